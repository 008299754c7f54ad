"""FlexiCache kernels: page scoring, sparse paged decode attention, promotion planning.

Installed as `fc_hf.kernels` (the repository folder is `kernels/`; see pyproject.toml).

| module | what it owns |
|---|---|
| `dispatch.py` | the decode step's primitives as the core calls them: the PyTorch backend, or a fused kernel (Triton on a GPU, C++ on a CPU) where one serves (`FLEXICACHE_BACKEND=torch|triton|native` forces one) |
| `triton_ops.py` | the Triton kernels of `page_scores`, `attention`, a decode token's writes, refinement's candidates, their logits with the keys read in place, refinement's choice (mass, top K, carried candidates), the attention over a ranking's own logits and a re-rank's window moves, registered as `torch.library` custom ops (`flexicache::page_scores`, `flexicache::attention`, `flexicache::append_token`, `flexicache::candidates`, `flexicache::page_logits`, `flexicache::choose`, `flexicache::chosen_attention`, `flexicache::move_windows`) with fake implementations; imported by `dispatch.py` on first use only (Triton is optional) |
| `native_ops.py` | the same fused ops in C++ for CPU tensors (`csrc/native_ops.cpp`, compiled on first use; `flexicache_cpu::<name>`), the CPU default; where they cannot be built the PyTorch backend serves |
| `contracts.py` | the fused ops' argument checks, shared by `triton_ops.py` and `native_ops.py` |
| `torch_backend.py` | the PyTorch implementation: the CPU path where the C++ kernels do not build, and the reference the fused kernels are tested against |
| `bruteforce.py` | literal-formula oracles for tests only (never called in production) |

The folder shares its name with Hugging Face's `kernels` package, which transformers >= 5.25 imports with every model
class. Installed, nothing of ours is a top-level `kernels`. In a checkout, wherever the repository root comes first on
`sys.path` (`python -c`, `python -m pytest`, a notebook beside it), `import kernels` reaches this file under the name
`kernels`: it then hands the name over to the next `kernels` package on `sys.path` (the installed one) and defines
nothing itself. Only when no other `kernels` package exists does it stay (transformers then finds no version on it and
treats `kernels` as not installed, as it would without this folder).
"""


def _installed_kernels():
    """The next regular `kernels` package or module on `sys.path` after this checkout's root, or None."""
    import importlib.machinery
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    others = [p for p in sys.path if not (isinstance(p, str) and os.path.abspath(p or os.curdir) == root)]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    if spec is None or spec.origin in (None, "namespace") or spec.loader is None:
        return None
    return spec


if __name__ == "kernels" and (_spec := _installed_kernels()) is not None:
    import importlib.util
    import sys

    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what `sys.modules` holds once this file has run
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        del sys.modules["kernels"]
        raise
else:
    from .dispatch import (append_token, attention, backend_for, chosen_attention, gather_pages, page_logits, page_mass,
                           page_scores, subpage_minmax)

    __all__ = ["append_token", "attention", "backend_for", "chosen_attention", "gather_pages", "page_logits",
               "page_mass", "page_scores", "subpage_minmax"]

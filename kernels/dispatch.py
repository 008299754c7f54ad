"""Choose the Triton kernel or the PyTorch backend for each call of the decode step.

On a CPU (and wherever Triton is not used) every call is the PyTorch backend (`torch_backend.py`). On CUDA with Triton
the calls that read pages go through Triton kernels registered as `torch.library` custom ops (`ops.py`), so a compiled
step keeps them as single nodes. `FLEXICACHE_BACKEND=torch|triton` (or `FlexiCacheConfig.backend`) forces either.
"""

from __future__ import annotations

import os

import torch

from . import torch_backend

_VALID = ("auto", "torch", "triton")


def backend_for(tensor: torch.Tensor, forced: str | None = None) -> str:
    """'triton' for CUDA tensors when Triton is importable, else 'torch'; `forced` or $FLEXICACHE_BACKEND override."""
    choice = forced or os.environ.get("FLEXICACHE_BACKEND", "auto")
    if choice not in _VALID:
        raise ValueError(f"FLEXICACHE_BACKEND must be one of {_VALID}, got {choice!r}")
    if choice == "auto":
        return "triton" if tensor.is_cuda and _triton_available() else "torch"
    return choice


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def page_scores(query, meta, bias, subpages, backend=None):
    """See `torch_backend.page_scores` (a matmul: cuBLAS on CUDA too)."""
    return torch_backend.page_scores(query, meta, bias, subpages)


def candidate_mass(query, keys, bias, scores, scaling, page_size, backend=None):
    """See `torch_backend.candidate_mass`."""
    return torch_backend.candidate_mass(query, keys, bias, scores, scaling, page_size)


def attention(query, keys, values, bias, scaling, softcap=None, backend=None):
    """See `torch_backend.attention`."""
    return torch_backend.attention(query, keys, values, bias, scaling, softcap)


def attention_from_logits(logits, values, backend=None):
    return torch_backend.attention_from_logits(logits, values)


def gather_pages(tier, index, backend=None):
    return torch_backend.gather_pages(tier, index)


def subpage_minmax(keys, sub, backend=None):
    return torch_backend.subpage_minmax(keys, sub)

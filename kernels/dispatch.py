"""Choose the fused kernels (Triton on a GPU, C++ on a CPU) or the PyTorch backend for each call of the decode step.

`backend_for` picks per call: "triton" for CUDA tensors where Triton imports, "native" for CPU tensors where the C++
kernels build (`native_ops.py`: compiled on first use, about 15 s once per machine; where they cannot be built it warns
once and the PyTorch backend serves), else "torch"; `FLEXICACHE_BACKEND=torch|triton|native` (or
`FlexiCacheConfig.backend`, passed here as `backend=`) forces one. The C++ kernels make the CPU step's calls the GPU
step's (1.16x dense's ops a layer-step against the PyTorch backend's 2.21x) and measured 3-5% faster on this machine's
CPU (docs/benchmarks.md). The Triton and native backends are the fused ones (`fused`): the same ops, one call each,
with the same contracts. On the Triton backend `page_scores`, `attention`, a decode token's writes (`append_token`),
refinement's candidates (`candidates`), their logits with the keys read in place (`page_logits`), refinement's choice
(`choose`: the mass, the top K, the carried candidates), the unstable rows' attention over that ranking's own logits
(`chosen_attention`) and a re-rank's window moves (`move_windows`) run Triton kernels registered as `torch.library`
custom ops (`flexicache::<name>`, in `triton_ops.py`, imported only on first use so Triton stays optional), each one
node of a compiled step; on the native backend the C++ kernels of the same names (`flexicache_cpu::<name>`). The other
primitives (`page_mass`, `gather_pages`, `subpage_minmax`) are the PyTorch backend (`torch_backend.py`) on both.
"""

from __future__ import annotations

import os

import torch

from . import torch_backend

_VALID = ("auto", "torch", "triton", "native")


def backend_for(tensor: torch.Tensor, forced: str | None = None) -> str:
    """'triton' for CUDA tensors when Triton is importable, 'native' for CPU tensors where the C++ kernels built, else
    'torch'; `forced` or $FLEXICACHE_BACKEND override ('native' on another device's tensors picks as 'auto')."""
    choice = forced or os.environ.get("FLEXICACHE_BACKEND", "auto")
    if choice not in _VALID:
        raise ValueError(f"FLEXICACHE_BACKEND must be one of {_VALID}, got {choice!r}")
    if choice == "native" and tensor.device.type != "cpu":  # C++ kernels serve CPU tensors; other devices as auto
        choice = "auto"
    if choice == "auto":
        if tensor.is_cuda:
            return "triton" if _triton_available() else "torch"
        choice = "native" if tensor.device.type == "cpu" else "torch"  # meta (accelerate's offload): the PyTorch path
    if choice == "native" and not _native_ops().available():  # not built (warned once, with why): serve anyway
        return "torch"
    return choice


def fused(tensor: torch.Tensor, forced: str | None = None) -> str | None:
    """The fused backend ('triton' or 'native') serving `tensor`'s call, or None where the PyTorch backend does."""
    backend = backend_for(tensor, forced)
    return None if backend == "torch" else backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_ops():
    """`triton_ops` (importing Triton and registering the custom ops on first use)."""
    from . import triton_ops

    return triton_ops


def _native_ops():
    from . import native_ops

    return native_ops


def _fused_ops(backend: str):
    """The module of the fused backend's ops: `triton_ops` or `native_ops` (same names, same contracts)."""
    return _triton_ops() if backend == "triton" else _native_ops()


def page_scores(query, meta, bias, subpages, backend=None):
    """See `torch_backend.page_scores`; on a fused backend `flexicache::page_scores` op."""
    if (which := fused(query, backend)) == "native":  # row blocks (views of the cache) read where they are
        return _native_ops().page_scores(query, meta, bias, subpages)
    if which:
        if not isinstance(meta, torch.Tensor):  # row blocks (views of the cache): the Triton kernel takes one tensor
            meta = torch.cat(meta) if len(meta) > 1 else meta[0]
        return _triton_ops().page_scores(query, meta, bias, subpages)
    return torch_backend.page_scores(query, meta, bias, subpages)


def candidates(scores, carried_pages, carried_scores, count, backend=None):
    """See `torch_backend.candidates`; on a fused backend `flexicache::candidates` op (one launch)."""
    if which := fused(scores, backend):
        if carried_pages is None:  # nothing carried: no place to raise
            carried_pages, carried_scores = scores.new_empty(scores.shape[0], 0, dtype=torch.long), scores[:, :0]
        return _fused_ops(which).candidates(scores, carried_pages, carried_scores, count)
    return torch_backend.candidates(scores, carried_pages, carried_scores, count)


def page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq, scaling, backend=None):
    """See `torch_backend.page_logits`; on a fused backend `flexicache::page_logits` op (one launch)."""
    args = (query, pages, rows, near, near_k, near_index, full_k, tokens, seq, scaling)
    if which := fused(query, backend):
        return _fused_ops(which).page_logits(*args)
    return torch_backend.page_logits(*args)


def page_mass(logits, scores, backend=None):
    return torch_backend.page_mass(logits, scores)


def choose(logits, scores, cand, page, k, carry, score, pages_out, scores_out, backend=None):
    """See `torch_backend.choose`; on a fused backend `flexicache::choose` op (one launch)."""
    args = (logits, scores, cand, page, k, carry, score, pages_out, scores_out)
    if which := fused(logits, backend):
        return _fused_ops(which).choose(*args)
    return torch_backend.choose(*args)


def attention(query, keys, values, bias, scaling, softcap=None, backend=None):
    """See `torch_backend.attention`; on a fused backend `flexicache::attention` op."""
    if which := fused(query, backend):
        return _fused_ops(which).attention(query, keys, values, bias, scaling, softcap)
    return torch_backend.attention(query, keys, values, bias, scaling, softcap)


def chosen_attention(logits, top, pages, starts, values, backend=None):
    """See `torch_backend.chosen_attention`; on a fused backend `flexicache::chosen_attention` op (one launch)."""
    if which := fused(values, backend):
        return _fused_ops(which).chosen_attention(logits, top, pages, starts, values)
    return torch_backend.chosen_attention(logits, top, pages, starts, values)


def gather_pages(tier, index, backend=None):
    return torch_backend.gather_pages(tier, index)


def append_token(keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift, stable_local,
                 near_k, near_v, near_place, subpage_len, backend=None):
    """See `torch_backend.append_token`; on a fused backend `flexicache::append_token` op (one launch)."""
    args = (keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift, stable_local,
            near_k, near_v, near_place, subpage_len)
    if which := fused(keys, backend):
        return _fused_ops(which).append_token(*args)
    return torch_backend.append_token(*args)


def move_windows(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base, win_bias_rows,
                 stable_batch, promoted, num_pages, k, count, backend=None):
    """See `torch_backend.move_windows`; on a fused backend `flexicache::move_windows` op (one launch)."""
    args = (pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base, win_bias_rows,
            stable_batch, promoted, num_pages, k, count)
    if which := fused(pages, backend):
        return _fused_ops(which).move_windows(*args)
    return torch_backend.move_windows(*args)


def subpage_minmax(keys, sub, backend=None):
    return torch_backend.subpage_minmax(keys, sub)

"""Choose the Triton kernel or the PyTorch backend for each call of the decode step.

`backend_for` picks per call: "triton" for CUDA tensors where Triton imports, else "torch"; `FLEXICACHE_BACKEND=
torch|triton` (or `FlexiCacheConfig.backend`, passed here as `backend=`) forces either. On the Triton backend
`page_scores`, `attention`, a decode token's writes (`append_token`), refinement's candidates (`candidates`), their
logits with the keys read in place (`page_logits`), refinement's choice (`choose`: the mass, the top K, the carried
candidates), the unstable rows' attention over that ranking's own logits (`chosen_attention`) and a re-rank's window
moves (`move_windows`) run Triton kernels registered as `torch.library` custom ops
(`flexicache::<name>`, in `triton_ops.py`, imported only on first use so Triton stays optional), each one node of a
compiled step. The other primitives (`page_mass`, `gather_pages`, `subpage_minmax`) are the
PyTorch backend (`torch_backend.py`) on both.
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


def _triton_ops():
    """`triton_ops` (importing Triton and registering the custom ops on first use)."""
    from . import triton_ops

    return triton_ops


def page_scores(query, meta, bias, subpages, backend=None):
    """See `torch_backend.page_scores`; on the Triton backend the `flexicache::page_scores` op."""
    if backend_for(query, backend) == "triton":
        if not isinstance(meta, torch.Tensor):  # row blocks (views of the cache): the kernel takes one tensor
            meta = torch.cat(meta) if len(meta) > 1 else meta[0]
        return _triton_ops().page_scores(query, meta, bias, subpages)
    return torch_backend.page_scores(query, meta, bias, subpages)


def candidates(scores, carried_pages, carried_scores, count, backend=None):
    """See `torch_backend.candidates`; on the Triton backend the `flexicache::candidates` op (one launch)."""
    if backend_for(scores, backend) == "triton":
        if carried_pages is None:  # nothing carried: no place to raise
            carried_pages, carried_scores = scores.new_empty(scores.shape[0], 0, dtype=torch.long), scores[:, :0]
        return _triton_ops().candidates(scores, carried_pages, carried_scores, count)
    return torch_backend.candidates(scores, carried_pages, carried_scores, count)


def page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq, scaling, backend=None):
    """See `torch_backend.page_logits`; on the Triton backend the `flexicache::page_logits` op (one launch)."""
    args = (query, pages, rows, near, near_k, near_index, full_k, tokens, seq, scaling)
    if backend_for(query, backend) == "triton":
        return _triton_ops().page_logits(*args)
    return torch_backend.page_logits(*args)


def page_mass(logits, scores, backend=None):
    return torch_backend.page_mass(logits, scores)


def choose(logits, scores, cand, page, k, carry, score, pages_out, scores_out, backend=None):
    """See `torch_backend.choose`; on the Triton backend the `flexicache::choose` op (one launch)."""
    args = (logits, scores, cand, page, k, carry, score, pages_out, scores_out)
    if backend_for(logits, backend) == "triton":
        return _triton_ops().choose(*args)
    return torch_backend.choose(*args)


def attention(query, keys, values, bias, scaling, softcap=None, backend=None):
    """See `torch_backend.attention`; on the Triton backend the `flexicache::attention` op."""
    if backend_for(query, backend) == "triton":
        return _triton_ops().attention(query, keys, values, bias, scaling, softcap)
    return torch_backend.attention(query, keys, values, bias, scaling, softcap)


def chosen_attention(logits, top, pages, starts, values, backend=None):
    """See `torch_backend.chosen_attention`; on the Triton backend the `flexicache::chosen_attention` op (one launch)."""
    if backend_for(values, backend) == "triton":
        return _triton_ops().chosen_attention(logits, top, pages, starts, values)
    return torch_backend.chosen_attention(logits, top, pages, starts, values)


def gather_pages(tier, index, backend=None):
    return torch_backend.gather_pages(tier, index)


def append_token(keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift, stable_local,
                 near_k, near_v, near_place, subpage_len, backend=None):
    """See `torch_backend.append_token`; on the Triton backend the `flexicache::append_token` op (one launch)."""
    args = (keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift, stable_local,
            near_k, near_v, near_place, subpage_len)
    if backend_for(keys, backend) == "triton":
        return _triton_ops().append_token(*args)
    return torch_backend.append_token(*args)


def move_windows(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base, win_bias_rows,
                 stable_batch, promoted, num_pages, k, count, backend=None):
    """See `torch_backend.move_windows`; on the Triton backend the `flexicache::move_windows` op (one launch)."""
    args = (pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base, win_bias_rows,
            stable_batch, promoted, num_pages, k, count)
    if backend_for(pages, backend) == "triton":
        return _triton_ops().move_windows(*args)
    return torch_backend.move_windows(*args)


def subpage_minmax(keys, sub, backend=None):
    return torch_backend.subpage_minmax(keys, sub)

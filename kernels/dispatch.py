"""Choose the Triton kernel or the PyTorch backend for each call."""

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


def score_pages(query, meta, num_pages, page_valid=None, backend=None, subpages=1, sink_pages=0):
    """Quest bound of every page, max over the group and its `subpages` MinMax entries; the last page and (without
    `page_valid`) the first `sink_pages` pages at +inf. One launch on Triton."""
    if backend_for(query, backend) == "triton":
        from .score import score_pages_triton

        return score_pages_triton(query, meta, num_pages, page_valid, subpages, sink_pages)
    return torch_backend.score_pages(query, meta, num_pages, page_valid, subpages, sink_pages)


def append_token(keys, values, heads, slots, k_pool, v_pool, offset, backend=None):
    """One decode token per row into the pools; see `torch_backend.append_token`."""
    if backend_for(keys, backend) == "triton":
        from .append import append_token_triton

        return append_token_triton(keys, values, heads, slots, k_pool, v_pool, offset)
    return torch_backend.append_token(keys, values, heads, slots, k_pool, v_pool, offset)


def force_sink_pages(scores, sink_pages, page_valid=None, backend=None):
    # One scatter on the scores; the same torch code on every backend.
    return torch_backend.force_sink_pages(scores, sink_pages, page_valid)


def select_topk(scores, k, backend=None):
    # torch.topk is used on every backend (see the kernels issue notes for its measured cost).
    return torch_backend.select_topk(scores, k)


def sparse_decode_attention(
    query, k_pool, v_pool, slots, page_idx, seq_len, scaling, token_valid=None, rows_per_batch=1, softcap=None,
    backend=None, workspace=None, in_range=False, logits=None, out=None, table=None, row_kv=None,
):
    """Sparse paged decode attention; `workspace` (a `GatherWorkspace`) is used by the PyTorch backend only.

    `in_range` (every page index is a page of the sequence) lets the PyTorch backend mask with one table lookup; the
    Triton kernel masks in-kernel anyway. `logits` (the ranking's own logits of these pages) is for the PyTorch
    backend: it reads only the values. `out` (`[N, G, Dv]`, the query's dtype), if given, receives the result on either
    backend. `table` (the block table) stands in for `slots` when they are None: the Triton kernel looks each page's
    slot up itself. `row_kv` (the pages' K/V laid out per row, `SlotPool.row_view`) is for the PyTorch backend:
    nothing is gathered.
    """
    if logits is None and row_kv is None and backend_for(query, backend) == "triton":
        from .decode import sparse_decode_attention_triton

        return sparse_decode_attention_triton(
            query, k_pool, v_pool, slots, page_idx, seq_len, scaling, token_valid, rows_per_batch, softcap, out=out,
            table=table,
        )
    return torch_backend.sparse_decode_attention(
        query, k_pool, v_pool, slots, page_idx, seq_len, scaling, token_valid, rows_per_batch, softcap, workspace,
        in_range, logits, out, table, row_kv,
    )


def candidate_mass(query, k_pool, slots, pages, seq_len, scaling, forced, token_valid=None, rows_per_batch=1,
                   backend=None, table=None):
    """Exact attention mass of candidate pages (refinement's ranking key); see `torch_backend.candidate_mass`."""
    if backend_for(query, backend) == "triton":
        from .refine import candidate_mass_triton

        return candidate_mass_triton(query, k_pool, slots, pages, seq_len, scaling, forced, token_valid, rows_per_batch,
                                     table)
    return torch_backend.candidate_mass(query, k_pool, slots, pages, seq_len, scaling, forced, token_valid,
                                        rows_per_batch, table)


def promotion_plan(old_pages, old_slots, new_pages, backend=None):
    return torch_backend.promotion_plan(old_pages, old_slots, new_pages)

"""Input checks shared by the Triton launchers (`decode.py`, `refine.py`, `append.py`, `score.py`).

A kernel reads raw pointers: a wrong shape or dtype would read garbage instead of failing, so each
launcher checks its tensors first and raises with what it expected.
"""

from __future__ import annotations

import torch

# What the Triton kernels accept; the PyTorch backend takes any float dtype.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_page_lists(rows: int, slots: torch.Tensor, pages: torch.Tensor, by_page: bool,
                     token_valid: torch.Tensor | None, rows_per_batch: int) -> None:
    """The per-row page lists a kernel walks: `pages [N, M]` with `slots [N, M]` (one slot per entry) or, with
    `by_page`, the block table `[N, Pcap]` as `slots`; the padding mask `token_valid [B, L]` with `rows_per_batch`."""
    if by_page:
        if slots.dim() != 2 or slots.shape[0] != rows or pages.dim() != 2 or pages.shape[0] != rows:
            raise ValueError(f"table must be [N={rows}, Pcap] and the page list [N, M], got {tuple(slots.shape)}/"
                             f"{tuple(pages.shape)}")
    elif slots.shape != pages.shape or slots.dim() != 2 or slots.shape[0] != rows:
        raise ValueError(f"slots and the page list must both be [N={rows}, M], got {tuple(slots.shape)}/"
                         f"{tuple(pages.shape)}")
    if slots.dtype not in INDEX_DTYPES or pages.dtype not in INDEX_DTYPES:
        raise TypeError("slots (or the table) and the page list must be int32 or int64")
    if rows_per_batch < 1:
        raise ValueError("rows_per_batch must be >= 1")
    if token_valid is not None:
        if token_valid.dtype != torch.bool or token_valid.dim() != 2:
            raise ValueError("token_valid must be a bool [B, L] tensor")
        if token_valid.shape[0] * rows_per_batch < rows:
            raise ValueError(f"token_valid has {token_valid.shape[0]} rows, need {-(-rows // rows_per_batch)}")

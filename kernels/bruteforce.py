"""Brute-force oracles for tests: the literal formulas, in float64 where it matters, no shortcuts.

Nothing in production calls these. The PyTorch backend (`torch_backend.py`) and the Triton kernels
are checked against them.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def score_pages_bruteforce(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The literal formula `sum_i max(q_i*kmin_i, q_i*kmax_i)`, max over the group. `[N,G,D]`,`[N,Np,D]` -> `[N,Np]`.

    No forcing, no masking: for tests only.
    """
    q = query.float()[:, :, None, :]  # [N, G, 1, D]
    lo = q * kmin.float()[:, None]
    hi = q * kmax.float()[:, None]
    return torch.maximum(lo, hi).sum(-1).amax(dim=1)


def dense_attention_bruteforce(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Dense attention over `[N, L, D]` keys with a `[N, L]` boolean mask; for tests. Returns `[N, G, D]` (fp32)."""
    logits = torch.einsum("ngd,nld->ngl", query.double(), keys.double()) * scaling
    logits = logits.masked_fill(~allowed[:, None, :], NEG_INF)
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.einsum("ngl,nld->ngd", probs, values.double()).float()


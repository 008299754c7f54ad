"""Head-stability metrics over top-K page traces (SPEC §2 "Head profile"), shared by the core and the profiler.

`FlexiCache(..., profile="auto")` classifies online with these (`fc_hf/online.py`); the offline profiler
(`fc_hf.profiler.metrics`) re-exports them. A trace is `topk[D, L, H, K]`, the K pages each (layer, KV head) selects
at each of D decode steps (entries < 0: padding), with `num_pages[D]`, the pages that existed at each step.

    RCO(s, t) = max(0, (|S_s ∩ S_t| / K - K / N_t) / (1 - K / N_t)),   N_t = num_pages[t]

TS(s) = mean of RCO(s, t) over t = s+1 .. s+W-1; windows start at s = 0, W, 2W, ... and only full windows count, as
in the authors' computation. Pairs with N_t <= K (everything selected: RCO is 0/0) are left out of a window's mean; a
window with none defined has TS = NaN, which the classification ignores (this only happens in tests and toy runs).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

__all__ = ["temporal_stability", "rco_by_offset", "num_unstable_heads", "count_unstable", "select_unstable"]


def _check_trace(topk: torch.Tensor, num_pages: torch.Tensor) -> None:
    if topk.dim() != 4:
        raise ValueError(f"topk must have shape [D, L, H, K], got {tuple(topk.shape)}")
    if num_pages.dim() != 1 or num_pages.shape[0] != topk.shape[0]:
        raise ValueError(f"num_pages must have shape [D={topk.shape[0]}], got {tuple(num_pages.shape)}")


def _intersection_size(a: torch.Tensor, b_sorted: torch.Tensor) -> torch.Tensor:
    """|A ∩ B| row by row. `a`, `b_sorted`: `[..., K]` page sets (b sorted ascending), negatives = padding."""
    a = a.masked_fill(a < 0, -1).contiguous()
    b = b_sorted.masked_fill(b_sorted < 0, -2)  # padding sorts first and stays first; never equals A's -1
    pos = torch.searchsorted(b, a).clamp(max=b.shape[-1] - 1)
    return (b.gather(-1, pos) == a).sum(-1)


def _rco(inter: torch.Tensor, k: int, n_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RCO from intersection sizes `inter[...]` and pages-at-t `n_t` (broadcastable). Returns (rco, defined)."""
    n_t = n_t.to(torch.float64)
    defined = n_t > k
    chance = torch.where(defined, k / n_t.clamp(min=1), torch.zeros_like(n_t))
    rco = ((inter.to(torch.float64) / k - chance) / (1 - chance)).clamp(min=0)
    defined = defined.expand_as(rco)
    return torch.where(defined, rco, torch.zeros_like(rco)), defined


def temporal_stability(topk: torch.Tensor, num_pages: torch.Tensor, window: int = 16) -> torch.Tensor:
    """Temporal stability TS `[D // W, L, H]` of every (layer, KV head) in every full window of W steps of a trace
    (`topk [D, L, H, K]`, `num_pages [D]`; module docstring); NaN where a window has no defined pair. Vectorised over
    windows, offsets, layers and heads (intersections by sorted search, no dense page masks).

    Example:
        >>> topk = torch.arange(4).expand(33, 2, 3, 4)        # heads never change
        >>> temporal_stability(topk, torch.full((33,), 40)).shape   # steps 32.. form no full window
        torch.Size([2, 2, 3])
    """
    _check_trace(topk, num_pages)
    if window < 2:
        raise ValueError(f"window must be >= 2 (a window compares its first step with later ones), got {window}")
    d, layers, heads, k = topk.shape
    starts = torch.arange(0, max(d - window + 1, 0), window)  # full windows only
    if starts.numel() == 0:
        return torch.empty(0, layers, heads)
    steps = starts[:, None] + torch.arange(1, window)  # [nw, W-1], all < D
    topk_sorted, _ = topk.sort(dim=-1)
    a = topk[starts][:, None].expand(-1, window - 1, -1, -1, -1)  # [nw, W-1, L, H, K]
    inter = _intersection_size(a, topk_sorted[steps])  # [nw, W-1, L, H]
    rco, defined = _rco(inter, k, num_pages[steps][..., None, None])
    rco = torch.where(defined, rco, torch.zeros_like(rco))
    return (rco.sum(1) / defined.sum(1)).float()  # 0/0 -> NaN for undefined windows


def rco_by_offset(topk: torch.Tensor, num_pages: torch.Tensor, max_offset: int = 32) -> torch.Tensor:
    """Mean RCO(s, s + o) over all s, `[max_offset, L, H]` (row o - 1: offset o; NaN where no pair is defined): how
    fast each head's top-K set decays (paper Fig. 1)."""
    _check_trace(topk, num_pages)
    d, layers, heads, k = topk.shape
    topk_sorted, _ = topk.sort(dim=-1)
    out = torch.full((max_offset, layers, heads), float("nan"))
    for o in range(1, min(max_offset, d - 1) + 1):  # a loop over offsets only; each is vectorised
        inter = _intersection_size(topk[: d - o], topk_sorted[o:])  # [D-o, L, H]
        rco, defined = _rco(inter, k, num_pages[o:][:, None, None])
        out[o - 1] = (rco.sum(0) / defined.sum(0)).float()
    return out


def num_unstable_heads(num_heads: int, unstable_fraction: float) -> int:
    """How many heads `unstable_fraction` of `num_heads` is (round half up: 25% of 90 -> 23)."""
    return min(num_heads, int(math.floor(unstable_fraction * num_heads + 0.5)))


def count_unstable(ts_list: Iterable[torch.Tensor], unstable_fraction: float = 0.25):
    """Per-head tallies of the classification over the TS `[num_windows, L, H]` of each sample: `counts` (`[L, H]`,
    windows in which the head was among the `unstable_fraction` of lowest TS), `windows` (ranked), `ts_sum` and `ts_n`
    (sum and number of its defined TS values) and `n_unstable` (heads unstable per window)."""
    ts_list = [torch.as_tensor(t) for t in ts_list]
    if not ts_list:
        raise ValueError("count_unstable needs at least one TS tensor")
    shape = ts_list[0].shape[1:]
    if any(t.dim() != 3 or t.shape[1:] != shape for t in ts_list):
        raise ValueError(f"every TS tensor must be [num_windows, L, H] with the same L, H; got {[tuple(t.shape) for t in ts_list]}")
    layers, heads = shape
    flat = torch.cat([t.reshape(t.shape[0], -1).double() for t in ts_list])  # [windows, L*H]
    flat = flat[~torch.isnan(flat).all(dim=1)]  # windows with nothing defined carry no ranking
    n = num_unstable_heads(layers * heads, unstable_fraction)
    counts = torch.zeros(layers * heads, dtype=torch.int64)
    if flat.shape[0] and n:
        # NaN sorts last (never unstable); a stable sort breaks TS ties by head index.
        order = torch.sort(torch.nan_to_num(flat, nan=float("inf")), dim=1, stable=True).indices[:, :n]
        counts.scatter_add_(0, order.reshape(-1), torch.ones(order.numel(), dtype=torch.int64))
    defined = ~torch.isnan(flat)
    return {
        "counts": counts.view(layers, heads),
        "windows": int(flat.shape[0]),
        "ts_sum": torch.where(defined, flat, 0.0).sum(0).view(layers, heads),
        "ts_n": defined.sum(0).view(layers, heads),
        "n_unstable": n,
    }


def select_unstable(counts: torch.Tensor, mean_ts: torch.Tensor, n_unstable: int) -> set[tuple[int, int]]:
    """The `n_unstable` heads most often unstable (`counts [L, H]`); ties by lower mean TS (`mean_ts [L, H]`, NaN as
    most stable), then (layer, head)."""
    layers, heads = counts.shape
    c = counts.reshape(-1).tolist()
    m = torch.nan_to_num(mean_ts.reshape(-1).double(), nan=float("inf")).tolist()
    order = sorted(range(layers * heads), key=lambda i: (-c[i], m[i], i))
    return {(i // heads, i % heads) for i in order[:n_unstable]}

"""Head-stability metrics of the profiler: cross-task overlap and held-out recall of unstable sets.

The trace metrics (RCO, temporal stability) and the classification's tallies live in the core module
`fc_hf.stability`, which FlexiCache's online classification (`profile="auto"`) uses too; they are
re-exported here, so the offline profile and the online one come from one implementation.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from fc_hf.stability import count_unstable, num_unstable_heads, rco_by_offset, select_unstable, temporal_stability

__all__ = [
    "temporal_stability",
    "classify_heads",
    "count_unstable",
    "select_unstable",
    "num_unstable_heads",
    "overlap_matrix",
    "mean_overlap",
    "heldout_recall",
    "rco_by_offset",
]


def classify_heads(ts_list: Sequence[torch.Tensor], unstable_fraction: float = 0.25) -> set[tuple[int, int]]:
    """The model's unstable KV heads from the TS of many samples (SPEC §2).

    In each window the `unstable_fraction` of heads with the lowest TS are unstable for that window
    (TS ties by head index); the result is the same number of heads, those unstable in the most
    windows over all samples, ties broken by lower mean TS and then by (layer, head).

    Args:
        ts_list (sequence of `torch.Tensor` of shape `[num_windows, L, H]`): `temporal_stability` of each sample.
        unstable_fraction (`float`, *optional*, defaults to 0.25): share of heads marked unstable.

    Returns:
        `set[tuple[int, int]]` of (layer, kv_head).
    """
    tally = count_unstable(ts_list, unstable_fraction)
    mean_ts = tally["ts_sum"] / tally["ts_n"]
    return select_unstable(tally["counts"], mean_ts, tally["n_unstable"])


def overlap_matrix(sets: Sequence[Iterable[tuple[int, int]]]) -> torch.Tensor:
    """Pairwise overlap `|A_i ∩ A_j| / |A|` of unstable sets (the paper's Table 1).

    |A| is the larger of the two sizes (all sets have the same size when made with one fraction).

    Returns:
        `torch.FloatTensor` of shape `[T, T]` with ones on the diagonal.
    """
    sets = [set(map(tuple, s)) for s in sets]
    t = len(sets)
    out = torch.ones(t, t)
    for i in range(t):
        for j in range(t):
            size = max(len(sets[i]), len(sets[j]))
            out[i, j] = len(sets[i] & sets[j]) / size if size else 1.0
    return out


def mean_overlap(matrix: torch.Tensor) -> float:
    """Mean of the off-diagonal entries of an overlap matrix (NaN for a single task)."""
    t = matrix.shape[0]
    if t < 2:
        return float("nan")
    off = ~torch.eye(t, dtype=torch.bool)
    return float(matrix[off].mean())


def heldout_recall(ts_list: Sequence[torch.Tensor], unstable_fraction: float = 0.25, seed: int = 0) -> dict:
    """How well a set found on half of the windows predicts the other half.

    The windows of all samples are pooled and split at random into a fitting half and a held-out
    half. The unstable set is classified on the fitting half (`classify_heads`) and compared with

    - `set_recall`: the set classified the same way on the held-out half, `|A_fit ∩ A_held| / |A_held|`;
    - `window_recall`: per held-out window, the share of that window's lowest-TS heads inside `A_fit`,
      averaged (window-level noise makes this lower than `set_recall`);
    - `chance`: what a random set of the same size would score on either (n_unstable / heads).

    Args:
        ts_list (sequence of `torch.Tensor` of shape `[num_windows, L, H]`): TS per sample.
        unstable_fraction (`float`, *optional*, defaults to 0.25): share of heads marked unstable.
        seed (`int`, *optional*, defaults to 0): seed of the split.

    Returns:
        `dict` with `set_recall`, `window_recall`, `chance` (floats), `windows_fit`, `windows_heldout` (ints).
    """
    flat = torch.cat([torch.as_tensor(t).float() for t in ts_list])
    flat = flat[~torch.isnan(flat.reshape(flat.shape[0], -1)).all(dim=1)]
    w, layers, heads = flat.shape
    if w < 2:
        raise ValueError(f"heldout_recall needs at least 2 windows with defined TS, got {w}")
    perm = torch.randperm(w, generator=torch.Generator().manual_seed(seed))
    fit, held = flat[perm[: w // 2]], flat[perm[w // 2 :]]
    a_fit = classify_heads([fit], unstable_fraction)
    a_held = classify_heads([held], unstable_fraction)
    n = num_unstable_heads(layers * heads, unstable_fraction)
    fit_mask = torch.zeros(layers * heads, dtype=torch.bool)
    for l, h in a_fit:
        fit_mask[l * heads + h] = True
    order = torch.sort(torch.nan_to_num(held.reshape(held.shape[0], -1), nan=float("inf")), dim=1, stable=True).indices[:, :n]
    window_recall = fit_mask[order].float().mean().item() if n else float("nan")
    return {
        "set_recall": len(a_fit & a_held) / len(a_held) if a_held else float("nan"),
        "window_recall": window_recall,
        "chance": n / (layers * heads),
        "windows_fit": int(fit.shape[0]),
        "windows_heldout": int(held.shape[0]),
    }

"""PNG plots of a profile run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rco_by_offset(rco: torch.Tensor, layer: int, unstable: set, path, title: str = "") -> Path:
    """RCO against step offset for every KV head of one layer (the paper's Fig. 1).

    Args:
        rco (`torch.Tensor` of shape `[O, L, H]`): `rco_by_offset`, row o-1 = offset o.
        layer (`int`): the layer to draw.
        unstable (`set`): (layer, head) pairs drawn dashed.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    offsets = torch.arange(1, rco.shape[0] + 1)
    for h in range(rco.shape[2]):
        bad = (layer, h) in unstable
        ax.plot(offsets.numpy(), rco[:, layer, h].float().numpy(), ls="--" if bad else "-", marker="." if bad else None,
                label=f"KV head {h}" + (" (unstable)" if bad else ""))
    ax.set_xlabel("step offset t - s")
    ax.set_ylabel("random-corrected overlap RCO(s, t)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or f"Top-K page overlap decay, layer {layer}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_overlap(matrix: torch.Tensor, tasks: Sequence[str], path, title: str = "") -> Path:
    """Heatmap of the cross-task overlap `|A_i ∩ A_j| / |A|` of unstable sets (`[T, T]`)."""
    plt = _plt()
    t = len(tasks)
    fig, ax = plt.subplots(figsize=(1.2 * t + 2.5, 1.0 * t + 2))
    matrix = torch.as_tensor(matrix).float()
    im = ax.imshow(matrix.numpy(), vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(t), tasks, rotation=30, ha="right")
    ax.set_yticks(range(t), tasks)
    for i in range(t):
        for j in range(t):
            ax.text(j, i, f"{float(matrix[i, j]):.2f}", ha="center", va="center",
                    color="black" if matrix[i, j] > 0.6 else "white", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    off = matrix[~torch.eye(t, dtype=torch.bool)]
    mean = f" (mean {float(off.mean()):.2f})" if t > 1 else ""
    ax.set_title(title or f"Cross-task overlap of unstable sets{mean}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_ts_by_layer(ts: Mapping[str, Sequence[torch.Tensor]], unstable: set, path, title: str = "") -> Path:
    """Per-layer distribution of window TS (all heads, windows, samples) with each head's mean marked.

    Args:
        ts (`dict[str, list[torch.Tensor]]`): task -> TS tensors `[num_windows, L, H]`.
        unstable (`set`): (layer, head) pairs whose means are drawn in red.
    """
    plt = _plt()
    pooled = torch.cat([x for xs in ts.values() for x in xs])  # [W, L, H]
    layers, heads = pooled.shape[1:]
    data = []
    for l in range(layers):
        v = pooled[:, l].reshape(-1)
        data.append(v[~torch.isnan(v)].numpy())
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * layers + 2), 4))
    ax.boxplot(data, positions=range(layers), widths=0.6, showfliers=False)
    means = pooled.nanmean(0)
    for l in range(layers):
        for h in range(heads):
            bad = (l, h) in unstable
            ax.plot(l, float(means[l, h]), "o" if bad else ".", color="tab:red" if bad else "tab:blue", ms=4 if bad else 3)
    ax.set_xlabel("layer")
    ax.set_ylabel("temporal stability TS (window)")
    ticks = list(range(0, layers, max(1, layers // 15)))
    ax.set_xticks(ticks, [str(t) for t in ticks])  # boxplot labels boxes 1..n by default
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "Temporal stability per layer\nboxes: windows x heads; dots: head means (red = unstable)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)

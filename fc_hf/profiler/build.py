"""From traces to a `HeadProfile`: per-task sets, cross-task overlap, held-out recall, leave-task-out variants."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from fc_hf.profile import HeadProfile

from .metrics import (
    classify_heads,
    count_unstable,
    heldout_recall,
    mean_overlap,
    num_unstable_heads,
    overlap_matrix,
    rco_by_offset,
    select_unstable,
    temporal_stability,
)
from .trace import Trace

RCO_MAX_OFFSET = 32
# Fields of a full profile that describe all its tasks together; a leave-task-out profile drops them.
STALE_WITHOUT_TASKS = ("overlap", "heldout_recall", "mean_ts", "unstable_counts", "windows", "sample_overlap",
                       "mean_ts_spearman", "rco_by_offset", "plot_layer")


def _nested(t: torch.Tensor, digits: int | None = None) -> list:
    t = t.detach().cpu()
    if digits is None:
        return t.tolist()
    return [[None if x != x else round(x, digits) for x in row] for row in t.double().tolist()]


def _pairs(s: Iterable[tuple[int, int]]) -> list[list[int]]:
    return [list(p) for p in sorted(s)]


def _tally_json(tally: dict) -> dict:
    return {
        "windows": tally["windows"],
        "unstable_counts": _nested(tally["counts"]),
        "ts_sum": _nested(tally["ts_sum"]),  # full precision: rebuilt sets must break ties as classify_heads does
        "ts_n": _nested(tally["ts_n"]),
    }


def _set_from_tallies(tallies: Sequence[Mapping], n_unstable: int) -> set[tuple[int, int]]:
    """Unstable set from summed per-task tallies (identical to `classify_heads` on the pooled windows)."""
    counts = sum(torch.tensor(t["unstable_counts"], dtype=torch.int64) for t in tallies)
    ts_sum = sum(torch.tensor(t["ts_sum"], dtype=torch.float64) for t in tallies)
    ts_n = sum(torch.tensor(t["ts_n"], dtype=torch.float64) for t in tallies)
    return select_unstable(counts, ts_sum / ts_n, n_unstable)


def analyse(traces: Mapping[str, Sequence[Trace]], window: int = 16, unstable_fraction: float = 0.25, seed: int = 0) -> dict:
    """Everything a profile records, from traces grouped by task.

    Args:
        traces (`dict[str, list[Trace]]`): task name -> its samples' traces.
        window (`int`, *optional*, defaults to 16): W.
        unstable_fraction (`float`, *optional*, defaults to 0.25): share of heads marked unstable.
        seed (`int`, *optional*, defaults to 0): held-out split seed.

    Returns:
        `dict` with `unstable` (set), `n_unstable`, `tasks` (per-task tallies and sets), `ts` (task -> list
        of `[num_windows, L, H]`), `mean_ts` (`[L, H]`), `overlap` (`[T, T]`), `mean_overlap`, `heldout`,
        `rco` (`[RCO_MAX_OFFSET, L, H]`, mean over all samples).
    """
    if not traces:
        raise ValueError("analyse needs traces of at least one task")
    ts = {task: [temporal_stability(t.topk, t.num_pages, window) for t in samples] for task, samples in traces.items()}
    all_ts = [x for xs in ts.values() for x in xs]
    layers, heads = all_ts[0].shape[1:]
    n = num_unstable_heads(layers * heads, unstable_fraction)
    tasks = {}
    for task, xs in ts.items():
        tally = count_unstable(xs, unstable_fraction)
        entry = _tally_json(tally)
        entry["samples"] = len(xs)
        entry["unstable"] = select_unstable(tally["counts"], tally["ts_sum"] / tally["ts_n"], n)
        tasks[task] = entry
    total = count_unstable(all_ts, unstable_fraction)
    unstable = select_unstable(total["counts"], total["ts_sum"] / total["ts_n"], n)  # == classify_heads(all_ts)
    names = list(tasks)
    overlap = overlap_matrix([tasks[t]["unstable"] for t in names])
    # Is stability a head property? Compare per-sample sets within vs across tasks, and rank-correlate
    # per-head mean TS between tasks; a random set of the same size overlaps by n / heads on average.
    sample_sets = [(task, classify_heads([x], unstable_fraction)) for task, xs in ts.items() for x in xs]
    within, across = [], []
    for i in range(len(sample_sets)):
        for j in range(i + 1, len(sample_sets)):
            o = len(sample_sets[i][1] & sample_sets[j][1]) / max(n, 1)
            (within if sample_sets[i][0] == sample_sets[j][0] else across).append(o)
    task_means = torch.stack([(t["ts_sum"] / t["ts_n"]).reshape(-1) for t in
                              (count_unstable(xs, unstable_fraction) for xs in ts.values())])
    spearman = _spearman(task_means)
    rcos = [rco_by_offset(t.topk, t.num_pages, RCO_MAX_OFFSET) for samples in traces.values() for t in samples]
    return {
        "unstable": unstable,
        "n_unstable": n,
        "tasks": tasks,
        "ts": ts,
        "mean_ts": (total["ts_sum"] / total["ts_n"]).float(),
        "counts": total["counts"],
        "windows": total["windows"],
        "overlap_tasks": names,
        "overlap": overlap,
        "mean_overlap": mean_overlap(overlap),
        "heldout": heldout_recall(all_ts, unstable_fraction, seed) if total["windows"] >= 2 else None,
        "rco": torch.stack(rcos).nanmean(0),
        "chance_overlap": n / (layers * heads),
        "sample_overlap": {"within_task": sum(within) / len(within) if within else None,
                           "across_tasks": sum(across) / len(across) if across else None,
                           "pairs_within": len(within), "pairs_across": len(across)},
        "ts_spearman": spearman,
    }


def _spearman(rows: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation between the rows of `[T, M]` (average ranks are not needed: TS ties are rare)."""
    ranks = rows.double().argsort(dim=1).argsort(dim=1).double()
    ranks = ranks - ranks.mean(dim=1, keepdim=True)
    ranks = ranks / ranks.norm(dim=1, keepdim=True)
    return (ranks @ ranks.T).float()


def make_profile(config, analysis: dict, settings: dict, model_id: str | None = None, revision: str | None = None) -> HeadProfile:
    """A `HeadProfile` for `config` from `analyse`'s output; `settings` (page size, budget, command, ...) go to `extra`."""
    tasks = {}
    for name, entry in analysis["tasks"].items():
        tasks[name] = {k: v for k, v in entry.items() if k != "unstable"}
        tasks[name]["unstable"] = _pairs(entry["unstable"])
    extra = dict(settings)
    extra.update({
        "n_unstable": analysis["n_unstable"],
        "windows": analysis["windows"],
        "samples": {name: entry["samples"] for name, entry in analysis["tasks"].items()},
        "mean_ts": _nested(analysis["mean_ts"], 4),
        "unstable_counts": _nested(analysis["counts"]),
        "tasks": tasks,
        # plain task -> [[layer, head], ...] view of the per-task sets, for tools that re-vote without a task
        "per_task_unstable": {name: entry["unstable"] for name, entry in tasks.items()},
        "overlap": {
            "tasks": analysis["overlap_tasks"],
            "matrix": _nested(analysis["overlap"], 4),
            "mean": round(analysis["mean_overlap"], 4) if analysis["mean_overlap"] == analysis["mean_overlap"] else None,
            "chance": round(analysis["chance_overlap"], 4),
        },
        "sample_overlap": analysis["sample_overlap"],
        "mean_ts_spearman": {"tasks": analysis["overlap_tasks"], "matrix": _nested(analysis["ts_spearman"], 4),
                             "mean": round(mean_overlap(analysis["ts_spearman"]), 4) if len(analysis["overlap_tasks"]) > 1 else None},
        "heldout_recall": analysis["heldout"],
        "rco_by_offset": {"offsets": list(range(1, analysis["rco"].shape[0] + 1)),
                          "mean_over_samples": [_nested(r, 4) for r in analysis["rco"]]},
    })
    return HeadProfile.from_unstable(config, analysis["unstable"], model_id=model_id, revision=revision, extra=extra)


def profile_excluding(profile: HeadProfile, exclude: Iterable[str]) -> HeadProfile:
    """The profile `profile` would have been without the tasks in `exclude` (no leakage into their evaluation).

    Rebuilt exactly from the per-task tallies stored in `profile.extra["tasks"]`: the unstable set is
    what `classify_heads` gives on the remaining tasks' windows.

    Raises:
        `ValueError` if a task is unknown or nothing would remain.
    """
    exclude = set(exclude)
    per_task = profile.extra.get("tasks") or {}
    unknown = exclude - set(per_task)
    if unknown:
        raise ValueError(f"profile has no task(s) {sorted(unknown)}; it has {sorted(per_task)}")
    keep = {name: entry for name, entry in per_task.items() if name not in exclude}
    if not keep:
        raise ValueError("excluding every task leaves nothing to build a profile from")
    n = profile.extra.get("n_unstable", len(profile.unstable))
    unstable = _set_from_tallies(list(keep.values()), n)
    extra = {k: v for k, v in profile.extra.items() if k not in STALE_WITHOUT_TASKS}
    extra["tasks"] = keep
    extra["per_task_unstable"] = {name: entry["unstable"] for name, entry in keep.items()}
    extra["samples"] = {name: entry.get("samples") for name, entry in keep.items()}
    extra["derived_from"] = {"excluded_tasks": sorted(exclude), "full_profile_tasks": sorted(per_task)}
    names = list(keep)
    matrix = overlap_matrix([set(map(tuple, keep[t]["unstable"])) for t in names])
    extra["overlap"] = {"tasks": names, "matrix": _nested(matrix, 4),
                        "mean": round(mean_overlap(matrix), 4) if len(names) > 1 else None}
    return HeadProfile(profile.num_layers, profile.num_kv_heads, unstable, head_dim=profile.head_dim,
                       model_id=profile.model_id, revision=profile.revision, extra=extra)

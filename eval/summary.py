"""Summaries of a results tree: Markdown retention and fidelity tables, and plots.

Retention of a task = method score / dense score on the same samples. A task on which dense scores
below `MIN_DENSE_SCORE` says nothing about retention (a ratio of a few lucky hits): its scores are
shown, its retention is "n/a" and it is left out of the average.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

__all__ = ["collect", "retention", "retention_table", "ablation_table", "fidelity_table", "plot_retention", "plot_agreement", "write_summary"]


def collect(out: str | Path) -> list[dict[str, Any]]:
    """Every run's metrics.json under `out` (each carries its config), with its folder as "path"."""
    rows = []
    for f in sorted(Path(out).rglob("metrics.json")):
        row = json.loads(f.read_text())
        row["path"] = str(f.parent)
        rows.append(row)
    return rows


def _label(row) -> str:
    label = "dense" if row["method"] == "dense" else f"{row['method']}@{row['budget']}"
    options = row.get("cache_options") or {}
    return label + "".join(f" {k}={':'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in sorted(options.items()))


def _order(label: str) -> tuple:
    from .methods import METHODS

    method, _, rest = label.partition("@")
    budget, _, options = rest.partition(" ")
    return (METHODS.index(method) if method in METHODS else 99, int(budget or 0), options)


MIN_DENSE_SCORE = 0.5


def retention(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """{run label: {setting: score / dense score}} for one bench and model (None where dense is missing or
    below `MIN_DENSE_SCORE`)."""
    dense = {r["setting"]: r.get("score") for r in rows if r["method"] == "dense"}
    table: dict[str, dict[str, float | None]] = defaultdict(dict)
    for r in rows:
        d, s = dense.get(r["setting"]), r.get("score")
        table[_label(r)][r["setting"]] = (s / d) if (d is not None and d >= MIN_DENSE_SCORE and s is not None) else None
    return dict(table)


def _fmt(x, digits=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def retention_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table for one bench and model: a row per method@budget, score and retention per task."""
    settings = sorted({r["setting"] for r in rows})
    scores = {(_label(r), r["setting"]): r.get("score") for r in rows}
    ret = retention(rows)
    n = {r["setting"]: r.get("n") for r in rows if r["method"] == "dense"}
    heads = [f"{s} (n={n[s]})" if n.get(s) else s for s in settings]
    lines = ["| method | " + " | ".join(heads) + " | avg retention |", "|---" * (len(settings) + 2) + "|"]
    for label in sorted(ret, key=_order):
        cells, vals = [], []
        for s in settings:
            sc, rt = scores.get((label, s)), ret[label].get(s)
            cells.append(f"{_fmt(sc)} ({_fmt(rt)})" if sc is not None else "—")
            if rt is not None:
                vals.append(rt)
        avg = sum(vals) / len(vals) if vals else None
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_fmt(avg)} |")
    low = [s for s in settings if scores.get(("dense", s)) is not None and scores[("dense", s)] < MIN_DENSE_SCORE]
    if low:
        lines.append(f"\nDense scores below {MIN_DENSE_SCORE} on {', '.join(low)}: the model mostly fails these, so "
                     "their retention is not measured (n/a) and they are left out of the average.")
    return "\n".join(lines)


def _avg_retention(rows: Sequence[dict[str, Any]], label: str) -> float | None:
    vals = [v for v in retention(rows).get(label, {}).values() if v is not None]
    return sum(vals) / len(vals) if vals else None


def ablation_table(rows: Sequence[dict[str, Any]]) -> str | None:
    """The paper's Table 3 for one model: no re-rank -> re-rank all -> stability-aware -> budget 2048.

    Columns: average RULER retention, and teacher-forced agreement with dense per fidelity task kind.
    """
    from .methods import ABLATION

    labels = [f"{m}@{b}" for m, b in ABLATION]
    ruler = [r for r in rows if r["bench"] == "ruler"]
    fid = [r for r in rows if r["bench"] == "fidelity" and not r.get("cache_options")]
    kinds = sorted({(r["setting"], k) for r in fid for k in r["summary"] if k != "all"})
    head = (["RULER avg retention"] if ruler else []) + [f"{k} agree ({s})" for s, k in kinds]
    if not head:
        return None
    lines = ["| step | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for label in labels:
        cells = [_fmt(_avg_retention(ruler, label))] if ruler else []
        for setting, kind in kinds:
            hit = [r for r in fid if r["setting"] == setting and _label(r) == label]
            cells.append(_fmt(hit[0]["summary"].get(kind, {}).get("agreement")) if hit else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fidelity_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of teacher-forced agreement with dense, per task kind, for one model and setting."""
    kinds = sorted({k for r in rows for k in r.get("summary", {}) if k != "all"})
    head = ["method"] + [f"{k} agree" for k in kinds] + [f"{k} KL" for k in kinds] + ["free-run agree len", "acc vs text (method / dense)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in sorted(rows, key=lambda r: _order(_label(r))):
        s = r["summary"]
        cells = [_label(r)] + [_fmt(s.get(k, {}).get("agreement")) for k in kinds]
        cells += [_fmt(s.get(k, {}).get("kl"), 4) for k in kinds]
        cells.append(_fmt(s["all"].get("free_run_agreement"), 1))
        cells.append(f"{_fmt(s['all']['method_accuracy'])} / {_fmt(s['all']['dense_accuracy'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_retention(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> Path | None:
    """Average retention vs budget, one line per method (dense is the 1.0 line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ret = retention(rows)
    by_method: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for label, per_task in ret.items():
        method, _, budget = label.partition("@")
        vals = [v for v in per_task.values() if v is not None]
        budget, _, options = budget.partition(" ")
        if budget and vals:
            by_method[method + (f" {options}" if options else "")].append((int(budget), sum(vals) / len(vals)))
    if not by_method:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, pts in sorted(by_method.items(), key=lambda kv: _order(kv[0])):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="dense")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget")
    ax.set_ylabel("retention (score / dense)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _agreement_curve(run_path: str | Path, kind: str, window: int) -> list[float]:
    rows = [json.loads(l) for l in (Path(run_path) / "predictions.jsonl").read_text().splitlines() if l.strip()]
    rows = [r for r in rows if r["kind"] == kind]
    if not rows:
        return []
    n = min(len(r["agree"]) for r in rows)
    per_step = [sum(r["agree"][i] for r in rows) / len(rows) for i in range(n)]
    return [sum(per_step[max(0, i - window + 1):i + 1]) / len(per_step[max(0, i - window + 1):i + 1]) for i in range(n)]


def plot_agreement(rows: Sequence[dict[str, Any]], path: str | Path, title: str, window: int = 16) -> Path | None:
    """Top-1 agreement with dense vs generated position (moving average), one panel per task kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["method"] != "dense"]
    kinds = sorted({k for r in rows for k in r.get("summary", {}) if k != "all"})
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for r in sorted(rows, key=lambda r: _order(_label(r))):
            curve = _agreement_curve(r["path"], kind, window)
            if curve:
                ax.plot(range(1, len(curve) + 1), curve, label=_label(r), lw=1.2)
        ax.set_title(f"{title} — {kind}", fontsize=9)
        ax.set_xlabel("forced decode step")
        ax.set_ylabel(f"top-1 agreement (moving avg {window})")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def write_summary(out: str | Path, plots: bool = True) -> Path:
    """Write `<out>/summary.md` (and PNG plots next to it); return its path."""
    out = Path(out)
    rows = collect(out)
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[(r["bench"], r["model"])].append(r)
    parts = [f"# FlexiCache evaluation summary\n\nResults under `{out.name}/`. Cells: score (retention = score / dense).\n"]
    for (bench, model), group in sorted(groups.items()):
        if bench == "fidelity":
            for setting in sorted({r["setting"] for r in group}):
                sel = [r for r in group if r["setting"] == setting]
                parts.append(f"## fidelity — {model} — {setting}\n\nTeacher-forced top-1 agreement with dense, mean "
                             f"KL(dense ‖ method) in nats, free-running agreement length, accuracy on the true text.\n")
                parts.append(fidelity_table(sel) + "\n")
                if plots:
                    png = plot_agreement(sel, out / f"agreement-{model}-{setting}.png", f"{model} {setting}")
                    if png:
                        parts.append(f"![agreement]({png.name})\n")
        else:
            parts.append(f"## {bench} — {model}\n")
            parts.append(retention_table(group) + "\n")
            if plots:
                png = plot_retention(group, out / f"retention-{bench}-{model}.png", f"{bench} {model}")
                if png:
                    parts.append(f"![retention]({png.name})\n")
        notes = sorted({r["profile_note"] for r in group if r.get("profile_note")})
        for n in notes:
            parts.append(f"- profile: {n}\n")
    for model in sorted({r["model"] for r in rows}):
        table = ablation_table([r for r in rows if r["model"] == model])
        if table:
            parts.append(f"## ablation (paper Table 3) — {model}\n\n{table}\n")
    path = out / "summary.md"
    path.write_text("\n".join(parts))
    return path

"""Agreement with dense's own answers, and retention of the task metric, with paired bootstrap intervals.

`flexicache eval agreement --results ROOT` reads the run folders of `flexicache eval leval|longbench`
(`ROOT/<bench>/<model>/<task>/<run>/predictions.jsonl`, rows `{"id", "prediction", "score", ...}`) and
compares every run of a task with that task's `dense` run, question by question. Only ids present in both
runs count (a run that stopped early, or covers other questions, is compared on the common ones).

Per task, and pooled over tasks, for each run:

- `n`: questions compared;
- `method_score`, `dense_score`: mean per-question benchmark score (as stored in the predictions, 0-1);
- `retention` = mean(method score) / mean(dense score) on those questions (None when dense scores 0 on
  all of them), with a paired bootstrap 95% interval; the resamples in which dense's mean is 0 have no
  ratio and are left out of that interval, and `retention_dropped` says how many (the table marks them);
- `agreement`: mean token F1 between the run's answer and dense's answer to the same question, after
  `metrics.normalize_answer` (the normalisation of `metrics.qa_f1`; two answers that normalise to nothing
  agree fully, F1 = 1), with a bootstrap 95% interval. With small models the task score is noisy and low,
  agreement with dense is the cleaner signal. Chinese answers have no spaces, so on LongBench's Chinese
  tasks this F1 compares whole answers and is coarse;
- `identical`: the share of answers whose text equals dense's (surrounding whitespace ignored).

Intervals: percentile bootstrap (2.5th and 97.5th percentiles) over `resamples` resamples of the
questions, drawn with replacement; method and dense scores of one question are always drawn together
(paired). Pooled rows are question-weighted means over all tasks' questions, and their bootstrap is
stratified by task: every resample draws each task's own number of questions from that task, so the
task mix stays the one that was run. Each row's resampling starts from `seed`, so a row's interval
does not depend on which other tasks or runs are in the table.

Pooled rows: "all" (when there are at least two tasks) and, for L-Eval, "open-ended" and "exam"
separately when both kinds are present (exam tasks score exact match, open-ended ones F1 / ROUGE).
A run whose config differs from dense's on the prompt or the answer length (`max_prompt_tokens`, `seq_length`,
`dtype`, `max_new_tokens`) is left out with a warning: its answers are to other prompts, or cut elsewhere.

Noise floor (`--control ROOT`): the dense runs of another results root made with another `dtype` (e.g.
`flexicache eval leval --methods dense --dtype bfloat16 --out ROOT`, same tasks and lengths) become a row
"dense-<dtype>" of each task. Free-running answers part for good at the first near tie, so answer F1 is low
even for a perturbation as small as bf16 rounding; that row says how low, and how far a method is from it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .methods import METHODS
from .metrics import normalize_answer, token_f1
from .results import read_predictions

__all__ = ["answer_f1", "pair_rows", "task_runs", "agreement_stats", "agreement_table", "agreement_markdown",
           "write_agreement", "markdown_path", "bootstrap_indices", "percentile_interval", "with_interval",
           "f1_difference"]

# Settings that must match dense's for the answers to be comparable: the same prompts, answers of the same length.
SAME_PROMPT_KEYS = ("max_prompt_tokens", "seq_length", "dtype", "max_new_tokens")


def answer_f1(a: str, b: str) -> float:
    """Token F1 between two answers after `normalize_answer`; 1.0 when both normalise to nothing."""
    ta, tb = normalize_answer(a or "").split(), normalize_answer(b or "").split()
    if not ta and not tb:
        return 1.0
    return token_f1(ta, tb)


def _answer(row: dict[str, Any]) -> str:
    # L-Eval / LongBench rows hold "prediction"; RULER rows hold "response".
    return str(row.get("prediction", row.get("response", "")) or "")


def pair_rows(dense_rows: Sequence[dict], method_rows: Sequence[dict]) -> list[tuple[dict, dict]]:
    """(dense row, method row) for every id in both lists, in dense's order (first row of an id kept)."""
    method = {}
    for r in method_rows:
        method.setdefault(str(r["id"]), r)
    pairs, seen = [], set()
    for r in dense_rows:
        sid = str(r["id"])
        if sid in method and sid not in seen:
            seen.add(sid)
            pairs.append((r, method[sid]))
    return pairs


def _config(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    return json.loads(f.read_text()) if f.exists() else {}


def _run_order(name: str, cfg: dict[str, Any]) -> tuple:
    method = cfg.get("method") or name.split("-b")[0]
    return (METHODS.index(method) if method in METHODS else len(METHODS), int(cfg.get("budget") or 0), name)


def _differing_keys(cfg: dict, dense_cfg: dict, skip: Sequence[str] = ()) -> list[str]:
    """The `SAME_PROMPT_KEYS` (less `skip`) both configs set, to different values."""
    return [k for k in SAME_PROMPT_KEYS if k not in skip and k in cfg and k in dense_cfg and cfg[k] != dense_cfg[k]]


def _control_run(dense_cfg: dict, control_task_dir: Path | None) -> tuple[str, list[dict]] | None:
    """`("dense-<dtype>", rows)` of the control root's dense run of this task, when it differs from dense's run
    in `dtype` only (same prompts and answer length); None when there is none."""
    if control_task_dir is None:
        return None
    rows = read_predictions(control_task_dir / "dense" / "predictions.jsonl")
    if not rows:
        return None
    cfg = _config(control_task_dir / "dense")
    differ = _differing_keys(cfg, dense_cfg, skip=("dtype",))
    if differ or cfg.get("dtype") == dense_cfg.get("dtype"):
        why = ", ".join(differ) + " differ" if differ else "the same dtype as dense's"
        warnings.warn(f"{control_task_dir / 'dense'}: {why}; not used as a noise-floor control.")
        return None
    return f"dense-{cfg.get('dtype')}", rows


def task_runs(task_dir: str | Path,
              control_task_dir: str | Path | None = None) -> dict[str, list[tuple[dict, dict]]] | None:
    """{run folder name: paired (dense row, run row)} for every non-dense run of one task folder, in method
    order; None when the folder has no dense run. Runs made with other prompts than dense are left out.
    `control_task_dir`: the same task's folder under a `--control` root; its dense run in another dtype comes
    first, as "dense-<dtype>"."""
    task_dir = Path(task_dir)
    dense_dir = task_dir / "dense"
    dense_rows = read_predictions(dense_dir / "predictions.jsonl")
    if not dense_rows:
        return None
    dense_cfg = _config(dense_dir)
    control = _control_run(dense_cfg, None if control_task_dir is None else Path(control_task_dir))
    found = []
    for folder in sorted(p for p in task_dir.iterdir() if p.is_dir() and p.name != "dense"):
        if not (folder / "predictions.jsonl").exists():
            continue
        cfg = _config(folder)
        differ = _differing_keys(cfg, dense_cfg)
        if differ:
            warnings.warn(f"{folder}: {', '.join(differ)} differ from dense's run; left out of the comparison.")
            continue
        found.append((_run_order(folder.name, cfg), folder.name))
    runs = {} if control is None else {control[0]: pair_rows(dense_rows, control[1])}
    runs.update({name: pair_rows(dense_rows, read_predictions(task_dir / name / "predictions.jsonl"))
                 for _, name in sorted(found)})
    return runs


def bootstrap_indices(sizes: Sequence[int], resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """`(resamples, sum(sizes))` indices into items laid out stratum after stratum (`sizes[i]` items in
    stratum i): each row is one bootstrap resample, drawn with replacement within each stratum, so every
    resample keeps the strata's sizes. Index arrays holding several values per item keep them paired."""
    rng = np.random.default_rng(seed)
    blocks, start = [], 0
    for size in sizes:
        blocks.append(start + rng.integers(0, size, size=(resamples, size)))
        start += size
    return np.concatenate(blocks, axis=1)


def percentile_interval(values: np.ndarray) -> tuple[float | None, float | None]:
    """The 2.5th and 97.5th percentiles of the finite `values` (bootstrap estimates); (None, None) if none."""
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None, None
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def agreement_stats(pairs_by_task: dict[str, Sequence[tuple[dict, dict]]], resamples: int = 2000,
                    seed: int = 0) -> dict[str, Any] | None:
    """The numbers of one row: the pairs of one task, or of several (pooled, bootstrap stratified by task).

    Returns None when there are no pairs. Keys: n, tasks, method_score, dense_score, retention (+ _low,
    _high), retention_dropped (resamples left out of retention's interval: dense's mean 0 in them; None
    with retention), agreement (+ _low, _high), identical (see the module docstring).
    """
    strata = [list(p) for p in pairs_by_task.values() if p]
    if not strata:
        return None
    pairs = [p for s in strata for p in s]
    dense = np.array([float(d["score"]) for d, _ in pairs])
    method = np.array([float(m["score"]) for _, m in pairs])
    f1 = np.array([answer_f1(_answer(m), _answer(d)) for d, m in pairs])
    identical = np.array([_answer(m).strip() == _answer(d).strip() for d, m in pairs], dtype=float)

    idx = bootstrap_indices([len(s) for s in strata], resamples, seed)  # (resamples, n): one resample a row
    boot_dense = dense[idx].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        boot_ret = np.where(boot_dense > 0, method[idx].mean(axis=1) / boot_dense, np.nan)
    dropped = int(np.count_nonzero(~(boot_dense > 0)))  # no ratio in these resamples
    ret_lo, ret_hi = percentile_interval(boot_ret)
    agr_lo, agr_hi = percentile_interval(f1[idx].mean(axis=1))
    d_mean, m_mean = float(dense.mean()), float(method.mean())
    return {
        "n": len(pairs), "tasks": len(strata), "method_score": m_mean, "dense_score": d_mean,
        "retention": m_mean / d_mean if d_mean > 0 else None,
        "retention_low": ret_lo if d_mean > 0 else None, "retention_high": ret_hi if d_mean > 0 else None,
        "retention_dropped": dropped if d_mean > 0 else None,
        "agreement": float(f1.mean()), "agreement_low": agr_lo, "agreement_high": agr_hi,
        "identical": float(identical.mean()),
    }


def f1_difference(base_by_task: dict[str, Sequence[tuple[dict, dict]]],
                  other_by_task: dict[str, Sequence[tuple[dict, dict]]], resamples: int = 2000,
                  seed: int = 0) -> dict[str, Any] | None:
    """Paired difference of F1 vs dense, other run - base run, over the questions both answered (per task: the ids
    in both), with a bootstrap interval stratified by task as the pooled rows'. None when no question is shared.
    Keys: difference (+ _low, _high), difference_n."""
    strata = []
    for task, base_pairs in base_by_task.items():
        base = {str(d["id"]): answer_f1(_answer(m), _answer(d)) for d, m in base_pairs}
        other = {str(d["id"]): answer_f1(_answer(m), _answer(d)) for d, m in other_by_task.get(task, [])}
        diffs = [other[i] - base[i] for i in base if i in other]
        if diffs:
            strata.append(diffs)
    if not strata:
        return None
    values = np.array([x for s in strata for x in s])
    lo, hi = percentile_interval(values[bootstrap_indices([len(s) for s in strata], resamples, seed)].mean(axis=1))
    return {"difference": float(values.mean()), "difference_low": lo, "difference_high": hi,
            "difference_n": int(values.size)}


def _groups(bench: str, tasks: Sequence[str]) -> list[tuple[str, list[str]]]:
    groups = [("all", list(tasks))] if len(tasks) >= 2 else []
    if bench == "leval":
        from .leval import EXAM_TASKS

        exam = [t for t in tasks if t in EXAM_TASKS]
        open_ended = [t for t in tasks if t not in EXAM_TASKS]
        if exam and open_ended:
            groups += [("open-ended", open_ended), ("exam", exam)]
    return groups


def agreement_table(root: str | Path, bench: str = "leval", model: str | None = None,
                    tasks: Sequence[str] | None = None, resamples: int = 2000, seed: int = 0,
                    control: str | Path | None = None, versus: str | None = None) -> list[dict[str, Any]]:
    """One dict per (model, task, run) and per (model, pooled group, run), for the runs under
    `root/<bench>/<model>/<task>/` that have a `dense` run beside them.

    Args:
        root: the results root (`--out` of `flexicache eval leval|longbench`).
        bench: "leval" or "longbench" (any bench whose rows hold "id", "score" and the answer).
        model: one model folder name (default: every model under `root/<bench>/`).
        tasks: only these tasks (default: every task folder with a dense run).
        resamples, seed: the bootstrap's (module docstring).
        control: a results root whose dense runs in another dtype become "dense-<dtype>" rows (noise floor).
        versus: a run folder name (e.g. "flexicache-b1024"): every other run's row also gets its paired F1
            difference from that run on the same questions (`f1_difference`).

    Each dict: model, task (a task, or "all" / "open-ended" / "exam" with `pooled` True), run (the run
    folder name, e.g. "flexicache-b1024"), `max_prompt_tokens` of the dense run, and `agreement_stats`'s keys
    (and `f1_difference`'s with `versus`).
    """

    def against(members: Sequence[str], run: str) -> dict[str, Any]:
        if not versus or run == versus:
            return {}
        base = {t: per_task[t].get(versus, []) for t in members}
        return f1_difference(base, {t: per_task[t].get(run, []) for t in members}, resamples, seed) or {}

    bench_dir = Path(root) / bench
    models = [model] if model else sorted(p.name for p in bench_dir.iterdir() if p.is_dir()) if bench_dir.is_dir() else []
    rows: list[dict[str, Any]] = []
    for m in models:
        model_dir = bench_dir / m
        if not model_dir.is_dir():
            continue
        per_task: dict[str, dict[str, list]] = {}
        prompt_tokens: dict[str, Any] = {}
        for task_dir in sorted(p for p in model_dir.iterdir() if p.is_dir()):
            if tasks and task_dir.name not in tasks:
                continue
            runs = task_runs(task_dir, None if control is None else Path(control) / bench / m / task_dir.name)
            if runs is None:
                continue
            per_task[task_dir.name] = runs
            prompt_tokens[task_dir.name] = _config(task_dir / "dense").get("max_prompt_tokens")
        run_names = []
        for runs in per_task.values():
            run_names += [r for r in runs if r not in run_names]
        for task, runs in per_task.items():
            for run, pairs in runs.items():
                stats = agreement_stats({task: pairs}, resamples, seed)
                if stats:
                    rows.append({"model": m, "task": task, "pooled": False, "run": run,
                                 "max_prompt_tokens": prompt_tokens[task], **stats, **against([task], run)})
        for group, members in _groups(bench, list(per_task)):
            for run in run_names:
                stats = agreement_stats({t: per_task[t].get(run, []) for t in members}, resamples, seed)
                if stats:
                    lengths = {prompt_tokens[t] for t in members if per_task[t].get(run)}
                    rows.append({"model": m, "task": group, "pooled": True, "run": run,
                                 "max_prompt_tokens": lengths.pop() if len(lengths) == 1 else None, **stats,
                                 **against(members, run)})
    return rows


def _fmt(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def with_interval(row: dict[str, Any], key: str) -> str:
    """`row[key]` with its `key_low`, `key_high` interval: "0.812 [0.750, 0.861]" ("n/a" for a missing value)."""
    if row.get(key) is None:
        return "n/a"
    return f"{row[key]:.3f} [{_fmt(row[key + '_low'])}, {_fmt(row[key + '_high'])}]"


def _retention_cell(row: dict[str, Any]) -> str:
    """Retention with its interval, and "†N" when N resamples were left out of it (dense's mean 0 in them)."""
    dropped = row.get("retention_dropped")
    return with_interval(row, "retention") + (f" †{dropped}" if dropped else "")


def agreement_markdown(rows: Sequence[dict[str, Any]], bench: str = "leval", resamples: int = 2000,
                       seed: int = 0, versus: str | None = None) -> str:
    """Markdown: one table per model, task rows then pooled rows (in bold); with `versus`, a column of each run's
    paired F1 difference from that run."""
    if not rows:
        return f"No {bench} task with a dense run and another run was found.\n"
    parts = [f"# Agreement with dense — {bench}\n",
             "Per question, paired with dense's answer to the same question (ids in both runs only). Score: mean "
             "benchmark score (0-1), method / dense. Retention = method / dense score. F1 vs dense: token F1 "
             "between the two answers (normalised as qa_f1). Identical: share of answers equal to dense's. "
             f"[95% paired bootstrap interval, {resamples} resamples of the questions, seed {seed}; pooled rows are "
             "question-weighted, resampled within each task.]\n"]
    if any(r.get("retention_dropped") for r in rows):
        parts.append(f"†N after a retention interval: in N of the {resamples} resamples dense's mean score was 0, so "
                     "they have no retention and the interval is over the others.\n")
    for model in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == model]
        lengths = {r["max_prompt_tokens"] for r in sel if not r["pooled"]}
        length = f" — prompts ≤ {lengths.pop()} tokens" if len(lengths) == 1 and None not in lengths else ""
        parts.append(f"## {model}{length}\n")
        extra = f" F1 - {versus} [95% CI] (n) |" if versus else ""
        lines = ["| task | run | n | score (method / dense) | retention [95% CI] | F1 vs dense [95% CI] | identical |"
                 + extra, "|---|---|---|---|---|---|---|" + ("---|" if versus else "")]
        for r in [r for r in sel if not r["pooled"]] + [r for r in sel if r["pooled"]]:
            task = f"**{r['task']}** ({r['tasks']} tasks)" if r["pooled"] else r["task"]
            diff = ""
            if versus:
                diff = " |" if r.get("difference") is None else (
                    f" {r['difference']:+.3f} [{r['difference_low']:+.3f}, {r['difference_high']:+.3f}] "
                    f"({r['difference_n']}) |")
            lines.append(f"| {task} | {r['run']} | {r['n']} | {r['method_score']:.3f} / {r['dense_score']:.3f} | "
                         f"{_retention_cell(r)} | {with_interval(r, 'agreement')} | {r['identical']:.3f} |" + diff)
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def write_agreement(root: str | Path, bench: str = "leval", model: str | None = None,
                    tasks: Sequence[str] | None = None, out: str | Path | None = None, resamples: int = 2000,
                    seed: int = 0, control: str | Path | None = None,
                    versus: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """`agreement_table` and its Markdown; the Markdown is also written to `out` when given.

    `out` names a Markdown file; an existing folder (e.g. the results root, which every other `eval` command
    calls `--out`) gets `agreement-<bench>.md` inside it (`markdown_path`)."""
    rows = agreement_table(root, bench, model, tasks, resamples, seed, control, versus)
    text = agreement_markdown(rows, bench, resamples, seed, versus)
    if out:
        out = markdown_path(out, bench)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return rows, text


def markdown_path(out: str | Path, bench: str = "leval") -> Path:
    """Where `write_agreement(out=...)` writes: `out`, or `out/agreement-<bench>.md` when `out` is a folder."""
    out = Path(out)
    return out / f"agreement-{bench}.md" if out.is_dir() else out

"""Run evaluations: one results folder per configuration, resumable, with progress bars.

Layout: `<out>/<bench>/<model>/<setting>/<method>[-b<budget>]/` holding
- `config.json`: everything that defines the run (a resumed run must match it exactly),
- `predictions.jsonl`: one line per finished sample (a resumed run skips those),
- `metrics.json`: the aggregate, rewritten after every sample (`score` is the headline number).

Benches: "fidelity" (teacher-forced agreement with dense, `fidelity.py`), "ruler" (lm-eval's
offline RULER tasks through `lm_eval_model.FlexiCacheLM`), "longbench" and "leval" (greedy
generation scored with the benchmarks' metrics).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from .methods import METHODS, make_cache, prepare_model

__all__ = [
    "RunDir",
    "run_name",
    "resolve_profile",
    "load_model",
    "run_fidelity",
    "run_ruler",
    "run_longbench",
    "run_leval",
]

FALLBACK_NOTE = (
    "FALLBACK: no stability profile found for this model; 25% of KV heads chosen at random (seed 0) "
    "stand in for the unstable set. This is not a stability profile."
)


# -- results folders -----------------------------------------------------------------------------------
def _option_text(value) -> str:
    return ":".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def parse_cache_options(text: str | None) -> dict[str, Any]:
    """"dense_layers=0:1,rerank_interval=8" -> {"dense_layers": (0, 1), "rerank_interval": 8}."""
    options: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if ":" in value or key.strip() in ("dense_layers",):
            options[key.strip()] = tuple(int(v) for v in value.split(":") if v)
        else:
            try:
                options[key.strip()] = int(value)
            except ValueError:
                options[key.strip()] = {"true": True, "false": False}.get(value.lower(), value)
    return options


def cache_defaults(base=None) -> dict[str, Any]:
    """The `FlexiCacheConfig` fields no method sets, recorded in every run's config so that a resumed run
    never mixes results made under different defaults."""
    from dataclasses import asdict

    from fc_hf.config import FlexiCacheConfig

    cfg = asdict(base or FlexiCacheConfig())
    return {k: cfg[k] for k in ("page_size", "rerank_interval", "sink_pages", "promotion", "dense_layers")}


def run_name(method: str, budget: int | None) -> str:
    return "dense" if method == "dense" else f"{method}-b{budget}"


def run_folder(method: str, budget: int | None, cache_options: dict | None = None) -> str:
    """A run's folder name: `run_name` plus the cache options that set it apart (e.g. "-page_size=8")."""
    return run_name(method, budget) + "".join(f"-{k}={_option_text(v)}" for k, v in sorted((cache_options or {}).items()))


class RunDir:
    """One configuration's results folder.

    Args:
        path (`Path`): the folder (created if needed).
        config (`dict`): the run's defining settings; if the folder already has a different
            `config.json` (other than in `EXTENSIBLE` keys), resuming would mix incompatible results,
            so this raises.
    """

    # Keys that only add samples (a resumed run may extend them) or only describe the run.
    EXTENSIBLE = frozenset({"started", "profile_note", "tasks", "distances", "offsets", "kinds", "limit"})

    def __init__(self, path: str | Path, config: dict[str, Any]):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = json.loads(json.dumps(config))  # normalise tuples etc. as they will be stored
        cfg_file = self.path / "config.json"
        if cfg_file.exists():
            old = json.loads(cfg_file.read_text())
            keys = set(old) | set(self.config)
            diff = sorted(k for k in keys if k not in self.EXTENSIBLE and old.get(k) != self.config.get(k))
            if diff:
                raise ValueError(
                    f"{self.path} holds a run with different settings ({', '.join(diff)}); use another --out "
                    "or delete that folder."
                )
            self.config["started"] = old.get("started")
        else:
            self.config["started"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        cfg_file.write_text(json.dumps(self.config, indent=1) + "\n")

    @property
    def predictions_file(self) -> Path:
        return self.path / "predictions.jsonl"

    def predictions(self) -> list[dict[str, Any]]:
        if not self.predictions_file.exists():
            return []
        rows = []
        for line in self.predictions_file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by an interrupted write: that sample is simply redone
        return rows

    def done_ids(self) -> set[str]:
        return {str(r["id"]) for r in self.predictions()}

    def append(self, row: dict[str, Any]) -> None:
        with open(self.predictions_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        tmp = self.path / "metrics.json.tmp"
        tmp.write_text(json.dumps({**self.config, **metrics}, indent=1) + "\n")
        tmp.replace(self.path / "metrics.json")


# -- models and profiles ---------------------------------------------------------------------------------
def load_model(name: str, dtype: str = "float32"):
    """A bundled model name ("smollm2-135m-instruct", ...) or a local folder -> (model, tokenizer, folder)."""
    import torch
    from fc_hf import assets

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    folder = assets.model_path(name) if name in assets.MODELS else Path(name)
    model, tok = assets.load_model(name, dtype=torch_dtype)
    return model, tok, folder


def _per_task_sets(extra: dict[str, Any]) -> dict[str, list] | None:
    """The profiler's per-task unstable sets (`extra["per_task_unstable"]`), if the profile recorded them."""
    for key in ("per_task_unstable", "per_task"):
        value = extra.get(key)
        if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            return value
    tasks = extra.get("tasks")  # the profiler's per-task tallies, each with its own "unstable" list
    if isinstance(tasks, dict) and tasks and all(isinstance(v, dict) and "unstable" in v for v in tasks.values()):
        return {name: entry["unstable"] for name, entry in tasks.items()}
    return None


# Evaluated task -> the profiler tasks (fc_hf.profiler.tasks) built from the same material, which must be
# left out of its profile. Fidelity is teacher-forced continue/recall on the KJV text, exactly what the
# profiler's kjv-continue and kjv-recall decode.
_SAME_MATERIAL = {
    "fidelity": ("kjv-continue", "kjv-recall"),
    "niah_single_1": ("ruler-niah",), "niah_multikey_2": ("ruler-niah",), "niah_multikey_3": ("ruler-niah",),
    "ruler_vt": ("ruler-vt",),
}


def excluded_tasks(eval_task: str, profile_tasks: Sequence[str]) -> list[str]:
    """Profile tasks that share the evaluated task's material (same name up to `_`/`-`, or `_SAME_MATERIAL`)."""
    norm = lambda t: t.lower().replace("_", "-")  # noqa: E731
    same = set(_SAME_MATERIAL.get(eval_task, ()))
    return [t for t in profile_tasks if t in same or norm(t) == norm(eval_task)]


def resolve_profile(model_name: str, model_config, eval_task: str, profile_arg: str | None = None):
    """The head profile to evaluate `eval_task` with, made on other tasks; and a note saying how.

    Order: `profile_arg` (a file or bundled name), else the bundled `profiles/<model>.json`, else
    the random fallback (`FALLBACK_NOTE`). When the profile records per-task results, the tasks that
    share `eval_task`'s material (`excluded_tasks`) are removed: exactly with the profiler's
    `profile_excluding` when its per-task tallies are there, else by re-voting the per-task sets (a
    head counts once per remaining task that marks it; the most-voted heads fill a set as large as
    the profile's).
    """
    from fc_hf.errors import ProfileError
    from fc_hf.profile import PROFILE_DIR, HeadProfile, attention_shape

    bundled = f"{Path(model_name).name}.json"
    source = profile_arg or str(PROFILE_DIR / bundled)
    try:
        profile = HeadProfile.load(source, config=model_config)
    except ProfileError:
        if profile_arg:
            raise
        layers, kv_heads, _ = attention_shape(model_config)
        pairs = [(l, h) for l in range(layers) for h in range(kv_heads)]
        chosen = random.Random(0).sample(pairs, max(1, round(0.25 * len(pairs))))
        return HeadProfile.from_unstable(model_config, chosen, extra={"note": FALLBACK_NOTE}), FALLBACK_NOTE

    source = profile_arg or f"profiles/{bundled}"  # as notes show it: no path of this machine
    per_task = _per_task_sets(profile.extra)
    if not per_task:
        tasks = profile.extra.get("tasks")
        names = sorted(tasks) if isinstance(tasks, (dict, list)) else tasks
        return profile, f"profile {source} (tasks {names}); no per-task sets recorded, so {eval_task!r} could not be excluded"
    drop = excluded_tasks(eval_task, list(per_task))
    if not drop:
        return profile, f"profile {source} (tasks {sorted(per_task)}; none shares {eval_task!r}'s material)"
    if len(drop) == len(per_task):
        raise ProfileError(f"Profile {source} was made only on {sorted(per_task)}: no task other than {eval_task!r} to use.")
    tallies = profile.extra.get("tasks")
    if isinstance(tallies, dict) and all(isinstance(v, dict) for v in tallies.values()):
        from fc_hf.profiler.build import profile_excluding

        derived = profile_excluding(profile, drop)
        return derived, f"profile {source} rebuilt without {drop} (from {sorted(set(per_task) - set(drop))})"
    others = {t: v for t, v in per_task.items() if t not in drop}
    votes = Counter((int(l), int(h)) for sets in others.values() for l, h in sets)
    chosen = [p for p, _ in sorted(votes.items(), key=lambda kv: (-kv[1], kv[0]))[:len(profile.unstable)]]
    note = f"profile {source}, re-voted over tasks {sorted(others)} (excluded {drop})"
    return HeadProfile.from_unstable(model_config, chosen, extra={"note": note, "source": source}), note


# -- generation ------------------------------------------------------------------------------------------
def _progress(iterable, desc: str, total: int | None = None):
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True)


def _method_runs(methods: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, int | None]]:
    """(method, budget) pairs: each method at every budget, or only at B when written "method@B"."""
    runs = []
    for spec in methods:
        m, _, only = spec.partition("@")
        if m not in METHODS:
            raise ValueError(f"Unknown method {m!r}; choose from {METHODS} (optionally as method@BUDGET).")
        if only and not only.isdigit():
            raise ValueError(f"{spec!r}: the budget after '@' must be a number of tokens, e.g. flexicache@2048.")
        pairs = [(m, None)] if m == "dense" else [(m, int(b)) for b in ([only] if only else budgets)]
        runs.extend(p for p in pairs if p not in runs)
    return runs


# -- fidelity --------------------------------------------------------------------------------------------
def run_fidelity(
    model_name: str, methods: Sequence[str], budgets: Sequence[int], out: str | Path, prompt_tokens: int = 4096,
    forced_tokens: int = 256, distances: Sequence[int] = (2048, 3584), offsets: Sequence[int] = (0,),
    kinds: Sequence[str] = ("continue", "recall"), free_run_tokens: int = 64, profile_arg: str | None = None,
    dtype: str = "float32", model_bundle=None, text_tokens=None, cache_options: dict | None = None,
) -> dict[str, dict]:
    """Teacher-forced fidelity of each method against dense; returns {run name: metrics}.

    Tasks are the outer loop so that dense log-probs are computed once per task and shared by all
    methods; every (method, budget) has its own results folder. `cache_options` (e.g.
    `{"dense_layers": (0, 1)}`) set `FlexiCacheConfig` fields for every method and name the folders.
    """
    from fc_hf.config import FlexiCacheConfig
    import torch

    from .fidelity import agreement_length, compare_steps, make_tasks, summarize
    from .shared_prefill import dense_prefill, forced_decode, greedy_decode

    model, tok, _ = model_bundle or load_model(model_name, dtype)
    tasks = make_tasks(tok, kinds, prompt_tokens, forced_tokens, distances, offsets, text_tokens=text_tokens)
    profile, note = resolve_profile(model_name, model.config, "fidelity", profile_arg)
    print(f"fidelity: {len(tasks)} tasks; profile: {note}")
    setting = f"p{prompt_tokens}-f{forced_tokens}"
    base = FlexiCacheConfig(**(cache_options or {}))
    base_cfg = {
        "bench": "fidelity", "model": Path(model_name).name, "setting": setting, "dtype": dtype,
        "prompt_tokens": prompt_tokens, "forced_tokens": forced_tokens, "distances": list(distances),
        "offsets": list(offsets), "kinds": list(kinds), "free_run_tokens": free_run_tokens,
        "tasks": [t.name for t in tasks], "cache_defaults": cache_defaults(base),
    }
    runs = {}
    for method, budget in _method_runs(methods, budgets):
        cfg = {**base_cfg, "method": method, "budget": budget, "cache_options": cache_options or None,
               "profile": (profile_arg or "bundled-or-fallback") if method == "flexicache" else None,
               "profile_note": note if method == "flexicache" else None}
        name = run_folder(method, budget, cache_options)
        runs[(method, budget)] = RunDir(Path(out) / "fidelity" / cfg["model"] / setting / name, cfg)

    dense_free: dict[str, list[int]] = {}
    for task in _progress(tasks, "fidelity tasks"):
        pending = [(k, r) for k, r in runs.items() if task.name not in r.done_ids()]
        if not pending:
            continue
        prefill = dense_prefill(model, task.prompt_ids)  # one dense prefill serves every method (shared_prefill.py)
        forced = task.target_ids[:-1]
        dense = torch.stack(list(forced_decode(model, prefill, "dense", None, forced)))
        targets = task.target_ids[1:]
        if free_run_tokens:
            dense_free[task.name] = greedy_decode(model, prefill, "dense", None, free_run_tokens)
        for (method, budget), run in _progress(pending, f"methods on {task.name}"):
            t0 = time.time()
            if method == "dense":
                steps = compare_steps(dense, iter(dense), targets)
                free_len = free_run_tokens if free_run_tokens else None
            else:
                fresh = lambda: make_cache(method, model, budget, profile, base=base)  # noqa: E731
                steps = compare_steps(dense, forced_decode(model, prefill, method, fresh(), forced), targets)
                free_len = None
                if free_run_tokens:
                    gen = greedy_decode(model, prefill, method, fresh(), free_run_tokens)
                    free_len = agreement_length(gen, dense_free[task.name])
            run.append({"id": task.name, "kind": task.kind, "meta": task.meta, **steps,
                        "free_run_agreement": free_len, "seconds": round(time.time() - t0, 1)})
            summary = summarize(run.predictions())
            run.write_metrics({"score": summary["all"]["agreement"], "summary": summary})
    prepare_model(model, "dense")
    return {r.path.name: json.loads((r.path / "metrics.json").read_text()) for r in runs.values()
            if (r.path / "metrics.json").exists()}


# -- RULER through lm-eval ---------------------------------------------------------------------------------
RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


def run_ruler(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    seq_lengths: Sequence[int] = (4096,), limit: int | None = 4, profile_arg: str | None = None,
    dtype: str = "float32", model_bundle=None, shared_prefill: bool = True, cache_options: dict | None = None,
) -> dict[str, dict]:
    """lm-eval's offline RULER tasks for each method.

    `shared_prefill` (default): one dense prefill per sample serves every method (`ruler.py`;
    resumable per sample). False: each method runs through `lm_eval.simple_evaluate` with
    `FlexiCacheLM` (resumable per sample through lm-eval's request cache).
    """
    if shared_prefill:
        from .ruler import run_ruler_shared

        return run_ruler_shared(model_name, tasks, methods, budgets, out, seq_lengths, limit, profile_arg, dtype,
                                model_bundle, cache_options)
    if cache_options:
        raise ValueError("cache options need the shared-prefill route; drop --per-method-prefill.")
    import lm_eval

    from .lm_eval_model import FlexiCacheLM

    model, tok, folder = model_bundle or load_model(model_name, dtype)
    results = {}
    for task in tasks:
        for length in seq_lengths:
            for method, budget in _method_runs(methods, budgets):
                # Resolved per run, so a long sweep picks up a profile that lands meanwhile.
                profile, note = resolve_profile(model_name, model.config, task, profile_arg)
                cfg = {"bench": "ruler", "model": Path(model_name).name, "setting": f"{task}-{length}", "task": task,
                       "seq_length": int(length), "limit": limit, "dtype": dtype, "method": method, "budget": budget,
                       "profile_note": note if method == "flexicache" else None}
                run = RunDir(Path(out) / "ruler" / cfg["model"] / cfg["setting"] / run_name(method, budget), cfg)
                done = run.path / "metrics.json"
                if done.exists() and json.loads(done.read_text()).get("limit") == limit:
                    results[f"{task}-{length}/{run_name(method, budget)}"] = json.loads((run.path / "metrics.json").read_text())
                    continue
                print(f"ruler {task} @ {length}: {run_name(method, budget)}")
                lm = FlexiCacheLM(pretrained=model, tokenizer=tok, method=method, token_budget=budget or 1024,
                                  profile=profile if method == "flexicache" else None, batch_size=1,
                                  max_length=int(length) + 512)
                t0 = time.time()
                res = lm_eval.simple_evaluate(
                    model=lm, tasks=[task], limit=limit, log_samples=True, bootstrap_iters=0,
                    use_cache=str(run.path / "lm_eval_requests"),
                    metadata={"max_seq_lengths": [int(length)], "tokenizer": str(folder)},
                )
                samples = res["samples"][task]
                if run.predictions_file.exists():
                    run.predictions_file.unlink()
                for s in samples:
                    run.append({"id": s["doc_id"], "target": s.get("target"), "response": s["filtered_resps"][0],
                                "score": s.get(f"{length}")})
                task_res = res["results"][task]
                score = task_res.get(f"{length},none")
                run.write_metrics({"score": None if score in (None, -1) else float(score), "n": len(samples),
                                   "lm_eval": {k: v for k, v in task_res.items() if isinstance(v, (int, float, str))},
                                   "seconds": round(time.time() - t0, 1)})
                results[f"{task}-{length}/{run_name(method, budget)}"] = json.loads((run.path / "metrics.json").read_text())
    return results


# -- LongBench and L-Eval --------------------------------------------------------------------------------
def _run_generation(
    bench: str, model_name: str, task: str, samples: list[dict], prompt_fn: Callable, score_fn: Callable,
    max_new_tokens: int, methods: Sequence[str], budgets: Sequence[int], out: str | Path, max_prompt_tokens: int,
    profile_arg: str | None, dtype: str, model_bundle,
) -> dict[str, dict]:
    """Greedy answers of every method, sample by sample: one dense prefill per sample serves all methods."""
    from .shared_prefill import dense_prefill, eos_token_ids, greedy_decode

    model, tok, _ = model_bundle
    profile, note = resolve_profile(model_name, model.config, task, profile_arg)
    eos_ids = eos_token_ids(model, tok)
    runs = {}
    for method, budget in _method_runs(methods, budgets):
        cfg = {"bench": bench, "model": Path(model_name).name, "setting": task, "task": task, "dtype": dtype,
               "max_prompt_tokens": max_prompt_tokens, "max_new_tokens": max_new_tokens, "method": method,
               "budget": budget, "cache_defaults": cache_defaults(),
               "profile_note": note if method == "flexicache" else None}
        runs[(method, budget)] = RunDir(Path(out) / bench / cfg["model"] / task / run_name(method, budget), cfg)
    for i, sample in enumerate(_progress(samples, f"{bench} {task}")):
        sid = str(sample.get("_id", i))
        pending = [(k, r) for k, r in runs.items() if sid not in r.done_ids()]
        if not pending:
            continue
        ids = prompt_fn(sample)
        prefill = dense_prefill(model, ids)
        for (method, budget), run in pending:
            cache = make_cache(method, model, budget or 1024, profile if method == "flexicache" else None)
            tokens = greedy_decode(model, prefill, method, cache, max_new_tokens, lambda t: t[-1] in eos_ids)
            pred = tok.decode(tokens, skip_special_tokens=True)
            run.append({"id": sid, "prediction": pred, "score": score_fn(pred, sample), "prompt_tokens": len(ids)})
            rows = run.predictions()
            run.write_metrics({"score": 100.0 * sum(r["score"] for r in rows) / len(rows), "n": len(rows)})
    results = {}
    for (method, budget), run in runs.items():
        if (run.path / "metrics.json").exists():
            results[run_name(method, budget)] = json.loads((run.path / "metrics.json").read_text())
    prepare_model(model, "dense")
    return results


def run_longbench(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    data: str | None = None, limit: int | None = None, max_prompt_tokens: int = 7500, prompt_file: str | None = None,
    profile_arg: str | None = None, dtype: str = "float32", model_bundle=None,
) -> dict[str, dict]:
    """LongBench tasks (hub or local JSONL) for each method; tasks without data are skipped with one line."""
    from . import longbench

    bundle = None
    prompts = longbench.load_prompts(prompt_file)
    results = {}
    for task in tasks:
        records = longbench.load_longbench(task, local=data, limit=limit)
        if records is None:
            continue
        for i, r in enumerate(records):
            r.setdefault("_id", str(i))
        bundle = bundle or model_bundle or load_model(model_name, dtype)
        tok = bundle[1]
        base = task[:-2] if task.endswith("_e") else task
        results[task] = _run_generation(
            "longbench", model_name, task, records,
            lambda r, t=task: longbench.build_prompt_ids(tok, t, r, max_prompt_tokens, prompts),
            lambda pred, r, t=task: longbench.score_sample(t, pred, r),
            longbench.MAX_NEW_TOKENS[base], methods, budgets, out, max_prompt_tokens, profile_arg, dtype, bundle,
        )
    return results


def run_leval(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    data: str | None = None, limit: int | None = None, max_prompt_tokens: int = 7500, max_new_tokens: int = 256,
    profile_arg: str | None = None, dtype: str = "float32", model_bundle=None,
) -> dict[str, dict]:
    """L-Eval open-ended tasks (hub or local JSONL) for each method; tasks without data are skipped."""
    from . import leval

    bundle = None
    results = {}
    for task in tasks:
        samples = leval.load_leval(task, local=data, limit=limit)
        if samples is None:
            continue
        for s in samples:
            s["_id"] = f"{s['doc_index']}-{s['inst_index']}"
        bundle = bundle or model_bundle or load_model(model_name, dtype)
        tok = bundle[1]
        results[task] = _run_generation(
            "leval", model_name, task, samples,
            lambda s: leval.build_prompt_ids(tok, s, max_prompt_tokens),
            lambda pred, s: leval.score_sample(pred, s),
            max_new_tokens, methods, budgets, out, max_prompt_tokens, profile_arg, dtype, bundle,
        )
    return results

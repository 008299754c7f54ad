"""LongBench and L-Eval runs: every method's greedy answer to each sample, scored by the benchmark's metric.

One dense prefill per sample serves every method (`shared_prefill.py`); answers and scores go to
one results folder per (method, budget) (`results.py`), resumable sample by sample. L-Eval's
questions on one document share the prompt's prefix, prefilled once (`shared_prefill.PrefixReuse`;
`prefix_reuse=False` prefills every question in full). The data, prompts and metrics are
`longbench.py` and `leval.py`; a task whose data is not reachable is skipped with one line.

`cache_options` (`FlexiCacheConfig` fields, e.g. `{"page_size": 8}`) go to every non-dense method's cache as
`make_cache`'s `base`, as in fidelity and RULER runs, are recorded in config.json and name those folders
(`results.run_folder`: "quest-b1024-page_size=8"). Dense does not use them: its folder stays `dense`, shared by
runs with and without options, which therefore pair with the same dense answers.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from . import leval, longbench
from .loading import load_model
from .methods import cache_defaults, make_cache, method_runs, prepare_model
from .profile_choice import resolve_profile
from .results import RunDir, finished_metrics, progress, run_folder
from .shared_prefill import PrefixReuse, dense_prefill, eos_token_ids, greedy_decode

__all__ = ["run_generation", "run_longbench", "run_leval"]


def run_generation(
    bench: str, model_name: str, task: str, samples: list[dict], prompt_fn: Callable, score_fn: Callable,
    max_new_tokens: int, methods: Sequence[str], budgets: Sequence[int], out: str | Path, max_prompt_tokens: int,
    profile_arg: str | None, dtype: str, model_bundle, prefix_reuse: bool = False, cache_options: dict | None = None,
) -> dict[str, dict]:
    """Greedy answers of every method, sample by sample: one dense prefill per sample serves all methods.

    With `prefix_reuse`, each prompt's prefill reuses the K/V of what it shares with the previous prompt
    (`shared_prefill.PrefixReuse`): consecutive questions on one document prefill the document once.
    `cache_options`: `FlexiCacheConfig` fields for every non-dense method (see the module docstring).
    """
    from fc_hf.config import FlexiCacheConfig

    base = FlexiCacheConfig(**(cache_options or {}))
    model, tok, _ = model_bundle
    prefill_fn = PrefixReuse(model) if prefix_reuse else partial(dense_prefill, model)
    profile, note = resolve_profile(model_name, model.config, task, profile_arg)
    eos_ids = eos_token_ids(model, tok)
    runs = {}
    for method, budget in method_runs(methods, budgets):
        options = None if method == "dense" else (cache_options or None)
        cfg = {"bench": bench, "model": Path(model_name).name, "setting": task, "task": task, "dtype": dtype,
               "max_prompt_tokens": max_prompt_tokens, "max_new_tokens": max_new_tokens, "method": method,
               "budget": budget, "cache_defaults": cache_defaults(base if options else None),
               "profile_note": note if method == "flexicache" else None}
        if options:
            cfg["cache_options"] = options
        folder = run_folder(method, budget, options)
        runs[(method, budget)] = RunDir(Path(out) / bench / cfg["model"] / task / folder, cfg)
    for i, sample in enumerate(progress(samples, f"{bench} {task}")):
        sid = str(sample.get("_id", i))
        pending = [(k, r) for k, r in runs.items() if sid not in r.done_ids()]
        if not pending:
            continue
        ids = prompt_fn(sample)
        prefill = prefill_fn(ids)
        for (method, budget), run in pending:
            cache = make_cache(method, model, budget or 1024, profile if method == "flexicache" else None, base=base)
            tokens = greedy_decode(model, prefill, method, cache, max_new_tokens, lambda t: t[-1] in eos_ids)
            pred = tok.decode(tokens, skip_special_tokens=True)
            run.append({"id": sid, "prediction": pred, "score": score_fn(pred, sample), "prompt_tokens": len(ids)})
            rows = run.predictions()
            run.write_metrics({"score": 100.0 * sum(r["score"] for r in rows) / len(rows), "n": len(rows)})
    prepare_model(model, "dense")
    return finished_metrics(runs.values())


def run_longbench(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    data: str | None = None, limit: int | None = None, max_prompt_tokens: int = 7500, prompt_file: str | None = None,
    profile_arg: str | None = None, dtype: str = "float32", model_bundle=None, max_new_tokens: int | None = None,
    cache_options: dict | None = None,
) -> dict[str, dict]:
    """LongBench tasks (hub or local JSONL) for each method; tasks without data are skipped with one line.
    `max_new_tokens` None: the benchmark's length for each task (`longbench.MAX_NEW_TOKENS`). `cache_options`:
    `FlexiCacheConfig` fields for every non-dense method (module docstring)."""
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
        results[task] = run_generation(
            "longbench", model_name, task, records,
            lambda r, t=task: longbench.build_prompt_ids(tok, t, r, max_prompt_tokens, prompts),
            lambda pred, r, t=task: longbench.score_sample(t, pred, r),
            max_new_tokens or longbench.MAX_NEW_TOKENS[base], methods, budgets, out, max_prompt_tokens, profile_arg,
            dtype, bundle, cache_options=cache_options,
        )
    return results


def run_leval(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    data: str | None = None, limit: int | None = None, max_prompt_tokens: int = 7500, max_new_tokens: int | None = None,
    profile_arg: str | None = None, dtype: str = "float32", model_bundle=None, prefix_reuse: bool = True,
    cache_options: dict | None = None,
) -> dict[str, dict]:
    """L-Eval tasks, open- and closed-ended (hub or local JSONL), for each method; tasks without data are skipped.

    `max_new_tokens` None: each task's `leval.MAX_NEW_TOKENS`. `prefix_reuse`: a document's questions
    share one prefill of the document (same answers; False prefills every question in full). `cache_options`:
    `FlexiCacheConfig` fields for every non-dense method (module docstring).
    """
    bundle = None
    results = {}
    for task in tasks:
        samples = leval.load_leval(task, local=data)
        if samples is None:
            continue
        bundle = bundle or model_bundle or load_model(model_name, dtype)
        tok = bundle[1]
        samples = leval.add_prompts(samples, tok, max_prompt_tokens)[:limit]
        for s in samples:
            s["_id"] = f"{s['doc_index']}-{s['inst_index']}"
        results[task] = run_generation(
            "leval", model_name, task, samples,
            lambda s: leval.prompt_ids(tok, s),
            lambda pred, s: leval.score_sample(pred, s),
            max_new_tokens or leval.MAX_NEW_TOKENS[task], methods, budgets, out, max_prompt_tokens, profile_arg, dtype,
            bundle, prefix_reuse=prefix_reuse, cache_options=cache_options,
        )
    return results

"""RULER through lm-eval's own tasks, with one dense prefill per sample shared by every method.

lm-eval builds the samples (its offline RULER generators), the prompts and the generation settings,
and scores the answers (`task.process_results`); this module only replaces the generation loop so
that the prompt is prefilled once and each method decodes from it (`shared_prefill.py`). Tokenising,
stop strings and answer post-processing are lm-eval's `HFLM` code paths, so a method's answer is the
one `lm_eval --model flexicache` would produce (checked on the dense runs: same answers, same
scores). `run_ruler(..., shared_prefill=False)` keeps the plain lm-eval route (`run_ruler_lm_eval`:
each method through `lm_eval.simple_evaluate`, one prefill per method).
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fc_hf.config import FlexiCacheConfig

from .loading import load_model
from .methods import cache_defaults, make_cache, method_runs, prepare_model
from .profile_choice import resolve_profile
from .results import RunDir, finished_metrics, progress, run_folder, run_name
from .shared_prefill import dense_prefill, eos_token_ids, greedy_decode

__all__ = ["RULER_TASKS", "ESSAY_TASKS", "RulerSample", "ruler_samples", "kjv_essays", "answer_stop", "run_ruler",
           "run_ruler_shared", "run_ruler_lm_eval"]

# Needle tasks whose haystack is Paul Graham's essays, a hub dataset (`baber/paul_graham_essays`): offline they run
# with the bundled King James Bible in its place (`kjv_essays`, `--essay-haystack kjv`).
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1")
RULER_TASKS = ("niah_single_1", *ESSAY_TASKS, "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe",
               "ruler_fwe")


@dataclass
class RulerSample:
    doc_id: int
    doc: dict[str, Any]
    context: str
    gen_kwargs: dict[str, Any]


ESSAYS_HUB_ID = "baber/paul_graham_essays"


@contextmanager
def kjv_essays():
    """lm-eval's RULER generators with the bundled King James Bible as their "essay" haystack (lm-eval splits it into
    words as it splits the essays), and sentences split at `.`, `!` or `?` followed by a space where lm-eval asks
    nltk's punkt (a download): the needles, keys, values, depths and templates stay lm-eval's own."""
    import datasets
    from lm_eval.tasks.ruler import prepare_niah

    from fc_hf.assets.text import kjv_text

    load, split = datasets.load_dataset, prepare_niah.cached_sent_tokenize

    def essays(path, *args, **kwargs):
        return {"text": [kjv_text()]} if path == ESSAYS_HUB_ID else load(path, *args, **kwargs)

    datasets.load_dataset = essays
    prepare_niah.cached_sent_tokenize = lambda text: re.split(r"(?<=[.!?])\s+", text)
    prepare_niah.get_haystack.cache_clear()  # lm-eval keeps one haystack per process
    try:
        yield
    finally:
        datasets.load_dataset, prepare_niah.cached_sent_tokenize = load, split
        prepare_niah.get_haystack.cache_clear()


def ruler_samples(task: str, length: int, limit: int | None, tokenizer_folder: str | Path, haystack: str = "hub"):
    """lm-eval's task object and its first `limit` samples at `length` tokens; `haystack="kjv"`: an essay task's
    haystack is the King James Bible (`kjv_essays`).

    RULER's generators draw from the global `random` module, so the samples depend on its state: seed
    it as `lm_eval.simple_evaluate` does by default, which gives every method — and the plain lm-eval
    route — the same samples.
    """
    import random

    import numpy as np
    import torch
    from lm_eval.evaluator import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.tasks import TaskManager, get_task_dict

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)

    manager = TaskManager(metadata={"max_seq_lengths": [int(length)], "tokenizer": str(tokenizer_folder)})
    with kjv_essays() if haystack == "kjv" and task in ESSAY_TASKS else nullcontext():
        task_obj = get_task_dict([task], manager)[task]
        task_obj.build_all_requests(limit=limit, rank=0, world_size=1)
    samples = [RulerSample(inst.doc_id, inst.doc, inst.args[0], dict(inst.args[1])) for inst in task_obj.instances]
    return task_obj, sorted(samples, key=lambda s: s.doc_id)


def answer_stop(lm, until: Sequence[str], eos_ids: set[int]):
    """The stopping rule of `HFLM` generation: an EOS token, or a stop string in the decoded answer."""

    def stop(tokens: list[int]) -> bool:
        if tokens[-1] in eos_ids:
            return True
        text = lm.tok_decode(tokens)
        return any(u and u in text for u in until)

    return stop


def run_ruler_shared(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    seq_lengths: Sequence[int] = (4096,), limit: int | None = 4, profile_arg: str | None = None,
    dtype: str = "float32", model_bundle=None, cache_options: dict | None = None, essay_haystack: str = "hub",
) -> dict[str, dict]:
    """Every (task, length) x (method, budget) of RULER, resumable per sample; returns {key: metrics}.

    `cache_options` (e.g. `{"page_size": 8}`) set `FlexiCacheConfig` fields for every method and name the folders.
    `essay_haystack="kjv"`: the essay tasks run on the King James Bible (`kjv_essays`; their settings end in "-kjv").
    """
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

    from .lm_eval_model import FlexiCacheLM

    base = FlexiCacheConfig(**(cache_options or {}))
    model, tok, folder = model_bundle or load_model(model_name, dtype)
    eos_ids = eos_token_ids(model, tok)
    # lm-eval's tokenising and answer post-processing, one per length (max_length bounds the prompt)
    lms = {length: FlexiCacheLM(pretrained=model, tokenizer=tok, method="dense", batch_size=1, max_length=int(length) + 512)
           for length in seq_lengths}
    results = {}
    for task in tasks:
        profile, note = resolve_profile(model_name, model.config, task, profile_arg)
        for length in seq_lengths:
            lm = lms[length]
            kjv = essay_haystack == "kjv" and task in ESSAY_TASKS
            task_obj, samples = ruler_samples(task, length, limit, folder, essay_haystack)
            setting = f"{task}-{length}" + ("-kjv" if kjv else "")
            runs = {}
            for method, budget in method_runs(methods, budgets):
                cfg = {"bench": "ruler", "model": Path(model_name).name, "setting": setting, "task": task,
                       "seq_length": int(length), "limit": limit, "dtype": dtype, "method": method, "budget": budget,
                       "generation": "shared-prefill", "cache_defaults": cache_defaults(base),
                       "haystack": "kjv" if kjv else "lm-eval's",
                       "cache_options": cache_options or None,
                       "profile_note": note if method == "flexicache" else None}
                folder_name = run_folder(method, budget, cache_options)
                runs[(method, budget)] = RunDir(Path(out) / "ruler" / cfg["model"] / setting / folder_name, cfg)
            eos = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
            for sample in progress(samples, f"ruler {setting}"):
                pending = [(k, r) for k, r in runs.items() if str(sample.doc_id) not in r.done_ids()]
                if not pending:
                    continue
                kwargs = normalize_gen_kwargs(dict(sample.gen_kwargs), lm.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen = int(kwargs.pop("max_gen_toks"))
                ids, _ = lm.tok_batch_encode([sample.context], left_truncate_len=lm.max_length - max_gen,
                                             truncation=lm.truncation)
                t0 = time.time()
                prefill = dense_prefill(model, ids[0].tolist())
                prefill_s = time.time() - t0
                for (method, budget), run in pending:
                    t0 = time.time()
                    cache = make_cache(method, model, budget or 1024, profile if method == "flexicache" else None, base=base)
                    tokens = greedy_decode(model, prefill, method, cache, max_gen, answer_stop(lm, until, eos_ids))
                    text = postprocess_generated_text(generation=lm.tok_decode(tokens), stop=until, think_end_token=None)
                    metrics = task_obj.process_results(sample.doc, [text])
                    score = float(metrics[str(length)])
                    run.append({"id": sample.doc_id, "target": sample.doc.get("outputs"), "response": text, "score": score,
                                "prompt_tokens": prefill.length, "new_tokens": len(tokens),
                                "prefill_seconds": round(prefill_s, 1), "decode_seconds": round(time.time() - t0, 1)})
                    rows = run.predictions()
                    run.write_metrics({"score": sum(r["score"] for r in rows) / len(rows), "n": len(rows)})
                del prefill
            results.update(finished_metrics(runs.values(), prefix=f"{setting}/"))
    prepare_model(model, "dense")
    return results


def run_ruler(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    seq_lengths: Sequence[int] = (4096,), limit: int | None = 4, profile_arg: str | None = None,
    dtype: str = "float32", model_bundle=None, shared_prefill: bool = True, cache_options: dict | None = None,
    essay_haystack: str = "hub",
) -> dict[str, dict]:
    """lm-eval's offline RULER tasks for each method.

    `shared_prefill` (default): one dense prefill per sample serves every method (`run_ruler_shared`;
    resumable per sample). False: each method runs through `lm_eval.simple_evaluate` with
    `FlexiCacheLM` (resumable per sample through lm-eval's request cache).
    """
    if shared_prefill:
        return run_ruler_shared(model_name, tasks, methods, budgets, out, seq_lengths, limit, profile_arg, dtype,
                                model_bundle, cache_options, essay_haystack)
    if cache_options or essay_haystack != "hub":
        raise ValueError("cache options and --essay-haystack need the shared-prefill route; drop --per-method-prefill.")
    return run_ruler_lm_eval(model_name, tasks, methods, budgets, out, seq_lengths, limit, profile_arg, dtype,
                             model_bundle)


def run_ruler_lm_eval(
    model_name: str, tasks: Sequence[str], methods: Sequence[str], budgets: Sequence[int], out: str | Path,
    seq_lengths: Sequence[int] = (4096,), limit: int | None = 4, profile_arg: str | None = None,
    dtype: str = "float32", model_bundle=None,
) -> dict[str, dict]:
    """Each method through `lm_eval.simple_evaluate` with `FlexiCacheLM` (one prefill per method; resumable
    per sample through lm-eval's request cache in the run folder)."""
    import lm_eval

    from .lm_eval_model import FlexiCacheLM

    model, tok, folder = model_bundle or load_model(model_name, dtype)
    results = {}
    for task in tasks:
        for length in seq_lengths:
            for method, budget in method_runs(methods, budgets):
                # Resolved per run, so a long sweep picks up a profile that lands meanwhile.
                profile, note = resolve_profile(model_name, model.config, task, profile_arg)
                cfg = {"bench": "ruler", "model": Path(model_name).name, "setting": f"{task}-{length}", "task": task,
                       "seq_length": int(length), "limit": limit, "dtype": dtype, "method": method, "budget": budget,
                       "profile_note": note if method == "flexicache" else None}
                run = RunDir(Path(out) / "ruler" / cfg["model"] / cfg["setting"] / run_name(method, budget), cfg)
                done = run.metrics()
                if done is not None and done.get("limit") == limit:
                    results[f"{task}-{length}/{run_name(method, budget)}"] = done
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
                results[f"{task}-{length}/{run_name(method, budget)}"] = run.metrics()
    return results

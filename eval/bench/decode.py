"""The timed suites of `flexicache bench`: decode, prefill, batch, and the ranking work per step read from decode.

Every group of cases runs in its own subprocess (`worker`: one model build, then the cases in turn),
so peak RSS and allocator state do not leak between groups. A decode case writes random K/V into
the cache layer by layer (exactly the calls a prefill makes, `common.ingest_random_kv`) and times
whole decode steps (a FlexiCache step is one fixed sequence of tensor ops: there is no per-phase timer);
Quest and FlexiCache rows also carry the cache's `memory_report()` and `stats()` (rows ranked, pages
promoted, bytes read). Every cache is allocated for the context and the steps timed (`common.bench_cache`),
as generate sizes it. A prefill case times the model over random tokens. Results accumulate in
`<out>/<suite>.json`; a case run again replaces its old entry.

Besides dense, Quest and FlexiCache the decode and batch suites know two more kinds of case:

- `floor`: dense attention (`DynamicCache` + sdpa, the `dense` case) over a cache of `budget` tokens instead
  of `length`: what a step costs when attention reads only as many tokens as FlexiCache attends, with no
  scoring, selection or paging. FlexiCache's tok/s over the floor's is how close it comes to that bound.
- configuration variants (`--cache-variants "old=refine_pages=0,score_subpages=1;refine=score_subpages=1"`):
  each label adds a Quest and a FlexiCache case (those in `--methods`) built with those `FlexiCacheConfig` fields
  on top of `--cache-options` (parsed by `methods.parse_cache_options`, as `--ops-cache-options` is). Rows carry
  `variant` (the label; absent for the unlabelled default) and `options` (the fields set). Quest and FlexiCache
  rows also carry `cache_config`: the whole `FlexiCacheConfig` the case ran with (`methods.cache_defaults`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from fc_hf.compat import cache_kwarg

from ..methods import cache_defaults, method_config, parse_cache_options, prepare_model, resolved_config
from .common import (PeakRSS, base_config, bench_cache, bench_profile, build_model, decode_step, environment,
                     ingest_random_kv, log, model_config, now, parse_sizes, release_memory, run_worker, unstable_share,
                     write_json)

__all__ = ["decode_case", "prefill_case", "worker", "suite_decode", "suite_batch", "suite_prefill", "suite_rerank",
           "ranking_per_step", "parse_cache_variants", "FLEXI_METHODS", "BENCH_METHODS"]

FLEXI_METHODS = ("quest", "flexicache")  # the cases built from a FlexiCacheConfig (options and variants apply)
BENCH_METHODS = ("dense", "floor") + FLEXI_METHODS  # what --methods of the decode and batch suites may name


# -- workers (run in a subprocess) ----------------------------------------------------------------
def decode_case(model, config, method, budget, length, batch, steps, profile, device="cpu", dtype=None,
                options: dict | None = None, warmup: int = 0) -> dict:
    """Time `steps` decode steps of `method` after a random-K/V prefill of `length` tokens, batch `batch`, the first
    step and `warmup` more untimed.

    `method` "floor" is dense attention over a cache of `min(budget, length)` tokens (the row still reports
    `length`, the context it stands in for; `cache_tokens` is what the cache held before step 1).
    `options`: `FlexiCacheConfig` fields for Quest and FlexiCache (the defaults otherwise)."""
    dtype = dtype or torch.float32
    floor = method == "floor"
    flexi = method in FLEXI_METHODS
    cache_method = "dense" if floor else method
    prepare_model(model, cache_method)
    kwarg = cache_kwarg(model)
    cuda = torch.device(device).type == "cuda"
    context = min(budget, length) if floor else length  # tokens in the cache before step 1 (positions follow it)
    result = {"method": method, "budget": budget if flexi or floor else None, "length": length, "batch": batch,
              "steps": steps, "warmup_steps": warmup, "cache_tokens": context}
    if flexi and options:
        result["options"] = dict(options)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        gpu_start = torch.cuda.memory_allocated()
    with PeakRSS() as rss, torch.no_grad():
        base = base_config(options, budget) if flexi else None
        # Room for the context and every step timed, as generate sizes a cache (a FlexiCache scores its capacity).
        cache = bench_cache(cache_method, config, budget, profile, base=base, tokens=context + 1 + warmup + steps)
        t0 = now(device)
        ingest_random_kv(cache, config, batch, context, dtype=dtype, device=device)
        result["ingest_s"] = now(device) - t0
        if flexi:
            result["cache_config"] = cache_defaults(cache.cache_config)
        token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0)).to(device)
        t0 = now(device)
        token = decode_step(model, cache, kwarg, token, context)  # step 1: every stable row ranks, windows filled
        result["first_step_ms"] = (now(device) - t0) * 1e3
        for i in range(warmup):
            token = decode_step(model, cache, kwarg, token, context + 1 + i)
        times = []
        for i in range(steps):
            t0 = now(device)
            token = decode_step(model, cache, kwarg, token, context + 1 + warmup + i)
            times.append((now(device) - t0) * 1e3)
        if flexi:
            result["memory"] = cache.memory_report()
            result["stats"] = cache.stats()
        else:
            nbytes = sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers
                         if getattr(l, "keys", None) is not None)
            result["memory"] = {"device_kv_bytes": nbytes, "dense_kv_bytes": nbytes, "host_kv_bytes": 0, "metadata_bytes": 0}
        del cache
        release_memory()
    times_sorted = sorted(times)
    mean = sum(times) / len(times)
    result.update(
        step_ms_mean=mean,
        step_ms_median=times_sorted[len(times) // 2],
        step_ms_min=times_sorted[0],
        # the tail: a step that re-ranks more rows, or waits on the host, shows here and not in the median
        step_ms_p99=times_sorted[min(len(times) - 1, -(-99 * len(times) // 100) - 1)],
        step_ms_max=times_sorted[-1],
        step_ms=times,
        tok_s=batch * 1e3 / mean,
        peak_rss_mb=rss.peak_mb,
    )
    if cuda:
        result["peak_gpu_mb"] = (torch.cuda.max_memory_allocated() - gpu_start) / 2**20
    return result


def prefill_case(model, config, method, budget, length, profile, device="cpu", options: dict | None = None) -> dict:
    """Time a real prefill of `length` random tokens with `method`'s cache, then one decode step.

    `options`: `FlexiCacheConfig` fields for Quest and FlexiCache (the defaults otherwise)."""
    prepare_model(model, method)
    kwarg = cache_kwarg(model)
    ids = torch.randint(1, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    result = {"method": method, "budget": budget if method != "dense" else None, "length": length, "batch": 1}
    flexi = method in FLEXI_METHODS
    if flexi and options:
        result["options"] = dict(options)
    with PeakRSS() as rss, torch.no_grad():
        base = base_config(options, budget) if flexi else None
        cache = bench_cache(method, config, budget, profile, base=base, tokens=length + 1)
        t0 = now(device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
        result["prefill_s"] = now(device) - t0
        token = out.logits[:, -1:].argmax(-1)
        del out
        t0 = now(device)
        decode_step(model, cache, kwarg, token, length)
        result["first_step_ms"] = (now(device) - t0) * 1e3
        del cache
        release_memory()
    result["peak_rss_mb"] = rss.peak_mb
    return result


def worker(spec: dict) -> int:
    """Run one group of cases on one model and print one JSON line per case."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    max_len = max(spec["lengths"]) + spec.get("steps", 0) + 64
    config = model_config(spec["model"], max_positions=max(8192, max_len), layers=spec.get("layers"))
    model = build_model(config)
    profile, label = bench_profile(config, spec.get("unstable_fraction", 0.25), prefer_shipped=spec["model"] == "smollm2")
    common = {"suite": spec["kind"], "model": spec["model"], "profile": label,
              "unstable_share": unstable_share(profile, config), "env": environment()}
    for case in spec["cases"]:
        t0 = time.perf_counter()
        if spec["kind"] == "prefill":
            res = prefill_case(model, config, case["method"], case["budget"], case["length"], profile,
                               options=case.get("options"))
        elif spec["kind"] == "paired":  # floor and FlexiCache interleaved (paired.py)
            from .paired import paired_case

            res = paired_case(model, config, case["budget"], case["length"], case["batch"], spec["steps"], profile,
                              options=case.get("options"), variant=case.get("paired_variant"))
        else:
            res = decode_case(model, config, case["method"], case["budget"], case["length"], case["batch"],
                              spec["steps"], profile, options=case.get("options"), warmup=spec.get("warmup", 0))
        if case.get("variant"):
            res["variant"] = case["variant"]
        res.update(common)
        print(json.dumps(res), flush=True)
        name = case["method"] + (f"[{case['variant']}]" if case.get("variant") else "")
        if "step_ms_mean" in res:
            what = f"{res['step_ms_mean']:.1f} ms/step ({res['tok_s']:.2f} tok/s)"
        elif "ratio_of_medians" in res:
            from .paired import sides

            a, b = sides(res)
            what = (f"{a} {res[a + '_median_ms']:.1f}, {b} {res[b + '_median_ms']:.1f} ms/step "
                    f"(medians; ratio {res['ratio_of_medians']:.2f})")
        else:
            what = f"prefill {res['prefill_s']:.2f} s"
        log(f"  {spec['model']:8s} {name:14s} B={res['budget']} L={case['length']} b={res['batch']}: {what}"
            f"  [{time.perf_counter() - t0:.1f} s]")
    return 0


def _run_group(spec: dict, timeout: int) -> list[dict]:
    """Run `worker(spec)` in a fresh interpreter (`python -m fc_hf.eval.bench _worker`); return its case results
    (whatever finished)."""
    results, rc = run_worker("_worker", spec, timeout)
    if rc != 0:
        print(f"bench: worker group {spec['model']} {spec['kind']} ended with {rc}; kept {len(results)} results",
              file=sys.stderr)
    return results


# -- suites ---------------------------------------------------------------------------------------
def parse_cache_variants(text: str | None) -> list[tuple[str, dict]]:
    """"old=refine_pages=0,score_subpages=1;refine=score_subpages=1" -> [("old", {...}), ("refine", {...})].

    Variants are separated by ";", each `LABEL=FIELD=VALUE[,FIELD=VALUE...]`; the fields are parsed by
    `methods.parse_cache_options` (so a value list such as `streaming_heads` works as it does there)."""
    variants: list[tuple[str, dict]] = []
    for item in filter(None, (part.strip() for part in (text or "").split(";"))):
        label, sep, fields = item.partition("=")
        label = label.strip()
        options = parse_cache_options(fields)
        if not sep or not label or not options:
            raise ValueError(f"cache variant {item!r}: write LABEL=FIELD=VALUE[,FIELD=VALUE...], "
                             "e.g. old=refine_pages=0")
        if not all(c.isalnum() or c in "_.-" for c in label):
            raise ValueError(f"cache variant label {label!r}: use letters, digits, '_', '.', '-'")
        if label in [v[0] for v in variants]:
            raise ValueError(f"cache variant label {label!r} given twice")
        variants.append((label, options))
    return variants


def _case_options(args) -> tuple[dict, list[tuple[str | None, dict]]]:
    """The `--cache-options` fields and the variants to run: (None, those fields) first, then each labelled
    variant's fields on top of them. Every variant is checked against every budget here, so a bad field fails
    before any worker starts."""
    from fc_hf.config import FlexiCacheConfig

    common = parse_cache_options(getattr(args, "cache_options", ""))
    variants = [(None, common)] + [(label, {**common, **opts})
                                   for label, opts in parse_cache_variants(getattr(args, "cache_variants", ""))]
    for label, opts in variants:
        for budget in parse_sizes(args.budgets):
            try:
                FlexiCacheConfig(token_budget=budget, **opts)
            except (TypeError, ValueError) as e:
                raise ValueError(f"cache options {opts} ({label or 'default'}) at budget {budget}: {e}") from e
    return common, variants


def _same_case(method: str, budget: int, opts: dict, default_opts: dict) -> bool:
    """Whether `method` with `opts` behaves as with `default_opts` (configs compared resolved: `methods.resolved_config`)."""
    def resolved(o):
        return resolved_config(method_config(method, budget, base=base_config(o, budget)))

    return resolved(opts) == resolved(default_opts)


def _method_cases(methods, budgets, length, batch, variants=((None, {}),)):
    """The cases of one (length, batch): dense; then per budget the floor, Quest and FlexiCache with the
    unlabelled options, then each labelled variant. A variant that behaves as the unlabelled one for that method
    (e.g. refine_pages=0,score_subpages=1 for Quest, its own selection; score_subpages=2 for FlexiCache at an even
    page size) is the same case twice and is left out: configs are compared resolved (`methods.resolved_config`),
    not as dataclasses, where score_subpages=2 and the default None differ."""
    cases = []
    if "dense" in methods:
        cases.append({"method": "dense", "budget": None, "length": length, "batch": batch})
    default_opts = dict(variants[0][1]) if variants else {}
    for budget in budgets:
        if "floor" in methods:
            cases.append({"method": "floor", "budget": budget, "length": length, "batch": batch})
        for label, opts in variants:
            for m in FLEXI_METHODS:
                if m not in methods:
                    continue
                if label is not None and _same_case(m, budget, opts, default_opts):
                    log(f"bench: {m}[{label}] is {m} itself at B={budget} ({opts}); not run twice")
                    continue
                case = {"method": m, "budget": budget, "length": length, "batch": batch}
                if opts:
                    case["options"] = dict(opts)
                if label is not None:
                    case["variant"] = label
                cases.append(case)
    return cases


def _methods(args) -> list[str]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in BENCH_METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {', '.join(BENCH_METHODS)}")
    return methods


def _decode_groups(args) -> list[dict]:
    models = [m for m in args.models.split(",") if m]
    lengths, batches, budgets = parse_sizes(args.lengths), parse_sizes(args.batches), parse_sizes(args.budgets)
    methods = _methods(args)
    _, variants = _case_options(args)

    # The issue-7 targets come first (SmolLM2, 16k/32k/4k), so a run cut short still answers them.
    def priority(key):
        model, length, batch = key
        return (models.index(model), [16384, 32768, 4096].index(length) if length in (16384, 32768, 4096) else 3,
                batch, length)

    keys = sorted(((m, l, b) for m in models for l in lengths for b in batches), key=priority)
    groups = []
    for model, length, batch in keys:
        groups.append({"kind": "decode", "model": model, "lengths": [length], "steps": args.steps,
                       "warmup": args.warmup_steps,
                       "layers": args.llama_layers if model == "llama8b" else None, "threads": args.threads,
                       "unstable_fraction": args.unstable_fraction,
                       "cases": _method_cases(methods, budgets, length, batch, variants)})
    return groups


def _case_key(model: str, case: dict) -> tuple:
    """Which earlier result a case replaces: same model, method, budget, length, batch and variant label."""
    budget = case.get("budget") if case["method"] in FLEXI_METHODS + ("floor",) else None
    return (model, case["method"], budget, case["length"], case.get("batch", 1), case.get("variant"))


def _run_suite(name: str, groups: list[dict], args, out: Path) -> list[dict]:
    # Results accumulate in `out` across runs (e.g. one model now, another later); a case that is
    # run again replaces its old entry.
    path = out / f"{name}.json"
    planned = {_case_key(spec["model"], c) for spec in groups for c in spec["cases"]}
    results = []
    if path.exists():
        results = [r for r in json.loads(path.read_text()).get("results", [])
                   if _case_key(r["model"], r) not in planned]
    for i, spec in enumerate(groups):
        log(f"bench {name}: group {i + 1}/{len(groups)} ({spec['model']}, {len(spec['cases'])} cases, "
            f"load {os.getloadavg()[0]:.1f})")
        results.extend(_run_group(spec, args.timeout))
        write_json(path, {"suite": name, "env": environment(), "argv": sys.argv[1:], "results": results})
    return results


def suite_decode(args, out: Path):
    return _run_suite("decode", _decode_groups(args), args, out)


def suite_batch(args, out: Path):
    length = parse_sizes(args.batch_length)[0]
    budgets = parse_sizes(args.budgets)[:1]
    methods = _methods(args)
    _, variants = _case_options(args)
    model = [m for m in args.models.split(",") if m][0]
    groups = [{"kind": "batch", "model": model, "lengths": [length], "steps": args.steps, "threads": args.threads,
               "unstable_fraction": args.unstable_fraction,
               "layers": args.llama_layers if model == "llama8b" else None,
               "cases": _method_cases(methods, budgets, length, b, variants)} for b in parse_sizes(args.batch_sizes)]
    return _run_suite("batch", groups, args, out)


def suite_prefill(args, out: Path):
    model = [m for m in args.models.split(",") if m][0]
    budget = parse_sizes(args.budgets)[0]
    options, _ = _case_options(args)  # --cache-options apply; variants are for the decode and batch suites
    cases = []
    for length in parse_sizes(args.prefill_lengths):
        cases += [{"method": m, "budget": budget, "length": length} for m in ("dense", "flexicache")]
    for case in cases:
        if case["method"] == "flexicache" and options:
            case["options"] = dict(options)
    groups = [{"kind": "prefill", "model": model, "lengths": parse_sizes(args.prefill_lengths), "threads": args.threads,
               "unstable_fraction": args.unstable_fraction, "cases": cases,
               "layers": args.llama_layers if model == "llama8b" else None}]
    return _run_suite("prefill", groups, args, out)


def ranking_per_step(r: dict) -> dict:
    """A Quest / FlexiCache decode row's ranking work per decode step, as its cache counted it (`stats()`, over every
    decode step of the case, step 1 included): rows ranked, and the bytes ranking read (the MinMax metadata scored
    and the candidates' keys refinement read)."""
    stats = r["stats"]
    steps = stats["decode_steps"]
    read = stats["bytes_read"]
    return {"rows": (stats["reranks_stable"] + stats["reranks_unstable"]) / steps,
            "bytes": (read["metadata"] + read["candidate_keys"]) / steps}


def suite_rerank(args, out: Path):
    """Fig. 8 from the decode results: ranking work per step, FlexiCache (unstable rows every step, each stable row
    every R steps) against Quest (every row every step), counted; and the whole step's time.

    The cost of ranking is no longer timed apart: a decode step is one fixed sequence of tensor ops (it compiles), with
    no per-phase timer. What ranking costs is what it reads, counted by the cache (`ranking_per_step`)."""
    path = out / "decode.json"
    if not path.exists():
        print("bench rerank: needs decode results (run the decode suite first)", file=sys.stderr)
        return []
    decode = json.loads(path.read_text())["results"]
    rows = []
    index = {(r["model"], r["method"], r["budget"], r["length"], r["batch"]): r for r in decode
             if not r.get("variant")}  # the unlabelled configuration only
    for (model, method, budget, length, batch), r in sorted(index.items(), key=lambda kv: str(kv[0])):
        if method != "flexicache":
            continue
        q = index.get((model, "quest", budget, length, batch))
        if q is None or "bytes_read" not in r.get("stats", {}) or "bytes_read" not in q.get("stats", {}):
            continue  # rows of an older run recorded no counted reads
        f_rank, q_rank = ranking_per_step(r), ranking_per_step(q)
        rows.append({"model": model, "budget": budget, "length": length, "batch": batch,
                     "flexicache_rows_ranked_per_step": f_rank["rows"], "quest_rows_ranked_per_step": q_rank["rows"],
                     "flexicache_ranking_bytes_per_step": f_rank["bytes"], "quest_ranking_bytes_per_step": q_rank["bytes"],
                     "ranking_bytes_ratio": q_rank["bytes"] / f_rank["bytes"] if f_rank["bytes"] else None,
                     "flexicache_step_ms": r["step_ms_mean"], "quest_step_ms": q["step_ms_mean"],
                     "end_to_end_speedup": q["step_ms_mean"] / r["step_ms_mean"],
                     "unstable_share": r.get("unstable_share")})
    write_json(out / "rerank.json", {"suite": "rerank", "source": str(path.name), "results": rows})
    return rows

"""`flexicache bench`: decode throughput, memory and re-rank cost of FlexiCache against dense and Quest.

Suites (run any subset; `all` runs every one):

- `decode`: tokens/s and time per decode step for dense (`DynamicCache` + sdpa), Quest (FlexiCache
  with every head unstable, one tier) and FlexiCache (profile, host tier) over a grid of context
  lengths, batch sizes and token budgets, on random-weight models of SmolLM2-135M's shape and of
  Llama-3.1-8B's attention/MLP shape with fewer layers. Each case also reports the per-phase
  breakdown of a step (scoring, selection, gather + attention, promotion, everything else, from
  `FlexiCache.enable_timing()`), peak RSS, and the bytes per tier from `memory_report()`.
  The prefill is replaced by writing random K/V into the cache layer by layer (exactly the calls a
  prefill makes), so 32k-token contexts cost seconds; its time is reported as `ingest_s`.
- `prefill`: a real prefill (the model over random tokens) with each cache, batch 1.
- `batch`: decode latency against batch size at one length (the paper's Fig. 7).
- `rerank`: stability-aware against re-rank-everything cost (Fig. 8), read from the decode suite's
  breakdown (scoring + selection per step, FlexiCache vs Quest), so it needs `decode` results.
- `memory`: device KV bytes against context length with the analytic limit (Fig. 9), see
  `bench_memory.py`.
- `promotion`: promoted bytes per re-rank on the real SmolLM2 (Table 7), see `bench_memory.py`.
- `report`: plots (PNG) and `benchmarks.md` from the JSON files in `--out`.

Every group of timed cases runs in its own subprocess (one model build, then the cases in turn), so
peak RSS and allocator state do not leak between groups. Ratios are only meaningful side by side
from one run on a quiet machine: the JSON records the load average at the start of each group.

    flexicache bench decode prefill batch memory promotion report --out results/bench
    flexicache bench decode --smoke --out /tmp/b          # seconds, for testing the suite
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SUITES = ("decode", "prefill", "batch", "rerank", "memory", "promotion", "report")
METHODS = ("dense", "quest", "flexicache")


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flexicache bench", description=__doc__.split("\n\n")[0])
    p.add_argument("suites", nargs="*", default=["decode", "report"], help=f"any of {', '.join(SUITES)}, or all")
    p.add_argument("--out", default="results/bench", help="folder for the JSON results (default results/bench)")
    p.add_argument("--docs", default=None, help="folder for benchmarks.md and bench/*.png (default: --out)")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes: checks the suite runs (seconds)")
    p.add_argument("--models", default="smollm2,llama8b", help="decode models (smollm2, llama8b, tiny)")
    p.add_argument("--lengths", default="4k,8k,16k,32k", help="context lengths of the decode suite")
    p.add_argument("--batches", default="1,4", help="batch sizes of the decode suite")
    p.add_argument("--budgets", default="1024,2048", help="token budgets")
    p.add_argument("--methods", default=",".join(METHODS), help="subset of dense,quest,flexicache")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per case (a multiple of the re-rank interval)")
    p.add_argument("--llama-layers", type=int, default=2, help="decoder layers of the Llama-8B-shaped model")
    p.add_argument("--unstable-fraction", type=float, default=0.25, help="share of unstable heads of the synthetic profile")
    p.add_argument("--prefill-lengths", default="4k,8k", help="prefill suite lengths (SmolLM2 shape, batch 1)")
    p.add_argument("--batch-length", default="8k", help="context length of the batch suite")
    p.add_argument("--batch-sizes", default="1,2,4,8", help="batch sizes of the batch suite")
    p.add_argument("--memory-lengths", default="2k,4k,8k,12k,16k,20k,24k,32k", help="memory suite lengths")
    p.add_argument("--promotion-prompt", type=int, default=6000, help="promotion suite: prompt tokens (real SmolLM2)")
    p.add_argument("--promotion-new", type=int, default=512, help="promotion suite: generated tokens")
    p.add_argument("--promotion-budgets", default="1024,2048", help="promotion suite budgets")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds allowed per subprocess group")
    return p


# -- workers (run in a subprocess) ----------------------------------------------------------------
def _decode_case(model, config, method, budget, length, batch, steps, profile, device="cpu", dtype=None) -> dict:
    import torch

    from .bench_common import PeakRSS, attn_impl, cache_kwarg, decode_step, ingest_random_kv, make_cache, now, release_memory

    dtype = dtype or torch.float32
    model.set_attn_implementation(attn_impl(method))
    kwarg = cache_kwarg(model)
    flexi = method in ("quest", "flexicache")
    cuda = torch.device(device).type == "cuda"
    result = {"method": method, "budget": budget if flexi else None, "length": length, "batch": batch, "steps": steps}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        gpu_start = torch.cuda.memory_allocated()
    with PeakRSS() as rss, torch.no_grad():
        cache = make_cache(method, config, budget, profile)
        t0 = now(device)
        ingest_random_kv(cache, config, batch, length, dtype=dtype, device=device)
        result["ingest_s"] = now(device) - t0
        if flexi:
            cache.enable_timing()
        token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0)).to(device)
        t0 = now(device)
        token = decode_step(model, cache, kwarg, token, length)  # step 1: first ranking, prompt pages dropped
        result["first_step_ms"] = (now(device) - t0) * 1e3
        if flexi:
            cache.timings.clear()
        times = []
        for i in range(steps):
            t0 = now(device)
            token = decode_step(model, cache, kwarg, token, length + 1 + i)
            times.append((now(device) - t0) * 1e3)
        if flexi:
            mem = cache.memory_report()
            stats = cache.stats()
            result["memory"] = mem
            result["stats"] = {k: v for k, v in stats.items() if k not in ("promoted_fraction_per_rerank", "timings_s")}
            fr = stats["promoted_fraction_per_rerank"]
            result["stats"]["promoted_fraction_mean"] = sum(fr) / len(fr) if fr else None
            phases = {k: v * 1e3 / steps for k, v in stats.get("timings_s", {}).items()}
        else:
            nbytes = sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers
                         if getattr(l, "keys", None) is not None)
            result["memory"] = {"device_kv_bytes": nbytes, "dense_kv_bytes": nbytes, "host_kv_bytes": 0, "metadata_bytes": 0}
            phases = {}
        del cache
        release_memory()
    times_sorted = sorted(times)
    mean = sum(times) / len(times)
    result.update(
        step_ms_mean=mean,
        step_ms_median=times_sorted[len(times) // 2],
        step_ms_min=times_sorted[0],
        step_ms=times,
        tok_s=batch * 1e3 / mean,
        peak_rss_mb=rss.peak_mb,
    )
    if cuda:
        result["peak_gpu_mb"] = (torch.cuda.max_memory_allocated() - gpu_start) / 2**20
    if phases:
        phases.setdefault("promotion", 0.0)
        phases["other"] = mean - sum(phases.values())
        result["breakdown_ms"] = phases
    return result


def _prefill_case(model, config, method, budget, length, profile, device="cpu") -> dict:
    import torch

    from .bench_common import PeakRSS, attn_impl, cache_kwarg, decode_step, make_cache, now, release_memory

    model.set_attn_implementation(attn_impl(method))
    kwarg = cache_kwarg(model)
    ids = torch.randint(1, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    result = {"method": method, "budget": budget if method != "dense" else None, "length": length, "batch": 1}
    with PeakRSS() as rss, torch.no_grad():
        cache = make_cache(method, config, budget, profile)
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


def _worker(spec: dict) -> int:
    """Run one group of cases on one model and print one JSON line per case."""
    import torch

    from .bench_common import bench_profile, build_model, environment, log, model_config, unstable_share

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
            res = _prefill_case(model, config, case["method"], case["budget"], case["length"], profile)
        else:
            res = _decode_case(model, config, case["method"], case["budget"], case["length"], case["batch"],
                               spec["steps"], profile)
        res.update(common)
        print(json.dumps(res), flush=True)
        log(f"  {spec['model']:8s} {case['method']:10s} B={res['budget']} L={case['length']} b={res['batch']}: "
            + (f"{res['step_ms_mean']:.1f} ms/step ({res['tok_s']:.2f} tok/s)" if "step_ms_mean" in res
               else f"prefill {res['prefill_s']:.2f} s") + f"  [{time.perf_counter() - t0:.1f} s]")
    return 0


def _run_group(spec: dict, timeout: int) -> list[dict]:
    """Run `_worker(spec)` in a fresh interpreter; return its case results (whatever finished)."""
    cmd = [sys.executable, "-m", "fc_hf.eval.bench", "_worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
        stdout, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout, rc = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout) or "", "timeout"
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if rc != 0:
        print(f"bench: worker group {spec['model']} {spec['kind']} ended with {rc}; kept {len(results)} results",
              file=sys.stderr)
    return results


# -- suites ---------------------------------------------------------------------------------------
def _method_cases(methods, budgets, length, batch):
    cases = []
    if "dense" in methods:
        cases.append({"method": "dense", "budget": None, "length": length, "batch": batch})
    for budget in budgets:
        for m in ("quest", "flexicache"):
            if m in methods:
                cases.append({"method": m, "budget": budget, "length": length, "batch": batch})
    return cases


def _decode_groups(args) -> list[dict]:
    models = [m for m in args.models.split(",") if m]
    lengths, batches, budgets = _ints(args.lengths), _ints(args.batches), _ints(args.budgets)
    methods = [m for m in args.methods.split(",") if m]

    # The issue-7 targets come first (SmolLM2, 16k/32k/4k), so a run cut short still answers them.
    def priority(key):
        model, length, batch = key
        return (models.index(model), [16384, 32768, 4096].index(length) if length in (16384, 32768, 4096) else 3,
                batch, length)

    keys = sorted(((m, l, b) for m in models for l in lengths for b in batches), key=priority)
    groups = []
    for model, length, batch in keys:
        groups.append({"kind": "decode", "model": model, "lengths": [length], "steps": args.steps,
                       "layers": args.llama_layers if model == "llama8b" else None, "threads": args.threads,
                       "unstable_fraction": args.unstable_fraction,
                       "cases": _method_cases(methods, budgets, length, batch)})
    return groups


def _case_key(model: str, case: dict) -> tuple:
    budget = case.get("budget") if case["method"] in ("quest", "flexicache") else None
    return (model, case["method"], budget, case["length"], case.get("batch", 1))


def _run_suite(name: str, groups: list[dict], args, out: Path) -> list[dict]:
    from .bench_common import environment, log, write_json

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
    length = _ints(args.batch_length)[0]
    budgets = _ints(args.budgets)[:1]
    methods = [m for m in args.methods.split(",") if m]
    model = [m for m in args.models.split(",") if m][0]
    groups = [{"kind": "batch", "model": model, "lengths": [length], "steps": args.steps, "threads": args.threads,
               "unstable_fraction": args.unstable_fraction,
               "layers": args.llama_layers if model == "llama8b" else None,
               "cases": _method_cases(methods, budgets, length, b)} for b in _ints(args.batch_sizes)]
    return _run_suite("batch", groups, args, out)


def suite_prefill(args, out: Path):
    model = [m for m in args.models.split(",") if m][0]
    budget = _ints(args.budgets)[0]
    cases = []
    for length in _ints(args.prefill_lengths):
        cases += [{"method": m, "budget": budget, "length": length} for m in ("dense", "flexicache")]
    groups = [{"kind": "prefill", "model": model, "lengths": _ints(args.prefill_lengths), "threads": args.threads,
               "unstable_fraction": args.unstable_fraction, "cases": cases,
               "layers": args.llama_layers if model == "llama8b" else None}]
    return _run_suite("prefill", groups, args, out)


def suite_rerank(args, out: Path):
    """Fig. 8 from the decode results: scoring + selection per step, FlexiCache against Quest."""
    from .bench_common import write_json

    path = out / "decode.json"
    if not path.exists():
        print("bench rerank: needs decode results (run the decode suite first)", file=sys.stderr)
        return []
    decode = json.loads(path.read_text())["results"]
    rows = []
    index = {(r["model"], r["method"], r["budget"], r["length"], r["batch"]): r for r in decode}
    for (model, method, budget, length, batch), r in sorted(index.items(), key=lambda kv: str(kv[0])):
        if method != "flexicache":
            continue
        q = index.get((model, "quest", budget, length, batch))
        if q is None:
            continue
        f_sel = r["breakdown_ms"]["scoring"] + r["breakdown_ms"]["selection"]
        q_sel = q["breakdown_ms"]["scoring"] + q["breakdown_ms"]["selection"]
        rows.append({"model": model, "budget": budget, "length": length, "batch": batch,
                     "flexicache_score_select_ms": f_sel, "quest_score_select_ms": q_sel,
                     "score_select_speedup": q_sel / f_sel if f_sel else None,
                     "flexicache_step_ms": r["step_ms_mean"], "quest_step_ms": q["step_ms_mean"],
                     "end_to_end_speedup": q["step_ms_mean"] / r["step_ms_mean"],
                     "unstable_share": r.get("unstable_share")})
    write_json(out / "rerank.json", {"suite": "rerank", "source": str(path.name), "results": rows})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return _worker(json.loads(argv[1]))
    parser = _parser()
    args = parser.parse_args(argv)
    suites = list(SUITES) if "all" in args.suites else args.suites
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"flexicache bench: unknown suite(s) {unknown}; choose from {', '.join(SUITES)} or all", file=sys.stderr)
        return 2
    if args.smoke:  # tiny sizes, except where the command line chose a value
        smoke = dict(models="tiny", lengths="256,512", batches="1,2", budgets="64,128", steps=4, prefill_lengths="128",
                     batch_length="256", batch_sizes="1,2", memory_lengths="256,512", promotion_budgets="64")
        for key, value in smoke.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for suite in suites:
        if suite == "decode":
            suite_decode(args, out)
        elif suite == "prefill":
            suite_prefill(args, out)
        elif suite == "batch":
            suite_batch(args, out)
        elif suite == "rerank":
            suite_rerank(args, out)
        elif suite == "memory":
            from .bench_memory import suite_memory

            suite_memory(args, out)
        elif suite == "promotion":
            from .bench_memory import suite_promotion

            suite_promotion(args, out)
        elif suite == "report":
            from .bench_report import write_report

            write_report(out, Path(args.docs) if args.docs else out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

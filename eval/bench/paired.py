"""`flexicache bench paired`: FlexiCache's decode step against the floor's, interleaved step by step in one worker.

The decode suite times its cases one after another; on a shared machine the load drifts between them (the floor, one
and the same computation at 16k and at 32k, measured 125-198 ms per step at batch 4 within one set of runs), so a
ratio of two cases' means moves by as much as the changes it is meant to show. Here one worker holds both caches
(FlexiCache over `length` tokens, the floor's `DynamicCache` over `budget` tokens, both written with random K/V as
the decode suite writes them) and times their steps in turn, in ABBA order (floor, FlexiCache, FlexiCache, floor,
...), so a drift lands on both about equally. Each case reports both sides' median and mean step and the median of
the per-step ratios (FlexiCache's step i over the floor's step i). Results go to `<out>/paired.json`, the table to
`<out>/paired.md`.

    flexicache bench paired --models smollm2 --lengths 16k,32k --batches 1,4 --budgets 1024 --steps 64

With `--paired-variant FIELDS` the two sides are FlexiCache (`--cache-options`) and FlexiCache with FIELDS on top
(e.g. `carry_pages=0`), both over the whole context: the cost of an option at the same bytes.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from fc_hf.compat import cache_kwarg

from ..methods import make_cache, parse_cache_options, prepare_model
from .common import (base_config, decode_step, environment, ingest_random_kv, log, now, parse_sizes, release_memory,
                     run_worker, write_json)

__all__ = ["paired_case", "suite_paired", "markdown_table", "sides"]


def paired_case(model, config, budget: int, length: int, batch: int, steps: int, profile, options=None,
                device="cpu", variant: dict | None = None) -> dict:
    """Time `steps` decode steps of FlexiCache (context `length`) and of the floor (dense over `min(budget, length)`
    tokens) alternately, after the first step of each (FlexiCache's first ranking) untimed.

    With `variant` (`FlexiCacheConfig` fields on top of `options`) the first side is FlexiCache with `options` instead
    of the floor, the second FlexiCache with `variant` too, both over `length` tokens: keys `flexicache_*` and
    `variant_*`, ratios variant / FlexiCache."""
    floor_tokens = min(budget, length)
    kwarg = cache_kwarg(model)
    sides = {}
    if variant is None:
        plan = (("floor", "dense", floor_tokens, None), ("flexicache", "flexicache", length, options))
    else:
        plan = (("flexicache", "flexicache", length, options),
                ("variant", "flexicache", length, {**(options or {}), **variant}))
    with torch.no_grad():
        for name, method, context, fields in plan:
            base = base_config(fields, budget) if method == "flexicache" else None
            cache = make_cache(method, config, budget, profile, base=base, dense_cache=True)
            ingest_random_kv(cache, config, batch, context, device=device)
            token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
            prepare_model(model, method)
            token = decode_step(model, cache, kwarg, token.to(device), context)  # untimed: the first ranking
            sides[name] = {"method": method, "cache": cache, "token": token, "context": context, "times": []}
        first, second = (name for name, *_ in plan)
        for i in range(steps):
            order = (first, second) if i % 2 == 0 else (second, first)  # ABBA
            for name in order:
                side = sides[name]
                prepare_model(model, side["method"])  # outside the timer: a config switch
                t0 = now(device)
                side["token"] = decode_step(model, side["cache"], kwarg, side["token"], side["context"] + 1 + i)
                side["times"].append((now(device) - t0) * 1e3)
    base, other = sides[first]["times"], sides[second]["times"]
    ratios = [b / a for b, a in zip(other, base)]
    result = {"budget": budget, "length": length, "batch": batch, "steps": steps}
    if variant is None:
        result["floor_tokens"] = floor_tokens
    else:
        result["variant"] = dict(variant)
    for name, times in ((first, base), (second, other)):
        result.update({f"{name}_ms": times, f"{name}_median_ms": statistics.median(times),
                       f"{name}_mean_ms": sum(times) / steps})
    result.update({"ratio_of_medians": statistics.median(other) / statistics.median(base),
                   "ratio_of_means": sum(other) / sum(base), "median_step_ratio": statistics.median(ratios)})
    if options:
        result["options"] = dict(options)
    for name, side in sides.items():
        if side["method"] == "flexicache":  # K/V pages, refinement candidates and metadata, counted by the cache
            result[f"{name}_bytes_read_per_step"] = side["cache"].stats()["bytes_read_per_step"]
        del side["cache"]
    release_memory()
    return result


def sides(result: dict) -> tuple[str, str]:
    """The two sides of a `paired_case` result, as its keys name them: the reference first."""
    return ("flexicache", "variant") if "variant" in result else ("floor", "flexicache")


def markdown_table(results: list[dict]) -> str:
    """The rows of one run (all floor-paired, or all variant-paired: the columns name the sides)."""
    a, b = sides(results[0]) if results else ("floor", "flexicache")
    label = {"floor": "floor", "flexicache": "FlexiCache", "variant": "variant"}
    head = ["model", "context", "batch", "budget", "steps", f"{label[a]} median / mean (ms)",
            f"{label[b]} median / mean (ms)", "ratio of medians", "ratio of means", "median step ratio",
            "MB read per step (FlexiCache sides)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(results, key=lambda r: (r["model"], r["length"], r["batch"], r["budget"])):
        lines.append("| " + " | ".join([
            r["model"], f"{r['length'] // 1024}k" if r["length"] % 1024 == 0 else str(r["length"]), str(r["batch"]),
            str(r["budget"]), str(r["steps"]), f"{r[a + '_median_ms']:.1f} / {r[a + '_mean_ms']:.1f}",
            f"{r[b + '_median_ms']:.1f} / {r[b + '_mean_ms']:.1f}", f"{r['ratio_of_medians']:.2f}×",
            f"{r['ratio_of_means']:.2f}×", f"{r['median_step_ratio']:.2f}×",
            " / ".join(f"{r[k] / 1e6:.1f}" for k in (a + "_bytes_read_per_step", b + "_bytes_read_per_step") if k in r)
            or "-"]) + " |")
    return "\n".join(lines)


def suite_paired(args, out: Path) -> list[dict]:
    """One worker per (model, length, batch), every budget in it; see the module docstring."""
    options = parse_cache_options(args.cache_options)
    variant = parse_cache_options(args.paired_variant) if args.paired_variant else None
    results = []
    for model in [m for m in args.models.split(",") if m]:
        for length in parse_sizes(args.lengths):
            for batch in parse_sizes(args.batches):
                cases = [{"method": "paired", "budget": b, "length": length, "batch": batch,
                          **({"options": dict(options)} if options else {}),
                          **({"paired_variant": variant} if variant else {})} for b in parse_sizes(args.budgets)]
                spec = {"kind": "paired", "model": model, "lengths": [length], "steps": args.steps,
                        "threads": args.threads, "unstable_fraction": args.unstable_fraction,
                        "layers": args.llama_layers if model == "llama8b" else None, "cases": cases}
                t0 = time.perf_counter()
                done, rc = run_worker("_worker", spec, args.timeout)  # decode.worker runs the "paired" kind
                results.extend(done)
                log(f"bench paired: {model} {length} b={batch} [{time.perf_counter() - t0:.0f} s]"
                    + ("" if rc == 0 else f"; the worker ended with {rc}, kept {len(done)} results"))
    table = markdown_table(results)
    env = environment()
    against = "the floor" if variant is None else f"FlexiCache with {args.paired_variant} (variant)"
    header = (f"FlexiCache against {against}, steps interleaved in one worker (`flexicache bench paired`), "
              f"{args.steps} steps each after the first; torch {env['torch']}, {env['cpus']} CPU(s), "
              f"load {env.get('loadavg_1m', float('nan')):.1f} at the end.")
    write_json(out / "paired.json", {"suite": "paired", "env": env, "argv": sys.argv[1:], "results": results})
    (out / "paired.md").write_text(header + "\n\n" + table + "\n")
    print(header + "\n\n" + table)
    return results

"""`python -m eval.bench.trees --other DIR`: this tree's FlexiCache decode step against another checkout's, ABBA.

`flexicache bench paired` compares two settings inside one process; two versions of the code cannot share one. Here
two resident workers, one per tree (each imports its own `fc_hf`, `kernels` and `eval`; the other tree needs only
the same installed packages), hold a cache built the same way (random K/V, the bench's model shape and profile), and
the parent asks them for one decode step at a time in ABBA order (other, this, this, other, ...), so load drift lands
on both sides alike. Each worker times its own step; only one runs at a time. Prints the table with the ratios of
medians and of means (this tree / the other) and writes it to `--out` when given.

    python -m eval.bench.trees --other ../flexicache-old --lengths 16k,32k --batches 1,4 --steps 48 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Runs inside each tree (cwd = the tree), so only names both trees have are used (`bench_cache` where it exists).
WORKER = r"""
import importlib.machinery, json, os, sys, time


class TreeFinder:  # the installed package maps fc_hf.kernels / .eval / .profiles to its own tree: map them to this one
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in ("fc_hf.kernels", "fc_hf.eval", "fc_hf.profiles"):
            return importlib.machinery.PathFinder.find_spec(name, [os.getcwd()])
        return None


sys.meta_path.insert(0, TreeFinder)
import torch
from eval.bench.common import (base_config, bench_profile, build_model, decode_step, ingest_random_kv,
                               model_config)
from eval.methods import make_cache, prepare_model
from fc_hf.compat import cache_kwarg
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
torch.manual_seed(0)
config = model_config(spec["model"], max_positions=max(8192, spec["length"] + spec["steps"] + 64))
model = build_model(config)
profile, _ = bench_profile(config, 0.25, prefer_shipped=spec["model"] == "smollm2")
kwarg = cache_kwarg(model)
with torch.no_grad():
    try:  # a tree whose FlexiCache is allocated for a capacity: room for the steps timed, as generate would size it
        from eval.bench.common import bench_cache
    except ImportError:
        cache = make_cache("flexicache", config, spec["budget"], profile, base=base_config(None, spec["budget"]),
                           dense_cache=True)
    else:
        cache = bench_cache("flexicache", config, spec["budget"], profile, base=base_config(None, spec["budget"]),
                            tokens=spec["length"] + spec["steps"] + 1)
    ingest_random_kv(cache, config, spec["batch"], spec["length"])
    prepare_model(model, "flexicache")
    token = torch.randint(1, config.vocab_size, (spec["batch"], 1), generator=torch.Generator().manual_seed(0))
    position = spec["length"]
    token = decode_step(model, cache, kwarg, token, position)  # untimed: the first ranking
    stats = getattr(cache, "stats", lambda: {})()
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        position += 1
        t0 = time.perf_counter()
        token = decode_step(model, cache, kwarg, token, position)
        print("@@" + json.dumps({"ms": (time.perf_counter() - t0) * 1e3}), flush=True)
    stats = getattr(cache, "stats", lambda: {})()
    print("@@" + json.dumps({"bytes_read_per_step": stats.get("bytes_read_per_step")}), flush=True)
"""


def _reply(proc: subprocess.Popen) -> dict:
    """The worker's next message (lines starting "@@"; anything else it prints is passed through)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker ended (exit code {proc.wait()})")
        if line.startswith("@@"):
            return json.loads(line[2:])
        print(line, end="", file=sys.stderr)


def _start(tree: Path, spec: dict) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(spec)], cwd=tree, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if _reply(proc).get("ready") is not True:
        raise RuntimeError(f"the worker in {tree} did not start")
    return proc


def _step(proc: subprocess.Popen) -> float:
    proc.stdin.write("step\n")
    proc.stdin.flush()
    return _reply(proc)["ms"]


def _finish(proc: subprocess.Popen):
    proc.stdin.write("end\n")
    proc.stdin.flush()
    last = _reply(proc)
    proc.wait()
    return last.get("bytes_read_per_step")


def paired_trees(this: Path, other: Path, spec: dict) -> dict:
    """One case: both workers started, `spec["steps"]` steps each in ABBA order; medians and means and their ratios (the
    median is a typical step, the mean the decode throughput, a re-rank stall included)."""
    procs = {"other": _start(other, spec), "this": _start(this, spec)}
    times = {"other": [], "this": []}
    for i in range(spec["steps"]):
        for side in (("other", "this") if i % 2 == 0 else ("this", "other")):
            times[side].append(_step(procs[side]))
    read = {side: _finish(proc) for side, proc in procs.items()}
    med = {side: statistics.median(t) for side, t in times.items()}
    mean = {side: statistics.fmean(t) for side, t in times.items()}  # decode throughput: re-rank stalls included
    low, high = _ratio_of_means_interval(times["other"], times["this"])
    return {**spec, "other_median_ms": med["other"], "this_median_ms": med["this"],
            "ratio_of_means_95": (low, high),
            "ratio_of_medians": med["this"] / med["other"],
            "other_mean_ms": mean["other"], "this_mean_ms": mean["this"], "ratio_of_means": mean["this"] / mean["other"],
            "median_step_ratio": statistics.median(b / a for a, b in zip(times["other"], times["this"])),
            "this_bytes_read_per_step": read["this"]}


def _ratio_of_means_interval(other: list, this: list, draws: int = 2000) -> tuple:
    """A 95% bootstrap interval of mean(this) / mean(other), resampling the ABBA pairs (step i of each side together),
    so load that hit both sides of a pair stays paired."""
    import random

    rng, n = random.Random(0), len(this)
    ratios = sorted(sum(this[j] for j in pick) / sum(other[j] for j in pick)
                    for pick in ([rng.randrange(n) for _ in range(n)] for _ in range(draws)))
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", required=True, help="the other checkout (e.g. a `git worktree` of the old commit)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", default="16k,32k")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the table (markdown) here")
    args = p.parse_args(argv)
    from .common import parse_sizes

    this, other = Path(__file__).resolve().parents[2], Path(args.other).resolve()
    rows = ["| context | batch | other median (ms) | this median (ms) | ratio of medians | median step ratio | other mean "
            "(ms) | this mean (ms) | ratio of means (95% interval) | this: bytes read per step (MB) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for length in parse_sizes(args.lengths):
        for batch in parse_sizes(args.batches):
            spec = {"model": args.model, "length": length, "batch": batch, "budget": args.budget,
                    "steps": args.steps, "threads": args.threads}
            r = paired_trees(this, other, spec)
            rows.append(f"| {length // 1024}k | {batch} | {r['other_median_ms']:.1f} | {r['this_median_ms']:.1f} | "
                        f"{r['ratio_of_medians']:.3f}× | {r['median_step_ratio']:.3f}× | {r['other_mean_ms']:.1f} | "
                        f"{r['this_mean_ms']:.1f} | {r['ratio_of_means']:.3f}× ({r['ratio_of_means_95'][0]:.3f}-"
                        f"{r['ratio_of_means_95'][1]:.3f}) | "
                        f"{(r['this_bytes_read_per_step'] or float('nan')) / 1e6:.2f} |")
            print(rows[-1], flush=True)
    table = (f"This tree ({this.name}) against {other.name}, {args.model}, budget {args.budget}, {args.steps} steps "
             f"each, ABBA, {args.threads} thread(s) per worker.\n\n" + "\n".join(rows) + "\n")
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()

"""`python -m eval.bench.compiled`: FlexiCache's decode step eager against compiled (inductor), on a CPU, one process.

Two FlexiCaches filled alike (random K/V through `cache.update`, as `flexicache bench decode` fills one) hold the same
tokens; one is stepped by the model eagerly, the other by `torch.compile(model, fullgraph=True, dynamic=False)` (the
decode step generate compiles), steps alternating so load drift lands on both. The compiled side's first steps compile
(timed apart); every step's next token must be the same on both sides. Prints medians, means and their ratio.

    python -m eval.bench.compiled --model smollm2 --length 16k --batch 4 --steps 48 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def run(model_name: str, length: int, batch: int, steps: int, budget: int, layers: int | None, backend: str,
        warmup: int) -> dict:
    from .common import decode_step, filled_flexicache, flexicache_model

    held = length + steps + warmup
    config, model, profile, kwarg = flexicache_model(model_name, held, layers)
    caches = [filled_flexicache(config, profile, budget, batch, length, held) for _ in range(2)]
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
    tokens = {"eager": token, "compiled": token}
    times = {"eager": [], "compiled": []}
    first = []
    with torch.no_grad():
        for i in range(warmup + steps):
            order = ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")
            for side in order:
                t0 = time.perf_counter()
                tokens[side] = decode_step(model if side == "eager" else compiled, caches[side == "compiled"], kwarg,
                                           tokens[side], length + i)
                ms = (time.perf_counter() - t0) * 1e3
                if i < warmup:
                    if side == "compiled":
                        first.append(ms)
                else:
                    times[side].append(ms)
            if not torch.equal(tokens["eager"], tokens["compiled"]):
                raise AssertionError(f"step {i + 1}: the compiled step chose other tokens than the eager one")
    med = {s: statistics.median(t) for s, t in times.items()}
    mean = {s: statistics.fmean(t) for s, t in times.items()}
    return {"model": model_name, "layers": config.num_hidden_layers, "length": length, "batch": batch,
            "steps": steps, "backend": backend, "eager_median_ms": med["eager"], "compiled_median_ms": med["compiled"],
            "eager_mean_ms": mean["eager"], "compiled_mean_ms": mean["compiled"],
            "ratio_of_medians": med["compiled"] / med["eager"], "ratio_of_means": mean["compiled"] / mean["eager"],
            "warmup_ms": first}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", default="16k")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (the compiled side compiles in them)")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a shorter compile)")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from .common import parse_sizes

    torch.set_num_threads(args.threads)
    r = run(args.model, parse_sizes(args.length)[0], args.batch, args.steps, args.budget, args.layers, args.backend,
            args.warmup)
    print(f"{r['model']} ({r['layers']} layers), {r['length']} tokens, batch {r['batch']}, budget {args.budget}, "
          f"{args.threads} thread(s), {r['steps']} steps each alternating, same tokens on both sides; compiled "
          f"({r['backend']}) warm-up steps (ms): {', '.join(f'{x:.0f}' for x in r['warmup_ms'])}\n")
    print("| side | median (ms) | mean (ms) |\n|---|---|---|")
    print(f"| eager | {r['eager_median_ms']:.1f} | {r['eager_mean_ms']:.1f} |")
    print(f"| compiled | {r['compiled_median_ms']:.1f} | {r['compiled_mean_ms']:.1f} |")
    print(f"| compiled / eager | {r['ratio_of_medians']:.3f}× | {r['ratio_of_means']:.3f}× |")


if __name__ == "__main__":
    main()

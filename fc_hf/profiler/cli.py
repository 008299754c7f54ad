"""`flexicache profile`: trace dense decoding on offline tasks, classify heads, write a profile and plots.

    flexicache profile --model smollm2-135m-instruct --tasks kjv-continue,kjv-recall,ruler-niah \\
        --samples 2 --prompt-tokens 4096 --new-tokens 256 --budget 1024 --page-size 16 \\
        --out profiles/smollm2-135m-instruct.json

    # the same profile without one task (evaluate on that task without leakage)
    flexicache profile --from profiles/smollm2-135m-instruct.json --exclude kjv-recall --out /tmp/no-recall.json

    # rebuild profile and plots from saved traces (--trace-dir of an earlier run), no model run
    flexicache profile --model smollm2-135m-instruct --from-traces traces/smollm2 --out profiles/smollm2-135m-instruct.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from .tasks import TASKS

DEFAULT_TASKS = "kjv-continue,kjv-recall,kjv-summary,ruler-niah"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flexicache profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="bundled model name (fc_hf.assets), a local folder, or a hub id")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma-separated, from {','.join(TASKS)}")
    p.add_argument("--samples", type=int, default=2, help="samples per task")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=256, help="decode steps traced per sample (D)")
    p.add_argument("--budget", type=int, default=1024, help="token budget B (K = B / page size)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--window", type=int, default=16, help="TS window W")
    p.add_argument("--unstable-fraction", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 is fastest on a shared CPU)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--plots-dir", default=None, help="where PNGs go (default: <out dir>/plots); 'none' to skip")
    p.add_argument("--plot-layer", type=int, default=None, help="layer of the RCO-vs-offset plot (default: widest TS spread)")
    p.add_argument("--trace-dir", default=None, help="also save each sample's trace here (torch files)")
    p.add_argument("--from-traces", default=None, help="build from traces saved by --trace-dir instead of running the model")
    p.add_argument("--from", dest="from_profile", default=None, help="derive from an existing profile (with --exclude)")
    p.add_argument("--exclude", default="", help="with --from: comma-separated tasks to leave out")
    return p


def _derive(args) -> int:
    from fc_hf.profile import HeadProfile

    from .build import profile_excluding

    base = HeadProfile.load(args.from_profile)
    derived = profile_excluding(base, [t for t in args.exclude.split(",") if t])
    derived.extra["command"] = "flexicache profile " + shlex.join(sys.argv[1:] if args._argv is None else args._argv)
    derived.save(args.out)
    print(f"wrote {args.out}: {len(derived.unstable)} unstable heads from tasks {sorted(derived.extra['tasks'])}")
    return 0


def _load_model(name: str, dtype):
    try:
        from fc_hf.assets import MODELS, load_model
    except ImportError:  # assets unavailable: plain transformers loading
        MODELS, load_model = {}, None
    if load_model is not None:
        return load_model(name, dtype=dtype, attn_implementation="sdpa")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(name)


def _model_folder(name: str):
    """Local folder of a bundled model name (without converting anything), or None."""
    try:
        from fc_hf import assets
    except ImportError:
        return None
    if name in getattr(assets, "MODELS", {}):
        return assets.model_path(name)
    return None


def _load_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(_model_folder(name) or name))


def _identity(name: str, config) -> tuple[str, str | None, dict]:
    """(model_id, revision, source) recorded in the profile: the hub id and the exact weights when known."""
    folder = _model_folder(name)
    marker = folder / "flexicache_asset.json" if folder else None
    if marker is not None and marker.is_file():
        info = json.loads(marker.read_text())
        revision = f"{' '.join(info.get('source', []))} {info.get('gguf_file', '')} sha256:{info.get('gguf_sha256', '?')}"
        return info.get("hub_id") or name, revision.strip(), {"bundled_name": name, **info}
    return name, getattr(config, "_commit_hash", None), {}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pick_layer(mean_ts) -> int:
    spread = mean_ts.amax(1) - mean_ts.amin(1)
    return int(spread.nan_to_num(-1).argmax())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args._argv = argv
    if args.from_profile:
        return _derive(args)
    if not args.model:
        print("flexicache profile: --model is required (or --from PROFILE --exclude TASKS)", file=sys.stderr)
        return 2

    import torch
    from tqdm.auto import tqdm

    from .build import analyse, make_profile
    from .plots import plot_overlap, plot_rco_by_offset, plot_ts_by_layer
    from .tasks import build_prompt
    from .trace import Trace, collect_trace

    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        print(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}", file=sys.stderr)
        return 2
    if args.budget % args.page_size:
        print(f"--budget ({args.budget}) must be a multiple of --page-size ({args.page_size})", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    command = "flexicache profile " + shlex.join(sys.argv[1:] if argv is None else argv)
    traces: dict[str, list[Trace]] = {t: [] for t in tasks}
    if args.from_traces:
        config = _load_config(args.model)
        for task in tasks:
            files = sorted(Path(args.from_traces).glob(f"{task}-*.pt"))
            if not files:
                print(f"no traces for {task} in {args.from_traces}", file=sys.stderr)
                return 2
            traces[task] = [Trace.load(f) for f in files[: args.samples]]
            k = {t.topk.shape[-1] for t in traces[task]}
            if k != {args.budget // args.page_size}:
                print(f"traces of {task} hold K={sorted(k)} pages per head, but --budget/--page-size give "
                      f"{args.budget // args.page_size}; pass the settings they were made with", file=sys.stderr)
                return 2
        run_info = Path(args.from_traces) / "run.json"
        trace_run = json.loads(run_info.read_text()) if run_info.is_file() else None
    else:
        model, tokenizer = _load_model(args.model, dtype)
        config = model.config
        trace_dir = Path(args.trace_dir) if args.trace_dir else None
        if trace_dir:
            trace_dir.mkdir(parents=True, exist_ok=True)
            (trace_dir / "run.json").write_text(json.dumps({"command": command, "started": _now()}, indent=1) + "\n")
        steps = tqdm(total=len(tasks) * args.samples * args.new_tokens, desc="decode steps", unit="tok")
        # sample-major order: if a long run is stopped early, --from-traces still has every task
        for i in range(args.samples):
            for task in tasks:
                steps.set_postfix_str(f"{task} #{i}")
                prompt = build_prompt(task, tokenizer, args.prompt_tokens, sample=i, seed=args.seed)
                trace = collect_trace(model, prompt.input_ids, args.new_tokens, page_size=args.page_size,
                                      token_budget=args.budget, tokenizer=tokenizer, progress=steps)
                traces[task].append(trace)
                if trace_dir:
                    trace.save(trace_dir / f"{task}-{i:03d}.pt")
                tqdm.write(f"{task} #{i}: {trace.prompt_len} prompt tokens -> "
                           f"{tokenizer.decode(trace.tokens[:60])!r}...")
        steps.close()

    analysis = analyse(traces, window=args.window, unstable_fraction=args.unstable_fraction, seed=args.seed)
    import transformers

    settings = {
        "page_size": args.page_size,
        "token_budget": args.budget,
        "pages_per_head": args.budget // args.page_size,
        "window": args.window,
        "unstable_fraction": args.unstable_fraction,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "seed": args.seed,
        "prompts": "generated offline by fc_hf.profiler.tasks (KJV text, RULER-style needles); greedy dense decoding, EOS suppressed",
        "command": command,
        "created": _now(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    plot_layer = args.plot_layer if args.plot_layer is not None else _pick_layer(analysis["mean_ts"])
    settings["plot_layer"] = plot_layer
    model_id, revision, source = _identity(args.model, config)
    if source:
        settings["model_source"] = source
    if args.from_traces:
        settings["built_from_traces"] = str(args.from_traces)
        if trace_run:
            settings["trace_command"] = trace_run.get("command")
    profile = make_profile(config, analysis, settings, model_id=model_id, revision=revision)
    out = profile.save(args.out)

    if (args.plots_dir or "").lower() != "none":
        plots = Path(args.plots_dir) if args.plots_dir else out.parent / "plots"
        plots.mkdir(parents=True, exist_ok=True)
        stem = out.stem
        unstable = profile.unstable
        plot_rco_by_offset(analysis["rco"], plot_layer, unstable, plots / f"{stem}_rco_layer{plot_layer}.png",
                           title=f"{args.model}: top-K overlap vs step offset, layer {plot_layer}")
        plot_overlap(analysis["overlap"], analysis["overlap_tasks"], plots / f"{stem}_overlap.png")
        plot_ts_by_layer(analysis["ts"], unstable, plots / f"{stem}_ts_layers.png")

    print(f"wrote {out}: {len(profile.unstable)} unstable of {profile.num_layers * profile.num_kv_heads} KV heads, "
          f"{analysis['windows']} windows")
    names = analysis["overlap_tasks"]
    print("cross-task overlap (rows/cols: " + ", ".join(names) + ")")
    for name, row in zip(names, analysis["overlap"].tolist()):
        print(f"  {name:14s} " + " ".join(f"{x:.2f}" for x in row))
    print(f"mean cross-task overlap: {analysis['mean_overlap']:.3f}")
    print(f"(a random set of {analysis['n_unstable']} heads overlaps by {analysis['chance_overlap']:.3f} on average)")
    so = analysis["sample_overlap"]
    if so["within_task"] is not None and so["across_tasks"] is not None:
        print(f"per-sample sets: mean overlap {so['within_task']:.3f} within a task, {so['across_tasks']:.3f} across tasks")
    if len(names) > 1:
        from .metrics import mean_overlap

        print(f"per-head mean TS, Spearman between tasks: mean {mean_overlap(analysis['ts_spearman']):.3f}")
    if analysis["heldout"]:
        h = analysis["heldout"]
        print(f"held-out recall: set {h['set_recall']:.3f}, window {h['window_recall']:.3f} (chance {h['chance']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

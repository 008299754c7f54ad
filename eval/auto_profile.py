"""Probe of `profile="auto"` (issue 16): how the online classification compares with a bundled offline profile.

Per sample (an L-Eval document the offline profiles were not built from, cut to `--prompt-tokens`):

A. `profile="auto"` with the largest warm-up `Wmax`, greedy, one step at a time: the warm-up trace of
   steps 1..Wmax is read before the classification, and classified again on its first W steps for every
   W of `--warmups` (the run up to step W is the same whatever W is: Quest); the run goes on to
   `Wmax + R + 1` steps, past the re-split and one stable re-rank.
B. the offline profile, the same number of steps.
C. zero warm-up: a prefill with `warmup_steps=0`, whose observation window is classified.
D. (`--dense-trace`) the profiler's dense trace of `Wmax` steps, classified the same way: what the same
   number of steps gives without Quest's own selections deciding the queries.

Reported: overlap `|A ∩ O| / |O|` of each set with the offline profile's O (chance: |O| / heads), per
sample and pooled over all samples (one classification over all rows, as for a batch); device KV bytes
after the run (auto vs offline), the Quest step time during the warm-up vs the profile's, the re-split step.

    python -m fc_hf.eval.auto_profile --model smollm2-135m-instruct --samples 6 --prompt-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

__all__ = ["probe", "main"]

TASKS = ("news_summ", "gov_report_summ", "financial_qa", "multidoc_qa", "patent_summ", "tv_show_summ")


def _samples(tokenizer, count: int, prompt_tokens: int, data: str) -> list[tuple[str, list[int]]]:
    """One prompt per document, round-robin over TASKS: the document's first tokens, then its first instruction.

    Reads the L-Eval JSONL files (`input`, `instructions`) directly; a plain prompt, no chat template
    (the classification needs long-context decoding, not a good answer).
    """
    docs = {}
    for task in TASKS:
        path = Path(data) / f"{task}.jsonl"
        if path.exists():
            docs[task] = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not docs:
        raise SystemExit(f"no L-Eval data in {data}: pass --data <folder of L-Eval open-ended JSONL files>")
    out, i = [], 0
    while len(out) < count and i < 1000:
        for task, records in docs.items():
            if i < len(records) and len(out) < count:
                tail = tokenizer(f"\n\nInstruction: {records[i]['instructions'][0]}\nAnswer:", add_special_tokens=False)
                room = prompt_tokens - len(tail["input_ids"])
                head = tokenizer(records[i]["input"], add_special_tokens=False)["input_ids"][:room]
                out.append((f"{task}#{i}", head + tail["input_ids"]))
        i += 1
    return out


def _greedy(model, cache, ids, steps: int, at_step=None):
    """Prefill + `steps` greedy steps, one forward each; returns per-step seconds. `at_step(step)` runs after each."""
    import torch

    from fc_hf.compat import cache_kwarg

    kw = {cache_kwarg(model): cache}
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
        times = []
        for step in range(1, steps + 1):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, use_cache=True, **kw)
            times.append(time.perf_counter() - t0)
            if at_step is not None:
                at_step(step)
    return times


def _overlap(found, offline) -> float | None:
    """`|found ∩ offline| / |offline|`; None when nothing was classified (no defined TS window)."""
    if found is None:
        return None
    return len(set(found) & set(offline)) / max(1, len(offline))


def probe(model, tokenizer, offline, prompts, warmups, budget: int = 1024, rerank: int = 16,
          dense_trace: bool = False) -> dict:
    import torch

    from fc_hf import FlexiCache, FlexiCacheConfig
    from fc_hf.online import TS_WINDOW, classify_trace

    wmax = max(warmups)
    steps = wmax + rerank + 1
    base = dict(token_budget=budget, rerank_interval=rerank)
    rows, traces = [], {w: [] for w in warmups}
    zero_traces, dense_traces = [], {w: [] for w in warmups}
    for name, ids in prompts:
        ids_t = torch.tensor([ids])
        auto = FlexiCache(model.config, FlexiCacheConfig(warmup_steps=wmax, **base), "auto")
        grabbed = {}

        def at_step(step, cache=auto):
            if step == wmax:
                grabbed["trace"] = cache.auto.trace()
                grabbed["quest_memory"] = cache.memory_report()

        t_auto = _greedy(model, auto, ids_t, steps, at_step)
        found_run = auto.profile_found()
        row = {"sample": name, "prompt_tokens": len(ids), "auto_memory": auto.memory_report(),
               "quest_memory_at_wmax": grabbed["quest_memory"], "step_s_auto": t_auto}
        (trace,) = grabbed["trace"]
        for w in warmups:
            prefix = (trace[0][:w], trace[1][:w])
            traces[w].append(prefix)
            found, _ = classify_trace([prefix], auto.cache_config.unstable_fraction, min(TS_WINDOW, w))
            row[f"overlap_w{w}"] = _overlap(found, offline.unstable)
            if w == wmax:
                assert found == found_run.unstable, "the run's classification differs from its own trace's"
        auto.release()
        ref = FlexiCache(model.config, FlexiCacheConfig(**base), offline)
        row["step_s_offline"] = _greedy(model, ref, ids_t, steps)
        row["offline_memory"] = ref.memory_report()
        ref.release()
        zero = FlexiCache(model.config, FlexiCacheConfig(warmup_steps=0, **base), "auto")
        _greedy(model, zero, ids_t, 0)
        ztrace = zero.auto.trace()
        zero_traces += ztrace
        found, _ = classify_trace(ztrace, zero.cache_config.unstable_fraction)
        row["overlap_w0"] = _overlap(found, offline.unstable)
        zero.release()
        if dense_trace:
            from fc_hf.profiler import collect_trace

            t = collect_trace(model, ids_t, wmax, page_size=16, token_budget=budget, tokenizer=tokenizer)
            for w in warmups:
                dense_traces[w].append((t.topk[:w], t.num_pages[:w]))
                found, _ = classify_trace([(t.topk[:w], t.num_pages[:w])], 0.25, min(TS_WINDOW, w))
                row[f"dense_overlap_w{w}"] = _overlap(found, offline.unstable)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("step_s") and "memory" not in k}), flush=True)

    heads = offline.num_layers * offline.num_kv_heads
    rng = random.Random(0)
    everything = [(l, h) for l in range(offline.num_layers) for h in range(offline.num_kv_heads)]
    chance = sum(_overlap(rng.sample(everything, len(offline.unstable)), offline.unstable) for _ in range(2000)) / 2000
    pooled = {w: _overlap(classify_trace(traces[w], 0.25, min(TS_WINDOW, w))[0], offline.unstable) for w in warmups}
    pooled[0] = _overlap(classify_trace(zero_traces, 0.25)[0], offline.unstable)
    summary = {"pooled_overlap": pooled, "chance_overlap": chance, "chance_expected": len(offline.unstable) / heads,
               "offline_task_overlap": (offline.extra.get("overlap") or {}).get("mean"),
               "offline_sample_overlap": offline.extra.get("sample_overlap")}
    if dense_trace:
        summary["pooled_dense_overlap"] = {
            w: _overlap(classify_trace(dense_traces[w], 0.25, min(TS_WINDOW, w))[0], offline.unstable) for w in warmups}
    return {"rows": rows, "summary": summary, "warmups": list(warmups), "steps": steps, "budget": budget,
            "rerank_interval": rerank}


def step_times(model, offline, ids, warmup: int, budget: int = 1024, rerank: int = 16, after: int = 32) -> dict:
    """Per-step CPU seconds (`time.process_time`, this process only) and wall seconds of `profile="auto"` and the
    offline profile, their steps interleaved (auto step i, then offline step i) so both see the same machine load."""
    import torch

    from fc_hf import FlexiCache, FlexiCacheConfig
    from fc_hf.compat import cache_kwarg

    base = dict(token_budget=budget, rerank_interval=rerank)
    caches = {"auto": FlexiCache(model.config, FlexiCacheConfig(warmup_steps=warmup, **base), "auto"),
              "offline": FlexiCache(model.config, FlexiCacheConfig(**base), offline)}
    out = {name: {"cpu_s": [], "wall_s": []} for name in caches}
    with torch.inference_mode():
        logits = {}
        for name, cache in caches.items():
            logits[name] = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache}).logits
        for _ in range(warmup + after):
            for name, cache in caches.items():
                nxt = logits[name][:, -1].argmax(-1, keepdim=True)
                c0, w0 = time.process_time(), time.perf_counter()
                logits[name] = model(input_ids=nxt, use_cache=True, **{cache_kwarg(model): cache}).logits
                out[name]["cpu_s"].append(time.process_time() - c0)
                out[name]["wall_s"].append(time.perf_counter() - w0)
    a, o = out["auto"]["cpu_s"], out["offline"]["cpu_s"]
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    out["summary"] = {
        "warmup_steps": warmup,
        "cpu_s_warmup_auto": mean(a[1:warmup]), "cpu_s_warmup_offline": mean(o[1:warmup]),
        "cpu_s_resplit_step": a[warmup], "cpu_s_offline_same_step": o[warmup],
        "cpu_s_after_auto": mean(a[warmup + 1:]), "cpu_s_after_offline": mean(o[warmup + 1:]),
        "device_kv_bytes_auto": caches["auto"].memory_report()["device_kv_bytes"],
        "device_kv_bytes_offline": caches["offline"].memory_report()["device_kv_bytes"],
    }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--profile", default=None, help="offline profile (default: the bundled one of --model)")
    p.add_argument("--data", default="../shared/data/leval/open-ended", help="folder of L-Eval JSONL files")
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--warmups", default="16,32,48,64")
    p.add_argument("--dense-trace", action="store_true")
    p.add_argument("--timing", type=int, default=None, metavar="W",
                   help="instead: per-step CPU time of warm-up W vs the offline profile on the first sample (1 thread)")
    p.add_argument("--out", default="results/auto_profile")
    args = p.parse_args(argv)

    from fc_hf.profile import HeadProfile

    from .loading import load_model

    from fc_hf import register

    model, tokenizer, _ = load_model(args.model)
    register()
    model.set_attn_implementation("flexicache")
    offline = HeadProfile.load(args.profile or args.model, model.config)
    prompts = _samples(tokenizer, args.samples, args.prompt_tokens, args.data)
    warmups = [int(w) for w in args.warmups.split(",")]
    if args.timing is not None:
        import torch

        torch.set_num_threads(1)
        result = step_times(model, offline, torch.tensor([prompts[0][1]]), args.timing, budget=args.budget)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.model}-{args.prompt_tokens}-timing-w{args.timing}.json"
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps(result["summary"], indent=1))
        print(f"wrote {path}")
        return
    result = probe(model, tokenizer, offline, prompts, warmups, budget=args.budget, dense_trace=args.dense_trace)
    result.update({"model": args.model, "profile": args.profile or f"profiles/{args.model}.json",
                   "prompt_tokens": args.prompt_tokens, "command": "python -m fc_hf.eval.auto_profile " + " ".join(
                       argv if argv is not None else __import__("sys").argv[1:])})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.model}-{args.prompt_tokens}.json"
    path.write_text(json.dumps(result, indent=1, default=list))
    print(json.dumps(result["summary"], indent=1, default=list))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

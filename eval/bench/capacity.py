"""Capacity under one device-KV cap (issue 28), and what reading stable pages back costs a chunked prefill.

`capacity`: the device may hold no more KV than dense needs at `--capacity-cap` tokens (16k). Per method, the
longest prompt that can be prefilled and then decoded for 64 tokens under that cap, and the largest batch at
the cap's length. Device KV counted as a real prefill holds it: what the cache holds (`memory_report`'s
`peak_device_kv_bytes`, counted by the cache itself: its store, allocated at the first chunk for the prompt and the
64 decode steps, `max_cache_len`, as generate sizes it) plus the K/V of one layer that the prefill forward itself
computes for the tokens it is given (the whole prompt unchunked, one chunk chunked; a chunk on a filled cache
attends over views of the store, no copy). Methods:

- `dense`: `DynamicCache`, analytic (it holds exactly its tokens, plus the forward's one layer: during a chunk's
  `torch.cat` the layer's previous K/V are held once more). The cap is dense's peak at the cap's length, so dense
  fits exactly that length at batch 1;
- `offload`: `DynamicCache(offloading=True)`, analytic (CUDA only): two layers on the device (the one computing,
  the next one prefetched); every decode step moves the whole KV host -> device and back;
- `flexicache`: one prefill; `flexicache-chunked`: `prefill_chunk_size` chunks; both counted on the model's shape,
  the cache filled by the very `update` calls a prefill makes (random K/V, as `flexicache bench decode` does),
  then 64 decode steps of the model. The shape's positions are extended (random weights: memory, not accuracy).

The lengths scanned are multiples of the chunk; a length counts as fitting when its peak is within the cap. Each
counted case also records the device bytes after every chunk and decode step (the plot) and the bytes moved
host <-> device per decode step (promotions and offloads, from `FlexiCache.stats()`).

`chunked-prefill`: the time of a real prefill (the model over random tokens) of `--chunk-lengths` tokens with
`DynamicCache` and FlexiCache, unchunked and with `prefill_chunk_size`, alternating the four in one worker so load
drift hits all of them; the ratio FlexiCache chunked / DynamicCache chunked is what chunking costs FlexiCache (its
chunks write the store and its MinMax entries and attend over every token held) beside what it costs dense.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from fc_hf.compat import cache_kwarg

from fc_hf.config import FlexiCacheConfig

from ..methods import make_cache
from .common import (bench_cache, bench_profile, build_model, decode_step, environment, log, model_config, parse_sizes,
                     run_worker, unstable_share, write_json)

__all__ = ["analytic_peak_fraction", "suite_capacity", "suite_chunked_prefill", "capacity_worker", "prefill_worker",
           "real_worker"]

DECODE_STEPS = 64
DEFAULTS = FlexiCacheConfig()


def analytic_peak_fraction(u: float, layers: int, length: int, budget: int = DEFAULTS.token_budget,
                           page_size: int = DEFAULTS.page_size, rerank: int = DEFAULTS.rerank_interval,
                           chunk: int | None = None) -> float:
    """FlexiCache's device KV at its peak as a share of dense's at `length`, from the design.

    The store is allocated once, at the first chunk, for every token it will hold: every page of the unstable heads
    (`u`) and each stable row's window of `K + ceil(R / P) + 1` pages, `(1 - u) (B + (ceil(R / P) + 1) P) / L`
    (`fc_hf/store.py`); prefill and decode hold the same. The peak is during the prefill, which adds the forward's own
    K/V of one layer for the tokens it is given (`1 / layers` of the prompt unchunked, of one chunk chunked); a chunk
    on a filled cache attends over views of the store (no read-back copy)."""
    forward = (chunk if chunk else length) / length / layers
    held = u + (1 - u) * min(1.0, (budget + (math.ceil(rerank / page_size) + 1) * page_size) / length)
    return held + forward


def _kv_bytes_per_token(config, dtype) -> int:
    from fc_hf.profile import attention_shape

    layers, kv_heads, head_dim = attention_shape(config)
    return layers * kv_heads * head_dim * 2 * dtype.itemsize


def _dense_peak(config, length: int, batch: int, chunk: int | None, dtype) -> int:
    """DynamicCache: every token of every layer, plus one layer of the forward's K/V (or of a chunk's `torch.cat`)."""
    per_token = _kv_bytes_per_token(config, dtype) * batch
    return per_token * (length + DECODE_STEPS) + per_token * length // config.num_hidden_layers


def _offload_peak(config, length: int, batch: int, chunk: int | None, dtype) -> int:
    """DynamicCache(offloading=True): the layer computing and the one prefetched, plus the forward's one layer."""
    layers = config.num_hidden_layers
    per_layer = _kv_bytes_per_token(config, dtype) * batch // layers
    forward = per_layer * (length if chunk is None else chunk)
    return 2 * per_layer * (length + DECODE_STEPS) + forward


def _counted_case(model, config, profile, length: int, batch: int, chunk: int | None, budget: int, dtype,
                  cap: int | None, record: bool) -> dict:
    """Fill a FlexiCache as a prefill would (chunked or not), decode 64 tokens; the counted peak and a trace."""
    from fc_hf.profile import attention_shape

    layers, kv_heads, head_dim = attention_shape(config)
    cache = bench_cache("flexicache", config, budget, profile, tokens=length + DECODE_STEPS)
    per_layer_token = kv_heads * head_dim * 2 * dtype.itemsize * batch
    gen = torch.Generator().manual_seed(length + batch)
    trace, forward_peak = [], 0
    sizes = [length] if chunk is None else [min(chunk, length - s) for s in range(0, length, chunk)]
    t0 = time.perf_counter()
    done = 0
    for size in sizes:
        for layer in range(layers):
            k = torch.randn(batch, kv_heads, size, head_dim, generator=gen).to(dtype)
            v = torch.randn(batch, kv_heads, size, head_dim, generator=gen).to(dtype)
            cache.update(k, v, layer)
            del k, v
        done += size
        forward_peak = max(forward_peak, cache.ledger.peak + size * per_layer_token)  # + the forward's own layer
        if record:
            trace.append({"phase": "prefill", "tokens": done, "device_kv_bytes": cache.ledger.current,
                          "peak_device_kv_bytes": cache.ledger.peak + size * per_layer_token})
    ingest_s = time.perf_counter() - t0
    kwarg = cache_kwarg(model)
    token = torch.ones(batch, 1, dtype=torch.long)
    before = cache.stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        for step in range(DECODE_STEPS):
            token = decode_step(model, cache, kwarg, token, length + step)
            if record:
                trace.append({"phase": "decode", "tokens": length + step + 1, "device_kv_bytes": cache.ledger.current,
                              "peak_device_kv_bytes": max(cache.ledger.peak, forward_peak)})
    decode_s = time.perf_counter() - t0
    after = cache.stats()
    report = cache.memory_report()
    peak = max(forward_peak, report["peak_device_kv_bytes"])
    moved = {key: (after[key] - before[key]) / DECODE_STEPS for key in ("bytes_promoted", "bytes_offloaded")}
    steady = cache.stats()
    out = {
        "length": length, "batch": batch, "chunk": chunk, "peak_bytes": peak,
        "cache_peak_bytes": report["peak_device_kv_bytes"], "device_kv_bytes_end": report["device_kv_bytes"],
        "metadata_bytes": report["metadata_bytes"], "host_kv_bytes": report["host_kv_bytes"],
        "dense_kv_bytes": report["dense_kv_bytes"], "fits": cap is None or peak <= cap,
        "promoted_bytes_per_step": moved["bytes_promoted"], "offloaded_bytes_per_step": moved["bytes_offloaded"],
        "ingest_s": ingest_s, "decode_s": decode_s, "reranks_stable": steady["reranks_stable"],
        "trace": trace,
    }
    cache.release()
    return out


def capacity_worker(spec: dict) -> None:
    """One model shape: the length scan and the batch scan of both FlexiCache variants (JSON lines on stdout)."""
    import json

    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    dtype = getattr(torch, spec["dtype"])
    config = _shape(spec)
    model = build_model(config, dtype=dtype)  # the K/V it decodes with are in the cache's dtype
    model.set_attn_implementation("flexicache")
    profile, label = _profile(spec, config)
    for case in spec["cases"]:
        result = _counted_case(model, config, profile, case["length"], case["batch"], case["chunk"], spec["budget"],
                               dtype, spec["cap_bytes"], case.get("record", False))
        result.update(method="flexicache-chunked" if case["chunk"] else "flexicache", profile=label,
                      shape=spec["shape"], unstable_share=unstable_share(profile, config))
        print(json.dumps(result), flush=True)


class _AfterPrefill:
    """A logits processor that only looks: at its first call (right after the prefill) it keeps the cache's memory
    report, counters and the time since it was made."""

    def __init__(self, cache):
        self.cache, self.t0, self.report = cache, time.perf_counter(), None

    def __call__(self, input_ids, scores):
        if self.report is None:
            self.prefill_s = time.perf_counter() - self.t0
            self.report, self.stats = self.cache.memory_report(), self.cache.stats()
        return scores


def real_worker(spec: dict) -> None:
    """A bundled model with its real weights and shipped profile: a real chunked prefill of real text, then 64
    greedy tokens; the counted peak, the device bytes after, the bytes moved per decode step (JSON lines)."""
    import json

    from fc_hf import register
    from fc_hf.assets import load_model, text_tokens

    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    register()
    model, tokenizer = load_model(spec["model"], dtype=getattr(torch, spec["dtype"]), attn_implementation="flexicache")
    profile, label = _profile({"shape": "qwen2.5-0.5b" if "qwen" in spec["model"] else "smollm2"}, model.config)
    for length in spec["lengths"]:
        ids = torch.tensor([text_tokens(tokenizer, length, 0)])
        cache = make_cache("flexicache", model, spec["budget"], profile)
        seen = _AfterPrefill(cache)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS + 1,
                           min_new_tokens=DECODE_STEPS + 1, do_sample=False, prefill_chunk_size=spec["chunk"],
                           pad_token_id=0, logits_processor=[seen], **{cache_kwarg(model): cache})
        decode_s = time.perf_counter() - t0 - seen.prefill_s
        prefill_s, after_prefill, before = seen.prefill_s, seen.report, seen.stats
        report, after = cache.memory_report(), cache.stats()
        per_token_layer = report["dense_kv_bytes"] // cache.get_seq_length() // model.config.num_hidden_layers
        forward = per_token_layer * spec["chunk"]  # the forward's own K/V of one layer of one chunk
        print(json.dumps({
            "model": spec["model"], "profile": label, "length": length, "chunk": spec["chunk"],
            "peak_bytes": report["peak_device_kv_bytes"] + forward, "cache_peak_bytes": report["peak_device_kv_bytes"],
            "after_prefill_bytes": after_prefill["device_kv_bytes"], "device_kv_bytes_end": report["device_kv_bytes"],
            "dense_kv_bytes": report["dense_kv_bytes"], "metadata_bytes": report["metadata_bytes"],
            "promoted_bytes_per_step": (after["bytes_promoted"] - before["bytes_promoted"]) / DECODE_STEPS,
            "offloaded_bytes_per_step": (after["bytes_offloaded"] - before["bytes_offloaded"]) / DECODE_STEPS,
            "prefill_s": prefill_s, "decode_s": decode_s,
        }), flush=True)
        cache.release()


def _shape(spec):
    if spec["shape"] == "qwen2.5-0.5b":
        from fc_hf import assets

        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(assets.model_path("qwen2.5-coder-0.5b-instruct"))
        config.max_position_embeddings = max(config.max_position_embeddings, spec["max_positions"])
        return config
    return model_config(spec["shape"], max_positions=spec["max_positions"])


def _profile(spec, config):
    if spec["shape"] == "qwen2.5-0.5b":
        from fc_hf import HeadProfile
        from fc_hf.profile import PROFILE_DIR

        path = Path(PROFILE_DIR) / "qwen2.5-coder-0.5b-instruct.json"
        return HeadProfile.load(path, config), f"shipped {path.name}"
    return bench_profile(config)


def suite_capacity(args, out: Path) -> None:
    """`flexicache bench capacity`: writes `<out>/capacity.json` and `<out>/capacity.md`."""
    cap_len = parse_sizes(args.capacity_cap)[0]
    chunk = args.capacity_chunk
    dtype = getattr(torch, args.capacity_dtype)
    rows, results = [], {"environment": environment(), "cap_tokens": cap_len, "chunk": chunk,
                         "budget": args.capacity_budget, "dtype": args.capacity_dtype, "decode_steps": DECODE_STEPS,
                         "shapes": {}}
    for shape in args.capacity_shapes.split(","):
        shape = shape.strip()
        config = _shape({"shape": shape, "max_positions": 1 << 17})
        cap = _dense_peak(config, cap_len, 1, None, dtype)  # what dense needs at the cap's length: it fits exactly
        lengths = parse_sizes(args.capacity_lengths)
        batches = parse_sizes(args.capacity_batches)
        cases = [{"length": n, "batch": 1, "chunk": chunk, "record": n == lengths[-1]} for n in lengths]
        cases += [{"length": n, "batch": 1, "chunk": None, "record": n == cap_len} for n in lengths]
        cases += [{"length": cap_len, "batch": b, "chunk": chunk} for b in batches if b > 1]
        spec = {"shape": shape, "max_positions": 1 << 17, "budget": args.capacity_budget, "dtype": args.capacity_dtype,
                "cap_bytes": cap, "cases": cases, "threads": args.threads}
        log(f"capacity: {shape}, cap = dense KV at {cap_len} tokens ({cap / 2**20:.0f} MiB), {len(cases)} cases")
        found, rc = run_worker("capacity_worker", spec, args.timeout)
        analytic = {
            "dense": {"tokens": _longest(lambda n: _dense_peak(config, n, 1, None, dtype), cap, chunk),
                      "batch": _largest(lambda b: _dense_peak(config, cap_len, b, None, dtype), cap)},
            "offload": {"tokens": _longest(lambda n: _offload_peak(config, n, 1, chunk, dtype), cap, chunk),
                        "batch": _largest(lambda b: _offload_peak(config, cap_len, b, chunk, dtype), cap),
                        "moved_bytes_per_step": 2 * _kv_bytes_per_token(config, dtype) * cap_len},
        }
        results["shapes"][shape] = {"cap_bytes": cap, "cases": found, "analytic": analytic, "worker_rc": rc}
        rows.append((shape, config, cap, found, analytic))
    if args.capacity_real:
        name, _, lengths = args.capacity_real.partition(":")
        spec = {"model": name, "lengths": parse_sizes(lengths or "16k,32k"), "chunk": chunk, "budget": args.capacity_budget,
                "dtype": "float32", "threads": args.threads}
        log(f"capacity: real {name} at {spec['lengths']} tokens, chunk {chunk}")
        results["real"], _ = run_worker("real_worker", spec, args.timeout)
    write_json(out / "capacity.json", results)
    (out / "capacity.md").write_text(capacity_table(results))
    plot_capacity(results, out / "capacity.png")
    log(f"capacity: wrote {out / 'capacity.md'}")


def _longest(peak_of, cap: int, step: int) -> int:
    n = step
    while peak_of(n + step) <= cap:
        n += step
    return n if peak_of(n) <= cap else 0


def _largest(peak_of, cap: int) -> int:
    b = 0
    while peak_of(b + 1) <= cap:
        b += 1
    return b


def capacity_table(results: dict) -> str:
    """The Markdown table of a capacity run: longest prompt and largest batch per method under the cap."""
    cap_len = results["cap_tokens"]
    lines = [f"Device-KV cap: what dense holds at {cap_len} tokens ({results['dtype']}); prefill then "
             f"{results['decode_steps']} decode steps; chunk {results['chunk']}.", ""]
    lines.append("| shape | method | longest prompt (tokens) | × dense | largest batch at the cap's length | "
                 "× dense | how | bytes moved host↔device per decode step |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for shape, data in results["shapes"].items():
        dense = data["analytic"]["dense"]
        cases = data["cases"]
        for method, how in (("dense", "analytic"), ("offload", "analytic (CUDA only)")):
            a = data["analytic"][method]
            moved = a.get("moved_bytes_per_step")
            lines.append(f"| {shape} | {method} | {a['tokens']} | {a['tokens'] / dense['tokens']:.2f} | {a['batch']} | "
                         f"{a['batch'] / max(1, dense['batch']):.2f} | {how} | "
                         f"{'-' if moved is None else f'{moved / 2**20:.0f} MiB (up and back)'} |")
        for method in ("flexicache", "flexicache-chunked"):
            mine = [c for c in cases if c["method"] == method]
            fit_len = [c["length"] for c in mine if c["batch"] == 1 and c["fits"]]
            tried = sorted({c["length"] for c in mine if c["batch"] == 1})
            fit_b = [c["batch"] for c in mine if c["length"] == cap_len and c["fits"]]
            moved = [c["promoted_bytes_per_step"] + c["offloaded_bytes_per_step"] for c in mine
                     if c["batch"] == 1 and c["length"] == cap_len]
            longest = max(fit_len) if fit_len else 0
            more = "" if not tried or longest < tried[-1] else f" (≥; longest tried {tried[-1]})"
            batch = max(fit_b) if fit_b else 0
            lines.append(f"| {shape} | {method} | {longest}{more} | {longest / dense['tokens']:.2f} | {batch} | "
                         f"{batch / max(1, dense['batch']):.2f} | counted | "
                         f"{(moved[0] / 2**20 if moved else float('nan')):.2f} MiB |")
    lines.append("")
    lines.append("| shape | method | length | batch | peak device KV / dense at that length | cache's own peak / dense "
                 "| after decode / dense | analytic peak |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for shape, data in results["shapes"].items():
        for c in data["cases"]:
            dense_len = c["dense_kv_bytes"]
            analytic = analytic_peak_fraction(c["unstable_share"], _layers_of(shape), c["length"],
                                              budget=results.get("budget", DEFAULTS.token_budget), chunk=c["chunk"])
            lines.append(f"| {shape} | {c['method']} | {c['length']} | {c['batch']} | {c['peak_bytes'] / dense_len:.3f} | "
                         f"{c['cache_peak_bytes'] / dense_len:.3f} | {c['device_kv_bytes_end'] / dense_len:.3f} | "
                         f"{analytic:.3f} |")
    if results.get("real"):
        lines += ["", "Real weights, real text (King James Bible), chunked prefill then 64 greedy tokens:", "",
                  "| model | prompt | peak device KV / dense (counted + the forward's chunk) | after the prefill / dense | "
                  "after decode / dense | bytes promoted per step | bytes offloaded per step | prefill (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results["real"]:
            dense = r["dense_kv_bytes"]
            lines.append(f"| {r['model']} | {r['length']} | {r['peak_bytes'] / dense:.3f} | "
                         f"{r['after_prefill_bytes'] / dense:.3f} | {r['device_kv_bytes_end'] / dense:.3f} | "
                         f"{r['promoted_bytes_per_step'] / 2**10:.0f} KiB | {r['offloaded_bytes_per_step'] / 2**10:.0f} KiB | "
                         f"{r['prefill_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot_capacity(results: dict, path: Path) -> None:
    """Device KV bytes over the prefill chunks and decode steps: the recorded FlexiCache runs (held and peak, per
    shape), dense and transformers' offloaded cache (analytic, the same prompt), and the cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [(name, data) for name, data in results["shapes"].items() if any(c["trace"] for c in data["cases"])]
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.4 * len(shapes), 4.0), squeeze=False)
    mib = 2**20
    for ax, (name, data) in zip(axes[0], shapes):
        config = _shape({"shape": name, "max_positions": 1 << 17})
        dtype = getattr(torch, results["dtype"])
        per_token = _kv_bytes_per_token(config, dtype)
        longest = 0
        for case in data["cases"]:
            if not case["trace"]:
                continue
            tokens = [t["tokens"] for t in case["trace"]]
            longest = max(longest, tokens[-1])
            label = f"{case['method']} ({case['length']} tokens)"
            line = ax.plot(tokens, [t["device_kv_bytes"] / mib for t in case["trace"]], label=f"{label}: held")[0]
            ax.plot(tokens, [t["peak_device_kv_bytes"] / mib for t in case["trace"]], linestyle=":",
                    color=line.get_color(), label=f"{label}: peak so far")
        xs = [0, longest]
        ax.plot(xs, [x * per_token / mib for x in xs], color="black", label="dense (DynamicCache)")
        ax.plot(xs, [2 * x * per_token / config.num_hidden_layers / mib for x in xs], color="gray", linestyle="--",
                label="offloaded DynamicCache (2 layers on the device)")
        ax.axhline(data["cap_bytes"] / mib, color="red", linewidth=0.8, label=f"cap: dense at {results['cap_tokens']}")
        ax.set_xlabel("tokens in the cache (prefill chunks, then decode steps)")
        ax.set_ylabel("device KV (MiB)")
        ax.set_title(f"{name}, chunk {results['chunk']}, {results['dtype']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _layers_of(shape: str) -> int:
    return _shape({"shape": shape, "max_positions": 1 << 17}).num_hidden_layers


# -- the cost of the read-back ----------------------------------------------------------------------------------
def prefill_worker(spec: dict) -> None:
    """Real prefills of one length, alternating DynamicCache/FlexiCache x unchunked/chunked; JSON lines of times."""
    import json

    from transformers import DynamicCache

    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    config = model_config(spec["shape"], max_positions=spec["length"] + 64, layers=spec.get("layers"))
    model = build_model(config)
    model.set_attn_implementation("flexicache")
    profile, _ = bench_profile(config)
    ids = torch.randint(0, config.vocab_size, (1, spec["length"]), generator=torch.Generator().manual_seed(0))
    kwarg = cache_kwarg(model)
    times, decode_ms = {}, {}
    cases = [("dense", None), ("dense", spec["chunk"]), ("flexicache", None), ("flexicache", spec["chunk"])]
    for rep in range(spec["repeats"]):
        for method, chunk in cases if rep % 2 == 0 else cases[::-1]:  # ABBA
            cache = (DynamicCache(config=config) if method == "dense"  # FlexiCache sized as generate would size it
                     else bench_cache("flexicache", config, spec["budget"], profile,
                                      tokens=spec["length"] + spec["decode_steps"]))
            with torch.no_grad():
                t0 = time.perf_counter()
                _prefill(model, ids, cache, kwarg, chunk)
                elapsed = time.perf_counter() - t0
                token, step_times = torch.ones(1, 1, dtype=torch.long), []
                for step in range(spec["decode_steps"]):  # the decode after it: as fast whichever way it was filled
                    t0 = time.perf_counter()
                    token = decode_step(model, cache, kwarg, token, spec["length"] + step)
                    step_times.append(time.perf_counter() - t0)
            times.setdefault(f"{method}/{chunk or 'one'}", []).append(elapsed)
            if step_times:
                decode_ms.setdefault(f"{method}/{chunk or 'one'}", []).append(1e3 * statistics.mean(step_times))
            del cache
    print(json.dumps({"length": spec["length"], "chunk": spec["chunk"], "times": times, "decode_ms": decode_ms}),
          flush=True)


def _prefill(model, ids, cache, kwarg: str, chunk: int | None) -> None:
    """The model over `ids` as generate's prefill feeds it: whole, or in chunks with the positions after the cache's."""
    if chunk is None:
        model(input_ids=ids, logits_to_keep=1, **{kwarg: cache})
        return
    for start in range(0, ids.shape[1], chunk):
        part = ids[:, start : start + chunk]
        pos = torch.arange(start, start + part.shape[1])[None]
        model(input_ids=part, position_ids=pos, logits_to_keep=1, **{kwarg: cache})


def _decode_cell(row) -> str:
    steps = row.get("decode_ms", {})
    one, chunked = steps.get("flexicache/one"), steps.get(f"flexicache/{row['chunk']}")
    if not one or not chunked:
        return "-"
    return f"{statistics.median(one):.1f} / {statistics.median(chunked):.1f}"


def suite_chunked_prefill(args, out: Path) -> None:
    """`flexicache bench chunked-prefill`: writes `<out>/chunked_prefill.json` and `.md`."""
    rows = []
    for length in parse_sizes(args.chunk_lengths):
        spec = {"shape": args.capacity_shapes.split(",")[0], "length": length, "chunk": args.capacity_chunk,
                "budget": args.capacity_budget, "repeats": args.chunk_repeats, "threads": args.threads,
                "decode_steps": args.chunk_decode_steps, "layers": args.chunk_layers or None}
        log(f"chunked-prefill: {length} tokens, chunk {args.capacity_chunk}, {args.chunk_repeats} alternating repeats")
        found, rc = run_worker("prefill_worker", spec, args.timeout)
        rows.extend(found)
    write_json(out / "chunked_prefill.json", {"environment": environment(), "rows": rows})
    lines = ["| length | chunk | DynamicCache one prefill (s) | DynamicCache chunked (s) | FlexiCache one prefill (s) | "
             "FlexiCache chunked (s) | FlexiCache chunked / DynamicCache chunked | FlexiCache one / DynamicCache one | "
             "FlexiCache decode step after one / after chunked (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        med = {key: statistics.median(values) for key, values in row["times"].items()}
        chunk = row["chunk"]
        lines.append(f"| {row['length']} | {chunk} | {med['dense/one']:.1f} | {med[f'dense/{chunk}']:.1f} | "
                     f"{med['flexicache/one']:.1f} | {med[f'flexicache/{chunk}']:.1f} | "
                     f"{med[f'flexicache/{chunk}'] / med[f'dense/{chunk}']:.3f} | "
                     f"{med['flexicache/one'] / med['dense/one']:.3f} | {_decode_cell(row)} |")
    layers = f", {args.chunk_layers} of the shape's layers (every layer costs the same)" if args.chunk_layers else ""
    (out / "chunked_prefill.md").write_text(f"Medians of alternating runs in one worker{layers}.\n\n" + "\n".join(lines)
                                            + "\n")
    log(f"chunked-prefill: wrote {out / 'chunked_prefill.md'}")

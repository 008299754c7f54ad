"""Memory micro-benchmarks: device KV bytes against context length (the paper's Fig. 9) and promoted
bytes per re-rank (Table 7). Neither depends on timing, so both give the same answer on a busy machine.

Device saving. A FlexiCache keeps on the device every page of the unstable heads (share `u`) and, for
each stable head, its top-K pages plus the pages created since its last re-rank. Relative to a dense
cache of `L` tokens its device KV is therefore at most

    u + (1 - u) * (B + n * P) / L        (B = token budget, P = page size, n = ceil(R / P) + 1 new pages)

plus the MinMax metadata, `2 * S * D` values per page (kmax and kmin of each of its `S =
FlexiCacheConfig.subpages` sub-pages) against `2 * P * D` for its K and V, i.e. `S / P` of dense.
`memory_report()` counts the bytes actually allocated (pool capacity included), and this
suite prints both side by side.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from fc_hf.compat import cache_kwarg
from fc_hf.config import FlexiCacheConfig
from fc_hf.transfer import PageTransfers

from ..methods import make_cache
from .common import (bench_profile, build_model, decode_step, environment, ingest_random_kv, log, model_config,
                     parse_sizes, release_memory, unstable_share, write_json)

__all__ = ["analytic_device_fraction", "memory_case", "suite_memory", "promotion_run", "suite_promotion"]

# Page size and re-rank interval default to the cache's own defaults.
DEFAULTS = FlexiCacheConfig()


def analytic_device_fraction(u: float, budget: int, length: int, page_size: int = DEFAULTS.page_size,
                             rerank: int = DEFAULTS.rerank_interval) -> float:
    """The analytic device KV share of dense, `u + (1-u) * (B + n*P) / L` (capped at 1)."""
    new_pages = math.ceil(rerank / page_size) + 1
    return u + (1 - u) * min(1.0, (budget + new_pages * page_size) / length)


def memory_case(config, profile, budget: int, length: int, batch: int = 1, page_size: int = DEFAULTS.page_size,
                rerank: int = DEFAULTS.rerank_interval) -> dict:
    """Fill a FlexiCache with `length` random tokens, decode `rerank + 1` steps, and read `memory_report()`.

    The decode passes the first ranking (step 1, prompt pages dropped) and one stable re-rank
    (step `rerank`), so the numbers are those of steady-state decoding.
    """
    model = build_model(config)
    model.set_attn_implementation("flexicache")
    base = FlexiCacheConfig(page_size=page_size, rerank_interval=rerank)
    cache = make_cache("flexicache", config, budget, profile, base=base)
    kwarg = cache_kwarg(model)
    with torch.no_grad():
        ingest_random_kv(cache, config, batch, length)
        after_prefill = cache.memory_report()
        token = torch.ones(batch, 1, dtype=torch.long)
        for i in range(rerank + 1):
            token = decode_step(model, cache, kwarg, token, length + i)
    rep = cache.memory_report()
    dense = rep["dense_kv_bytes"]
    u = unstable_share(profile, config)
    analytic = analytic_device_fraction(u, budget, length + rerank + 1, page_size, rerank)
    meta_analytic = cache.cache_config.subpages / page_size  # S MinMax entries (2D values each) per page
    device_frac = rep["device_kv_bytes"] / dense
    meta_frac = rep["metadata_bytes"] / dense
    result = {
        "length": length, "budget": budget, "batch": batch, "unstable_share": u, "page_size": page_size,
        "rerank_interval": rerank, "subpages": cache.cache_config.subpages,
        "dense_kv_bytes": dense, "device_kv_bytes": rep["device_kv_bytes"], "host_kv_bytes": rep["host_kv_bytes"],
        "metadata_bytes": rep["metadata_bytes"], "device_kv_bytes_after_prefill": after_prefill["device_kv_bytes"],
        "device_fraction": device_frac, "analytic_device_fraction": analytic,
        "metadata_fraction": meta_frac, "analytic_metadata_fraction": meta_analytic,
        "saving": 1 - device_frac - meta_frac, "analytic_saving": 1 - analytic - meta_analytic,
        "saving_kv_only": 1 - device_frac, "analytic_saving_kv_only": 1 - analytic,
        "abs_error": abs(device_frac - analytic),
    }
    cache.release()
    del cache, model
    release_memory()
    return result


def suite_memory(args, out: Path) -> list[dict]:
    """Fig. 9: device-memory saving against context length, with the analytic limit beside it."""
    lengths = parse_sizes(args.memory_lengths)
    budgets = parse_sizes(args.budgets)
    name = "tiny" if args.smoke else "smollm2-tiny"
    config = model_config(name, max_positions=max(lengths) + 256)
    profile, label = bench_profile(config, args.unstable_fraction)
    rows = []
    for budget in budgets:
        for length in lengths:
            r = memory_case(config, profile, budget, length)
            r.update(model=name, profile=label)
            rows.append(r)
            log(f"  memory B={budget} L={length}: device {r['device_fraction']:.4f} of dense (analytic "
                f"{r['analytic_device_fraction']:.4f}), metadata {r['metadata_fraction']:.4f}, saving {r['saving']:.3f}")
            write_json(out / "memory.json", {"suite": "memory", "env": environment(), "results": rows})
    return rows


def _percentile(values, q):
    values = sorted(values)
    if not values:
        return None
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def promotion_run(model, tokenizer, profile, budget: int, prompt_tokens: int, new_tokens: int, text_offset: int = 0) -> dict:
    """Generate `new_tokens` after a real `prompt_tokens`-token prompt; count what each re-rank promotes.

    Besides `stats()`, every host -> device copy request is counted independently (a wrapper around
    `PageTransfers.promote` that adds up the bytes of the pages it is asked to copy), so the check
    "bytes moved == promoted pages x page bytes" compares two separate counts.
    """
    counted = {"bytes": 0, "calls": 0}
    original = PageTransfers.promote

    def counting(self, k_pool, v_pool, dst_slots, host_k, host_v, host_index):
        counted["bytes"] += host_index.numel() * (host_k[0].numel() * host_k.element_size()
                                                  + host_v[0].numel() * host_v.element_size())
        counted["calls"] += 1
        return original(self, k_pool, v_pool, dst_slots, host_k, host_v, host_index)

    if tokenizer is None:
        ids = torch.randint(1, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    else:
        from fc_hf.assets import text_tokens

        ids = torch.tensor([text_tokens(tokenizer, prompt_tokens, offset=text_offset)])
    cache = make_cache("flexicache", model, budget, profile)
    PageTransfers.promote = counting
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, **{cache_kwarg(model): cache})
    finally:
        PageTransfers.promote = original
    stats = cache.stats()
    fractions = stats["promoted_fraction_per_rerank"]
    page_bytes = None
    stable_rows = 0
    for layer in cache.flexi_layers:
        for group in layer.groups:
            if group.kind == "stable" and group.store is not None:
                page_bytes = group.store.page_bytes
                stable_rows += group.store.rows
    k = budget // cache.cache_config.page_size
    events = len(fractions) // max(1, sum(1 for l in cache.flexi_layers for g in l.groups if g.kind == "stable"))
    result = {
        "budget": budget, "prompt_tokens": int(ids.shape[1]), "new_tokens": int(out.shape[1] - ids.shape[1]),
        "decode_steps": stats["decode_steps"], "reranks_stable": stats["reranks_stable"],
        "rerank_events": events, "stable_heads": stable_rows,
        "pages_promoted": stats["pages_promoted"], "bytes_promoted": stats["bytes_promoted"],
        "bytes_copied_counted": counted["bytes"], "page_bytes": page_bytes,
        "bytes_match_pages": page_bytes is not None and stats["bytes_promoted"] == stats["pages_promoted"] * page_bytes,
        "bytes_match_copies": stats["bytes_promoted"] == counted["bytes"],
        "promoted_bytes_per_rerank": stats["bytes_promoted"] / events if events else None,
        "stable_topk_bytes": stable_rows * k * page_bytes if page_bytes else None,
        "fraction_mean": statistics.fmean(fractions) if fractions else None,
        "fraction_median": statistics.median(fractions) if fractions else None,
        "fraction_p10": _percentile(fractions, 0.1), "fraction_p90": _percentile(fractions, 0.9),
        "fraction_min": min(fractions, default=None), "fraction_max": max(fractions, default=None),
        "fractions": fractions,
    }
    cache.release()
    return result


def suite_promotion(args, out: Path) -> list[dict]:
    """Table 7 on the real SmolLM2-135M-Instruct: promoted share of the stable top-K per re-rank."""
    from fc_hf import register

    register()
    if args.smoke:
        config = model_config("tiny", max_positions=4096)
        model, tokenizer, name = build_model(config), None, "tiny (random)"
        model.set_attn_implementation("flexicache")
        prompt, new = 256, 40
    else:
        from fc_hf.assets import load_model

        model, tokenizer = load_model("smollm2-135m-instruct", dtype=torch.float32, attn_implementation="flexicache")
        name, prompt, new = "smollm2-135m-instruct", args.promotion_prompt, args.promotion_new
    profile, label = bench_profile(model.config, args.unstable_fraction)
    rows = []
    for budget in parse_sizes(args.promotion_budgets):
        r = promotion_run(model, tokenizer, profile, budget, prompt, new)
        r.update(model=name, profile=label)
        rows.append(r)
        log(f"  promotion B={budget}: {r['rerank_events']} re-ranks, promoted {r['fraction_mean']:.3f} of the stable "
            f"top-K on average (p10 {r['fraction_p10']:.3f}, p90 {r['fraction_p90']:.3f}); bytes match: "
            f"{r['bytes_match_pages']} / {r['bytes_match_copies']}")
        write_json(out / "promotion.json", {"suite": "promotion", "env": environment(), "results": rows})
    return rows

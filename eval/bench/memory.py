"""Memory micro-benchmarks: device KV bytes against context length (the paper's Fig. 9) and the pages promoted per
decode step (Table 7). Neither depends on timing, so both give the same answer on a busy machine.

Device saving. A FlexiCache keeps on the device every page of the unstable heads (share `u`) and, for each stable
row (a (sequence, KV head) pair), a window of `W = K + ceil(R / P) + 1` pages (`fc_hf/store.py`): the K pages of its
last ranking (the page then being filled among them) and the pages it opens before its next ranking, at most R steps
later. Relative to a dense cache of `L` tokens its device KV is therefore

    u + (1 - u) * (B + n * P) / L        (B = K * P the token budget, P = page size, n = ceil(R / P) + 1 new pages)

(capped at 1), plus the MinMax metadata, `2 * S * D` values per page (kmax and kmin of each of its `S =
FlexiCacheConfig.subpages` sub-pages) against `2 * P * D` for its K and V, i.e. `S / P` of dense. `memory_report()`
counts the bytes allocated, and this suite prints both side by side. The cache is allocated for the tokens it holds
(`max_cache_len`: the context and the decode steps), as generate sizes it; beyond the formula the allocation holds
one spare window per layer with stable heads (where the padded places of a step's ranking write,
`spare_window_fraction`) and the capacity rounded up to whole pages.

Promotion. A stable row's window takes its new pages from the host tier when it ranks: at the first decode step after
the prompt every stable row ranks and fills its whole window, then every step ranks the stable rows whose phase is due
(`fc_hf/schedule.py`: each row every R steps, a slice of them at every step). `promotion_run` reads `stats()` after every
step: the pages promoted and the stable rows ranked that step, so the promoted share of a step is its promoted pages
over its ranked rows' K pages.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from fc_hf.compat import cache_kwarg
from fc_hf.config import FlexiCacheConfig
from fc_hf.store import window_pages

from ..methods import make_cache
from .common import (bench_cache, bench_profile, build_model, decode_step, environment, ingest_random_kv, log,
                     model_config, parse_sizes, release_memory, unstable_share, write_json)

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

    The decode passes the first ranking (step 1: every stable row fills its window) and each stable row's next
    ranking at its phase, so the numbers are those of steady-state decoding.
    """
    model = build_model(config)
    model.set_attn_implementation("flexicache")
    base = FlexiCacheConfig(page_size=page_size, rerank_interval=rerank)
    held = length + rerank + 1
    cache = bench_cache("flexicache", config, budget, profile, base=base, tokens=held)
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
    analytic = analytic_device_fraction(u, budget, held, page_size, rerank)
    meta_analytic = cache.cache_config.subpages / page_size  # S MinMax entries (2D values each) per page
    # Each layer with stable rows holds one window more than it has stable rows (`PageStore.win_k`'s extra row).
    layers, kv_heads = len(cache.flexi_layers), config.num_key_value_heads
    spare = sum(1 for layer in cache.flexi_layers if layer.kinds.stable)
    window = window_pages(cache.cache_config, cache.capacity // page_size) * page_size
    spare_fraction = spare * window / (layers * kv_heads * batch * held)
    device_frac = rep["device_kv_bytes"] / dense
    meta_frac = rep["metadata_bytes"] / dense
    result = {
        "length": length, "budget": budget, "batch": batch, "unstable_share": u, "page_size": page_size,
        "rerank_interval": rerank, "subpages": cache.cache_config.subpages, "capacity": cache.capacity,
        "dense_kv_bytes": dense, "device_kv_bytes": rep["device_kv_bytes"], "host_kv_bytes": rep["host_kv_bytes"],
        "metadata_bytes": rep["metadata_bytes"], "device_kv_bytes_after_prefill": after_prefill["device_kv_bytes"],
        "device_fraction": device_frac, "analytic_device_fraction": analytic, "spare_window_fraction": spare_fraction,
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
                f"{r['analytic_device_fraction']:.4f}, spare windows {r['spare_window_fraction']:.4f}), metadata "
                f"{r['metadata_fraction']:.4f}, saving {r['saving']:.3f}")
            write_json(out / "memory.json", {"suite": "memory", "env": environment(), "results": rows})
    return rows


def _percentile(values, q):
    values = sorted(values)
    if not values:
        return None
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


class _StepCounts:
    """A logits processor that only looks: after the prefill and after every decode step it reads the cache's
    `stats()` (pages promoted, stable rows ranked) and every layer's window pages (`store.win_pages`), so each step's
    promotions are the differences between two calls."""

    def __init__(self, cache):
        self.cache = cache
        self.stats: list[dict] = []
        self.windows: list[list[torch.Tensor]] = []

    def __call__(self, input_ids, scores):
        stats = self.cache.stats()
        self.stats.append({"pages_promoted": stats["pages_promoted"], "reranks_stable": stats["reranks_stable"]})
        self.windows.append([layer.store.win_pages[: layer.store.rows.n_stable].clone()
                             for layer in self.cache.flexi_layers])
        return scores


def _pages_entered(before: list[torch.Tensor], after: list[torch.Tensor], k: int) -> int:
    """Pages that entered the stable rows' windows between two snapshots: a page a window's ranked positions
    (`[0, K)`) hold after that it did not hold anywhere before. Counted apart from the cache's own counter."""
    entered = 0
    for old, new in zip(before, after):
        for row_old, row_new in zip(old.tolist(), new.tolist()):
            if row_new != row_old:
                held = set(row_old)
                entered += sum(1 for page in row_new[:k] if page >= 0 and page not in held)
    return entered


def promotion_run(model, tokenizer, profile, budget: int, prompt_tokens: int, new_tokens: int, text_offset: int = 0) -> dict:
    """Generate `new_tokens` after a real `prompt_tokens`-token prompt; count what each decode step promotes.

    Per decode step, from `stats()` before and after it: the pages promoted and the stable rows ranked; the step's
    promoted share is `pages / (rows x K)`. Step 1 is apart: every stable row ranks and fills its window from the host
    tier. Independently of the cache's counter, the pages that entered the windows are counted from snapshots of
    each layer's `store.win_pages` around every step (`pages_match_windows`).
    """
    if tokenizer is None:
        ids = torch.randint(1, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    else:
        from fc_hf.assets import text_tokens

        ids = torch.tensor([text_tokens(tokenizer, prompt_tokens, offset=text_offset)])
    cache = make_cache("flexicache", model, budget, profile)
    seen = _StepCounts(cache)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, logits_processor=[seen],
                             **{cache_kwarg(model): cache})
    stats = cache.stats()
    k = cache.cache_config.pages_per_head
    stable_rows = sum(layer.store.rows.n_stable for layer in cache.flexi_layers)
    page_bytes = next((layer.store.page_bytes for layer in cache.flexi_layers if layer.store.rows.n_stable), None)
    # seen.stats[0] is read after the prefill, seen.stats[s] after decode step s.
    steps = []
    for step, (before, after) in enumerate(zip(seen.stats, seen.stats[1:]), start=1):
        pages = after["pages_promoted"] - before["pages_promoted"]
        rows = after["reranks_stable"] - before["reranks_stable"]
        steps.append({"step": step, "pages_promoted": pages, "stable_rows_ranked": rows,
                      "fraction": pages / (rows * k) if rows else None})
    entered = sum(_pages_entered(a, b, k) for a, b in zip(seen.windows, seen.windows[1:]))
    first, later = steps[0], steps[1:]
    fractions = [s["fraction"] for s in later if s["fraction"] is not None]
    later_pages = sum(s["pages_promoted"] for s in later)
    result = {
        "budget": budget, "prompt_tokens": int(ids.shape[1]), "new_tokens": int(out.shape[1] - ids.shape[1]),
        "decode_steps": stats["decode_steps"], "reranks_stable": stats["reranks_stable"], "stable_rows": stable_rows,
        "pages_per_ranking": k, "pages_promoted": stats["pages_promoted"], "bytes_promoted": stats["bytes_promoted"],
        "page_bytes": page_bytes, "promoted_fraction": stats["promoted_fraction"],
        "bytes_match_pages": page_bytes is not None and stats["bytes_promoted"] == stats["pages_promoted"] * page_bytes,
        "pages_entered_windows": entered, "pages_match_windows": entered == stats["pages_promoted"],
        "first_step_pages_promoted": first["pages_promoted"], "first_step_fraction": first["fraction"],
        "promoted_pages_per_step": later_pages / len(later) if later else None,
        "promoted_bytes_per_step": later_pages * page_bytes / len(later) if later and page_bytes else None,
        "stable_topk_bytes": stable_rows * k * page_bytes if page_bytes else None,
        "fraction_mean": statistics.fmean(fractions) if fractions else None,
        "fraction_median": statistics.median(fractions) if fractions else None,
        "fraction_p10": _percentile(fractions, 0.1), "fraction_p90": _percentile(fractions, 0.9),
        "fraction_min": min(fractions, default=None), "fraction_max": max(fractions, default=None),
        "fractions": fractions, "steps": steps,
    }
    cache.release()
    return result


def suite_promotion(args, out: Path) -> list[dict]:
    """Table 7 on the real SmolLM2-135M-Instruct: the promoted share of the K pages of the stable rows ranked, per
    decode step."""
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
        log(f"  promotion B={budget}: {r['decode_steps']} decode steps, {r['stable_rows']} stable rows; after step 1 "
            f"promoted {r['fraction_mean']:.3f} of the ranked rows' K pages on average (p10 {r['fraction_p10']:.3f}, "
            f"p90 {r['fraction_p90']:.3f}); counts match: bytes {r['bytes_match_pages']}, windows "
            f"{r['pages_match_windows']}")
        write_json(out / "promotion.json", {"suite": "promotion", "env": environment(), "results": rows})
    return rows

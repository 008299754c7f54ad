"""Turn the benchmark JSON files into PNG plots and a Markdown summary (`benchmarks.md`).

    python -m fc_hf.eval.bench report --out results/bench --docs docs
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .common import SHAPES

READ_BANDWIDTH_GBS = 78.0  # SPEC §4: measured read bandwidth of this machine with 2 threads


def _load(out: Path, name: str) -> list[dict]:
    path = out / f"{name}.json"
    if not path.exists():
        return []
    return json.loads(path.read_text()).get("results", [])


def _env(out: Path, name: str) -> dict:
    path = out / f"{name}.json"
    return json.loads(path.read_text()).get("env", {}) if path.exists() else {}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _f(x, digits=1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# -- bytes moved per step (for the bandwidth check) -------------------------------------------------
def weight_bytes(model: str, layers: int | None = None, itemsize: int = 4) -> int:
    """Bytes of weights one decode step reads: every decoder layer plus the LM head."""
    s = SHAPES[model]
    h, d, q, kv, inter = s["hidden_size"], s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"], s["intermediate_size"]
    per_layer = h * q * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h
    return ((layers or s["num_hidden_layers"]) * per_layer + s["vocab_size"] * h) * itemsize


def row_cache_config(r: dict):
    """The `FlexiCacheConfig` a Quest / FlexiCache row ran with: its recorded `cache_config` (decode rows record it),
    else the one today's `methods.method_config` builds from the row's method, budget and `options`."""
    from dataclasses import fields

    from fc_hf.config import FlexiCacheConfig

    from ..methods import method_config

    recorded = r.get("cache_config")
    if recorded:
        names = {f.name for f in fields(FlexiCacheConfig)}
        return FlexiCacheConfig(**{k: v for k, v in recorded.items() if k in names})
    return method_config(r["method"], r["budget"], base=FlexiCacheConfig(**(r.get("options") or {})))


def kv_bytes_read(r: dict, itemsize: int = 4) -> int:
    """KV, MinMax metadata and refinement bytes one decode step reads for result `r` (from the shapes).

    A row is one (sequence, KV head) of one layer: `batch * kv_heads` rows per layer; D = head_dim, L = `length`,
    every count times `itemsize` bytes (the metadata has the KV dtype).

    - dense: every layer reads L tokens of K and V, `2D` values each.
    - floor: the same over the `cache_tokens` it held.
    - quest / flexicache, with the row's config (`row_cache_config`): P = page_size, K = budget / P, Np = ceil(L / P),
      S = `subpages`, C = `candidate_pages`, R = `rerank_interval`, u = the share of unstable heads (`unstable_share`;
      1 for Quest: no profile, every head ranked every step). A ranking of a row reads the MinMax metadata, kmax and
      kmin of every sub-page, `Np * S * 2D`, and with refinement (C > 0) the keys of its min(C, Np) candidate pages,
      `min(C, Np) * P * D`. Per step, an unstable row ranks and attends over its K pages: their values only with
      refinement (its logits are re-used), `K * P * D`, else K and V, `K * P * 2D`; a stable row attends over its
      window, `W * P` tokens of K and V with `W = K + ceil(R / P) + 1` pages (`fc_hf/store.py`), and ranks every R
      steps (a ranking's cost over R).
    The cache counts what its decode steps read itself (`FlexiCache.stats()["bytes_read"]`, over the capacity's pages
    and step 1's ranking of every row included); this estimates the steady step from the shapes, for every row alike.
    """
    s = SHAPES[r["model"]]
    layers = r.get("layers") or s["num_hidden_layers"]
    d = s["head_dim"]
    rows = r["batch"] * s["num_key_value_heads"]  # per layer
    per_token = 2 * d * itemsize  # K and V
    length = r["length"]
    if r["method"] == "dense":
        return rows * layers * length * per_token
    if r["method"] == "floor":  # dense over the cache's `budget` tokens
        return rows * layers * r.get("cache_tokens", min(length, r["budget"])) * per_token
    cfg = row_cache_config(r)
    p, k, c = cfg.page_size, cfg.pages_per_head, cfg.candidate_pages
    pages = math.ceil(length / p)
    ranking = pages * cfg.subpages * 2 * d + (min(c, pages) * p * d if c else 0)  # values one ranking of one row reads
    unstable = k * p * (d if c else 2 * d) + ranking
    window = k + min(math.ceil(cfg.rerank_interval / p) + 1, pages)
    stable = window * p * 2 * d + ranking / cfg.rerank_interval
    u = 1.0 if r["method"] == "quest" else r.get("unstable_share", 1.0)
    return int(rows * layers * (u * unstable + (1 - u) * stable) * itemsize)


def _index(rows):
    """The unlabelled rows (no `variant`) by (model, method, budget, length, batch)."""
    return {(r["model"], r["method"], r.get("budget"), r["length"], r["batch"]): r for r in rows if not r.get("variant")}


METHOD_NAMES = {"dense": "dense", "quest": "Quest", "flexicache": "FlexiCache"}


def case_name(r: dict) -> str:
    """A row's name in the tables: "dense over 1024 tokens (floor)", "FlexiCache [old]", ..."""
    if r["method"] == "floor":
        return f"dense over {r.get('cache_tokens', r['budget'])} tokens (floor)"
    name = METHOD_NAMES.get(r["method"], r["method"])
    return name + (f" [{r['variant']}]" if r.get("variant") else "")


def _method_label(r: dict) -> str:
    """The method column of the per-row tables: the method, with its variant label."""
    return r["method"] + (f"[{r['variant']}]" if r.get("variant") else "")


def _options_text(options: dict | None) -> str:
    return ", ".join(f"{k}={':'.join(map(str, v)) if isinstance(v, (tuple, list)) else v}"
                     for k, v in (options or {}).items()) or "–"


def _ratio(a: dict | None, b: dict | None) -> str:
    return _f(a["tok_s"] / b["tok_s"], 2) + "×" if a and b and a is not b else "–"


def side_by_side_tables(rows: list[dict]) -> list[str]:
    """One table per model: every case of each (batch, context) as its own row (dense, then per budget the floor,
    Quest, Quest's variants, FlexiCache, FlexiCache's variants), with its tok/s over dense's, over the floor's
    (same budget) and over the unlabelled row of its method ("× default", variants only)."""
    order = {"dense": 0, "floor": 1, "quest": 2, "flexicache": 3}
    labels = {}  # variant label -> first-seen order
    for r in rows:
        if r.get("variant"):
            labels.setdefault(r["variant"], len(labels))
    idx = _index(rows)
    parts = []
    for model in sorted({r["model"] for r in rows}, key=lambda m: (m != "smollm2", m)):
        table = []
        mine = sorted((r for r in rows if r["model"] == model and r["method"] in order),
                      key=lambda r: (r["batch"], r["length"], r.get("budget") or 0, order[r["method"]],
                                     -1 if not r.get("variant") else labels[r["variant"]]))
        for r in mine:
            at = (r["length"], r["batch"])
            dense = idx.get((model, "dense", None) + at)
            floor = idx.get((model, "floor", r.get("budget")) + at) if r.get("budget") else None
            default = idx.get((model, r["method"], r.get("budget")) + at) if r.get("variant") else None
            table.append([r["batch"], _k(r["length"]), r.get("budget") or "–", case_name(r),
                          _options_text(r.get("options")), _f(r.get("step_ms_mean")), _f(r.get("tok_s"), 2),
                          _ratio(r, dense), _ratio(r, floor), _ratio(r, default)])
        parts.append(f"**{model}**\n\n" + _table(["batch", "context", "budget", "case", "options", "ms/step", "tok/s",
                                                  "× dense", "× floor", "× default"], table))
    return parts


def _has_side_by_side(rows: list[dict]) -> bool:
    return any(r["method"] == "floor" or r.get("variant") for r in rows)


SIDE_BY_SIDE_TEXT = (
    "Every case of one (context, batch) was timed in the same worker, one after the other. 'dense over B tokens "
    "(floor)' is the `dense` case (`DynamicCache` + sdpa) over a cache of only B tokens: a step that attends as "
    "many tokens as FlexiCache does, with no scoring, selection or paging, so FlexiCache's '× floor' is how close it "
    "comes to that bound. A row with a [label] is a configuration variant (`--cache-variants`): Quest or "
    "FlexiCache with the `FlexiCacheConfig` fields in 'options' set; '× default' is its tok/s over the unlabelled "
    "row of the same method and budget. Ratios are of tok/s (> 1: faster).")


# -- plots ------------------------------------------------------------------------------------------
def _plots(out: Path, docs: Path, decode, memory, rerank, batch, promotion) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    img = docs / "bench"
    img.mkdir(parents=True, exist_ok=True)
    colors = {"dense": "tab:gray", "floor": "tab:green", "quest": "tab:orange", "flexicache": "tab:blue"}
    decode = [r for r in decode if not r.get("variant")]  # the plots show the unlabelled configuration
    batch = [r for r in batch if not r.get("variant")]

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(img / name, dpi=110)
        plt.close(fig)
        made.append(name)

    if decode:
        keys = sorted({(r["model"], r["batch"]) for r in decode})
        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
        for ax, (model, b) in zip(axes[0], keys):
            for method in ("dense", "floor", "quest", "flexicache"):
                budgets = sorted({r.get("budget") for r in decode if r["method"] == method}, key=lambda x: x or 0)
                for budget in budgets:
                    pts = sorted((r["length"], r["tok_s"]) for r in decode if r["model"] == model and r["batch"] == b
                                 and r["method"] == method and r.get("budget") == budget)
                    if pts:
                        label = method if budget is None else (f"dense over {budget} tokens (floor)" if method ==
                                                               "floor" else f"{method} B={budget}")
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[method],
                                linestyle="-" if budget in (None, 1024) else "--", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}, batch {b}")
            ax.set_xlabel("context tokens")
            ax.set_ylabel("decode tokens/s")
            ax.legend(fontsize=7)
        save(fig, "decode_throughput.png")

    if memory:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for budget in sorted({r["budget"] for r in memory}):
            rs = sorted((r for r in memory if r["budget"] == budget), key=lambda r: r["length"])
            x = [r["length"] for r in rs]
            ax.plot(x, [100 * r["saving"] for r in rs], marker="o", label=f"measured, B={budget}")
            ax.plot(x, [100 * r["analytic_saving"] for r in rs], linestyle="--", label=f"analytic, B={budget}")
            ax.plot(x, [100 * r["saving_kv_only"] for r in rs], marker=".", linestyle=":", label=f"KV only, B={budget}")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("device memory saved vs dense (%)")
        ax.set_title("Device KV saving (metadata counted)")
        ax.legend(fontsize=7)
        save(fig, "memory_saving.png")

    if rerank:
        rs = sorted(rerank, key=lambda r: (r["model"], r["budget"], r["batch"], r["length"]))
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rs)), 3.6))
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["quest_ranking_bytes_per_step"] / 2**20 for r in rs], width=0.4,
               label="rank every row every step (Quest)")
        ax.bar([x + 0.2 for x in xs], [r["flexicache_ranking_bytes_per_step"] / 2**20 for r in rs], width=0.4,
               label="stability-aware")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['model'][:5]} B{r['budget']} b{r['batch']} {_k(r['length'])}" for r in rs], rotation=70, fontsize=7)
        ax.set_ylabel("bytes ranking reads, MiB/step")
        ax.legend(fontsize=7)
        save(fig, "rerank_cost.png")

    if batch:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for method in ("dense", "floor", "quest", "flexicache"):
            pts = sorted((r["batch"], r["step_ms_mean"]) for r in batch if r["method"] == method)
            if pts:
                label = f"dense over {batch[0].get('budget') or '?'} tokens (floor)" if method == "floor" else method
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[method], label=label)
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"Decode latency vs batch ({_k(batch[0]['length'])} tokens)")
        ax.legend(fontsize=7)
        save(fig, "latency_vs_batch.png")

    if promotion:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for r in promotion:
            ax.hist([100 * f for f in r["fractions"]], bins=20, alpha=0.6, label=f"B={r['budget']}")
        ax.set_xlabel("promoted share of the ranked stable rows' K pages per decode step (%)")
        ax.set_ylabel("decode steps")
        ax.set_title("Promotion per decode step, real SmolLM2")
        ax.legend(fontsize=7)
        save(fig, "promotion_fraction.png")
    return made


# -- markdown -----------------------------------------------------------------------------------------
def _decode_tables(decode) -> list[str]:
    idx = _index(decode)
    parts = []
    budgets = sorted({r["budget"] for r in decode if r.get("budget")})
    floors = any(r["method"] == "floor" for r in decode)
    for model in sorted({r["model"] for r in decode}, key=lambda m: m != "smollm2"):
        for b in sorted({r["batch"] for r in decode if r["model"] == model}):
            header = ["context", "dense ms/step", "dense tok/s"]
            for budget in budgets:
                header += [f"Quest B={budget} tok/s", f"FlexiCache B={budget} tok/s", f"Flexi/dense B={budget}",
                           f"Flexi/Quest B={budget}"] + ([f"Flexi/floor B={budget}"] if floors else [])
            rows = []
            for length in sorted({r["length"] for r in decode if r["model"] == model and r["batch"] == b}):
                d = idx.get((model, "dense", None, length, b))
                row = [_k(length), _f(d and d["step_ms_mean"]), _f(d and d["tok_s"], 2)]
                for budget in budgets:
                    q = idx.get((model, "quest", budget, length, b))
                    f = idx.get((model, "flexicache", budget, length, b))
                    row += [_f(q and q["tok_s"], 2), _f(f and f["tok_s"], 2),
                            _f(f["tok_s"] / d["tok_s"], 2) + "×" if f and d else "–",
                            _f(f["tok_s"] / q["tok_s"], 2) + "×" if f and q else "–"]
                    if floors:
                        row.append(_ratio(f, idx.get((model, "floor", budget, length, b))))
                rows.append(row)
            parts.append(f"**{model}, batch {b}**\n\n" + _table(header, rows))
    return parts


def _memory_per_method_table(decode) -> str:
    rows = []
    for r in sorted(decode, key=lambda r: (r["model"] != "smollm2", r["model"], r["batch"], r["length"], r["method"], r.get("budget") or 0, r.get("variant") or "")):
        m = r.get("memory", {})
        rows.append([r["model"], _method_label(r), r.get("budget") or "–", r["batch"], _k(r["length"]),
                     _f(r.get("peak_rss_mb"), 0), _f(m.get("device_kv_bytes", 0) / 2**20, 0),
                     _f(m.get("host_kv_bytes", 0) / 2**20, 0), _f(m.get("metadata_bytes", 0) / 2**20, 1),
                     _f(m.get("dense_kv_bytes", 0) / 2**20, 0), _f(r.get("ingest_s"), 2), _f(r.get("first_step_ms"), 0)])
    return _table(["model", "method", "budget", "batch", "context", "peak RSS MB (over model)", "device KV MB",
                   "host KV MB", "metadata MB", "dense KV MB", "cache fill s", "first step ms"], rows)


def _tail_table(decode) -> str:
    """Per decode case the median, 99th percentile and slowest step: staggered re-ranks make every step alike."""
    rows = []
    for r in sorted(decode, key=lambda r: (r["model"] != "smollm2", r["model"], r["batch"], r["length"], r["method"], r.get("budget") or 0, r.get("variant") or "")):
        if "step_ms_p99" not in r:
            continue
        rows.append([r["model"], _method_label(r), r.get("budget") or "–", r["batch"], _k(r["length"]), r["steps"],
                     r.get("warmup_steps", 0), _f(r["step_ms_median"]), _f(r["step_ms_p99"]), _f(r["step_ms_max"]),
                     _f(r["step_ms_p99"] / r["step_ms_median"], 2) + "×"])
    return _table(["model", "method", "budget", "batch", "context", "timed steps", "untimed after step 1",
                   "median ms", "p99 ms", "slowest ms", "p99 / median"], rows)


def _bandwidth_table(decode) -> str:
    rows = []
    for r in sorted(decode, key=lambda r: (r["model"] != "smollm2", r["model"], r["batch"], r["length"], r["method"], r.get("budget") or 0, r.get("variant") or "")):
        if r.get("budget") not in (None, 1024):
            continue
        wb = weight_bytes(r["model"], r.get("layers"))
        kv = kv_bytes_read(r)
        total = wb + kv
        floor_ms = total / (READ_BANDWIDTH_GBS * 1e9) * 1e3
        rows.append([r["model"], _method_label(r), r["batch"], _k(r["length"]), _f(wb / 1e6, 0), _f(kv / 1e6, 0),
                     _f(floor_ms, 1), _f(r["step_ms_mean"], 1), _f(total / (r["step_ms_mean"] * 1e6), 1)])
    return _table(["model", "method", "batch", "context", "weights MB/step", "KV+meta MB/step",
                   f"read time ms at {READ_BANDWIDTH_GBS:.0f} GB/s", "measured ms", "effective GB/s"], rows)


def _targets(decode, rerank) -> tuple[str, list[str]]:
    idx = _index(decode)
    rows, lines = [], []

    def ratio(length, batch, method="flexicache", base="dense", budget=1024):
        f = idx.get(("smollm2", method, budget, length, batch))
        d = idx.get(("smollm2", base, None if base == "dense" else budget, length, batch))
        return None if f is None or d is None else f["tok_s"] / d["tok_s"]

    def add(name, value, goal, ok):
        rows.append([name, "–" if value is None else value, goal, "not measured" if ok is None else ("met" if ok else "missed")])

    for length, batch, goal in ((16384, 1, 2.0), (32768, 1, 3.5), (16384, 4, 3.0)):
        x = ratio(length, batch)
        add(f"tok/s vs dense, {_k(length)}, batch {batch}", x and f"{x:.2f}×", f"≥ {goal}×", None if x is None else x >= goal)
    x = ratio(4096, 1)
    add("tok/s vs dense, 4k, batch 1", x and f"{x:.2f}×", "≥ 0.95×", None if x is None else x >= 0.95)
    x4 = ratio(4096, 4)
    add("tok/s vs dense, 4k, batch 4", x4 and f"{x4:.2f}×", "≥ 0.95×", None if x4 is None else x4 >= 0.95)
    rr = [r for r in rerank if r["model"] == "smollm2" and r["budget"] == 1024]
    if rr:
        best = min(r["ranking_bytes_ratio"] for r in rr if r["ranking_bytes_ratio"])
        at16 = next((r for r in rr if r["length"] == 16384 and r["batch"] == 1), None)
        value = f"{at16['ranking_bytes_ratio']:.2f}× at 16k b1 (min {best:.2f}× over the grid)" if at16 else f"min {best:.2f}×"
        add("stability-aware ranking reads fewer bytes than Quest's (counted)", value, "≥ 2×",
            (at16["ranking_bytes_ratio"] if at16 else best) >= 2.0)
    else:
        add("stability-aware ranking reads fewer bytes than Quest's (counted)", None, "≥ 2×", None)
    x = ratio(32768, 4, base="quest")
    add("tok/s vs Quest, 32k, batch 4", x and f"{x:.2f}×", "> 1×", None if x is None else x > 1.0)
    return _table(["target (SmolLM2 shape, fp32, budget 1024)", "measured", "goal", "status"], rows), lines


def write_report(out: Path, docs: Path) -> Path:
    """Write `docs/benchmarks.md` and `docs/bench/*.png` (+ copies of the JSON) from the results in `out`."""
    out, docs = Path(out), Path(docs)
    docs.mkdir(parents=True, exist_ok=True)
    decode, prefill, batch = _load(out, "decode"), _load(out, "prefill"), _load(out, "batch")
    rerank, memory, promotion = _load(out, "rerank"), _load(out, "memory"), _load(out, "promotion")
    # Runs from before the static decode step timed ranking phases and counted promotions per re-rank: not shown.
    rerank = [r for r in rerank if "quest_ranking_bytes_per_step" in r]
    promotion = [r for r in promotion if "steps" in r]
    plots = _plots(out, docs, decode, memory, rerank, batch, promotion)
    json_dir = docs / "bench"
    json_dir.mkdir(parents=True, exist_ok=True)
    for name in ("decode", "prefill", "batch", "rerank", "memory", "promotion"):
        src = out / f"{name}.json"
        if src.exists() and src.resolve() != (json_dir / src.name).resolve():
            (json_dir / src.name).write_text(src.read_text())

    md = ["# FlexiCache benchmarks", ""]
    env = _env(out, "decode") or _env(out, "memory")
    if env:
        md += [f"Measured {env.get('time_utc', '?')} on {env.get('cpus', '?')} CPU(s), torch {env.get('torch')}, "
               f"transformers {env.get('transformers')}" + (f", GPU {env['gpu']}" if env.get("gpu") else "") + ".", ""]
    md += [
        "Reproduce: `flexicache bench decode prefill batch rerank memory promotion report --out results/bench --docs docs`",
        "(`python -m fc_hf.eval.bench ...` works too). JSON for every table is in `docs/bench/`. Ratios are side by "
        "side from one run; every timed case records the 1-minute load average it started under "
        "(`env.loadavg_1m`), and timings taken on a loaded machine are not comparable.",
        "",
        "Methods: **dense** = `DynamicCache` + sdpa (what users run); **Quest** = FlexiCache with no profile (every "
        "head re-ranked every step, everything on the device, `offload=False`); **FlexiCache** = a profile with ~25% "
        "unstable heads ranked every step, each stable head re-ranked every R steps (`rerank_interval`, 8 by default; "
        "staggered: every step ranks a slice of them), host tier on; **dense over B tokens (floor)** = the "
        "dense case over a cache of only B (the budget) tokens, the cost of a step that attends as many tokens as "
        "FlexiCache with none of its work (`--methods` `floor`); configuration variants (`--cache-variants "
        "\"LABEL=FIELD=VALUE,...;...\"`) add Quest / FlexiCache cases with those `FlexiCacheConfig` fields, timed in "
        "the same run and shown as rows of their own with their ratio to dense, to the floor and to the unlabelled "
        "row. Models have random weights (speed "
        "does not depend on their values): `smollm2` is SmolLM2-135M's exact shape (30 layers, hidden 576, 9 / 3 "
        "heads, head_dim 64, MLP 1536, fp32); `llama8b` is Llama-3.1-8B's layer shape (hidden 4096, 32 / 8 heads, "
        "head_dim 128, MLP 14336) with 2 layers and a 32k vocabulary, so KV bytes per weight byte per layer are the "
        "real model's. The prefill of the decode suite is replaced by writing random K/V into the cache (the "
        "same `cache.update` calls a prefill makes), so contexts up to 32k cost seconds; the `prefill` table times "
        "real prefills. Each decode case times the steps after the first (step 1 ranks every stable row and fills "
        "its window from the host tier; reported apart as `first_step_ms`), "
        f"{', '.join(sorted({str(r['steps']) for r in decode})) or '?'} steps, and reports their mean: every step "
        "after the first ranks the unstable rows and the same number of stable ones, so the steps are alike. Whole "
        "steps only: a decode step is one fixed sequence of tensor ops, with no per-phase timer. Every cache is "
        "allocated for the context and the steps timed (`max_cache_len`), as generate sizes it.",
        "",
    ]
    if decode:
        profiles = sorted({f"{r['model']}: {r.get('profile')} (u = {r.get('unstable_share', 0):.3f})" for r in decode
                           if r["method"] == "flexicache"})
        if profiles:
            md += ["Profiles used: " + "; ".join(profiles) + ".", ""]
        table, _ = _targets(decode, rerank)
        md += ["## Issue 7 targets", "", table, ""]
        md += ["## Decode throughput", ""] + [p + "\n" for p in _decode_tables(decode)]
        md += ["## Step tail", "", "The no-stall target (issue 49): the 99th-percentile step at most 1.5× the median.", "",
               _tail_table(decode), ""]
        if _has_side_by_side(decode):
            md += ["### Side by side: the floor and configuration variants", "", SIDE_BY_SIDE_TEXT, ""]
            md += [p + "\n" for p in side_by_side_tables(decode)]
        if "decode_throughput.png" in plots:
            md += ["![decode throughput](bench/decode_throughput.png)", ""]
        md += ["## Bytes moved per step against the machine's bandwidth", "",
               f"Estimated bytes a step must read (weights + KV and metadata it touches) and the time that takes at "
               f"{READ_BANDWIDTH_GBS:.0f} GB/s (SPEC §4), beside the measured step.", "", _bandwidth_table(decode), ""]
        md += ["## Memory per method, cache fill and first step", "",
               "'cache fill' is the time `cache.update` takes to take in the whole prompt's K/V (FlexiCache writes "
               "it into its preallocated store and its MinMax metadata: its share of a prefill); 'first step' is "
               "decode step 1, which ranks every row and fills each stable row's window from the host tier.", "",
               "Peak RSS is the growth of resident memory during the case (cache fill + decode) over the loaded model "
               "(Linux VmHWM, reset per case). On a CPU the 'device' and 'host' tiers are both RSS, so RSS does not "
               "show the device saving; `memory_report()` does.", "", _memory_per_method_table(decode), ""]
    if rerank:
        rows = [[r["model"], r["budget"], r["batch"], _k(r["length"]), _f(r["quest_rows_ranked_per_step"], 1),
                 _f(r["flexicache_rows_ranked_per_step"], 1), _f(r["quest_ranking_bytes_per_step"] / 2**20, 2),
                 _f(r["flexicache_ranking_bytes_per_step"] / 2**20, 2), _f(r["ranking_bytes_ratio"], 2) + "×",
                 _f(r["end_to_end_speedup"], 2) + "×"] for r in sorted(rerank, key=lambda r: (r["model"] != "smollm2", r["model"], r["budget"], r["batch"], r["length"]))]
        md += ["## Stability-aware vs naive re-ranking (Fig. 8)", "",
               "Ranking work per decode step, counted by the cache (`stats()`, over the case's decode steps, step 1 "
               "included): the rows ranked and the bytes ranking reads (the MinMax metadata scored and the candidate "
               "pages' keys refinement reads). Quest ranks every row every step; FlexiCache its unstable rows every "
               "step and each stable row every R steps. Ranking is no longer timed apart (a decode step has no "
               "per-phase timer); 'end-to-end' is the whole step's time, Quest's over FlexiCache's.", "",
               _table(["model", "budget", "batch", "context", "Quest rows / step", "FlexiCache rows / step",
                       "Quest MiB / step", "FlexiCache MiB / step", "fewer bytes by", "end-to-end vs Quest"], rows), ""]
        if "rerank_cost.png" in plots:
            md += ["![re-rank cost](bench/rerank_cost.png)", ""]
    if prefill:
        rows = [[r["model"], r["method"], _k(r["length"]), _f(r["prefill_s"], 2), _f(r["first_step_ms"], 0),
                 _f(r.get("peak_rss_mb"), 0)] for r in sorted(prefill, key=lambda r: (r["length"], r["method"]))]
        md += ["## Prefill (real forward pass, batch 1)", "",
               _table(["model", "method", "context", "prefill s", "first decode step ms", "peak RSS MB"], rows), ""]
    if batch:
        idx = _index(batch)
        rows = []
        bbudget = next((r["budget"] for r in batch if r["method"] in ("quest", "flexicache", "floor")), 1024)
        floor_col = (("floor", bbudget),) if any(r["method"] == "floor" for r in batch) else ()
        for b in sorted({r["batch"] for r in batch}):
            cells = [b]
            for m, budget in (("dense", None), ("quest", bbudget), ("flexicache", bbudget)) + floor_col:
                r = idx.get((batch[0]["model"], m, budget, batch[0]["length"], b))
                cells += [_f(r and r["step_ms_mean"]), _f(r and r["tok_s"], 1)]
            rows.append(cells)
        md += [f"## Decode latency vs batch (Fig. 7; {batch[0]['model']}, {_k(batch[0]['length'])} tokens, "
               f"budget {bbudget})", "",
               _table(["batch", "dense ms", "dense tok/s", "Quest ms", "Quest tok/s", "FlexiCache ms", "FlexiCache tok/s"]
                      + (["floor ms", "floor tok/s"] if floor_col else []), rows), ""]
        if _has_side_by_side(batch):
            md += ["### Side by side: the floor and configuration variants (batch suite)", "", SIDE_BY_SIDE_TEXT, ""]
            md += [p + "\n" for p in side_by_side_tables(batch)]
        if "latency_vs_batch.png" in plots:
            md += ["![latency vs batch](bench/latency_vs_batch.png)", ""]
    if memory:
        rows = [[r["budget"], _k(r["length"]), f"{100 * r['device_fraction']:.2f}%", f"{100 * r['analytic_device_fraction']:.2f}%",
                 f"{100 * r['abs_error']:.2f}", _f(r.get("spare_window_fraction") and 100 * r["spare_window_fraction"], 2),
                 f"{100 * r['metadata_fraction']:.2f}%", f"{100 * r['saving']:.1f}%",
                 f"{100 * r['analytic_saving']:.1f}%", f"{100 * r['saving_kv_only']:.1f}%"]
                for r in sorted(memory, key=lambda r: (r["budget"], r["length"]))]
        u = memory[0]["unstable_share"]
        # Rows from before these were recorded: page 16, R = 16, and S from the analytic metadata share (S / P).
        page, rr = memory[0].get("page_size", 16), memory[0].get("rerank_interval", 16)
        sub = memory[0].get("subpages", round(memory[0]["analytic_metadata_fraction"] * page))
        md += ["## Device memory against context length (Fig. 9)", "",
               f"SmolLM2's attention shape (30 layers × 3 KV heads × 64; tiny hidden size), batch 1, fp32, page {page}, "
               f"R = {rr}, {memory[0].get('profile')} (u = {u:.3f}). Measured after {rr + 1} decode steps (step 1 fills "
               "every stable row's window, then each ranks once more at its phase) from `memory_report()`: the bytes "
               "allocated for the tokens held (`max_cache_len`). Analytic device KV = u + (1 − u)·(B + "
               f"{math.ceil(rr / page) + 1}·{page})/L of dense (the unstable heads' pages, each stable row's window); the "
               "allocation also holds one spare window per layer with stable heads (where a step's padded ranking "
               "places write; 'spare windows', points of dense) and the capacity rounded up to pages. Metadata "
               f"analytic = S/P = {sub}/{page} of "
               f"dense (2·D values per MinMax entry, S = {sub} entries per page, against 2·{page}·D of K and V). Saving = "
               "1 − (device KV + metadata)/dense.", "",
               _table(["budget", "context", "device KV / dense", "analytic", "|diff| (points)", "spare windows (points)",
                       "metadata / dense",
                       "saving", "analytic saving", "saving, KV only"], rows), ""]
        if "memory_saving.png" in plots:
            md += ["![memory saving](bench/memory_saving.png)", ""]
    if promotion:
        rows = [[r["model"], r["budget"], r["prompt_tokens"], r["new_tokens"], r["stable_rows"],
                 f"{100 * r['first_step_fraction']:.1f}%", f"{100 * r['fraction_mean']:.1f}%",
                 f"{100 * r['fraction_median']:.1f}%", f"{100 * r['fraction_p10']:.1f}–{100 * r['fraction_p90']:.1f}%",
                 _f(r["promoted_bytes_per_step"] / 2**10, 1), _f(r["stable_topk_bytes"] / 2**20, 1),
                 "yes" if r["bytes_match_pages"] and r["pages_match_windows"] else "NO"]
                for r in promotion]
        md += ["## Promoted pages per decode step (Table 7)", "",
               f"Real SmolLM2-135M-Instruct (fp32), a {promotion[0]['prompt_tokens']}-token KJV prompt, greedy "
               f"generation; profile: {promotion[0].get('profile')}. Step 1 ranks every stable row and fills its "
               "window from the host tier; after it every step ranks the stable rows whose phase is due (each every "
               "R steps). Share = a step's promoted pages ÷ (its stable rows ranked × K), from `stats()` before and "
               "after the step; mean, median and p10–p90 over the steps after the first that ranked a stable row. "
               "'counts check': `bytes_promoted == pages_promoted × page bytes`, and the pages promoted equal the pages "
               "that entered the windows, counted apart from snapshots of every layer's window pages.", "",
               _table(["model", "budget", "prompt", "generated", "stable rows", "step 1 share", "mean share after",
                       "median", "p10–p90", "KiB promoted / step", "stable rows' K pages MiB", "counts check"], rows),
               ""]
        if "promotion_fraction.png" in plots:
            md += ["![promotion](bench/promotion_fraction.png)", ""]
    path = docs / "benchmarks.md"
    kept = kept_sections(path.read_text()) if path.exists() else []
    path.write_text("\n".join(md + kept) + "\n")
    return path


# Sections of benchmarks.md written by hand (tables from other suites, before/after comparisons): a
# regenerated report carries them over unchanged.
KEPT_SECTIONS = ("## Decode-step ops",)


def kept_sections(text: str) -> list[str]:
    """The lines of every `KEPT_SECTIONS` section of an existing benchmarks.md (heading to the next `## `)."""
    out, keep = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            keep = line.startswith(KEPT_SECTIONS)
        if keep:
            out.append(line)
    return out

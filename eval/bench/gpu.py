"""GPU benchmark for a 15-minute lease: FlexiCache vs dense vs Quest (vs transformers' offloading) on CUDA.

A random-weight model with Llama-3.1-8B's layer shape (hidden 4096, 32 query / 8 KV heads,
head_dim 128, MLP 14336, vocabulary 128256), `--layers` decoder layers (default 8: KV bytes per weight
byte per layer are the real model's, and the whole run fits the lease), bf16, Triton kernels (the
dispatcher picks them on CUDA). Contexts 10k-32k, batch up to 40.

Stages, each guarded so a failure or an out-of-memory case is recorded and the run goes on:
1. sanity (`sanity`): FlexiCache on the GPU (Triton kernels, side-stream tier copies) against the CPU
   reference, fp32 on both sides, same weights (2 layers of the Llama-8B attention shape), same
   prompt K/V, same teacher-forced tokens: at a full budget against dense attention on the CPU, at a
   low budget (re-ranks and promotions every 4 steps, sync and deferred) against FlexiCache on the
   CPU. Every step's logits must agree to `SANITY_RTOL`; if not, the run still times the grid but
   exits with status 1 (and says so last);
2. decode: per (context, batch) the methods in turn, `--steps` timed steps each (CUDA-synchronised
   wall clock per step), peak GPU memory over the model, `memory_report()` bytes per tier, and the
   per-phase breakdown from `enable_timing()` (which synchronises; it costs a little);
3. the summary table, printed last; `$OUT/gpu_bench.json` (or `--out`) is rewritten after every case.

A deadline (`--deadline-s`, default 480 s after start) skips the cases left, so the table always prints.

    bash eval/bench/gpu_bench.sh            # on the GPU machine: sets up imports, writes under $OUT
    python -m fc_hf.eval.bench.gpu --out results/gpu --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

DEFAULT_GRID = [
    # (context, batch, methods, budgets)
    (10240, 1, ("dense", "offload", "quest", "flexicache"), (1024,)),
    (10240, 8, ("dense", "offload", "quest", "flexicache"), (1024,)),
    (10240, 16, ("dense", "quest", "flexicache"), (1024,)),
    (10240, 32, ("dense", "quest", "flexicache"), (1024,)),
    (10240, 40, ("dense", "quest", "flexicache"), (1024, 2048)),
    (32768, 1, ("dense", "offload", "quest", "flexicache"), (1024, 2048)),
    (32768, 4, ("dense", "quest", "flexicache"), (1024,)),
    (32768, 8, ("dense", "quest", "flexicache"), (1024,)),
]


def llama8b_config(layers: int, max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
    )


SANITY_RTOL = 1e-3  # max |logit difference| <= SANITY_RTOL * max(1, max |logit|); fp32 on both sides
SANITY_CASES = (  # (name, FlexiCacheConfig fields, the CPU reference's method)
    ("full", dict(token_budget=2048), "dense"),
    ("low", dict(token_budget=256), "flexicache"),
    ("low-deferred", dict(token_budget=256, promotion="deferred"), "flexicache"),
)


def sanity_config(layers: int = 2):
    """A small model with Llama-3.1-8B's attention shape (32 query / 8 KV heads of 128) for the sanity check."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1024, hidden_size=4096, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
    )


def _forced_logits(model, method, cfg, profile, prompt_kv, tokens, device):
    """Load `prompt_kv` as a prefill would, teacher-force `tokens [B, T]`; returns (`[B, T, V]` fp32 logits on the CPU, stats)."""
    import torch

    from fc_hf.compat import cache_kwarg

    from ..methods import make_cache, prepare_model

    prepare_model(model, method)
    cache = make_cache(method, model, cfg.token_budget, profile, base=cfg, dense_cache=True)
    length = prompt_kv[0][0].shape[2]
    logits = []
    with torch.no_grad():
        for layer, (k, v) in enumerate(prompt_kv):
            cache.update(k.to(device), v.to(device), layer)
        for i in range(tokens.shape[1]):
            out = model(input_ids=tokens[:, i : i + 1].to(device), use_cache=True, logits_to_keep=1,
                        cache_position=torch.tensor([length + i], device=device), **{cache_kwarg(model): cache})
            logits.append(out.logits[:, -1].float().cpu())
    stats = cache.stats() if hasattr(cache, "stats") else {}
    return torch.stack(logits, 1), stats


def sanity(device, config=None, length: int = 1536, steps: int = 24, batch: int = 2, rtol: float = SANITY_RTOL) -> dict:
    """FlexiCache on `device` against the CPU reference (see the module docstring); `ok` is False on any step over `rtol`.

    Returns a dict with one entry per case of `SANITY_CASES` (max difference, the first step over the
    tolerance, pages promoted on the device) and `ok` for all of them; the low-budget cases must also
    have promoted pages, or they would not have exercised the tier copies.
    """
    import copy

    import torch

    from fc_hf import FlexiCacheConfig
    from fc_hf.profile import attention_shape

    from .common import build_model, spread_profile

    config = config or sanity_config()
    reference = build_model(config, dtype=torch.float32, device="cpu")
    model = copy.deepcopy(reference).to(device)
    profile = spread_profile(config, 0.25)
    layers, kv_heads, head_dim = attention_shape(config)
    g = torch.Generator().manual_seed(1)
    prompt_kv = [tuple(torch.randn(batch, kv_heads, length, head_dim, generator=g) for _ in range(2)) for _ in range(layers)]
    tokens = torch.randint(1, config.vocab_size, (batch, steps), generator=g)
    result = {"rtol": rtol, "length": length, "steps": steps, "batch": batch}
    for name, fields, reference_method in SANITY_CASES:
        cfg = FlexiCacheConfig(page_size=16, rerank_interval=4, **fields)
        want, _ = _forced_logits(reference, reference_method, cfg, profile, prompt_kv, tokens, "cpu")
        got, stats = _forced_logits(model, "flexicache", cfg, profile, prompt_kv, tokens, device)
        scale = max(1.0, want.abs().max().item())
        per_step = (got - want).abs().amax(dim=(0, 2))  # [T]
        over = (~(per_step <= rtol * scale)).nonzero()  # NaN counts as over
        case = {"reference": f"{reference_method} (cpu)", "max_abs_logit_diff": per_step.max().item(),
                "max_abs_logit": want.abs().max().item(), "first_bad_step": int(over[0]) + 1 if over.numel() else None,
                "pages_promoted": stats.get("pages_promoted", 0)}
        case["ok"] = case["first_bad_step"] is None and (name == "full" or case["pages_promoted"] > 0)
        result[name] = case
    result["ok"] = all(result[name]["ok"] for name, _, _ in SANITY_CASES)
    return result


def _table(results: list[dict]) -> str:
    idx = {(r["method"], r.get("budget"), r["length"], r["batch"]): r for r in results if "step_ms_mean" in r}
    lines = [f"{'context':>8} {'batch':>5} {'method':>11} {'budget':>6} {'ms/step':>9} {'tok/s':>9} {'vs dense':>9} "
             f"{'vs Quest':>9} {'peak GPU MB':>12} {'device KV MB':>13} {'score+sel ms':>13}"]
    for r in sorted(idx.values(), key=lambda r: (r["length"], r["batch"], r["method"], r.get("budget") or 0)):
        d = idx.get(("dense", None, r["length"], r["batch"]))
        q = idx.get(("quest", r.get("budget"), r["length"], r["batch"]))
        bd = r.get("breakdown_ms") or {}
        sel = bd.get("scoring", 0) + bd.get("selection", 0) if bd else None
        lines.append(
            f"{r['length']:>8} {r['batch']:>5} {r['method']:>11} {str(r.get('budget') or '-'):>6} "
            f"{r['step_ms_mean']:>9.2f} {r['tok_s']:>9.1f} "
            f"{(r['tok_s'] / d['tok_s']) if d else float('nan'):>8.2f}x "
            f"{(r['tok_s'] / q['tok_s']) if q and r['method'] == 'flexicache' else float('nan'):>8.2f}x "
            f"{r.get('peak_gpu_mb', float('nan')):>12.0f} {r.get('memory', {}).get('device_kv_bytes', 0) / 2**20:>13.0f} "
            f"{sel if sel is not None else float('nan'):>13.2f}")
    failed = [r for r in results if "error" in r]
    for r in failed:
        lines.append(f"{r['length']:>8} {r['batch']:>5} {r['method']:>11} {str(r.get('budget') or '-'):>6}  FAILED: {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fc_hf.eval.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=480.0, help="skip the cases left after this many seconds")
    p.add_argument("--quick", action="store_true", help="two small cases only (a dry run of the script)")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only to dry-run the script's logic")
    args = p.parse_args(argv)

    import torch

    from .common import build_model, environment, spread_profile, write_json
    from .decode import decode_case

    start = time.perf_counter()
    device, dtype = args.device, torch.bfloat16
    if device == "cuda" and not torch.cuda.is_available():
        print("bench gpu: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    grid = [(2048, 1, ("dense", "quest", "flexicache"), (1024,)), (4096, 4, ("dense", "flexicache"), (1024,))] \
        if args.quick else DEFAULT_GRID
    max_len = max(g[0] for g in grid) + args.steps + 64
    config = llama8b_config(args.layers, max_len)
    model = build_model(config, dtype=dtype, device=device)
    profile = spread_profile(config, 0.25)
    out = Path(args.out)
    record = {"suite": "gpu", "env": environment(), "layers": args.layers, "dtype": "bf16",
              "profile": f"spread {len(profile.unstable)}/{args.layers * 8} heads",
              "backend": os.environ.get("FLEXICACHE_BACKEND", "auto"), "results": []}
    try:
        record["sanity"] = sanity(device)
    except Exception as e:  # keep going: the timing is still worth having (the exit status reports it)
        record["sanity"] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
    print(f"sanity: {record['sanity']}", flush=True)
    write_json(out / "gpu_bench.json", record)

    for length, batch, methods, budgets in grid:
        for method in methods:
            for budget in (budgets if method in ("quest", "flexicache") else (None,)):
                if time.perf_counter() - start > args.deadline_s:
                    record["results"].append({"method": method, "budget": budget, "length": length, "batch": batch,
                                              "error": "skipped (deadline)"})
                    continue
                t0 = time.perf_counter()
                try:
                    r = decode_case(model, config, method, budget or 1024, length, batch, args.steps, profile,
                                     device=device, dtype=dtype)
                    r.pop("step_ms", None)
                    if method not in ("quest", "flexicache"):
                        r["budget"] = None
                except Exception as e:  # OOM or a kernel failure: record and go on
                    r = {"method": method, "budget": budget, "length": length, "batch": batch,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    torch.cuda.empty_cache()
                r["wall_s"] = time.perf_counter() - t0
                record["results"].append(r)
                write_json(out / "gpu_bench.json", record)
                msg = f"{r['step_ms_mean']:.2f} ms/step" if "step_ms_mean" in r else r["error"]
                print(f"L={length} b={batch} {method} B={budget}: {msg} [{r['wall_s']:.1f} s]", flush=True)
    record["total_s"] = time.perf_counter() - start
    write_json(out / "gpu_bench.json", record)
    print()
    print(f"FlexiCache GPU benchmark: random-weight Llama-3.1-8B layer shape x {args.layers} layers, bf16, "
          f"{record['env'].get('gpu')}, {record['profile']}, sanity ok={record['sanity'].get('ok')}")
    print(_table(record["results"]))
    print(json.dumps({"total_s": round(record["total_s"], 1)}))
    if not record["sanity"].get("ok"):
        print(f"SANITY CHECK FAILED: FlexiCache on {device} does not match the CPU reference (rtol {SANITY_RTOL}); "
              f"see 'sanity' in {out / 'gpu_bench.json'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

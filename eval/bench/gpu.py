"""GPU benchmark for one device lease: FlexiCache vs dense vs Quest (vs transformers' offloading) on CUDA.

Run it with `eval/bench/gpu_bench.sh`: its header gives the device command, the expected wall time and the CPU
rehearsal (`--dry-run`) that CI runs. It needs torch, Triton, transformers and accelerate only.

A random-weight model with Llama-3.1-8B's layer shape (hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 14336,
vocabulary 128256), `--layers` decoder layers (default 8: KV bytes per weight byte per layer are the real model's,
and the whole run fits the lease), bf16, Triton kernels (the dispatcher picks them on CUDA). Contexts 10k-32k,
batch up to 40.

Stages, each guarded so a failure or an out-of-memory case is recorded and the run goes on:
1. sanity (`sanity`): FlexiCache on the GPU (Triton kernels, side-stream tier copies) against the CPU
   reference, fp32 on both sides, same weights (2 layers of the Llama-8B attention shape), same
   prompt K/V, same teacher-forced tokens: at a full budget against dense attention on the CPU, at a
   low budget (re-ranks and promotions every 4 steps, sync and deferred) against FlexiCache on the
   CPU. Every step's logits must agree to `SANITY_RTOL`; and every asynchronous copy's host side must be
   pinned and contiguous (`_audit_async_copies`, on the real device). If not, the run still times the grid
   but exits with status 1 (and says so last);
2. decode (`time_case`): per (context, batch, method, budget) a random-K/V prefill, the first step, `--warmup`
   untimed steps (past every page offset, a page opened and a re-rank: every Triton variant is compiled before
   the timing), then `--steps` timed steps: a CUDA event between steps, no synchronize inside (phase timing
   off), medians and means; Triton compiles during the timed steps are counted (0 expected). Then a separate
   pass of `--phase-steps` steps with `enable_timing()` (which synchronises around each phase) for the
   per-phase breakdown. Memory: peak GPU memory over the model during the prefill and during the timed steps,
   bytes per tier (`memory_report()`), pinned host bytes held by PyTorch's host allocator;
3. the summary table, printed last. `gpu_bench.json` and `gpu_bench.md` (the table) under `--out` are rewritten
   after every stage and case, so a run stopped early still returns what it measured.

A deadline (`--deadline-s`) skips the cases left once the next one would not finish in time, so the table always
prints; the shell script also stops the run at a hard limit (SIGINT: the table is still written).

`--dry-run` (CPU, no GPU): imports everything the GPU run imports, builds every case (its cache and the model on
the meta device), runs the timing path on a tiny model on the CPU, runs the sanity stage's CPU reference, checks
that nothing outside torch, Triton, transformers, accelerate and their dependencies was imported, and writes the
same files. CI runs it through `gpu_bench.sh` from the repository root, under a python3 without the project
installed, as the lent machine runs it (tests/test_gpu_script.py).
"""

from __future__ import annotations

import argparse
import contextlib
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
QUICK_GRID = [(2048, 1, ("dense", "quest", "flexicache"), (1024,)), (4096, 4, ("dense", "flexicache"), (1024,))]
FLEXI = ("quest", "flexicache")

# What the project's own code may import on the lent machine, whose python3 has torch, Triton, transformers and
# accelerate (and their dependencies) but none of the project's extras (lm-eval, datasets, gguf, ...). `--dry-run`
# records every import statement that code runs (`_imports_by_project`); what they import in turn is theirs.
ALLOWED_IMPORTS = frozenset({"fc_hf", "torch", "triton", "transformers", "accelerate", "tqdm", "numpy", "safetensors",
                             "huggingface_hub", "packaging"})


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


@contextlib.contextmanager
def _audit_async_copies():
    """Yields a list that collects every `non_blocking=True` host<->device copy whose host side is not pinned and
    contiguous (such a copy is staged through pageable memory and the host waits for it). CUDA only: on a CPU no
    copy crosses devices."""
    import torch

    found: list[str] = []
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def check(host, what):
        if not (host.is_pinned() and host.is_contiguous()):
            found.append(f"{what} {tuple(host.shape)} pinned={host.is_pinned()} contiguous={host.is_contiguous()}")

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if kwargs.get("non_blocking") and self.device.type == "cpu" and out.device.type == "cuda":
            check(self, "to(cuda)")
        return out

    def copy_(self, src, non_blocking=False):
        if non_blocking and self.device.type != src.device.type:
            check(self if self.device.type == "cpu" else src, "copy_")
        return real_copy(self, src, non_blocking)

    torch.Tensor.to, torch.Tensor.copy_ = to, copy_
    try:
        yield found
    finally:
        torch.Tensor.to, torch.Tensor.copy_ = real_to, real_copy


def sanity(device, config=None, length: int = 1536, steps: int = 24, batch: int = 2, rtol: float = SANITY_RTOL,
           reference_only: bool = False) -> dict:
    """FlexiCache on `device` against the CPU reference (see the module docstring); `ok` is False on any step over `rtol`.

    Returns a dict with one entry per case of `SANITY_CASES` (max difference, the first step over the
    tolerance, pages promoted on the device) and `ok` for all of them; the low-budget cases must also
    have promoted pages, or they would not have exercised the tier copies. `reference_only` (the dry run) computes
    the CPU reference alone and checks its logits are finite.
    """
    import copy

    import torch

    from fc_hf import FlexiCacheConfig
    from fc_hf.profile import attention_shape

    from .common import build_model, spread_profile

    config = config or sanity_config()
    reference = build_model(config, dtype=torch.float32, device="cpu")
    model = None if reference_only else copy.deepcopy(reference).to(device)
    profile = spread_profile(config, 0.25)
    layers, kv_heads, head_dim = attention_shape(config)
    g = torch.Generator().manual_seed(1)
    prompt_kv = [tuple(torch.randn(batch, kv_heads, length, head_dim, generator=g) for _ in range(2)) for _ in range(layers)]
    tokens = torch.randint(1, config.vocab_size, (batch, steps), generator=g)
    result = {"rtol": rtol, "length": length, "steps": steps, "batch": batch}
    for name, fields, reference_method in SANITY_CASES:
        cfg = FlexiCacheConfig(page_size=16, rerank_interval=4, **fields)
        want, _ = _forced_logits(reference, reference_method, cfg, profile, prompt_kv, tokens, "cpu")
        if reference_only:
            result[name] = {"reference": f"{reference_method} (cpu)", "max_abs_logit": want.abs().max().item(),
                            "ok": bool(torch.isfinite(want).all())}
            continue
        with _audit_async_copies() as pageable:
            got, stats = _forced_logits(model, "flexicache", cfg, profile, prompt_kv, tokens, device)
        scale = max(1.0, want.abs().max().item())
        per_step = (got - want).abs().amax(dim=(0, 2))  # [T]
        over = (~(per_step <= rtol * scale)).nonzero()  # NaN counts as over
        case = {"reference": f"{reference_method} (cpu)", "max_abs_logit_diff": per_step.max().item(),
                "max_abs_logit": want.abs().max().item(), "first_bad_step": int(over[0]) + 1 if over.numel() else None,
                "pages_promoted": stats.get("pages_promoted", 0), "pageable_async_copies": pageable[:5]}
        case["ok"] = case["first_bad_step"] is None and (name == "full" or case["pages_promoted"] > 0) and not pageable
        result[name] = case
    result["ok"] = all(result[name]["ok"] for name, _, _ in SANITY_CASES)
    return result


# -- timing ---------------------------------------------------------------------------------------------------------
class _StepTimer:
    """Marks between decode steps: CUDA events on the compute stream (no synchronize until `intervals_ms`), or the
    wall clock on a CPU."""

    def __init__(self, device):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


@contextlib.contextmanager
def _count_compiles():
    """Yields a dict whose "count" is the Triton kernels compiled (in-memory cache misses) inside the block; None when
    this Triton has no `knobs.runtime.jit_cache_hook` (Triton 3.6 and 3.9 have it)."""
    counted = {"count": None}
    try:
        from triton import knobs

        runtime = knobs.runtime
        previous = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield counted
        return
    counted["count"] = 0

    def hook(*args, **kwargs):
        counted["count"] += 1
        return previous(*args, **kwargs) if previous else False

    runtime.jit_cache_hook = hook
    try:
        yield counted
    finally:
        runtime.jit_cache_hook = previous


def _gpu_mb(what: str, cuda: bool) -> float:
    import torch

    if not cuda:
        return 0.0
    return (torch.cuda.max_memory_allocated() if what == "peak" else torch.cuda.memory_allocated()) / 2**20


def _pinned_host_mb() -> dict:
    """Pinned host memory held by PyTorch's host allocator (the host tier rounds up to powers of two there and stays
    cached), when this torch reports it."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        s = stats() if stats else {}
    except RuntimeError:
        return {}
    keys = {"allocated_bytes.current": "host_pinned_held_mb", "active_bytes.current": "host_pinned_in_use_mb"}
    return {name: s[key] / 2**20 for key, name in keys.items() if key in s}


def _release(cuda: bool) -> None:
    import torch

    from .common import release_memory

    release_memory()
    if cuda:
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # give the pinned host tier back between cases
        if empty_host is not None:
            empty_host()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def time_case(model, config, method, budget, length, batch, profile, *, steps, warmup, phase_steps, device,
              dtype) -> dict:
    """Time `steps` decode steps of `method` after a random-K/V prefill of `length` tokens and `warmup` untimed steps
    (see the module docstring, stage 2)."""
    import torch

    from fc_hf.compat import cache_kwarg

    from ..methods import make_cache, prepare_model
    from .common import decode_step, ingest_random_kv, now, sync

    flexi = method in FLEXI
    prepare_model(model, method)
    kwarg = cache_kwarg(model)
    cuda = torch.device(device).type == "cuda"
    r = {"method": method, "budget": budget if flexi else None, "length": length, "batch": batch, "steps": steps,
         "warmup_steps": warmup, "phase_steps": phase_steps if flexi else 0}
    with torch.no_grad():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base_mb = _gpu_mb("now", cuda)
        cache = make_cache(method, config, budget, profile, dense_cache=True)
        t0 = now(device)
        ingest_random_kv(cache, config, batch, length, dtype=dtype, device=device)
        r["ingest_s"] = now(device) - t0
        token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0)).to(device)
        t0 = now(device)
        token = decode_step(model, cache, kwarg, token, length)  # step 1: the first ranking drops the prompt's pages
        r["first_step_ms"] = (now(device) - t0) * 1e3
        r["ingest_peak_mb"] = _gpu_mb("peak", cuda) - base_mb
        position = length + 1
        for _ in range(warmup):
            token = decode_step(model, cache, kwarg, token, position)
            position += 1
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timer = _StepTimer(device)
        with _count_compiles() as compiles:
            wall0 = time.perf_counter()
            timer.mark()
            for _ in range(steps):
                token = decode_step(model, cache, kwarg, token, position)
                position += 1
                timer.mark()
            times = timer.intervals_ms()  # the one synchronize of the timed steps
            r["wall_ms_per_step"] = (time.perf_counter() - wall0) * 1e3 / steps
        r["compiles_in_timed_steps"] = compiles["count"]
        r["decode_peak_mb"] = _gpu_mb("peak", cuda) - base_mb
        if flexi:
            r["memory"] = cache.memory_report()
            if phase_steps:  # apart from the timed steps: the phase timers synchronise
                cache.enable_timing()
                for _ in range(phase_steps):
                    token = decode_step(model, cache, kwarg, token, position)
                    position += 1
                r["breakdown_ms"] = {k: v * 1e3 / phase_steps for k, v in cache.stats().get("timings_s", {}).items()}
            stats = cache.stats()
            r["stats"] = {k: v for k, v in stats.items() if k not in ("promoted_fraction_per_rerank", "timings_s")}
        else:
            layers = [l for l in getattr(cache, "layers", []) if getattr(l, "keys", None) is not None]
            nbytes = [l.keys.numel() * l.keys.element_size() * 2 for l in layers]
            on_device = sum(n for n, l in zip(nbytes, layers) if l.keys.device.type == torch.device(device).type)
            r["memory"] = {"device_kv_bytes": on_device, "dense_kv_bytes": sum(nbytes),
                           "host_kv_bytes": sum(nbytes) - on_device}  # offload: the layers moved to the host
        r.update(_pinned_host_mb() if cuda else {})
        del cache
    _release(cuda)
    r.update(step_ms=times, step_ms_median=_median(times), step_ms_mean=sum(times) / len(times),
             step_ms_min=min(times), step_ms_max=max(times))
    r["tok_s"] = batch * 1e3 / r["step_ms_median"]
    return r


# -- report ---------------------------------------------------------------------------------------------------------
_COLUMNS = ("context", "batch", "method", "budget", "median ms", "mean ms", "tok/s", "vs dense", "vs Quest",
            "compiles", "decode peak MB", "device KV MB", "score+sel ms")


def _table(results: list[dict], markdown: bool = False) -> str:
    """One row per measured case (tok/s from the median step), then the failed and skipped ones."""
    idx = {(r["method"], r.get("budget"), r["length"], r["batch"]): r for r in results if "step_ms_mean" in r}
    rows = []
    for r in sorted(idx.values(), key=lambda r: (r["length"], r["batch"], r["method"], r.get("budget") or 0)):
        d = idx.get(("dense", None, r["length"], r["batch"]))
        q = idx.get(("quest", r.get("budget"), r["length"], r["batch"]))
        bd = r.get("breakdown_ms") or {}
        sel = bd.get("scoring", 0) + bd.get("selection", 0) if bd else float("nan")
        peak = r.get("decode_peak_mb", r.get("peak_gpu_mb", float("nan")))
        compiles = r.get("compiles_in_timed_steps")
        rows.append([str(r["length"]), str(r["batch"]), r["method"], str(r.get("budget") or "-"),
                     f"{r.get('step_ms_median', float('nan')):.2f}", f"{r['step_ms_mean']:.2f}", f"{r['tok_s']:.1f}",
                     f"{(r['tok_s'] / d['tok_s']) if d else float('nan'):.2f}x",
                     f"{(r['tok_s'] / q['tok_s']) if q and r['method'] == 'flexicache' else float('nan'):.2f}x",
                     "-" if compiles is None else str(compiles), f"{peak:.0f}",
                     f"{r.get('memory', {}).get('device_kv_bytes', 0) / 2**20:.0f}", f"{sel:.2f}"])
    failed = [[str(r["length"]), str(r["batch"]), r["method"], str(r.get("budget") or "-"), f"FAILED: {r['error']}"]
              for r in results if "error" in r]
    if markdown:
        lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["| " + " | ".join(row + [""] * (len(_COLUMNS) - len(row))) + " |" for row in failed]
        return "\n".join(lines)
    widths = [max(len(c), 6) for c in _COLUMNS]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = [" ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths))]
    lines += [" ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines += [" ".join(cell.rjust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in failed]
    return "\n".join(lines)


def _headline(record: dict) -> str:
    sanity_ok = (record.get("sanity") or {}).get("ok")
    mode = "DRY RUN (CPU) " if record.get("dry_run") else ""
    return (f"{mode}FlexiCache GPU benchmark: random-weight Llama-3.1-8B layer shape x {record['layers']} layers, "
            f"{record['dtype']}, {record['env'].get('gpu', 'no GPU')}, {record['profile']}, sanity ok={sanity_ok}; "
            f"{record.get('warmup_steps')} untimed + {record.get('steps')} timed steps per case (CUDA events, median)")


def _write(out: Path, record: dict) -> None:
    """`gpu_bench.json` and `gpu_bench.md` as they stand (called after every stage and case)."""
    from .common import write_json

    write_json(out / "gpu_bench.json", record)
    (out / "gpu_bench.md").write_text(_headline(record) + "\n\n" + _table(record["results"], markdown=True) + "\n")


# -- the dry run ----------------------------------------------------------------------------------------------------
def _cases(grid):
    for length, batch, methods, budgets in grid:
        for method in methods:
            for budget in (budgets if method in FLEXI else (None,)):
                yield length, batch, method, budget


@contextlib.contextmanager
def _imports_by_project():
    """Yields a set collecting `importer -> module` for every import statement run by the project's code (modules named
    `fc_hf...`) of a top-level module that is neither standard library nor in `ALLOWED_IMPORTS`."""
    import builtins

    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    found: set[str] = set()
    real = builtins.__import__

    def checked(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        top = name.split(".")[0]
        if level == 0 and importer.startswith("fc_hf") and top not in stdlib and top not in ALLOWED_IMPORTS:
            found.add(f"{importer} -> {name}")
        return real(name, globals, locals, fromlist, level)

    builtins.__import__ = checked
    try:
        yield found
    finally:
        builtins.__import__ = real


def dry_run(args, grid, record: dict, out: Path) -> bool:
    """The CPU rehearsal (module docstring): every check's outcome lands in `record["dry_run"]`; True when all pass."""
    import torch

    from fc_hf import kernels
    from fc_hf.kernels import append, decode, refine, score  # noqa: F401 - the Triton kernels the GPU run launches

    from ..methods import make_cache
    from .common import build_model, model_config, spread_profile

    checks = record["dry_run"]
    checks["triton_kernels_imported"] = kernels.__name__
    # Every case of the grid: its cache, on the model config it runs with (the model itself on the meta device).
    config = llama8b_config(args.layers, max(g[0] for g in grid) + args.warmup + args.steps + args.phase_steps + 64)
    meta_model = build_model(config, dtype=torch.bfloat16, device="meta")
    profile = spread_profile(config, 0.25)
    built = []
    for length, batch, method, budget in _cases(grid):
        cache = make_cache(method, config, budget or 1024, profile if method == "flexicache" else None,
                           dense_cache=True)
        built.append(f"{method}@{budget} L={length} b={batch}: {type(cache).__name__}")
    checks["cases_built"] = built
    checks["meta_model_parameters"] = sum(p.numel() for p in meta_model.parameters())
    del meta_model
    # The timing path on a tiny model on the CPU (offload needs CUDA).
    tiny = model_config("tiny", max_positions=512)
    tiny_model = build_model(tiny)
    tiny_profile = spread_profile(tiny, 0.5)
    rehearsal = {}
    for method in ("dense", "quest", "flexicache"):
        r = time_case(tiny_model, tiny, method, 64, 200, 2, tiny_profile if method == "flexicache" else None,
                      steps=3, warmup=2, phase_steps=2 if method in FLEXI else 0, device="cpu", dtype=torch.float32)
        rehearsal[method] = {k: r[k] for k in ("step_ms_median", "tok_s", "compiles_in_timed_steps")}
        rehearsal[method]["breakdown"] = sorted(r.get("breakdown_ms", {}))
    checks["timing_rehearsal"] = rehearsal
    _write(out, record)
    # The sanity stage's CPU reference, at the model size and prompt the GPU run uses (9 steps: two re-ranks).
    t0 = time.perf_counter()
    record["sanity"] = sanity("cpu", steps=9, reference_only=True)
    checks["sanity_reference_s"] = round(time.perf_counter() - t0, 1)
    checks["ok"] = bool(record["sanity"]["ok"] and len(built) == len(list(_cases(grid))))
    return checks["ok"]


# -- main -----------------------------------------------------------------------------------------------------------
def _record(args, env: dict, deadline: float, argv) -> dict:
    return {"suite": "gpu", "env": env, "argv": sys.argv[1:] if argv is None else argv, "layers": args.layers,
            "dtype": "bf16", "steps": args.steps, "warmup_steps": args.warmup, "phase_steps": args.phase_steps,
            "deadline_s": deadline, "backend": os.environ.get("FLEXICACHE_BACKEND", "auto"), "results": []}


def _dry_run_main(args, argv) -> int:
    """`--dry-run`: `dry_run` with every import statement of the project's code checked (`_imports_by_project`), on
    every case of both grids."""
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"dry_run": {}, "env": {}, "layers": args.layers, "dtype": "bf16", "profile": "-", "results": []}
    with _imports_by_project() as foreign:
        try:
            from .common import environment

            record.update(_record(args, environment(), 0.0, argv), dry_run={}, profile="spread 25% of heads")
            ok = dry_run(args, QUICK_GRID + DEFAULT_GRID, record, out)
        except Exception as e:
            record["dry_run"].update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            ok = False
    record["dry_run"]["imports_beyond_the_stack"] = sorted(foreign)
    record["dry_run"]["ok"] = ok = ok and not foreign
    record["total_s"] = time.perf_counter() - start
    _write(out, record)
    print(json.dumps(record["dry_run"], indent=1))
    print(f"dry run {'ok' if ok else 'FAILED'} in {record['total_s']:.1f} s; files in {out}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_bench.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before them (a page and a re-rank at least)")
    p.add_argument("--phase-steps", type=int, default=16, help="steps of the separate per-phase pass (0: none)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no case that would end after this many seconds (default 300; --quick 90)")
    p.add_argument("--quick", action="store_true", help="two small cases only (about 2 minutes in all)")
    p.add_argument("--dry-run", action="store_true", help="CPU rehearsal: imports, every case built, the CPU reference")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script's logic")
    args = p.parse_args(argv)
    if args.dry_run:
        return _dry_run_main(args, argv)
    deadline = args.deadline_s if args.deadline_s is not None else (90.0 if args.quick else 300.0)

    import torch

    from . import common
    from .common import environment, spread_profile

    start = time.perf_counter()
    device, dtype = args.device, torch.bfloat16
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = _record(args, environment(), deadline, argv)
    if device == "cuda" and not torch.cuda.is_available():
        print("bench gpu: no CUDA device; nothing to do (--dry-run rehearses on a CPU)", file=sys.stderr)
        return 2
    max_len = max(g[0] for g in grid) + args.warmup + args.steps + args.phase_steps + 64
    config = llama8b_config(args.layers, max_len)
    record["profile"] = f"spread {round(0.25 * args.layers * 8)}/{args.layers * 8} heads"
    try:
        try:
            record["sanity"] = sanity(device)
        except Exception as e:  # keep going: the timing is still worth having (the exit status reports it)
            record["sanity"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc(limit=5)}
        print(f"sanity: {record['sanity']}", flush=True)
        _write(out, record)
        try:
            model, model_error = common.build_model(config, dtype=dtype, device=device), None
        except Exception as e:
            model, model_error = None, f"model build failed: {type(e).__name__}: {str(e)[:200]}"
        profile = spread_profile(config, 0.25)
        longest = 0.0
        for length, batch, method, budget in _cases(grid):
            if model_error or time.perf_counter() - start + 1.5 * longest > deadline:
                record["results"].append({"method": method, "budget": budget, "length": length, "batch": batch,
                                          "error": model_error or f"skipped (deadline {deadline:.0f} s)"})
                continue
            t0 = time.perf_counter()
            try:
                r = time_case(model, config, method, budget or 1024, length, batch,
                              profile if method == "flexicache" else None, steps=args.steps, warmup=args.warmup,
                              phase_steps=args.phase_steps, device=device, dtype=dtype)
            except Exception as e:  # OOM or a kernel failure: record and go on
                r = {"method": method, "budget": budget, "length": length, "batch": batch,
                     "error": f"{type(e).__name__}: {str(e)[:200]}"}
                _release(device == "cuda")
            r["wall_s"] = time.perf_counter() - t0
            longest = max(longest, r["wall_s"])
            record["results"].append(r)
            _write(out, record)
            msg = (f"{r['step_ms_median']:.2f} ms/step median, {r.get('compiles_in_timed_steps')} compiles"
                   if "step_ms_median" in r else r["error"])
            print(f"L={length} b={batch} {method} B={budget}: {msg} [{r['wall_s']:.1f} s]", flush=True)
    except KeyboardInterrupt:  # the shell script's hard time limit: keep what was measured
        record["interrupted"] = True
    finally:
        record["total_s"] = time.perf_counter() - start
        _write(out, record)
    print()
    print(_headline(record))
    print(_table(record["results"]))
    print(json.dumps({"total_s": round(record["total_s"], 1), "interrupted": record.get("interrupted", False)}))
    if not record.get("sanity", {}).get("ok"):
        print(f"SANITY CHECK FAILED: FlexiCache on {device} does not match the CPU reference (rtol {SANITY_RTOL}) or "
              f"copied through pageable memory; see 'sanity' in {out / 'gpu_bench.json'}", file=sys.stderr)
        return 1
    return 130 if record.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())

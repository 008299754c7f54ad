"""GPU benchmark for one device lease: FlexiCache and Quest against the fastest dense a user gets, eager and compiled.

Run it with `eval/bench/gpu_bench.sh`: its header gives the device command, the wall time and the CPU rehearsal
(`--dry-run`) that CI runs. It needs torch, Triton and transformers only (the lent machine's: torch 2.11, Triton 3.6,
transformers 5.17; nothing installs there).

The model has random weights of Llama-3.1-8B's layer shape (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336,
vocabulary 128256) and `--layers` decoder layers (8: a layer's KV bytes per weight byte are the real model's), bf16.
A case fills its cache with random K/V as a prefill would (`common.ingest_random_kv`), takes the first decode step
eagerly (profiled: which sdpa kernel ran), `--warmup` more untimed (compiling, recording CUDA graphs), then `--steps`
timed: a CUDA event after every step and no synchronize among them; p50, p99 and the slowest step, tok/s from the
mean. Device memory, weights excluded: the larger of the allocator's peak over the timed steps and what it holds
reserved after them (CUDA graphs keep their memory in pools of their own); `held_bytes` is what the cache's own
tensors occupy on the device, beside what its `memory_report()` says (`held_mapped_host_bytes`: its tensors in pinned
host memory mapped into the device, outside the CUDA allocator's segments: FlexiCache's host tier).

Dense is the fastest a user gets, so it runs as every variant a user may have, each in its own process or with its
backend pinned: `sdpa` (`DynamicCache` and sdpa as installed: `generate`'s default), `sdpa, flash` (sdpa pinned to
flash), `static` (`StaticCache`, eager), `static, compiled` (as `generate` compiles a compileable cache:
`get_compiled_call(CompileConfig())`, inductor, mode "reduce-overhead", CUDA graphs), and the `cuDNN deprioritised`
ones in a process started with `TORCH_CUDNN_SDPA_DEPRIORITIZED=1` (on sm90 with a recent cuDNN torch otherwise
prefers cuDNN's sdpa, whatever it costs a decode step). FlexiCache and Quest (budget 1024) run eager and compiled the
same way; a compile that fails falls back to eager, the reason recorded; a compiled row records its graphs, graph
breaks, recompiles while timed and CUDA-graph skips (inductor skips CUDA graphs for a graph that mutates inputs not
marked static). The throughput case: at `--throughput-context` tokens, the largest batch whose device memory fits
`--cap-gb` for dense (`static, compiled`) and FlexiCache (compiled), estimated from an eager probe at batch 1, then
measured (once more, smaller, if over the cap); FlexiCache's batch is also bounded by its host tier (pinned host memory
mapped into the device, which cannot be paged out) under `--host-cap-gb`, half the machine's memory by default.

Order and time: the sanity check first (in this process), then the cases in priority order (`plan`), each run of
consecutive cases sharing an environment in one worker process. No case starts that would end after
`--time-budget-s`, judged by the slowest finished case of its kind (compiled or eager); a worker still busy then is
stopped. `gpu_bench.json` and `gpu_bench.md` (the table) under `--out` are rewritten after every case.

The sanity check: FlexiCache on the GPU against the CPU reference, fp32 on both sides, same weights (2 layers of the
Llama-8B attention shape), prompt K/V and teacher-forced tokens: at a full budget against dense attention, at a low
budget (re-ranks every 4 steps, sync and deferred promotion) against FlexiCache on the CPU's PyTorch path. Every
step's logits must agree to `SANITY_RTOL`, no non-empty asynchronous host<->device copy may go through pageable
memory, and a `copy.deepcopy` of a filled cache must hold its bytes where the original does (its host tier in mapped
host memory, not device memory). If not, the run goes on but exits with status 1.

`--dry-run` rehearses all of it on a CPU, quickly: tiny shapes, 3 timed steps, the compiled cases through `aot_eager`
(inductor's reduce-overhead mode is CUDA's), the sanity check with the CPU as the device. It also checks that the code
of the project imports nothing beyond that stack (`ALLOWED_IMPORTS`), in this process and in every worker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

# What the project's own code may import on the lent machine: its python3 has torch, Triton and transformers (and their
# dependencies) but none of the project's extras. `_imports_by_project` records every import statement that code runs.
ALLOWED_IMPORTS = frozenset({"fc_hf", "torch", "triton", "transformers", "accelerate", "tqdm", "numpy", "safetensors",
                             "huggingface_hub", "packaging"})

# Each case runs one of these: the method (its attention), the cache, compiled or eager, an sdpa backend pinned, the
# process environment.
VARIANTS = {
    "sdpa": dict(method="dense", cache="dynamic"),
    "sdpa, flash": dict(method="dense", cache="dynamic", pin="flash"),
    "static": dict(method="dense", cache="static"),
    "static, compiled": dict(method="dense", cache="static", compiled=True),
    "sdpa, cuDNN deprioritised": dict(method="dense", cache="dynamic", env="no-cudnn"),
    "static, cuDNN deprioritised": dict(method="dense", cache="static", env="no-cudnn"),
    "static, compiled, cuDNN deprioritised": dict(method="dense", cache="static", compiled=True, env="no-cudnn"),
    "flexicache": dict(method="flexicache", cache="flexicache"),
    "flexicache, compiled": dict(method="flexicache", cache="flexicache", compiled=True),
    "quest": dict(method="quest", cache="flexicache"),
    "quest, compiled": dict(method="quest", cache="flexicache", compiled=True),
}
ENVIRONMENTS = {"installed": {}, "no-cudnn": {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}}
RESULT = "GPU_BENCH_ROW "  # marks a worker's result lines on its stdout
STOP_GRACE_S = 15.0  # a worker busy past the time budget is stopped this much later


def plan(shapes, throughput_context: int | None, budget: int = 1024) -> list[dict]:
    """The cases in priority order: the fair pair (dense and FlexiCache compiled), the other dense variants, Quest
    compiled, the throughput case, the eager sparse ones. `shapes`: (context, batch) pairs; `budget`: FlexiCache's
    and Quest's token budget."""

    def at_every_shape(tier, *labels):
        return [case(label, tier, length, batch, budget) for length, batch in shapes for label in labels]

    cases = at_every_shape(1, "static, compiled", "flexicache, compiled")
    cases += at_every_shape(1, "sdpa", "sdpa, flash", "static")
    cases += at_every_shape(1, "sdpa, cuDNN deprioritised", "static, cuDNN deprioritised",
                            "static, compiled, cuDNN deprioritised")
    cases += at_every_shape(2, "quest, compiled")
    if throughput_context:
        cases += [case(label, 3, throughput_context, None, budget, kind="throughput")
                  for label in ("static, compiled", "flexicache, compiled")]
    return cases + at_every_shape(3, "flexicache", "quest")


def case(label: str, tier: int, length: int, batch: int | None, budget: int, kind: str = "latency") -> dict:
    """A case of `plan`: variant `label` at `length` tokens and `batch` (None: the throughput case finds it)."""
    spec = dict(dict(compiled=False, pin=None, env="installed"), **VARIANTS[label])
    return dict(spec, label=label, tier=tier, kind=kind, length=length, batch=batch,
                budget=None if spec["method"] == "dense" else budget)


def llama8b_config(layers: int, max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
    )


# -- sanity ---------------------------------------------------------------------------------------------------------
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
    """Load `prompt_kv` as a prefill would, teacher-force `tokens [B, T]`; returns (`[B, T, V]` fp32 logits on the
    CPU, stats)."""
    from fc_hf.compat import cache_kwarg

    from ..methods import prepare_model

    prepare_model(model, method)
    cache = _filled_cache(model, method, cfg, profile, prompt_kv, device)
    length = prompt_kv[0][0].shape[2]
    logits = []
    with torch.no_grad():
        for i in range(tokens.shape[1]):
            out = model(input_ids=tokens[:, i : i + 1].to(device), use_cache=True, logits_to_keep=1,
                        cache_position=torch.tensor([length + i], device=device), **{cache_kwarg(model): cache})
            logits.append(out.logits[:, -1].float().cpu())
    stats = cache.stats() if hasattr(cache, "stats") else {}
    return torch.stack(logits, 1), stats


def _filled_cache(model, method, cfg, profile, prompt_kv, device):
    """A cache of `method` holding `prompt_kv` (per layer `(K, V)`), written as a prefill writes it."""
    from ..methods import make_cache

    cache = make_cache(method, model, cfg.token_budget, profile, base=cfg, dense_cache=True)
    with torch.no_grad():
        for layer, (k, v) in enumerate(prompt_kv):
            cache.update(k.to(device), v.to(device), layer)
    return cache


def _copy_bytes(model, profile, prompt_kv, device) -> dict:
    """`copy.deepcopy` of a filled cache (the docs' prefix copies) holds what the original holds where it holds it:
    `(device bytes, mapped host bytes)` of each (`_device_bytes`); a copy whose host tier landed in device memory
    differs."""
    import copy

    from fc_hf import FlexiCacheConfig

    cfg = FlexiCacheConfig(page_size=16, rerank_interval=4, token_budget=256)
    cache = _filled_cache(model, "flexicache", cfg, profile, prompt_kv, device)
    twin = copy.deepcopy(cache)
    entry = {"original": list(_device_bytes(cache, device)), "copy": list(_device_bytes(twin, device))}
    entry["ok"] = entry["original"] == entry["copy"]
    return entry


@contextlib.contextmanager
def _audit_async_copies():
    """Yields a list that collects every non-empty `non_blocking=True` host<->device copy whose host side is not pinned
    and contiguous: such a copy is staged through pageable memory and the host waits for it."""
    found: list[str] = []
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def check(host, what):
        if host.numel() and not (host.is_pinned() and host.is_contiguous()):
            found.append(f"{what} {tuple(host.shape)} pinned={host.is_pinned()} contiguous={host.is_contiguous()}")

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if kwargs.get("non_blocking") and self.device.type == "cpu" and out.device.type != "cpu":
            check(self, "to(device)")
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


def sanity(device, config=None, length: int = 1536, steps: int = 24, batch: int = 2, rtol: float = SANITY_RTOL) -> dict:
    """FlexiCache on `device` against the CPU reference (module docstring); `ok` is False on any step over `rtol`.

    Returns a dict with one entry per case of `SANITY_CASES` (max difference, the first step over the tolerance, pages
    promoted, pageable copies) and `ok` for all of them; the low-budget cases must have promoted pages, or they would
    not have exercised the tier moves."""
    import copy

    from fc_hf import FlexiCacheConfig
    from fc_hf.profile import attention_shape

    from .common import build_model, spread_profile

    config = config or sanity_config()
    reference = build_model(config, dtype=torch.float32, device="cpu")
    model = copy.deepcopy(reference).to(device)
    profile = spread_profile(config, 0.25)
    layers, kv_heads, head_dim = attention_shape(config)
    g = torch.Generator().manual_seed(1)
    prompt_kv = [tuple(torch.randn(batch, kv_heads, length, head_dim, generator=g) for _ in range(2))
                 for _ in range(layers)]
    tokens = torch.randint(1, config.vocab_size, (batch, steps), generator=g)
    result = {"rtol": rtol, "length": length, "steps": steps, "batch": batch}
    for name, fields, reference_method in SANITY_CASES:
        cfg = FlexiCacheConfig(page_size=16, rerank_interval=4, **fields)
        # The reference is the PyTorch path (every kernel's reference), which also spares the lent machine the
        # C++ kernels' build (about 15 s).
        want, _ = _forced_logits(reference, reference_method, dataclasses.replace(cfg, backend="torch"), profile,
                                 prompt_kv, tokens, "cpu")
        with _audit_async_copies() as pageable:
            got, stats = _forced_logits(model, "flexicache", cfg, profile, prompt_kv, tokens, device)
        scale = max(1.0, want.abs().max().item())
        per_step = (got - want).abs().amax(dim=(0, 2))  # [T]
        over = (~(per_step <= rtol * scale)).nonzero()  # NaN counts as over
        entry = {"reference": f"{reference_method} (cpu)", "max_abs_logit_diff": per_step.max().item(),
                 "max_abs_logit": want.abs().max().item(), "first_bad_step": int(over[0]) + 1 if over.numel() else None,
                 "pages_promoted": stats.get("pages_promoted", 0), "pageable_async_copies": pageable[:5]}
        promoted = name == "full" or entry["pages_promoted"] > 0
        entry["ok"] = entry["first_bad_step"] is None and promoted and not pageable
        result[name] = entry
    result["copy"] = _copy_bytes(model, profile, prompt_kv, device)
    result["ok"] = all(result[name]["ok"] for name, _, _ in SANITY_CASES) and result["copy"]["ok"]
    del model
    _release(device)
    return result


# -- one case (in a worker) -----------------------------------------------------------------------------------------
class _StepTimer:
    """Marks between decode steps: CUDA events on the compute stream (no synchronize until `intervals_ms`), or the
    wall clock on a CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _device_bytes(cache, device) -> tuple[int, int]:
    """Bytes of the distinct tensors on `device`'s kind of device that `cache` holds (its layers, stores, selectors,
    masks), found through its attributes: what it occupies there, whatever it reports of itself; and, on CUDA, the
    bytes of those that lie outside the caching allocator's segments (pinned host memory mapped into the device: the
    host tier, which occupies no device memory)."""
    kind = torch.device(device).type
    segments = []
    if kind == "cuda":
        segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]
    seen, storages, total, mapped = set(), set(), 0, 0
    todo = [cache]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if obj.device.type == kind and ptr not in storages:
                storages.add(ptr)
                if segments and storage.nbytes() and not any(lo <= ptr < hi for lo, hi in segments):
                    mapped += storage.nbytes()
                else:
                    total += storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            todo.extend(vars(obj).values())
    return total, mapped


def _cache(spec: dict, config, profile, tokens: int):
    """A fresh cache of the case's kind, with room for `tokens` per sequence (as generate sizes one)."""
    from transformers import StaticCache

    from .common import bench_cache

    if spec["cache"] == "static":
        return StaticCache(config=config, max_cache_len=tokens)
    return bench_cache(spec["method"], config, spec["budget"], profile if spec["method"] == "flexicache" else None,
                       tokens=tokens)


def _step(forward, cache, kwarg: str, token, position):
    """One greedy decode step; the logits are dropped at once (CUDA graphs reuse their memory)."""
    return forward(input_ids=token, cache_position=position, use_cache=True, logits_to_keep=1,
                   **{kwarg: cache}).logits[:, -1:].argmax(-1)


def _sdpa_pin(pin: str | None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if pin == "flash" else contextlib.nullcontext()


def _release(device) -> None:
    """Free what a case left: compiled graphs (their CUDA-graph pools with them), tensors, cached blocks."""
    torch._dynamo.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _timed(model, config, spec: dict, settings: dict, profile, compiled: bool) -> dict:
    """Fill the case's cache, decode (the module docstring) and measure; raises on any failure."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from fc_hf.compat import cache_kwarg
    from fc_hf.kernels import dispatch

    from ..methods import prepare_model
    from .common import ingest_random_kv

    device, steps, warmup = settings["device"], settings["steps"], settings["warmup"]
    cuda = torch.device(device).type == "cuda"
    length, batch = spec["length"], spec["batch"]
    prepare_model(model, spec["method"])
    kwarg = cache_kwarg(model)
    r = dict(spec, compiled=compiled, steps=steps, warmup_steps=warmup)
    if cuda:
        torch.cuda.synchronize()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()  # the weights
    cache = _cache(spec, config, profile, length + 1 + warmup + steps)
    ingest_random_kv(cache, config, batch, length, dtype=getattr(torch, settings["dtype"]), device=device)
    r["held_bytes"], r["held_mapped_host_bytes"] = _device_bytes(cache, device)
    if cuda:
        torch.cuda.empty_cache()  # the random prefill's temporaries are no part of a decode's memory
    token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0)).to(device)
    position = torch.tensor([length], device=device)
    with _sdpa_pin(spec["pin"]), torch.no_grad():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            token = _step(model, cache, kwarg, token, position)  # eager: a FlexiCache's first step ranks every row
        r["sdpa_kernels"] = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})
        if spec["method"] != "dense":
            r["flexicache_backend"] = dispatch.backend_for(token, cache.cache_config.backend)
        forward = model
        if compiled:  # what generate does for a compileable cache (nothing compiled: `_release` reset dynamo)
            counters.clear()
            forward = model.get_compiled_call(CompileConfig(**settings["compile"]))
        t0 = time.perf_counter()
        for i in range(warmup):
            position = position + 1  # as generate advances it: on the device
            token = _step(forward, cache, kwarg, token, position)
            if i == 0:
                _sync(device)
                r["first_call_s"] = time.perf_counter() - t0  # a compiled case's compile
        graphs = counters["stats"]["unique_graphs"]
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timer = _StepTimer(device)
        wall0 = time.perf_counter()
        timer.mark()
        for _ in range(steps):
            position = position + 1
            token = _step(forward, cache, kwarg, token, position)
            timer.mark()
        times = timer.intervals_ms()  # the one synchronize of the timed steps
        r["wall_ms_per_step"] = (time.perf_counter() - wall0) * 1e3 / steps
    if compiled:
        r.update(graphs=graphs, recompiles_in_timed_steps=counters["stats"]["unique_graphs"] - graphs,
                 graph_breaks=sum(counters["graph_break"].values()),
                 cudagraph_skips=counters["inductor"]["cudagraph_skips"])
    if cuda:
        r["decode_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        r["reserved_bytes"] = torch.cuda.memory_reserved() - base_reserved
    # A CPU has no allocator peak: the cache's own bytes.
    r["device_bytes"] = max(r["decode_peak_bytes"], r["reserved_bytes"]) if cuda else r["held_bytes"]
    if spec["method"] != "dense":
        r["memory_report"] = cache.memory_report()  # what the cache reports of itself, beside `held_bytes`
        r["stats"] = {k: v for k, v in cache.stats().items() if k != "bytes_read"}
    del cache
    mean = sum(times) / len(times)
    r.update(step_ms=times, step_ms_p50=percentile(times, 50), step_ms_p99=percentile(times, 99),
             step_ms_max=max(times), step_ms_mean=mean, tok_s=batch * 1e3 / mean)
    return r


def run_case(model, config, spec: dict, settings: dict, profile) -> dict:
    """`_timed`; a compiled case that fails runs again eagerly, the failure recorded as `compile_fallback`."""
    try:
        return _timed(model, config, spec, settings, profile, spec["compiled"])
    except Exception as e:
        if not spec["compiled"]:
            raise
        reason = f"{type(e).__name__}: {str(e)[:300]}"
    _release(settings["device"])  # outside the except block, whose traceback holds the failed attempt's cache
    r = _timed(model, config, spec, settings, profile, compiled=False)
    r["compile_fallback"] = reason
    return r


def throughput_case(model, config, spec: dict, settings: dict, profile) -> dict:
    """The largest batch whose decode fits the cap (weights excluded): estimated from a sequence's device bytes (an
    eager probe at batch 1: its cache and a step's own memory, such as sdpa's `repeat_kv` copy beside a
    `StaticCache`), then measured; once more at a proportionally smaller batch if the measured peak is over the cap."""
    device, cap, host_cap = settings["device"], settings["cap_bytes"], settings.get("host_cap_bytes", 0)
    probe = _timed(model, config, dict(spec, batch=1), dict(settings, steps=1, warmup=1), profile, compiled=False)
    per_sequence, host_per_sequence = probe["device_bytes"], probe["held_mapped_host_bytes"]
    _release(device)
    estimated = max(1, int(cap / (per_sequence * 1.02)))  # 2% for what a larger batch adds beyond the multiple
    host_bound = host_per_sequence and host_cap and estimated * host_per_sequence > host_cap
    if host_bound:  # the host tier, not the device, limits the batch (pinned memory cannot be paged out)
        estimated = max(1, int(host_cap / host_per_sequence))

    def measured(batch: int) -> dict:
        r = run_case(model, config, dict(spec, batch=batch), settings, profile)
        r.update(cap_bytes=cap, bytes_per_sequence=per_sequence, estimated_batch=estimated,
                 fits=r["device_bytes"] <= cap, host_cap_bytes=host_cap, host_bytes_per_sequence=host_per_sequence,
                 host_bound=bool(host_bound))
        return r

    r = measured(estimated)
    if not r["fits"] and estimated > 1:  # once more, smaller by the measured excess
        _release(device)
        r = measured(max(1, int(estimated * cap / r["device_bytes"])))
    return r


def worker(spec: dict) -> int:
    """A worker process: one model, then its cases in turn, one result line each on stdout (`RESULT`); a case that
    would end after the deadline is skipped. Last, a line with what it imported beyond the stack."""
    settings = spec["settings"]
    slowest = dict(spec["slowest"])  # seconds of the slowest finished case, compiled and eager
    with _imports_by_project() as foreign:
        from .common import build_model, model_config, spread_profile

        device = settings["device"]
        max_positions = max(c["length"] for c in spec["cases"]) + settings["warmup"] + settings["steps"] + 64
        if settings["model"] == "llama8b":
            config = llama8b_config(settings["layers"], max_positions)
        else:
            config = model_config(settings["model"], max_positions=max_positions, layers=settings["layers"])
        model = build_model(config, dtype=getattr(torch, settings["dtype"]), device=device)
        profile = spread_profile(config, 0.25)
        for c in spec["cases"]:
            kind = "compiled" if c["compiled"] else "eager"
            if time.time() + slowest.get(kind, 0.0) > spec["deadline"]:
                _emit(dict(c, skipped=f"time budget: the slowest {kind} case took {slowest.get(kind, 0):.0f} s"))
                continue
            t0 = time.perf_counter()
            try:
                run = throughput_case if c["kind"] == "throughput" else run_case
                r = run(model, config, c, settings, profile)
            except Exception as e:  # out of memory, a kernel failing: recorded, the next case runs
                r = dict(c, error=f"{type(e).__name__}: {str(e)[:300]}", traceback=traceback.format_exc(limit=4))
            r["wall_s"] = time.perf_counter() - t0
            slowest[kind] = max(slowest.get(kind, 0.0), r["wall_s"])
            _release(device)
            _emit(r)
    _emit({"worker": {"imports_beyond_the_stack": sorted(foreign), "environment": _environment()}})
    return 0


def _emit(row: dict) -> None:
    print(RESULT + json.dumps(row), flush=True)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# -- the main process -----------------------------------------------------------------------------------------------
def _environment() -> dict:
    from .common import environment

    info = environment()
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    info["cuda"] = torch.version.cuda
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    info["TORCH_CUDNN_SDPA_DEPRIORITIZED"] = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    return info


def _groups(cases: list[dict]) -> list[tuple[str, list[dict]]]:
    """Runs of consecutive cases sharing an environment: one worker process each."""
    groups: list[tuple[str, list[dict]]] = []
    for c in cases:
        if groups and groups[-1][0] == c["env"]:
            groups[-1][1].append(c)
        else:
            groups.append((c["env"], [c]))
    return groups


def _run_worker(env_name: str, spec: dict, stop_at: float, out: Path):
    """Start a worker for `spec` in environment `env_name` and yield each row it prints, then `{"worker": ...}`
    with its exit status. Stopped at `stop_at` (`time.time()`), on an interrupt, or when the caller stops reading."""
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENTS["no-cudnn"]}
    env.update(ENVIRONMENTS[env_name], PYTHONUNBUFFERED="1")
    # Run from `out`, not the checkout's root: there `fc_hf/` (without kernels/ and eval/) would come first.
    proc = subprocess.Popen([sys.executable, "-m", __spec__.name, "--worker", json.dumps(spec)], cwd=out, env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def read():  # in a thread, so that waiting for a line can time out
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    summary = {"env": env_name, "cases": len(spec["cases"])}
    t0 = time.perf_counter()
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, stop_at - time.time()))
            except queue.Empty:
                summary["stopped"] = "time budget"
                break
            if line is None:
                break
            if line.startswith(RESULT):
                row = json.loads(line[len(RESULT):])
                if "worker" in row:
                    summary.update(row["worker"])
                else:
                    yield row
            else:
                print(line, end="", file=sys.stderr)
    finally:
        if proc.poll() is None:  # its process group: inductor's compile workers with it
            os.killpg(proc.pid, signal.SIGKILL)
        summary.update(returncode=proc.wait(), wall_s=time.perf_counter() - t0)
    yield {"worker": summary}


def _settings(args) -> dict:
    """What a worker needs of the options. Compiled as generate compiles (`CompileConfig()`: inductor, mode
    "reduce-overhead"), or with another backend and no mode (the rehearsal's `aot_eager`)."""
    compile_config = {} if args.compile_backend == "inductor" else {"backend": args.compile_backend, "mode": None}
    return {"device": args.device, "model": args.model, "layers": args.layers, "dtype": "bfloat16",
            "steps": args.steps, "warmup": args.warmup, "compile": compile_config, "cap_bytes": int(args.cap_gb * 1e9),
            "host_cap_bytes": int((args.host_cap_gb if args.host_cap_gb is not None else _half_of_ram_gb()) * 1e9)}


def _half_of_ram_gb() -> float:
    """Half the machine's memory (the throughput case's default bound on host memory mapped into the device)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 2 / 1e9
    except OSError:
        pass
    return 32.0


def _run(args, record: dict, out: Path, deadline: float) -> None:
    """The sanity check, then every planned case in its worker; the files are rewritten after each."""
    try:
        record["sanity"] = sanity(args.device, steps=args.sanity_steps)
    except Exception as e:  # keep going: the timing is still worth having (the exit status reports it)
        record["sanity"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc(limit=5)}
    print(f"sanity: {json.dumps(record['sanity'])[:2000]}", flush=True)
    _write(out, record)
    slowest: dict[str, float] = {}
    for env_name, cases in _groups(record["plan"]):
        pending = list(cases)
        why = "stopped at the time budget"
        if time.time() < deadline:
            spec = {"settings": record["settings"], "cases": cases, "deadline": deadline, "slowest": slowest}
            with contextlib.closing(_run_worker(env_name, spec, deadline + STOP_GRACE_S, out)) as rows:
                for row in rows:
                    if "worker" in row:
                        record["workers"].append(row["worker"])
                        continue
                    pending.pop(0)
                    kind = "compiled" if row["compiled"] or "compile_fallback" in row else "eager"
                    slowest[kind] = max(slowest.get(kind, 0.0), row.get("wall_s", 0.0))
                    record["results"].append(row)
                    _write(out, record)
                    print(_progress(row), flush=True)
            if "stopped" not in record["workers"][-1]:
                why = f"its worker exited (status {record['workers'][-1]['returncode']}) first: see gpu_bench.log"
        record["results"] += [dict(c, skipped=why) for c in pending]
        _write(out, record)


def _progress(r: dict) -> str:
    head = f"L={r['length']} b={r['batch']} {r['label']}:"
    if "tok_s" not in r:
        return f"{head} {r.get('skipped') or r.get('error')}"
    return (f"{head} p50 {r['step_ms_p50']:.2f} / p99 {r['step_ms_p99']:.2f} / max {r['step_ms_max']:.2f} ms, "
            f"{r['tok_s']:.0f} tok/s{' (compile failed: eager)' if 'compile_fallback' in r else ''} "
            f"[{r['wall_s']:.1f} s]")


# -- report ---------------------------------------------------------------------------------------------------------
_COLUMNS = ("context", "batch", "case", "compiled", "p50 ms", "p99 ms", "max ms", "tok/s", "vs dense", "vs Quest",
            "attention", "device GB", "notes")
_SDPA_KERNELS = ("cudnn", "flash", "efficient", "math")  # as named in the aten ops sdpa dispatches to


def _group(r: dict) -> tuple:
    """Rows compared with each other: the same context and batch; throughput rows: the same context."""
    kind = r.get("kind", "latency")
    return kind, r["length"], r["batch"] if kind == "latency" else None


def _compiled_cell(r: dict) -> str:
    if "compile_fallback" in r:
        return "no (compile failed)"
    return {True: "yes", False: "no"}.get(r.get("compiled"), "-")


def _notes(r: dict) -> str:
    notes = []
    if r.get("compiled"):
        notes.append(f"{r['graphs']} graphs, {r['graph_breaks']} breaks, {r['cudagraph_skips']} CUDA-graph skips")
        if r["recompiles_in_timed_steps"]:
            notes.append(f"{r['recompiles_in_timed_steps']} recompiles while timed")
    if "compile_fallback" in r:
        notes.append(r["compile_fallback"][:80])
    if r.get("held_mapped_host_bytes"):
        notes.append(f"host tier {r['held_mapped_host_bytes'] / 1e9:.2f} GB mapped")
    if r.get("kind") == "throughput":
        fits = "fits" if r["fits"] else "OVER"
        notes.append(f"{fits} {r['cap_bytes'] / 1e9:g} GB (estimated b={r['estimated_batch']})")
        if r.get("host_bound"):
            notes.append(f"batch bound by the host tier's {r['host_cap_bytes'] / 1e9:g} GB")
    return "; ".join(notes)


def _table(results: list[dict], markdown: bool = False) -> str:
    """One row per measured case (tok/s from the mean step; vs dense: over the fastest dense row of its group), then
    the failed and skipped ones."""
    measured = [r for r in results if "tok_s" in r]
    best_dense: dict[tuple, float] = {}
    for r in measured:
        if r["method"] == "dense":
            best_dense[_group(r)] = max(best_dense.get(_group(r), 0.0), r["tok_s"])
    quest = {(_group(r), r.get("budget"), r.get("compiled")): r["tok_s"] for r in measured if r["method"] == "quest"}
    rows = []
    for r in sorted(measured, key=lambda r: (r.get("kind", "latency") != "latency", -r["length"], r["batch"])):
        dense = best_dense.get(_group(r))
        q = quest.get((_group(r), r.get("budget"), r.get("compiled"))) if r["method"] == "flexicache" else None
        kernel = next((f"sdpa {k}" for k in _SDPA_KERNELS for name in r.get("sdpa_kernels", ()) if k in name),
                      f"flexicache {r['flexicache_backend']}" if "flexicache_backend" in r else "-")
        device_bytes = r.get("device_bytes")
        rows.append([str(r["length"]), str(r["batch"]), r.get("label", r["method"]), _compiled_cell(r),
                     f"{r.get('step_ms_p50', math.nan):.2f}", f"{r.get('step_ms_p99', math.nan):.2f}",
                     f"{r.get('step_ms_max', math.nan):.2f}", f"{r['tok_s']:.1f}",
                     f"{r['tok_s'] / dense:.2f}x" if dense else "-", f"{r['tok_s'] / q:.2f}x" if q else "-", kernel,
                     f"{device_bytes / 1e9:.2f}" if device_bytes is not None else "-", _notes(r)])
    others = [[str(r["length"]), str(r["batch"]), r.get("label", r["method"]),
               f"FAILED: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"]
              for r in results if "tok_s" not in r]
    if markdown:
        lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["| " + " | ".join(row + [""] * (len(_COLUMNS) - len(row))) + " |" for row in others]
        return "\n".join(lines)
    widths = [len(c) for c in _COLUMNS]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = [" ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths))]
    lines += [" ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines += [" ".join(cell.rjust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in others]
    return "\n".join(lines)


def _headline(record: dict) -> str:
    env = record["env"]
    mode = "DRY RUN (CPU) " if record["dry_run"] else ""
    model = "Llama-3.1-8B's layer shape" if record["model"] == "llama8b" else f"a {record['model']} Llama"
    return (f"{mode}FlexiCache GPU benchmark: random weights of {model} x {record['layers']} layers, bf16, "
            f"{env.get('gpu', 'no GPU')}, torch {env.get('torch')}, cuDNN {env.get('cudnn')}, "
            f"sanity ok={(record.get('sanity') or {}).get('ok')}; per case {record['warmup_steps']} untimed + "
            f"{record['steps']} timed steps (CUDA events on a GPU): p50 / p99 / max, tok/s from the mean step; "
            f"budget {record['budget']}; device GB: the decode's, weights excluded")


def _write(out: Path, record: dict) -> None:
    """`gpu_bench.json` and `gpu_bench.md` as they stand (after the sanity check and after every case)."""
    from .common import write_json

    write_json(out / "gpu_bench.json", record)
    (out / "gpu_bench.md").write_text(_headline(record) + "\n\n" + _table(record["results"], markdown=True) + "\n")


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


def _dry_run_checks(record: dict) -> dict:
    """What the CPU rehearsal must show: the sanity check passed, every case measured (compiled ones compiled), the
    throughput cases fit, nothing imported beyond the stack, the GPU run's plan built."""
    results = record["results"]
    foreign = sorted(set(record["imports_beyond_the_stack"]).union(
        *(w.get("imports_beyond_the_stack", ["(worker did not report)"]) for w in record["workers"])))
    checks = {
        "sanity": bool(record["sanity"].get("ok")),
        "every_case_measured": all("tok_s" in r for r in results) and len(results) == len(record["plan"]),
        "compiled_cases_compiled": all(r["compiled"] for r in results if VARIANTS[r["label"]].get("compiled")),
        "throughput_fits": all(r.get("fits") for r in results if r["kind"] == "throughput"),
        "gpu_plan": [f"{c['label']} @ {c['length']} x {c['batch'] or 'max'}" for c in plan(*_GPU_PLAN)],
        "imports_beyond_the_stack": foreign,
    }
    checks["ok"] = all(checks[k] for k in ("sanity", "every_case_measured", "compiled_cases_compiled",
                                            "throughput_fits")) and not foreign
    return checks


_GPU_PLAN = (((32768, 8), (10240, 40)), 32768)  # --shapes and --throughput-context of the GPU run
# Tiny shapes whose contexts hold more pages than the budget (the rankings choose), a cap of a few sequences.
_DRY_RUN = dict(device="cpu", model="tiny", layers=2, shapes=[(160, 2), (96, 3)], throughput_context=160, budget=64,
                steps=3, warmup=2, cap_gb=0.0005, compile_backend="aot_eager", sanity_steps=9, time_budget_s=240.0)


def _tokens(text: str) -> int:
    """"32k" -> 32768."""
    return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)


def _shapes(text: str) -> list[tuple[int, int]]:
    """"32k:8,10k:40" -> [(32768, 8), (10240, 40)]."""
    return [(_tokens(length), int(batch)) for length, batch in (item.split(":") for item in text.split(","))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_bench.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per case")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps after the first (compile, CUDA graphs)")
    p.add_argument("--sanity-steps", type=int, default=24, help="teacher-forced steps of each sanity case")
    p.add_argument("--shapes", type=_shapes, default=list(_GPU_PLAN[0]),
                   help="context:batch,... (default 32k:8,10k:40)")
    p.add_argument("--throughput-context", type=_tokens, default=_GPU_PLAN[1], help="0: no throughput case")
    p.add_argument("--budget", type=int, default=1024, help="FlexiCache's and Quest's token budget")
    p.add_argument("--cap-gb", type=float, default=40.0, help="the throughput case's device memory, weights excluded")
    p.add_argument("--host-cap-gb", type=float, default=None,
                   help="the throughput case's host memory mapped into the device (FlexiCache's host tier; default: "
                        "half the machine's memory)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no case that would end later (420 s; --quick 200 s)")
    p.add_argument("--quick", action="store_true", help="one small shape, no throughput case (about 3 minutes)")
    p.add_argument("--dry-run", action="store_true", help="the CPU rehearsal: tiny shapes, aot_eager, a few steps")
    p.add_argument("--compile-backend", default="inductor",
                   help="inductor (as generate compiles); another torch.compile backend, e.g. aot_eager, rehearses")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script's logic")
    p.add_argument("--model", default="llama8b", choices=("llama8b", "tiny"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.warmup < 1:
        p.error("--warmup must be at least 1: a compiled case compiles in its first untimed step")
    if args.dry_run:
        vars(args).update(_DRY_RUN)
    elif args.quick:
        args.shapes, args.throughput_context = [(4096, 4)], 0
    if args.time_budget_s is None:
        args.time_budget_s = 200.0 if args.quick else 420.0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench gpu: no CUDA device; nothing to do (--dry-run rehearses on a CPU)", file=sys.stderr)
        return 2
    start, deadline = time.perf_counter(), time.time() + args.time_budget_s
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with _imports_by_project() as foreign:  # the project's modules are first imported inside (lazily)
        record = {"suite": "gpu", "dry_run": args.dry_run, "env": _environment(),
                  "argv": sys.argv[1:] if argv is None else argv, "model": args.model, "layers": args.layers,
                  "steps": args.steps, "warmup_steps": args.warmup, "budget": args.budget,
                  "time_budget_s": args.time_budget_s, "cap_gb": args.cap_gb, "settings": _settings(args),
                  "plan": plan(args.shapes, args.throughput_context, args.budget), "sanity": {},
                  "results": [], "workers": []}
        try:
            _run(args, record, out, deadline)
        except KeyboardInterrupt:  # the shell script's hard limit: keep what was measured
            record["interrupted"] = True
        finally:
            record["imports_beyond_the_stack"] = sorted(foreign)
            if args.dry_run:
                record["dry_run_checks"] = _dry_run_checks(record)
            record["total_s"] = time.perf_counter() - start
            _write(out, record)
    print()
    print(_headline(record))
    print(_table(record["results"]))
    print(json.dumps({"total_s": round(record["total_s"], 1), "interrupted": record.get("interrupted", False)}))
    if args.dry_run:
        checks = record["dry_run_checks"]
        print(json.dumps(checks, indent=1))
        print(f"dry run {'ok' if checks['ok'] else 'FAILED'} in {record['total_s']:.1f} s; files in {out}")
        return 0 if checks["ok"] else 1
    if not record["sanity"].get("ok"):
        print(f"SANITY CHECK FAILED: FlexiCache on {args.device} does not match the CPU reference (rtol {SANITY_RTOL}) "
              f"or copied through pageable memory; see 'sanity' in {out / 'gpu_bench.json'}", file=sys.stderr)
        return 1
    return 130 if record.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())

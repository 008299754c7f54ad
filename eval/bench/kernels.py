"""Kernel-level decode-attention benchmark: sparse (score + top-K + paged attention) against dense.

One decode step of one attention layer, Llama-3.1-8B's head shape by default (32 query / 8 KV heads,
head_dim 128). For every (batch, context, budget) it times:

- dense attention over the whole context: SDPA with `enable_gqa=True` (what HF runs) and SDPA with
  each GQA group's query heads packed as rows of one query (usually faster); the faster one is the
  baseline. On CUDA also "dense paged": the sparse kernel with every page selected.
- "rerank-all" (Quest): every KV head scores all its pages, takes its top-K, attends to them.
- "stability-aware" (FlexiCache): the unstable fraction of heads (25%) scores every step, the
  stable heads every R=16 steps (their cost amortised over R), attention per head group as the
  cache runs it. Promotion copies (host -> device) are not part of this kernel benchmark.

Run `python -m fc_hf.eval.bench.kernels --out results.json` (or `flexicache bench-kernels`). On CUDA
the defaults are the paper's setting (bf16, 10k tokens, batch 1/8/16/32/40, budgets 1024/2048) and
timings use `triton.testing.do_bench` (L2 flushed between runs); on CPU it runs the PyTorch path at
small sizes (fp32, 4k/8k tokens, batch 1/4), timing process CPU time on one thread (see `_timer`).

On a GPU machine, kernel tests and this benchmark in one call (from the repository root):

    pip install -q --no-deps --no-build-isolation -e . || { ln -s ../kernels fc_hf/kernels; ln -s ../eval fc_hf/eval; }
    python -m pytest tests/test_kernels.py -q -m cuda -x && python -m fc_hf.eval.bench.kernels --out results/bench_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fc_hf import kernels
from fc_hf.kernels import torch_backend

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _timer(device: torch.device, cpu_iters: int, clock: str = "cpu"):
    """A function `{name: fn} -> {name: milliseconds}` suited to the device.

    CUDA: median of `triton.testing.do_bench` per function (L2 flushed before each run, so a batch-1
    KV that fits in L2 is not flattered). CPU: `cpu_iters` rounds that run every function once each,
    keeping each function's minimum; interleaving spreads other processes' bursts on a shared
    machine evenly over the functions compared. `clock="cpu"` counts this process's CPU time
    (`time.process_time`), which time slices given to other processes do not inflate; it equals
    the work done only with one torch thread (with more it sums the threads, spin-waits included).
    """
    now = time.process_time if clock == "cpu" else time.perf_counter
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fns: {name: float(do_bench(fn, warmup=25, rep=100, return_mode="median")) for name, fn in fns.items()}

    def cpu_time(fns):
        for fn in fns.values():
            fn()  # warm-up
        best = {name: float("inf") for name in fns}
        for _ in range(cpu_iters):
            for name, fn in fns.items():
                t0 = now()
                fn()
                best[name] = min(best[name], (now() - t0) * 1e3)
        return best

    return cpu_time


class Layer:
    """One attention layer's KV in both layouts: dense `[B, Hkv, L, D]` and paged `[S, P, D]` pools.

    Pages are scattered over the pool in a random slot order, as a long-running cache would have them.
    """

    def __init__(self, batch, q_heads, kv_heads, head_dim, context, page_size, dtype, device, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.kv_heads, self.group = batch, kv_heads, q_heads // kv_heads
        self.head_dim, self.context, self.page_size = head_dim, context, page_size
        self.rows = rows = batch * kv_heads
        self.num_pages = pages = math.ceil(context / page_size)
        padded = pages * page_size

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

        self.query = randn(batch, q_heads, 1, head_dim)
        k = randn(batch, kv_heads, padded, head_dim)
        v = randn(batch, kv_heads, padded, head_dim)
        k[:, :, context:] = 0
        v[:, :, context:] = 0
        self.k_dense = k[:, :, :context].contiguous()
        self.v_dense = v[:, :, :context].contiguous()
        self.table = (torch.randperm(rows * pages, generator=gen, device=device) + 1).view(rows, pages)
        self.k_pool = torch.zeros(1 + rows * pages, page_size, head_dim, dtype=dtype, device=device)
        self.v_pool = torch.zeros_like(self.k_pool)
        self.k_pool[self.table.reshape(-1)] = k.reshape(rows * pages, page_size, head_dim)
        self.v_pool[self.table.reshape(-1)] = v.reshape(rows * pages, page_size, head_dim)
        kp = k.reshape(rows, pages, page_size, head_dim)
        self.meta = torch_backend.pack_minmax(kp.amax(2), kp.amin(2)).contiguous()
        self.q_rows = self.query.view(rows, self.group, head_dim)
        self.scaling = head_dim**-0.5
        del k, v, kp

    def group_rows(self, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices of the unstable / stable KV heads: the first `fraction` of each sequence's heads."""
        n_unstable = max(1, round(self.kv_heads * fraction))
        head = torch.arange(self.rows, device=self.table.device) % self.kv_heads
        rows = torch.arange(self.rows, device=self.table.device)
        return rows[head < n_unstable], rows[head >= n_unstable]

    # -- the operations timed -------------------------------------------------------------------
    def dense_sdpa_gqa(self):
        return F.scaled_dot_product_attention(self.query, self.k_dense, self.v_dense, scale=self.scaling, enable_gqa=True)

    def dense_sdpa_packed(self):
        q = self.query.view(self.batch, self.kv_heads, self.group, self.head_dim)
        return F.scaled_dot_product_attention(q, self.k_dense, self.v_dense, scale=self.scaling)


class Group:
    """The tensors a head group of the cache holds: its rows' queries, metadata and block table (contiguous)."""

    def __init__(self, layer: Layer, rows: torch.Tensor, pages_per_head: int, backend: str | None):
        self.layer, self.k, self.backend = layer, pages_per_head, backend
        self.q = layer.q_rows[rows].contiguous()
        self.meta = layer.meta[rows].contiguous()
        self.table = layer.table[rows].contiguous()
        self.rows_per_batch = max(1, rows.numel() // layer.batch)
        self.sel, self.slots = self.select()

    def select(self):
        scores = kernels.score_pages(self.q, self.meta, self.layer.num_pages, backend=self.backend)
        sel = kernels.select_topk(scores, self.k, backend=self.backend)
        return sel, self.table.gather(1, sel)

    def attend(self):
        lay = self.layer
        return kernels.sparse_decode_attention(
            self.q, lay.k_pool, lay.v_pool, self.slots, self.sel, lay.context, lay.scaling,
            None, self.rows_per_batch, None, backend=self.backend,
        )

    def step(self):
        self.sel, self.slots = self.select()
        return self.attend()


def _keep_large_allocations_on_heap() -> bool:
    """glibc: serve large allocations from the heap instead of fresh mmaps (no page faults per call).

    By default glibc maps every allocation above 32 MB anew and unmaps it on free, so a tensor that
    size created each step (the torch path's page gather at batch 4, budget 2048) is page-faulted
    in on every call. Returns whether `mallopt` was available.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def bench_config(layer: Layer, budget: int, args, timer) -> dict:
    k = budget // args.page_size
    backend = args.backend
    all_rows = torch.arange(layer.rows, device=layer.table.device)
    unstable_rows, stable_rows = layer.group_rows(args.unstable_fraction)
    quest = Group(layer, all_rows, k, backend)
    unstable = Group(layer, unstable_rows, k, backend)
    stable = Group(layer, stable_rows, k, backend)

    rec = {"batch": layer.batch, "context": layer.context, "budget": budget, "pages_per_head": k}
    fns = {
        "dense_sdpa_gqa_ms": layer.dense_sdpa_gqa,
        "dense_sdpa_packed_ms": layer.dense_sdpa_packed,
        # Re-rank every head every step (Quest).
        "rerank_all_select_ms": quest.select,
        "rerank_all_attend_ms": quest.attend,
        "rerank_all_step_ms": quest.step,  # measured in one piece, as a check on the sum below
        # Stability-aware: unstable group ranks every step, stable group every R steps; both attend every step.
        "unstable_select_ms": unstable.select,
        "stable_select_ms": stable.select,
        "groups_attend_ms": lambda: (unstable.attend(), stable.attend()),
    }
    if layer.table.is_cuda and args.dense_paged:
        fns["dense_paged_ms"] = Group(layer, all_rows, layer.num_pages, backend).attend
    rec.update(timer(fns))
    rec["dense_ms"] = min(rec["dense_sdpa_gqa_ms"], rec["dense_sdpa_packed_ms"])
    r = args.rerank_interval
    # Both strategies are sums of separately timed parts, so they compare like with like.
    rec["rerank_all_ms"] = rec["rerank_all_select_ms"] + rec["rerank_all_attend_ms"]
    rec["stable_aware_select_ms"] = rec["unstable_select_ms"] + rec["stable_select_ms"] / r
    rec["stable_aware_ms"] = rec["unstable_select_ms"] + rec["stable_select_ms"] / r + rec["groups_attend_ms"]
    rec["speedup_rerank_all"] = rec["dense_ms"] / rec["rerank_all_ms"]
    rec["speedup_stable_aware"] = rec["dense_ms"] / rec["stable_aware_ms"]
    rec["stable_vs_rerank_all_step"] = rec["rerank_all_ms"] / rec["stable_aware_ms"]
    rec["stable_vs_rerank_all_select"] = rec["rerank_all_select_ms"] / rec["stable_aware_select_ms"]
    return rec


def sanity_check(layer: Layer, backend: str | None) -> dict:
    """Every page selected must give dense attention; top-K output must match the torch reference."""
    all_rows = torch.arange(layer.rows, device=layer.table.device)
    every = Group(layer, all_rows, layer.num_pages, backend)
    dense = layer.dense_sdpa_packed().reshape(layer.rows, layer.group, layer.head_dim).float()
    out = {"all_pages_vs_sdpa": _rel_err(every.attend().float(), dense)}
    topk = Group(layer, all_rows, 64, backend)
    ref = torch_backend.sparse_decode_attention(
        topk.q, layer.k_pool, layer.v_pool, topk.slots, topk.sel, layer.context, layer.scaling, None, layer.kv_heads
    )
    out["topk_vs_reference"] = _rel_err(topk.attend().float(), ref.float())
    return out


def format_table(records: list[dict]) -> str:
    head = (
        f"{'batch':>5} {'ctx':>6} {'budget':>6} | {'sdpa-pk':>8} {'sdpa-gqa':>8} {'paged':>8} | {'rerank-all':>10} "
        f"{'stab-aware':>10} | {'dense/RA':>8} {'dense/SA':>8} {'RA/SA':>6} {'sel RA/SA':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        paged = f"{r['dense_paged_ms']:8.3f}" if "dense_paged_ms" in r else f"{'-':>8}"
        lines.append(
            f"{r['batch']:>5} {r['context']:>6} {r['budget']:>6} | {r['dense_sdpa_packed_ms']:8.3f} "
            f"{r['dense_sdpa_gqa_ms']:8.3f} {paged} | {r['rerank_all_ms']:10.3f} {r['stable_aware_ms']:10.3f} | "
            f"{r['speedup_rerank_all']:7.2f}x {r['speedup_stable_aware']:7.2f}x {r['stable_vs_rerank_all_step']:5.2f}x "
            f"{r['stable_vs_rerank_all_select']:8.2f}x"
        )
    lines.append(
        "ms per layer-step. sdpa-pk: SDPA, GQA groups packed as query rows; sdpa-gqa: SDPA enable_gqa (HF); "
        "paged: sparse kernel over every page (CUDA); dense = faster SDPA. RA: re-rank every head every step; "
        "SA: stability-aware (unstable heads every step, stable every R steps, amortised); sel: scoring + top-K only"
    )
    return "\n".join(lines)


def _parse(argv):
    p = argparse.ArgumentParser(prog="flexicache bench-kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--context", type=int, nargs="+", default=None, help="default 10000 on CUDA, 4096 8192 on CPU")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 8 16 32 40 on CUDA, 1 4 on CPU")
    p.add_argument("--budget", type=int, nargs="+", default=[1024, 2048], help="token budgets")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--rerank-interval", type=int, default=16)
    p.add_argument("--unstable-fraction", type=float, default=0.25)
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--cpu-iters", type=int, default=7, help="timed repetitions per measurement on CPU (min is kept)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="CPU runs: process CPU time or wall time")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 with --clock cpu)")
    p.add_argument("--heap-malloc", action="store_true", help="CPU: keep allocations up to 1 GB off mmap (glibc)")
    p.add_argument("--no-dense-paged", dest="dense_paged", action="store_false", help="skip the all-pages paged run")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness sanity check")
    p.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.context = args.context or ([10000] if cuda else [4096, 8192])
    args.batch = args.batch or ([1, 8, 16, 32, 40] if cuda else [1, 4])
    args.backend = None if args.backend == "auto" else args.backend
    if not cuda and args.threads is None and args.clock == "cpu":
        args.threads = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    heap_malloc = args.heap_malloc and _keep_large_allocations_on_heap()
    dtype = _DTYPES[args.dtype]
    timer = _timer(device, args.cpu_iters, args.clock)
    backend_used = kernels.backend_for(torch.empty(0, device=device), args.backend)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "clock": "cuda events (do_bench)" if device.type == "cuda" else args.clock,
        "heap_malloc": heap_malloc,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "backend": backend_used,
        "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "page_size": args.page_size, "rerank_interval": args.rerank_interval,
        "unstable_fraction": args.unstable_fraction,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"bench-kernels: {meta}", flush=True)
    records, checks = [], {}
    for context in args.context:
        for batch in args.batch:
            layer = Layer(batch, args.q_heads, args.kv_heads, args.head_dim, context, args.page_size, dtype, device)
            if args.check and not checks:
                checks = sanity_check(layer, args.backend)
                print(f"sanity check (relative error): {checks}", flush=True)
            for budget in args.budget:
                rec = bench_config(layer, budget, args, timer)
                records.append(rec)
                print(format_table([rec]).splitlines()[2], flush=True)
            del layer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    print(format_table(records))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "checks": checks, "records": records}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

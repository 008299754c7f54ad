"""Speed and memory benchmarks (`flexicache bench`, `flexicache bench-kernels`), apart from the accuracy harness.

| module | owns |
|---|---|
| `cli.py` | `flexicache bench`: options, `--smoke` sizes, which suites run (`python -m fc_hf.eval.bench`) |
| `decode.py` | the timed suites: decode, prefill, batch (each group of cases in a subprocess), re-rank cost |
| `memory.py` | device KV bytes against context length with the analytic limit; promoted bytes per re-rank |
| `ops.py` | kernel-launching aten ops, Triton launches and host syncs per decode step and layer (`bench ops`) |
| `report.py` | `benchmarks.md` and its plots from the suites' JSON |
| `common.py` | model shapes, synthetic head profiles, random prefills, timers, peak RSS, size lists |
| `gpu.py` + `gpu_bench.sh` | the CUDA benchmark for a short GPU lease |
| `kernels.py` | kernel-level decode attention (`flexicache bench-kernels`) |

From the harness the benchmarks use only `fc_hf.eval.methods` (a cache and attention implementation
per method name); the harness never imports this package.
"""

"""Speed and memory benchmarks (`flexicache bench`), apart from the accuracy harness.

| module | owns |
|---|---|
| `cli.py` | `flexicache bench`: options, `--smoke` sizes, which suites run (`python -m fc_hf.eval.bench`) |
| `decode.py` | the timed suites: decode, prefill, batch (each group of cases in a subprocess); ranking work per step |
| `memory.py` | device KV bytes against context length with the analytic limit; pages promoted per decode step |
| `ops.py` | kernel-launching aten ops, Triton launches and host syncs per decode step and layer (`bench ops`) |
| `report.py` | `benchmarks.md` and its plots from the suites' JSON |
| `common.py` | model shapes, synthetic head profiles, sized caches, random prefills, timers, peak RSS, size lists |
| `gpu.py` + `gpu_bench.sh` | the CUDA benchmark for a short GPU lease |

From the harness the benchmarks use only `fc_hf.eval.methods` (a cache and attention implementation
per method name); the harness never imports this package.
"""

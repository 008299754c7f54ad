"""FlexiCache evaluation and benchmarks (installed as `fc_hf.eval`). See `README.md` in this folder.

A generation one-liner with a fresh cache per call is the core's `fc_hf.flexicache_pipeline`.
"""

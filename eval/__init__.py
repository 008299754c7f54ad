"""FlexiCache evaluation and benchmarks (installed as `fc_hf.eval`). See `README.md` in this folder.

    from fc_hf.eval import flexicache_pipeline
    generate = flexicache_pipeline(model, tokenizer, FlexiCacheConfig(token_budget=1024), profile)
"""


def __getattr__(name):
    # Lazy, so `fc_hf.eval.bench` and friends do not import transformers' generation stack first.
    if name == "flexicache_pipeline":
        from .pipeline import flexicache_pipeline

        return flexicache_pipeline
    raise AttributeError(f"module 'fc_hf.eval' has no attribute {name!r}")

"""FlexiCache for Hugging Face transformers.

    from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile, register
    register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flexicache")
    out = model.generate(**inputs, cache=FlexiCache(model.config, FlexiCacheConfig()), max_new_tokens=64)
    # (past_key_values=... before transformers 5.24; `fc_hf.compat.cache_kwargs` picks the name)

The core (the modules here, and `fc_hf.kernels`) imports nothing from `fc_hf.assets` (bundled
models and text), `fc_hf.profiler`, `fc_hf.eval`, `demo` or `cli`.
"""

from importlib import import_module

__version__ = "0.1.0"

# Public names -> defining module. Imported lazily so `fc_hf.kernels` or `fc_hf.profiler` can be
# used without importing transformers' cache machinery first.
_EXPORTS = {
    "FlexiCache": "fc_hf.cache",
    "FlexiCacheConfig": "fc_hf.config",
    "HeadProfile": "fc_hf.profile",
    "register": "fc_hf.attention",
    "FlexiCacheError": "fc_hf.errors",
    "ProfileError": "fc_hf.errors",
    "flexicache_pipeline": "fc_hf.pipeline",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fc_hf' has no attribute {name!r}")

"""The methods the evaluation compares, all built from `FlexiCacheConfig` + `HeadProfile` (SPEC §2).

| name        | what it is                                                                          |
|-------------|-------------------------------------------------------------------------------------|
| dense       | transformers' `DynamicCache` with sdpa attention: the reference                     |
| flexicache  | stability-aware: the profile's unstable heads re-ranked every step, stable heads    |
|             | every R=16 steps, host tier on                                                      |
| quest       | no profile: every head re-ranked every step, everything on the device (Quest)       |
| no-rerank   | every head stable, R=10**9: the top-K chosen at the first decode step stays         |
|             | (permanent eviction, SnapKV-like)                                                   |
| uniform     | every head stable, re-ranked every R=16 steps (no stability awareness)              |
| lserve      | LServe-like: half the KV heads attend to sink + recent pages only (streaming),      |
|             | the rest are stable heads re-ranked every 4 steps                                   |

The ablation of the paper's Table 3 is no-rerank -> uniform -> flexicache -> flexicache at budget 2048.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

__all__ = [
    "METHODS",
    "ABLATION",
    "method_config",
    "method_profile",
    "make_cache",
    "attn_implementation",
    "prepare_model",
    "cache_kwargs",
    "streaming_half",
]

METHODS = ("dense", "flexicache", "quest", "no-rerank", "uniform", "lserve")
ABLATION = (("no-rerank", 1024), ("uniform", 1024), ("flexicache", 1024), ("flexicache", 2048))

NO_RERANK_INTERVAL = 10**9
LSERVE_RERANK_INTERVAL = 4


def _check(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose from {METHODS}.")


def streaming_half(model_config) -> tuple[tuple[int, int], ...]:
    """Every other (layer, KV head) pair in layer-major order: half the heads, spread over all layers.

    LServe picks its streaming heads by profiling; an even spread is the neutral choice when the
    baseline must not borrow FlexiCache's own profile.
    """
    from fc_hf.profile import attention_shape

    layers, kv_heads, _ = attention_shape(model_config)
    pairs = [(l, h) for l in range(layers) for h in range(kv_heads)]
    return tuple(pairs[0::2])


def method_config(method: str, budget: int = 1024, model_config=None, base=None):
    """The `FlexiCacheConfig` of a method (None for dense).

    Args:
        method (`str`): one of `METHODS`.
        budget (`int`, *optional*, defaults to 1024): token budget per head.
        model_config: the model's config (needed by "lserve" to pick its streaming heads).
        base (`FlexiCacheConfig`, *optional*): starting point for fields no method sets (page size,
            backend, ...); its token_budget is replaced by `budget`.
    """
    from fc_hf.config import FlexiCacheConfig

    _check(method)
    if method == "dense":
        return None
    base = replace(base or FlexiCacheConfig(), token_budget=int(budget))
    if method == "flexicache":
        return base
    if method == "quest":
        return replace(base, offload=False)
    if method == "no-rerank":
        return replace(base, rerank_interval=NO_RERANK_INTERVAL)
    if method == "uniform":
        return base
    if model_config is None:
        raise ValueError("method 'lserve' needs the model config to choose its streaming heads.")
    return replace(base, rerank_interval=LSERVE_RERANK_INTERVAL, streaming_heads=streaming_half(model_config))


def method_profile(method: str, model_config, profile=None):
    """The `HeadProfile` a method runs with: the given one for "flexicache", None (all unstable) for
    "quest", all heads stable for "no-rerank", "uniform" and "lserve", and nothing for "dense"."""
    from fc_hf.profile import HeadProfile

    _check(method)
    if method in ("dense", "quest"):
        return None
    if method == "flexicache":
        if profile is None:
            raise ValueError("method 'flexicache' needs a head profile (see eval.runner.resolve_profile).")
        profile.check(model_config)
        return profile
    return HeadProfile.from_unstable(model_config, [], extra={"note": f"all heads stable ({method} baseline)"})


def make_cache(method: str, model, budget: int = 1024, profile=None, base=None):
    """A fresh cache for one `generate` call or one forced sequence (None for dense).

    Args:
        method (`str`): one of `METHODS`.
        model: the model (its config sizes the cache).
        budget (`int`, *optional*, defaults to 1024): token budget per head.
        profile (`HeadProfile`, *optional*): the unstable heads, used by "flexicache" only.
        base (`FlexiCacheConfig`, *optional*): defaults for the fields a method does not set.

    Returns:
        A `FlexiCache`, or None for "dense" (transformers then makes its own `DynamicCache`).
    """
    _check(method)
    if method == "dense":
        return None
    from fc_hf.cache import FlexiCache

    config = model.config
    return FlexiCache(config, method_config(method, budget, config, base), method_profile(method, config, profile))


def attn_implementation(method: str) -> str:
    """The attention implementation a method needs: "sdpa" for dense, "flexicache" otherwise."""
    _check(method)
    return "sdpa" if method == "dense" else "flexicache"


def prepare_model(model, method: str):
    """Switch `model` to the attention implementation `method` needs (registering FlexiCache's)."""
    impl = attn_implementation(method)
    if impl == "flexicache":
        from fc_hf.attention import register

        register()
    if getattr(model.config, "_attn_implementation", None) != impl:
        model.set_attn_implementation(impl)
    return model


def cache_kwargs(model, cache) -> dict[str, Any]:
    """`{name: cache}` under the keyword this transformers version uses (`cache`, formerly
    `past_key_values`); empty for None."""
    if cache is None:
        return {}
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}

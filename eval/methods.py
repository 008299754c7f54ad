"""The methods the evaluation compares, all built from `FlexiCacheConfig` + `HeadProfile` (SPEC §2).

| name        | what it is                                                                          |
|-------------|-------------------------------------------------------------------------------------|
| dense       | transformers' `DynamicCache` with sdpa attention: the reference                     |
| flexicache  | stability-aware: the profile's unstable heads re-ranked every step, stable heads    |
|             | every R=8 steps (`rerank_interval`), host tier on                                   |
| auto        | flexicache with `profile="auto"`: no offline profile; every head is Quest-like for  |
|             | the first `warmup_steps` decode steps, then classified online (fc_hf/online.py)     |
| quest       | no profile: every head re-ranked every step, everything on the device (Quest); its  |
|             | own selection (one MinMax entry per page, no refinement) unless the cache options   |
|             | set `score_subpages` / `refine_pages`                                               |
| no-rerank   | every head stable, R=10**9: the top-K chosen at the first decode step stays         |
|             | (permanent eviction, SnapKV-like)                                                   |
| uniform     | every head stable, re-ranked every R=8 steps (no stability awareness)               |
| lserve      | LServe-like: half the KV heads attend to sink + recent pages only (streaming),      |
|             | the rest are stable heads re-ranked every 4 steps                                   |

The ablation of the paper's Table 3 is no-rerank -> uniform -> flexicache -> flexicache at budget 2048.

This is the one module the accuracy harness and the speed benchmarks (`bench/`) share: the only
place that turns a method name into a cache (`make_cache`) and an attention implementation. The
benchmarks also use "offload", transformers' own whole-layer CPU offloading (`CACHE_NAMES`).
Which keyword `generate` takes the cache under is `fc_hf.compat.cache_kwargs`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any, Sequence

__all__ = [
    "METHODS",
    "CACHE_NAMES",
    "ABLATION",
    "method_config",
    "method_profile",
    "make_cache",
    "attn_implementation",
    "prepare_model",
    "streaming_half",
    "method_runs",
    "parse_cache_options",
    "cache_defaults",
    "resolved_config",
]

METHODS = ("dense", "flexicache", "auto", "quest", "no-rerank", "uniform", "lserve")
# Every name `make_cache` knows: the compared methods, and transformers' offloading cache (benchmarks).
CACHE_NAMES = METHODS + ("offload",)
ABLATION = (("no-rerank", 1024), ("uniform", 1024), ("flexicache", 1024), ("flexicache", 2048))

NO_RERANK_INTERVAL = 10**9
LSERVE_RERANK_INTERVAL = 4
# Quest's selection where the caller leaves `refine_pages` / `score_subpages` unset: no refinement, one MinMax
# entry per page.
QUEST_REFINE_PAGES = 0
QUEST_SCORE_SUBPAGES = 1


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
    if method in ("flexicache", "auto"):
        return base
    if method == "quest":
        # The authors' Quest: its bound over one MinMax entry per page alone chooses (no refinement). Only the
        # fields left unset (None) take those values; ones the caller set (`--cache-options`) are kept, as the
        # run's folder name and config say.
        return replace(base, offload=False,
                       refine_pages=QUEST_REFINE_PAGES if base.refine_pages is None else base.refine_pages,
                       score_subpages=QUEST_SCORE_SUBPAGES if base.score_subpages is None else base.score_subpages)
    if method == "no-rerank":
        return replace(base, rerank_interval=NO_RERANK_INTERVAL)
    if method == "uniform":
        return base
    if model_config is None:
        raise ValueError("method 'lserve' needs the model config to choose its streaming heads.")
    return replace(base, rerank_interval=LSERVE_RERANK_INTERVAL, streaming_heads=streaming_half(model_config))


def method_profile(method: str, model_config, profile=None):
    """The `HeadProfile` a method runs with: the given one for "flexicache", "auto" for "auto" (the cache
    classifies online), None (all unstable) for "quest", all heads stable for "no-rerank", "uniform" and
    "lserve", and nothing for "dense"."""
    from fc_hf.profile import HeadProfile

    _check(method)
    if method in ("dense", "quest"):
        return None
    if method == "auto":
        return "auto"
    if method == "flexicache":
        if profile is None:
            raise ValueError("method 'flexicache' needs a head profile (see eval.profile_choice.resolve_profile).")
        profile.check(model_config)
        return profile
    return HeadProfile.from_unstable(model_config, [], extra={"note": f"all heads stable ({method} baseline)"})


def make_cache(method: str, model, budget: int = 1024, profile=None, base=None, dense_cache: bool = False):
    """A fresh cache for one `generate` call or one forced sequence.

    Args:
        method (`str`): one of `CACHE_NAMES`.
        model: the model, or its config (either sizes the cache).
        budget (`int`, *optional*, defaults to 1024): token budget per head.
        profile (`HeadProfile`, *optional*): the unstable heads, used by "flexicache" only.
        base (`FlexiCacheConfig`, *optional*): defaults for the fields a method does not set.
        dense_cache (`bool`, *optional*, defaults to False): give "dense" a fresh `DynamicCache` (to fill
            by hand, as the benchmarks do) instead of None.

    Returns:
        A `FlexiCache`; for "dense" None (transformers then makes its own `DynamicCache`) unless
        `dense_cache`; for "offload" a `DynamicCache(offloading=True)` (CUDA only).
    """
    if method not in CACHE_NAMES:
        raise ValueError(f"Unknown method {method!r}; choose from {CACHE_NAMES}.")
    config = getattr(model, "config", model)
    if method in ("dense", "offload"):
        from transformers import DynamicCache

        if method == "offload":
            return DynamicCache(config=config, offloading=True)
        return DynamicCache(config=config) if dense_cache else None
    from fc_hf.cache import FlexiCache

    return FlexiCache(config, method_config(method, budget, config, base), method_profile(method, config, profile))


def attn_implementation(method: str) -> str:
    """The attention implementation a method needs: "sdpa" for dense (and "offload"), "flexicache" otherwise."""
    if method not in CACHE_NAMES:
        raise ValueError(f"Unknown method {method!r}; choose from {CACHE_NAMES}.")
    return "sdpa" if method in ("dense", "offload") else "flexicache"


def prepare_model(model, method: str):
    """Switch `model` to the attention implementation `method` needs (registering FlexiCache's)."""
    impl = attn_implementation(method)
    if impl == "flexicache":
        from fc_hf.attention import register

        register()
    if getattr(model.config, "_attn_implementation", None) != impl:
        model.set_attn_implementation(impl)
    return model


def method_runs(methods: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, int | None]]:
    """(method, budget) pairs: each method at every budget, or only at B when written "method@B"."""
    runs = []
    for spec in methods:
        m, _, only = spec.partition("@")
        if m not in METHODS:
            raise ValueError(f"Unknown method {m!r}; choose from {METHODS} (optionally as method@BUDGET).")
        if only and not only.isdigit():
            raise ValueError(f"{spec!r}: the budget after '@' must be a number of tokens, e.g. flexicache@2048.")
        pairs = [(m, None)] if m == "dense" else [(m, int(b)) for b in ([only] if only else budgets)]
        runs.extend(p for p in pairs if p not in runs)
    return runs


def parse_cache_options(text: str | None) -> dict[str, Any]:
    """"carry_pages=0,rerank_interval=8" -> {"carry_pages": 0, "rerank_interval": 8}: `FlexiCacheConfig`
    fields set for every method of a run (`base` of `make_cache`)."""
    options: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if ":" in value:
            options[key.strip()] = tuple(int(v) for v in value.split(":") if v)
        else:
            try:
                options[key.strip()] = int(value)
            except ValueError:
                options[key.strip()] = {"true": True, "false": False}.get(value.lower(), value)
    return options


def cache_defaults(base=None) -> dict[str, Any]:
    """The `FlexiCacheConfig` a run starts from (`base`, or the defaults), recorded in every run's config so that a
    resumed run never mixes results made under different defaults.

    Every field is recorded (JSON-safe: tuples become lists), plus the values the unset fields resolve to:
    `subpages` (`score_subpages` None -> 2 at an even page size) and `candidate_pages` (`refine_pages` None -> 2 * K,
    at the base's own `token_budget`), so that a change of how the defaults resolve also shows.
    """
    from fc_hf.config import FlexiCacheConfig

    cfg = base or FlexiCacheConfig()
    record = {**asdict(cfg), "subpages": cfg.subpages, "candidate_pages": cfg.candidate_pages}
    return json.loads(json.dumps(record))


def resolved_config(cfg):
    """`cfg` with `score_subpages` and `refine_pages` replaced by what they resolve to (`subpages`, `candidate_pages`).

    Two configs that behave the same compare equal this way: `FlexiCacheConfig(score_subpages=2)` and
    `FlexiCacheConfig()` differ as dataclasses, but not once resolved. None stays None (dense).
    """
    if cfg is None:
        return None
    return replace(cfg, score_subpages=cfg.subpages, refine_pages=cfg.candidate_pages)

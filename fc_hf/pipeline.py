"""A text-generation pipeline that generates with a `FlexiCache` of its own, emptied for every call (the stock one would
hand one filled cache to every call), so a pipeline user gets FlexiCache in one line:

    >>> from fc_hf import FlexiCacheConfig, flexicache_pipeline
    >>> pipe = flexicache_pipeline("path/to/model", cache_config=FlexiCacheConfig(token_budget=1024))
    >>> pipe("Once upon a time", max_new_tokens=32, do_sample=False)[0]["generated_text"]
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, PreTrainedModel, pipeline
from transformers.pipelines import PIPELINE_REGISTRY, TextGenerationPipeline

from .attention import NAME, register
from .cache import FlexiCache
from .compat import cache_kwarg
from .config import FlexiCacheConfig
from .profile import HeadProfile

TASK = "flexicache-text-generation"


class FlexiCacheTextGenerationPipeline(TextGenerationPipeline):
    """The stock `TextGenerationPipeline`, generating with one `FlexiCache` that it empties (`reset()`) for every call.

    Args:
        cache_config (`FlexiCacheConfig`, *optional*): settings of the cache; defaults to `FlexiCacheConfig()`.
        profile (`HeadProfile` or `"auto"`, *optional*): unstable heads; None treats every head as unstable (Quest);
            "auto" classifies them online in every call, with a new cache per call (see `FlexiCache`).
        *args, **kwargs: as for `TextGenerationPipeline`.

    The cache (`cache`, made at the first call) keeps its tensors from call to call: a compiled decode step (on CUDA
    `generate` compiles it, with CUDA graphs) is replayed, not compiled and recorded again for every call's new
    tensors, and the host tier is not allocated again. It grows when a call needs more room and is allocated afresh
    for a batch of another size. Its memory stays with the pipeline between calls, as a `StaticCache`'s would;
    `pipe.cache.release()` frees it, and the next call makes a new one. After a call, `last_stats` and
    `last_memory_report` hold that call's `FlexiCache.stats()` and `memory_report()`.
    """

    def __init__(self, *args, cache_config: FlexiCacheConfig | None = None, profile: HeadProfile | str | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if cache_config is not None and not isinstance(cache_config, FlexiCacheConfig):
            raise TypeError(f"cache_config must be a FlexiCacheConfig, got {type(cache_config).__name__}.")
        self.cache_config = cache_config or FlexiCacheConfig()
        self.profile = profile
        if isinstance(profile, HeadProfile):
            profile.check(self.model.config)  # fail at construction, not at the first call
        elif profile is not None:
            FlexiCache(self.model.config, self.cache_config, profile)  # "auto" with fitting settings, or raise now
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl != NAME:
            raise ValueError(
                f"The pipeline's model uses attn_implementation={impl!r}; FlexiCache needs 'flexicache'. Call "
                "`fc_hf.register()` and load it with attn_implementation='flexicache' (flexicache_pipeline does this)."
            )
        self.cache: FlexiCache | None = None
        self.last_stats: dict | None = None
        self.last_memory_report: dict | None = None

    def _forward(self, model_inputs, **generate_kwargs):
        given = [k for k in ("cache", "past_key_values") if generate_kwargs.get(k) is not None]
        if given:
            raise ValueError(
                f"{type(self).__name__} generates with a FlexiCache of its own, emptied for every call; do not pass "
                f"{given[0]}=. Set cache_config/profile on the pipeline instead."
            )
        cache = self._empty_cache()
        generate_kwargs[cache_kwarg(self.model)] = cache
        out = super()._forward(model_inputs, **generate_kwargs)
        self.last_stats, self.last_memory_report = cache.stats(), cache.memory_report()
        return out

    def _empty_cache(self) -> FlexiCache:
        """The pipeline's cache, emptied for a call; a new one at the first call, after `release()`, and with
        profile="auto" (its classification is the call's own)."""
        if self.cache is None or not self.cache.layers or self.profile == "auto":
            self.cache = FlexiCache(self.model.config, self.cache_config, self.profile)
        else:
            self.cache.reset()
        return self.cache


def register_pipeline() -> str:
    """Register the task "flexicache-text-generation" with transformers (idempotent); returns its name.

    Afterwards `transformers.pipeline("flexicache-text-generation", model=..., cache_config=..., profile=...)`
    works like `flexicache_pipeline` for a model already loaded with attn_implementation="flexicache".
    """
    register()
    if PIPELINE_REGISTRY.supported_tasks.get(TASK, {}).get("impl") is not FlexiCacheTextGenerationPipeline:
        PIPELINE_REGISTRY.register_pipeline(
            TASK, pipeline_class=FlexiCacheTextGenerationPipeline, pt_model=AutoModelForCausalLM, type="text"
        )
    return TASK


def flexicache_pipeline(
    model,
    tokenizer=None,
    cache_config: FlexiCacheConfig | None = None,
    profile: HeadProfile | str | None = None,
    model_kwargs: dict | None = None,
    **pipeline_kwargs,
) -> FlexiCacheTextGenerationPipeline:
    """A `text-generation` pipeline whose every call generates with its `FlexiCache`, emptied for the call.

    Args:
        model (`str | os.PathLike | PreTrainedModel`): a model folder or hub name (loaded with
            attn_implementation="flexicache"), or a loaded causal LM (switched to "flexicache" if it is not).
        tokenizer (`str | PreTrainedTokenizerBase`, *optional*): defaults to the model's own.
        cache_config (`FlexiCacheConfig`, *optional*): settings of every cache.
        profile (`HeadProfile | str`, *optional*): a profile, a path/bundled name for `HeadProfile.load`, or "auto".
        model_kwargs (`dict`, *optional*): extra `from_pretrained` arguments when `model` is a path
            (e.g. `{"dtype": torch.bfloat16, "device_map": "auto"}`).
        **pipeline_kwargs: passed to `transformers.pipeline` (e.g. `device`, `batch_size`, generation defaults).

    Returns:
        `FlexiCacheTextGenerationPipeline`: call it like any text-generation pipeline.

    Example:
        >>> pipe = flexicache_pipeline(path, cache_config=FlexiCacheConfig(token_budget=1024), profile="smollm2-135m-instruct")
        >>> pipe(["a long prompt ...", "another one"], max_new_tokens=64, do_sample=False, batch_size=2)
    """
    register()
    if isinstance(model, PreTrainedModel):
        if getattr(model.config, "_attn_implementation", None) != NAME:
            model.set_attn_implementation(NAME)
        if model_kwargs:
            raise ValueError("model_kwargs only apply when `model` is a path; the model is already loaded.")
    else:
        if tokenizer is None:
            tokenizer = str(model)
        model = AutoModelForCausalLM.from_pretrained(model, attn_implementation=NAME, **(model_kwargs or {}))
    if (isinstance(profile, str) and profile != "auto") or hasattr(profile, "__fspath__"):
        profile = HeadProfile.load(profile, model.config)
    return pipeline(
        "text-generation",
        model=model,
        tokenizer=tokenizer,
        pipeline_class=FlexiCacheTextGenerationPipeline,
        cache_config=cache_config,
        profile=profile,
        **pipeline_kwargs,
    )

"""A one-line text generator that gives every call a fresh FlexiCache.

The stock text-generation pipeline would reuse one cache object across prompts, and a non-empty
cache means "continue" (SPEC §3). This callable builds a new cache per call instead.

    from fc_hf.eval.pipeline import flexicache_pipeline
    generate = flexicache_pipeline(model, tokenizer, FlexiCacheConfig(token_budget=1024), profile)
    print(generate("Summarise the text above.", max_new_tokens=64))
"""

from __future__ import annotations

from typing import Callable

__all__ = ["flexicache_pipeline"]


def flexicache_pipeline(model, tokenizer, cfg=None, profile=None, **generate_defaults) -> Callable[..., str]:
    """Return `generate(prompt, **kwargs) -> str` that runs greedy generation with a fresh FlexiCache.

    Args:
        model: a causal LM; its attention implementation is switched to "flexicache".
        tokenizer: its tokenizer.
        cfg (`FlexiCacheConfig`, *optional*): cache settings (default `FlexiCacheConfig()`).
        profile (`HeadProfile`, *optional*): unstable heads; None treats every head as unstable.
        **generate_defaults: defaults for `model.generate` (e.g. `max_new_tokens=128`).

    The returned callable accepts a string, or a list of chat messages (`[{"role": ..., "content": ...}]`,
    formatted with the tokenizer's chat template), plus `generate` keyword arguments.
    """
    import torch

    from fc_hf.cache import FlexiCache
    from fc_hf.config import FlexiCacheConfig

    from .methods import cache_kwargs, prepare_model

    prepare_model(model, "flexicache")
    cfg = cfg or FlexiCacheConfig()
    device = next(model.parameters()).device

    def generate(prompt, **kwargs) -> str:
        if isinstance(prompt, str):
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        else:
            out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            ids = out["input_ids"]
        ids = ids.to(device)
        options = {"max_new_tokens": 64, "do_sample": False, **generate_defaults, **kwargs}
        if options.get("pad_token_id") is None:
            options["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        cache = FlexiCache(model.config, cfg, profile)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), **options)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return generate

"""lm-eval integration: the `flexicache` model type.

    lm_eval --model flexicache \\
        --model_args pretrained=PATH,token_budget=1024,method=flexicache,profile=PROFILE.json \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths":[4096],"tokenizer":"PATH"}'

(`import fc_hf.eval.lm_eval_model` registers it; `flexicache eval ruler` does that for you.)

Every `generate_until` request batch gets a fresh cache built by `methods.make_cache`, so one
cache never serves two prompts. Loglikelihood requests (multiple-choice and perplexity tasks) run
a single forward pass over prompt + continuation and never decode: FlexiCache is a decode-time
method, so those requests run densely (prefill is dense in FlexiCache too) and their scores do not
measure it. Use generation tasks (RULER, LongBench, L-Eval) to measure FlexiCache.
"""

from __future__ import annotations

from pathlib import Path

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from fc_hf.compat import cache_kwargs

from .methods import METHODS, attn_implementation, make_cache, prepare_model

__all__ = ["FlexiCacheLM"]


def _load_profile(profile, model_config):
    """`profile` may be a HeadProfile, a path or bundled profile name, or None / "none"."""
    from fc_hf.profile import HeadProfile

    if profile is None or isinstance(profile, HeadProfile):
        return profile
    if str(profile).lower() in ("", "none"):
        return None
    return HeadProfile.load(Path(str(profile)), config=model_config)


@register_model("flexicache")
class FlexiCacheLM(HFLM):
    """`HFLM` whose generation runs with a fresh FlexiCache (or a baseline from `methods.METHODS`).

    Args:
        pretrained: model folder / hub id, or a loaded `PreTrainedModel`.
        token_budget (`int`, *optional*, defaults to 1024): tokens per head at decode.
        method (`str`, *optional*, defaults to "flexicache"): one of `methods.METHODS`.
        profile: `HeadProfile`, a profile JSON path, or a bundled profile name (needed by "flexicache").
        **kwargs: passed to `HFLM` (tokenizer, batch_size, dtype, device, ...).
    """

    def __init__(self, pretrained, token_budget: int = 1024, method: str = "flexicache", profile=None, **kwargs):
        if method not in METHODS:
            raise ValueError(f"Unknown method {method!r}; choose from {METHODS}.")
        if isinstance(pretrained, str):
            if attn_implementation(method) == "flexicache":
                from fc_hf.attention import register

                register()
            kwargs.setdefault("attn_implementation", attn_implementation(method))
            import torch

            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        else:
            prepare_model(pretrained, method)
        super().__init__(pretrained=pretrained, **kwargs)
        # Data parallel (`accelerate launch --num_processes N`): HFLM takes its rank from accelerate only when it sees
        # more than one GPU, so on CPUs (or one GPU) every process would run every request. The processes accelerate
        # started split the requests instead, as they do on several GPUs (eval/README.md, "Data-parallel evaluation").
        acc = getattr(self, "accelerator", None)
        if acc is not None and acc.num_processes > 1 and self._world_size == 1:
            self._rank, self._world_size = acc.process_index, acc.num_processes
        self.method = method
        self.token_budget = int(token_budget)
        self.profile = _load_profile(profile, self.model.config)
        if method == "flexicache" and self.profile is None:
            raise ValueError("method 'flexicache' needs a head profile: pass profile=PATH (a profile made on other tasks), "
                             "or use method=quest for every head unstable.")
        self.caches_made = 0

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        cache = make_cache(self.method, self.model, self.token_budget, self.profile)
        if cache is not None:
            self.caches_made += 1
            generation_kwargs.update(cache_kwargs(self.model, cache))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

"""Prefill once, decode many times: one dense forward pass over a prompt serves every method.

Every method the evaluation compares prefills densely (FlexiCache's prefill *is* sdpa over the
whole prompt), so the prompt's K/V and its last-position logits are the same for all of them. On a
2-core machine the prefill is most of a long-context sample's cost (≈25 s at 8k tokens on SmolLM2,
several minutes at 16k on Qwen2.5-0.5B), so computing it once per sample instead of once per
method and budget makes the RULER and fidelity grids affordable here.

`load_prefill` hands the prompt's K/V to a fresh cache through `cache.update(k, v, layer_idx)`,
layer by layer, exactly the calls a model's own prefill forward makes; decoding then continues
with ordinary one-token forward passes. `tests/test_eval_shared_prefill.py` checks that this gives
the same tokens as `model.generate` with a fresh cache, for every method.

**Prefix reuse.** Prompts that start alike share more: an L-Eval document carries about 8
questions, each prompt being the same document followed by its question. `extend_prefill` turns the
dense prefill of one prompt into that of another which shares its first tokens, running only the
tokens after the shared part (the shared part's K/V do not depend on what follows it: attention is
causal); `PrefixReuse` does this from each prompt to the next. So a document is prefilled once and
each further question costs a forward pass over the question alone, for every method. The tests check
the result gives the tokens of a fresh `generate` for every method.

A `profile="auto"` cache with `warmup_steps=0` classifies its heads from the prompt's last queries at
prefill, which handed-over K/V do not carry: it gets its own prefill forward too.

Models with sliding-window layers cannot share: such a layer keeps only its last window, and
handing that to another cache is not the same as its prefill. For them `load_prefill` runs each
method's own prefill forward instead (same results, no saving), and prefixes are not reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from fc_hf.compat import cache_kwargs

from .methods import prepare_model

__all__ = [
    "DensePrefill", "dense_prefill", "load_prefill", "extend_prefill", "common_prefix_length", "PrefixReuse",
    "greedy_decode", "forced_decode", "eos_token_ids",
]


@dataclass
class DensePrefill:
    """A prompt's dense prefill.

    Attributes:
        prompt_ids (`list[int]`): the prompt.
        kv (`list[tuple[Tensor, Tensor]]` or None): per layer, keys and values `[1, H_kv, L, D]` after RoPE;
            None when the model has layers that do not keep their full K/V (each method then prefills itself).
        logits (`torch.Tensor` of shape `[V]`): the next-token logits at the prompt's last position.
    """

    prompt_ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None
    logits: torch.Tensor

    @property
    def length(self) -> int:
        return len(self.prompt_ids)


@torch.inference_mode()
def dense_prefill(model, prompt_ids: Sequence[int]) -> DensePrefill:
    """Run the prompt once through `model` with sdpa and a `DynamicCache`; keep its K/V and last logits."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    prompt_ids = list(prompt_ids)
    prepare_model(model, "dense")
    cache = DynamicCache(config=model.config)
    out = _prompt_forward(model, cache, prompt_ids)
    shareable = all(type(layer) is DynamicLayer for layer in cache.layers)
    kv = [(layer.keys, layer.values) for layer in cache.layers] if shareable else None
    return DensePrefill(prompt_ids, kv, out.logits[0, -1])


def _prompt_forward(model, cache, prompt_ids: list[int]):
    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    return model(input_ids=ids, logits_to_keep=1, use_cache=True, **cache_kwargs(model, cache))


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def extend_prefill(model, prefix: DensePrefill, prompt_ids: Sequence[int], reuse: int | None = None) -> DensePrefill:
    """The dense prefill of `prompt_ids`, reusing the K/V of the first `reuse` tokens of `prefix`.

    Args:
        model: the model (left set up for "dense").
        prefix (`DensePrefill`): a prefill whose first `reuse` tokens begin `prompt_ids`; not modified.
        prompt_ids (`list[int]`): the prompt.
        reuse (`int`, *optional*): tokens to reuse (default: all of `prefix`). When that is the whole prompt,
            the prompt must be `prefix`'s own (its last logits are needed) and `prefix` is returned.

    Only the tokens after the reused ones run through the model. A prefix without shareable K/V
    (sliding-window layers) cannot be extended: the prompt gets its own full prefill.
    """
    prompt_ids = list(prompt_ids)
    reuse = prefix.length if reuse is None else int(reuse)
    if not 0 < reuse <= min(prefix.length, len(prompt_ids)) or prompt_ids[:reuse] != prefix.prompt_ids[:reuse]:
        raise ValueError(f"extend_prefill: the prompt does not start with the {reuse} tokens to reuse.")
    if reuse == len(prompt_ids):
        if reuse != prefix.length:
            raise ValueError("extend_prefill: nothing to run after the reused tokens, and their last logits are unknown.")
        return prefix
    if prefix.kv is None:
        return dense_prefill(model, prompt_ids)
    from transformers import DynamicCache

    prepare_model(model, "dense")
    cache = DynamicCache(config=model.config)
    for layer_idx, (k, v) in enumerate(prefix.kv):
        cache.update(k[:, :, :reuse], v[:, :, :reuse], layer_idx)
    out = _prompt_forward(model, cache, prompt_ids[reuse:])
    return DensePrefill(prompt_ids, [(layer.keys, layer.values) for layer in cache.layers], out.logits[0, -1])


class PrefixReuse:
    """Dense prefills of a stream of prompts, each reusing what it shares with the previous one.

    `reuse(prompt_ids)` returns the prompt's `DensePrefill`: when it shares at least `min_shared` leading
    tokens with the previous prompt, only the rest runs through the model (`extend_prefill`); otherwise
    (and for models whose prefills are not shareable) a full `dense_prefill`. Consecutive questions on one
    document thus prefill the document once. `prefilled` and `reused` count the prompt tokens that ran
    through the model and those whose K/V were reused.
    """

    def __init__(self, model, min_shared: int = 64):
        self.model, self.min_shared = model, int(min_shared)
        self.last: DensePrefill | None = None
        self.prefilled = self.reused = 0

    def __call__(self, prompt_ids: Sequence[int]) -> DensePrefill:
        prompt_ids = list(prompt_ids)
        last = self.last
        shared = 0 if last is None or last.kv is None else common_prefix_length(last.prompt_ids, prompt_ids)
        if last is not None and shared == len(prompt_ids) == last.length:  # the same prompt again
            self.reused += shared
            return last
        shared = min(shared, len(prompt_ids) - 1)  # the last position must run: its logits start the decode
        if shared >= max(1, self.min_shared):
            pre = extend_prefill(self.model, last, prompt_ids, reuse=shared)
        else:
            shared, pre = 0, dense_prefill(self.model, prompt_ids)
        self.reused += shared
        self.prefilled += len(prompt_ids) - shared
        self.last = pre
        return pre


@torch.inference_mode()
def load_prefill(prefill: DensePrefill, cache, model, method: str = "dense"):
    """Give `cache` (None: a fresh `DynamicCache`) the prompt, as the model's own prefill forward would.

    The prefill's tensors are not modified (caches copy what they are given), so one prefill can be
    loaded into any number of caches. Leaves `model` set up for `method`.
    """
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    if cache.get_seq_length() != 0:
        raise ValueError("load_prefill needs an empty cache; create a new one for every method and sample.")
    prepare_model(model, method)
    # Not shareable (sliding-window layers), or a cache that classifies its heads from the prompt's queries
    # (profile="auto", warmup_steps=0): this method's own prefill.
    if prefill.kv is None or getattr(cache, "observes_prefill", False):
        _prompt_forward(model, cache, prefill.prompt_ids)
        return cache
    for layer_idx, (k, v) in enumerate(prefill.kv):
        cache.update(k, v, layer_idx)
    return cache


def _step_logits(model, cache, token: int, device) -> torch.Tensor:
    out = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **cache_kwargs(model, cache))
    return out.logits[0, -1]


@torch.inference_mode()
def greedy_decode(
    model, prefill: DensePrefill, method: str, cache, max_new_tokens: int,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy tokens after the prompt for one method.

    Args:
        model: the model (switched to `method`'s attention implementation here).
        prefill (`DensePrefill`): the prompt's dense prefill.
        method (`str`): the method's name (`methods.METHODS`).
        cache: a fresh cache for the method (None for dense).
        max_new_tokens (`int`): at most this many tokens.
        stop (*optional*): `fn(tokens so far) -> bool`; generation ends after the token that makes it true.
    """
    device = next(model.parameters()).device
    cache = load_prefill(prefill, cache, model, method)
    tokens = [int(prefill.logits.argmax())]
    while len(tokens) < max_new_tokens and not (stop and stop(tokens)):
        tokens.append(int(_step_logits(model, cache, tokens[-1], device).argmax()))
    return tokens


@torch.inference_mode()
def forced_decode(model, prefill: DensePrefill, method: str, cache, forced: Sequence[int]) -> Iterator[torch.Tensor]:
    """Feed `forced` one token per step after the prompt; yield each step's fp32 log-probs `[V]`."""
    device = next(model.parameters()).device
    cache = load_prefill(prefill, cache, model, method)
    for token in forced:
        yield torch.log_softmax(_step_logits(model, cache, int(token), device).float(), dim=-1)


def eos_token_ids(model, tokenizer) -> set[int]:
    """The token ids that end a generation: the generation config's EOS ids and the tokenizer's."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids

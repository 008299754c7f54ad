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

Models with sliding-window layers cannot share: such a layer keeps only its last window, and
handing that to another cache is not the same as its prefill. For them `load_prefill` runs each
method's own prefill forward instead (same results, no saving).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from fc_hf.compat import cache_kwargs

from .methods import prepare_model

__all__ = ["DensePrefill", "dense_prefill", "load_prefill", "greedy_decode", "forced_decode", "eos_token_ids"]


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
    if prefill.kv is None:  # not shareable (sliding-window layers): this method's own prefill
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

"""FlexiCache's attention function, registered under the name "flexicache".

Prefill (and layers FlexiCache does not manage: sliding-window and dense layers) goes to
transformers' own sdpa attention. A decode step of a FlexiCache layer arrives with the layer's
placeholder K/V (see `layer.py`); the layer then scores, selects and attends sparsely.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .errors import FlexiCacheError
from .grad_modes import storage_mode, stored_kv_output
from .layer import DecodePlaceholder

NAME = "flexicache"


def flexicache_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention with transformers' standard signature: `query [B, Hq, T, D]` after RoPE, `key`/`value` what the cache
    returned (a decode placeholder at decode steps), the sdpa mask `[B, 1, T, L]` or None -> `(out [B, T, Hq, D], None)`.
    """
    if isinstance(key, DecodePlaceholder):
        if scaling is None:
            scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
        layer = key.fc_layer
        prompt = layer.take_prompt_kv()
        if prompt is None:
            return _decode(layer, query, attention_mask, scaling, kwargs.get("softcap")), None
        # Speculative decoding's first forward: the prompt then the first candidates. The prompt's queries attend
        # densely over it, as its prefill would; the candidates' are decode steps.
        pk, pv = prompt
        n = query.shape[2] - layer.block_tokens()
        mask = attention_mask[:, :, :n, : pk.shape[2]] if isinstance(attention_mask, torch.Tensor) else attention_mask
        dense, _ = flexicache_attention_forward(module, query[:, :, :n], pk, pv, mask, dropout, scaling, **kwargs)
        rest = _decode(layer, query[:, :, n:], attention_mask, scaling, kwargs.get("softcap"))
        return torch.cat([dense, rest], dim=1), None
    observer = getattr(key, "fc_observe", None)  # profile="auto" with zero warm-up: trace the prompt's last queries
    if observer is not None:
        with storage_mode():
            observer.observe_prefill(query, attention_mask)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[-1] > key.shape[-2]:
        # A filled FlexiCache's mask covers its whole capacity; the keys are the tokens held so far.
        attention_mask = attention_mask[..., : key.shape[-2]]
    if kwargs.get("softcap") is not None:  # sdpa refuses logit soft-capping (Gemma2)
        return _dense_softcap_attention(module, query, key, value, attention_mask, scaling, kwargs["softcap"]), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _decode(layer, query: torch.Tensor, attention_mask, scaling: float, softcap) -> torch.Tensor:
    """A FlexiCache layer's decode attention, computed without autograd over its stored pages (fc_hf/grad_modes.py)."""
    with storage_mode():
        out = layer.attend(query, attention_mask, scaling, softcap)
    return stored_kv_output(out, query)


def _dense_softcap_attention(module, query, key, value, attention_mask, scaling, softcap) -> torch.Tensor:
    """Dense attention with `tanh(s / c) * c` logit capping; `[B, Hq, T, D]` -> `[B, T, Hq, D]`."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    logits = torch.matmul(query, key.transpose(2, 3)).float() * scaling
    logits = torch.tanh(logits / softcap) * softcap
    t, length = query.shape[2], key.shape[2]
    if attention_mask is None:  # sdpa_mask skipped a plain causal mask: rebuild it (queries are the last t positions)
        q_pos = torch.arange(length - t, length, device=query.device)[:, None]
        attention_mask = q_pos >= torch.arange(length, device=query.device)[None, :]
    if attention_mask.dtype == torch.bool:
        # The dtype's minimum, not -inf, as eager attention does: a fully masked (padding) query row
        # then stays finite instead of turning into NaN keys/values for the next layer.
        logits = logits.masked_fill(~attention_mask, torch.finfo(logits.dtype).min)
    else:
        logits = logits + attention_mask
    probs = torch.softmax(logits, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def flexicache_mask(*args, **kwargs):
    """transformers' sdpa mask, after checking that a 2D padding mask covers every key position.

    Every way of adding tokens to a filled cache hands the model the mask of the whole sequence (generate does, so
    do chunked prefill, conversations and a copied prefix). A shorter one means the model is re-fed the sequence
    with `use_cache=False` (which would store it twice in the cache) or was given only the new tokens' mask, which
    transformers pads with masked positions: both would attend wrongly, so refuse before any layer writes."""
    mask, q_offset, q_length = kwargs.get("attention_mask"), kwargs.get("q_offset"), kwargs.get("q_length")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and isinstance(q_offset, int) and q_length is not None:
        covered = mask.shape[-1]
        needed = q_offset + q_length  # the tokens held and the new ones (a FlexiCache's mask spans its capacity)
        if covered < needed:
            raise FlexiCacheError(
                f"The attention mask covers {covered} positions but the cache and the new tokens span {needed}. Pass "
                "the mask of the whole sequence (earlier tokens and new ones), as generate does. With generate this "
                "happens under use_cache=False, which re-feeds the whole sequence to a cache that already holds it: "
                "keep use_cache=True (the default) with a FlexiCache. Nothing was written."
            )
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register FlexiCache's attention and mask functions under "flexicache" (idempotent); returns the name.

    Touches nothing else: models not asked for `attn_implementation="flexicache"` are unaffected.
    """
    AttentionInterface.register(NAME, flexicache_attention_forward)
    # Without a mask function transformers builds no mask at all, and left padding would be ignored.
    AttentionMaskInterface.register(NAME, flexicache_mask)
    return NAME

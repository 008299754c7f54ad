"""Top-K page traces recorded during *dense* greedy decoding.

A registered attention function ("flexicache_trace") sees every layer's post-RoPE query and full
keys. At decode steps (query length 1) it keeps per-page key min/max (incrementally: a page's entry
is written once, when it is full), scores the pages with the Quest bound (`page_scores`: one
MinMax entry per page, GQA max over the group, page being filled forced in; no sink page, sub-pages or
refinement, i.e. the authors' selection, not FlexiCache's default) and records the top-K indices per KV
head: stability is measured on the bound's choices, as the paper does. The output then comes from transformers' sdpa attention over all keys,
so the trace reflects the model, never FlexiCache's own choices.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from fc_hf.compat import cache_kwarg
from fc_hf.kernels.torch_backend import page_scores
from fc_hf.profile import attention_shape

TRACE_ATTENTION = "flexicache_trace"

_ACTIVE: contextvars.ContextVar["PageTracer | None"] = contextvars.ContextVar("flexicache_page_tracer", default=None)


@dataclass
class Trace:
    """One sample's trace.

    Attributes:
        topk (`torch.LongTensor` of shape `[D, L, H, K]`): selected pages per decode step, layer, KV head;
            -1 pads steps that had fewer than K pages.
        num_pages (`torch.LongTensor` of shape `[D]`): pages that existed at each step (the last one partial).
        tokens (`torch.LongTensor` of shape `[D]`): the token fed at each step (greedy output).
        prompt_len (`int`): prompt tokens.
    """

    topk: torch.Tensor
    num_pages: torch.Tensor
    tokens: torch.Tensor
    prompt_len: int

    def save(self, path) -> None:
        torch.save({"topk": self.topk.to(torch.int16 if self.num_pages.max() < 2**15 else torch.int32),
                    "num_pages": self.num_pages, "tokens": self.tokens, "prompt_len": self.prompt_len}, path)

    @classmethod
    def load(cls, path) -> "Trace":
        raw = torch.load(path)
        return cls(raw["topk"].long(), raw["num_pages"].long(), raw["tokens"].long(), int(raw["prompt_len"]))


class PageTracer:
    """Collects top-K page indices of every (layer, KV head) at each decode step.

    Args:
        num_layers (`int`), num_kv_heads (`int`), head_dim (`int`): attention shape of the model.
        page_size (`int`): tokens per page (P).
        pages_per_head (`int`): K, pages selected per head (the page being filled is one of them).
        max_steps (`int`): decode steps to record.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, pages_per_head: int, max_steps: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.k = page_size, pages_per_head
        self.topk = torch.full((max_steps, num_layers, num_kv_heads, pages_per_head), -1, dtype=torch.long)
        self.num_pages = torch.zeros(max_steps, dtype=torch.long)
        self.step = 0
        self._meta: list[torch.Tensor | None] = [None] * num_layers  # [H, capacity, 2*head_dim] per layer
        self._full = [0] * num_layers  # pages whose min/max is written

    def _update_meta(self, layer: int, key: torch.Tensor) -> None:
        """Write min/max of pages that filled since the last call. `key`: `[H, T, D]`."""
        heads, length, dim = key.shape
        pages = -(-length // self.page_size)
        meta = self._meta[layer]
        if meta is None or meta.shape[1] < pages:
            grown = torch.zeros(heads, max(pages, 2 * (0 if meta is None else meta.shape[1]), 64), 2 * dim, dtype=key.dtype)
            if meta is not None:
                grown[:, : meta.shape[1]] = meta
            meta = self._meta[layer] = grown
        done, full = self._full[layer], length // self.page_size
        if full > done:
            new = key[:, done * self.page_size : full * self.page_size].reshape(heads, full - done, self.page_size, dim)
            meta[:, done:full] = torch.cat([new.amax(dim=2), new.amin(dim=2)], dim=-1)
            self._full[layer] = full
        # The partial last page needs no entry: it is forced in with +inf.

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Record layer `layer`'s top-K pages for the current step.

        Args:
            query (`torch.Tensor` of shape `[1, Hq, 1, D]`): post-RoPE decode query.
            key (`torch.Tensor` of shape `[1, H, T, D]`): all keys of the layer, post-RoPE.
        """
        if query.shape[0] != 1:
            raise ValueError(f"the page tracer records batch 1 only, got batch {query.shape[0]}")
        if self.step >= self.topk.shape[0]:
            return
        key = key[0].detach()
        heads, length = key.shape[0], key.shape[1]
        self._update_meta(layer, key)
        pages = -(-length // self.page_size)
        q = query[0, :, 0].detach().reshape(heads, -1, query.shape[-1])  # query head j -> KV head j // G
        bias = torch.zeros(heads, pages)
        bias[:, -1] = float("inf")  # the page being filled is always selected
        scores = page_scores(q, self._meta[layer][:, :pages].transpose(1, 2), bias, 1)
        chosen = torch.topk(scores, min(self.k, pages), dim=-1).indices
        self.topk[self.step, layer, :, : chosen.shape[1]] = chosen
        self.num_pages[self.step] = pages


def trace_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention function "flexicache_trace": records the active tracer's top-K pages, then runs sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tracer = _ACTIVE.get()
    if tracer is not None and query.shape[2] == 1:
        tracer.observe(module.layer_idx, query, key)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_trace_attention() -> str:
    """Register "flexicache_trace" (attention + sdpa mask) with transformers; returns the name. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TRACE_ATTENTION, trace_attention)
    AttentionMaskInterface.register(TRACE_ATTENTION, sdpa_mask)
    return TRACE_ATTENTION


def _eos_ids(model, tokenizer=None) -> list[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


@torch.inference_mode()
def collect_trace(
    model,
    input_ids: torch.Tensor,
    new_tokens: int,
    page_size: int = 16,
    token_budget: int = 1024,
    suppress_eos: bool = True,
    tokenizer=None,
    progress=None,
) -> Trace:
    """Greedy dense decoding of one prompt with `DynamicCache`, recording top-K pages at every step.

    Step d is the forward pass that feeds the d-th generated token (query length 1); the prefill
    is not a step. With `suppress_eos` the end-of-sequence tokens are masked out so every sample
    yields exactly `new_tokens` steps.

    Args:
        model: a transformers causal LM whose attention goes through `AttentionInterface` (Llama, Qwen2, ...).
        input_ids (`torch.LongTensor` of shape `[1, T]`): the prompt.
        new_tokens (`int`): D, decode steps to record.
        page_size (`int`, *optional*, defaults to 16): P.
        token_budget (`int`, *optional*, defaults to 1024): K * P.
        suppress_eos (`bool`, *optional*, defaults to True): never emit EOS.
        tokenizer (*optional*): only to find more EOS ids.
        progress (*optional*): a tqdm-like object; `update(1)` is called per step.

    Returns:
        `Trace` with `topk` `[D, L, H, K]` and `num_pages` `[D]`.
    """
    from transformers import DynamicCache

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"collect_trace takes one prompt, input_ids [1, T]; got {tuple(input_ids.shape)}")
    if token_budget % page_size:
        raise ValueError(f"token_budget ({token_budget}) must be a multiple of page_size ({page_size})")
    layers, kv_heads, head_dim = attention_shape(model.config)
    tracer = PageTracer(layers, kv_heads, head_dim, page_size, token_budget // page_size, new_tokens)
    register_trace_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(TRACE_ATTENTION)
    cache_arg = cache_kwarg(model)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    eos = _eos_ids(model, tokenizer) if suppress_eos else []
    token = _ACTIVE.set(tracer)
    try:
        cache = DynamicCache(config=model.config)
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        fed = torch.empty(new_tokens, dtype=torch.long)
        for step in range(new_tokens):
            logits = out.logits[:, -1].float()
            if eos:
                logits[:, eos] = float("-inf")
            nxt = logits.argmax(dim=-1, keepdim=True)
            fed[step] = nxt.item()
            tracer.step = step
            out = model(input_ids=nxt, use_cache=True, **{cache_arg: cache})
            if progress is not None:
                progress.update(1)
    finally:
        _ACTIVE.reset(token)
        model.set_attn_implementation(previous)
    return Trace(tracer.topk, tracer.num_pages, fed, int(input_ids.shape[1]))

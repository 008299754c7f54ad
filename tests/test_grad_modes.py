"""FlexiCache under every grad mode (`fc_hf/grad_modes.py`), and a forward that failed part-way.

- Under plain autograd and under `torch.inference_mode()` a forward gives `no_grad`'s logits bitwise, step after step,
  and the cache goes on being usable (a prefill under inference mode, then `generate`).
- Backward through a decode step raises `FlexiCacheError` (stored K/V carry no gradient); through a prompt on an empty
  cache it gives DynamicCache's gradients exactly.
- A forward that raised after some layers had stored its token is refused by the next forward, naming the lengths.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile
from fc_hf.compat import cache_kwargs

CFG = FlexiCacheConfig(page_size=8, token_budget=32, rerank_interval=2)
MODES = {"no_grad": torch.no_grad, "autograd": torch.enable_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, heads=4, kv_heads=2)


def _cache(model):
    # One stable and one unstable KV head per layer: both tiers, re-ranks with promotions every 2 steps.
    return FlexiCache(model.config, CFG, HeadProfile.from_unstable(model.config, {(0, 0), (1, 1)}))


def _decode(model, mode: str, steps: int = 6):
    """Prompt of 70 tokens then `steps` greedy decode steps under `mode`: the last-position logits of each forward."""
    ids = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(0))
    cache, logits = _cache(model), []
    with MODES[mode]():
        out = model(ids, **cache_kwargs(model, cache))
        for _ in range(steps + 1):
            logits.append(out.logits[:, -1])
            out = model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache))
    return cache, logits


@pytest.mark.parametrize("mode", ["autograd", "inference_mode"])
def test_every_grad_mode_gives_no_grads_logits_bitwise(model, mode):
    _, expected = _decode(model, "no_grad")
    cache, got = _decode(model, mode)
    assert all(torch.equal(a, b.detach()) for a, b in zip(expected, got))
    assert cache.stats()["reranks_stable"] >= 4 and cache.stats()["pages_promoted"] > 0  # tier moves were made


def test_a_prefill_under_inference_mode_then_generate(model):
    ids = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(1))
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              **cache_kwargs(model, _cache(model)))
    cache = _cache(model)
    with torch.inference_mode():
        model(ids[:, :-1], **cache_kwargs(model, cache))
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         **cache_kwargs(model, cache))
    assert torch.equal(got, expected)


def test_backward_through_a_decode_step_raises(model):
    _, logits = _decode(model, "autograd", steps=1)
    assert logits[-1].requires_grad
    with pytest.raises(FlexiCacheError, match="stores K/V without autograd history"):
        logits[-1].sum().backward()


def test_backward_through_tokens_added_to_a_filled_cache_raises(model):
    cache = _cache(model)
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids[:, :30], **cache_kwargs(model, cache))
    out = model(ids[:, 30:], attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache))
    with pytest.raises(FlexiCacheError, match="stores K/V without autograd history"):
        out.logits.sum().backward()


def test_backward_through_a_prompt_on_an_empty_cache_equals_dynamic_caches(model):
    ids = torch.randint(3, 90, (2, 50), generator=torch.Generator().manual_seed(3))
    grads = []
    for cache in (_cache(model), DynamicCache(config=model.config)):
        model.zero_grad()
        model(ids, **cache_kwargs(model, cache)).logits.float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Boom(RuntimeError):
    pass


def test_a_forward_that_failed_part_way_is_refused_by_the_next_one(model, monkeypatch):
    cache, _ = _decode(model, "no_grad", steps=2)
    held = cache.get_seq_length()
    attention = model.model.layers[1].self_attn
    real = attention.forward
    monkeypatch.setattr(attention, "forward", lambda *a, **k: (_ for _ in ()).throw(_Boom()))
    token = torch.tensor([[5]])
    with torch.no_grad(), pytest.raises(_Boom):
        model(token, **cache_kwargs(model, cache))  # layer 0 stored the token, layer 1 never ran
    monkeypatch.setattr(attention, "forward", real)
    with torch.no_grad(), pytest.raises(FlexiCacheError, match=rf"layer 0: {held + 1}; layer 1: {held}"):
        model(token, **cache_kwargs(model, cache))
    assert [layer.get_seq_length() for layer in cache.layers] == [held + 1, held]  # the refusal wrote nothing


def test_refusals_come_before_any_layer_writes(model):
    """A decode step on a model whose attention is not FlexiCache's: refused at the first layer, nothing stored."""
    cache, _ = _decode(model, "no_grad", steps=1)
    held = [layer.get_seq_length() for layer in cache.layers]
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad(), pytest.raises(FlexiCacheError, match="Nothing was written"):
            model(torch.tensor([[5]]), **cache_kwargs(model, cache))
    finally:
        model.set_attn_implementation("flexicache")
    assert [layer.get_seq_length() for layer in cache.layers] == held
    with torch.no_grad():
        model(torch.tensor([[5]]), **cache_kwargs(model, cache))  # and the cache goes on
    assert [layer.get_seq_length() for layer in cache.layers] == [h + 1 for h in held]

"""With a budget covering every page, FlexiCache must reproduce dense attention exactly."""

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from transformers import DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile

FAMILIES = ["llama", "qwen2", "mistral", "gemma3", "phi3"]


def _generate(model, ids, mask, cache, **kw):
    return model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False, max_new_tokens=12,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw,
    )


def _profiles(config):
    yield None  # every head unstable
    yield HeadProfile.from_unstable(config, [(0, 0)])  # mixed layer 0, all-stable layer 1
    yield HeadProfile.from_unstable(config, [])  # every head stable, tiered


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch,pads", [(1, [0]), (3, [0, 5, 11])], ids=["B1", "B3-leftpad"])
def test_full_budget_matches_dynamic_cache(family, batch, pads, no_grad):
    model = tiny_model(family)
    ids, mask = left_padded_batch(batch, 37, pad_lengths=pads)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    for profile in _profiles(model.config):
        cfg = FlexiCacheConfig(page_size=4, token_budget=64, rerank_interval=3)
        cache = FlexiCache(model.config, cfg, profile=profile)
        out = _generate(model, ids, mask, cache)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
        assert cache.stats()["decode_steps"] == 11


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_full_budget_beam_search_matches(family, no_grad):
    model = tiny_model(family)
    ids, mask = left_padded_batch(2, 29, pad_lengths=[0, 6])
    kw = dict(num_beams=3, num_return_sequences=2, early_stopping=True)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), **kw)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=64, rerank_interval=2),
                       profile=HeadProfile.from_unstable(model.config, [(0, 1)]))
    out = _generate(model, ids, mask, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)


def test_cache_spelling_and_sampling(no_grad):
    """`cache=` (transformers >= 5.24; `past_key_values=` before) and sampling; same seed -> same sample as dense."""
    import transformers
    from packaging.version import Version

    name = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    model = tiny_model("llama")
    ids, mask = left_padded_batch(2, 21, pad_lengths=[0, 3])
    cfg = FlexiCacheConfig(page_size=4, token_budget=64)
    torch.manual_seed(5)
    ref = model.generate(input_ids=ids, attention_mask=mask, **{name: DynamicCache(config=model.config)},
                         do_sample=True, max_new_tokens=10, pad_token_id=0)
    torch.manual_seed(5)
    out = model.generate(input_ids=ids, attention_mask=mask, **{name: FlexiCache(model.config, cfg)},
                         do_sample=True, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(out, ref)


def test_sliding_window_layers_stay_standard():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from fc_hf.layer import FlexiCacheLayer

    model = tiny_model("gemma3", layers=6)
    cache = FlexiCache(model.config, FlexiCacheConfig())
    kinds = [type(l) for l in cache.layers]
    assert kinds.count(FlexiCacheLayer) == 1 and isinstance(cache.layers[5], FlexiCacheLayer)
    assert all(isinstance(l, DynamicSlidingWindowLayer) for l in cache.layers[:5])



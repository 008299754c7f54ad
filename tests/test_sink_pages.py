"""`sink_pages`: the first attendable pages are always selected by ranked heads."""

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.kernels import torch_backend as ref


def test_force_sink_pages_without_padding():
    scores = torch.arange(12, dtype=torch.float32).view(2, 6)
    out = ref.force_sink_pages(scores.clone(), 2)
    assert torch.isinf(out[:, :2]).all() and (out[:, :2] > 0).all()
    assert torch.equal(out[:, 2:], scores[:, 2:])
    assert torch.equal(ref.force_sink_pages(scores.clone(), 0), scores)


def test_force_sink_pages_starts_at_the_first_real_page():
    scores = torch.zeros(3, 5)
    valid = torch.tensor([[True] * 5, [False, False, True, True, True], [False, False, False, False, True]])
    scores = scores.masked_fill(~valid, float("-inf"))
    out = ref.force_sink_pages(scores, 2, valid)
    inf = float("inf")
    assert out[0].tolist() == [inf, inf, 0, 0, 0]
    assert out[1].tolist() == [-inf, -inf, inf, inf, 0]
    assert out[2].tolist() == [-inf, -inf, -inf, -inf, inf]  # one real page: never force padding


@pytest.mark.parametrize("profile_unstable", [[], [(0, 0), (0, 1)]])
def test_ranked_heads_always_hold_the_sink_page(profile_unstable, monkeypatch):
    """Bounds rigged so that page 0 is the worst: with sink_pages=1 it is still selected, without it never is.

    The rig sits below the forcing (on every query head's bound of page 0's MinMax entries), so it holds wherever
    the sink is forced (inside `score_pages` without padding, by `force_sink_pages` otherwise)."""
    from fc_hf.kernels import torch_backend

    real = torch_backend.bounds_per_head

    def page0_worst(query, meta, entries):
        bounds = real(query, meta, entries)
        bounds[..., : FlexiCacheConfig(page_size=4, token_budget=12).subpages] = -1e30  # page 0's entries
        return bounds

    monkeypatch.setattr(torch_backend, "bounds_per_head", page0_worst)
    for sink, expect in ((1, True), (0, False)):
        model = tiny_model("llama", layers=1)
        profile = HeadProfile.from_unstable(model.config, profile_unstable)
        cfg = FlexiCacheConfig(page_size=4, token_budget=12, rerank_interval=2, sink_pages=sink)
        cache = FlexiCache(model.config, cfg, profile)
        ids, mask = left_padded_batch(1, 40)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(5):
                mask = torch.cat([mask, torch.ones_like(tok)], 1)
                out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                for group in cache.layers[0].groups:
                    assert bool((group.sel == 0).any(dim=1).all()) is expect


@pytest.mark.parametrize("bad", [-1, 3, True, 1.0])
def test_sink_pages_must_leave_room(bad):
    with pytest.raises(ValueError, match="sink_pages"):
        FlexiCacheConfig(page_size=4, token_budget=12, sink_pages=bad)

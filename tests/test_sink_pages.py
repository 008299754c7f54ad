"""`sink_pages`: the first attendable pages are always selected by ranked heads."""

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.step_bias import StepBias

INF = float("inf")


def _bias(valid: torch.Tensor, sink: int, position: int, page_size: int = 2) -> torch.Tensor:
    """The scoring bias of each page (first entry) for a mask `valid [B, tokens]` at `position`."""
    b, tokens = valid.shape
    bias = StepBias(b, tokens // page_size, page_size, 1, sink, "cpu")
    bias.update(valid[:, None, None, :], torch.tensor(position))
    return bias.pages


def test_the_sink_and_the_page_being_filled_are_forced_without_padding():
    out = _bias(torch.ones(2, 12, dtype=torch.bool), sink=2, position=9)
    assert out[0].tolist() == [INF, INF, 0, 0, INF, -INF]  # pages 0-1 the sink, page 4 being filled, page 5 not yet
    assert torch.equal(_bias(torch.ones(1, 12, dtype=torch.bool), sink=0, position=9)[0],
                       torch.tensor([0, 0, 0, 0, INF, -INF]))


def test_the_sink_starts_at_each_rows_first_real_page():
    valid = torch.tensor([[True] * 10, [False] * 4 + [True] * 6, [False] * 8 + [True] * 2])
    out = _bias(valid, sink=2, position=9)
    assert out[0].tolist() == [INF, INF, 0, 0, INF]
    assert out[1].tolist() == [-INF, -INF, INF, INF, INF]
    assert out[2].tolist() == [-INF, -INF, -INF, -INF, INF]  # one real page: never force padding


@pytest.mark.parametrize("profile_unstable", [[], [(0, 0), (0, 1)]])
def test_ranked_heads_always_hold_the_sink_page(profile_unstable, monkeypatch):
    """Bounds rigged so that page 0 is the worst: with sink_pages=1 it is still selected (by the unstable heads'
    rankings, in the stable heads' windows), without it never is. The rig sits below the forcing (on page 0's MinMax
    entries), which the step's bias applies."""
    from fc_hf.kernels import torch_backend

    real = torch_backend.page_scores

    def page0_worst(query, meta, bias, subpages):
        meta = meta.clone() if isinstance(meta, torch.Tensor) else torch.cat(meta)  # never the cache's own views
        d = meta.shape[1] // 2
        meta[:, :d, :subpages], meta[:, d:, :subpages] = -1e4, 1e4  # kmax very low, kmin very high: a tiny bound
        return real(query, meta, bias, subpages)

    monkeypatch.setattr(torch_backend, "page_scores", page0_worst)
    for sink, expect in ((1, True), (0, False)):
        model = tiny_model("llama", layers=1)
        profile = HeadProfile.from_unstable(model.config, profile_unstable)
        cfg = FlexiCacheConfig(page_size=4, token_budget=12, rerank_interval=2, sink_pages=sink, refine_pages=0)
        cache = FlexiCache(model.config, cfg, profile)
        ids, mask = left_padded_batch(1, 40)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(5):
                mask = torch.cat([mask, torch.ones_like(tok)], 1)
                out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                layer = cache.layers[0]
                held = [layer.last_ranking] if layer.kinds.unstable else []
                if layer.kinds.stable:
                    held.append(layer.store.win_pages[: layer.store.rows.n_stable])
                assert held and all(bool((pages == 0).any(dim=1).all()) is expect for pages in held)


@pytest.mark.parametrize("bad", [-1, 3, True, 1.0])
def test_sink_pages_must_leave_room(bad):
    with pytest.raises(ValueError, match="sink_pages"):
        FlexiCacheConfig(page_size=4, token_budget=12, sink_pages=bad)

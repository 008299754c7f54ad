"""Scoring, selection, sparse attention against brute force, and the re-rank schedule."""

import math

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.kernels import bruteforce, dispatch, torch_backend


def _random_pages(n, pages, page_size, d, seed=0):
    """Random keys `[N, Np, P, D]` and their MinMax entries in the store's layout `[N, 2D, Np]` (kmax then kmin)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, pages, page_size, d, generator=g)
    return keys, torch.cat([keys.amax(2), keys.amin(2)], -1).transpose(1, 2)


@pytest.mark.parametrize("groups", [1, 3, 7])
def test_score_equals_literal_formula_and_is_an_upper_bound(groups):
    n, pages, p, d = 4, 9, 5, 16
    keys, meta = _random_pages(n, pages, p, d)
    q = torch.randn(n, groups, d)
    bias = torch.zeros(n, pages)
    bias[:, -1] = float("inf")  # the page being filled is forced in through the bias
    s = torch_backend.page_scores(q, meta, bias, subpages=1)
    brute = bruteforce.score_pages_bruteforce(q, meta[:, d:].transpose(1, 2), meta[:, :d].transpose(1, 2))
    torch.testing.assert_close(s[:, :-1], brute[:, :-1], rtol=1e-5, atol=1e-5)
    assert torch.isinf(s[:, -1]).all() and (s[:, -1] > 0).all()
    true_max = torch.einsum("ngd,nptd->ngpt", q, keys).amax(-1).amax(1)  # max over the group and the page
    assert (brute >= true_max - 1e-5).all()


def test_sub_page_scores_are_the_max_over_the_sub_pages():
    n, pages, p, d, s = 3, 6, 8, 8, 2
    keys, _ = _random_pages(n, pages, p, d)
    sub = keys.view(n, pages * s, p // s, d)
    meta = torch.cat([sub.amax(2), sub.amin(2)], -1).transpose(1, 2)
    q = torch.randn(n, 2, d)
    got = torch_backend.page_scores(q, meta, torch.zeros(n, pages * s), subpages=s)
    per_sub = bruteforce.score_pages_bruteforce(q, meta[:, d:].transpose(1, 2), meta[:, :d].transpose(1, 2))
    torch.testing.assert_close(got, per_sub.view(n, pages, s).amax(-1), rtol=1e-5, atol=1e-5)


def test_scores_of_row_blocks_equal_scores_of_their_rows():
    """The eager step scores the cache's MinMax rows as views (row blocks): the same scores as the rows stacked."""
    n, pages, d = 5, 7, 8
    _, meta = _random_pages(n, pages, 4, d)
    q, bias = torch.randn(n, 3, d), torch.randn(n, pages)
    whole = torch_backend.page_scores(q, meta, bias, subpages=1)
    for cut in ([meta[:2], meta[2:]], [meta[:1], meta[1:4], meta[4:]], [meta]):
        torch.testing.assert_close(torch_backend.page_scores(q, cut, bias, subpages=1), whole, rtol=0, atol=0)


def test_eager_ranking_reads_the_minmax_cache_in_place():
    """An eager decode step scores the MinMax rows it ranks where they lie (views of the kind-major cache), never
    gathering a copy of them: with unstable and stable heads in a batch of 2 the rows of a ranking are not adjacent in
    the model's row order, only in the cache's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny_model("llama", layers=1, heads=6, kv_heads=3)
    profile = HeadProfile.from_unstable(model.config, [(0, 1)])
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=2), profile)
    ids, mask = left_padded_batch(2, 30)
    _decode(model, cache, ids, mask, 1)
    store = cache.layers[0].store
    assert not store.rows.kind_major
    meta = store.meta.untyped_storage().data_ptr()

    class Reads(TorchDispatchMode):
        ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [b for a in args for b in (a if isinstance(a, (list, tuple)) else [a])]  # row blocks: a list
            if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == meta for a in flat):
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Reads():
        _decode_more(model, cache, 4)
    # the scores read it: the PyTorch path's product, or the C++ op given the row blocks as they lie
    assert ("page_scores" if dispatch.backend_for(torch.zeros(1)) == "native" else "baddbmm") in Reads.ops, Reads.ops
    assert "index_select" not in Reads.ops and "cat" not in Reads.ops, Reads.ops


def _decode_more(model, cache, steps):
    tok = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(steps):
            model(input_ids=tok, past_key_values=cache, use_cache=True)


def test_pages_without_an_attendable_token_are_never_preferred():
    n, pages, d = 2, 6, 8
    _, meta = _random_pages(n, pages, 4, d)
    bias = torch.zeros(n, pages)
    bias[:, :3] = float("-inf")
    s = torch_backend.page_scores(torch.randn(n, 1, d), meta, bias, subpages=1)
    assert torch.isneginf(s[:, :3]).all()
    assert set(torch.topk(s, 3).indices[0].tolist()) == {3, 4, 5}


def _decode(model, cache, ids, mask, steps):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
    return out


@pytest.mark.parametrize("interval,steps", [(4, 17), (16, 40), (1, 5), (3, 30)])
def test_rerank_schedule(interval, steps, monkeypatch):
    """Unstable rows rank every step; each stable row at step 1 and then every `interval` steps at its own phase. An
    eager step ranks exactly those rows (no padded place: that is the compiled step's, `tests/test_compile.py`)."""
    from fc_hf.schedule import phase_of
    from fc_hf.selection import PageSelector as Selector

    model = tiny_model("llama", layers=2, heads=6, kv_heads=3)
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])  # layer 0 mixed, layer 1 all stable
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=interval), profile)
    calls = {}  # (layer, step) -> rows ranked
    real = Selector.rank

    def rank(self, q, rows, store, *a, **kw):
        layer = next(layer for layer in cache.layers if layer.store is store)
        assert (layer.layer_idx, layer.host_step) not in calls  # one ranking per layer and step
        calls[layer.layer_idx, layer.host_step] = rows.clone()
        return real(self, q, rows, store, *a, **kw)

    monkeypatch.setattr(Selector, "rank", rank)
    ids, mask = left_padded_batch(2, 30)
    _decode(model, cache, ids, mask, steps)
    stats = cache.stats()
    assert stats["decode_steps"] == steps
    n_rows = 2 * 3  # batch 2 x 3 KV heads
    for layer in range(2):
        unstable = set(range(0, n_rows, 3)) if layer == 0 else set()
        stable = [r for r in range(n_rows) if r not in unstable]
        for s in range(1, steps + 1):
            due = {r for j, r in enumerate(stable)
                   if s == 1 or (s >= 2 and s % interval == phase_of(j, len(stable), interval))}
            rows = calls.get((layer, s), torch.empty(0, dtype=torch.long)).tolist()
            assert sorted(rows) == sorted(unstable | due) and len(rows) == len(unstable | due), (layer, s)
    expected_stable = sum(1 for layer in range(2) for s in range(1, steps + 1)
                          for j in range(4 if layer == 0 else 6)
                          if s == 1 or (s >= 2 and s % interval == phase_of(j, 4 if layer == 0 else 6, interval)))
    assert stats["reranks_stable"] == expected_stable
    assert stats["reranks_unstable"] == 2 * steps  # layer 0's two unstable rows, every step


def test_stable_heads_read_pages_created_since_rank():
    model = tiny_model("llama", layers=1)
    profile = HeadProfile.from_unstable(model.config, [])
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=16), profile)
    ids, mask = left_padded_batch(1, 40)
    _decode(model, cache, ids, mask, 9)  # ranked at step 1 (41 tokens: page 10 being filled), now 49 tokens
    store = cache.layers[0].store
    window = store.win_pages[0].tolist()  # [K - 1 ranked pages, the page then being filled, the pages opened since]
    k = 2
    assert window[k - 1] == 10 and window[k : k + 2] == [11, 12]
    assert store.window >= k + 2


def test_low_budget_changes_output_but_stays_finite(no_grad):
    """A budget far below the sequence must actually drop tokens (the test of equivalence is not vacuous)."""
    from transformers import DynamicCache

    model = tiny_model("llama", layers=2)
    ids, mask = left_padded_batch(1, 120)
    dense = _decode(model, DynamicCache(config=model.config), ids, mask, 3).logits[:, -1]
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8))
    sparse = _decode(model, cache, ids, mask, 3).logits[:, -1]
    assert torch.isfinite(sparse).all()
    assert (dense - sparse).abs().max() > 1e-4


def test_inference_mode_then_no_grad(no_grad):
    """The CPU gather workspace must not leak an inference-mode tensor into a later no_grad call."""
    model = tiny_model("llama", layers=1)
    ids, mask = left_padded_batch(1, 40)
    cfg = FlexiCacheConfig(page_size=4, token_budget=8)
    with torch.inference_mode():
        a = _decode(model, FlexiCache(model.config, cfg), ids, mask, 3).logits
    b = _decode(model, FlexiCache(model.config, cfg), ids, mask, 3).logits
    assert torch.equal(a, b)

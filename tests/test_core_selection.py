"""Scoring, selection, sparse attention against brute force, and the re-rank schedule."""

import math

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.kernels import bruteforce, torch_backend as ref


def _random_pages(n, pages, page_size, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, pages, page_size, d, generator=g)
    return keys, torch.cat([keys.amax(2), keys.amin(2)], -1)


@pytest.mark.parametrize("groups", [1, 3, 7])
def test_score_equals_literal_formula_and_is_an_upper_bound(groups):
    n, pages, p, d = 4, 9, 5, 16
    keys, meta = _random_pages(n, pages, p, d)
    q = torch.randn(n, groups, d)
    s = ref.score_pages(q, meta, pages)
    brute = bruteforce.score_pages_bruteforce(q, meta[..., d:], meta[..., :d])
    torch.testing.assert_close(s[:, :-1], brute[:, :-1], rtol=1e-5, atol=1e-5)
    assert torch.isinf(s[:, -1]).all() and (s[:, -1] > 0).all()  # the page being filled is forced in
    true_max = torch.einsum("ngd,nptd->ngpt", q, keys).amax(-1).amax(1)  # max over the group and the page
    assert (brute >= true_max - 1e-5).all()


def test_invalid_pages_are_never_preferred():
    n, pages, d = 2, 6, 8
    _, meta = _random_pages(n, pages, 4, d)
    valid = torch.ones(n, pages, dtype=torch.bool)
    valid[:, :3] = False
    s = ref.score_pages(torch.randn(n, 1, d), meta, pages, valid)
    assert torch.isneginf(s[:, :3]).all()
    top = ref.select_topk(s, 3)
    assert set(top[0].tolist()) == {3, 4, 5}


def test_select_topk_invariants():
    s = torch.randn(5, 20)
    s[:, -1] = float("inf")
    top = ref.select_topk(s, 6)
    assert top.shape == (5, 6)
    assert (top == 19).any(1).all()  # current page always in
    assert all(len(set(r.tolist())) == 6 for r in top)  # K distinct pages
    few = ref.select_topk(torch.randn(3, 4), 6)  # fewer pages than K: all of them
    assert few.shape == (3, 4) and all(sorted(r.tolist()) == [0, 1, 2, 3] for r in few)


@pytest.mark.parametrize(
    "batch,kv_heads,groups,d,length,page_size,m",
    [(1, 1, 1, 8, 13, 4, 2), (2, 3, 3, 16, 37, 8, 3), (3, 2, 7, 12, 50, 16, 4), (1, 4, 2, 64, 100, 16, 5)],
    ids=["B1-H1-G1", "B2-H3-G3", "B3-H2-G7", "B1-H4-G2-D64"],
)
def test_sparse_attention_matches_bruteforce(batch, kv_heads, groups, d, length, page_size, m):
    """Paged gather through permuted slots == dense attention masked to the selected pages' tokens."""
    g = torch.Generator().manual_seed(1)
    n = batch * kv_heads
    pages = math.ceil(length / page_size)
    keys = torch.randn(n, pages * page_size, d, generator=g)
    values = torch.randn(n, pages * page_size, d, generator=g)
    # Scatter pages into a pool in a random order; slot 0 stays the (NaN-free) null block.
    perm = torch.randperm(n * pages, generator=g) + 1
    k_pool = torch.full((n * pages + 1, page_size, d), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    k_pool[0] = 0
    v_pool[0] = 0
    table = perm.view(n, pages)
    k_pool[table] = keys.view(n, pages, page_size, d)
    v_pool[table] = values.view(n, pages, page_size, d)
    # Distinct pages per row (selections never repeat a page), the partial last page first.
    others = [torch.randperm(pages - 1, generator=g)[: m - 1] for _ in range(n)]
    page_idx = torch.stack([torch.cat([torch.tensor([pages - 1]), o]) for o in others])
    page_idx[0, -1] = -1  # an unused entry
    slots = table.gather(1, page_idx.clamp(min=0)).masked_fill(page_idx < 0, 0)
    token_valid = torch.ones(batch, length, dtype=torch.bool)
    token_valid[-1, :5] = False  # left padding of the last sequence
    q = torch.randn(n, groups, d, generator=g)
    out = ref.sparse_decode_attention(q, k_pool, v_pool, slots, page_idx, length, 0.3, token_valid, kv_heads)
    allowed = torch.zeros(n, pages * page_size, dtype=torch.bool)
    for row in range(n):
        for p in page_idx[row].tolist():
            if p >= 0:
                allowed[row, p * page_size : (p + 1) * page_size] = True
    allowed[:, length:] = False
    allowed &= torch.nn.functional.pad(token_valid, (0, pages * page_size - length)).repeat_interleave(kv_heads, 0)
    brute = bruteforce.dense_attention_bruteforce(q, keys, values, allowed, 0.3)
    torch.testing.assert_close(out, brute, rtol=1e-4, atol=1e-5)


def _decode(model, cache, ids, mask, steps):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
    return out


@pytest.mark.parametrize("interval,steps", [(4, 17), (16, 40), (1, 5)])
def test_rerank_schedule(interval, steps, monkeypatch):
    """Stable heads rank at step 1 and every `interval` steps; unstable heads every step; all-stable
    layers do no scoring in between."""
    import fc_hf.kernels as kernels

    model = tiny_model("llama", layers=2)
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])  # layer 0 mixed, layer 1 all stable
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=interval), profile)
    calls = []
    real = kernels.score_pages
    monkeypatch.setattr(kernels, "score_pages", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))
    ids, mask = left_padded_batch(1, 30)
    _decode(model, cache, ids, mask, steps)
    due = sum(1 for s in range(1, steps + 1) if s == 1 or s % interval == 0)
    stats = cache.stats()
    assert stats["decode_steps"] == steps
    assert stats["reranks_stable"] == 2 * due  # layer 0's stable group + layer 1
    assert stats["reranks_unstable"] == steps  # layer 0's unstable group, every step
    assert len(calls) == steps + 2 * due
    assert cache.layers[1].groups[0].rankings == due


def test_stable_heads_read_pages_created_since_rank():
    model = tiny_model("llama", layers=1)
    profile = HeadProfile.from_unstable(model.config, [])
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=16), profile)
    ids, mask = left_padded_batch(1, 40)
    _decode(model, cache, ids, mask, 9)  # ranked at step 1 (41 tokens = 11 pages), now 49 tokens = 13 pages
    group = cache.layers[0].groups[0]
    pages = group.pages_for_step(9, None, None)  # not due: no scoring needed
    assert group.sel.shape[1] == 2 and group.pages_at_rank == 11
    assert sorted(pages[0].tolist()[2:]) == [11, 12]


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

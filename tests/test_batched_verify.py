"""The batched verification block (`fc_hf/block.py`) against its reference, the loop of single decode steps.

`tests/test_speculative.py` runs both paths through random verifications and crops and compares each against plain
decoding. Here: what a crop restores (the marks) is the loop's for every token, the kinds of rows the speculative tests
do not cover (streaming rows, a softcap) agree, the block is the path actually taken, and carried candidates that
change inside a block are ranked again until they settle.
"""

import pytest
import torch
from conftest import tiny_config
from test_speculative import _batched, _forward, _prefill, assert_same_state

import fc_hf.decode as decode
from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.selection import PageSelector

pytestmark = pytest.mark.usefixtures("no_grad")

CONFIGS = {
    "low": FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3),
    "variants": FlexiCacheConfig(page_size=4, token_budget=20, rerank_interval=3, promotion="deferred",
                                 score_subpages=2, carry_pages=2, sink_pages=2),
    # layer 0's KV head 0 streams (sink + recent pages), beside an unstable and stable heads
    "streaming": FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=2, streaming_heads=((0, 0),)),
}


def _caches(cfg, kv_heads=2, heads=4, length=160, seed=0):
    config = tiny_config("llama", layers=2, heads=heads, kv_heads=kv_heads, head_dim=16)
    profile = HeadProfile.from_unstable(config, [(0, 1)])
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(2, kv_heads, length, 16, generator=g) for _ in range(2)]
    queries = torch.randn(2, heads, length, 16, generator=g)
    block, loop = (FlexiCache(config, cfg, profile) for _ in range(2))
    return _batched(block, True), _batched(loop, False), kv, queries


def _assert_same_marks(a, b):
    for la, lb in zip(a.flexi_layers, b.flexi_layers):
        assert len(la._marks) == len(lb._marks) > 0
        for ma, mb in zip(la._marks, lb._marks):
            assert (ma.length, ma.rank_all) == (mb.length, mb.rank_all)
            assert int(ma.promoted) == int(mb.promoted)
            n = la.store.n  # the extra carried row takes padded places' writes: not state
            assert torch.equal(ma.carried[1][:n], mb.carried[1][:n])
            live = torch.isfinite(ma.carried[1][:n])
            assert torch.equal(ma.carried[0][:n][live], mb.carried[0][:n][live])
            n_s = la.store.rows.n_stable
            assert torch.equal(ma.win_pages[:n_s], mb.win_pages[:n_s])
            assert torch.equal(ma.win_shift[:n_s], mb.win_shift[:n_s])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
def test_block_outputs_marks_and_state_are_the_loops(name, softcap):
    """Blocks of 1-7 tokens, with rankings of every kind inside them: the outputs to rounding, every mark a crop could
    restore, and the state after each crop, equal to the loop's."""
    block, loop, (keys, values), queries = _caches(CONFIGS[name])
    prompt, length = 37, 37
    for cache in (block, loop):
        _prefill(cache, keys[:, :, :prompt], values[:, :, :prompt])
        cache.activate_past_recording()
    g = torch.Generator().manual_seed(1)
    while length < 140:
        t = int(torch.randint(1, 8, (1,), generator=g))
        span = slice(length, length + t)
        got, want = (_forward(c, keys[:, :, span], values[:, :, span], queries[:, :, span], softcap=softcap)
                     for c in (block, loop))
        for x, y in zip(got, want):
            assert torch.allclose(x, y, rtol=0, atol=1e-5), (x - y).abs().max()
        _assert_same_marks(block, loop)
        keep = int(torch.randint(1, t + 1, (1,), generator=g))
        for cache in (block, loop):
            cache.crop(keep - t)  # 0 keeps every token (and drops the marks)
        length += keep
        assert_same_state(block, loop)
    stats = block.stats()
    assert stats["reranks_stable"] > 10 and stats["pages_promoted"] > 0


def test_the_block_is_the_path_taken(monkeypatch):
    """A verification forward runs no single decode step (the loop would)."""
    calls = []
    real = decode.attend
    monkeypatch.setattr(decode, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    block, loop, (keys, values), queries = _caches(CONFIGS["low"])
    for cache in (block, loop):
        _prefill(cache, keys[:, :, :40], values[:, :, :40])
        cache.activate_past_recording()
        _forward(cache, keys[:, :, 40:47], values[:, :, 40:47], queries[:, :, 40:47])
    assert len(calls) == 7 * 2  # the loop's: 7 tokens x 2 layers; none from the block


def test_carried_candidates_that_change_inside_a_block_are_ranked_again(monkeypatch):
    """Rows that rank at several steps of a block take the carried candidates of their ranking before: where those
    changed the candidates, `rank_block` ranks those entries again (a round), and the result is still the loop's."""
    redone = []
    real = PageSelector._refine

    def spy(self, query, *args, **kw):
        redone.append(query.shape[0])
        return real(self, query, *args, **kw)

    monkeypatch.setattr(PageSelector, "_refine", spy)
    block, loop, (keys, values), queries = _caches(CONFIGS["variants"], seed=3)
    for cache in (block, loop):
        _prefill(cache, keys[:, :, :30], values[:, :, :30])
        cache.activate_past_recording()
    rounds = 0
    for start in range(30, 150, 8):
        span = slice(start, start + 8)
        redone.clear()
        got = _forward(block, keys[:, :, span], values[:, :, span], queries[:, :, span])
        rounds += len(redone) - len(block.layers)  # one first round per layer; the rest re-ranked changed entries
        want = _forward(loop, keys[:, :, span], values[:, :, span], queries[:, :, span])
        for x, y in zip(got, want):
            assert torch.allclose(x, y, rtol=0, atol=1e-5)
        block.crop(0), loop.crop(0)  # every token kept
    assert rounds > 0
    assert_same_state(block, loop)


def test_a_later_round_reads_only_the_new_candidates_keys_and_gets_a_full_refinements_logits(monkeypatch):
    """A round after the first computes the logits of the candidates its entries did not have before and takes the
    others from the earlier round: bit for bit the logits (so the mass and the ranking) of refining every candidate
    again, while fewer keys are read."""
    from fc_hf.kernels import dispatch

    real = PageSelector._logits_again
    checked, read, full = [], [], []

    def check(self, query, rows, seq, cand, old_cand, old_logits, store, bias, scaling):
        got = real(self, query, rows, seq, cand, old_cand, old_logits, store, bias, scaling)
        want = dispatch.page_logits(query, cand, rows, 0, store.near_k, store.near_index, store.full_k, bias.tokens,
                                    seq, scaling)  # the backend the step uses (the C++ op or the PyTorch path)
        assert torch.equal(got, want)
        n, c = cand.shape
        new = ~(cand[:, :, None] == old_cand[:, None, :]).any(-1)
        read.append(int(new.sum(1).max()) * n), full.append(c * n)
        checked.append(n)
        return got

    monkeypatch.setattr(PageSelector, "_logits_again", check)
    block, loop, (keys, values), queries = _caches(CONFIGS["variants"], seed=3)
    for cache in (block, loop):
        _prefill(cache, keys[:, :, :30], values[:, :, :30])
        cache.activate_past_recording()
    for start in range(30, 150, 8):
        span = slice(start, start + 8)
        got = _forward(block, keys[:, :, span], values[:, :, span], queries[:, :, span])
        want = _forward(loop, keys[:, :, span], values[:, :, span], queries[:, :, span])
        for x, y in zip(got, want):
            assert torch.allclose(x, y, rtol=0, atol=1e-5)
        block.crop(0), loop.crop(0)
    assert checked  # later rounds happened
    assert sum(read) < sum(full)
    assert_same_state(block, loop)

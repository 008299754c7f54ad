"""Batched verification (issue 29, item 2): a forward of T decode tokens attends its queries in one set of ops per head
group between its rankings (`FlexiCacheLayer._block_plan` / `_attend_block`, `HeadGroup.attend_block`) where that is
exact in semantics, while the groups that rank at every step attend each query as a step does (`HeadGroup.attend`);
one step at a time otherwise (a stable re-rank inside the block, padding, batch > 1, ...).

Each test drives two caches with the same tokens: one batching its blocks, one running every block one step at a time
(`batched_verify = False`, the loop). Their outputs agree to float rounding (atol 1e-5), and their states are identical
after every block and every crop: every tensor, slot and counter (`assert_same_state`), and every mark a crop could
restore, i.e. each step's selection, schedule and counters (`assert_same_marks`).
"""

from contextlib import nullcontext

import pytest
import torch
from conftest import tiny_model
from deferred_transfers import deferred_transfers
from test_speculative import CONFIGS, _forward, _generate, _mixed_profile, _prefill, _prompt, _setup, _steps
from test_speculative import assert_crop_cycles_hold_memory, assert_same_state

import fc_hf.head_group as head_group
import fc_hf.layer as layer_module
from fc_hf import FlexiCache, FlexiCacheConfig

pytestmark = pytest.mark.usefixtures("no_grad")

ATOL = 1e-5


@pytest.fixture
def batched_calls(monkeypatch):
    """Counts, per group kind, the group attentions made inside a batched span of a block (`_attend_block`): a stable
    group's `HeadGroup.attend_block`, and each step's `HeadGroup.attend` of a group that ranks at every step (so a test
    knows the batched path ran)."""
    calls = {"stable": 0, "unstable": 0}
    inside = []
    orig_block, orig_attend = layer_module.FlexiCacheLayer._attend_block, head_group.HeadGroup.attend

    def block(self, *args, **kwargs):
        inside.append(True)
        try:
            return orig_block(self, *args, **kwargs)
        finally:
            inside.pop()

    def attend_block(self, *args, **kwargs):
        calls[self.kind] += 1
        return orig_attend_block(self, *args, **kwargs)

    def attend(self, *args, **kwargs):
        if inside:
            calls[self.kind] += 1
        return orig_attend(self, *args, **kwargs)

    orig_attend_block = head_group.HeadGroup.attend_block
    monkeypatch.setattr(layer_module.FlexiCacheLayer, "_attend_block", block)
    monkeypatch.setattr(head_group.HeadGroup, "attend_block", attend_block)
    monkeypatch.setattr(head_group.HeadGroup, "attend", attend)
    return calls


def _pair(make):
    batched, loop = make(), make()
    for layer in loop.flexi_layers:
        layer.batched_verify = False
    return batched, loop


def assert_same_marks(a, b):
    """The marks `crop` can restore: for each token of the block, each group's selection, schedule and counters as
    they stood before it (i.e. after the previous step), and its store's sizes and counters."""
    for la, lb in zip(a.flexi_layers, b.flexi_layers):
        assert len(la._marks) == len(lb._marks)
        for ma, mb in zip(la._marks, lb._marks):
            assert (ma.length, ma.steps) == (mb.length, mb.steps)
            for ga, gb in zip(ma.groups, mb.groups):
                sa, sb = ga.store, gb.store
                assert (sa.length, sa.pool.n_free, sa.counters) == (sb.length, sb.pool.n_free, sb.counters)
                assert (sa.host is None and sb.host is None) or sa.host.pages == sb.host.pages
                assert (ga.sel is None) == (gb.sel is None) and (ga.sel is None or torch.equal(ga.sel, gb.sel))
                fields = ("pages_at_rank", "pending", "compacted", "rankings", "promotions", "rank_next", "after_append",
                          "counts")
                assert [getattr(ga, f) for f in fields] == [getattr(gb, f) for f in fields]
                assert (ga.carried is None) == (gb.carried is None)
                assert ga.carried is None or all(torch.equal(x, y) for x, y in zip(ga.carried, gb.carried))


def _run(cfg, seed, heads, kv_heads, transfers, longest=12, length=240, prompt=40):
    """Random blocks of 2..`longest` tokens with random crops, on a batching cache and a looping one (and plain
    decoding of the kept tokens): outputs within ATOL, states identical."""
    make, keys, values, queries = _setup(cfg, heads=heads, kv_heads=kv_heads, seed=seed, batch=1, length=length + 16)
    g = torch.Generator().manual_seed(200 + seed)
    with transfers() as created:
        batched, loop = _pair(make)
        ref = make()
        for cache in (batched, loop, ref):
            _prefill(cache, keys[:, :, :prompt], values[:, :, :prompt])
        batched.activate_past_recording()
        loop.activate_past_recording()
        done = prompt
        while done < length:
            t = int(torch.randint(2, longest + 1, (1,), generator=g))
            keep = int(torch.randint(0, t + 1, (1,), generator=g))
            span = slice(done, done + t)
            drafted = torch.randint(0, keys.shape[2], (t,), generator=g)  # rejected tokens: other K/V and queries
            k, v, q = keys[:, :, span].clone(), values[:, :, span].clone(), queries[:, :, span].clone()
            k[:, :, keep:], v[:, :, keep:], q[:, :, keep:] = (x[:, :, drafted[keep:]] for x in (keys, values, queries))
            got = _forward(batched, k, v, q)
            want = _forward(loop, k, v, q)
            for x, y in zip(got, want):
                assert torch.allclose(x, y, rtol=0, atol=ATOL)
            assert_same_marks(batched, loop)  # every step's selection (the mark before the next token holds it)
            assert_same_state(batched, loop)
            batched.crop(keep - t)
            loop.crop(keep - t)
            assert_same_state(batched, loop)
            if keep:
                for x, y in zip(got, _steps(ref, k[:, :, :keep], v[:, :, :keep], q[:, :, :keep])):
                    assert torch.allclose(x[:, :keep], y, rtol=0, atol=ATOL)
            done += keep
        assert_same_state(batched, ref)
    return batched, ref, created


@pytest.mark.parametrize("transfers", ["sync", "deferred"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("name", ["low", "low-variants"])
def test_batched_blocks_equal_the_loop_and_plain_decoding(name, heads, kv_heads, transfers, batched_calls):
    batched, ref, created = _run(CONFIGS[name], 0, heads, kv_heads,
                                 deferred_transfers if transfers == "deferred" else (lambda: nullcontext([])))
    assert batched_calls["unstable"] > 20 and batched_calls["stable"] > 20
    assert batched.stats()["reranks_stable"] > 10 and batched.stats()["pages_promoted"] > 0
    if transfers == "deferred":
        assert sum(s.issued["promote"] for s in created) > 0
    g = torch.Generator().manual_seed(5)  # and the two go on the same, step for step
    for _ in range(5):
        k, v = torch.randn(1, kv_heads, 1, 16, generator=g), torch.randn(1, kv_heads, 1, 16, generator=g)
        q = torch.randn(1, heads, 1, 16, generator=g)
        for x, y in zip(_forward(batched, k, v, q), _forward(ref, k, v, q)):
            assert torch.equal(x, y)
    assert_same_state(batched, ref)


@pytest.mark.parametrize("seed", range(3))
def test_long_blocks_many_pages_and_a_full_budget(seed, batched_calls):
    """Blocks longer than a page (several page boundaries inside one block), several seeds; a full budget (stable
    groups batched, unstable ones too few pages to rank by refinement: one step at a time)."""
    _run(CONFIGS["low"], seed, 6, 2, lambda: nullcontext([]), longest=11)
    _run(CONFIGS["full"], seed, 6, 2, lambda: nullcontext([]), longest=9, length=120)
    assert batched_calls["unstable"] > 0 and batched_calls["stable"] > 0


def test_the_plan_splits_at_stable_reranks_only():
    """Re-rank interval 3, 4-token pages: a block of 9 runs each stable re-rank alone and batches the steps between
    them, across page boundaries (each batched step ranks and reads over its own page count)."""
    make, keys, values, _ = _setup(CONFIGS["low"], batch=1, length=80)
    cache = make()
    _prefill(cache, keys[:, :, :40], values[:, :, :40])
    cache.activate_past_recording()
    layer = cache.flexi_layers[0]
    layer.steps = 5  # the next token is step 6, at length 41 (in page 11)
    query = torch.zeros(1, 4, 9, 16)
    # steps 6..14 at lengths 41..49: 6 (also the first after the prompt), 9 and 12 re-rank; 13 and 14 (lengths 48 and
    # 49) lie on both sides of a page boundary
    assert layer._block_plan(query, None, 9, None) == [(0, 1, False), (1, 3, True), (3, 4, False), (4, 6, True),
                                                       (6, 7, False), (7, 9, True)]
    layer.groups[1].rank_next = False
    layer.steps = 6  # steps 7..15: 9, 12, 15 re-rank
    assert layer._block_plan(query, None, 9, None) == [(0, 2, True), (2, 3, False), (3, 5, True), (5, 6, False),
                                                       (6, 8, True), (8, 9, False)]
    layer.steps = 0  # step 1 ranks, whatever the interval (step 3 is a re-rank too)
    assert layer._block_plan(query[:, :, :3], None, 3, None) == [(0, 3, False)]


def test_what_is_not_batched_runs_the_loop(batched_calls):
    """Batch 2, padding, a softcap and FLEXICACHE_BATCHED_VERIFY=0 all run one step at a time."""
    make, keys, values, queries = _setup(CONFIGS["low"], batch=2, length=80)
    cache = make()
    _prefill(cache, keys[:, :, :40], values[:, :, :40])
    cache.activate_past_recording()
    _forward(cache, keys[:, :, 40:48], values[:, :, 40:48], queries[:, :, 40:48])  # batch 2
    assert batched_calls == {"stable": 0, "unstable": 0}
    make, keys, values, queries = _setup(CONFIGS["low"], batch=1, length=80)
    cache = make()
    _prefill(cache, keys[:, :, :40], values[:, :, :40])
    cache.activate_past_recording()
    layer = cache.flexi_layers[0]
    q = torch.zeros(1, 4, 6, 16)
    layer.steps = 1
    assert any(b for *_, b in layer._block_plan(q, None, 6, None))
    assert not any(b for *_, b in layer._block_plan(q, None, 6, 30.0))  # softcap
    padded = torch.ones(1, 1, 6, 46, dtype=torch.bool)
    padded[..., :3] = False
    assert not any(b for *_, b in layer._block_plan(q, padded, 6, None))
    layer.batched_verify = False
    assert not any(b for *_, b in layer._block_plan(q, None, 6, None))


def test_many_batched_verifications_hold_no_more_memory(batched_calls):
    make, keys, values, queries = _setup(CONFIGS["low"], batch=1, length=200)
    cache = make()
    _prefill(cache, keys[:, :, :70], values[:, :, :70])
    _forward(cache, keys[:, :, 70:71], values[:, :, 70:71], queries[:, :, 70:71])
    _forward(cache, keys[:, :, 71:72], values[:, :, 71:72], queries[:, :, 71:72])
    assert_crop_cycles_hold_memory(cache, keys, values, queries)
    assert batched_calls["unstable"] > 0


@pytest.mark.parametrize("name", ["low", "low-variants"])
@pytest.mark.parametrize("family,shape", [("llama", {}), ("qwen2", {"heads": 8, "kv_heads": 4}),
                                          ("mistral", {"kv_heads": 6})])
def test_prompt_lookup_with_batched_blocks_gives_greedy_tokens(family, shape, name, batched_calls, monkeypatch):
    """generate with prompt lookup on the batched path: plain greedy FlexiCache decoding's tokens, and the state the
    loop leaves."""
    model = tiny_model(family, **shape)
    cfg, profile = CONFIGS[name], _mixed_profile(model)
    ids, mask = _prompt(90, seed=2)
    plain = _generate(model, ids, mask, FlexiCache(model.config, cfg, profile), new=48)
    cache = FlexiCache(model.config, cfg, profile)
    assert torch.equal(_generate(model, ids, mask, cache, new=48, prompt_lookup_num_tokens=6), plain)
    assert batched_calls["stable"] > 0 and batched_calls["unstable"] > 0
    monkeypatch.setenv("FLEXICACHE_BATCHED_VERIFY", "0")
    loop = FlexiCache(model.config, cfg, profile)
    assert torch.equal(_generate(model, ids, mask, loop, new=48, prompt_lookup_num_tokens=6), plain)
    assert_same_state(cache, loop, atol=1e-5)


@pytest.mark.parametrize("cfg", [
    FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3, offload=False),  # stable heads untiered
    FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=5, carry_pages=0),  # candidates by the bound alone
    FlexiCacheConfig(page_size=4, token_budget=24, rerank_interval=4, refine_pages=12, sink_pages=0, score_subpages=1),
], ids=["no-offload", "no-carry", "no-sink-one-subpage"])
def test_other_configurations(cfg):
    _run(cfg, 1, 6, 2, lambda: nullcontext([]), length=160)


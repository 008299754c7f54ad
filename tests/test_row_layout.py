"""A tiered group's pages laid out row by row (`PagedKV.lay_out`), read in place by the PyTorch attention.

- the views `row_view` gives hold exactly what gathering the pages' slots gives, also for the pages opened after
  the arrangement, and the layout is dropped (None: gather again) as soon as a slot moves in a way it did not plan;
- nothing is lost: the store's dense K/V equal those of a store that never arranged;
- laying a ranking out straight from the host gives what promoting it into evicted slots and then arranging gave;
- in a cache, generation gives bit for bit what it gives when every step gathers and what a store that never
  arranges gives, and the stable groups do read in place;
- the residency check still stops a step whose selected page is not on the device;
- a refinement's candidate keys (`page_keys`) come from the host tier where a page is not resident, before and
  after the arrangement.
"""

from __future__ import annotations

import pytest
import torch

from conftest import left_padded_batch, tiny_model
from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile
from fc_hf.paged_store import PagedKV, gather_pages
from fc_hf.slot_pool import SlotPool
from fc_hf.tiers import move_tiers

B, H, P, D, PROMPT = 2, 3, 4, 8, 41  # 41 tokens: 11 pages, the last holding one token


def _tiered_store(seed=0):
    g = torch.Generator().manual_seed(seed)
    store = PagedKV(B, H, P, D, D, torch.float32, torch.device("cpu"), tiered=True)
    store.append(torch.randn(B, H, PROMPT, D, generator=g), torch.randn(B, H, PROMPT, D, generator=g))
    return store, g


def _ranked(store, g, keep=4):
    """A ranking's tier move: every row keeps `keep` pages, the page being filled among them, in a scrambled order."""
    n, last = store.rows, store.num_pages - 1
    picks = torch.stack([torch.randperm(last, generator=g)[: keep - 1] for _ in range(n)])
    sel = torch.cat([picks, torch.full((n, 1), last)], 1)[:, torch.randperm(keep, generator=g)]
    resident = torch.arange(store.num_pages).expand(n, -1)
    move_tiers(store, resident, sel)
    return sel


def _arrange(store, sel, headroom):
    """Lay out a selection that is resident already (after `_ranked`'s tier move): nothing is promoted."""
    assert store.lay_out(sel, sel, headroom) == 0


def _gathered(store, pages):
    slots = store.slots_for(pages)
    n, m = pages.shape
    return (gather_pages(store.k_pool, slots).view(n, m * P, D), gather_pages(store.v_pool, slots).view(n, m * P, D))


def test_row_view_is_what_a_gather_reads():
    store, g = _tiered_store()
    plain, _ = _tiered_store()  # the same tokens, never arranged
    sel = _ranked(store, g)
    assert store.row_view(sel, sel.shape[1]) is None  # a tier move is not an arrangement
    _arrange(store, sel, 2)
    assert store.slots_in_use() == store.rows * sel.shape[1]
    opened = 0
    for i in range(3 * P):
        pages = torch.cat([sel, torch.arange(11, store.num_pages).expand(store.rows, -1)], 1)
        view = store.row_view(sel, pages.shape[1])
        if opened <= 2:  # the headroom: two pages opened after the arrangement continue the rows
            assert view is not None
            for a, b in zip(view, _gathered(store, pages)):
                assert torch.equal(a, b)
        else:
            assert view is None and store.pool.row_layout is None
        assert store.row_view(sel.clone(), pages.shape[1]) is None  # another selection tensor: not this layout
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        before = store.num_pages
        store.append(k, v)
        plain.append(k, v)
        opened += store.num_pages - before
    assert opened == 3
    # Nothing was lost: the device pages plus the host tier are the plain store's tokens.
    for a, b in zip(store.dense(), plain.dense()):
        assert torch.equal(a, b)


def test_laying_out_from_the_host_is_promoting_then_arranging():
    a, g = _tiered_store(3)
    b, gb = _tiered_store(3)
    sel = _ranked(a, g)
    assert torch.equal(_ranked(b, gb), sel)  # the same tier move: most pages are on the host only
    n, last = a.rows, a.num_pages - 1
    new = torch.stack([torch.randperm(last, generator=g)[:4] for _ in range(n)])
    new = torch.cat([new, torch.full((n, 1), last)], 1)
    promoted = move_tiers(a, sel, new)  # promoted into evicted slots (and new ones), then arranged
    _arrange(a, new, 2)
    assert b.lay_out(new, sel, 2) == promoted > 0  # read straight from the host into the layout
    assert a.counters == b.counters
    assert torch.equal(a.table, b.table) and torch.equal(a.k_pool, b.k_pool) and torch.equal(a.v_pool, b.v_pool)
    assert torch.equal(a.pool.free[: a.pool.n_free], b.pool.free[: b.pool.n_free])
    for x, y in zip(a.dense(), b.dense()):
        assert torch.equal(x, y)


def test_a_page_on_neither_tier_is_refused_before_anything_moves():
    store, g = _tiered_store(4)
    sel = _ranked(store, g)
    last = store.num_pages - 1  # the page being filled: never on the host
    store.table[0, last] = 0  # and now not on the device either (the bug the check exists for)
    store.pool.table_changed()
    table, k_pool = store.table.clone(), store.k_pool.clone()
    with pytest.raises(FlexiCacheError, match="neither on the device nor on the host"):
        store.lay_out(sel, sel, 2)
    assert torch.equal(store.table, table) and torch.equal(store.k_pool, k_pool)


def test_a_slot_move_it_did_not_plan_drops_the_layout():
    store, g = _tiered_store(1)
    sel = _ranked(store, g)
    _arrange(store, sel, 2)
    assert store.row_view(sel, sel.shape[1]) is not None
    store.pool.release(torch.tensor([], dtype=torch.long))  # nothing released: the layout stays
    assert store.pool.row_layout is not None
    store.pool.compact(0)
    assert store.row_view(sel, sel.shape[1]) is None
    # Arranged again, then a beam reshuffle (rows duplicated) moves every slot.
    _arrange(store, sel, 1)
    assert store.row_view(sel, sel.shape[1]) is not None
    store.select_rows(torch.tensor([1, 1]))
    assert store.pool.row_layout is None


def _generate(model, profile, ids, mask, steps=24, **cfg):
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=5, **cfg), profile)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, past_key_values=cache,
                         output_scores=True, return_dict_in_generate=True)
    return torch.stack(out.scores), cache


@pytest.mark.parametrize("promotion", ["deferred", "sync"])
def test_generation_reading_in_place_is_bit_identical(monkeypatch, promotion):
    model = tiny_model("llama", layers=2, heads=8, kv_heads=4)
    profile = HeadProfile.from_unstable(model.config, [(0, 1), (1, 0), (1, 3)])
    ids, mask = left_padded_batch(2, 45, pad_lengths=[0, 6])
    reads = {"in place": 0, "gathered": 0}
    real = PagedKV.row_view

    def counted(self, arranged, m):
        view = real(self, arranged, m)
        if self.tiered:
            reads["in place" if view is not None else "gathered"] += 1
        return view

    monkeypatch.setattr(PagedKV, "row_view", counted)
    with torch.no_grad():
        in_place, _ = _generate(model, profile, ids, mask, promotion=promotion)
    # Two stable groups, every decode step from the first ranking on (the headroom is never exhausted here).
    assert reads == {"in place": 2 * 23, "gathered": 0}
    monkeypatch.setattr(SlotPool, "row_view", lambda self, arranged, m: None)
    with torch.no_grad():
        gathered, _ = _generate(model, profile, ids, mask, promotion=promotion)
    assert torch.equal(in_place, gathered)
    # And what a store that never arranges gives (compaction alone, as before the layout existed).
    def promote_then_compact(self, pages, resident, headroom):
        promoted = move_tiers(self, resident, pages)
        self.pool.compact(headroom * self.rows)
        return promoted

    monkeypatch.setattr(PagedKV, "lay_out", promote_then_compact)
    with torch.no_grad():
        never, _ = _generate(model, profile, ids, mask, promotion=promotion)
    assert torch.equal(in_place, never)


def test_residency_check_still_stops_a_missing_page():
    model = tiny_model("llama", layers=1)
    profile = HeadProfile.from_unstable(model.config, [])  # one stable group, tiered
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=16), profile)
    cache.check_residency = True
    ids, mask = left_padded_batch(1, 40)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, past_key_values=cache)
        group = cache.layers[0].groups[0]
        store = group.store
        assert store.pool.row_layout is not None  # read in place since the first ranking
        page = int(group.sel[0, 0])
        store.table[0, page] = 0  # a selected page that is not on the device (a bug the check exists for)
        store.pool.table_changed()
        step = torch.tensor([[5]])
        with pytest.raises(FlexiCacheError, match="not resident"):
            model(input_ids=step, past_key_values=cache, use_cache=True,
                  attention_mask=torch.ones(1, 44, dtype=torch.long))


def test_candidate_keys_come_from_the_host_where_not_resident():
    store, g = _tiered_store(2)
    full = store.dense()[0].reshape(store.rows, -1, D)  # every token's key, row by row
    full = torch.nn.functional.pad(full, (0, 0, 0, store.num_pages * P - full.shape[1]))
    want = full.view(store.rows, store.num_pages, P, D)
    sel = _ranked(store, g)
    everything = torch.arange(store.num_pages).expand(store.rows, -1).flip(1)  # most pages now host-only
    for arranged in (False, True):
        if arranged:
            _arrange(store, sel, 2)
        got = store.page_keys(everything)
        valid = store.length - (store.num_pages - 1) * P  # the page being filled holds this many tokens
        assert torch.equal(got[:, 1:], want.flip(1)[:, 1:])
        assert torch.equal(got[:, 0, :valid], want[:, -1, :valid])

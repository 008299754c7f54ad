"""Stream ordering of the tier copies, checked on a CPU with the deferred fake backend (issue 14, item 3).

Under `deferred_transfers()` a host<->device copy happens only when the code waits for it, and its
destination is NaN until then (tests/deferred_transfers.py). Each unit test below isolates one
ordering rule of `fc_hf/transfer.py` and fails if the wait that rule needs is removed; the
integration tests run tiered decoding (sync and deferred promotion, beam search, pool growth)
under the fake and require the same logits as synchronous copies, bit for bit.

`FLEXICACHE_TEST_TRANSFERS=deferred pytest tests/test_tiers.py tests/test_properties.py ...` runs
whole files under the fake.
"""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from deferred_transfers import DeferredStreams, deferred_transfers
from robustness_helpers import RecordingCache, forced_decode

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.paged_store import PagedKV
from fc_hf.tiers import move_tiers

P, D = 4, 8


def _store(pages: int, seed: int = 0):
    """A tiered store of one row holding `pages` full pages (their offloads still pending), and its keys."""
    store = PagedKV(1, 1, P, D, D, torch.float32, torch.device("cpu"), tiered=True, grow_pages=1)
    keys = torch.randn(1, 1, pages * P, D, generator=torch.Generator().manual_seed(seed))
    store.append(keys, -keys)
    return store, keys


def _page(keys, page):
    return keys[0, 0, page * P : (page + 1) * P]


def _resident(store, page):
    return store.k_pool[store.table[0, page]]


def test_the_fake_defers_until_waited_for():
    """The tool itself: an offload lands at a host wait, not at a stream wait; a promotion at a stream wait."""
    fake = DeferredStreams()
    src, host = torch.ones(2, 3), fake.host_empty((2, 3), torch.float32)
    done = fake.offload(host, src)
    assert torch.isnan(host).all()
    fake.compute_wait(done)
    assert torch.isnan(host).all()  # the CPU does not wait for a stream
    fake.host_wait(done)
    assert torch.equal(host, src)
    pool = torch.zeros(4, 2)
    staged = fake.host_empty((1, 2), torch.float32).fill_(1.0)
    done = fake.promote(pool, pool.clone(), torch.tensor([2]), staged, staged)
    assert torch.isnan(pool[2]).all() and torch.equal(pool[[0, 1, 3]], torch.zeros(3, 2))
    fake.compute_wait(done)
    assert torch.equal(pool[2], torch.ones(2))


def _page0_promoted_back():
    """A tiered store whose page 0 was dropped and is being promoted back into page 1's slot (copy pending).

    Its pages' offloads are still pending too: nothing has synchronised the host since they were issued.
    """
    store, keys = _store(3)
    move_tiers(store, torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2]]))  # drop page 0 (device slot freed)
    store.append(torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D))  # page 3, being filled
    move_tiers(store, torch.tensor([[1, 2, 3]]), torch.tensor([[0, 2, 3]]))  # promote page 0 into page 1's slot
    return store, keys


def test_promotion_gathers_host_pages_after_their_offload_landed():
    """A page dropped and promoted back before anything synchronised the host must arrive intact."""
    with deferred_transfers():
        store, keys = _page0_promoted_back()
        store.transfers.wait_promotions()
        assert torch.equal(_resident(store, 0), _page(keys, 0))


def test_pool_growth_waits_for_a_pending_promotion():
    """The pool is copied when it grows: a promotion still in flight must land before the copy."""
    with deferred_transfers():
        store, keys = _page0_promoted_back()
        slots = store.k_pool.shape[0]
        store.append(torch.randn(1, 1, 2 * P, D), torch.randn(1, 1, 2 * P, D))  # pages 4, 5: the pool grows
        assert store.k_pool.shape[0] > slots
        store.transfers.wait_promotions()
        assert torch.equal(_resident(store, 0), _page(keys, 0))


def test_repack_waits_for_a_pending_promotion():
    """A beam reorder repacks the pool: a promotion still in flight must land before the copy."""
    with deferred_transfers():
        store, keys = _page0_promoted_back()
        store.select_rows(torch.tensor([0, 0]))  # beam search duplicates the sequence
        store.transfers.wait_promotions()
        for row in range(2):
            assert torch.equal(store.k_pool[store.table[row, 0]], _page(keys, 0))


def test_dense_view_waits_for_a_pending_promotion():
    with deferred_transfers():
        store, keys = _page0_promoted_back()
        k, _ = store.dense()
        assert torch.equal(k[0, 0, : 3 * P], keys[0, 0])


# -- whole decodes under the fake ----------------------------------------------------------------------

CFG = dict(page_size=4, token_budget=16, rerank_interval=5)


def _profile(config):
    return HeadProfile.from_unstable(config, [(0, 1)])  # layer 0 mixed, layer 1 all stable (tiered)


@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_teacher_forced_decode_same_under_deferred_copies(promotion):
    """Left padding, promotions every 5 steps and a pool that grows mid-decode (no compaction headroom)."""
    model = tiny_model("llama", layers=2)
    ids, mask = left_padded_batch(2, 37, pad_lengths=[0, 6])
    forced = torch.randint(1, 97, (2, 45), generator=torch.Generator().manual_seed(2))
    cfg = FlexiCacheConfig(promotion=promotion, **CFG)
    want = forced_decode(model, FlexiCache(model.config, cfg, _profile(model.config)), ids, mask, forced)
    with deferred_transfers() as fakes, pytest.MonkeyPatch.context() as mp:
        mp.setattr("fc_hf.head_group.compaction_headroom", lambda store, interval: 0)  # grow on the next page
        cache = RecordingCache(model.config, cfg, _profile(model.config))
        got = forced_decode(model, cache, ids, mask, forced)
    assert torch.equal(got, want)
    cache.assert_nothing_lost()
    assert sum(f.issued["promote"] for f in fakes) > 0 and sum(f.landed_late for f in fakes) > 0


@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_beam_search_same_under_deferred_copies(promotion):
    """Beam search reorders (repacks) the pools right after a deferred promotion was issued."""
    model = tiny_model("llama", layers=2)
    ids, mask = left_padded_batch(2, 41, pad_lengths=[0, 5])
    kw = dict(num_beams=3, max_new_tokens=25, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    cfg = FlexiCacheConfig(promotion=promotion, **CFG)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, past_key_values=FlexiCache(model.config, cfg, _profile(model.config)), **kw)
        with deferred_transfers() as fakes:
            cache = RecordingCache(model.config, cfg, _profile(model.config))
            got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    cache.assert_nothing_lost()
    assert sum(f.issued["promote"] for f in fakes) > 0

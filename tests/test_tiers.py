"""Two tiers: nothing lost, same answer as one tier, bounded device slots, promotions allocate nothing."""

import math

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from robustness_helpers import RecordingCache

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile

CFG = dict(page_size=4, token_budget=16, rerank_interval=5)


def _forced_decode(model, cache, ids, mask, forced, on_step=None):
    """Teacher-force `forced [B, T]` tokens one at a time; returns the per-step logits."""
    logits = []
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for t in range(forced.shape[1]):
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
            out = model(input_ids=forced[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            if on_step is not None:
                on_step(t)
    return torch.stack(logits, 1)


def _profile(config):
    return HeadProfile.from_unstable(config, [(0, 1), (1, 0)])  # every layer mixed


def test_nothing_lost_every_step():
    model = tiny_model("llama", layers=2)
    cache = RecordingCache(model.config, FlexiCacheConfig(**CFG), _profile(model.config))
    ids, mask = left_padded_batch(2, 45, pad_lengths=[0, 7])
    forced = torch.randint(1, 97, (2, 60), generator=torch.Generator().manual_seed(3))

    def check(step):
        for idx, layer in enumerate(cache.layers):
            k, v = layer.dense_kv()
            assert torch.equal(k, cache.seen[idx][0]) and torch.equal(v, cache.seen[idx][1]), f"step {step} layer {idx}"
            # each stable row's window holds exactly its pages' tokens as they were given (the device tier)
            store, p = layer.store, layer.store.page_size
            length = store.length
            for j, row in enumerate(store.rows.stable.tolist()):
                b, h = divmod(row, store.heads)
                for slot, page in enumerate(store.win_pages[j].tolist()):
                    if page < 0 or page * p >= length:
                        continue
                    end = min(p, length - page * p)
                    got = store.win_k[j, slot * p : slot * p + end]
                    assert torch.equal(got, cache.seen[idx][0][b, h, page * p : page * p + end]), (step, idx, row, page)
            held = store.tier_bytes()
            assert held["host"] > 0 and held["device"] < store.n * store.capacity * 2 * store.head_dim * 4

    _forced_decode(model, cache, ids, mask, forced, check)
    assert cache.stats()["pages_promoted"] > 0  # promotions really happened


def test_tiered_equals_single_tier_bit_for_bit():
    """Same selections -> identical attention whether stable pages come from the host tier or not."""
    model = tiny_model("qwen2", layers=2)
    ids, mask = left_padded_batch(3, 33, pad_lengths=[0, 4, 9])
    forced = torch.randint(1, 97, (3, 310), generator=torch.Generator().manual_seed(4))
    runs = {}
    for offload in (True, False):
        cache = FlexiCache(model.config, FlexiCacheConfig(offload=offload, **CFG), _profile(model.config))
        runs[offload] = (_forced_decode(model, cache, ids, mask, forced), cache)
    assert torch.equal(runs[True][0], runs[False][0])
    tiered, flat = runs[True][1].stats(), runs[False][1].stats()
    assert tiered["reranks_stable"] == flat["reranks_stable"] >= 2 * 3 * (1 + 309 // 5)  # 3 stable rows a layer
    assert tiered["pages_promoted"] > 0 and flat["pages_promoted"] == 0
    assert runs[True][1].memory_report()["device_kv_bytes"] < runs[False][1].memory_report()["device_kv_bytes"]


def test_an_accelerator_counts_the_stable_full_tier_as_device_memory():
    """Where the stable rows' full tier could not be mapped from host memory (a non-CUDA accelerator, or the mapping
    failed) it is allocated on the accelerator: the memory report says so there instead of crediting a host tier that
    does not exist (on a CPU the split is by role)."""
    model = tiny_model("llama", layers=2)
    cache = FlexiCache(model.config, FlexiCacheConfig(**CFG), _profile(model.config))
    ids, mask = left_padded_batch(2, 45, pad_lengths=[0, 7])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    store = cache.layers[0].store
    by_role = store.tier_bytes()
    assert by_role["host"] > 0
    store.device = torch.device("cuda")  # the rule only; the tensors stay where they are
    on_gpu = store.tier_bytes()
    assert on_gpu["host"] == 0 and on_gpu["device"] == by_role["device"] + by_role["host"]


@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_the_device_tier_never_reallocates_and_promotions_are_the_newly_resident_pages(promotion):
    """Every tensor of the store keeps its address over a whole decode (re-ranks and pages opening allocate nothing);
    `pages_promoted` counts, re-rank after re-rank, the pages a window holds that it did not hold before."""
    model = tiny_model("llama", layers=1, kv_heads=3, heads=6)
    profile = HeadProfile.from_unstable(model.config, [])
    cfg = FlexiCacheConfig(promotion=promotion, **CFG)
    cache = FlexiCache(model.config, cfg, profile)
    ids, mask = left_padded_batch(2, 61)
    forced = torch.randint(1, 97, (2, 80), generator=torch.Generator().manual_seed(5))
    addresses, counted = [], {"pages": 0}
    before = {}

    def check(step):
        store = cache.layers[0].store
        addresses.append(tuple(t.data_ptr() for t in (store.full_k, store.full_v, store.meta, store.win_k, store.win_v,
                                                         store.win_pages)))
        now = store.win_pages[: store.rows.n_stable]
        if "pages" in before:
            for old, new in zip(before["pages"].tolist(), now.tolist()):
                k = cfg.pages_per_head
                counted["pages"] += len({p for p in new[:k] if p >= 0} - set(old))
        before["pages"] = now.clone()

    _forced_decode(model, cache, ids, mask, forced, check)
    assert len(set(addresses)) == 1
    st = cache.stats()
    first = cache.layers[0]  # the first step's ranking fills the windows after the prompt: not counted by `check`
    assert st["pages_promoted"] >= counted["pages"] > 0
    page_bytes = cfg.page_size * 2 * model.config.head_dim * 4  # K and V of one page, fp32
    assert st["bytes_promoted"] == st["pages_promoted"] * page_bytes
    assert first.store.window == cfg.pages_per_head + math.ceil(cfg.rerank_interval / cfg.page_size) + 1


def test_deferred_promotion_keeps_everything():
    model = tiny_model("llama", layers=2)
    cache = RecordingCache(model.config, FlexiCacheConfig(promotion="deferred", **CFG), _profile(model.config))
    ids, mask = left_padded_batch(1, 40)
    forced = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(6))
    logits = _forced_decode(model, cache, ids, mask, forced)
    assert torch.isfinite(logits).all()
    for idx, layer in enumerate(cache.layers):
        assert torch.equal(layer.dense_kv()[0], cache.seen[idx][0])


def test_beam_search_keeps_tiers_consistent():
    model = tiny_model("llama", layers=2)
    ids, mask = left_padded_batch(2, 41, pad_lengths=[0, 5])
    kw = dict(num_beams=3, max_new_tokens=25, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    outs = {}
    for offload in (True, False):
        cache = FlexiCache(model.config, FlexiCacheConfig(offload=offload, **CFG), _profile(model.config))
        with torch.no_grad():
            outs[offload] = (model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw), cache)
    assert torch.equal(outs[True][0].sequences, outs[False][0].sequences)
    for a, b in zip(outs[True][1].layers, outs[False][1].layers):
        ka, va = a.dense_kv()
        kb, vb = b.dense_kv()
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.cuda
def test_cuda_tiers_match_cpu():
    model = tiny_model("llama", layers=2)
    ids, mask = left_padded_batch(2, 45, pad_lengths=[0, 7])
    forced = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    cpu = _forced_decode(model, FlexiCache(model.config, FlexiCacheConfig(**CFG), _profile(model.config)), ids, mask, forced)
    model = model.cuda()
    cache = FlexiCache(model.config, FlexiCacheConfig(**CFG), _profile(model.config))
    gpu = _forced_decode(model, cache, ids.cuda(), mask.cuda(), forced.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)

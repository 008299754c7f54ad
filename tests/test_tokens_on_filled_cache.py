"""Tokens at any time (issue 28): chunked prefill, conversations and prefix reuse on a FlexiCache.

Every idiom transformers' docs show for a filled cache must behave as with `DynamicCache` used the same way: at a full
budget token for token and in logits to fp32 rounding, on several families, at batch 1 and in a left-padded batch.
At a low budget a chunked prefill must leave exactly the state one prefill leaves, and the device must hold only what
the design says (unstable heads' pages, the stable heads' sink and page being filled).
"""

import copy

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from transformers import DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile
from fc_hf.compat import cache_kwargs
from fc_hf.layer import FlexiCacheLayer

FULL = FlexiCacheConfig(page_size=4, token_budget=512, rerank_interval=3)
LOW = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3)
FAMILIES = ["llama", "qwen2", "gemma3", "phi3"]

pytestmark = pytest.mark.usefixtures("no_grad")


def _mixed(model):
    """Head 1 of the first full-attention layer unstable, every other head stable (tiered)."""
    cache = FlexiCache(model.config, FULL)
    return HeadProfile.from_unstable(model.config, [(cache.flexi_layers[0].layer_idx, 1)])


def _generate(model, ids, mask, cache, new=6, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True, **cache_kwargs(model, cache),
                          **kw)


def _same(out, ref, atol=1e-5):
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def _batch(batch, length, seed=0):
    return left_padded_batch(batch, length, seed=seed, pad_lengths=[0, 7, 13][:batch] if batch > 1 else None)


def _more(out_ids, mask, tokens, seed):
    """The conversation's next user turn: `tokens` new ids after what was generated, the mask extended to match."""
    g = torch.Generator().manual_seed(seed)
    new = torch.randint(3, 90, (out_ids.shape[0], tokens), generator=g)
    grown = torch.ones(out_ids.shape[0], out_ids.shape[1] - mask.shape[1] + tokens, dtype=mask.dtype)
    return torch.cat([out_ids, new], 1), torch.cat([mask, grown], 1)


def _conversation(model, cache, ids, mask, turns=3, **kw):
    outs = []
    for turn in range(turns):
        out = _generate(model, ids, mask, cache, **kw)
        outs.append(out)
        ids, mask = _more(out.sequences, mask, 5 + 4 * turn, seed=turn)
    return outs


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_dynamic_cache_at_full_budget(family, batch):
    model = tiny_model(family)
    ids, mask = _batch(batch, 47)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), prefill_chunk_size=10)
    cache = FlexiCache(model.config, FULL, _mixed(model))
    _same(_generate(model, ids, mask, cache, prefill_chunk_size=10), ref)
    assert cache.get_seq_length() == ids.shape[1] + 5  # the last generated token is not fed back


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_conversation_equals_dynamic_cache_at_full_budget(family, batch):
    """The docs' iterative generation: generate, append a new user turn, generate again with the same cache."""
    model = tiny_model(family)
    ids, mask = _batch(batch, 31)
    refs = _conversation(model, DynamicCache(config=model.config), ids, mask)
    outs = _conversation(model, FlexiCache(model.config, FULL, _mixed(model)), ids, mask)
    for out, ref in zip(outs, refs):
        _same(out, ref)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_reuse_by_deepcopy_equals_dynamic_cache_at_full_budget(family, batch):
    """The docs' prefix caching: prefill a document once, `copy.deepcopy` the cache for every question."""
    model = tiny_model(family)
    doc, doc_mask = _batch(batch, 43)
    results = {}
    for name, cache in (("dense", DynamicCache(config=model.config)), ("flexi", FlexiCache(model.config, FULL, _mixed(model)))):
        model(input_ids=doc, attention_mask=doc_mask, **cache_kwargs(model, cache))
        held = cache.get_seq_length()
        before = [layer.dense_kv() for layer in getattr(cache, "flexi_layers", [])]
        results[name] = []
        for seed, tokens in ((1, 9), (2, 6)):
            ids, mask = _more(doc, doc_mask, tokens, seed)
            results[name].append(_generate(model, ids, mask, copy.deepcopy(cache)))
        assert cache.get_seq_length() == held  # the copies were used, not the original
        for layer, (k, v) in zip(getattr(cache, "flexi_layers", []), before):
            ka, va = layer.dense_kv()
            assert torch.equal(ka, k) and torch.equal(va, v)
    for out, ref in zip(results["flexi"], results["dense"]):
        _same(out, ref)


def test_chunked_and_turns_with_auto_profile_equal_dynamic_cache():
    """profile="auto": a turn during the warm-up and after the classification, both at a full budget."""
    model = tiny_model("llama")
    ids, mask = _batch(1, 29)
    cfg = FlexiCacheConfig(page_size=4, token_budget=512, rerank_interval=2, warmup_steps=4)
    refs = _conversation(model, DynamicCache(config=model.config), ids, mask, prefill_chunk_size=8)
    cache = FlexiCache(model.config, cfg, profile="auto")
    outs = _conversation(model, cache, ids, mask, prefill_chunk_size=8)
    for out, ref in zip(outs, refs):
        _same(out, ref)
    assert cache.profile_found() is None and cache.auto.postponed_at  # every sequence within the budget: nothing to tell


def test_auto_profile_classifies_across_chunks_and_turns():
    """profile="auto" at a low budget, driven directly: chunks, a turn inside the warm-up, the classification, a turn
    after it; every token kept and the metadata right throughout."""
    config = _tiny_config()
    cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=2, warmup_steps=8)
    keys, values = _kv(200, 7)
    cache, length = FlexiCache(config, cfg, profile="auto"), 0
    g = torch.Generator().manual_seed(0)
    for chunks, steps in (([30, 31], 5), ([12], 9), ([20, 7], 4)):
        for size in chunks:
            _feed(cache, keys[:, :, length:], values[:, :, length:], [size])
            length += size
            _check_state(cache, keys, values, length)
        for _ in range(steps):
            _decode_step(cache, keys[:, :, length : length + 1], values[:, :, length : length + 1],
                         torch.randn(2, 4, 1, 16, generator=g))
            length += 1
            _check_state(cache, keys, values, length)
    assert cache.profile_found() is not None
    kinds = {layer.kinds.kind_of(h) for layer in cache.flexi_layers for h in range(layer.num_kv_heads)}
    assert kinds == {"stable", "unstable"}  # the warm-up's all-unstable heads were re-split


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chunked_prefill_at_low_budget_decodes_as_one_prefill(family):
    """The prefill is exact either way, so the decode after it is the same wherever DynamicCache's own chunked and
    unchunked prefills agree (they differ only by the attention's rounding over other chunk shapes)."""
    model = tiny_model(family)
    ids, mask = _batch(1, 150)
    dense = [_generate(model, ids, mask, DynamicCache(config=model.config), new=24, **kw)
             for kw in ({}, {"prefill_chunk_size": 32})]
    flexi = [_generate(model, ids, mask, FlexiCache(model.config, LOW, _mixed(model)), new=24, **kw)
             for kw in ({}, {"prefill_chunk_size": 32})]
    assert torch.equal(dense[0].sequences, dense[1].sequences)
    assert torch.equal(flexi[0].sequences, flexi[1].sequences)
    own = max((a - b).abs().max().item() for a, b in zip(dense[0].logits, dense[1].logits))
    ours = max((a - b).abs().max().item() for a, b in zip(flexi[0].logits, flexi[1].logits))
    assert ours <= 4 * own + 1e-5


# -- the cache's state, fed K/V directly --------------------------------------------------------------------------

def _kv(length, seed, batch=2, heads=2, dim=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, length, dim, generator=g), torch.randn(batch, heads, length, dim, generator=g)


def _feed(cache, keys, values, chunks):
    """Append `keys`/`values` to every layer of `cache` in the given chunk sizes (as chunked prefill does)."""
    start = 0
    for size in chunks:
        for idx in range(len(cache.layers)):
            out = cache.update(keys[:, :, start : start + size], values[:, :, start : start + size], idx)
            if start:  # a chunk on a filled cache sees every earlier token and its own
                assert torch.equal(out[0], keys[:, :, : start + size]) and torch.equal(out[1], values[:, :, : start + size])
        start += size


def _decode_step(cache, key, value, query):
    """One decode step of every layer, driven as the model drives it: update, then FlexiCache's attention."""
    outs = []
    for idx, layer in enumerate(cache.layers):
        k, v = cache.update(key, value, idx)
        outs.append(layer.attend(query, None, 0.25, None))
    return outs


def _tiny_config():
    from conftest import tiny_config

    return tiny_config("llama", layers=2, heads=4, kv_heads=2, head_dim=16)


@pytest.mark.parametrize("chunks", [[37, 40, 23], [1, 99], [16, 16, 16, 16, 36]])
def test_chunked_prefill_leaves_the_state_of_one_prefill(chunks):
    config = _tiny_config()
    profile = HeadProfile.from_unstable(config, [(0, 1)])  # layer 0 mixed, layer 1 all stable
    keys, values = _kv(100, 0)
    # The same capacity (generate gives both its max_length): shapes, and so every rounding, are the same.
    one, chunked = FlexiCache(config, LOW, profile, max_cache_len=256), FlexiCache(config, LOW, profile, max_cache_len=256)
    _feed(one, keys, values, [100])
    _feed(chunked, keys, values, chunks)
    for a, b in zip(one.flexi_layers, chunked.flexi_layers):
        for x, y in zip(a.dense_kv(), b.dense_kv()):
            assert torch.equal(x, y)
        sa, sb = a.store, b.store
        full = 100 // LOW.page_size * sa.subpages
        assert torch.equal(sa.meta[:, :, :full], sb.meta[:, :, :full])
        assert a.rank_all == b.rank_all == bool(a.kinds.stable)  # the next step ranks every stable row
        assert torch.equal(sa.win_shift, sb.win_shift)
    g = torch.Generator().manual_seed(5)
    for _ in range(8):  # then the same decode, step by step (re-ranks, promotions), bit for bit
        k, v = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
        q = torch.randn(2, 4, 1, 16, generator=g)
        for x, y in zip(_decode_step(one, k, v, q), _decode_step(chunked, k, v, q)):
            assert torch.equal(x, y)


def _check_state(cache, keys, values, length):
    """The full tier holds exactly the tokens fed; the MinMax entries of every full page are those of its keys; the
    ledger counts exactly the device tier allocated (every page of the unstable heads, the stable rows' windows), and
    its peak is never below it."""
    held = 0
    for layer in cache.flexi_layers:
        assert layer.length == length
        k, v = layer.dense_kv()
        assert torch.equal(k, keys[:, :, :length]) and torch.equal(v, values[:, :, :length])
        store = layer.store
        held += store.tier_bytes()["device"]
        full, s = length // store.page_size, store.subpages
        rows = keys[:, :, : full * store.page_size].reshape(store.n, full * s, -1, keys.shape[-1])
        expect = torch.cat([rows.amax(2), rows.amin(2)], -1).transpose(1, 2)
        assert torch.equal(store.minmax()[:, :, : full * s], expect)
    assert cache.ledger.current == held
    assert cache.ledger.peak >= held


@pytest.mark.parametrize("seed", range(6))
def test_random_chunks_turns_and_copies_keep_every_token(seed):
    """Random prompt chunks, decode steps, new turns and copies: after every update device ∪ host is the dense K/V,
    the metadata is a recomputation's, the counted bytes are the allocations'; a copy changed never changes its
    original; at a full budget every decode step equals dense attention."""
    g = torch.Generator().manual_seed(seed)
    config = _tiny_config()
    profile = HeadProfile.from_unstable(config, [(0, 1), (1, 0)])
    cfg = FULL if seed % 2 else LOW
    keys, values = _kv(400, seed)
    cache, length = FlexiCache(config, cfg, profile), 0
    while length < 330:
        action = int(torch.randint(0, 4, (1,), generator=g))
        if action == 0 or length == 0:  # a chunk (a prompt, a prefill chunk, a new turn)
            size = int(torch.randint(2, 40, (1,), generator=g))
            _feed(cache, keys[:, :, length:], values[:, :, length:], [size])
            length += size
        elif action in (1, 2):  # decode steps
            for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
                q = torch.randn(2, 4, 1, 16, generator=g)
                outs = _decode_step(cache, keys[:, :, length : length + 1], values[:, :, length : length + 1], q)
                length += 1
                if cfg is FULL:
                    logits = torch.einsum("bhgd,bhld->bhgl", q.view(2, 2, 2, 16), keys[:, :, :length]) * 0.25
                    ref = torch.einsum("bhgl,bhld->bhgd", torch.softmax(logits, -1), values[:, :, :length])
                    for out in outs:
                        torch.testing.assert_close(out.view(2, 2, 2, 16), ref, rtol=1e-5, atol=1e-5)
        else:  # continue on a copy; the original is changed no more
            original, snapshot = cache, [layer.dense_kv() for layer in cache.flexi_layers]
            cache = copy.deepcopy(cache)
            _feed(cache, keys[:, :, length:], values[:, :, length:], [3])
            length += 3
            for layer, (k, v) in zip(original.flexi_layers, snapshot):
                ka, va = layer.dense_kv()
                assert torch.equal(ka, k) and torch.equal(va, v)
        _check_state(cache, keys, values, length)


def test_peak_with_chunks_is_the_design_bound():
    """The device tier is allocated once for the capacity: every page of the unstable heads, a window of the budget's
    pages (plus the pages a re-rank interval opens) per stable row. A chunked prefill adds nothing on a CPU: a chunk
    on a filled cache attends over views of the full tier. The peak is the allocation, far below dense's K/V."""
    from conftest import tiny_config

    from fc_hf.store import window_pages

    config = tiny_config("llama", layers=8, heads=4, kv_heads=2, head_dim=16)
    profile = HeadProfile.from_unstable(config, [(layer, layer % 2) for layer in range(0, 8, 2)])  # 4 of 16 heads
    keys, values = _kv(400, 3)
    cache = FlexiCache(config, LOW, profile, max_cache_len=400)
    _feed(cache, keys, values, [50] * 8)
    report = cache.memory_report()
    dense = report["dense_kv_bytes"]
    per_token_head = dense // (400 * 2 * 16)  # one sequence's one KV head's token, K and V
    pages = 400 // LOW.page_size
    stable_rows = 2 * 12  # sequences x stable heads
    windows = (stable_rows + 8 * 0) * window_pages(LOW, pages) * LOW.page_size * per_token_head
    extra_rows = sum(1 for layer in cache.flexi_layers if layer.kinds.stable) * window_pages(LOW, pages)
    expected = 2 * 4 * 400 * per_token_head + windows + extra_rows * LOW.page_size * per_token_head
    assert report["device_kv_bytes"] == expected
    assert report["peak_device_kv_bytes"] == report["device_kv_bytes"]
    assert report["peak_device_kv_bytes"] < 0.4 * dense


def test_a_new_turn_with_another_batch_size_fails_clearly():
    model = tiny_model("llama")
    ids, mask = _batch(1, 20)
    cache = FlexiCache(model.config, LOW)
    _generate(model, ids, mask, cache, new=3)
    held = cache.get_seq_length()
    more, more_mask = _batch(2, 30, seed=1)
    with pytest.raises(FlexiCacheError, match="holds batch 1 but got 2"):
        _generate(model, more, more_mask, cache, new=3)
    assert cache.get_seq_length() == held


def test_a_released_cache_refuses_more_tokens():
    model = tiny_model("llama")
    ids, mask = _batch(1, 20)
    cache = FlexiCache(model.config, LOW)
    out = _generate(model, ids, mask, cache, new=3)
    cache.release()
    more, more_mask = _more(out.sequences, mask, 4, 0)
    with pytest.raises(FlexiCacheError, match="released"):
        _generate(model, more, more_mask, cache, new=3)
    assert cache.memory_report()["device_kv_bytes"] == 0 and cache.ledger.current == 0


def test_a_short_attention_mask_is_refused_before_anything_is_written():
    """A forward given only the new tokens' mask on a filled cache: transformers would pad it with masked positions."""
    model = tiny_model("llama")
    ids, mask = _batch(1, 20)
    cache = FlexiCache(model.config, LOW)
    model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
    new = torch.randint(3, 90, (1, 5))
    with pytest.raises(FlexiCacheError, match="mask of the whole sequence"):
        model(input_ids=new, attention_mask=torch.ones(1, 5, dtype=torch.long), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 20
    assert all(isinstance(l, FlexiCacheLayer) for l in cache.layers)


def test_zero_warmup_auto_profile_observes_the_last_chunk():
    """profile="auto" with warmup_steps=0 classifies from the prompt's last 32 queries: with a chunked prefill the
    last chunk's (here 40 tokens), so it finds the set the one-prefill cache finds."""
    model = tiny_model("llama", layers=3, heads=8, kv_heads=4)
    ids, mask = _batch(1, 160)
    cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=2, warmup_steps=0)
    found = []
    for kw in ({}, {"prefill_chunk_size": 40}):
        cache = FlexiCache(model.config, cfg, profile="auto")
        _generate(model, ids, mask, cache, new=3, **kw)
        assert cache.stats()["auto_profile"]["observed_prefill"]
        found.append(cache.profile_found().unstable)
    assert found[0] == found[1]


@pytest.mark.parametrize("length", [129, 130, 133, 65, 2])
def test_a_one_token_prefill_chunk_is_a_prompt_token(length):
    """Chunked prefill equals one prefill at every prompt length, also when the last chunk is a single token (length
    = 1 mod the chunk size): generate feeds it as a prompt token (`speculative.in_prefill`), so it attends densely and
    is no decode step. Issue 39's case: 2 layers, 4 heads, 2 KV heads, budget 32, pages of 8, chunks of 64, 24
    tokens (at 129 the first step's logits differed by 0.176 and the tokens parted)."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    cfg = FlexiCacheConfig(page_size=8, token_budget=32)
    ids = torch.randint(3, 90, (1, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    one, chunked = FlexiCache(model.config, cfg, _mixed(model)), FlexiCache(model.config, cfg, _mixed(model))
    ref = _generate(model, ids, mask, one, new=24)
    _same(_generate(model, ids, mask, chunked, new=24, prefill_chunk_size=64), ref, atol=1e-6)
    assert [l.decode_steps() for l in chunked.flexi_layers] == [l.decode_steps() for l in one.flexi_layers] == [23, 23]


def test_a_one_token_turn_is_a_prompt_token():
    """A new turn of one token (generate on a filled cache with one more input token) attends densely, as a turn of
    several does and as one prefill of the whole conversation would, then decodes: at a full budget every token
    equals DynamicCache's; at a low one the turn's logits are exact attention over the K/V the cache holds."""
    model = tiny_model("llama")
    ids, mask = _batch(1, 40)
    for cfg in (FULL, LOW):
        flexi, dense = FlexiCache(model.config, cfg, _mixed(model)), DynamicCache(config=model.config)
        out = _generate(model, ids, mask, flexi)
        _generate(model, ids, mask, dense)
        # The answer's last token is not in the cache yet: generate on the answer feeds exactly that one token.
        turn, turn_mask = out.sequences, torch.cat([mask, torch.ones(1, 6, dtype=mask.dtype)], 1)
        assert turn.shape[1] - flexi.get_seq_length() == 1
        steps = [l.counts()["decode_steps"] for l in flexi.flexi_layers]
        held = DynamicCache(config=model.config)  # what the FlexiCache holds now, every token exactly
        for layer in flexi.flexi_layers:
            held.update(*layer.dense_kv(), layer.layer_idx)
        got = _generate(model, turn, turn_mask, flexi)
        assert [l.counts()["decode_steps"] for l in flexi.flexi_layers] == [s + 5 for s in steps]  # the turn: no step
        if cfg is FULL:
            _same(got, _generate(model, turn, turn_mask, dense))
        exact = model(input_ids=turn[:, -1:], attention_mask=turn_mask, **cache_kwargs(model, held)).logits[:, -1]
        torch.testing.assert_close(got.logits[0], exact, rtol=0, atol=1e-5)

"""Speculative decoding on a FlexiCache (issue 29): `crop`, several decode tokens in one forward, and generate's
prompt lookup and assisted decoding giving exactly plain greedy FlexiCache decoding's tokens.

The cache-level tests feed K/V and queries directly and compare against a cache that never saw the rolled-back
tokens, fed the kept ones one decode step at a time: every tensor (its valid region), every slot, every counter equal,
and the attention outputs equal bit for bit.
"""

import copy

import pytest
import torch
from conftest import tiny_config, tiny_model
from transformers import DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile
from fc_hf.compat import cache_kwargs

pytestmark = pytest.mark.usefixtures("no_grad")

CONFIGS = {
    "low": FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3),
    # a deferred promotion, sub-page MinMax entries, two carried pages, two sink pages
    "low-variants": FlexiCacheConfig(page_size=4, token_budget=20, rerank_interval=3, promotion="deferred",
                                     score_subpages=2, carry_pages=2, sink_pages=2),
    "full": FlexiCacheConfig(page_size=4, token_budget=512, rerank_interval=3),
}
SCALE = 0.25
# The caches compared through generate share one capacity: a verification may run a few drafts past max_length (prompt
# lookup's last), so a cache that verifies sizes itself larger than one that decodes plainly would.
CAPACITY = 160


# -- driving a cache directly -------------------------------------------------------------------------------------

def _setup(cfg, heads=4, kv_heads=2, seed=0, length=260, batch=2):
    config = tiny_config("llama", layers=2, heads=heads, kv_heads=kv_heads, head_dim=16)
    # layer 0: head 1 unstable, the others stable (tiered); layer 1: every head stable
    profile = HeadProfile.from_unstable(config, [(0, 1)])
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, length, 16, generator=g)
    values = torch.randn(batch, kv_heads, length, 16, generator=g)
    queries = torch.randn(batch, heads, length, 16, generator=g)
    return (lambda: FlexiCache(config, cfg, profile)), keys, values, queries


def _prefill(cache, keys, values):
    for idx in range(len(cache.layers)):
        cache.update(keys, values, idx)


def _forward(cache, keys, values, queries, mask=None, softcap=None):
    """One forward of `T = keys.shape[2]` decode tokens through every layer: update, then FlexiCache's attention."""
    outs = []
    for idx, layer in enumerate(cache.layers):
        cache.update(keys, values, idx)
        outs.append(layer.attend(queries, mask, SCALE, softcap))
    return outs


def _steps(cache, keys, values, queries):
    """The same tokens one decode step at a time; outputs concatenated over the steps."""
    outs = [_forward(cache, keys[:, :, j : j + 1], values[:, :, j : j + 1], queries[:, :, j : j + 1])
            for j in range(keys.shape[2])]
    return [torch.cat(per_layer, dim=1) for per_layer in zip(*outs)]


def assert_same_state(a, b, atol=0.0):
    """Every tensor's valid region and every counter of caches `a` and `b` equal (K/V and MinMax entries within `atol`:
    a model computes a token's K/V in a forward of several tokens with other rounding)."""
    same = torch.equal if not atol else (lambda x, y: torch.allclose(x, y, rtol=0, atol=atol))
    assert a.ledger.current == b.ledger.current
    ra, rb = a.memory_report(), b.memory_report()
    ra.pop("peak_device_kv_bytes"), rb.pop("peak_device_kv_bytes")  # a high-water mark: the verification did hold more
    assert ra == rb
    assert a.stats() == b.stats()
    for la, lb in zip(a.flexi_layers, b.flexi_layers):
        assert (la.length, la.decode_steps(), la.pending, la.rank_all, la.prompt_end) == (
            lb.length, lb.decode_steps(), lb.pending, lb.rank_all, lb.prompt_end)
        for x, y in zip(la.dense_kv(), lb.dense_kv()):
            assert same(x, y)
        _assert_same_store(la, lb, same)


def _assert_same_store(la, lb, same):
    sa, sb = la.store, lb.store
    assert int(sa.length_t) == int(sb.length_t) == sa.length and int(la.promoted) == int(lb.promoted)
    full, s = sa.length // sa.page_size, sa.subpages
    assert same(sa.meta[:, :, : full * s], sb.meta[:, :, : full * s])  # full pages' entries
    n_s = sa.rows.n_stable  # the stable rows' windows (their extra last row takes padded places' writes: not state)
    for name in ("win_pages", "win_shift", "win_bias_rows"):
        assert torch.equal(getattr(sa, name)[:n_s], getattr(sb, name)[:n_s]), name
    tokens = sa.win_pages[:n_s, :, None] * sa.page_size + torch.arange(sa.page_size)
    held = ((sa.win_pages[:n_s, :, None] >= 0) & (tokens < sa.length)).flatten(1)
    for x, y in ((sa.win_k, sb.win_k), (sa.win_v, sb.win_v)):
        assert same(x[:n_s][held], y[:n_s][held])
    rows = sa.n  # the carried candidates of every row (the extra row: padded places')
    ca, cb = la.selector, lb.selector
    assert torch.equal(ca.carried_scores[:rows], cb.carried_scores[:rows])
    live = torch.isfinite(ca.carried_scores[:rows])
    assert torch.equal(ca.carried_pages[:rows][live], cb.carried_pages[:rows][live])


def assert_same_outputs(got, want, batched: bool):
    """A verification's outputs against plain decoding's: bit for bit from the loop of single steps; to float rounding
    from the batched block (its attention runs the block's queries in one matmul), with the same selections (the
    states compared after it)."""
    if batched:
        assert torch.allclose(got, want, rtol=0, atol=ATOL), (got - want).abs().max()
    else:
        assert torch.equal(got, want), (got - want).abs().amax(dim=(0, 2, 3))


ATOL = 1e-5


def _batched(cache, batched: bool):
    for layer in cache.flexi_layers:
        layer.batched_verify = batched
    return cache


def _random_run(cfg, seed, batched=True):
    """Random verification forwards (1-7 tokens) with random rejections, against plain decoding of the kept tokens."""
    make, keys, values, queries = _setup(cfg, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompt = int(torch.randint(5, 40, (1,), generator=g))
    if True:
        spec, ref = _batched(make(), batched), make()
        _prefill(spec, keys[:, :, :prompt], values[:, :, :prompt])
        _prefill(ref, keys[:, :, :prompt], values[:, :, :prompt])
        spec.activate_past_recording()
        length, rejected = prompt, 0
        while length < 200:
            t = int(torch.randint(1, 8, (1,), generator=g))
            keep = int(torch.randint(0, t + 1, (1,), generator=g))  # 0: all taken back (transformers keeps >= 1)
            span = slice(length, length + t)
            drafted = torch.randint(0, keys.shape[2], (t,), generator=g)  # rejected tokens: other K/V and queries
            k, v, q = keys[:, :, span].clone(), values[:, :, span].clone(), queries[:, :, span].clone()
            k[:, :, keep:], v[:, :, keep:], q[:, :, keep:] = (x[:, :, drafted[keep:]] for x in (keys, values, queries))
            outs = _forward(spec, k, v, q)
            spec.crop(keep - t)
            rejected += t - keep
            if keep:
                for got, want in zip(outs, _steps(ref, k[:, :, :keep], v[:, :, :keep], q[:, :, :keep])):
                    assert_same_outputs(got[:, :keep], want, batched)
            length += keep
            assert spec.get_seq_length() == length
            assert_same_state(spec, ref)
    assert rejected > 20
    return spec, ref


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("batched", [True, False], ids=["block", "loop"])
def test_random_verifications_and_crops_leave_plain_decodings_state(seed, name, batched):
    spec, ref = _random_run(CONFIGS[name], seed, batched)
    if name != "full":  # stable heads re-ranked and promoted pages inside verified blocks
        assert spec.stats()["pages_promoted"] > 0 and spec.stats()["reranks_stable"] > 10
    g = torch.Generator().manual_seed(seed)  # and the two caches go on the same, step for step
    for _ in range(6):
        k, v = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
        q = torch.randn(2, 4, 1, 16, generator=g)
        for x, y in zip(_forward(spec, k, v, q), _forward(ref, k, v, q)):
            assert torch.equal(x, y)
    assert_same_state(spec, ref)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 4), (8, 2)])
@pytest.mark.parametrize("name", ["low", "low-variants"])
@pytest.mark.parametrize("batched", [True, False], ids=["block", "loop"])
def test_several_decode_tokens_attend_as_single_steps(name, heads, kv_heads, batched):
    """A forward of T decode tokens = T decode steps (bit for bit from the loop, to rounding from the block), with
    stable re-ranks falling inside the block (re-rank interval 3, blocks of 7) and a left-padded batch's mask."""
    make, keys, values, queries = _setup(CONFIGS[name], heads=heads, kv_heads=kv_heads, length=120)
    spec, ref = _batched(make(), batched), make()
    prompt = 33
    valid = torch.ones(2, 120, dtype=torch.bool)
    valid[1, :9] = False  # row 1 left-padded
    for cache in (spec, ref):
        _prefill(cache, keys[:, :, :prompt], values[:, :, :prompt])
    spec.activate_past_recording()
    length = prompt
    while length + 7 <= 120:
        span = slice(length, length + 7)
        mask = valid[:, None, None, : length + 7].expand(2, 1, 7, length + 7)  # padding only (causal: per step)
        outs = _forward(spec, keys[:, :, span], values[:, :, span], queries[:, :, span], mask)
        spec.crop(0)
        steps = []
        for j in range(length, length + 7):
            one = slice(j, j + 1)
            steps.append(_forward(ref, keys[:, :, one], values[:, :, one], queries[:, :, one], valid[:, None, None, : j + 1]))
        for got, want in zip(outs, zip(*steps)):
            assert_same_outputs(got, torch.cat(want, dim=1), batched)
        length += 7
    assert_same_state(spec, ref)
    assert spec.stats()["reranks_stable"] >= 20


def test_crop_refusals_change_nothing():
    make, keys, values, queries = _setup(CONFIGS["low"], length=40)
    cache = make()
    _prefill(cache, keys[:, :, :20], values[:, :, :20])
    with pytest.raises(FlexiCacheError, match="only decode tokens fed since its last crop while recording"):
        cache.crop(-1)  # not recording
    cache.activate_past_recording()
    _forward(cache, keys[:, :, 20:24], values[:, :, 20:24], queries[:, :, 20:24])
    with pytest.raises(FlexiCacheError, match="negative"):
        cache.crop(3)
    with pytest.raises(FlexiCacheError, match="4 now"):
        cache.crop(-5)  # past the prompt
    assert cache.get_seq_length() == 24
    cache.crop(-2)
    with pytest.raises(FlexiCacheError, match="0 now"):
        cache.crop(-1)  # the crop committed what it kept
    assert cache.get_seq_length() == 22


def test_many_verify_and_crop_cycles_hold_no_more_memory():
    """Thirty verifications of 6 tokens, every one taken back: slots, device and host bytes, the ledger, all as
    before; the marks are gone after each crop."""
    make, keys, values, queries = _setup(CONFIGS["low"], length=200)
    cache = make()
    _prefill(cache, keys[:, :, :70], values[:, :, :70])
    _forward(cache, keys[:, :, 70:71], values[:, :, 70:71], queries[:, :, 70:71])
    assert_crop_cycles_hold_memory(cache, keys, values, queries)


def assert_crop_cycles_hold_memory(cache, keys, values, queries, cycles: int = 30, tokens: int = 6):
    """`cycles` verifications of `tokens` random tokens, each taken back: the memory report (its peak aside) as
    before every time, and no marks left."""
    before = cache.memory_report()
    before.pop("peak_device_kv_bytes")
    cache.activate_past_recording()
    g = torch.Generator().manual_seed(1)
    for _ in range(cycles):
        idx = torch.randint(0, keys.shape[2], (tokens,), generator=g)
        _forward(cache, keys[:, :, idx], values[:, :, idx], queries[:, :, idx])
        cache.crop(-tokens)
        after = cache.memory_report()
        after.pop("peak_device_kv_bytes")
        assert after == before
        assert all(not layer._marks for layer in cache.flexi_layers)


# -- generate ---------------------------------------------------------------------------------------------------

def _prompt(length=60, seed=0):
    """Random ids with a repeated span, so prompt lookup finds candidates from the first forward on."""
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(3, 90, (1, 12), generator=g)
    ids = torch.cat([torch.randint(3, 90, (1, length - 30), generator=g), span, torch.randint(3, 90, (1, 12),
                     generator=g), span[:, :6]], 1)
    return ids, torch.ones_like(ids)


def _generate(model, ids, mask, cache, new=40, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, **cache_kwargs(model, cache), **kw)


def _forwards(model):
    """Counts the model's forwards (a list that grows by one per call)."""
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def _mixed_profile(model):
    first = FlexiCache(model.config).flexi_layers[0].layer_idx
    return HeadProfile.from_unstable(model.config, [(first, 1)])


def _assistant(model):
    """The same weights with dense attention: its drafts are dense greedy decoding's, which a low budget's own tokens
    depart from now and then (rejections), a full budget's never."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("sdpa")
    return twin


@pytest.mark.parametrize("budget", ["low", "full"])
@pytest.mark.parametrize("family,shape", [("llama", {}), ("qwen2", {}), ("gemma3", {}), ("phi3", {}),
                                          ("llama", {"heads": 8, "kv_heads": 4}), ("mistral", {"kv_heads": 6})])
def test_prompt_lookup_and_assisted_decoding_give_greedy_tokens(family, shape, budget):
    model = tiny_model(family, **shape)
    cfg, profile = CONFIGS[budget], _mixed_profile(model)
    ids, mask = _prompt()
    plain = _generate(model, ids, mask, FlexiCache(model.config, cfg, profile, max_cache_len=CAPACITY))
    if budget == "full":
        assert torch.equal(plain, _generate(model, ids, mask, DynamicCache(config=model.config)))
    assistant = _assistant(model)
    calls = _forwards(model)
    for kw in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": assistant}):
        calls.clear()
        cache = FlexiCache(model.config, cfg, profile, max_cache_len=CAPACITY)
        assert torch.equal(_generate(model, ids, mask, cache, **kw), plain), kw
        assert len(calls) < 40  # some candidates were accepted: fewer forwards than tokens
        reference = FlexiCache(model.config, cfg, profile, max_cache_len=CAPACITY)
        _generate(model, ids, mask, reference)
        assert_same_state(cache, reference, atol=1e-5)


def test_a_new_turn_after_prompt_lookup_attends_densely_again():
    """generate ends recording at its next call: the next turn is a dense prefill, as after plain decoding."""
    model = tiny_model("llama")
    cfg, profile = CONFIGS["low"], _mixed_profile(model)
    ids, mask = _prompt()
    spec, plain = FlexiCache(model.config, cfg, profile, max_cache_len=CAPACITY), FlexiCache(model.config, cfg, profile, max_cache_len=CAPACITY)
    first = _generate(model, ids, mask, spec, prompt_lookup_num_tokens=4)
    assert torch.equal(first, _generate(model, ids, mask, plain))
    more = torch.cat([first, torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(1))], 1)
    assert torch.equal(_generate(model, more, torch.ones_like(more), spec, new=12),
                       _generate(model, more, torch.ones_like(more), plain, new=12))
    assert not any(layer.record_past for layer in spec.flexi_layers)
    assert_same_state(spec, plain, atol=1e-5)


def test_what_assisted_decoding_cannot_do_is_refused_clearly():
    model = tiny_model("llama")
    ids, mask = _prompt()
    batch = torch.cat([ids, ids.flip(1)])
    cache = FlexiCache(model.config, CONFIGS["low"])
    with pytest.raises(FlexiCacheError, match="one sequence at a time.*this batch has 2"):
        _generate(model, batch, torch.ones_like(batch), cache, prompt_lookup_num_tokens=3)
    assert cache.get_seq_length() == 0
    out = _generate(model, ids, mask, cache, new=5)  # the cache is still usable
    more = torch.cat([out, out[:, -4:]], 1)
    with pytest.raises(FlexiCacheError, match="starts from an empty cache; this FlexiCache holds 64 tokens"):
        _generate(model, more, torch.ones_like(more), cache, prompt_lookup_num_tokens=3)
    assert cache.get_seq_length() == 64
    auto = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=2, warmup_steps=4),
                      profile="auto")
    with pytest.raises(FlexiCacheError, match='profile="auto"'):
        _generate(model, ids, mask, auto, prompt_lookup_num_tokens=3)

"""Property tests (hypothesis) over random shapes and settings.

Each example draws a tiny Llama (layers, KV heads, GQA ratio, head_dim), a FlexiCacheConfig (page
size, K, re-rank interval, offload, promotion mode), a profile (any subset of heads unstable, or
None), a batch with random left padding (and masked spans inside prompts), and prompt/decode lengths; then teacher-forces random
tokens and checks after every decode step:
(a) host and device tiers together hold every K/V the cache was given, bit for bit;
(b) the sparse attention of every row equals brute-force dense attention (fp64) over exactly the pages it read (an
    unstable row its ranking, a stable row its window), taken from the K/V the cache was *given* (so a page in the
    wrong place fails too), and each read set has the current page, no duplicate, and every page while <= K;
(c) with a budget covering every token, logits equal a DynamicCache run.
Bounded for CI: few examples, derandomized; FLEXICACHE_HYPOTHESIS_EXAMPLES raises the count.
"""

import os

import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from robustness_helpers import RecordingCache, forced_decode
from transformers import DynamicCache

import fc_hf.decode as decode
from fc_hf import FlexiCacheConfig, HeadProfile
from fc_hf.kernels import bruteforce

EXAMPLES = int(os.environ.get("FLEXICACHE_HYPOTHESIS_EXAMPLES", "12"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def cases(draw, full_budget=False):
    layers = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([1, 2, 3, 7]))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    page_size = draw(st.integers(1, 8))
    prompt = draw(st.integers(2, 40))
    decode = draw(st.integers(1, 24))
    if full_budget:
        pages = -(-(prompt + decode) // page_size)
        k = max(2, pages + draw(st.integers(0, 2)))
    else:
        k = draw(st.integers(2, 6))
    batch = draw(st.integers(1, 3))
    pads = [0] + [draw(st.integers(0, prompt - 1)) for _ in range(batch - 1)]
    # Optionally a masked span inside a row's prompt (generate accepts any 2D mask); the last token stays.
    holes = [draw(st.one_of(st.none(), st.tuples(st.integers(pad, prompt - 1), st.integers(0, 9)))) for pad in pads]
    pairs = [(l, h) for l in range(layers) for h in range(kv_heads)]
    unstable = draw(st.one_of(st.none(), st.sets(st.sampled_from(pairs))))
    cfg = dict(
        page_size=page_size,
        token_budget=k * page_size,
        rerank_interval=draw(st.integers(1, 7)),
        offload=draw(st.booleans()),
        promotion=draw(st.sampled_from(["sync", "deferred"])),
    )
    return dict(layers=layers, kv_heads=kv_heads, heads=kv_heads * ratio, head_dim=head_dim, prompt=prompt,
                decode=decode, pads=pads, holes=holes, unstable=unstable, cfg=cfg, seed=draw(st.integers(0, 2**16)))


def _setup(case):
    model = tiny_model("llama", layers=case["layers"], heads=case["heads"], kv_heads=case["kv_heads"],
                       head_dim=case["head_dim"], seed=case["seed"] % 7)
    g = torch.Generator().manual_seed(case["seed"])
    batch = len(case["pads"])
    ids = torch.randint(1, 97, (batch, case["prompt"]), generator=g)
    mask = torch.ones_like(ids)
    for i, pad in enumerate(case["pads"]):
        ids[i, :pad], mask[i, :pad] = 0, 0
        if case["holes"][i] is not None:
            start, width = case["holes"][i]
            mask[i, start : min(start + width, case["prompt"] - 1)] = 0
    forced = torch.randint(1, 97, (batch, case["decode"]), generator=g)
    profile = None if case["unstable"] is None else HeadProfile.from_unstable(model.config, case["unstable"])
    return model, ids, mask, forced, profile


@SETTINGS
@given(case=cases())
def test_tiers_reconstruct_everything_and_attention_matches_bruteforce(case):
    model, ids, mask, forced, profile = _setup(case)
    cfg = FlexiCacheConfig(**case["cfg"])
    cache = RecordingCache(model.config, cfg, profile)
    checked = []
    real_attend, real_windows = decode.attend, decode._attend_windows
    windows = {}

    def spy_windows(layer, *a, **k):
        windows[layer.layer_idx] = layer.store.win_pages[: layer.store.rows.n_stable].clone()
        return real_windows(layer, *a, **k)

    def spy_attend(layer, query, ctx, attention_mask, scaling, softcap):
        out = real_attend(layer, query, ctx, attention_mask, scaling, softcap)
        length = layer.store.length  # the step's token included
        valid = torch.cat([mask, mask.new_ones(mask.shape[0], length - mask.shape[1])], 1).bool()  # ground truth
        _check_layer(cache, layer, query, out, windows.pop(layer.layer_idx, None), length, valid, scaling, cfg)
        checked.append(layer.layer_idx)
        return out

    decode.attend, decode._attend_windows = spy_attend, spy_windows
    try:
        forced_decode(model, cache, ids, mask, forced, on_step=lambda t: cache.assert_nothing_lost(f"step {t}"))
    finally:
        decode.attend, decode._attend_windows = real_attend, real_windows
    assert len(set(checked)) == case["layers"]  # every layer's decode went through the sparse path


def _check_layer(cache, layer, query, out, windows, length, token_valid, scaling, cfg):
    """(b): each row's output `[B, 1, Hq, D]` == brute force over the tokens of the pages it read."""
    keys, values = cache.seen[layer.layer_idx]
    store, k, p = layer.store, cfg.pages_per_head, cfg.page_size
    heads, ratio = store.heads, query.shape[1] // store.heads
    num_pages = -(-length // p)
    unstable, stable = store.rows.unstable.tolist(), store.rows.stable.tolist()
    for row in range(store.n):
        b, h = divmod(row, heads)
        if row in unstable:
            read = [x for x in layer.last_ranking[unstable.index(row)].tolist() if x < num_pages]
        elif row in stable:
            read = [x for x in windows[stable.index(row)].tolist() if 0 <= x < num_pages]
        else:
            read = bruteforce.streaming_pages_bruteforce(num_pages, k, cfg.streaming_sink_pages)
        assert len(read) == len(set(read)), f"row {row} reads a page twice: {read}"
        assert num_pages - 1 in read, "the page being filled must always be read"
        if num_pages <= k:  # every page with an attendable token (an all-padding page is as good as none)
            attendable = [x for x in range(num_pages) if bool(token_valid[b, x * p : (x + 1) * p].any())]
            assert set(attendable) <= set(read), "with <= K pages every page is read"
        allowed = torch.zeros(num_pages * p, dtype=torch.bool)
        for page in read:
            allowed[page * p : (page + 1) * p] = True
        allowed = allowed[:length] & token_valid[b]
        q = query[b, h * ratio : (h + 1) * ratio, 0]
        brute = bruteforce.dense_attention_bruteforce(q[None], keys[b, h][None], values[b, h][None], allowed[None],
                                                      scaling)
        torch.testing.assert_close(out[b, 0, h * ratio : (h + 1) * ratio].float(), brute[0], rtol=1e-4, atol=1e-5)


@SETTINGS
@given(case=cases(full_budget=True))
def test_budget_covering_everything_equals_dense(case):
    model, ids, mask, forced, profile = _setup(case)
    cache = RecordingCache(model.config, FlexiCacheConfig(**case["cfg"]), profile)
    got = forced_decode(model, cache, ids, mask, forced)
    want = forced_decode(model, DynamicCache(config=model.config), ids, mask, forced)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    cache.assert_nothing_lost("end")
    assert cache.stats()["decode_steps"] == case["decode"]

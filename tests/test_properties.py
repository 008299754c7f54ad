"""Property tests (hypothesis) over random shapes and settings.

Each example draws a tiny Llama (layers, KV heads, GQA ratio, head_dim), a FlexiCacheConfig (page
size, K, re-rank interval, offload, promotion mode), a profile (any subset of heads unstable, or
None), a batch with random left padding (and masked spans inside prompts), and prompt/decode lengths; then teacher-forces random
tokens and checks after every decode step:
(a) host and device tiers together hold every K/V the cache was given, bit for bit;
(b) the sparse attention of every head group equals brute-force dense attention (fp64) over exactly
    the selected pages' tokens, taken from the K/V the cache was *given* (so a page in the wrong slot
    fails too), and each selection has the current page, no duplicate, and every page while <= K;
(c) with a budget covering every token, logits equal a DynamicCache run.
Half the examples of (a)-(b) run the tier copies through the deferred fake backend
(tests/deferred_transfers.py), so a missing stream wait shows as NaN or a lost page.
Bounded for CI: few examples, derandomized; FLEXICACHE_HYPOTHESIS_EXAMPLES raises the count.
"""

import os
from contextlib import nullcontext

import torch
from conftest import tiny_model
from deferred_transfers import deferred_transfers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from robustness_helpers import RecordingCache, forced_decode
from transformers import DynamicCache

import fc_hf.kernels as kernels
from fc_hf import FlexiCacheConfig, HeadProfile
from fc_hf.head_group import HeadGroup
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
                decode=decode, pads=pads, holes=holes, unstable=unstable, cfg=cfg, seed=draw(st.integers(0, 2**16)),
                deferred_copies=draw(st.booleans()))


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
    cache = None  # made inside the transfer backend below
    checked = []
    real_attend = HeadGroup.attend

    def spy_attend(group, query, step, token_valid, page_valid, scaling, softcap, check, out=None):
        seen = {}
        real_sda = kernels.sparse_decode_attention

        def spy_sda(q, k_pool, v_pool, slots, pages, length, *a, **k):
            seen.update(pages=pages.clone(), length=length)
            return real_sda(q, k_pool, v_pool, slots, pages, length, *a, **k)

        kernels.sparse_decode_attention = spy_sda
        try:
            out = real_attend(group, query, step, token_valid, page_valid, scaling, softcap, check, out=out)
        finally:
            kernels.sparse_decode_attention = real_sda
        layer = next(i for i, l in enumerate(cache.layers) if group in getattr(l, "groups", ()))
        length = seen["length"]
        valid = torch.cat([mask, mask.new_ones(mask.shape[0], length - mask.shape[1])], 1).bool()  # ground truth
        _check_group(cache, layer, group, query, out, seen["pages"], length, valid, scaling, cfg)
        checked.append(layer)
        return out

    HeadGroup.attend = spy_attend
    try:
        with deferred_transfers() if case["deferred_copies"] else nullcontext():
            cache = RecordingCache(model.config, cfg, profile)
            forced_decode(model, cache, ids, mask, forced, on_step=lambda t: cache.assert_nothing_lost(f"step {t}"))
    finally:
        HeadGroup.attend = real_attend
    assert len(set(checked)) == case["layers"]  # every layer's decode went through the sparse path


def _check_group(cache, layer, group, query, out, pages, length, token_valid, scaling, cfg):
    """(b): `out [N, G, D]` == brute force over the tokens of `pages [N, M]`, with the true K/V and mask `[B, L]`."""
    keys, values = cache.seen[layer]
    heads = group.head_index
    b = keys.shape[0]
    n = b * len(group.heads)
    keys = keys[:, heads].reshape(n, length, -1)
    values = values[:, heads].reshape(n, length, -1)
    num_pages = -(-length // cfg.page_size)
    allowed = torch.zeros(n, num_pages * cfg.page_size, dtype=torch.bool)
    for row in range(n):
        chosen = [p for p in pages[row].tolist() if p >= 0]
        assert len(chosen) == len(set(chosen)), f"row {row} selects a page twice: {chosen}"
        assert num_pages - 1 in chosen, "the page being filled must always be selected"
        if num_pages <= cfg.pages_per_head and group.kind != "streaming":
            assert sorted(chosen) == list(range(num_pages)), "with <= K pages every page is selected"
        for p in chosen:
            allowed[row, p * cfg.page_size : (p + 1) * cfg.page_size] = True
    allowed = allowed[:, :length] & token_valid.repeat_interleave(len(group.heads), 0)
    brute = bruteforce.dense_attention_bruteforce(query, keys, values, allowed, scaling)
    torch.testing.assert_close(out.float(), brute, rtol=1e-4, atol=1e-5)


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

"""Selection policies of `fc_hf.selection` against brute force: exact page mass, the tail estimate.

The tail estimate stands for an unselected page by one softmax term built from the page's mean key
and mean value. When every token of a page has the same key and value that term is exact, so
attention over the selected pages plus the tail must equal dense attention: a planted case that fails
if a term is missing, counted twice, mis-scaled or given the wrong value.
"""

import math

import pytest
import torch

from fc_hf import FlexiCache, FlexiCacheConfig
from fc_hf.kernels import bruteforce, torch_backend
from fc_hf.selection import exact_page_mass, tail_terms


def _constant_pages(n, pages, page_size, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, pages, 1, d, generator=g).expand(n, pages, page_size, d).contiguous()
    v = torch.randn(n, pages, 1, d, generator=g).expand(n, pages, page_size, d).contiguous()
    return k, v


@pytest.mark.parametrize("n,groups,pages,page_size,d,selected", [(3, 1, 9, 4, 8, 3), (4, 3, 12, 8, 16, 5), (2, 7, 5, 2, 4, 1)])
def test_tail_estimate_is_exact_on_constant_pages(n, groups, pages, page_size, d, selected):
    k, v = _constant_pages(n, pages, page_size, d)
    q = torch.randn(n, groups, d)
    scaling = d ** -0.5
    # The last page is partial (being filled): 1 token in it.
    length = (pages - 1) * page_size + 1
    keys = k.reshape(n, -1, d)[:, :length]
    values = v.reshape(n, -1, d)[:, :length]
    dense = bruteforce.dense_attention_bruteforce(q, keys, values, torch.ones(n, length, dtype=torch.bool), scaling)
    # Select `selected` random full pages per row + the page being filled; the rest goes to the tail.
    sel = torch.stack([torch.randperm(pages - 1)[:selected] for _ in range(n)])
    sel = torch.cat([sel, torch.full((n, 1), pages - 1)], dim=1)
    pool_k = torch.cat([torch.zeros(1, page_size, d), k.reshape(-1, page_size, d)])
    pool_v = torch.cat([torch.zeros(1, page_size, d), v.reshape(-1, page_size, d)])
    slots = 1 + torch.arange(n)[:, None] * pages + sel
    means = torch.cat([k.mean(2), v.mean(2)], dim=-1)  # [N, pages, 2D]
    tail = tail_terms(q, means, sel, pages - 1, page_size, scaling)
    out = torch_backend.sparse_decode_attention(q, pool_k, pool_v, slots, sel, length, scaling, tail=tail)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    # Without the tail the same selection is not dense attention: the test can tell.
    no_tail = torch_backend.sparse_decode_attention(q, pool_k, pool_v, slots, sel, length, scaling)
    assert (no_tail - dense).abs().max() > 1e-3


def test_tail_terms_skip_read_invalid_and_partial_pages():
    n, g, d, pages, page_size = 2, 2, 4, 6, 4
    q = torch.randn(n, g, d)
    means = torch.randn(n, pages, 2 * d)
    read = torch.tensor([[0, 5], [2, 3]])  # page 5 is the page being filled (full_pages = 5)
    valid = torch.ones(n, pages, dtype=torch.bool)
    valid[1, 0] = False
    logits, values = tail_terms(q, means, read, 5, page_size, 0.5, valid)
    assert logits.shape == (n, g, 5) and values.shape == (n, 5, d)
    skipped = torch.isinf(logits[:, 0])
    assert skipped.tolist() == [[True, False, False, False, False], [True, False, True, True, False]]
    expected = 0.5 * torch.einsum("ngd,npd->ngp", q, means[:, :5, :d]) + math.log(page_size)
    torch.testing.assert_close(logits[~torch.isinf(logits)], expected[~torch.isinf(logits)])


@pytest.mark.parametrize("n,groups,pages,page_size,length", [(3, 2, 7, 4, 26), (2, 3, 4, 8, 32)])
def test_exact_page_mass_is_the_true_attention_mass_per_page(n, groups, pages, page_size, length):
    d = 8
    q = torch.randn(n, groups, d)
    keys = torch.randn(n, pages * page_size, d)
    mass = exact_page_mass(q, keys, length, page_size, 0.4)
    for row in range(n):
        for page in range(pages):
            total = 0.0
            for h in range(groups):
                logits = [float(q[row, h] @ keys[row, t]) * 0.4 for t in range(length)]
                top = max(logits)
                z = sum(math.exp(x - top) for x in logits)
                total += sum(math.exp(logits[t] - top) for t in range(page * page_size, min(length, (page + 1) * page_size))) / z
            assert mass[row, page].item() == pytest.approx(total / groups, abs=1e-5)


def test_tail_estimate_cache_equals_dense_at_full_budget_and_counts_its_metadata():
    from conftest import tiny_model
    from transformers import DynamicCache

    model = tiny_model("llama")
    ids = torch.randint(1, 90, (1, 150), generator=torch.Generator().manual_seed(3))
    dense = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=DynamicCache(config=model.config))
    plain = FlexiCache(model.config, FlexiCacheConfig(page_size=16, token_budget=512))
    with_tail = FlexiCache(model.config, FlexiCacheConfig(page_size=16, token_budget=512, tail_estimate=True))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=with_tail)
    model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=plain)
    assert torch.equal(out, dense)
    extra = with_tail.memory_report()["metadata_bytes"] - plain.memory_report()["metadata_bytes"]
    layers = with_tail.flexi_layers
    per_page = (layers[0].head_dim + layers[0].value_dim) * 4  # fp32 mean key + mean value
    full_pages = layers[0].length // 16  # every full page of every KV head has its means
    needed = len(layers) * layers[0].num_kv_heads * full_pages * per_page
    assert needed > 0 and needed <= extra <= 3 * needed  # capacity grows in steps, never by more than 2x here


def test_refine_with_every_page_as_candidate_is_the_exact_selection():
    from conftest import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(1, 90, (1, 400), generator=torch.Generator().manual_seed(5))
    pages = 400 // 16 + 2
    runs = {}
    for name, opts in {"exact": dict(page_score="exact"), "refine_all": dict(refine_pages=pages),
                       "quest": dict()}.items():
        cache = FlexiCache(model.config, FlexiCacheConfig(page_size=16, token_budget=96, **opts))
        seen = []
        real = cache.flexi_layers[1].groups[0].selector.select

        def spy(*a, _real=real, _seen=seen, **kw):
            out = _real(*a, **kw)
            _seen.append(out.sort(dim=-1).values.clone())
            return out

        cache.flexi_layers[1].groups[0].selector.select = spy
        model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
        runs[name] = seen
    assert len(runs["exact"]) == 5  # 6 new tokens: the first comes from the prefill
    for a, b in zip(runs["exact"], runs["refine_all"]):
        assert torch.equal(a, b)
    # ... and the Quest bound chooses differently on this data (the comparison can fail).
    assert any(not torch.equal(a, b) for a, b in zip(runs["exact"], runs["quest"]))


@pytest.mark.parametrize("padded", [False, True])
def test_attention_from_the_rankings_logits_equals_reading_the_keys(padded):
    """`sparse_decode_attention(..., logits=...)` (keys not read) gives what reading the keys gives, tail included."""
    n, g, d, pages, page_size = 4, 3, 8, 7, 4
    gen = torch.Generator().manual_seed(11)
    k_pool, v_pool = torch.randn(1 + n * pages, page_size, d, generator=gen), torch.randn(1 + n * pages, page_size, d, generator=gen)
    q = torch.randn(n, g, d, generator=gen)
    length, scaling = (pages - 1) * page_size + 2, d ** -0.5
    sel = torch.stack([torch.cat([torch.randperm(pages - 1, generator=gen)[:3], torch.tensor([pages - 1])]) for _ in range(n)])
    slots = 1 + torch.arange(n)[:, None] * pages + sel
    token_valid = None
    if padded:  # 2 sequences x 2 heads; the second sequence's first 9 positions are padding
        token_valid = torch.ones(2, length, dtype=torch.bool)
        token_valid[1, :9] = False
    keys = k_pool[slots.reshape(-1)].view(n, -1, d)
    logits = torch.matmul(q, keys.transpose(1, 2)) * scaling
    ok = torch_backend.token_mask(sel, page_size, length, token_valid, 2)
    logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
    means = torch.randn(n, pages - 1, 2 * d, generator=gen)
    tail = tail_terms(q, means, sel, pages - 1, page_size, scaling)
    for t in (None, tail):
        read = torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, token_valid, 2, tail=t)
        reused = torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, token_valid, 2,
                                                       tail=t, logits=logits)
        torch.testing.assert_close(reused, read, rtol=1e-6, atol=1e-6)
    wrong = torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, token_valid, 2,
                                                  logits=logits.roll(1, dims=-1))
    assert (wrong - read).abs().max() > 1e-3  # the logits are really what the output is made of
    with pytest.raises(ValueError, match="soft-capped"):
        torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, softcap=30.0, logits=logits)


@pytest.mark.parametrize("opts", [dict(), dict(promotion="deferred"), dict(tail_estimate=True)],
                         ids=["default", "deferred", "tail"])
def test_refined_ranking_steps_reuse_their_logits_and_match_reading_the_keys(opts):
    """A step that ranks with refinement attends from the ranking's logits (only the values are read); the logits
    of generate then equal those of the same cache with the re-use turned off. Deferred promotion attends to the
    previous selection at a stable head's re-rank: that step cannot re-use."""
    from conftest import tiny_model

    from fc_hf.profile import HeadProfile
    from fc_hf.selection import PageSelector

    model = tiny_model("llama", layers=2, heads=6, kv_heads=2)
    ids = torch.randint(1, 90, (2, 300), generator=torch.Generator().manual_seed(6))
    profile = HeadProfile.from_unstable(model.config, [(0, 1), (1, 0)])
    cfg = FlexiCacheConfig(page_size=8, token_budget=64, rerank_interval=4, **opts)
    taken = {"used": 0, "offered": 0}
    real = PageSelector.take_logits

    def counting(self, pages, **kw):
        out = real(self, pages, **kw)
        taken["offered"] += 1
        taken["used"] += out is not None
        return out

    def run(reuse):
        PageSelector.take_logits = counting if reuse else (lambda self, pages, **kw: (real(self, pages, **kw), None)[1])
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 past_key_values=FlexiCache(model.config, cfg, profile))
        finally:
            PageSelector.take_logits = real
        return torch.stack(out.logits)

    with torch.inference_mode():
        without = run(False)
        with_reuse = run(True)
    torch.testing.assert_close(with_reuse, without, rtol=1e-5, atol=1e-5)
    # 11 decode steps x 2 layers x 2 groups offered; unstable groups rank (and re-use) every step, stable ones at
    # steps 1, 4, 8 (deferred: at step 1 only, where there is nothing to promote yet).
    assert taken["offered"] == 11 * 2 * 2
    assert taken["used"] == 11 * 2 + 2 * (3 if opts.get("promotion") != "deferred" else 1)

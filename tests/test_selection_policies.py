"""Selection policies of `fc_hf.selection` against brute force: refinement over every page is the exact selection,
and a ranking's own logits are what its step's attention is made of."""

import pytest
import torch

from fc_hf import FlexiCache, FlexiCacheConfig
from fc_hf.kernels import torch_backend


def test_refine_with_every_page_as_candidate_is_the_exact_selection():
    """With every page a candidate, a ranking keeps the K pages of most true attention mass (softmax over every key,
    mean over the GQA group; the sink and the page being filled forced), computed here by brute force from the store's
    keys; the Quest bound alone chooses otherwise on the same data."""
    from conftest import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(1, 90, (1, 400), generator=torch.Generator().manual_seed(5))
    pages = 400 // 16 + 2
    k = 96 // 16
    differs = []
    for name, opts in {"refine_all": dict(refine_pages=pages), "quest": dict(refine_pages=0)}.items():
        cache = FlexiCache(model.config, FlexiCacheConfig(page_size=16, token_budget=96, **opts))
        seen = []
        selector = cache.flexi_layers[1].groups[0].selector
        real = selector.select

        def spy(scores, query, store, scaling, *a, _real=real, _seen=seen, **kw):
            out = _real(scores, query, store, scaling, *a, **kw)
            n, np_ = store.rows, store.num_pages
            keys = store.page_keys(torch.arange(np_).expand(n, np_)).reshape(n, np_ * 16, -1)
            logits = (query.float() @ keys.float().transpose(1, 2) * scaling)[..., : store.length]
            mass = torch.softmax(logits, -1)
            mass = torch.nn.functional.pad(mass, (0, np_ * 16 - store.length)).view(n, -1, np_, 16).sum(-1).mean(1)
            mass[:, 0] = mass[:, -1] = float("inf")
            _seen.append((out.sort(dim=-1).values, mass.topk(k, dim=-1).indices.sort(dim=-1).values))
            return out

        selector.select = spy
        model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
        assert len(seen) == 5  # 6 new tokens: the first comes from the prefill
        if name == "refine_all":
            assert all(torch.equal(got, want) for got, want in seen)
        else:  # ... and the Quest bound chooses differently on this data (the comparison can fail)
            differs = [not torch.equal(got, want) for got, want in seen]
    assert any(differs)


@pytest.mark.parametrize("padded", [False, True])
def test_attention_from_the_rankings_logits_equals_reading_the_keys(padded):
    """`sparse_decode_attention(..., logits=...)` (keys not read) gives what reading the keys gives."""
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
    read = torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, token_valid, 2)
    reused = torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, token_valid, 2,
                                                   logits=logits)
    torch.testing.assert_close(reused, read, rtol=1e-6, atol=1e-6)
    wrong = torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, token_valid, 2,
                                                  logits=logits.roll(1, dims=-1))
    assert (wrong - read).abs().max() > 1e-3  # the logits are really what the output is made of
    with pytest.raises(ValueError, match="soft-capped"):
        torch_backend.sparse_decode_attention(q, k_pool, v_pool, slots, sel, length, scaling, softcap=30.0, logits=logits)


@pytest.mark.parametrize("opts", [dict(), dict(promotion="deferred")], ids=["default", "deferred"])
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

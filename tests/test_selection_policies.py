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

    from fc_hf.selection import PageSelector

    model = tiny_model("llama")
    ids = torch.randint(1, 90, (1, 400), generator=torch.Generator().manual_seed(5))
    pages = 400 // 16 + 2
    k = 96 // 16
    differs = []
    for name, opts in {"refine_all": dict(refine_pages=pages), "quest": dict(refine_pages=0)}.items():
        cache = FlexiCache(model.config, FlexiCacheConfig(page_size=16, token_budget=96, **opts))
        seen = []
        real = PageSelector.rank

        def spy(self, query, rows, store, bias, scaling, minmax=None, _real=real, _seen=seen, **kw):
            out = _real(self, query, rows, store, bias, scaling, minmax, **kw)
            if store is cache.flexi_layers[1].store:
                length = int(store.length_t)
                n, np_ = rows.numel(), -(-length // 16)
                keys = store.full_k[rows, :length]
                mass = torch.softmax(query.float() @ keys.float().transpose(1, 2) * scaling, -1)
                mass = torch.nn.functional.pad(mass, (0, np_ * 16 - length)).view(n, -1, np_, 16).sum(-1).mean(1)
                mass[:, 0] = mass[:, -1] = float("inf")
                chosen = out.pages.sort(dim=-1).values
                _seen.append((chosen, mass.topk(k, dim=-1).indices.sort(dim=-1).values))
            return out

        PageSelector.rank = spy
        try:
            model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
        finally:
            PageSelector.rank = real
        assert len(seen) == 5  # 6 new tokens: the first comes from the prefill
        if name == "refine_all":
            assert all(torch.equal(got, want) for got, want in seen)
        else:  # ... and the Quest bound chooses differently on this data (the comparison can fail)
            differs = [not torch.equal(got, want) for got, want in seen]
    assert any(differs)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_from_the_rankings_logits_equals_reading_the_keys(masked):
    """`attention_from_logits` over a ranking's logits (keys not read again) gives what `attention` reading the keys
    gives, and the logits are really what the output is made of."""
    n, g, d, c, p = 4, 3, 8, 5, 4
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(n, g, d, generator=gen)
    keys, values = torch.randn(n, c * p, d, generator=gen), torch.randn(n, c * p, d, generator=gen)
    bias = torch.zeros(n, c * p)
    if masked:
        bias[1, :9] = float("-inf")  # padding
    logits = torch_backend.candidate_logits(q, keys, bias, d**-0.5, p)
    read = torch_backend.attention(q, keys, values, bias, d**-0.5)
    reused = torch_backend.attention_from_logits(logits.view(n, g, -1), values)
    torch.testing.assert_close(reused, read, rtol=1e-6, atol=1e-6)
    wrong = torch_backend.attention_from_logits(logits.view(n, g, -1).roll(1, dims=-1), values)
    assert (wrong - read).abs().max() > 1e-3


@pytest.mark.parametrize("opts", [dict(), dict(promotion="deferred")], ids=["default", "deferred"])
def test_refined_ranking_steps_reuse_their_logits_and_match_reading_the_keys(opts, monkeypatch):
    """The unstable rows attend from their ranking's logits (only the values are read); the logits of generate then
    equal those of the same cache reading the keys again."""
    from conftest import tiny_model

    import fc_hf.decode as decode
    from fc_hf.profile import HeadProfile

    model = tiny_model("llama", layers=2, heads=6, kv_heads=2)
    ids = torch.randint(1, 90, (2, 300), generator=torch.Generator().manual_seed(6))
    profile = HeadProfile.from_unstable(model.config, [(0, 1), (1, 0)])
    cfg = FlexiCacheConfig(page_size=8, token_budget=64, rerank_interval=4, **opts)
    used = []
    real = decode._attend_unstable

    def counting(layer, q, ranking, *a):
        used.append(ranking.logits is not None)
        return real(layer, q, ranking, *a)

    def reading(layer, q, ranking, *a):
        return real(layer, q, type(ranking)(ranking.pages), *a)  # the same pages, no logits: keys are read

    def run(attend):
        monkeypatch.setattr(decode, "_attend_unstable", attend)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             past_key_values=FlexiCache(model.config, cfg, profile))
        return torch.stack(out.logits)

    with torch.inference_mode():
        without = run(reading)
        with_reuse = run(counting)
    torch.testing.assert_close(with_reuse, without, rtol=1e-5, atol=1e-5)
    assert len(used) == 11 * 2 and all(used)  # 11 decode steps x 2 layers, each with unstable rows re-using


def test_candidate_logits_of_a_subset_of_pages_are_the_full_sets_numbers_bit_for_bit():
    """A verification block's later rounds compute only new candidates' logits and reuse the rest
    (`PageSelector._logits_again`), so a token's logit may not depend on the pages scored with it. One matrix product
    over all candidates rounds edge columns differently at some shapes (head_dim 16, pages of 4 on MKL);
    `candidate_logits` fixes each product's shape. Also: the numbers are the plain product's, to rounding."""
    gen = torch.Generator().manual_seed(4)
    for d, p, c in ((16, 4, 10), (16, 4, 40), (64, 16, 128), (32, 8, 21)):
        n, g = 9, 3
        q = torch.randn(n, g, d, generator=gen)
        keys = torch.randn(n, c, p, d, generator=gen)
        bias = torch.where(torch.rand(n, c * p, generator=gen) < 0.1, float("-inf"), 0.0)
        full = torch_backend.candidate_logits(q, keys.view(n, -1, d), bias, 0.3, p).view(n, g, c, p)
        plain = torch.baddbmm(bias[:, None, :], q, keys.view(n, -1, d).transpose(1, 2), alpha=0.3).view(n, g, c, p)
        torch.testing.assert_close(full, plain, rtol=1e-6, atol=1e-6)
        for m in (1, 3, c // 2 + 1):
            pick = torch.stack([torch.randperm(c, generator=gen)[:m] for _ in range(n)])
            sub_keys = keys.gather(1, pick[:, :, None, None].expand(-1, -1, p, d)).view(n, -1, d)
            sub_bias = bias.view(n, c, p).gather(1, pick[:, :, None].expand(-1, -1, p)).view(n, -1)
            sub = torch_backend.candidate_logits(q, sub_keys, sub_bias, 0.3, p).view(n, g, m, p)
            assert torch.equal(sub, full.gather(2, pick[:, None, :, None].expand(-1, g, -1, p)))

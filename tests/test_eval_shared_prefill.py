"""Shared prefill (one dense prefill, many methods) must give what each method's own generate gives."""

import pytest
import torch
from conftest import tiny_model

from fc_hf.compat import cache_kwargs
from fc_hf.config import FlexiCacheConfig
from fc_hf.eval import fidelity as F
from fc_hf.eval.methods import METHODS, make_cache, prepare_model
from fc_hf.eval.shared_prefill import dense_prefill, forced_decode, greedy_decode, load_prefill
from fc_hf.profile import HeadProfile

# Small pages and budget so that every sparse method really drops pages (prompt = 15 pages of 4).
BASE = FlexiCacheConfig(page_size=4)
BUDGET = 12


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model = tiny_model("llama", layers=2, heads=6, kv_heads=2)
    model.generation_config.eos_token_id = None  # compare fixed-length generations
    profile = HeadProfile.from_unstable(model.config, [(0, 1)])
    prompt = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, profile, prompt


def _cache(method, model, profile):
    return make_cache(method, model, BUDGET, profile, base=BASE)


def _generate(model, method, profile, prompt, n):
    """`model.generate` with a fresh cache of `method`: the reference the shared path must equal."""
    prepare_model(model, method)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             **cache_kwargs(model, _cache(method, model, profile)))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_after_shared_prefill_equals_generate(setup, method):
    model, profile, prompt = setup
    pre = dense_prefill(model, prompt)
    shared = greedy_decode(model, pre, method, _cache(method, model, profile), max_new_tokens=24)
    assert shared == _generate(model, method, profile, prompt, 24)


@pytest.mark.parametrize("method", ["dense", "flexicache", "no-rerank"])
def test_forced_after_shared_prefill_equals_own_prefill(setup, method):
    model, profile, prompt = setup
    forced = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    task = F.FidelityTask("t", "continue", prompt, forced + [5])
    prepare_model(model, method)
    own = torch.stack(list(F.forced_logprobs(model, task, _cache(method, model, profile))))
    pre = dense_prefill(model, prompt)
    shared = torch.stack(list(forced_decode(model, pre, method, _cache(method, model, profile), forced)))
    torch.testing.assert_close(shared, own, rtol=0, atol=1e-5)


def test_sparse_methods_really_differ_from_dense(setup):
    """Guards the equivalence tests: with this budget, a broken hand-over that fell back to dense would show."""
    model, profile, prompt = setup
    pre = dense_prefill(model, prompt)
    forced = torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    dense = torch.stack(list(forced_decode(model, pre, "dense", None, forced)))
    sparse = torch.stack(list(forced_decode(model, pre, "no-rerank", _cache("no-rerank", model, profile), forced)))
    assert (dense - sparse).abs().max() > 1e-3


def test_one_prefill_serves_many_caches_unchanged(setup):
    model, profile, prompt = setup
    pre = dense_prefill(model, prompt)
    before = [(k.clone(), v.clone()) for k, v in pre.kv]
    for method in METHODS:
        greedy_decode(model, pre, method, _cache(method, model, profile), max_new_tokens=3)
    for (k0, v0), (k1, v1) in zip(before, pre.kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert pre.length == len(prompt)


def test_load_prefill_refuses_a_used_cache(setup):
    model, profile, prompt = setup
    pre = dense_prefill(model, prompt)
    cache = load_prefill(pre, _cache("quest", model, profile), model)
    with pytest.raises(ValueError, match="empty cache"):
        load_prefill(pre, cache, model)


@pytest.mark.parametrize("method", ["dense", "quest", "flexicache"])
def test_sliding_window_models_fall_back_to_their_own_prefill(method):
    """Gemma3's local layers keep only a window: nothing is shared, each method prefills itself, same tokens."""
    model = tiny_model("gemma3")
    model.generation_config.eos_token_id = None
    profile = HeadProfile.from_unstable(model.config, [(5, 0)])
    prompt = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    pre = dense_prefill(model, prompt)
    assert pre.kv is None and pre.length == 60
    shared = greedy_decode(model, pre, method, _cache(method, model, profile), max_new_tokens=12)
    assert shared == _generate(model, method, profile, prompt, 12)

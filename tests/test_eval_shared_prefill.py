"""Shared prefill (one dense prefill, many methods) must give what each method's own generate gives."""

import pytest
import torch
from conftest import tiny_model

from fc_hf.compat import cache_kwargs
from fc_hf.config import FlexiCacheConfig
from fc_hf.eval import fidelity as F
from fc_hf.eval.methods import METHODS, make_cache, prepare_model
from fc_hf.eval.shared_prefill import (
    PrefixReuse, common_prefix_length, dense_prefill, extend_prefill, forced_decode, greedy_decode, load_prefill,
)
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


@pytest.mark.parametrize("options", [dict(warmup_steps=0), dict(warmup_steps=8, rerank_interval=4)],
                         ids=["observe-prefill", "warmup-8"])
def test_auto_through_its_classification_after_shared_prefill_equals_generate(setup, options):
    """profile="auto" past its classification: from the prompt's queries (warmup 0, which needs the cache's own
    prefill forward) or after 8 decode steps; the shared path must still give generate's tokens."""
    model, _, prompt = setup
    base = FlexiCacheConfig(page_size=4, **options)
    pre = dense_prefill(model, prompt)
    cache = make_cache("auto", model, BUDGET, base=base)
    shared = greedy_decode(model, pre, "auto", cache, max_new_tokens=24)
    assert cache.profile_found() is not None  # classified within the 24 steps
    prepare_model(model, "auto")
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             **cache_kwargs(model, make_cache("auto", model, BUDGET, base=base)))
    assert shared == out[0, len(prompt):].tolist()


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


def _questions_on_one_document(doc_len=60, question_lens=(5, 9, 7)):
    """Prompts that share a document and end in different questions (as L-Eval's do)."""
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(3, 97, (doc_len,), generator=g).tolist()
    return doc, [doc + torch.randint(3, 97, (n,), generator=g).tolist() for n in question_lens]


@pytest.mark.parametrize("method", ["dense", "quest", "flexicache", "no-rerank"])
def test_prefix_reuse_runs_only_each_question_and_gives_what_generate_gives(setup, method):
    model, profile, _ = setup
    doc, prompts = _questions_on_one_document()
    reuse = PrefixReuse(model, min_shared=16)
    ran = []
    for prompt in prompts:
        hook = model.register_forward_pre_hook(lambda m, a, kw: ran.append(kw["input_ids"].shape[1]), with_kwargs=True)
        try:
            pre = reuse(prompt)
        finally:
            hook.remove()
        assert pre.prompt_ids == prompt
        assert greedy_decode(model, pre, method, _cache(method, model, profile), 16) == _generate(
            model, method, profile, prompt, 16)
    shared = [common_prefix_length(a, b) for a, b in zip(prompts, prompts[1:])]
    assert all(s >= len(doc) for s in shared)
    assert ran == [len(prompts[0])] + [len(p) - s for p, s in zip(prompts[1:], shared)]  # the document ran once
    assert reuse.reused == sum(shared) and reuse.prefilled == sum(ran)


def test_extend_prefill_edges(setup):
    model, _, _ = setup
    doc, (a, b, _) = _questions_on_one_document()
    pre = dense_prefill(model, a)
    assert extend_prefill(model, pre, a) is pre
    with pytest.raises(ValueError, match="does not start"):
        extend_prefill(model, pre, b)  # b shares the document only, not all of a
    with pytest.raises(ValueError, match="last logits"):
        extend_prefill(model, pre, doc, reuse=len(doc))
    ext = extend_prefill(model, pre, b, reuse=len(doc))
    assert torch.equal(ext.kv[0][0][:, :, : len(doc)], pre.kv[0][0][:, :, : len(doc)])
    torch.testing.assert_close(ext.logits, dense_prefill(model, b).logits, rtol=0, atol=1e-5)
    # Short shared parts (under min_shared) are not worth a second cache: a full prefill instead.
    reuse = PrefixReuse(model, min_shared=len(doc) + 50)
    reuse(a), reuse(b)
    assert reuse.reused == 0 and reuse.prefilled == len(a) + len(b)

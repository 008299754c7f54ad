"""The evaluated methods are configurations of one code path; check each one's configuration and
that each builds a cache that reproduces dense attention when the budget covers the whole sequence."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fc_hf.compat import cache_kwargs
from fc_hf.config import FlexiCacheConfig
from fc_hf.eval import methods as M
from fc_hf.profile import HeadProfile


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def test_method_configs(tiny):
    cfg = tiny.config
    assert M.method_config("dense", 1024, cfg) is None
    fc = M.method_config("flexicache", 2048, cfg)
    assert (fc.token_budget, fc.rerank_interval, fc.offload, fc.streaming_heads) == (2048, 8, True, ())
    assert M.method_config("quest", 1024, cfg).offload is False
    assert M.method_config("no-rerank", 1024, cfg).rerank_interval == M.NO_RERANK_INTERVAL
    assert M.method_config("uniform", 1024, cfg).rerank_interval == 8
    ls = M.method_config("lserve", 1024, cfg)
    assert ls.rerank_interval == 4 and ls.streaming_heads == ((0, 0), (1, 0))
    base = FlexiCacheConfig(page_size=8, backend="torch")
    assert M.method_config("uniform", 64, cfg, base=base).page_size == 8
    with pytest.raises(ValueError, match="Unknown method"):
        M.method_config("snapkv", 1024, cfg)
    with pytest.raises(ValueError, match="lserve"):
        M.method_config("lserve", 1024, None)


def test_quest_keeps_the_selection_fields_a_caller_sets(tiny):
    cfg = tiny.config
    q = M.method_config("quest", 1024, cfg)
    assert (q.refine_pages, q.score_subpages, q.subpages, q.candidate_pages) == (0, 1, 1, 0)  # the authors' Quest
    # --cache-options score_subpages=2 names the run and is recorded: quest must run with it, not with 1.
    q2 = M.method_config("quest", 1024, cfg, base=FlexiCacheConfig(score_subpages=2))
    assert (q2.score_subpages, q2.refine_pages, q2.offload) == (2, 0, False)
    q3 = M.method_config("quest", 1024, cfg, base=FlexiCacheConfig(refine_pages=96, score_subpages=1))
    assert (q3.refine_pages, q3.score_subpages) == (96, 1)
    assert M.make_cache("quest", tiny, 64, base=FlexiCacheConfig(score_subpages=2)).cache_config.subpages == 2


def test_resolved_config_compares_behaviour():
    default = FlexiCacheConfig()
    assert FlexiCacheConfig(score_subpages=2) != default  # as dataclasses
    assert M.resolved_config(FlexiCacheConfig(score_subpages=2, refine_pages=128)) == M.resolved_config(default)
    assert M.resolved_config(FlexiCacheConfig(score_subpages=1)) != M.resolved_config(default)
    assert M.resolved_config(FlexiCacheConfig(refine_pages=0)) != M.resolved_config(default)
    assert M.resolved_config(M.method_config("quest", 1024, base=FlexiCacheConfig(refine_pages=0, score_subpages=1))) == \
        M.resolved_config(M.method_config("quest", 1024))
    assert M.resolved_config(None) is None


def test_streaming_half_is_half_of_all_heads():
    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    pairs = M.streaming_half(cfg)
    assert len(pairs) == 45 and len(set(pairs)) == 45
    assert {l for l, _ in pairs} == set(range(30))  # every layer keeps some streaming heads


def test_method_profiles(tiny):
    cfg = tiny.config
    given = HeadProfile.from_unstable(cfg, [(1, 1)])
    assert M.method_profile("flexicache", cfg, given) is given
    assert M.method_profile("quest", cfg, given) is None
    assert M.method_profile("dense", cfg, given) is None
    for m in ("no-rerank", "uniform", "lserve"):
        assert M.method_profile(m, cfg, given).unstable == set()
    with pytest.raises(ValueError, match="needs a head profile"):
        M.method_profile("flexicache", cfg, None)


def test_attn_implementation_and_cache_kwarg(tiny):
    assert M.attn_implementation("dense") == "sdpa"
    assert M.attn_implementation("quest") == "flexicache"
    assert cache_kwargs(tiny, None) == {}
    (key,) = cache_kwargs(tiny, object())
    assert key in ("cache", "past_key_values")


@pytest.mark.parametrize("method", [m for m in M.METHODS if m != "dense"])
def test_every_method_equals_dense_when_budget_covers_everything(tiny, method):
    """With more budget than tokens every page is selected, so each method must match dense."""
    from fc_hf.eval.fidelity import FidelityTask, compare_steps, forced_logprobs

    ids = torch.randint(0, 61, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    task = FidelityTask("t", "continue", ids[:50], ids[50:])
    M.prepare_model(tiny, "dense")
    dense = torch.stack(list(forced_logprobs(tiny, task)))
    M.prepare_model(tiny, method)
    profile = HeadProfile.from_unstable(tiny.config, [(0, 1)])
    cache = M.make_cache(method, tiny, 128, profile)
    assert cache is not None and type(cache).__name__ == "FlexiCache"
    steps = compare_steps(dense, forced_logprobs(tiny, task, cache), task.target_ids[1:])
    M.prepare_model(tiny, "dense")
    assert sum(steps["agree"]) == len(steps["agree"]) == 19
    assert max(steps["kl"]) < 1e-5


def test_make_cache_dense_is_none(tiny):
    assert M.make_cache("dense", tiny, 1024, None) is None

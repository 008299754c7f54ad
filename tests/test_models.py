"""More model families: those whose attention goes through ALL_ATTENTION_FUNCTIONS work; the rest refuse clearly.

Llama, Qwen2, Mistral, Gemma3 and Phi3 are in test_core_equivalence.py. Here: families with an
unusual attention (Granite's own `attention_multiplier` scaling, OLMo2's q/k norms over all heads,
StableLM's partial rotary, Cohere's parallel block, Qwen3's per-head q/k norms, GPT-NeoX / GPT-2
without GQA), each equal to dense at a full budget and consistent with its own single-tier run at a
low budget; then architectures FlexiCache cannot serve, each with a clear error.
"""

import pytest
import torch
import transformers
from conftest import left_padded_batch
from robustness_helpers import forced_decode
from transformers import AutoModelForCausalLM, DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile, ProfileError, register

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, pad_token_id=0)
GQA = dict(num_key_value_heads=2)
FAMILIES = {
    "granite": ("GraniteConfig", dict(attention_multiplier=0.3, **GQA)),
    "olmo2": ("Olmo2Config", GQA),
    "stablelm": ("StableLmConfig", dict(partial_rotary_factor=0.5, **GQA)),
    "cohere": ("CohereConfig", GQA),
    "qwen3": ("Qwen3Config", dict(head_dim=16, **GQA)),
    "starcoder2": ("Starcoder2Config", GQA),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "gpt2": ("GPT2Config", {}),
}


# One torch thread comes from conftest.py; every test here runs without autograd.
pytestmark = pytest.mark.usefixtures("no_grad")


def _model(family, impl):
    name, extra = FAMILIES[family]
    register()
    torch.manual_seed(0)
    config = getattr(transformers, name)(**COMMON, **extra)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(impl)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_budget_equals_dense(family):
    model = _model(family, "sdpa")
    ids, mask = left_padded_batch(2, 29, pad_lengths=[0, 6])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **kw)
    model.set_attn_implementation("flexicache")
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=64), profile)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    assert cache.stats()["decode_steps"] == 7 and cache.stats()["reranks_stable"] > 0


@pytest.mark.parametrize("family", ["granite", "stablelm", "gpt_neox"])
def test_low_budget_tiered_equals_single_tier(family):
    """At a budget that drops pages, tiers on/off give bit-identical logits (scaling/rotary quirks included)."""
    model = _model(family, "flexicache")
    ids, mask = left_padded_batch(2, 41, pad_lengths=[0, 8])
    forced = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])
    runs = [forced_decode(model, FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16,
                                                                          rerank_interval=4, offload=off), profile),
                          ids, mask, forced) for off in (True, False)]
    assert torch.equal(runs[0], runs[1])
    dense = forced_decode(model, DynamicCache(config=model.config), ids, mask, forced)
    assert (runs[0] - dense).abs().max() > 1e-4  # the budget really dropped tokens


def test_cache_built_for_another_head_count_refuses_before_writing():
    """A config whose num_key_value_heads does not match the attention (here GPT-NeoX, which has no GQA)
    would mis-group heads silently; the first update must refuse with nothing written."""
    register()
    torch.manual_seed(0)
    honest = transformers.GPTNeoXConfig(**COMMON)
    model = AutoModelForCausalLM.from_config(honest).eval()
    model.set_attn_implementation("flexicache")
    lying = transformers.GPTNeoXConfig(**COMMON, num_key_value_heads=2)
    cache = FlexiCache(lying, FlexiCacheConfig(page_size=4, token_budget=64))
    ids, mask = left_padded_batch(1, 20)
    with pytest.raises(FlexiCacheError, match="built for 2 KV heads.*produced 4"):
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0


# transformers 5.25 moved Falcon's attention onto `ALL_ATTENTION_FUNCTIONS` with its KV heads in the config; before, its
# multi-query attention was not described by num_key_value_heads and its new decoder called sdpa itself.
FALCON_THROUGH_ATTENTION_FUNCTIONS = not hasattr(transformers.models.falcon.modeling_falcon.FalconAttention,
                                                 "_split_heads")


@pytest.mark.parametrize("new_decoder", [False, True], ids=["multi-query", "new-decoder"])
def test_falcon_is_served_exactly_or_refused_loudly(new_decoder):
    """Where Falcon's attention goes through the registered attention function (5.25+), FlexiCache at a full budget
    gives dense's tokens; before, the first update (multi-query: "KV heads") or the decode placeholder (new decoder,
    which called sdpa itself) refused instead of attending over a stand-in."""
    register()
    torch.manual_seed(0)
    extra = dict(new_decoder_architecture=True, num_kv_heads=2) if new_decoder else {}
    model = AutoModelForCausalLM.from_config(transformers.FalconConfig(**COMMON, **extra)).eval()
    ids, mask = left_padded_batch(1, 20)
    with torch.no_grad():
        dense = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    model.set_attn_implementation("flexicache")
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=64))
    run = lambda: model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,  # noqa: E731
                                 max_new_tokens=3, do_sample=False)
    if FALCON_THROUGH_ATTENTION_FUNCTIONS:
        with torch.no_grad():
            assert torch.equal(run(), dense)
        return
    needle = "attention function other than FlexiCache's" if new_decoder else "KV heads"
    with pytest.raises(FlexiCacheError, match=needle):
        run()


@pytest.mark.parametrize(
    "name,error,needle",
    [
        ("MambaConfig", ProfileError, "needs a decoder with attention layers"),
        ("RwkvConfig", ProfileError, "needs a decoder with attention layers"),
        ("Qwen3NextConfig", FlexiCacheError, "'linear_attention'.*Use DynamicCache"),
        ("JambaConfig", FlexiCacheError, "'linear_attention'.*Use DynamicCache"),
        ("FalconH1Config", FlexiCacheError, "'hybrid'.*Use DynamicCache"),
        ("T5Config", FlexiCacheError, "encoder-decoder"),
        ("BartConfig", FlexiCacheError, "encoder-decoder"),
        ("WhisperConfig", FlexiCacheError, "encoder-decoder"),
    ],
)
def test_architectures_that_cannot_work_refused_at_construction(name, error, needle):
    with pytest.raises(error, match=needle):
        FlexiCache(getattr(transformers, name)(), FlexiCacheConfig())


def test_softcapped_attention_matches_eager():
    """Gemma2 passes `softcap`: dense prefill and sparse decode both apply it (sdpa cannot), so at a
    full budget FlexiCache equals transformers' eager attention."""
    register()
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=5.0,
                                       sliding_window=8, query_pre_attn_scalar=16)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = left_padded_batch(2, 20, pad_lengths=[0, 4])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=config), **kw)
        model.set_attn_implementation("flexicache")
        cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=64))
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert cache.stats()["decode_steps"] == 7


@pytest.mark.parametrize(
    "name,extra,kinds",
    [
        ("MistralConfig", dict(sliding_window=8), ["DynamicSlidingWindowLayer"] * 2),
        ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
         ["FlexiCacheLayer", "DynamicSlidingWindowLayer"]),
    ],
    ids=["mistral-sliding", "qwen2-sliding-hybrid"],
)
def test_sliding_window_variants_equal_dense(name, extra, kinds):
    """Sliding layers stay standard sliding layers; prompts longer than the window, decode past it."""
    register()
    torch.manual_seed(0)
    config = getattr(transformers, name)(**COMMON, **GQA, **extra)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("sdpa")
    ids, mask = left_padded_batch(2, 29, pad_lengths=[0, 6])
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **kw)
    model.set_attn_implementation("flexicache")
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=64))
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert [type(l).__name__ for l in cache.layers] == kinds
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)

"""Bad input gets a clear error that says what to do, and no state is lost."""

import json

import pytest
import torch
from conftest import left_padded_batch, tiny_config, tiny_model
from transformers import DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile, ProfileError


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(token_budget=100, page_size=16), "multiple of page_size"),
        (dict(token_budget=16, page_size=16), "at least 2 pages"),
        (dict(page_size=0), "page_size must be a positive integer"),
        (dict(page_size=-4), "page_size must be a positive integer"),
        (dict(rerank_interval=0), "rerank_interval must be a positive integer"),
        (dict(unstable_fraction=1.5), "unstable_fraction must lie in [0, 1]"),
        (dict(unstable_fraction=-0.1), "unstable_fraction must lie in [0, 1]"),
        (dict(promotion="later"), "promotion must be one of"),
        (dict(max_device_pages=0), "max_device_pages must be a positive integer"),
    ],
)
def test_config_validation(kwargs, needle):
    with pytest.raises(ValueError) as err:
        FlexiCacheConfig(**kwargs)
    assert needle in str(err.value)


def test_profile_shape_mismatch():
    config = tiny_config("llama", layers=2)
    other = HeadProfile(num_layers=3, num_kv_heads=2, unstable=set(), head_dim=16, model_id="other-model")
    with pytest.raises(ProfileError, match="other-model.*layers, kv_heads, head_dim"):
        FlexiCache(config, FlexiCacheConfig(), other)
    with pytest.raises(ProfileError, match="outside the model"):
        HeadProfile(num_layers=2, num_kv_heads=2, unstable={(5, 0)})


def test_profile_files(tmp_path):
    config = tiny_config("llama", layers=2)
    prof = HeadProfile.from_unstable(config, [(1, 1)], extra={"tasks": ["a"]})
    path = prof.save(tmp_path / "p.json")
    back = HeadProfile.load(path, config)
    assert back.unstable == {(1, 1)} and back.extra["tasks"] == ["a"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        HeadProfile.load(tmp_path / "bad.json")
    raw = json.loads(path.read_text())
    raw["schema_version"] = 99
    (tmp_path / "v99.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="schema_version=99"):
        HeadProfile.load(tmp_path / "v99.json")
    del raw["unstable"]
    raw["schema_version"] = 1
    (tmp_path / "missing.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="missing or has a malformed field"):
        HeadProfile.load(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="No head profile"):
        HeadProfile.load(tmp_path / "nope.json")


def test_model_without_flexicache_attention_raises(no_grad):
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16))
    with pytest.raises(FlexiCacheError, match="attn_implementation is 'sdpa'.*attn_implementation='flexicache'"):
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)


def test_eager_attention_also_refused(no_grad):
    model = tiny_model("llama", layers=1)
    model.set_attn_implementation("eager")
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16))
    with pytest.raises(FlexiCacheError, match="attn_implementation is 'eager'.*attn_implementation='flexicache'"):
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)


def test_attention_that_ignores_the_cache_output_is_refused_naming_it(no_grad):
    """An attention function that never touches the decode placeholder: the next update refuses, naming it."""
    from transformers import AttentionInterface

    def ignores_kv(module, query, key, value, attention_mask, **kwargs):
        return torch.zeros_like(query).transpose(1, 2), None

    AttentionInterface.register("fc_test_ignores_kv", ignores_kv)
    model = tiny_model("llama", layers=2)
    model.set_attn_implementation("fc_test_ignores_kv")
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16))
    ids = torch.randint(1, 97, (1, 12))
    model(input_ids=ids, past_key_values=cache, use_cache=True)  # prefill: dense K/V, no placeholder
    model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)  # placeholders handed out, never read
    with pytest.raises(FlexiCacheError, match="attn_implementation is 'fc_test_ignores_kv'"):
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


def test_config_without_attention_layers():
    from transformers import MambaConfig

    with pytest.raises(ValueError, match="FlexiCache needs a decoder with attention layers"):
        FlexiCache(MambaConfig(num_hidden_layers=2), FlexiCacheConfig())


def test_dtype_change_mid_generation(no_grad):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16))
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    length = cache.get_seq_length()
    model.to(torch.bfloat16)
    with pytest.raises(FlexiCacheError, match="dtype/device changed mid-generation"):
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)
    assert cache.get_seq_length() == length


def test_max_device_pages_refuses_before_writing(no_grad):
    model = tiny_model("llama", layers=2)
    ids, mask = left_padded_batch(2, 40)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16, max_device_pages=50))
    with pytest.raises(FlexiCacheError, match="max_device_pages=50.*still empty"):
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0 and all(l.length == 0 for l in cache.flexi_layers)
    ok = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16, max_device_pages=400))
    model(input_ids=ids, attention_mask=mask, past_key_values=ok)
    assert ok.get_seq_length() == 40


def test_assisted_decoding_of_two_sequences_refused_clearly(no_grad):
    """transformers' assisted loop is batch 1 only; FlexiCache says so first, before anything is written."""
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=1)
    ids, mask = left_padded_batch(2, 20)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16))
    assert cache.is_croppable
    with pytest.raises(FlexiCacheError, match="one sequence at a time"):
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, assistant_model=assistant,
                       max_new_tokens=5, do_sample=False)
    assert cache.get_seq_length() == 0


def test_bad_streaming_head_indices():
    config = tiny_config("llama", layers=2)
    with pytest.raises(ValueError, match="streaming head"):
        FlexiCache(config, FlexiCacheConfig(streaming_heads=((0, 9),)))


def test_release_frees_tensors(no_grad):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16))
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.memory_report()["device_kv_bytes"] > 0
    cache.release()
    assert cache.memory_report()["device_kv_bytes"] == 0


def test_dynamic_cache_unaffected_by_register(no_grad):
    """register() adds a name; sdpa models with DynamicCache are untouched."""
    from transformers import AutoModelForCausalLM

    from fc_hf import register

    register()
    register()  # idempotent
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    ids, mask = left_padded_batch(1, 12)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), max_new_tokens=3)
    assert out.shape == (1, 15)

"""`flexicache_pipeline`: a stock text-generation pipeline with a FlexiCache of its own, emptied for every call."""

import re
from pathlib import Path

import pytest
from conftest import tiny_model
from robustness_helpers import tiny_tokenizer, words
from transformers import pipeline

from fc_hf import FlexiCacheConfig, HeadProfile, ProfileError
from fc_hf.pipeline import FlexiCacheTextGenerationPipeline, flexicache_pipeline, register_pipeline

DOC = Path(__file__).resolve().parent.parent / "docs" / "robustness.md"
FULL = FlexiCacheConfig(page_size=4, token_budget=128)
LOW = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=4)
PROMPTS = [words(range(10, 50)), words(range(60, 71))]  # 40 and 11 tokens
GEN = dict(max_new_tokens=9, do_sample=False, return_tensors=True)


@pytest.fixture
def model_dir(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _dense_pipe():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    return pipeline("text-generation", model=model, tokenizer=tiny_tokenizer())


def _ids(out):
    return [o[0]["generated_token_ids"] if isinstance(o, list) else o["generated_token_ids"] for o in out]


def test_two_consecutive_calls_match_dense(model_dir):
    pipe = flexicache_pipeline(str(model_dir), cache_config=FULL)
    assert isinstance(pipe, FlexiCacheTextGenerationPipeline)
    assert pipe.model.config._attn_implementation == "flexicache"
    dense = _dense_pipe()
    for prompt in PROMPTS:  # a cache handed over filled would raise on the second call
        got = pipe(prompt, **GEN)
        assert _ids(got) == _ids(dense(prompt, **GEN))
        assert pipe.last_stats["decode_steps"] == GEN["max_new_tokens"] - 1
        assert pipe.last_memory_report["dense_kv_bytes"] > 0


def test_batched_call_with_left_padding_matches_dense(model_dir):
    pipe = flexicache_pipeline(model_dir, cache_config=FULL)
    got = pipe(PROMPTS, batch_size=2, **GEN)
    assert _ids(got) == _ids(_dense_pipe()(PROMPTS, batch_size=2, **GEN))
    assert pipe.last_stats["decode_steps"] == GEN["max_new_tokens"] - 1


def test_low_budget_with_profile_file_runs_tiered(model_dir, tmp_path):
    model = tiny_model("llama")
    path = HeadProfile.from_unstable(model.config, [(0, 0)]).save(tmp_path / "profile.json")
    pipe = flexicache_pipeline(model, tokenizer=tiny_tokenizer(), cache_config=LOW, profile=str(path))
    out = pipe(PROMPTS[0], max_new_tokens=20, do_sample=False)
    assert out[0]["generated_text"].startswith(PROMPTS[0])
    st = pipe.last_stats
    assert st["decode_steps"] == 19 and st["reranks_stable"] > 0 and st["pages_offloaded"] > 0
    assert pipe.last_memory_report["host_kv_bytes"] > 0


def test_loaded_model_is_switched_to_flexicache():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    pipe = flexicache_pipeline(model, tokenizer=tiny_tokenizer(), cache_config=FULL)
    assert pipe.model.config._attn_implementation == "flexicache"
    assert _ids(pipe(PROMPTS[1], **GEN)) == _ids(_dense_pipe()(PROMPTS[1], **GEN))


def test_registered_task():
    task = register_pipeline()
    assert register_pipeline() == task == "flexicache-text-generation"
    pipe = pipeline(task, model=tiny_model("llama"), tokenizer=tiny_tokenizer(), cache_config=FULL)
    assert isinstance(pipe, FlexiCacheTextGenerationPipeline)
    assert _ids(pipe(PROMPTS[0], **GEN)) == _ids(_dense_pipe()(PROMPTS[0], **GEN))


def test_bad_pipeline_input():
    model = tiny_model("llama")
    pipe = flexicache_pipeline(model, tokenizer=tiny_tokenizer(), cache_config=FULL)
    with pytest.raises(ValueError, match="FlexiCache of its own, emptied for every call"):
        pipe(PROMPTS[0], past_key_values=object(), max_new_tokens=2)
    wrong = HeadProfile(num_layers=5, num_kv_heads=2, unstable=set(), head_dim=16)
    with pytest.raises(ProfileError, match="layers, kv_heads, head_dim"):
        flexicache_pipeline(model, tokenizer=tiny_tokenizer(), profile=wrong)
    with pytest.raises(TypeError, match="FlexiCacheConfig"):
        flexicache_pipeline(model, tokenizer=tiny_tokenizer(), cache_config={"token_budget": 64})
    sdpa = tiny_model("llama")
    sdpa.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="needs 'flexicache'"):
        pipeline(register_pipeline(), model=sdpa, tokenizer=tiny_tokenizer())


def test_documented_example_runs(model_dir):
    """The pipeline example of docs/robustness.md, with the model path pointed at a tiny local model."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    example = next(b for b in blocks if "flexicache_pipeline" in b)
    example = re.sub(r'^model_path = .*$', f'model_path = "{model_dir}"', example, count=1, flags=re.M)
    example = example.replace("PROMPT", repr(PROMPTS[0]))
    scope = {}
    exec(compile(example, str(DOC), "exec"), scope)
    assert scope["pipe"].last_stats["decode_steps"] > 0


def test_the_pipeline_keeps_its_cache_and_empties_it_for_every_call(model_dir):
    """One cache for every call, reset rather than rebuilt: the same tensors (a compiled step is replayed, not compiled
    again) while a call fits, the call's own stats and peak, dense's tokens; a new one after `release()`."""
    pipe = flexicache_pipeline(str(model_dir), cache_config=FULL)
    dense = _dense_pipe()
    assert _ids(pipe(PROMPTS[0], **GEN)) == _ids(dense(PROMPTS[0], **GEN))
    cache, keys = pipe.cache, pipe.cache.layers[0].store.full_k
    first_peak = pipe.last_memory_report["peak_device_kv_bytes"]
    assert _ids(pipe(PROMPTS[1], **GEN)) == _ids(dense(PROMPTS[1], **GEN))  # shorter: it fits
    assert pipe.cache is cache and pipe.cache.layers[0].store.full_k is keys
    assert pipe.last_stats["decode_steps"] == GEN["max_new_tokens"] - 1
    assert pipe.last_memory_report["peak_device_kv_bytes"] == first_peak  # the same tensors, nothing more
    cache.release()
    assert _ids(pipe(PROMPTS[1], **GEN)) == _ids(dense(PROMPTS[1], **GEN))
    assert pipe.cache is not cache
    auto = flexicache_pipeline(str(model_dir), cache_config=LOW, profile="auto")
    auto(PROMPTS[0], max_new_tokens=4, do_sample=False)
    held = auto.cache
    auto(PROMPTS[0], max_new_tokens=4, do_sample=False)
    assert auto.cache is not held  # "auto" classifies in every call, on a cache of its own

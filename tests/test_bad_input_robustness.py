"""More bad input (beyond test_bad_input.py): each gets a clear error, and the cache keeps what it had."""

import json

import pytest
import torch
from conftest import left_padded_batch, tiny_config, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile, ProfileError

LOW = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=4)


# One torch thread comes from conftest.py; every test here runs without autograd.
pytestmark = pytest.mark.usefixtures("no_grad")


def _prefilled(batch=2, length=21):
    model = tiny_model("llama")
    cache = FlexiCache(model.config, LOW, HeadProfile.from_unstable(model.config, [(0, 0)]))
    ids, mask = left_padded_batch(batch, length, pad_lengths=[0, 3][:batch])
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    return model, cache


def _snapshot(cache):
    return [(l.length, *(t.clone() for t in l.dense_kv())) for l in cache.flexi_layers]


def _unchanged(cache, snap):
    for layer, (length, k, v) in zip(cache.flexi_layers, snap):
        assert layer.length == length and not layer.pending
        k2, v2 = layer.dense_kv()
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_device_change_mid_generation():
    """Keys arriving on another device than the layer's tiers (here 'meta') are refused before any write."""
    model, cache = _prefilled()
    snap = _snapshot(cache)
    k = torch.empty(2, 2, 1, 16, device="meta")
    with pytest.raises(FlexiCacheError, match="holds torch.float32 on cpu but got torch.float32 on meta"):
        cache.update(k, k, 0)
    _unchanged(cache, snap)


def test_batch_size_change_mid_generation():
    model, cache = _prefilled(batch=2)
    snap = _snapshot(cache)
    with pytest.raises(FlexiCacheError, match="holds batch 2 but got 3 sequences"):
        model(input_ids=torch.randint(1, 97, (3, 1)), past_key_values=cache)
    _unchanged(cache, snap)
    # the cache still works for the right batch afterwards
    out = model(input_ids=torch.randint(1, 97, (2, 1)), attention_mask=torch.ones(2, 22, dtype=torch.long),
                past_key_values=cache)
    assert torch.isfinite(out.logits).all() and cache.get_seq_length() == 22


def test_use_after_release_is_clear():
    model, cache = _prefilled()
    cache.release()
    with pytest.raises(FlexiCacheError, match="released"):
        model(input_ids=torch.randint(1, 97, (2, 1)), past_key_values=cache)


def test_cache_built_from_another_models_config():
    """A cache made for a 2-layer model used on a 3-layer one with other head counts: refused, not mis-grouped."""
    model = tiny_model("llama", layers=2, heads=8, kv_heads=4)
    cache = FlexiCache(tiny_config("llama", layers=2, heads=6, kv_heads=2), LOW)
    ids, mask = left_padded_batch(1, 20)
    with pytest.raises(FlexiCacheError, match="built for 2 KV heads.*produced 4"):
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(token_budget=64.0), "token_budget must be a positive integer"),
        (dict(page_size=True), "page_size must be a positive integer"),
        (dict(page_size="16"), "page_size must be a positive integer"),
        (dict(rerank_interval=-3), "rerank_interval must be a positive integer"),
        (dict(carry_pages=-1), "carry_pages must be None (K // 8), 0 (off) or a positive number of pages, got -1"),
        (dict(refine_pages=3, token_budget=64, page_size=16), r"refine_pages must be None (2 \* K), 0 (off) or >= 4"),
        (dict(token_budget=10, page_size=4), "try token_budget=8"),
        (dict(backend="cuda"), "backend must be None, 'torch', 'triton' or 'native'"),
        (dict(streaming_heads=((0, 0),), streaming_sink_pages=4, token_budget=64, page_size=16), "streaming_sink_pages"),
    ],
)
def test_more_config_nonsense(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        FlexiCacheConfig(**kwargs)


def _good_profile(tmp_path):
    config = tiny_config("llama", layers=2)
    path = HeadProfile.from_unstable(config, [(1, 1)]).save(tmp_path / "good.json")
    return config, json.loads(path.read_text())


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda raw: b"\x89PNG\x00\xff garbage", "not valid JSON"),
        (lambda raw: "", "not valid JSON"),
        (lambda raw: json.dumps(raw)[: len(json.dumps(raw)) // 2], "not valid JSON"),
        (lambda raw: json.dumps([raw]), "must hold a JSON object"),
        (lambda raw: json.dumps({**raw, "unstable": [[0]]}), "malformed field"),
        (lambda raw: json.dumps({**raw, "unstable": [[0, 1, 2]]}), "malformed field"),
        (lambda raw: json.dumps({**raw, "unstable": [["a", 0]]}), "malformed field"),
        (lambda raw: json.dumps({**raw, "unstable": "0,1"}), "malformed field"),
        (lambda raw: json.dumps({**raw, "unstable": [[9, 0]]}), "outside the model"),
        (lambda raw: json.dumps({**raw, "unstable": [[-1, 0]]}), "outside the model"),
        (lambda raw: json.dumps({**raw, "num_layers": "two"}), "malformed field"),
        (lambda raw: json.dumps({**raw, "num_kv_heads": None}), "malformed field"),
        (lambda raw: json.dumps({k: v for k, v in raw.items() if k != "schema_version"}), "schema_version=None"),
        (lambda raw: json.dumps({**raw, "head_dim": 32}), "layers, kv_heads, head_dim"),
        (lambda raw: json.dumps({**raw, "num_layers": 3}), "layers, kv_heads, head_dim"),
    ],
    ids=["binary", "empty", "truncated", "list", "short-pair", "long-pair", "str-layer", "str-unstable",
         "layer-out-of-range", "negative", "num_layers-str", "kv-null", "no-version", "head_dim", "layers"],
)
def test_corrupted_profile_files(tmp_path, mutate, needle):
    config, raw = _good_profile(tmp_path)
    bad = mutate(raw)
    path = tmp_path / "bad.json"
    path.write_bytes(bad) if isinstance(bad, bytes) else path.write_text(bad)
    with pytest.raises(ProfileError, match=needle):
        HeadProfile.load(path, config)


def test_max_device_pages_bounds_decode_too(no_grad):
    """The bound holds during decode: the step that would need a new page past it is refused before any
    layer writes, and the cache keeps every earlier token (the same call works again with room)."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8, max_device_pages=24, offload=False))
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)  # 5 pages x 2 KV heads x 2 layers = 20
    steps = 0
    with pytest.raises(FlexiCacheError, match="max_device_pages=24.*still holds all 24 tokens"):
        for _ in range(30):
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
            model(input_ids=torch.randint(1, 97, (1, 1)), attention_mask=mask, past_key_values=cache)
            steps += 1
    assert steps == 4  # tokens 21..24 fill page 6 of each head (24 slots); token 25 would need 4 more
    assert cache.memory_report()["device_slots_in_use"] <= 24
    assert all(layer.length == 24 for layer in cache.flexi_layers)

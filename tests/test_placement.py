"""Multi-device placement: each FlexiCache layer keeps its tiers on the device its keys arrive on.

With accelerate's `device_map`, layers of one model run on different devices; FlexiCache initialises
each layer lazily from its first `key_states`, so nothing has to be told where a layer lives. On CPU
this is shown with two devices that exist here ('cpu' and 'meta') and with accelerate's dispatch
hooks; the CUDA test splits a real model over cuda:0 and the CPU.
"""

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from transformers import DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile

CFG = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=4)
FULL = FlexiCacheConfig(page_size=4, token_budget=128)


# One torch thread comes from conftest.py; every test here runs without autograd.
pytestmark = pytest.mark.usefixtures("no_grad")


def _device_tensors(layer):
    s = layer.store
    names = ("full_k", "full_v", "meta", "win_k", "win_v", "win_pages", "win_shift", "win_bias_rows", "length_t")
    tensors = {name: getattr(s, name) for name in names}
    tensors.update(carried=layer.selector.carried_pages, rows=s.rows.stable, promoted=layer.promoted)
    return tensors


def assert_layer_on(layer, device):
    """Every tensor of `layer` on `device` (on a CPU the host tier, the stable rows' full tier, is its memory)."""
    device = torch.device(device)
    assert layer.device == device
    for name, t in _device_tensors(layer).items():
        assert t.device == device, f"layer {layer.layer_idx} {name} on {t.device}, expected {device}"


def test_each_layer_initialises_on_its_keys_device():
    """Layer 0 gets CPU keys (mixed, tiered), layer 1 'meta' keys (all unstable): each store follows its keys."""
    model = tiny_model("llama", layers=2)
    profile = HeadProfile.from_unstable(model.config, [(0, 0), (1, 0), (1, 1)])
    cache = FlexiCache(model.config, CFG, profile)
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(2, 2, 21, 16, generator=g), torch.randn(2, 2, 21, 16, generator=g)
    cache.update(k0, v0, 0)
    cache.update(torch.empty(2, 2, 21, 16, device="meta"), torch.empty(2, 2, 21, 16, device="meta"), 1)
    assert_layer_on(cache.layers[0], "cpu")
    assert_layer_on(cache.layers[1], "meta")
    assert cache.memory_report()["host_kv_bytes"] > 0  # the CPU layer's stable head has a host tier
    k, v = cache.layers[0].dense_kv()
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert cache.get_seq_length() == 21


def test_accelerate_dispatch_hooks_leave_the_cache_alone():
    """With accelerate's per-module hooks (what device_map installs), generate still matches dense: the hooks
    must not try to move the FlexiCache. (Where each layer lands is tested with a real split below.)"""
    from accelerate import dispatch_model

    model = tiny_model("llama", layers=2)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    model = dispatch_model(model, device_map=device_map, force_hooks=True)
    assert hasattr(model.model.layers[1], "_hf_hook")
    ids, mask = left_padded_batch(2, 27, pad_lengths=[0, 5])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **kw)
    cache = FlexiCache(model.config, FULL, HeadProfile.from_unstable(model.config, [(0, 1)]))
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(out, ref)
    for layer in cache.layers:
        assert_layer_on(layer, "cpu")


def test_accelerate_hooks_split_over_cpu_and_meta():
    """Layer 0 runs on the CPU, layer 1 (and the head) on 'meta', each behind accelerate's AlignDevicesHook
    (what device_map installs per module; dispatch_model itself would treat 'cpu' as offload): each layer's
    tiers land on its module's device, and the CPU layer holds exactly what a run without hooks holds."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    def build():
        return tiny_model("llama", layers=2, tie_word_embeddings=False)

    profile = lambda config: HeadProfile.from_unstable(config, [(0, 1), (1, 0), (1, 1)])  # noqa: E731 (layer 0 tiered)
    ids = torch.randint(1, 97, (2, 27), generator=torch.Generator().manual_seed(0))

    def decode(model, cache):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        for t in range(6):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        return cache

    model = build()
    ref = decode(model, FlexiCache(model.config, CFG, profile(model.config)))
    model = build()  # the same weights (same seed)
    placement = {model.model.embed_tokens: "cpu", model.model.rotary_emb: "cpu", model.model.layers[0]: "cpu",
                 model.model.layers[1]: "meta", model.model.norm: "meta", model.lm_head: "meta"}
    for module, device in placement.items():
        module.to(device)
        add_hook_to_module(module, AlignDevicesHook(execution_device=torch.device(device), io_same_device=False))
    cache = FlexiCache(model.config, CFG, profile(model.config))
    decode(model, cache)
    assert_layer_on(cache.layers[0], "cpu")
    assert_layer_on(cache.layers[1], "meta")
    assert cache.stats()["decode_steps"] == 6 and cache.stats()["reranks_stable"] > 0
    k, v = cache.layers[0].dense_kv()
    k_ref, v_ref = ref.layers[0].dense_kv()
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.cuda
def test_device_map_split_over_cuda_and_cpu():
    """Layer 0 on cuda:0, layer 1 on the CPU: tiers follow, output equals dense (full budget), low budget runs."""
    from accelerate import dispatch_model

    model = tiny_model("llama", layers=2)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                  "model.norm": "cpu", "lm_head": "cpu"}
    model = dispatch_model(model, device_map=device_map)
    ids, mask = left_padded_batch(2, 27, pad_lengths=[0, 5])
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **kw)
    profile = HeadProfile.from_unstable(model.config, [(0, 1)])
    cache = FlexiCache(model.config, FULL, profile)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(out.cpu(), ref.cpu())
    assert_layer_on(cache.layers[0], "cuda:0")
    assert_layer_on(cache.layers[1], "cpu")
    low = FlexiCache(model.config, CFG, profile)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=low, max_new_tokens=40, do_sample=False,
                         pad_token_id=0)
    assert low.stats()["decode_steps"] == 39 and out.shape[1] == 27 + 40
    assert_layer_on(low.layers[0], "cuda:0")

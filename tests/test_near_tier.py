"""The GPU layout of the tiers, run on a CPU: the full tier (every row) plays the mapped pinned host memory and the
near rows (unstable, streaming) keep their tokens apart in device memory (`PageStore.near_apart`). The same tokens and
logits as one full tier, bit for bit, through every path that writes or reads the near rows: decode steps, a verified
block (prompt lookup), beam search (rows reordered), a new turn on a filled cache and growth."""

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.host_memory import mapped_host_zeros
from fc_hf.store import PageStore

CFG = dict(page_size=4, token_budget=16, rerank_interval=3)


def _cache(model, split: bool, monkeypatch, **kw):
    monkeypatch.setattr(PageStore, "split_on_cpu", split)
    # Layer 0: unstable head 1, streaming head 2, stable head 0; layer 1: unstable head 0, stable 1 and 2.
    cfg = FlexiCacheConfig(streaming_heads=((0, 2),), streaming_sink_pages=1, **CFG)
    return FlexiCache(model.config, cfg, HeadProfile.from_unstable(model.config, [(0, 1), (1, 0)]), **kw)


def _model():
    return tiny_model("llama", layers=2, kv_heads=3, heads=6)


def _check_near_rows(cache, split: bool) -> None:
    for layer in cache.layers:
        store = layer.store
        assert store.near_apart is split
        held = store.length
        near = store.rows.near
        assert torch.equal(store.near_k[: near.numel(), :held] if split else store.near_k[near, :held],
                           store.full_k[near, :held])
        assert torch.equal(store.near_v[: near.numel(), :held] if split else store.near_v[near, :held],
                           store.full_v[near, :held])
        if split:  # device: the near rows and the windows; host: every row's full tier
            per_row = store.capacity * (store.head_dim + store.value_dim) * store.dtype.itemsize
            bytes_ = store.tier_bytes()
            windows = (store.win_k.numel() + store.win_v.numel()) * store.dtype.itemsize
            assert bytes_ == {**bytes_, "device": near.numel() * per_row + windows, "host": store.n * per_row}


def test_near_rows_apart_decode_bit_for_bit(monkeypatch):
    model = _model()
    ids, mask = left_padded_batch(2, 37, pad_lengths=[0, 6])
    forced = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    logits, caches = {}, {}
    for split in (False, True):
        cache = _cache(model, split, monkeypatch)
        steps, m = [], mask
        with torch.no_grad():
            model(input_ids=ids, attention_mask=m, past_key_values=cache, use_cache=True)
            for t in range(forced.shape[1]):
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
                out = model(input_ids=forced[:, t : t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
                steps.append(out.logits[:, -1])
        logits[split], caches[split] = torch.stack(steps, 1), cache
        _check_near_rows(cache, split)
    assert torch.equal(logits[True], logits[False])
    assert caches[True].stats()["pages_promoted"] == caches[False].stats()["pages_promoted"] > 0


@pytest.mark.parametrize("mode", ["beams", "prompt_lookup", "second_turn"])
def test_near_rows_apart_generate_alike(mode, monkeypatch):
    model = _model()
    ids, mask = left_padded_batch(2, 29, pad_lengths=[0, 3])
    if mode == "prompt_lookup":  # one sequence (the assisted loop's), its prompt repeating itself so drafts are accepted
        ids = torch.cat([ids[:1], ids[:1, :20]], 1)
        mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    if mode == "beams":
        kw["num_beams"] = 2
    if mode == "prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 3
    out = {}
    for split in (False, True):
        cache = _cache(model, split, monkeypatch)
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
            if mode == "second_turn":  # a turn on the filled cache, past its capacity (it grows)
                more = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(1))
                turn = torch.cat([seq, more], 1)
                turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
                capacity = cache.layers[0].store.capacity
                seq = model.generate(input_ids=turn, attention_mask=turn_mask, past_key_values=cache, **kw)
                assert cache.layers[0].store.capacity > capacity
        out[split] = seq
        _check_near_rows(cache, split)
    assert torch.equal(out[True], out[False])


def test_mapped_host_memory_is_cuda_only():
    assert mapped_host_zeros((2, 3), torch.float32, torch.device("cpu")) is None


@pytest.mark.cuda
def test_mapped_host_memory_takes_no_device_memory_and_reads_back():
    device = torch.device("cuda")
    before = torch.cuda.memory_allocated(device)
    tier = mapped_host_zeros((64, 1024, 128), torch.bfloat16, device)
    assert tier is not None and tier.device.type == "cuda" and tier.dtype == torch.bfloat16
    assert torch.cuda.memory_allocated(device) - before < tier.numel() * tier.element_size()
    rows = torch.tensor([3, 17], device=device)
    src = torch.randn(2, 1024, 128, device=device, dtype=torch.bfloat16)
    tier.index_copy_(0, rows, src)  # a device kernel writes host memory
    assert torch.equal(tier.index_select(0, rows), src)  # and reads it back
    assert torch.equal(tier[3].cpu(), src[0].cpu())


@pytest.mark.parametrize("mapping", ["kept", "fails"])
def test_a_copy_keeps_its_full_tier_in_mapped_host_memory(mapping, monkeypatch):
    """`copy.deepcopy` of a prefilled cache (the docs' prefix copies): a full tier in mapped host memory is copied into
    new mapped host memory (a plain deepcopy of the CUDA tensor wrapping it would put the whole host tier in device
    memory). Here the full tier plays the mapped memory (`full_mapped` set by hand, the allocator recorded); where
    the copy cannot be mapped it falls back to one full tier in device memory. Either way the copy decodes what the
    original does, bit for bit, and the two are independent."""
    import copy

    import fc_hf.store as store_module

    model = _model()
    ids, mask = left_padded_batch(2, 37, pad_lengths=[0, 6])
    forced = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = _cache(model, True, monkeypatch)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        layer.store.full_mapped = True
    monkeypatch.setattr(PageStore, "split_on_cpu", False)  # from here the near tier is apart because of the mapping
    made = []

    def mapped(shape, dtype, device):
        if mapping == "fails":
            return None
        made.append(torch.zeros(shape, dtype=dtype, device=device))
        return made[-1]

    monkeypatch.setattr(store_module, "mapped_host_zeros", mapped)
    twin = copy.deepcopy(cache)
    for old, new in zip(cache.layers, twin.layers):
        a, b = old.store, new.store
        assert b.full_k.data_ptr() != a.full_k.data_ptr() and torch.equal(b.full_k, a.full_k)
        if mapping == "kept":
            assert b.full_mapped and b.near_apart
            assert any(b.full_k is t for t in made) and any(b.full_v is t for t in made)
            assert b.near_k.data_ptr() not in (a.near_k.data_ptr(), b.full_k.data_ptr())
        else:  # one full tier, as a new cache whose mapping failed has
            assert not b.full_mapped and not b.near_apart and b.near_k is b.full_k and b.near_v is b.full_v
    assert len(made) == (2 * len(cache.layers) if mapping == "kept" else 0)

    def decode(c):
        m, steps = mask, []
        with torch.no_grad():
            for t in range(forced.shape[1]):
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
                steps.append(model(input_ids=forced[:, t : t + 1], attention_mask=m, past_key_values=c,
                                   use_cache=True).logits[:, -1])
        return torch.stack(steps, 1)

    assert torch.equal(decode(twin), decode(cache))

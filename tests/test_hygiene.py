"""Resource hygiene: fresh caches per call do not leak; `release()` gives the memory back."""

import ctypes
import gc
import os
import weakref

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile

MB = 1 << 20


def rss_bytes() -> int:
    """Resident set size of this process now (not the peak), after glibc returns its free heap to the OS.

    Without the trim, glibc keeps freed blocks of a few MB around (measured here: +30..170 MB of
    retained-but-free heap after 100 calls, back to baseline after `malloc_trim`), which is not a leak.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        psutil = pytest.importorskip("psutil")
        return psutil.Process().memory_info().rss


# One torch thread comes from conftest.py; every test here runs without autograd.
pytestmark = pytest.mark.usefixtures("no_grad")


def test_100_generate_calls_with_fresh_caches_keep_rss_flat():
    """Each call's cache (~3 MB of KV with its host tier) must be freed: 100 leaked caches would add > 250 MB."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=4, head_dim=64)
    profile = HeadProfile.from_unstable(model.config, [(0, 0), (1, 3)])
    cfg = FlexiCacheConfig(page_size=16, token_budget=64, rerank_interval=4)
    ids, mask = left_padded_batch(1, 600)

    def call():
        cache = FlexiCache(model.config, cfg, profile)
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False,
                       pad_token_id=0)
        return cache

    for _ in range(5):  # warm-up: allocator pools, lazy imports
        call()
    gc.collect()
    size = call().memory_report()
    per_cache = size["device_kv_bytes"] + size["host_kv_bytes"] + size["metadata_bytes"]
    assert per_cache > 2.5 * MB
    gc.collect()
    before = rss_bytes()
    refs = []
    for _ in range(100):
        refs.append(weakref.ref(call()))
    gc.collect()
    growth = rss_bytes() - before
    alive = sum(r() is not None for r in refs)
    print(f"RSS growth over 100 generate calls: {growth / MB:.1f} MB ({per_cache / MB:.1f} MB per cache)")
    assert alive == 0, f"{alive} of 100 finished caches are still referenced"
    assert growth < 25 * MB, f"RSS grew by {growth / MB:.1f} MB over 100 calls ({per_cache / MB:.1f} MB per cache)"


def test_release_frees_the_memory():
    """A large prefilled cache: after release() its tensors are gone and the RSS drops by most of their size."""
    model = tiny_model("llama", layers=4, heads=8, kv_heads=4, head_dim=64)
    profile = HeadProfile.from_unstable(model.config, [(l, 0) for l in range(4)])
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=16, token_budget=256), profile)
    g = torch.Generator().manual_seed(0)
    for layer in range(4):
        k, v = torch.randn(1, 4, 4096, 64, generator=g), torch.randn(1, 4, 4096, 64, generator=g)
        cache.update(k, v, layer)
    del k, v
    report = cache.memory_report()
    held = report["device_kv_bytes"] + report["host_kv_bytes"] + report["metadata_bytes"]
    assert held > 30 * MB  # 32 MB of K/V (a quarter on the device, the stable heads' on the host) and metadata
    pools = [weakref.ref(l.store.full_k) for l in cache.flexi_layers]
    gc.collect()
    before = rss_bytes()
    cache.release()
    gc.collect()
    freed = before - rss_bytes()
    print(f"release() freed {freed / MB:.1f} MB of {held / MB:.1f} MB held")
    assert all(p() is None for p in pools)
    assert cache.memory_report()["device_kv_bytes"] == 0 and cache.memory_report()["host_kv_bytes"] == 0
    assert freed > 0.6 * held, f"release() freed {freed / MB:.1f} MB of {held / MB:.1f} MB"

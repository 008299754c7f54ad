"""State a cache owns (issue 14, item 4): no buffer shared between caches, and `release()` frees it all.

The CPU gather buffers (`kernels.GatherWorkspace`) were process-global: two caches decoding in two
threads wrote into the same buffer. Each cache now owns one (`FlexiCache.workspace`). The thread test
widens the window between a gather and its use (a sleep that releases the GIL), so a shared buffer
is overwritten by the other thread; `test_shared_workspace_is_caught` shows that it would be.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from robustness_helpers import forced_decode

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile
from fc_hf.kernels import GatherWorkspace

CFG = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3)


def _inputs(seed):
    ids, mask = left_padded_batch(2, 30 + seed, pad_lengths=[0, 3], seed=seed)
    forced = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(seed))
    return ids, mask, forced


def _run(model, seed):
    profile = HeadProfile.from_unstable(model.config, [(0, 1)])
    return forced_decode(model, FlexiCache(model.config, CFG, profile), *_inputs(seed))


@pytest.fixture
def gather_yields(monkeypatch):
    """Let the other thread run between a gather and the matmul that reads its buffer."""
    real = GatherWorkspace.gather

    def gather(self, pool, flat, name):
        out = real(self, pool, flat, name)
        time.sleep(0.0005)
        return out

    monkeypatch.setattr(GatherWorkspace, "gather", gather)


def _two_threads(model) -> tuple[bool, list]:
    """(whether two caches decoding in two threads gave what they give one after the other, the threads' errors)."""
    want = [_run(model, seed) for seed in (1, 2)]
    got = [None, None]
    errors = []

    def work(i, seed):
        try:
            got[i] = _run(model, seed)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, seed)) for i, seed in enumerate((1, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        return False, errors
    return all(torch.equal(a, b) for a, b in zip(got, want)), errors


def test_two_caches_in_two_threads_equal_sequential_runs(gather_yields):
    model = tiny_model("llama", layers=2)
    equal, errors = _two_threads(model)
    assert not errors, errors
    assert equal


def test_shared_workspace_is_caught(gather_yields, monkeypatch):
    """Mutant: one process-global workspace again. The thread test must see the other thread's keys: as different
    outputs or, when a thread finds a buffer or table of the other's size, as an error (which of the two is timing)."""
    shared = GatherWorkspace()
    monkeypatch.setattr("fc_hf.cache.GatherWorkspace", lambda: shared)
    model = tiny_model("llama", layers=2)
    equal, errors = _two_threads(model)
    assert errors or not equal


def _owned_tensors(cache):
    """Weak references to every tensor the cache allocated: pools, tables, metadata, host tier, gather buffers."""
    refs = []
    for layer in cache.flexi_layers:
        for group in layer.groups:
            s = group.store
            refs += [weakref.ref(t) for t in (s.k_pool, s.v_pool, s.table, s.minmax.meta_t, s.pool.free) if t is not None]
            if s.host is not None and s.host.host_k is not None:
                refs += [weakref.ref(s.host.host_k), weakref.ref(s.host.host_v)]
    refs += [weakref.ref(b) for b in cache.workspace._buffers.values()]
    return refs


def test_release_frees_everything_the_cache_allocated(no_grad):
    model = tiny_model("llama", layers=2)
    cache = FlexiCache(model.config, CFG, HeadProfile.from_unstable(model.config, [(0, 1)]))
    ids, mask, forced = _inputs(1)
    forced_decode(model, cache, ids, mask, forced)
    refs = _owned_tensors(cache)
    assert len(refs) > 10 and cache.workspace.nbytes() > 0 and cache.memory_report()["host_kv_bytes"] > 0
    cache.release()
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} tensors outlive release(): {[tuple(t.shape) for t in alive]}"
    assert cache.workspace.nbytes() == 0
    with pytest.raises(FlexiCacheError, match="was released"):
        cache.update(ids[:, :1, None].float(), ids[:, :1, None].float(), 0)


def test_release_that_keeps_the_workspace_is_caught(no_grad, monkeypatch):
    """Mutant: release() forgets the gather buffers; the test above must notice."""
    monkeypatch.setattr(GatherWorkspace, "clear", lambda self: None)
    with pytest.raises(AssertionError, match="outlive release"):
        test_release_frees_everything_the_cache_allocated(None)

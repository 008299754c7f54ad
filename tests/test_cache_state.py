"""State a cache owns (issue 14, item 4): no buffer shared between caches, and `release()` frees it all.

Every buffer a decode step writes (the store, the step's mask buffers `StepBias`) belongs to one cache, so two caches
decoding in two threads never write into each other's. The thread test widens the window between a gather and its
use (a sleep that releases the GIL), so a shared buffer would be overwritten by the other thread;
`test_shared_step_buffers_are_caught` shows that it would be.
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
from fc_hf.kernels import dispatch

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
    """Let the other thread run between a gather and the matmul that reads it."""
    real = dispatch.gather_pages

    def gather(*args, **kwargs):
        out = real(*args, **kwargs)
        time.sleep(0.0005)
        return out

    monkeypatch.setattr(dispatch, "gather_pages", gather)


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


def test_shared_step_buffers_are_caught(gather_yields, monkeypatch):
    """Mutant: one process-global set of step buffers again. The thread test must see the other thread's masks: as
    different outputs or, when a thread finds buffers of the other's size, as an error (which of the two is timing)."""
    from fc_hf.forward_state import ForwardState

    real = ForwardState.step_bias
    shared = {}

    def global_bias(self, layer):
        if "bias" not in shared:
            shared["bias"] = real(self, layer)
        self.biases[layer.device] = shared["bias"]
        return shared["bias"]

    monkeypatch.setattr(ForwardState, "step_bias", global_bias)
    model = tiny_model("llama", layers=2)
    equal, errors = _two_threads(model)
    assert errors or not equal


def _owned_tensors(cache):
    """Weak references to every tensor the cache allocated: the stores, the selectors' state, the step buffers."""
    refs = []
    for layer in cache.flexi_layers:
        s = layer.store
        refs += [weakref.ref(t) for t in (s.full_k, s.full_v, s.meta, s.win_k, s.win_v, s.win_pages, s.win_bias_rows,
                                          layer.selector.carried_pages, layer.selector.carried_scores)]
    refs += [weakref.ref(b.tokens) for b in cache.forward.biases.values()]
    return refs


def test_release_frees_everything_the_cache_allocated(no_grad):
    model = tiny_model("llama", layers=2)
    cache = FlexiCache(model.config, CFG, HeadProfile.from_unstable(model.config, [(0, 1)]))
    ids, mask, forced = _inputs(1)
    forced_decode(model, cache, ids, mask, forced)
    refs = _owned_tensors(cache)
    assert len(refs) > 10 and cache.memory_report()["host_kv_bytes"] > 0
    cache.release()
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} tensors outlive release(): {[tuple(t.shape) for t in alive]}"
    with pytest.raises(FlexiCacheError, match="was released"):
        cache.update(ids[:, :1, None].float(), ids[:, :1, None].float(), 0)


def test_release_that_keeps_the_step_buffers_is_caught(no_grad, monkeypatch):
    """Mutant: release() forgets the step buffers; the test above must notice."""
    from fc_hf.cache import FlexiCache as Cache

    real = Cache.release

    def keeping(self):
        kept = self.forward.biases
        real(self)
        self.forward.biases = kept

    monkeypatch.setattr(Cache, "release", keeping)
    with pytest.raises(AssertionError, match="outlive release"):
        test_release_frees_everything_the_cache_allocated(None)

"""No decode step synchronises with the host (issue 49): neither a steady step nor one where stable rows re-rank and
promote pages, with or without padding, in eager mode (what a compiled step replays is the same code).

`HostSyncs` records, while a decode step runs, every operation that makes the host wait for the device: the aten ops
that read a value back (`_local_scalar_dense`: `.item()`, `int(t)`, `bool(t)`, `if t.any():`), compute a shape from
values (`nonzero`, `masked_select`, `unique*`, `repeat_interleave` with tensor repeats), index with a boolean mask (a
`nonzero` inside), and the Python calls that copy to the host (`.tolist()`, `.numpy()`, `.cpu()`, `.to("cpu")`),
which on a CPU issue no aten op and are caught by patching them (when called from FlexiCache's code, not from
transformers' forward, whose `.to(x.device)` calls stay on the device). The planted tests show each kind is caught when put
inside a decode step.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import fc_hf.decode as decode
from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.compat import cache_kwargs

_VALUE_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "unique_dim_consecutive"}


def _ours(frame) -> bool:
    """A Python-level copy counts when FlexiCache (or a test) asks for it: transformers' own `.to(x.device)` calls in
    the model's forward are same-device moves on any machine, and on a CPU every target is "cpu"."""
    return os.sep + "site-packages" + os.sep not in frame.f_code.co_filename


class HostSyncs(TorchDispatchMode):
    """Records host syncs while active (see the module docstring): `found` lists their kinds."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self._patched = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _VALUE_OPS:
            self.found.append(name)
        elif name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor) and (
                len(args) < 2 or isinstance(args[1], torch.Tensor)) and kwargs.get("output_size") is None:
            self.found.append("repeat_interleave(tensor)")
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())):
            self.found.append(f"{name}(bool mask)")
        return func(*args, **kwargs)

    def __enter__(self):
        found = self.found

        def patch(name, test=lambda *a, **k: True):
            real = getattr(torch.Tensor, name)

            def spy(self, *args, **kwargs):
                if test(*args, **kwargs) and _ours(sys._getframe(1)):
                    found.append(name)
                return real(self, *args, **kwargs)

            self._patched[name] = real
            setattr(torch.Tensor, name, spy)

        patch("tolist")
        patch("numpy")
        patch("cpu")
        patch("to", lambda *a, **k: any(str(x).startswith("cpu") for x in (*a, k.get("device", ""))))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._patched.items():
            setattr(torch.Tensor, name, real)
        self._patched = {}
        return super().__exit__(*exc)


CFG = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3)


def _decode_steps(planted=None, steps=12, padded=True, promotion="sync"):
    """Decode `steps` steps of a 2-layer model (each layer: unstable and stable heads) and return the host syncs found
    inside the decode steps (the prefill is outside the detector). `planted(layer)` runs inside each layer's step."""
    model = tiny_model("llama", layers=2, heads=6, kv_heads=3)
    profile = HeadProfile.from_unstable(model.config, [(0, 0), (1, 2)])
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3,
                                                      promotion=promotion), profile)
    ids, mask = left_padded_batch(2, 41, pad_lengths=[0, 9] if padded else [0, 0])
    syncs = HostSyncs()
    real = decode.attend

    def attend(layer, *args, **kwargs):
        if planted is not None:
            planted(layer)
        return real(layer, *args, **kwargs)

    decode.attend = attend
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)  # outside the detector: generate's own work
                mask = torch.cat([mask, torch.ones_like(token)], 1)
                with syncs:
                    out = model(input_ids=token, attention_mask=mask, **cache_kwargs(model, cache))
    finally:
        decode.attend = real
    stats = cache.stats()
    assert stats["pages_promoted"] > 0 and stats["reranks_stable"] > 4 * 2  # re-ranks with promotions happened
    return syncs.found


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_decode_steps_never_sync_with_the_host(padded, promotion):
    assert _decode_steps(padded=padded, promotion=promotion) == []


@pytest.mark.parametrize("padded", [True, False])
def test_decode_steps_never_sync_with_the_host_in_the_gpu_layout(padded, monkeypatch):
    """The same with the near rows apart (`PageStore.split_on_cpu`): their extra writes and reads add no sync."""
    from fc_hf.store import PageStore

    monkeypatch.setattr(PageStore, "split_on_cpu", True)
    assert _decode_steps(padded=padded, promotion="sync") == []


PLANTS = {
    "_local_scalar_dense": lambda layer: layer.store.length_t.item(),
    "int(tensor)": lambda layer: int(layer.store.length_t),
    "bool(tensor)": lambda layer: bool(layer.store.win_pages.any()),
    "nonzero": lambda layer: layer.store.win_pages.nonzero(),
    "index(bool mask)": lambda layer: layer.store.win_pages[layer.store.win_pages > 0],
    "tolist": lambda layer: layer.store.win_pages.tolist(),
    "cpu": lambda layer: layer.store.win_pages.cpu(),
    "to": lambda layer: layer.store.win_pages.to("cpu"),
}
CAUGHT_AS = {"int(tensor)": "_local_scalar_dense", "bool(tensor)": "_local_scalar_dense"}


@pytest.mark.parametrize("kind", PLANTS)
def test_a_sync_planted_in_a_decode_step_is_caught(kind):
    found = _decode_steps(PLANTS[kind], steps=4)
    assert found and set(found) == {CAUGHT_AS.get(kind, kind)}
    assert len(found) == 4 * 2  # once per step and layer

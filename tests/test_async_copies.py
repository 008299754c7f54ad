"""The CUDA path hides no host syncs and no pageable copies (issue 31), checked on a CPU.

- every `non_blocking=True` copy in the code lives in `fc_hf.transfer.CudaStreams`, whose host sides the deferred
  fake (tests/deferred_transfers.py) checks: contiguous memory from `host_empty` (pinned on CUDA); device sources
  contiguous. A whole tiered decode (promotions, host-only refinement candidates, a beam reorder) runs under it;
- every store of a device shares one side stream;
- a steady decode step (no re-rank) issues no host sync, counted with the op counter of `flexicache bench ops`,
  and a re-rank step no more than its one device-to-host copy per tier move and per refinement look-up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from deferred_transfers import DeferredStreams, HostSideError, deferred_transfers

import fc_hf.transfer as transfer
from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile

ROOT = Path(__file__).resolve().parents[1]


def _non_blocking_calls(path: Path):
    """(enclosing class or None, line) of every call with a `non_blocking=True` keyword in `path`."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call) and any(
                    k.arg == "non_blocking" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                    for k in child.keywords):
                found.append((cls, child.lineno))
            visit(child, cls)

    visit(tree, None)
    return found


def test_every_non_blocking_copy_is_in_cuda_streams():
    """Outside `CudaStreams` no copy may be asynchronous: there its host side is not audited by the fake below."""
    stray = []
    for folder in ("fc_hf", "kernels", "eval"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for cls, line in _non_blocking_calls(path):
                if not (path.name == "transfer.py" and cls == "CudaStreams"):
                    stray.append(f"{path.relative_to(ROOT)}:{line}")
    assert not stray, f"non_blocking copies outside fc_hf.transfer.CudaStreams: {stray}"
    assert len(_non_blocking_calls(ROOT / "fc_hf" / "transfer.py")) >= 4  # offload, promote (K, V), upload


def test_the_fake_rejects_strided_or_unpinned_host_sides():
    fake = DeferredStreams()
    pool = torch.zeros(5, 2, 3)
    both = fake.host_empty((2, 4, 2, 3), torch.float32)  # the old [2, C, ...] staging: [:, :count] is strided
    with pytest.raises(HostSideError, match="not contiguous"):
        fake.promote(pool, pool.clone(), torch.tensor([1, 2]), both[0, :2], both[:, :2][1].transpose(1, 2))
    with pytest.raises(HostSideError, match="not host_empty"):
        fake.upload(torch.zeros(3))  # ordinary (pageable) memory
    with pytest.raises(HostSideError, match="device side"):
        fake.offload(fake.host_empty((2, 3, 2), torch.float32), torch.zeros(3, 2, 2).transpose(0, 1))
    staged = fake.host_empty((4, 2, 3), torch.float32).normal_()
    fake.promote(pool, pool.clone(), torch.tensor([1, 2]), staged[:2], staged[2:])  # slices along dim 0: fine
    assert torch.equal(fake.upload(staged[1:3]), staged[1:3])


def _profile(config):
    return HeadProfile.from_unstable(config, [(0, 1)])  # layer 0 mixed, layer 1 all stable (tiered)


@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_tiered_decoding_copies_only_contiguous_pinned_memory(promotion):
    """Greedy decoding with promotions and refinement candidates read from the host, then a beam search (its reorder
    rebuilds the host tier): every copy's host side passes the fake's check, and each kind of copy happened."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(1, 97, (2, 61), generator=torch.Generator().manual_seed(0))
    cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3, promotion=promotion)
    with torch.no_grad(), deferred_transfers() as fakes:
        cache = FlexiCache(model.config, cfg, _profile(model.config))
        model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache)
        for store in (g.store for layer in cache.flexi_layers for g in layer.groups):
            store.dense()  # a full view reads dropped pages from the host
        beams = FlexiCache(model.config, cfg, _profile(model.config))
        model.generate(ids[:1], max_new_tokens=12, num_beams=3, do_sample=False, past_key_values=beams)
    issued = {kind: sum(f.issued[kind] for f in fakes) for kind in ("offload", "promote", "upload")}
    assert all(n > 0 for n in issued.values()), issued


def test_one_side_stream_per_device(monkeypatch):
    """Every store on a device shares one `CudaStreams` (one side stream); another device has its own."""

    class FakeCudaStreams:
        def __init__(self, device):
            self.device = device

    monkeypatch.setattr(transfer, "CudaStreams", FakeCudaStreams)
    monkeypatch.setattr(transfer, "_STREAMS", {})
    stores = [transfer.PageTransfers(torch.device("cuda", 0)) for _ in range(3)]
    other = transfer.PageTransfers(torch.device("cuda", 1))
    assert stores[0].streams is stores[1].streams is stores[2].streams
    assert other.streams is not stores[0].streams and other.streams.device == torch.device("cuda", 1)
    assert transfer.streams_for(torch.device("cpu")) is None


def test_steady_decode_step_issues_no_host_sync():
    """Counted by the dispatcher (`flexicache bench ops`'s op counter) under the deferred fake, i.e. along the path
    CUDA takes: no sync in a plain step or a page step; a re-rank step syncs once per tier move and once per
    refinement's host-only look-up (`fc_hf.transfer.to_host`), 2 per tiered layer: 4 here, as before issue 31."""
    from fc_hf.eval.bench import common as bench_common
    from fc_hf.eval.bench import ops as bench_ops

    config = bench_common.model_config("tiny", max_positions=1024)
    model = bench_common.build_model(config)
    profile = bench_common.spread_profile(config, 0.25)
    with deferred_transfers() as fakes:
        case = bench_ops.count_case(model, config, "flexicache", 64, 136, 34, profile)
    summary = bench_ops.summarize(case)
    assert summary["plain"]["steps"] > 20 and summary["plain"]["syncs_per_step"] == 0, summary["plain"]
    assert summary["page"]["syncs_per_step"] == 0, summary["page"]
    assert summary["rerank"]["syncs_per_step"] <= 4, summary["rerank"]
    assert set(summary["rerank"]["sync_kinds"]) <= {"device->host copy"}
    assert sum(f.issued["promote"] for f in fakes) > 0 and sum(f.issued["upload"] for f in fakes) > 0

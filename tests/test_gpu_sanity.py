"""The GPU script's sanity check (eval/bench/gpu.py) can fail, and failing it fails the run (issue 14, item 6).

On a CPU the "device" side is the CPU too, so the real check passes trivially; the tests below show
that a device-side difference just over the tolerance is caught at every budget, that FlexiCache's decode attention
slightly off is caught against dense at the full budget, and that `main` then exits with status 1.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from fc_hf.eval.bench import gpu as bench_gpu
from fc_hf.kernels import dispatch

SMALL = dict(length=600, steps=9, batch=2)  # 38 pages: the 256-token budget (16 pages) has to choose


def _config():
    return tiny_config("llama", layers=2, heads=4, kv_heads=2, head_dim=16, tie_word_embeddings=False)


def test_sanity_passes_against_the_cpu_reference():
    result = bench_gpu.sanity("cpu", config=_config(), **SMALL)
    assert result["ok"], result
    assert result["full"]["max_abs_logit_diff"] < 1e-5  # FlexiCache (every page) against dense attention
    # CPU against CPU: the "device" side on the CPU's default kernels (the C++ ones where they build), the reference
    # on the PyTorch path; equal but for fp32 rounding (exactly equal where the C++ kernels did not build).
    for case in ("low", "low-deferred"):
        assert result[case]["max_abs_logit_diff"] <= (1e-6 if dispatch.backend_for(torch.zeros(1)) == "native" else 0)
    assert result["low"]["pages_promoted"] > 0 and result["low-deferred"]["pages_promoted"] > 0


@pytest.mark.parametrize("case", [name for name, _, _ in bench_gpu.SANITY_CASES])
def test_device_side_difference_over_the_tolerance_fails(monkeypatch, case):
    """Mutant: the device side's logits differ by twice the tolerance at one step of one case."""
    real = bench_gpu._forced_logits
    calls = []

    def device_off(model, method, cfg, profile, prompt_kv, tokens, device):
        logits, stats = real(model, method, cfg, profile, prompt_kv, tokens, device)
        name = bench_gpu.SANITY_CASES[len(calls) // 2][0]  # each case: the reference, then the device side
        calls.append(cfg)
        if len(calls) % 2 == 0 and name == case:
            logits[0, 4, 0] += 2 * bench_gpu.SANITY_RTOL * max(1.0, logits.abs().max().item())
        return logits, stats

    monkeypatch.setattr(bench_gpu, "_forced_logits", device_off)
    result = bench_gpu.sanity("cpu", config=_config(), **SMALL)
    assert not result["ok"] and not result[case]["ok"] and result[case]["first_bad_step"] == 5
    assert all(result[name]["ok"] for name, _, _ in bench_gpu.SANITY_CASES if name != case)


def test_attention_slightly_off_fails_against_dense(monkeypatch):
    """Mutant: FlexiCache's decode attention 1% off everywhere, in both primitives a decode step attends with
    (`attention` over gathered or windowed K/V, `chosen_attention` over a ranking's own logits; the core calls them
    through `fc_hf.kernels.dispatch`). The full-budget case compares with dense and fails from the first step; the
    low-budget ones compare with FlexiCache on the CPU, as wrong on both sides, and pass: only dense can see it."""
    calls = []
    for name in ("attention", "chosen_attention"):
        def off(*a, _real=getattr(dispatch, name), _name=name, **k):
            calls.append(_name)
            return _real(*a, **k) * 1.01

        monkeypatch.setattr(dispatch, name, off)
    result = bench_gpu.sanity("cpu", config=_config(), **SMALL)
    assert set(calls) == {"attention", "chosen_attention"}  # the step attends through both
    assert not result["ok"] and not result["full"]["ok"] and result["full"]["first_bad_step"] == 1
    assert result["low"]["ok"] and result["low-deferred"]["ok"]


def test_failed_sanity_fails_the_run(monkeypatch, tmp_path):
    """A sanity check that fails gives status 1 (with no time left for any case: the plan is recorded skipped)."""
    monkeypatch.setattr(bench_gpu, "sanity", lambda device, **kw: {"ok": False, "full": {"max_abs_logit_diff": 1.0}})
    args = ["--device", "cpu", "--model", "tiny", "--layers", "2", "--time-budget-s", "0", "--out", str(tmp_path)]
    assert bench_gpu.main(args) == 1
    monkeypatch.setattr(bench_gpu, "sanity", lambda device, **kw: {"ok": True})
    assert bench_gpu.main(args) == 0

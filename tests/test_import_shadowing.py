"""The repository's top-level `kernels/` folder never shadows an installed `kernels` package (Hugging Face's, which
transformers >= 5.25 imports with every model class): from the repository root, where `python -c`, `python -m pytest`
and notebooks put the checkout first on `sys.path`, and in the wheel, where the folder is `fc_hf.kernels` only."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_from_root(code: str, pythonpath: Path | None = None) -> str:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture
def installed_kernels(tmp_path):
    """A regular `kernels` package later on `sys.path` than the repository root, as site-packages is."""
    package = tmp_path / "kernels"
    package.mkdir()
    (package / "__init__.py").write_text("CUDAProperties = 'the installed kernels package'\n")
    (package / "layers.py").write_text("NAME = 'installed submodule'\n")
    return tmp_path


def test_from_the_repository_root_import_kernels_finds_the_installed_package(installed_kernels):
    out = _run_from_root(
        "import sys, kernels, kernels.layers\n"
        "from kernels import CUDAProperties\n"
        "import fc_hf.kernels as ours, fc_hf.kernels.dispatch\n"
        "print(sys.path[0] == '', CUDAProperties, kernels.layers.NAME, ours.__name__,\n"
        "      callable(ours.dispatch.page_scores))",
        pythonpath=installed_kernels,
    )
    assert out == "True the installed kernels package installed submodule fc_hf.kernels True"


def test_from_the_repository_root_kernels_is_what_it_is_elsewhere(tmp_path):
    """With Hugging Face's `kernels` installed (transformers >= 5.25), the root finds that package; without it, this
    folder stays and transformers, which probes `kernels` by its version metadata, counts it as not installed."""
    probe = ("import importlib.util as u, transformers.utils.import_utils as iu; s = u.find_spec('kernels'); "
             "print(iu.is_kernels_available(), s.origin if s and s.origin and 'site-packages' in s.origin else None)")
    elsewhere = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert elsewhere.returncode == 0, elsewhere.stderr
    installed = elsewhere.stdout.split()[1] != "None"
    code = "import kernels, transformers.utils.import_utils as iu; print(iu.is_kernels_available(), kernels.__file__)"
    available, found = _run_from_root(code).split()
    assert available == str(installed)
    assert (found == elsewhere.stdout.split()[1]) if installed else found == str(ROOT / "kernels" / "__init__.py")


def test_the_wheel_has_no_top_level_kernels(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "setuptools" in proc.stderr:
        pytest.skip("no setuptools in this environment to build the wheel without isolation")
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("flexicache-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert "kernels" not in tops and "eval" not in tops and "fc_hf" in tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "fc_hf/kernels/dispatch.py" in names
    assert "fc_hf/kernels/csrc/native_ops.cpp" in names  # the C++ kernels compile from it on first use

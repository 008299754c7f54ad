"""C++ CPU kernels of the decode step: the fused ops of `triton_ops.py` (same names, same contracts, one call each) for
CPU tensors, so that a CPU step issues the calls a GPU step launches instead of the PyTorch backend's many small ops.

The source is `csrc/native_ops.cpp`. On first use it is compiled by the C++ compiler (`$CXX`, default `c++`; C++20)
against the installed torch's headers and libraries, about 15 s once per machine, source and torch version; no build
tool beyond the compiler (torch's `cpp_extension.load` would need ninja, which a torch install does not bring). Builds
are cached in `$TORCH_EXTENSIONS_DIR/flexicache_native` (default `~/.cache/torch_extensions`), and loaded with
`torch.ops.load_library`, which registers the ops `flexicache_cpu::<name>`. Where it cannot be built, `available()`
says why (`build_error()`) and `dispatch.py` keeps the PyTorch backend: the native path is a speed-up, never a
requirement. Each wrapper checks its arguments against the contract (`contracts.py`) first; each op has a fake
implementation, so a compiled step keeps a call as one node.

Numerics are the Triton kernels' (see `triton_ops.py`): fp32 sums, `page_logits` and the attention's logits summed over
the channels in 16 partial sums added in one order (the same number whatever a token's company), choices among equal
values taking the lower place, writes equal to the backend's bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from .contracts import (FAKES, check_append_token, check_attention, check_candidates, check_choose,
                        check_chosen_attention, check_move_windows, check_page_logits, check_page_scores)

BACKEND = "native"  # the name `dispatch` routes by
OPS_NAMESPACE = "flexicache_cpu"  # torch.ops.flexicache_cpu.<name>
_SOURCE = Path(__file__).with_name("csrc") / "native_ops.cpp"
_DISABLE_ENV = "FLEXICACHE_NATIVE"  # "0": never build or use the C++ kernels
_UNUSED_DAYS = 30  # a cached build no process loaded for this long is removed when another one is built
_build_error: Optional[str] = None
_loaded: Optional[bool] = None  # None: not tried yet


def available() -> bool:
    """Whether the C++ kernels are built and loaded (building them on the first call). A failure is remembered, warned
    about once, and reported by `build_error()`."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def _load() -> bool:
    global _build_error
    if os.environ.get(_DISABLE_ENV, "1") == "0":
        _build_error = f"{_DISABLE_ENV}=0"
        return False
    try:
        torch.ops.load_library(str(_build()))
    except Exception as error:  # no compiler, a failed build: the PyTorch backend serves instead
        _build_error = f"{type(error).__name__}: {error}".strip()
        warnings.warn(f"FlexiCache's C++ CPU kernels could not be built ({_build_error.splitlines()[0]}); the CPU "
                      f"decode step uses the PyTorch backend (same results, more ops a step). Install a C++20 "
                      f"compiler (or point $CXX at one) to build them, or set {_DISABLE_ENV}=0 to silence this.",
                      RuntimeWarning, stacklevel=2)
        return False
    _register_fakes()
    return True


def build_folder() -> Path:
    """Where builds are cached: `$TORCH_EXTENSIONS_DIR/flexicache_native`, default `~/.cache/torch_extensions/...`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "flexicache_native"


def _build() -> Path:
    """The path of the shared library for this source, torch and CPU, compiled unless cached (by any compiler).
    `-march=native` (this machine's vector units) is tried first, then plain `-O3`; a failure raises with the
    compiler's last words. Flags a compiler refused are not asked of it again for a day (a `.failed` marker, removed
    with the partial files), so a compiler without `-march=native` costs one failed build, not one per process."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or "c++"
    folder = build_folder()
    folder.mkdir(parents=True, exist_ok=True)
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    failures = []
    for flags in (["-O3", "-march=native"], ["-O3"]):
        # Named by all that goes into it, so checkouts with other sources, other torch versions or machines sharing a
        # home folder keep builds of their own and never replace a library a running process has loaded.
        key = [_SOURCE.read_bytes(), torch.__version__, *flags, *includes, *libraries, _machine()]
        digest = hashlib.sha1(b"\0".join(k if isinstance(k, bytes) else k.encode() for k in key)).hexdigest()[:16]
        target = folder / f"flexicache_native_{digest}.so"
        if target.exists():
            with contextlib.suppress(OSError):  # a cache another user owns is read, not marked
                os.utime(target)  # marks it used (see `_remove_unused`)
            return target
        refused = folder / f"{target.stem}.{hashlib.sha1(compiler.encode()).hexdigest()[:8]}.failed"
        if refused.exists():
            failures.append(f"{' '.join(flags)}: refused by {compiler} within a day ({refused})")
            continue
        partial = folder / f"{target.stem}.{os.getpid()}.partial"  # renamed into place whole: no half-written library
        command = [compiler, "-shared", "-fPIC", "-std=c++20", *flags, *includes, str(_SOURCE), *libraries, "-o",
                   str(partial)]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as error:  # no compiler at all, or one that hangs
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"cannot run the C++ compiler {compiler!r}: {error}") from None
        if run.returncode == 0:
            os.replace(partial, target)
            _remove_unused(folder, target)
            return target
        partial.unlink(missing_ok=True)
        failures.append(f"{' '.join(flags)}: exit {run.returncode}: {run.stderr.strip()[-1500:]}")
        with contextlib.suppress(OSError):  # a cache folder another user owns: the next process tries again
            refused.write_text(failures[-1])
    raise RuntimeError(f"{compiler} failed to compile {_SOURCE.name}\n" + "\n".join(failures))


def _remove_unused(folder: Path, keep: Path):
    """Removes cached builds no process loaded in `_UNUSED_DAYS` days (each load touches its file), and partial builds
    and refusal markers a day old; a process that has a removed library loaded keeps it (it is only unlinked)."""
    now = time.time()
    for path in folder.iterdir():
        try:
            age = now - path.stat().st_mtime
            if path != keep and (age > _UNUSED_DAYS * 86400 if path.suffix == ".so" else age > 86400):
                path.unlink()
        except OSError:  # removed by another process meanwhile, or not ours to remove: left as it is
            pass


def _machine() -> str:
    """The CPU's architecture and, where Linux says, its model and flags (what `-march=native` builds for)."""
    import platform

    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            text += "".join(line for line in info if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return text


def build_error() -> Optional[str]:
    """Why the C++ kernels are not in use (None when they are, or before `available()` was asked)."""
    return _build_error


def _ops():
    if not available():
        raise RuntimeError(f"FlexiCache's C++ CPU kernels are not available ({_build_error}); use FLEXICACHE_BACKEND="
                           f"torch")
    return torch.ops.flexicache_cpu


def _check_cpu(*tensors):
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"the C++ kernels run on CPU tensors, got {[str(t.device) for t in tensors]}; on a GPU the "
                         f"Triton backend serves")


def page_scores(query, meta, bias, subpages):
    """See `torch_backend.page_scores`: `meta` one tensor or row blocks (views of the MinMax cache, read in place, not
    concatenated). -> `[n, E / S]` fp32."""
    blocks = [meta] if isinstance(meta, torch.Tensor) else list(meta)
    check_page_scores(query, blocks, bias, subpages)
    _check_cpu(query, bias, *blocks)
    return _ops().page_scores.default(query, blocks, bias, subpages)


def attention(query, keys, values, bias, scaling, softcap=None):
    """See `torch_backend.attention`. -> `[n, G, Dv]` in the values' dtype."""
    check_attention(query, keys, values, bias)
    _check_cpu(query, keys, values, bias)
    return _ops().attention.default(query, keys, values, bias, float(scaling),
                                    None if softcap is None else float(softcap))


def chosen_attention(logits, top, pages, starts, values):
    """See `torch_backend.chosen_attention`. -> `[m, G, Dv]` in the values' dtype."""
    check_chosen_attention(logits, top, pages, starts, values)
    _check_cpu(logits, top, pages, starts, values)
    return _ops().chosen_attention.default(logits, top, pages, starts, values)


def candidates(scores, carried_pages, carried_scores, count):
    """See `torch_backend.candidates` (nothing carried: `[n, 0]` tensors). -> `(scores [n, C], pages [n, C])`."""
    check_candidates(scores, carried_pages, carried_scores, count)
    _check_cpu(scores, carried_pages, carried_scores)
    return _ops().candidates.default(scores, carried_pages, carried_scores, count)


def page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq, scaling):
    """See `torch_backend.page_logits`. -> `[n, G, C, P]` fp32."""
    check_page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq)
    _check_cpu(query, pages, rows, near_k, near_index, full_k, tokens)
    return _ops().page_logits.default(query, pages, rows, near, near_k, near_index, full_k, tokens, seq,
                                      float(scaling))


def choose(logits, scores, cand, page, k, carry, score, pages_out, scores_out):
    """See `torch_backend.choose`. -> `(mass [n, C], top [n, K], pages [n, K])`; the carried candidates written."""
    check_choose(logits, scores, cand, page, k, carry, pages_out, scores_out)
    _check_cpu(logits, scores, cand, page, pages_out, scores_out)
    return _ops().choose.default(logits, scores, cand, page, k, carry, float(score), pages_out, scores_out)


def append_token(keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift,
                 stable_local, near_k, near_v, near_place, subpage_len):
    """See `torch_backend.append_token`."""
    check_append_token(keys, values, full_k, full_v, meta, win_k, win_v, near_k, near_v, subpage_len)
    _check_cpu(keys, values, position, length, full_k, full_v, meta, win_k, win_v, near_k, near_v)
    _ops().append_token.default(keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift,
                                stable_local, near_k, near_v, near_place, subpage_len)


def move_windows(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base,
                 win_bias_rows, stable_batch, promoted, num_pages, k, count):
    """See `torch_backend.move_windows`."""
    check_move_windows(pages, page, local, rows, full_k, win_k, win_pages, num_pages, k)
    _check_cpu(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, promoted)
    _ops().move_windows.default(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base,
                                win_bias_rows, stable_batch, promoted, num_pages, k, count)


def _register_fakes():
    """Output shapes and dtypes for FakeTensor tracing: the Triton ops' fakes (`contracts.FAKES`)."""
    for name, fake in FAKES.items():
        torch.library.register_fake(f"{OPS_NAMESPACE}::{name}")(fake)

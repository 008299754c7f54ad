"""Compile every Triton kernel for Hopper (sm_90) without a GPU, so compile errors show in CI.

The interpreter (tests/test_kernels.py) runs kernels as Python and misses what only the compiler
rejects (layouts, `tl.dot` shapes and dtypes, constexpr misuse). Each variant here is built from the
same `_*_plan` helper the launcher uses, so the compiled signature and launch options (warps) are
exactly what a launch would pass. Compiling needs triton imported *without* TRITON_INTERPRET (its
`tl.sum`/`tl.max` helpers are decorated at import); when this process has the interpreter on, the
cases skip and `test_compile_in_fresh_process` runs this file again in a process without it.

Each variant's resources on sm_90 are read with `ptxas -v` on the PTX Triton made (the ptxas Triton
ships; the GPU is not needed): registers per thread, spill bytes, shared memory. A spill in an fp16 or
bf16 variant fails the test (registers are capped at 255, so a kernel that needs more spills to local
memory); fp32 variants are reported only. `FLEXICACHE_KERNEL_STATS=FILE` writes the table as JSON,
and `pytest tests/test_kernel_compile.py -s` prints it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from fc_hf.kernels import append, decode, refine, score  # noqa: E402

COMPILER_READY = isinstance(triton.language.sum, JITFunction)
needs_compiler = pytest.mark.skipif(not COMPILER_READY, reason="triton imported with the interpreter on; see the fresh-process test")


@pytest.mark.skipif(COMPILER_READY, reason="the compile cases run in this process")
def test_compile_in_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"compile run failed:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout


TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
}


def _jit(kernel) -> JITFunction:
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _ptxas() -> str | None:
    """The ptxas Triton compiles sm_90 code with (it ships its own), else one on PATH."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError):
        return shutil.which("ptxas")


def resources(compiled) -> dict | None:
    """`ptxas -v` on the compiled kernel's PTX for sm_90a: registers, spill store/load bytes; plus Triton's shared
    memory. None when no ptxas is found or its report cannot be read."""
    ptxas = _ptxas()
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([ptxas, "-v", "-lineinfo", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    if run.returncode != 0 or regs is None or spills is None:
        return None
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "shared_bytes": int(getattr(compiled.metadata, "shared", 0))}


STATS: list[dict] = []  # one row per compiled variant, in test order


@pytest.fixture(scope="module", autouse=True)
def _report_stats():
    yield
    if not STATS:
        return
    print("\nsm_90 resources per kernel variant (ptxas -v):")
    for row in STATS:
        r = row["resources"] or {}
        print(f"  {row['kernel']:24s} {row['dtype']:9s} {row['variant']:32s} warps {row['num_warps']}  "
              f"regs {r.get('registers', '?'):>3}  spill {r.get('spill_stores', '?')}/{r.get('spill_loads', '?')} B  "
              f"smem {r.get('shared_bytes', '?')} B")
    if os.environ.get("FLEXICACHE_KERNEL_STATS"):
        Path(os.environ["FLEXICACHE_KERNEL_STATS"]).write_text(json.dumps(STATS, indent=1) + "\n")


def _compile(kernel, args: dict, constexprs: dict, options: dict, variant: str = "", dtype=None):
    """Compile for sm_90 with the plan's launch `options`; record its resources (and fail on a spill unless fp32)."""
    signature = {}
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: unsupported argument {value!r}")
    signature.update({name: "constexpr" for name in constexprs})
    fn = _jit(kernel)
    assert set(signature) == set(fn.arg_names), "plan and kernel arguments disagree"
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=dict(options))
    assert "ptx" in compiled.asm and ".target sm_90" in compiled.asm["ptx"]
    assert len(compiled.asm.get("cubin", b"")) > 0
    found = resources(compiled)
    STATS.append({"kernel": fn.__name__, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
                  "num_warps": options.get("num_warps", 4), "resources": found})
    if found is not None and dtype != torch.float32:
        assert found["spill_stores"] == 0 and found["spill_loads"] == 0, f"{fn.__name__} [{variant}] spills: {found}"
        assert found["registers"] <= 255
    return compiled


@needs_compiler
def test_resource_reader_finds_spills():
    """The reader itself, on the launch the decode kernel had before issue 31 for fp32 pools of 128 channels (64
    tokens a loop iteration, 4 warps): it spilled 600+ bytes on sm_90, and the reader must say so."""
    n, g, d = 32, 4, 128
    query, pool = torch.empty(n, g, d), torch.empty(1025, 16, d)
    slots, page_idx = torch.zeros(n, 64, dtype=torch.int32), torch.zeros(n, 64, dtype=torch.int64)
    _, args, constexprs, _ = decode._decode_plan(query, pool, pool, slots, page_idx, 1000, d**-0.5, None, 8, None,
                                                 torch.empty(n, g, d), 2)
    constexprs.update(UPCAST=True, PAGES_PER_BLOCK=4)
    signature = {k: "*" + _TYPES[v.dtype] if isinstance(v, torch.Tensor) else "fp32" if isinstance(v, float) else "i32"
                 for k, v in args.items()}
    signature.update({k: "constexpr" for k in constexprs})
    compiled = triton.compile(ASTSource(_jit(decode._sparse_decode_kernel), signature, constexprs), target=TARGET,
                              options={"num_warps": 4})
    found = resources(compiled)
    if found is None:
        pytest.skip("no ptxas to read resources with")
    assert found["registers"] == 255 and found["spill_stores"] > 0, found


@needs_compiler
@pytest.mark.parametrize(
    "dtype, with_valid, d",
    [
        pytest.param(torch.bfloat16, True, 128, id="bf16-valid-D128"),
        pytest.param(torch.float16, False, 64, id="fp16-D64"),
        pytest.param(torch.float32, False, 64, id="fp32-D64"),
        pytest.param(torch.float32, True, 128, id="fp32-valid-D128"),
    ],
)
def test_score_kernel_compiles_for_sm90(dtype, with_valid, d):
    n, g, pcap = 16, 4, 640
    query = torch.empty(n, g, d, dtype=dtype)
    meta = torch.empty(n, pcap, 2 * d, dtype=dtype)
    out = torch.empty(n, 600, dtype=torch.float32)
    valid = torch.ones(n, 600, dtype=torch.bool) if with_valid else None
    _, args, constexprs, options = score._score_plan(query, meta, 600, valid, out)
    _compile(score._score_pages_kernel, args, constexprs, options, f"G{g} D{d} S1", dtype)
    _, args, constexprs, options = score._score_plan(query, meta, 300, valid, out[:, :300], subpages=2, sink_pages=1)
    _compile(score._score_pages_kernel, args, constexprs, options, f"G{g} D{d} S2 sink", dtype)


@needs_compiler
@pytest.mark.parametrize(
    "dtype, g, d, splits, padded, softcap",
    [
        pytest.param(torch.bfloat16, 4, 128, 4, True, None, id="bf16-G4-D128-split-pad"),
        pytest.param(torch.bfloat16, 16, 64, 1, False, None, id="bf16-G16-D64-nosplit"),
        pytest.param(torch.float16, 7, 256, 1, False, 30.0, id="fp16-G7-D256-nosplit-softcap"),
        pytest.param(torch.float16, 8, 128, 2, False, None, id="fp16-G8-D128-split"),
        pytest.param(torch.float32, 1, 64, 2, False, None, id="fp32-G1-D64-split"),
        pytest.param(torch.float32, 4, 128, 2, True, None, id="fp32-G4-D128-split-pad"),
    ],
)
def test_decode_kernels_compile_for_sm90(dtype, g, d, splits, padded, softcap):
    n, slots_count, page, m = 32, 1025, 16, 64
    query = torch.empty(n, g, d, dtype=dtype)
    pool = torch.empty(slots_count, page, d, dtype=dtype)
    slots = torch.zeros(n, m, dtype=torch.int32)
    page_idx = torch.zeros(n, m, dtype=torch.int64)
    out = torch.empty(n, g, d, dtype=dtype)
    token_valid = torch.ones(4, 1024, dtype=torch.bool) if padded else None
    name = f"G{g} D{d} split{splits}" + (" pad" if padded else "") + (" softcap" if softcap else "")
    _, args, constexprs, options = decode._decode_plan(
        query, pool, pool, slots, page_idx, 1000, d**-0.5, token_valid, 8, softcap, out, splits
    )
    # Compiled for the GPU path (the plan picks fp32 upcasting for CPU tensors, i.e. the interpreter).
    constexprs["UPCAST"] = dtype == torch.float32
    _compile(decode._sparse_decode_kernel, args, constexprs, options, name, dtype)
    table = torch.zeros(n, 300, dtype=torch.int64)
    _, args, constexprs, options = decode._decode_plan(
        query, pool, pool, table, page_idx, 1000, d**-0.5, token_valid, 8, softcap, out, splits, by_page=True
    )
    constexprs["UPCAST"] = dtype == torch.float32
    _compile(decode._sparse_decode_kernel, args, constexprs, options, name + " by-page", dtype)
    if constexprs["SPLIT"]:
        _, args, constexprs, options = decode._combine_plan(args["part_o_ptr"], args["part_lse_ptr"], out)
        _compile(decode._combine_splits_kernel, args, constexprs, options, f"G{g} D{d}", dtype)


@needs_compiler
@pytest.mark.parametrize(
    "dtype, g, d, page, padded",
    [
        pytest.param(torch.bfloat16, 4, 128, 16, True, id="bf16-G4-D128-P16-pad"),
        pytest.param(torch.float32, 3, 64, 8, False, id="fp32-G3-D64-P8"),
        pytest.param(torch.float16, 7, 256, 32, False, id="fp16-G7-D256-P32"),
        pytest.param(torch.bfloat16, 16, 64, 16, False, id="bf16-G16-D64-P16"),
    ],
)
def test_refine_kernels_compile_for_sm90(dtype, g, d, page, padded):
    n, slots_count, c = 16, 1025, 128
    query = torch.empty(n, g, d, dtype=dtype)
    pool = torch.empty(slots_count, page, d, dtype=dtype)
    slots = torch.zeros(n, c, dtype=torch.int64)
    pages = torch.zeros(n, c, dtype=torch.int64)
    lse = torch.empty(n, g, c, dtype=torch.float32)
    token_valid = torch.ones(n, 4096, dtype=torch.bool) if padded else None
    name = f"G{g} D{d} P{page}" + (" pad" if padded else "")
    _, args, constexprs, options = refine._lse_plan(query, pool, slots, pages, 4000, d**-0.5, token_valid, 1, lse)
    _compile(refine._candidate_lse_kernel, args, constexprs, options, name, dtype)
    table = torch.zeros(n, 300, dtype=torch.int64)
    _, args, constexprs, options = refine._lse_plan(query, pool, table, pages, 4000, d**-0.5, token_valid, 1, lse,
                                                    by_page=True)
    _compile(refine._candidate_lse_kernel, args, constexprs, options, name + " by-page", dtype)
    forced = torch.empty(n, c, dtype=torch.float32)
    mass = torch.empty(n, c, dtype=torch.float32)
    _, args, constexprs, options = refine._mass_plan(lse, forced, mass)
    _compile(refine._candidate_mass_kernel, args, constexprs, options, f"G{g} C{c}", dtype)


@needs_compiler
@pytest.mark.parametrize("dtype, with_heads", [pytest.param(torch.bfloat16, True, id="bf16-heads"),
                                               pytest.param(torch.float32, False, id="fp32-all")])
def test_append_kernel_compiles_for_sm90(dtype, with_heads):
    keys = torch.empty(4, 8, 1, 128, dtype=dtype).select(2, 0)
    heads = torch.tensor([0, 3, 5]) if with_heads else None
    slots = torch.zeros(4 * (3 if with_heads else 8), dtype=torch.int64)
    pool = torch.empty(100, 16, 128, dtype=dtype)
    _, args, constexprs, options = append._append_plan(keys, keys, heads, slots, pool, pool, 7)
    _compile(append._append_token_kernel, args, constexprs, options, "heads" if with_heads else "all heads", dtype)


# The integer arguments that change from one decode step (or page) to the next: specialised on their values (1,
# multiples of 16), each would compile new variants inside a timed decode.
PER_STEP_ARGS = {
    append._append_token_kernel: {"offset"},
    score._score_pages_kernel: {"num_pages", "stride_on"},
    decode._sparse_decode_kernel: {"seq_len", "num_entries", "pages_per_split", "tv_len", "stride_pn", "stride_tb"},
    decode._combine_splits_kernel: {"num_splits"},
    refine._candidate_lse_kernel: {"seq_len", "num_cand", "tv_len", "stride_pn", "stride_tb"},
    refine._candidate_mass_kernel: {"num_cand"},
}


@needs_compiler  # under the interpreter the kernels are InterpretedFunctions, which keep no such list
@pytest.mark.parametrize("kernel", list(PER_STEP_ARGS), ids=lambda k: _jit(k).__name__)
def test_per_step_arguments_are_not_specialised(kernel):
    fn = _jit(kernel)
    dns = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    missing = PER_STEP_ARGS[kernel] - dns
    assert not missing, f"{fn.__name__}: specialised on {missing}"

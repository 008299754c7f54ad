"""Compile every Triton kernel for Hopper (sm_90) without a GPU, so compile errors show in CI.

The interpreter (tests/test_kernels.py) runs kernels as Python and misses what only the compiler
rejects (layouts, `tl.dot` shapes and dtypes, constexpr misuse). Each variant here is built from the
same `_*_plan` helper the launcher uses, so the compiled signature is exactly what a launch would
pass. Compiling needs triton imported *without* TRITON_INTERPRET (its `tl.sum`/`tl.max` helpers are
decorated at import); when this process has the interpreter on, the cases skip and
`test_compile_in_fresh_process` runs this file again in a process without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def _compile(kernel, args: dict, constexprs: dict, num_warps: int = 4):
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
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options={"num_warps": num_warps})
    assert "ptx" in compiled.asm and ".target sm_90" in compiled.asm["ptx"]
    assert len(compiled.asm.get("cubin", b"")) > 0
    return compiled


@needs_compiler
@pytest.mark.parametrize(
    "dtype, with_valid, d",
    [
        pytest.param(torch.bfloat16, True, 128, id="bf16-valid-D128"),
        pytest.param(torch.float32, False, 64, id="fp32-D64"),
    ],
)
def test_score_kernel_compiles_for_sm90(dtype, with_valid, d):
    n, g, pcap = 16, 4, 640
    query = torch.empty(n, g, d, dtype=dtype)
    meta = torch.empty(n, pcap, 2 * d, dtype=dtype)
    out = torch.empty(n, 600, dtype=torch.float32)
    valid = torch.ones(n, 600, dtype=torch.bool) if with_valid else None
    _, args, constexprs = score._score_plan(query, meta, 600, valid, out)
    _compile(score._score_pages_kernel, args, constexprs)
    _, args, constexprs = score._score_plan(query, meta, 300, valid, out[:, :300], subpages=2, sink_pages=1)
    _compile(score._score_pages_kernel, args, constexprs)


@needs_compiler
@pytest.mark.parametrize(
    "dtype, g, d, splits, padded, softcap",
    [
        pytest.param(torch.bfloat16, 4, 128, 4, True, None, id="bf16-G4-D128-split-pad"),
        pytest.param(torch.float16, 7, 256, 1, False, 30.0, id="fp16-G7-D256-nosplit-softcap"),
        pytest.param(torch.float32, 1, 64, 2, False, None, id="fp32-G1-D64-split"),
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
    plan = decode._decode_plan(
        query, pool, pool, slots, page_idx, 1000, d**-0.5, token_valid, 8, softcap, out, splits
    )
    _, args, constexprs = plan
    # Compiled for the GPU path (the plan picks fp32 upcasting for CPU tensors, i.e. the interpreter).
    constexprs["UPCAST"] = dtype == torch.float32
    _compile(decode._sparse_decode_kernel, args, constexprs)
    table = torch.zeros(n, 300, dtype=torch.int64)
    _, args, constexprs = decode._decode_plan(
        query, pool, pool, table, page_idx, 1000, d**-0.5, token_valid, 8, softcap, out, splits, by_page=True
    )
    constexprs["UPCAST"] = dtype == torch.float32
    _compile(decode._sparse_decode_kernel, args, constexprs)
    if constexprs["SPLIT"]:
        _, args, constexprs = decode._combine_plan(args["part_o_ptr"], args["part_lse_ptr"], out)
        _compile(decode._combine_splits_kernel, args, constexprs)


@needs_compiler
@pytest.mark.parametrize(
    "dtype, g, d, page, padded",
    [
        pytest.param(torch.bfloat16, 4, 128, 16, True, id="bf16-G4-D128-P16-pad"),
        pytest.param(torch.float32, 3, 64, 8, False, id="fp32-G3-D64-P8"),
        pytest.param(torch.float16, 7, 256, 32, False, id="fp16-G7-D256-P32"),
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
    _, args, constexprs = refine._lse_plan(query, pool, slots, pages, 4000, d**-0.5, token_valid, 1, lse)
    _compile(refine._candidate_lse_kernel, args, constexprs)
    table = torch.zeros(n, 300, dtype=torch.int64)
    _, args, constexprs = refine._lse_plan(query, pool, table, pages, 4000, d**-0.5, token_valid, 1, lse, by_page=True)
    _compile(refine._candidate_lse_kernel, args, constexprs)
    forced = torch.empty(n, c, dtype=torch.float32)
    mass = torch.empty(n, c, dtype=torch.float32)
    _, args, constexprs = refine._mass_plan(lse, forced, mass)
    _compile(refine._candidate_mass_kernel, args, constexprs)


@needs_compiler
@pytest.mark.parametrize("dtype, with_heads", [pytest.param(torch.bfloat16, True, id="bf16-heads"),
                                               pytest.param(torch.float32, False, id="fp32-all")])
def test_append_kernel_compiles_for_sm90(dtype, with_heads):
    keys = torch.empty(4, 8, 1, 128, dtype=dtype).select(2, 0)
    heads = torch.tensor([0, 3, 5]) if with_heads else None
    slots = torch.zeros(4 * (3 if with_heads else 8), dtype=torch.int64)
    pool = torch.empty(100, 16, 128, dtype=dtype)
    _, args, constexprs = append._append_plan(keys, keys, heads, slots, pool, pool, 7)
    _compile(append._append_token_kernel, args, constexprs)

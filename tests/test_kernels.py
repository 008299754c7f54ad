"""Triton kernels against the PyTorch references and against brute force.

On a machine without CUDA the kernels run on CPU tensors under the Triton interpreter. The
interpreter must be on before *triton itself* is imported (triton's own `tl.sum`/`tl.max` helpers
are decorated at import), so this module sets TRITON_INTERPRET=1 before importing it. In a full
test run something else (a transformers model import) has usually imported triton already; then
the CPU cases skip here and `test_interpreter_cases_in_fresh_process` runs this file again in a
fresh process with the interpreter on, failing with that run's output if any case fails.
With CUDA present the same tests run compiled on the GPU (`cuda` marker).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from fc_hf.kernels import append as append_mod  # noqa: E402
from fc_hf.kernels import decode as decode_mod  # noqa: E402
from fc_hf.kernels import bruteforce, dispatch, torch_backend  # noqa: E402
from fc_hf.kernels import refine as refine_mod  # noqa: E402
from fc_hf.kernels import score as score_mod  # noqa: E402

# Kernels can only be interpreted if triton's language helpers were decorated with the interpreter on.
INTERPRET = hasattr(triton.language.sum, "rewriter") and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRET and not hasattr(decode_mod._sparse_decode_kernel, "rewriter"):
    # The kernel modules were imported before the interpreter was switched on: re-decorate them.
    score_mod = importlib.reload(score_mod)
    decode_mod = importlib.reload(decode_mod)
    refine_mod = importlib.reload(refine_mod)
    append_mod = importlib.reload(append_mod)
_CHILD_ENV = "FLEXICACHE_KERNEL_TESTS_CHILD"

score_pages_triton = score_mod.score_pages_triton
sparse_decode_attention_triton = decode_mod.sparse_decode_attention_triton
candidate_mass_triton = refine_mod.candidate_mass_triton
append_token_triton = append_mod.append_token_triton

DEVICES = [
    pytest.param(
        "cpu", id="cpu",
        marks=pytest.mark.skipif(not INTERPRET, reason="triton imported without the interpreter; see the fresh-process test"),
    ),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA without the interpreter"),
        ],
    ),
]


@pytest.mark.skipif(
    INTERPRET or torch.cuda.is_available() or os.environ.get(_CHILD_ENV) == "1",
    reason="the interpreter cases run in this process",
)
def test_interpreter_cases_in_fresh_process():
    """Run this file's CPU cases where triton is imported with the interpreter on from the start."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_ENV: "1"})
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider", "-m", "not cuda", "-k", "cpu"]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"interpreter run failed:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and "no tests ran" not in run.stdout


# Relative-RMS floor per dtype: about two ulps of the output dtype (the interpreter truncates fp32 -> bf16).
FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPE_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.fixture(autouse=True)
def nan_filled_allocations(monkeypatch):
    """Fresh float allocations start as NaN, so an output element a kernel never writes fails the test."""
    original = torch.empty

    def empty(*args, **kwargs):
        t = original(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """`rms(actual - expected) / rms(expected)` in float64; infinite if `actual` has a NaN/inf."""
    a, e = actual.double().cpu(), expected.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def assert_rel_rms(actual, expected, tol, what=""):
    err = rel_rms(actual, expected)
    assert err <= tol, f"{what}: relative RMS error {err:.3e} > {tol:.3e}"


# --------------------------------------------------------------------------------------------------
# Page scoring
# --------------------------------------------------------------------------------------------------

SCORE_CASES = [
    # rows, G, D, num_pages, extra capacity, dtype, page_valid
    pytest.param(1, 1, 64, 1, 0, torch.float32, False, id="N1-G1-D64-Np1-fp32"),
    pytest.param(6, 3, 128, 37, 5, torch.bfloat16, True, id="N6-G3-D128-Np37-valid-bf16"),
    pytest.param(3, 7, 256, 70, 2, torch.float16, False, id="N3-G7-D256-Np70-fp16"),
    pytest.param(4, 4, 64, 130, 7, torch.float32, True, id="N4-G4-D64-Np130-valid-fp32"),
    pytest.param(2, 2, 96, 9, 3, torch.float32, True, id="N2-G2-D96-Np9-valid-fp32"),
]


def _score_inputs(n, g, d, num_pages, extra, dtype, with_valid, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(n, g, d, generator=gen).to(dtype)
    a = torch.randn(n, num_pages, d, generator=gen)
    b = torch.randn(n, num_pages, d, generator=gen)
    kmax, kmin = torch.maximum(a, b).to(dtype), torch.minimum(a, b).to(dtype)
    # Pages beyond num_pages hold NaN: the kernel must never read them.
    meta = torch.full((n, num_pages + extra, 2 * d), float("nan"), dtype=dtype)
    meta[:, :num_pages] = torch_backend.pack_minmax(kmax, kmin)
    valid = None
    if with_valid:
        valid = torch.rand(n, num_pages, generator=gen) > 0.3
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(query), move(meta), move(valid), kmax, kmin


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, g, d, num_pages, extra, dtype, with_valid", SCORE_CASES)
def test_score_pages_matches_reference_and_bruteforce(device, n, g, d, num_pages, extra, dtype, with_valid):
    query, meta, valid, kmax, kmin = _score_inputs(n, g, d, num_pages, extra, dtype, with_valid, device)
    out = score_pages_triton(query, meta, num_pages, valid).cpu()
    ref = torch_backend.score_pages(query.cpu(), meta.cpu(), num_pages, None if valid is None else valid.cpu())
    assert out.shape == (n, num_pages) and out.dtype == torch.float32
    # Forced and masked entries must match exactly; finite ones to fp32 summation-order noise.
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref))
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert torch.isfinite(out[finite]).all()
    if finite.any():
        assert_rel_rms(out[finite], ref[finite], 1e-5, "vs reference")
        brute = bruteforce.score_pages_bruteforce(query.cpu(), kmin, kmax)
        assert_rel_rms(out[finite], brute[finite], 1e-5, "vs brute force")
    assert torch.isposinf(out[:, -1]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("subpages, sink, with_valid", [(2, 1, False), (2, 2, True), (4, 0, False), (1, 3, False)])
def test_score_pages_subpages_and_sink(device, subpages, sink, with_valid):
    """A page's bound is its best sub-page's; the sink is forced in-kernel without padding (with padding the
    selector forces it per row, `force_sink_pages`, so the kernel leaves it)."""
    n, g, d, num_pages = 4, 3, 64, 23
    entries = num_pages * subpages
    query, meta, valid, kmax, kmin = _score_inputs(n, g, d, entries, 5, torch.float32, False, device)
    page_valid = (torch.rand(n, num_pages, generator=torch.Generator().manual_seed(2)) > 0.3) if with_valid else None
    move = None if page_valid is None else page_valid.to(device)
    out = score_pages_triton(query, meta, num_pages, move, subpages, sink).cpu()
    ref = torch_backend.score_pages(query.cpu(), meta.cpu(), num_pages, page_valid, subpages, sink)
    brute = bruteforce.score_pages_bruteforce(query.cpu(), kmin, kmax).view(n, num_pages, subpages).amax(-1)
    if page_valid is not None:
        brute = brute.masked_fill(~page_valid, float("-inf"))
    elif sink:
        brute[:, :sink] = float("inf")
    brute[:, -1] = float("inf")
    for got in (out, ref):
        assert torch.equal(torch.isinf(got), torch.isinf(brute)) and torch.equal(got[torch.isinf(got)], brute[torch.isinf(brute)])
        finite = torch.isfinite(brute)
        assert_rel_rms(got[finite], brute[finite], 1e-5, "vs brute force")


@pytest.mark.parametrize("device", DEVICES)
def test_score_pages_strided_query_and_meta(device):
    """Views into larger buffers (as a cache would pass them) are read through their strides."""
    n, g, d, num_pages = 3, 2, 64, 11
    gen = torch.Generator().manual_seed(1)
    big_q = torch.randn(g, n, 2 * d, generator=gen)
    query = big_q[:, :, :d].transpose(0, 1)  # [N, G, D], non-contiguous
    big_meta = torch.randn(num_pages + 4, n, 2 * d, generator=gen)
    meta = big_meta.transpose(0, 1)  # [N, Pcap, 2D], rows strided
    assert not query.is_contiguous() and not meta.is_contiguous()
    out = score_pages_triton(query.to(device), meta.to(device), num_pages).cpu()
    ref = torch_backend.score_pages(query, meta, num_pages)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out))
    assert_rel_rms(out[finite], ref[finite], 1e-5, "strided")


def test_score_pages_rejects_bad_shapes():
    q = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match=r"meta must be \[N=2, Pcap, 2D=16\], got \(2, 4, 8\)"):
        score_pages_triton(q, torch.zeros(2, 4, 8), 3)  # meta last dim must be 2D
    with pytest.raises(ValueError, match=r"num_pages=5 x subpages=1 outside \[1, 4\]"):
        score_pages_triton(q, torch.zeros(2, 4, 16), 5)  # num_pages > capacity
    with pytest.raises(ValueError, match=r"num_pages=3 x subpages=2 outside \[1, 4\]"):
        score_pages_triton(q, torch.zeros(2, 4, 16), 3, subpages=2)  # entries > capacity
    with pytest.raises(ValueError, match="page_valid must be bool"):
        score_pages_triton(q, torch.zeros(2, 4, 16), 3, torch.ones(2, 3, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------------
# Sparse paged decode attention
# --------------------------------------------------------------------------------------------------


class DecodeCase:
    """A logical KV sequence per row, scattered into NaN-filled pools at randomly permuted slots.

    Attributes mirror `torch_backend.sparse_decode_attention`'s arguments, plus the logical `keys`/`values`
    `[N, num_pages * P, D]` (in the test dtype) for the brute-force check.
    """

    def __init__(self, batch, kv_heads, g, d, page_size, seq_len, budget, dtype, padding, seed=0, unused=2):
        gen = torch.Generator().manual_seed(seed)
        n = batch * kv_heads
        self.n, self.g, self.d, self.page_size, self.seq_len, self.dtype = n, g, d, page_size, seq_len, dtype
        self.rows_per_batch = kv_heads
        self.num_pages = num_pages = -(-seq_len // page_size)
        length = num_pages * page_size
        self.query = torch.randn(n, g, d, generator=gen).to(dtype)
        self.keys = torch.randn(n, length, d, generator=gen).to(dtype)
        self.values = torch.randn(n, length, d, generator=gen).to(dtype)
        # Tokens past seq_len in the last page: zero (the reference multiplies them by 0, NaN would leak).
        self.keys[:, seq_len:] = 0
        self.values[:, seq_len:] = 0
        self.num_slots = num_slots = 1 + n * num_pages + 3
        self.block_table = (torch.randperm(num_slots - 1, generator=gen)[: n * num_pages] + 1).view(n, num_pages)
        self.k_pool = torch.full((num_slots, page_size, d), float("nan"), dtype=dtype)
        self.v_pool = torch.full((num_slots, page_size, d), float("nan"), dtype=dtype)
        self.k_pool[0] = 0  # the null block
        self.v_pool[0] = 0
        self.k_pool[self.block_table.reshape(-1)] = self.keys.reshape(n * num_pages, page_size, d)
        self.v_pool[self.block_table.reshape(-1)] = self.values.reshape(n * num_pages, page_size, d)
        self.token_valid = None
        if padding:
            # Left padding of a different length per sequence; the last sequence (if batch > 1) is fully padded.
            tv = torch.ones(batch, seq_len, dtype=torch.bool)
            for b in range(batch):
                pad = seq_len if (b == batch - 1 and batch > 1) else int(torch.randint(0, seq_len // 2 + 1, (1,), generator=gen))
                tv[b, :pad] = False
            self.token_valid = tv
        # Select the top-`budget` pages with the reference scorer, then append unused (-1) entries and shuffle.
        kmax = self.keys.view(n, num_pages, page_size, d).float().amax(2)
        kmin = self.keys.view(n, num_pages, page_size, d).float().amin(2)
        scores = torch_backend.score_pages(self.query, torch_backend.pack_minmax(kmax, kmin), num_pages)
        sel = torch_backend.select_topk(scores, budget)
        sel = torch.cat([sel, torch.full((n, unused), -1, dtype=sel.dtype)], dim=1)
        perm = torch.argsort(torch.rand(sel.shape, generator=gen), dim=1)
        self.page_idx = sel.gather(1, perm)
        self.slots = torch.where(self.page_idx >= 0, self.block_table.gather(1, self.page_idx.clamp_min(0)), 0)

    def args(self, device, index_dtype=torch.int64):
        tv = None if self.token_valid is None else self.token_valid.to(device)
        return (
            self.query.to(device), self.k_pool.to(device), self.v_pool.to(device),
            self.slots.to(device, index_dtype), self.page_idx.to(device, index_dtype), self.seq_len,
            self.d ** -0.5, tv, self.rows_per_batch,
        )

    def allowed(self) -> torch.Tensor:
        """`[N, num_pages * P]`: tokens of selected pages, inside the sequence, not padding (brute force)."""
        length = self.num_pages * self.page_size
        pos = torch.arange(length)
        selected = torch.zeros(self.n, self.num_pages, dtype=torch.bool)
        rows, cols = (self.page_idx >= 0).nonzero(as_tuple=True)
        selected[rows, self.page_idx[rows, cols]] = True
        ok = selected.repeat_interleave(self.page_size, dim=1) & (pos < self.seq_len)
        if self.token_valid is not None:
            tv = torch.zeros(self.token_valid.shape[0], length, dtype=torch.bool)
            tv[:, : self.seq_len] = self.token_valid[:, : self.seq_len]
            ok &= tv[torch.arange(self.n) // self.rows_per_batch]
        return ok

    def bruteforce(self, softcap=None) -> torch.Tensor:
        if softcap is None:
            return bruteforce.dense_attention_bruteforce(self.query, self.keys, self.values, self.allowed(), self.d ** -0.5)
        q, k, v = self.query.double(), self.keys.double(), self.values.double()
        logits = torch.einsum("ngd,nld->ngl", q, k) * self.d ** -0.5
        logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~self.allowed()[:, None, :], float("-inf"))
        probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
        return torch.einsum("ngl,nld->ngd", probs, v).float()


DECODE_CASES = [
    # batch, KV heads, G, D, page size, seq_len, budget (pages), dtype, padding, softcap
    pytest.param(1, 1, 1, 64, 16, 37, 2, torch.float32, False, None, id="B1-H1-G1-D64-P16-L37-K2-fp32"),
    pytest.param(3, 2, 3, 128, 16, 100, 4, torch.bfloat16, True, None, id="B3-H2-G3-D128-P16-L100-K4-pad-bf16"),
    pytest.param(1, 2, 7, 256, 16, 50, 3, torch.float16, False, None, id="B1-H2-G7-D256-P16-L50-K3-fp16"),
    pytest.param(3, 1, 4, 64, 5, 23, 3, torch.float32, True, None, id="B3-H1-G4-D64-P5-L23-K3-pad-fp32"),
    pytest.param(1, 2, 3, 64, 16, 200, 9, torch.bfloat16, False, 20.0, id="B1-H2-G3-D64-P16-L200-K9-softcap-bf16"),
    pytest.param(3, 2, 1, 128, 8, 77, 5, torch.float32, True, None, id="B3-H2-G1-D128-P8-L77-K5-pad-fp32"),
    pytest.param(1, 1, 7, 128, 16, 16, 4, torch.float32, False, None, id="B1-H1-G7-D128-P16-L16-K4-onepage-fp32"),
    pytest.param(1, 3, 3, 64, 32, 133, 3, torch.float16, True, 30.0, id="B1-H3-G3-D64-P32-L133-K3-pad-softcap-fp16"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["split1", "split3"])
@pytest.mark.parametrize("batch, kv_heads, g, d, page_size, seq_len, budget, dtype, padding, softcap", DECODE_CASES)
def test_sparse_decode_matches_reference_and_bruteforce(
    device, num_splits, batch, kv_heads, g, d, page_size, seq_len, budget, dtype, padding, softcap
):
    case = DecodeCase(batch, kv_heads, g, d, page_size, seq_len, budget, dtype, padding)
    out = sparse_decode_attention_triton(*case.args(device), softcap, num_splits=num_splits)
    assert out.shape == (case.n, g, d) and out.dtype == dtype and out.device.type == device
    out = out.cpu()
    ref = torch_backend.sparse_decode_attention(*case.args("cpu"), softcap)
    brute = case.bruteforce(softcap)
    # flash-attention's rule: the kernel may be at most ~2x as far from the fp64 truth as the
    # same-dtype PyTorch reference, plus a floor of about two output ulps.
    ref_err = rel_rms(ref, brute)
    assert_rel_rms(out, brute, 2 * ref_err + FLOOR[dtype], "vs brute force")
    assert_rel_rms(out, ref.float(), 3 * ref_err + FLOOR[dtype], "vs reference")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["split1", "split3"])
def test_sparse_decode_writes_into_a_given_span(device, num_splits):
    """`out=`: the result lands in a span of a larger buffer (as a layer's output), nothing else is touched."""
    case = DecodeCase(1, 3, 3, 64, 16, 150, 4, torch.float32, False, unused=0)
    expected = sparse_decode_attention_triton(*case.args(device), num_splits=num_splits)
    buffer = torch.full((case.n + 2, 3, 64), float("nan"), device=device)
    got = sparse_decode_attention_triton(*case.args(device), num_splits=num_splits, out=buffer[1 : case.n + 1])
    assert got.data_ptr() == buffer[1].data_ptr()
    assert torch.equal(buffer[1 : case.n + 1], expected)
    assert torch.isnan(buffer[0]).all() and torch.isnan(buffer[-1]).all()
    with pytest.raises(ValueError, match="out must be"):
        sparse_decode_attention_triton(*case.args(device), out=buffer[: case.n].double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
def test_slots_looked_up_in_the_block_table(device, padding):
    """`table=`: the decode and refinement kernels look each page's slot up themselves (unused -1 entries read
    nothing) and give exactly what they give from gathered slots; the PyTorch backend gathers them the same way."""
    case = DecodeCase(2, 2, 3, 64, 16, 150, 4, torch.float32, padding, unused=2)
    query, k_pool, v_pool, slots, pages, seq_len, scaling, tv, rpb = case.args(device)
    table = case.block_table.to(device)
    by_slots = sparse_decode_attention_triton(query, k_pool, v_pool, slots, pages, seq_len, scaling, tv, rpb)
    by_table = sparse_decode_attention_triton(query, k_pool, v_pool, None, pages, seq_len, scaling, tv, rpb,
                                              table=table)
    assert torch.equal(by_table, by_slots)
    args = case.args("cpu")
    ref = torch_backend.sparse_decode_attention(args[0], args[1], args[2], None, *args[4:], table=case.block_table)
    assert torch.equal(ref, torch_backend.sparse_decode_attention(*args))
    cand = torch.stack([torch.randperm(case.num_pages, generator=torch.Generator().manual_seed(r))[:5]
                        for r in range(case.n)]).to(device)
    forced = torch.zeros(case.n, 5, device=device)
    mass_slots = candidate_mass_triton(query, k_pool, table.gather(1, cand), cand, seq_len, scaling, forced, tv, rpb)
    mass_table = candidate_mass_triton(query, k_pool, None, cand, seq_len, scaling, forced, tv, rpb, table=table)
    assert torch.equal(mass_table, mass_slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_sparse_decode_all_pages_equals_dense(device, index_dtype):
    """With every page selected the result is dense attention over the whole (padded) sequence."""
    case = DecodeCase(3, 2, 4, 64, 16, 90, 100, torch.float32, True, unused=0)
    assert (case.page_idx >= 0).sum(1).eq(case.num_pages).all()
    out = sparse_decode_attention_triton(*case.args(device, index_dtype), num_splits=2).cpu()
    length = case.num_pages * case.page_size
    tv = torch.zeros(3, length, dtype=torch.bool)
    tv[:, : case.seq_len] = case.token_valid
    dense = bruteforce.dense_attention_bruteforce(
        case.query, case.keys, case.values, tv[torch.arange(case.n) // case.rows_per_batch], case.d ** -0.5
    )
    assert_rel_rms(out, dense, FLOOR[torch.float32], "vs dense")


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_decode_never_reads_masked_tokens(device):
    """NaN past seq_len and in the slots of unused (-1) entries must not leak into the output."""
    case = DecodeCase(1, 2, 3, 64, 16, 41, 3, torch.float32, False)
    expected = case.bruteforce()
    last = case.block_table[:, -1]
    case.k_pool[last, 41 % 16 :] = float("nan")  # garbage after seq_len in the partial last page
    case.v_pool[last, 41 % 16 :] = float("nan")
    owned = set(case.block_table.reshape(-1).tolist()) | {0}
    spare = next(s for s in range(case.num_slots) if s not in owned)  # a slot nobody owns, still NaN
    assert torch.isnan(case.k_pool[spare]).all()
    case.slots = torch.where(case.page_idx >= 0, case.slots, spare)  # unused entries point at garbage
    out = sparse_decode_attention_triton(*case.args(device), num_splits=2).cpu()
    assert_rel_rms(out, expected, FLOOR[torch.float32], "garbage masked")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2], ids=["split1", "split2"])
def test_sparse_decode_fully_masked_row_is_zero(device, num_splits):
    case = DecodeCase(2, 2, 3, 64, 16, 70, 3, torch.bfloat16, True)  # sequence 1 is fully padded
    assert not case.token_valid[1].any() and case.token_valid[0].any()
    out = sparse_decode_attention_triton(*case.args(device), num_splits=num_splits).cpu()
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert out[:2].abs().sum() > 0
    # A row whose entries are all unused (-1) also returns zeros.
    case.page_idx[0] = -1
    out = sparse_decode_attention_triton(*case.args(device), num_splits=num_splits).cpu()
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_decode_strided_pools(device):
    """Pools that are views of a `[S, P, H, D]` buffer (one head's slice) are read through their strides."""
    case = DecodeCase(1, 2, 2, 64, 16, 60, 2, torch.float32, False)
    s, p, d = case.k_pool.shape
    big_k = torch.full((s, p, 3, d), float("nan"))
    big_v = torch.full((s, p, 3, d), float("nan"))
    big_k[:, :, 1], big_v[:, :, 1] = case.k_pool, case.v_pool
    args = list(case.args(device))
    args[1], args[2] = big_k.to(device)[:, :, 1], big_v.to(device)[:, :, 1]
    assert not args[1].is_contiguous()
    out = sparse_decode_attention_triton(*args, num_splits=2).cpu()
    assert_rel_rms(out, case.bruteforce(), FLOOR[torch.float32], "strided pools")


def test_sparse_decode_rejects_bad_inputs():
    case = DecodeCase(1, 1, 2, 64, 16, 20, 2, torch.float32, False)
    args = list(case.args("cpu"))
    with pytest.raises(ValueError, match="slots and the page list must both be"):
        sparse_decode_attention_triton(args[0], args[1], args[2], args[3][:, :1], *args[4:])  # slots/page_idx mismatch
    with pytest.raises(TypeError, match="must be int32 or int64"):
        sparse_decode_attention_triton(args[0], args[1], args[2], args[3].float(), args[4].float(), *args[5:])
    with pytest.raises(ValueError, match="do not match head_dim 32"):
        sparse_decode_attention_triton(args[0][:, :, :32], *args[1:])  # head_dim mismatch


# --------------------------------------------------------------------------------------------------
# Refinement: exact mass of candidate pages
# --------------------------------------------------------------------------------------------------

MASS_CASES = [
    # batch, KV heads, G, D, page size, seq_len, candidates (pages), dtype, padding
    pytest.param(1, 1, 1, 64, 16, 37, 3, torch.float32, False, id="B1-H1-G1-D64-P16-L37-C3-fp32"),
    pytest.param(3, 2, 3, 128, 16, 100, 5, torch.bfloat16, True, id="B3-H2-G3-D128-P16-L100-C5-pad-bf16"),
    pytest.param(1, 2, 7, 64, 8, 150, 12, torch.float16, False, id="B1-H2-G7-D64-P8-L150-C12-fp16"),
    pytest.param(3, 1, 4, 64, 5, 23, 4, torch.float32, True, id="B3-H1-G4-D64-P5-L23-C4-pad-fp32"),
    pytest.param(1, 3, 3, 64, 16, 700, 20, torch.float32, False, id="B1-H3-G3-D64-P16-L700-C20-fp32"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch, kv_heads, g, d, page_size, seq_len, cands, dtype, padding", MASS_CASES)
def test_candidate_mass_matches_reference_and_bruteforce(device, batch, kv_heads, g, d, page_size, seq_len, cands,
                                                         dtype, padding):
    """Refinement's two kernels against the PyTorch reference and the literal formula, forced candidates included."""
    case = DecodeCase(batch, kv_heads, g, d, page_size, seq_len, cands, dtype, padding, unused=0)
    gen = torch.Generator().manual_seed(7)
    forced = torch.randn(case.n, case.page_idx.shape[1], generator=gen)
    forced[:, 0] = float("inf")  # a forced page (e.g. the sink) and an all-padding one
    forced[:, -1] = float("-inf")
    query, k_pool, _, slots, pages, _, scaling, tv, rpb = case.args(device)
    out = candidate_mass_triton(query, k_pool, slots, pages, seq_len, scaling, forced.to(device), tv, rpb)
    assert out.shape == pages.shape and out.dtype == torch.float32 and out.device.type == device
    out = out.cpu()
    ref = torch_backend.candidate_mass(*[a.cpu() if torch.is_tensor(a) else a for a in (query, k_pool, slots, pages)],
                                       seq_len, scaling, forced, case.token_valid, rpb)
    allowed = torch.arange(case.num_pages * page_size) < seq_len
    allowed = allowed.expand(case.n, -1).clone()
    if case.token_valid is not None:
        tv_rows = case.token_valid[torch.arange(case.n) // rpb]
        allowed[:, :seq_len] &= tv_rows
    brute = bruteforce.candidate_mass_bruteforce(case.query, case.keys, allowed, case.page_idx, page_size, scaling,
                                                 forced)
    inf = torch.isinf(brute)
    assert torch.equal(out[inf], brute[inf]) and torch.equal(ref[inf], brute[inf])
    # Masses are fp32 sums of fp32 softmax terms whatever the KV dtype: both within fp32 rounding of the truth.
    torch.testing.assert_close(out[~inf], brute[~inf], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ref[~inf], brute[~inf], rtol=1e-4, atol=1e-6)
    if padding and batch > 1:  # the fully padded sequence: no token, mass 0 (not NaN) outside forced entries
        last = slice((batch - 1) * kv_heads, batch * kv_heads)
        assert (out[last][~inf[last]] == 0).all()


def test_candidate_mass_rejects_bad_inputs():
    q = torch.randn(2, 3, 16)
    pool = torch.randn(5, 4, 16)
    slots = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="forced"):
        candidate_mass_triton(q, pool, slots, slots, 10, 1.0, torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="slots and the page list"):
        candidate_mass_triton(q, pool, slots, slots[:, :2], 10, 1.0, torch.zeros(2, 3))


# --------------------------------------------------------------------------------------------------
# Decode append
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [None, [2, 0], [1]], ids=["all", "two-of-three", "one"])
def test_append_token_matches_reference(device, dtype, heads):
    """One launch writes exactly what the reference's index_copy_/index_put_ write, and nothing else."""
    gen = torch.Generator().manual_seed(5)
    batch, num_heads, d, dv, page, slots_count = 2, 3, 64, 32, 8, 20
    step_k = torch.randn(batch, num_heads, 1, d, generator=gen).to(dtype)  # the model's [B, H, 1, D]
    step_v = torch.randn(batch, num_heads, 1, dv, generator=gen).to(dtype)
    head_index = None if heads is None else torch.tensor(heads)
    rows = batch * (num_heads if heads is None else len(heads))
    slots = 1 + torch.randperm(slots_count - 1, generator=gen)[:rows]
    pools = [torch.randn(slots_count, page, dim, generator=gen).to(dtype) for dim in (d, dv)]
    expected = [p.clone() for p in pools]
    torch_backend.append_token(step_k.select(2, 0), step_v.select(2, 0), head_index, slots, *expected, 5)
    got = [p.clone().to(device) for p in pools]
    append_token_triton(step_k.to(device).select(2, 0), step_v.to(device).select(2, 0),
                        None if head_index is None else head_index.to(device), slots.to(device), *got, 5)
    for g, e in zip(got, expected):
        assert torch.equal(g.cpu(), e)
    assert not torch.equal(expected[0], pools[0])  # the reference did write


def test_append_token_rejects_bad_inputs():
    k = torch.randn(1, 2, 16)
    pool = torch.randn(4, 8, 16)
    with pytest.raises(ValueError, match="slots"):
        append_token_triton(k, k, None, torch.ones(3, dtype=torch.long), pool, pool, 0)
    with pytest.raises(ValueError, match="offset"):
        append_token_triton(k, k, None, torch.ones(2, dtype=torch.long), pool, pool, 8)
    with pytest.raises(TypeError, match="dtype"):
        append_token_triton(k.double(), k.double(), None, torch.ones(2, dtype=torch.long), pool, pool, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_pipeline_triton_equals_torch(device):
    """score -> top-K -> slots -> sparse attention through `dispatch` with each backend forced."""
    case = DecodeCase(3, 2, 3, 64, 16, 150, 100, torch.float32, True, unused=0)
    n, num_pages = case.n, case.num_pages
    kmax = case.keys.view(n, num_pages, 16, 64).amax(2)
    kmin = case.keys.view(n, num_pages, 16, 64).amin(2)
    meta = torch_backend.pack_minmax(kmax, kmin)
    results = {}
    for backend in ("torch", "triton"):
        dev = "cpu" if backend == "torch" else device
        scores = dispatch.score_pages(case.query.to(dev), meta.to(dev), num_pages, backend=backend)
        sel = dispatch.select_topk(scores, 4, backend=backend)
        slots = case.block_table.to(dev).gather(1, sel)
        args = list(case.args(dev))
        args[3], args[4] = slots, sel
        results[backend] = (sel.sort(1).values.cpu(), dispatch.sparse_decode_attention(*args, backend=backend).cpu())
    assert torch.equal(results["torch"][0], results["triton"][0])
    assert_rel_rms(results["triton"][1], results["torch"][1], FLOOR[torch.float32], "dispatch")


@pytest.mark.parametrize("device", DEVICES)
def test_cache_generate_triton_backend_matches_torch(device):
    """The kernels inside the real cache: greedy generation with a sparse budget, left padding and a
    mixed stable/unstable profile gives the same tokens and logits with either backend."""
    from conftest import left_padded_batch, tiny_model

    from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile

    model = tiny_model("llama", layers=1).to(device)  # the interpreter is slow: one layer, three decode steps
    ids, mask = left_padded_batch(2, 45, pad_lengths=[0, 7])
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])  # head 0 unstable, head 1 stable (tiered)
    runs = {}
    for backend in ("torch", "triton"):
        cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3, backend=backend)
        cache = FlexiCache(model.config, cfg, profile=profile)
        with torch.no_grad():
            runs[backend] = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=cache, do_sample=False,
                max_new_tokens=4, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
        assert cache.stats()["decode_steps"] == 3
    assert torch.equal(runs["torch"].sequences, runs["triton"].sequences)
    for a, b in zip(runs["triton"].logits, runs["torch"].logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Benchmark script (tiny CPU run: the table and JSON come out and the sanity check holds)
# --------------------------------------------------------------------------------------------------


def test_bench_kernels_smoke(tmp_path, capsys):
    from fc_hf.eval.bench import kernels as bench_kernels

    out = tmp_path / "bench.json"
    argv = [
        "--device", "cpu", "--context", "300", "--batch", "1", "2", "--budget", "64", "128",
        "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32", "--cpu-iters", "1", "--out", str(out),
    ]
    assert bench_kernels.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["backend"] == "torch" and data["meta"]["dtype"] == "fp32"
    assert [(r["batch"], r["budget"]) for r in data["records"]] == [(1, 64), (1, 128), (2, 64), (2, 128)]
    assert data["checks"]["all_pages_vs_sdpa"] < 1e-5 and data["checks"]["topk_vs_reference"] < 1e-6
    for r in data["records"]:
        assert r["pages_per_head"] == r["budget"] // 16
        assert all(r[k] > 0 for k in ("dense_ms", "rerank_all_ms", "stable_aware_ms", "stable_select_ms"))
        # Amortisation is arithmetic on the measured parts: check it, not the (noisy) timings.
        expected = r["unstable_select_ms"] + r["stable_select_ms"] / 16 + r["groups_attend_ms"]
        assert abs(r["stable_aware_ms"] - expected) < 1e-9
    assert "dense/RA" in capsys.readouterr().out

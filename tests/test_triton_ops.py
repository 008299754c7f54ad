"""The Triton kernels of the decode step (`kernels/triton_ops.py`, custom ops `flexicache::page_scores` and
`flexicache::attention`) against the PyTorch backend and the brute-force oracles (issue 49).

Without CUDA the kernels run on CPU tensors under Triton's interpreter. The interpreter has to be on when `triton`
itself is first imported (its `tl.max`/`tl.sum` helpers are decorated then), so this module sets TRITON_INTERPRET=1
before it imports triton and `triton_ops` (at collection, before any test has run) and leaves it set (see
`_import_ops`). When something in this process imported triton without it first, the kernel cases skip here and
`test_interpreter_cases_in_fresh_process` runs this file again in a fresh process with the interpreter on. With CUDA the
same cases run compiled on the GPU. `test_kernels_compile_for_sm90` builds the kernels for Hopper without a GPU (the
interpreter does not check what only the compiler rejects, and runs bf16 dots in fp32: see `triton_ops._dot_fp32`),
in a process without the interpreter.

Covered: random shapes with GQA groups (G = 1 to 8, padded to 16 rows inside), head dims that are not powers of two,
sub-pages S = 1 to 4 (3: a padded page), more pages than one program's block, non-contiguous inputs, -inf and +inf
biases, a bias per query head `[n, G, M]`, softcap, token splits (the combine kernel) and single-pass launches, rows
and splits with no attendable token, fp32 / bf16 / fp16; the fake implementations (FakeTensorMode, meta tensors,
`torch.library.opcheck`); a compiled function (`fullgraph=True`, aot_eager) keeps each op as one node; dispatch routes
to the ops only on the Triton backend; FlexiCache imports and decodes without triton; `generate` with every op on the
Triton backend, eager and compiled, gives the PyTorch path's tokens.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fc_hf.kernels import bruteforce, dispatch, torch_backend

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
_CHILD_ENV = "FLEXICACHE_TRITON_OPS_CHILD"
ROOT = Path(__file__).resolve().parents[1]


def _import_ops():
    """`(triton, triton_ops)`; `(None, None)` without triton. On a CPU, when nothing imported triton yet, it is imported
    under the interpreter, and TRITON_INTERPRET=1 stays set for the process: triton reads it again whenever it imports
    more of itself (at a launch), and asserts that it agrees with how `triton.language` was decorated."""
    if not CUDA and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        from fc_hf.kernels import triton_ops
    except ImportError:
        return None, None
    return triton, triton_ops


triton, ops = _import_ops()
# Kernels run here when both triton's language helpers and our kernels are interpreted (CPU), or neither is (CUDA).
LANG_INTERPRETED = triton is not None and not isinstance(triton.language.sum, triton.runtime.JITFunction)
IN_PROCESS = ops is not None and ops.interpreted() == LANG_INTERPRETED and (CUDA or LANG_INTERPRETED)
kernels_here = pytest.mark.skipif(not IN_PROCESS, reason="triton is missing, or was imported without the "
                                  "interpreter before this module: see test_interpreter_cases_in_fresh_process")


@pytest.fixture
def triton_ops():
    pytest.importorskip("triton")
    return ops


@pytest.fixture(params=["triton", "native"])
def fused_ops(request):
    """The module of one fused backend's ops (same names, same contracts): the Triton kernels where they run in this
    process, the C++ CPU kernels (`native_ops`) where they build, on a CPU, and not in the interpreter's child process
    (the parent runs them)."""
    if request.param == "triton":
        if not IN_PROCESS:
            pytest.skip("triton is missing, or was imported without the interpreter before this module: see "
                        "test_interpreter_cases_in_fresh_process")
        return ops
    if CUDA or os.environ.get(_CHILD_ENV) == "1":
        pytest.skip("the C++ kernels are CPU ones; the interpreter's child process leaves them to its parent")
    from fc_hf.kernels import native_ops

    if not native_ops.available():
        pytest.skip(f"the C++ kernels did not build: {native_ops.build_error()}")
    return native_ops


def _raw_ops(fused_ops):
    """The backend's op namespace (`torch.ops.flexicache` or `torch.ops.flexicache_cpu`): the ops without their
    Python wrappers, for opcheck and graph nodes."""
    return getattr(torch.ops, fused_ops.OPS_NAMESPACE)


@pytest.fixture(autouse=True)
def nan_filled_allocations(monkeypatch):
    """Fresh float allocations start as NaN, so an output element a kernel never writes fails the comparisons
    (NaN is only ever expected where the reference has NaN too)."""
    original = torch.empty

    def empty(*args, **kwargs):
        t = original(*args, **kwargs)
        if t.is_floating_point() and t.device.type != "meta" and not isinstance(t, torch._subclasses.FakeTensor):
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(autouse=True)
def quiet_interpreter():
    """The interpreter runs the kernels in NumPy, which warns at the -inf / NaN the masked cases produce on purpose."""
    import numpy as np

    with np.errstate(all="ignore"):
        yield


@pytest.mark.skipif(triton is None or IN_PROCESS or CUDA or os.environ.get(_CHILD_ENV) == "1",
                    reason="the kernel cases run in this process (or triton is missing)")
def test_interpreter_cases_in_fresh_process():
    """Run this file where triton is first imported with the interpreter on."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_ENV: "1"})
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider",
           "-k", "not fresh_process and not sm90 and not stays_optional and not native"]  # the C++ cases: this process
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"interpreter run failed:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-3000:]


# --------------------------------------------------------------------------------------------------
# Page scores
# --------------------------------------------------------------------------------------------------

def _score_inputs(n, g, d, pages, s, dtype, layout, seed):
    """`(query [n, G, D], meta [n, 2D, E], bias [n, E], kmin, kmax [n, E, D])`, E = pages * S. The bias mixes 0,
    finite offsets, -inf and +inf; row 0's first page has every entry at -inf, its second (S > 1) one +inf entry and
    one -inf entry. `layout`: "strided" makes meta a slice of a wider tensor and the query a transposed view."""
    gen = torch.Generator().manual_seed(seed)
    e = pages * s
    query = torch.randn(n, g, d, generator=gen).to(dtype)
    a, b = torch.randn(n, e, d, generator=gen), torch.randn(n, e, d, generator=gen)
    kmax, kmin = torch.maximum(a, b).to(dtype), torch.minimum(a, b).to(dtype)
    meta = torch.cat([kmax, kmin], dim=2).transpose(1, 2)  # [n, 2D, E]
    if layout == "strided":
        wide = torch.full((n, 2 * d, e + 7), float("nan"), dtype=dtype)  # the columns past E must never be read
        wide[:, :, :e] = meta
        meta = wide[:, :, :e]
        query = query.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        meta = meta.contiguous()
    u = torch.rand(n, e, generator=gen)
    bias = torch.where(u < 0.6, 0.0, torch.randn(n, e, generator=gen))
    bias = bias.masked_fill(u > 0.9, float("-inf")).masked_fill((u > 0.85) & (u <= 0.9), float("inf"))
    bias[0, :s] = float("-inf")
    bias[-1, -s:] = 0.0  # at least one finite score
    if s > 1 and pages > 1:
        bias[0, s], bias[0, s + 1] = float("inf"), float("-inf")
    return query, meta, bias, kmin, kmax


SCORE_CASES = [
    # n, G, D, pages, S, dtype, layout
    pytest.param(2, 1, 16, 1, 1, torch.float32, "contiguous", id="n2-G1-D16-P1-S1-fp32"),
    pytest.param(3, 4, 64, 37, 2, torch.bfloat16, "contiguous", id="n3-G4-D64-P37-S2-bf16"),
    pytest.param(2, 3, 40, 130, 1, torch.float32, "contiguous", id="n2-G3-D40-P130-S1-fp32-two-blocks"),
    pytest.param(4, 8, 128, 50, 4, torch.float16, "contiguous", id="n4-G8-D128-P50-S4-fp16"),
    pytest.param(2, 2, 32, 45, 3, torch.float32, "strided", id="n2-G2-D32-P45-S3-fp32-strided"),
    pytest.param(5, 7, 24, 20, 2, torch.bfloat16, "strided", id="n5-G7-D24-P20-S2-bf16-strided"),
]


@pytest.mark.parametrize("n, g, d, pages, s, dtype, layout", SCORE_CASES)
def test_page_scores_matches_backend_and_bruteforce(fused_ops, n, g, d, pages, s, dtype, layout):
    query, meta, bias, kmin, kmax = _score_inputs(n, g, d, pages, s, dtype, layout, seed=n * 100 + d)
    dev = [t.to(DEVICE) for t in (query, meta, bias)]
    out = fused_ops.page_scores(*dev, s).cpu()
    ref = torch_backend.page_scores(query, meta, bias, s)
    oracle = (bruteforce.score_pages_bruteforce(query, kmin, kmax) + bias).view(n, pages, s).amax(-1)
    assert out.shape == (n, pages) and out.dtype == torch.float32
    for expected in (ref, oracle):
        # Forced and never-attendable pages exactly; the rest to fp32 summation order (the 16-bit entries are
        # upcast, so their products are exact in every implementation).
        assert torch.equal(torch.isposinf(out), torch.isposinf(expected))
        assert torch.equal(torch.isneginf(out), torch.isneginf(expected))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6 * d)
    finite = torch.isfinite(ref)
    _record(f"page_scores, {fused_ops.BACKEND} vs backend", dtype, (out[finite] - ref[finite]).abs().max().item())
    _record(f"page_scores, {fused_ops.BACKEND} vs oracle", dtype,
            (out[finite].double() - oracle[finite].double()).abs().max().item())
    assert torch.isneginf(out[0, 0]) and (s == 1 or pages == 1 or torch.isposinf(out[0, 1]))


@kernels_here
def test_page_scores_dispatch_matches_backend(triton_ops):
    """dispatch.page_scores on the Triton backend is the op, with the backend's results."""
    query, meta, bias, _, _ = _score_inputs(2, 4, 32, 9, 2, torch.float32, "contiguous", seed=5)
    dev = [t.to(DEVICE) for t in (query, meta, bias)]
    out = dispatch.page_scores(*dev, 2, backend="triton").cpu()
    torch.testing.assert_close(out, torch_backend.page_scores(query, meta, bias, 2), rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Decode attention
# --------------------------------------------------------------------------------------------------

def _attention_inputs(n, g, d, dv, m, dtype, per_query, masks, seed, qdtype=None, q_scale=1.0):
    """`(query, keys, values, bias)`: ~30% of tokens at -inf. `masks` adds: "row" (row 0 masked everywhere: NaN
    expected), "head" (one query head of row 0 masked, with a per-query bias), "prefix" (each row's first 70 tokens
    masked: with splits of 64 tokens the first split of a row has none)."""
    gen = torch.Generator().manual_seed(seed)
    query = (torch.randn(n, g, d, generator=gen) * q_scale).to(qdtype or dtype)
    keys = torch.randn(n, m, d, generator=gen).to(dtype)
    values = torch.randn(n, m, dv, generator=gen).to(dtype)
    shape = (n, g, m) if per_query else (n, m)
    bias = torch.zeros(shape).masked_fill(torch.rand(shape, generator=gen) < 0.3, float("-inf"))
    bias[..., -1] = 0.0  # the step's own token
    if "row" in masks:
        bias[0] = float("-inf")
    if "head" in masks:
        bias[0, g - 1] = float("-inf")
    if "prefix" in masks:
        bias[..., :70] = float("-inf")
    return query, keys, values, bias


ATTENTION_CASES = [
    # n, G, D, Dv, M, dtype, per-query bias, softcap, masks, split on the interpreter (4 programs)
    pytest.param(1, 1, 16, 16, 5, torch.float32, False, None, (), False, id="n1-G1-D16-M5-fp32"),
    pytest.param(1, 4, 64, 64, 200, torch.float32, False, None, ("prefix",), True, id="n1-G4-D64-M200-fp32-prefix"),
    pytest.param(2, 3, 40, 24, 300, torch.bfloat16, True, None, ("head",), True, id="n2-G3-D40-Dv24-M300-bf16-perq"),
    pytest.param(6, 8, 128, 128, 96, torch.float16, False, None, ("row",), False, id="n6-G8-D128-M96-fp16-row"),
    pytest.param(3, 2, 32, 32, 130, torch.float32, False, 5.0, ("row",), True, id="n3-G2-D32-M130-fp32-softcap"),
    pytest.param(2, 4, 64, 64, 150, torch.bfloat16, True, 30.0, (), True, id="n2-G4-D64-M150-bf16-softcap-perq"),
    pytest.param(2, 2, 256, 256, 70, torch.bfloat16, False, None, ("row",), True, id="n2-G2-D256-M70-bf16-row"),
    pytest.param(1, 2, 256, 192, 40, torch.float32, False, None, (), True, id="n1-G2-D256-Dv192-M40-fp32"),
]
# Error against float64 that both implementations must stay within (max abs over finite outputs, |out| <~ 1).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
MAX_ERR: dict = {}  # largest errors seen, per check and dtype (printed with -s)


def _record(what, dtype, err):
    MAX_ERR[what, dtype] = max(MAX_ERR.get((what, dtype), 0.0), err)


def _finite_err(actual, expected):
    ok = ~torch.isnan(expected)
    return (actual.double()[ok] - expected.double()[ok]).abs().max().item() if ok.any() else 0.0


@pytest.mark.parametrize("n, g, d, dv, m, dtype, per_query, softcap, masks, split", ATTENTION_CASES)
def test_attention_matches_backend_and_bruteforce(fused_ops, n, g, d, dv, m, dtype, per_query, softcap, masks,
                                                  split):
    q_scale = 4.0 if softcap else 1.0  # logits beyond the cap, so tanh saturates
    query, keys, values, bias = _attention_inputs(n, g, d, dv, m, dtype, per_query, masks, seed=m + d, q_scale=q_scale)
    scaling = d ** -0.5
    if not CUDA and fused_ops.BACKEND == "triton":  # the case's split is what the test means to cover
        out_buf = torch.empty(n, g, dv, dtype=dtype)
        launches = fused_ops._attention_launches(query, keys, values, bias, scaling, softcap, out_buf)
        assert (len(launches) == 2) == split
    out = fused_ops.attention(*(t.to(DEVICE) for t in (query, keys, values, bias)), scaling, softcap).cpu()
    ref = torch_backend.attention(query, keys, values, bias, scaling, softcap)
    exact = torch_backend.attention(query.double(), keys.double(), values.double(), bias.double(), scaling, softcap)
    assert out.shape == (n, g, dv) and out.dtype == dtype

    # NaN exactly where the backend has it: query heads with no attendable token.
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isnan(ref), torch.isnan(exact))
    if "row" in masks:
        assert torch.isnan(out[0]).all()
    if "head" in masks:
        assert torch.isnan(out[0, g - 1]).all() and not torch.isnan(out[0, : g - 1]).any()
    assert not torch.isinf(out).any() and not torch.isnan(ref).all()

    err, err_ref = _finite_err(out, exact), _finite_err(ref, exact)
    _record(f"attention, {fused_ops.BACKEND} vs float64", dtype, err)
    _record("attention, backend vs float64", dtype, err_ref)
    assert err <= TOL[dtype], f"{fused_ops.BACKEND} vs float64: {err:.2e} (backend {err_ref:.2e})"
    # No worse than the backend, give or take one rounding of the output (its dtype's epsilon at its largest value).
    ulp = torch.finfo(dtype).eps * exact.nan_to_num().abs().max().item()
    assert err <= 2 * err_ref + ulp, f"Triton {err:.2e} is worse than the backend {err_ref:.2e} (ulp {ulp:.1e})"
    assert _finite_err(out, ref) <= 2 * TOL[dtype]

    if not per_query and softcap is None:  # the literal oracle: a boolean mask, float64, fully masked rows -> 0
        allowed = torch.isfinite(bias)
        oracle = bruteforce.dense_attention_bruteforce(query.float(), keys.float(), values.float(), allowed, scaling)
        live = allowed.any(-1)
        assert _finite_err(out[live], oracle[live]) <= TOL[dtype]


def test_attention_positive_infinite_bias_is_nan_as_backend(fused_ops):
    """+inf is outside the attention bias's contract (0 or -inf); the op answers as the backend does: NaN for the
    heads that see it, in the single-pass kernel and through the combine of splits."""
    for n, m in ((1, 200), (8, 40)):  # split over 4 programs, then single-pass
        query, keys, values, bias = _attention_inputs(n, 2, 32, 32, m, torch.float32, True, (), seed=m)
        bias[0, 1, m // 2] = float("inf")
        out = fused_ops.attention(*(t.to(DEVICE) for t in (query, keys, values, bias)), 0.2, None).cpu()
        ref = torch_backend.attention(query, keys, values, bias, 0.2)
        assert torch.isnan(out[0, 1]).all() and torch.equal(torch.isnan(out), torch.isnan(ref))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_attention_mixed_dtypes_and_strides(fused_ops):
    """A fp32 query over bf16 keys (cast to the keys' dtype first, as the backend does), non-contiguous keys/values
    (a window slice), the output in the values' dtype."""
    n, g, d, m = 2, 4, 64, 100
    query, keys, values, bias = _attention_inputs(n, g, d, d, m, torch.bfloat16, False, (), seed=3,
                                                  qdtype=torch.float32)
    wide_k = torch.randn(n, m + 20, d).to(torch.bfloat16)
    wide_k[:, 10 : 10 + m] = keys
    keys = wide_k[:, 10 : 10 + m]
    values = values.transpose(1, 2).contiguous().transpose(1, 2)
    out = fused_ops.attention(*(t.to(DEVICE) for t in (query, keys, values, bias)), d ** -0.5, None).cpu()
    ref = torch_backend.attention(query, keys, values, bias, d ** -0.5)
    assert out.dtype == torch.bfloat16
    assert _finite_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("what", ["attention-no-tokens", "attention-no-rows", "scores-no-entries"])
def test_empty_inputs_match_backend(fused_ops, what):
    """No kernel launches: no tokens gives zeros (the backend's empty matmul), no rows or entries an empty output."""
    if what == "scores-no-entries":
        out = fused_ops.page_scores(*(t.to(DEVICE) for t in (torch.randn(2, 3, 8), torch.randn(2, 16, 0),
                                                              torch.zeros(2, 0))), 2)
        assert out.shape == (2, 0) and out.dtype == torch.float32
        return
    n, m = (2, 0) if what == "attention-no-tokens" else (0, 5)
    args = (torch.randn(n, 3, 8), torch.randn(n, m, 8), torch.randn(n, m, 4), torch.zeros(n, m))
    out = fused_ops.attention(*(t.to(DEVICE) for t in args), 0.5, None).cpu()
    torch.testing.assert_close(out, torch_backend.attention(*args, 0.5))


# --------------------------------------------------------------------------------------------------
# A decode token's writes
# --------------------------------------------------------------------------------------------------

def _append_inputs(dtype, near: bool, seed: int, n=6, capacity=64, d=12, dv=10, sub=4, n_s=3, wp=32):
    """`(args, state names)` of `append_token`: rows 1, 3, 4 stable (locals 0, 1, 2), the others near; the MinMax rows
    in a permuted (kind) order; every tensor it writes starts random, so a write that is missing or misplaced shows."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    stable_local = torch.tensor([n_s, 0, n_s, 1, 2, n_s])
    near_place = torch.tensor([0, 0, 1, 0, 0, 2])
    win_shift = torch.arange(n_s + 1) * wp - torch.tensor([20, 25, 18, 20])  # a window's position 0 before the token
    near_k = rand(3, capacity, d) if near else torch.empty(0, 1, d, dtype=dtype)
    near_v = rand(3, capacity, dv) if near else torch.empty(0, 1, dv, dtype=dtype)
    return dict(keys=rand(n, d), values=rand(n, dv), full_k=rand(n, capacity, d), full_v=rand(n, capacity, dv),
                meta=rand(n, 2 * d, capacity // sub), meta_row=torch.randperm(n, generator=gen),
                win_k=rand(n_s + 1, wp, d), win_v=rand(n_s + 1, wp, dv), win_shift=win_shift, stable_local=stable_local,
                near_k=near_k, near_v=near_v, near_place=near_place, subpage_len=sub)


def _append(fn, inputs, position):
    """Run `fn` (an `append_token`) on copies of `inputs` at `position`: the written tensors and the count after."""
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    length = torch.tensor(position, device=DEVICE)
    fn(dev["keys"], dev["values"], torch.tensor(position, device=DEVICE), length, dev["full_k"], dev["full_v"],
       dev["meta"], dev["meta_row"], dev["win_k"], dev["win_v"], dev["win_shift"], dev["stable_local"], dev["near_k"],
       dev["near_v"], dev["near_place"], dev["subpage_len"])
    n_s = inputs["win_shift"].shape[0] - 1
    out = {k: dev[k].cpu() for k in ("full_k", "full_v", "meta", "near_k", "near_v")}
    # (the windows' extra row, which padded writes land in, is never read)
    out.update(win_k=dev["win_k"][:n_s].cpu(), win_v=dev["win_v"][:n_s].cpu(), length=int(length))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("near", [False, True], ids=["near-in-full-tier", "near-apart"])
@pytest.mark.parametrize("position", [24, 26, 31])  # a sub-page's first token, a middle one, the last of a page
def test_append_token_matches_backend(fused_ops, dtype, near, position):
    """The one-launch decode token writes (full tier, window or near tier, the sub-page's MinMax entry from its tokens,
    the count) equal the backend's bit for bit; each of them changed something."""
    inputs = _append_inputs(dtype, near, seed=position)
    got = _append(fused_ops.append_token, inputs, position)
    want = _append(torch_backend.append_token, inputs, position)
    for name, expected in want.items():
        assert (got[name] == expected) if name == "length" else torch.equal(got[name], expected), name
    assert want["length"] == position + 1
    for name in ("full_k", "full_v", "meta", "win_k", "win_v") + (("near_k", "near_v") if near else ()):
        n_s = inputs["win_shift"].shape[0] - 1
        before = inputs[name][:n_s] if name.startswith("win") else inputs[name]
        assert not torch.equal(want[name], before), f"{name} was not written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_token_minmax_keeps_nan_keys(fused_ops, dtype):
    """A NaN key, the new token's or one already in the sub-page, makes that channel's MinMax bounds NaN, as the
    backend's amax / amin do (a max or min that skipped it would bound the page as if the key were not there); the
    other channels and rows keep finite bounds equal to the backend's."""
    position = 26  # sub-page 6 holds positions 24..27
    inputs = _append_inputs(dtype, near=True, seed=5)
    inputs["keys"][2, 5] = float("nan")  # the new token of row 2, channel 5
    inputs["full_k"][4, 25, 7] = float("nan")  # row 4's earlier token in the same sub-page, channel 7
    got = _append(fused_ops.append_token, inputs, position)
    want = _append(torch_backend.append_token, inputs, position)
    d = inputs["keys"].shape[1]
    for row, channel in ((2, 5), (4, 7)):
        entry = want["meta"][inputs["meta_row"][row], :, position // 4]
        assert torch.isnan(entry[[channel, d + channel]]).all() and torch.isnan(entry).sum() == 2
    assert torch.isnan(want["meta"]).sum() == 4
    for name, expected in want.items():
        if name != "length":
            torch.testing.assert_close(got[name], expected, rtol=0, atol=0, equal_nan=True, msg=name)


def test_native_append_token_refuses_a_position_outside_the_tier():
    """A position at or past the full tier's end (a full cache) raises in the C++ op, which reads the position as a
    host number anyway, instead of writing past its tensors."""
    from fc_hf.kernels import native_ops

    if CUDA or os.environ.get(_CHILD_ENV) == "1" or not native_ops.available():
        pytest.skip("the C++ kernels run on a CPU, in the parent process, where they build")
    inputs = _append_inputs(torch.float32, near=True, seed=5)
    capacity = inputs["full_k"].shape[1]
    for position in (capacity, -1):
        with pytest.raises(RuntimeError, match="outside the full tier"):
            _append(native_ops.append_token, inputs, position)
    assert _append(native_ops.append_token, inputs, capacity - 1)["length"] == capacity


def test_one_launch_ops_write_what_a_decode_step_writes(fused_ops, monkeypatch):
    """On a real cache (stable, unstable and streaming rows, a layer without stable rows, near rows apart or not,
    promotions and page openings) decode steps whose token writes and window moves go through the ops leave every state
    and logit of the PyTorch path, bit for bit (the carried pages wherever something is carried)."""
    import fc_hf.decode as decode
    from conftest import left_padded_batch, tiny_model

    from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
    from fc_hf.store import PageStore

    class OneLaunchWrites:  # the token writes and window moves take the ops; every other call is the PyTorch path
        def __getattr__(self, name):
            return getattr(dispatch, name)

        @staticmethod
        def fused(tensor, forced=None):
            return fused_ops.BACKEND

    import fc_hf.tiers as tiers

    monkeypatch.setenv("FLEXICACHE_BACKEND", "torch")  # the PyTorch path, where the ops are not asked for
    launches, op, move_op = [], fused_ops.append_token, fused_ops.move_windows
    monkeypatch.setattr(fused_ops, "append_token", lambda *args: launches.append("append") or op(*args))
    monkeypatch.setattr(fused_ops, "move_windows", lambda *args: launches.append("move") or move_op(*args))
    model = tiny_model("llama", layers=3, kv_heads=3, heads=6)
    ids, mask = left_padded_batch(2, 37, pad_lengths=[0, 6])
    forced = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    # Layer 0: stable, unstable and streaming rows; layer 1: stable and unstable; layer 2: unstable only (no window).
    unstable = [(0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    for split in (False, True):
        monkeypatch.setattr(PageStore, "split_on_cpu", split)
        runs = {}
        for one_launch in (False, True):
            if one_launch:
                monkeypatch.setattr(decode, "kernels", OneLaunchWrites())
                monkeypatch.setattr(tiers, "kernels", OneLaunchWrites())
            cfg = FlexiCacheConfig(streaming_heads=((0, 2),), streaming_sink_pages=1, page_size=4, token_budget=16,
                                   rerank_interval=3)
            cache = FlexiCache(model.config, cfg, HeadProfile.from_unstable(model.config, unstable))
            steps, m = [], mask
            with torch.no_grad():
                model(input_ids=ids, attention_mask=m, past_key_values=cache, use_cache=True)
                for t in range(forced.shape[1]):
                    m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
                    steps.append(model(input_ids=forced[:, t : t + 1], attention_mask=m, past_key_values=cache,
                                       use_cache=True).logits[:, -1])
            runs[one_launch] = torch.stack(steps, 1), cache
            monkeypatch.setattr(decode, "kernels", dispatch)
            monkeypatch.setattr(tiers, "kernels", dispatch)
        assert torch.equal(runs[True][0], runs[False][0])
        for a, b in zip(runs[True][1].layers, runs[False][1].layers):
            assert a.store.near_apart is (split and a.store.rows.n_stable > 0)  # no stable row: no tier apart
            for name in ("full_k", "full_v", "meta", "near_k", "near_v", "win_pages", "win_shift", "length_t"):
                assert torch.equal(getattr(a.store, name), getattr(b.store, name)), name
            n_s = a.store.rows.n_stable
            assert torch.equal(a.store.win_k[:n_s], b.store.win_k[:n_s])
            assert torch.equal(a.store.win_v[:n_s], b.store.win_v[:n_s])
            assert torch.equal(a.store.win_bias_rows[:n_s], b.store.win_bias_rows[:n_s])
            _same_carried((a.selector.carried_pages, a.selector.carried_scores),
                          (b.selector.carried_pages, b.selector.carried_scores))
        assert runs[True][1].stats()["pages_promoted"] == runs[False][1].stats()["pages_promoted"] > 0
    assert launches.count("append") == 2 * forced.shape[1] * 3  # one per layer and step, in both layouts
    assert launches.count("move") >= 2 * forced.shape[1] // 3  # the stable rows' re-ranks


def test_writing_ops_check_and_compile(fused_ops):
    """opcheck of the token writes, refinement's choice and the window moves (schema, the declared
    mutations, fake tensors); a compiled function (`fullgraph=True`, aot_eager) that writes a token is one graph whose
    writes are eager's."""
    inputs = _append_inputs(torch.float32, True, seed=3)
    args = [v.to(DEVICE) if isinstance(v, torch.Tensor) else v for v in inputs.values()]
    keys, values, full_k, full_v, meta, meta_row, win_k, win_v, win_shift, local, near_k, near_v, near_place, sub = args
    position, length = torch.tensor(26, device=DEVICE), torch.tensor(26, device=DEVICE)
    call = (keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift, local, near_k,
            near_v, near_place, sub)
    torch.library.opcheck(_raw_ops(fused_ops).append_token.default, tuple(
        t.clone() if isinstance(t, torch.Tensor) else t for t in call))
    logits, scores, cand, page = (t.to(DEVICE) for t in _choice_inputs(3, 2, 16, 4, True, seed=4))
    carried = (torch.zeros(3, 6, dtype=torch.long, device=DEVICE), torch.zeros(3, 6, device=DEVICE))
    torch.library.opcheck(_raw_ops(fused_ops).choose.default,
                          (logits.clamp(min=-30), scores.clamp(-9, 9), cand, page, 8, 3, 2.5) + carried)
    moves = {name: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for name, v in _move_inputs(seed=5).items()}
    moves["local"], moves["rows"] = moves["local"][:3], moves["rows"][:3]  # opcheck runs it again: no padded place
    moves["pages"], moves["page"] = moves["pages"][:3], moves["page"][:3]
    torch.library.opcheck(_raw_ops(fused_ops).move_windows.default, tuple(moves.values()) + (True,))

    def step(*a):
        dispatch.append_token(*a, backend=fused_ops.BACKEND)
        return a[3] + 0, a[6].sum()

    eager_state = [t.clone() if isinstance(t, torch.Tensor) else t for t in call]
    eager = step(*eager_state)
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled_state = [t.clone() if isinstance(t, torch.Tensor) else t for t in call]
    compiled = torch.compile(step, fullgraph=True, backend=counter)(*compiled_state)
    assert counter.frame_count == 1
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    for got, want in zip(compiled_state, eager_state):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want)


@pytest.mark.parametrize("n, pages, count, width", [(4, 40, 16, 4), (3, 300, 32, 8), (2, 7, 7, 2), (5, 64, 5, 0),
                                                    (2, 130, 64, 16)])
def test_candidates_match_backend(fused_ops, n, pages, count, width):
    """Refinement's candidates: with no two scores equal, the backend's bit for bit (carried pages raised, a carried
    score below a page's own bound leaving it, pages in order); with ties at the cut (pages never attendable, -inf;
    forced, +inf; several carried, the same score) the lower pages, and the same raised scores and cut as the
    backend's."""
    from fc_hf.selection import CARRIED_SCORE

    gen = torch.Generator().manual_seed(pages + width)
    scores = torch.randn(n, pages, generator=gen)
    carried_pages = torch.randint(0, pages, (n, width), generator=gen)
    carried_scores = torch.where(torch.rand(n, width, generator=gen) < 0.7, CARRIED_SCORE, float("-inf"))
    carried_scores[:, :1] = -5.0  # below every bound: it leaves its page as it was
    for c_p, c_s in ((carried_pages, carried_scores), (None, None)):
        if c_p is None and not width:
            continue
        dev = [None if t is None else t.to(DEVICE) for t in (scores, c_p, c_s)]
        want = torch_backend.candidates(scores, c_p, c_s, count)
        got = dispatch.candidates(*dev, count, backend=fused_ops.BACKEND)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)) and got[1].dtype == torch.long
    tied = scores.clone()
    tied[:, : pages // 2] = float("-inf")
    tied[:, -1] = float("inf")
    if pages > 4:
        tied[0, 2:5] = tied[0, 1]  # equal finite bounds
    raised = tied.scatter_reduce(1, carried_pages, carried_scores, "amax")
    got_scores, got_pages = (t.cpu() for t in fused_ops.candidates(tied.to(DEVICE), carried_pages.to(DEVICE),
                                                                     carried_scores.to(DEVICE), count))
    want_scores, _ = torch_backend.candidates(tied, carried_pages, carried_scores, count)
    assert torch.equal(got_pages, got_pages.sort(dim=1).values) and (got_pages[:, 1:] > got_pages[:, :-1]).all()
    assert torch.equal(got_scores, raised.gather(1, got_pages))
    assert torch.equal(got_scores.sort(dim=1).values, want_scores.sort(dim=1).values)  # the same scores were taken
    cut = got_scores.min(dim=1, keepdim=True).values
    above, at = raised > cut, raised == cut
    assert (above.sum(1) <= count).all()
    # the lower pages of the cut's score: a page at the cut is taken only where every lower one at the cut is
    taken = torch.zeros_like(raised, dtype=torch.bool).scatter_(1, got_pages, True)
    assert torch.equal(taken, above | (at & (at.cumsum(1) <= count - above.sum(1, keepdim=True))))
    torch.library.opcheck(_raw_ops(fused_ops).candidates.default,
                          (tied.to(DEVICE), carried_pages.to(DEVICE), carried_scores.to(DEVICE), count))


def _logits_inputs(n, g, d, p, c, near, sequences, dtype, seed):
    """The arguments of `page_logits`: rows of a full tier and a near tier holding other keys (so reading the wrong
    one shows), C sorted pages a row, a token bias of 0 / -inf with whole pages never attendable."""
    gen = torch.Generator().manual_seed(seed)
    per_row, tiers = c + 5, n + 2
    full_k = torch.randn(tiers, per_row * p, d, generator=gen).to(dtype)
    near_k = torch.randn(near + 1, per_row * p, d, generator=gen).to(dtype)
    near_index = torch.randperm(tiers, generator=gen) % (near + 1)
    rows = torch.randperm(tiers, generator=gen)[:n]
    pages = torch.sort(torch.rand(n, per_row, generator=gen).argsort(dim=1)[:, :c], dim=1).values
    tokens = torch.zeros(sequences, per_row + 1, p).masked_fill(torch.rand(sequences, per_row + 1, p, generator=gen)
                                                                < 0.3, float("-inf"))
    tokens[:, -1] = tokens[:, 2] = float("-inf")
    seq = torch.randint(0, sequences, (n,), generator=gen) if sequences > 1 else None
    query = torch.randn(n, g, d, generator=gen).to(dtype)
    return query, pages, rows, near, near_k, near_index, full_k, tokens, seq


@pytest.mark.parametrize("n, g, d, p, c, near, sequences", [(3, 3, 64, 16, 32, 1, 2), (4, 1, 40, 6, 9, 0, 1),
                                                             (2, 8, 128, 4, 70, 2, 3), (5, 4, 16, 1, 3, 3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_logits_matches_backend_and_is_the_same_number_in_any_company(fused_ops, n, g, d, p, c, near, sequences,
                                                                           dtype):
    """Refinement's logits with the keys read in place: the backend's to fp32 rounding and the fp64 formula's, the
    first `near` rows from the near tier, -inf exactly where the bias is; a subset of the pages in another order gives
    each token's logit bit for bit (a verification block's later rounds compute only their new candidates')."""
    args = _logits_inputs(n, g, d, p, c, near, sequences, dtype, seed=n * c + near)
    query, pages, rows, _, near_k, near_index, full_k, tokens, seq = args
    dev = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args]
    got = fused_ops.page_logits(*dev, 0.125).cpu()
    want = torch_backend.page_logits(*args, 0.125)
    tier = torch.where((torch.arange(n) < near)[:, None, None], near_k[near_index[rows]], full_k[rows])
    keys = tier.view(n, -1, p, d)[torch.arange(n)[:, None], pages].double()  # [n, C, P, D]
    bias = tokens[0 if seq is None else seq[:, None], pages].double()  # [n, C, P]
    exact = torch.einsum("ngd,ncpd->ngcp", query.double(), keys) * 0.125 + bias[:, None]
    assert got.shape == (n, g, c, p) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(exact)) and torch.isinf(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    _record(f"page_logits, {fused_ops.BACKEND} vs backend", dtype, _finite_err(got, want))
    some = torch.arange(c - 1, -1, -2)  # every other page, in reverse
    dev[1] = dev[1][:, some]
    assert torch.equal(fused_ops.page_logits(*dev, 0.125).cpu(), got[:, :, some])
    torch.library.opcheck(_raw_ops(fused_ops).page_logits.default, tuple(dev) + (0.125,))


def test_verification_blocks_are_the_loop_with_refinement_and_attention_from_the_ops(fused_ops, monkeypatch):
    """With refinement's candidates, logits and choice and the unstable rows' attention from the ops
    (`flexicache::candidates`, `page_logits`, `choose`, `chosen_attention`), a verification block's rankings are still
    its loop's: every mark, the state after every crop, the outputs (a later round of `rank_block` computes only its
    new candidates' logits, `_logits_again`, so the op must give a token's logit in any company)."""
    import fc_hf.decode as decode
    import fc_hf.selection as selection
    from test_batched_verify import CONFIGS, _assert_same_marks, _caches
    from test_speculative import _forward, _prefill, assert_same_state

    launches = []

    class OpsForRefinement:  # refinement's ops on the fused backend; every other primitive the PyTorch path
        def __getattr__(self, name):
            if name in ("candidates", "page_logits", "choose", "chosen_attention"):
                return lambda *args, backend=None: (launches.append(name)
                                                    or getattr(dispatch, name)(*args, backend=fused_ops.BACKEND))
            return getattr(dispatch, name)

        @staticmethod
        def fused(tensor, forced=None):
            return fused_ops.BACKEND

    monkeypatch.setenv("FLEXICACHE_BACKEND", "torch")  # the PyTorch path, where the ops are not asked for
    monkeypatch.setattr(selection, "kernels", OpsForRefinement())
    monkeypatch.setattr(decode, "kernels", OpsForRefinement())  # the token writes too (`append_token`, exact)
    block, loop, (keys, values), queries = _caches(CONFIGS["variants"], seed=3)
    for cache in (block, loop):
        _prefill(cache, keys[:, :, :30], values[:, :, :30])
        cache.activate_past_recording()
    g = torch.Generator().manual_seed(4)
    length = 30
    while length < 110:
        t = int(torch.randint(2, 8, (1,), generator=g))
        span = slice(length, length + t)
        got, want = (_forward(c, keys[:, :, span], values[:, :, span], queries[:, :, span]) for c in (block, loop))
        for x, y in zip(got, want):
            assert torch.allclose(x, y, rtol=0, atol=1e-5), (x - y).abs().max()
        _assert_same_marks(block, loop)
        keep = int(torch.randint(1, t + 1, (1,), generator=g))
        for cache in (block, loop):
            cache.crop(keep - t)
        length += keep
        assert_same_state(block, loop)
    assert min(launches.count(name) for name in ("candidates", "page_logits", "choose", "chosen_attention")) > 20
    assert block.stats()["pages_promoted"] > 0


# --------------------------------------------------------------------------------------------------
# Refinement's choice: the mass, the top K, the carried candidates
# --------------------------------------------------------------------------------------------------

def _choice_inputs(n, g, c, p, per_row_page, seed):
    """`(logits [n, G, C, P], scores [n, C], cand [n, C], page)`: masses of every kind: a head with no finite logit in
    row 0 (NaN), whole pages never attendable (0), forced and never-attendable scores (+-inf); candidates in page
    order, some at the page being filled."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, g, c, p, generator=gen) * 4
    logits = logits.masked_fill(torch.rand(n, g, c, p, generator=gen) < 0.2, float("-inf"))
    logits[:, :, : max(1, c // 3)] = float("-inf")  # whole pages never attendable, the first block's included
    if n > 1:
        logits[0, 0] = float("-inf")
    scores = torch.randn(n, c, generator=gen)
    scores[:, -1], scores[-1, 0] = float("inf"), float("-inf")
    cand = torch.sort(torch.randperm(4 * c, generator=gen)[:c].expand(n, -1) + torch.arange(n)[:, None], dim=1).values
    page = cand[:, -1] - torch.randint(0, 2, (n,), generator=gen) if per_row_page else cand[0, c // 2].clone()
    return logits, scores, cand, page


def _choice(fn, logits, scores, cand, page, k, carry, width):
    pages, carried = torch.full((cand.shape[0], width), -7, dtype=torch.long), torch.full((cand.shape[0], width), 3.0)
    dev = [t.to(DEVICE) for t in (logits, scores, cand, page, pages, carried)]
    mass, top, chosen = fn(*dev[:4], k, carry, 123.0, *dev[4:])
    return mass.cpu(), top.cpu(), chosen.cpu(), (dev[4].cpu(), dev[5].cpu())


def _same_carried(got, want):
    """The scores exactly, the pages wherever something is carried (a finite score): a page scored -inf carries nothing
    (of masses equal at 0 the backends may pick different candidates)."""
    assert torch.equal(got[1], want[1])
    finite = torch.isfinite(want[1])
    assert torch.equal(got[0][finite], want[0][finite]) and torch.equal(got[0][~finite] * 0, want[0][~finite] * 0)


@pytest.mark.parametrize("n, g, c, p, k, carry, width", [
    (3, 3, 16, 16, 8, 2, 4), (2, 1, 70, 16, 35, 8, 16), (4, 8, 33, 4, 16, 3, 8), (2, 4, 300, 8, 150, 0, 1),
    (1, 2, 5, 1, 3, 2, 4), (2, 3, 40, 6, 20, 6, 12), (3, 2, 9, 4, 4, 3, 8), (2, 3, 6, 4, 6, 6, 12)])
@pytest.mark.parametrize("per_row_page", [False, True], ids=["one-page", "page-per-row"])
def test_choose_matches_backend_and_selector(fused_ops, n, g, c, p, k, carry, width, per_row_page):
    """Refinement's choice in one launch. The mass: the backend's (`page_mass`) to fp32 rounding and the fp64
    formula's, infinite scores kept exactly, NaN where a head has no finite logit (row 0), more pages than one block
    (C = 300), pages of a size that is not a power of two. The top K of that mass, of equal ones the first, in
    candidate order, with their pages. The carried candidates from that mass: the backend's and the selector's own
    PyTorch path (the pages of most mass, each with the next page up to the page being filled; nothing past
    `2 carry`; none written without carrying)."""
    from fc_hf.config import FlexiCacheConfig
    from fc_hf.selection import CARRIED_SCORE, PageSelector

    logits, scores, cand, page = _choice_inputs(n, g, c, p, per_row_page, seed=n * g + c + carry)
    mass, top, chosen, carried = _choice(fused_ops.choose, logits, scores, cand, page, k, carry, width)
    want = torch_backend.page_mass(logits, scores)
    exact = torch.where(torch.isinf(scores), scores.double(),
                        torch.softmax(logits.double().view(n, g, c * p), -1).view(n, g, c, p).sum(-1).mean(1))
    assert mass.shape == (n, c) and mass.dtype == torch.float32
    assert torch.equal(torch.isnan(mass), torch.isnan(want)) and (n == 1 or torch.isnan(mass[0, :-1]).all())
    assert torch.equal(mass[torch.isinf(scores)], scores[torch.isinf(scores)])
    torch.testing.assert_close(mass, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(mass.double(), exact, rtol=1e-5, atol=1e-6, equal_nan=True)
    _record(f"choose's mass, {fused_ops.BACKEND} vs backend", torch.float32,
            (mass - want).nan_to_num().abs().max().item())

    bits = mass.view(torch.int32)
    order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).argsort(dim=1, descending=True, stable=True)  # NaN first, as topk
    assert torch.equal(top, order[:, :k].sort(dim=1).values) and torch.equal(chosen, cand.gather(1, top))
    assert top.dtype == torch.long
    _, want_top, _ = torch_backend.choose(logits, scores, cand, page, k, 0, 1.0, *carried)
    torch.testing.assert_close(mass.gather(1, top).sort(1).values, want.gather(1, want_top).sort(1).values,
                               rtol=1e-5, atol=1e-6, equal_nan=True)  # the backend took as much mass

    if not carry:
        assert (carried[0] == -7).all() and (carried[1] == 3.0).all()
        return
    ref = (torch.full_like(carried[0], -7), torch.full_like(carried[1], 3.0))
    torch_backend.carry_out(cand, mass, page, carry, 123.0, *ref)
    _same_carried(carried, ref)
    assert torch.isneginf(carried[1][:, 2 * carry :]).all() and (carried[1][:, : 2 * carry] == 123.0).any()
    if n > 1:
        assert torch.isneginf(carried[1][0, 2:]).all()  # row 0: only the forced page's mass is not NaN; it carries 0
    selector = PageSelector(FlexiCacheConfig(page_size=4, token_budget=4 * k, refine_pages=c, carry_pages=carry), n,
                            "cpu")
    pages, scores_out = selector._carry_out(cand, mass, page)
    own = (pages, torch.where(scores_out == CARRIED_SCORE, 123.0, scores_out))
    if width == selector.carried_pages.shape[1]:
        _same_carried(carried, own)
    else:  # the selector's state is 2 carry wide
        _same_carried(tuple(x[:, : 2 * carry] for x in carried), own)


# --------------------------------------------------------------------------------------------------
# Attention over a ranking's own logits
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m, g, c, k, p, dv, dtype", [
    (3, 3, 16, 8, 16, 64, torch.float32), (2, 8, 40, 20, 4, 128, torch.bfloat16), (4, 1, 9, 5, 6, 40, torch.float32),
    (2, 4, 70, 33, 16, 64, torch.bfloat16), (2, 2, 3, 3, 1, 16, torch.float16)])
def test_chosen_attention_matches_backend_and_fp64(fused_ops, m, g, c, k, p, dv, dtype):
    """The unstable rows' attention over a ranking's own logits: the chosen places in any order, the values read in
    place at each row's start in a flat tier, more pages than one block (K = 33 of 16 tokens), pages of a size that is
    not a power of two, masked tokens and whole pages; NaN where a head has no attendable chosen token (row 0's last
    head), as the backend; within `attention`'s tolerance of fp64 and no worse than the backend."""
    gen = torch.Generator().manual_seed(m * c + k)
    per_row = c + 3
    logits = (torch.randn(m + 1, g, c, p, generator=gen) * 3).masked_fill(
        torch.rand(m + 1, g, c, p, generator=gen) < 0.2, float("-inf"))
    top = torch.rand(m, c, generator=gen).argsort(dim=1)[:, :k]
    logits[:, :, top[0, 0]] = float("-inf")  # a chosen page never attendable
    logits[0, g - 1] = float("-inf")
    pages = torch.randint(0, per_row, (m, k), generator=gen)
    starts = torch.randint(0, 5, (m,), generator=gen) * per_row
    values = torch.randn(5 * per_row * p, dv, generator=gen).to(dtype)
    dev = [t.to(DEVICE) for t in (logits, top, pages, starts, values)]
    out = fused_ops.chosen_attention(*dev).cpu()
    ref = torch_backend.chosen_attention(logits, top, pages, starts, values)
    exact = torch_backend.chosen_attention(logits.double(), top, pages, starts, values.double())
    assert out.shape == (m, g, dv) and out.dtype == dtype
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out[0, g - 1]).all()
    assert not torch.isnan(out[1:]).any() and not torch.isinf(out).any()
    err, err_ref = _finite_err(out, exact), _finite_err(ref, exact)
    _record(f"chosen_attention, {fused_ops.BACKEND} vs float64", dtype, err)
    ulp = torch.finfo(dtype).eps * exact.nan_to_num().abs().max().item()
    assert err <= TOL[dtype] and err <= 2 * err_ref + ulp, f"Triton {err:.2e}, backend {err_ref:.2e}"
    # opcheck compares repeated runs: rows 1.. (no NaN)
    torch.library.opcheck(_raw_ops(fused_ops).chosen_attention.default, tuple(t[1:] for t in dev[:4]) + (dev[4],))


# --------------------------------------------------------------------------------------------------
# A re-rank's window moves
# --------------------------------------------------------------------------------------------------

def _move_inputs(seed, k=6, ranked=6, n_pages=20, p=4, d=8, dv=6, extra=3, per_row_page=True):
    """`(args, names of the written tensors)` of `move_windows`: 3 ranked stable rows of 4 and a padded place (the extra
    row), rankings of distinct pages some past the page being filled, old windows sharing some pages with the new."""
    gen = torch.Generator().manual_seed(seed)
    n_s, w, rows_total = 4, k + extra, 6
    local, rows = torch.tensor([2, 0, 3, n_s]), torch.tensor([5, 1, 3, 5])
    at = torch.tensor([14, 9, 17, 14]) if per_row_page else torch.tensor(14)
    pages = torch.stack([torch.randperm(n_pages, generator=gen)[:ranked] for _ in range(4)])
    pages[:, 0] = at if per_row_page else at.expand(4)  # the page being filled is always ranked
    old = torch.randint(-1, n_pages, (n_s + 1, w), generator=gen)
    old[:, :2] = pages[[1, 0, 0, 2, 3], 1:3]  # some pages held before
    return dict(pages=pages, page=at, local=local, rows=rows,
                full_k=torch.randn(rows_total, n_pages * p, d, generator=gen),
                full_v=torch.randn(rows_total, n_pages * p, dv, generator=gen),
                win_k=torch.randn(n_s + 1, w * p, d, generator=gen),
                win_v=torch.randn(n_s + 1, w * p, dv, generator=gen),
                win_pages=old, win_shift=torch.randint(0, 99, (n_s + 1,), generator=gen),
                win_base=torch.arange(n_s + 1) * w * p, win_bias_rows=torch.randint(0, 99, (n_s + 1, w), generator=gen),
                stable_batch=torch.tensor([0, 1, 1, 0, 0]), promoted=torch.tensor(5), num_pages=n_pages, k=k)


def _moved(fn, inputs, count):
    state = {name: v.clone().to(DEVICE) if isinstance(v, torch.Tensor) else v for name, v in inputs.items()}
    fn(*state.values(), count)
    n_s = inputs["win_pages"].shape[0] - 1
    return {name: (state[name][:n_s] if state[name].dim() else state[name]).cpu()  # the extra row is never read
            for name in ("win_k", "win_v", "win_pages", "win_shift", "win_bias_rows", "promoted")}


@pytest.mark.parametrize("ranked", [6, 4], ids=["K-ranked", "fewer-pages-than-K"])
@pytest.mark.parametrize("per_row_page", [True, False], ids=["page-per-row", "one-page"])
@pytest.mark.parametrize("count", [True, False], ids=["host-tier", "no-host-tier"])
@pytest.mark.parametrize("p", [4, 3], ids=["P4", "P3"])
def test_move_windows_matches_backend(fused_ops, ranked, per_row_page, count, p):
    """The one-launch window moves (the window planned in page order, its first K pages copied from the full tier, the
    shift, the token-bias rows, the pages promoted) equal the backend's bit for bit, and each wrote something; pages of
    a power-of-two size or not."""
    inputs = _move_inputs(seed=ranked + 2 * per_row_page + p, ranked=ranked, per_row_page=per_row_page, p=p)
    got, want = _moved(fused_ops.move_windows, inputs, count), _moved(torch_backend.move_windows, inputs, count)
    for name, expected in want.items():
        assert torch.equal(got[name], expected), name
    n_s = inputs["win_pages"].shape[0] - 1
    for name in ("win_k", "win_v", "win_pages", "win_shift", "win_bias_rows"):
        assert not torch.equal(want[name], inputs[name][:n_s]), f"{name} was not written"
    assert int(want["promoted"]) == 5 if not count else int(want["promoted"]) >= 5
    if count and ranked == 6:
        assert int(want["promoted"]) > 5  # pages not held before were counted


# --------------------------------------------------------------------------------------------------
# Custom ops: fake implementations, opcheck, torch.compile, dispatch
# --------------------------------------------------------------------------------------------------

def _meta_arg(fused_ops, meta):
    """The MinMax argument of a raw `page_scores` op: one tensor (Triton), a list of row blocks (C++)."""
    return meta if fused_ops.BACKEND == "triton" else [meta]


def test_fake_implementations_give_shapes_and_dtypes(fused_ops):
    """Under FakeTensorMode (and on meta tensors) the ops give their output's shape, dtype and device without running
    a kernel; inputs that break the contract are refused at trace time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(6, 4, 64, dtype=torch.bfloat16)
        raw = _raw_ops(fused_ops)
        scores = raw.page_scores(q, _meta_arg(fused_ops, torch.empty(6, 128, 40, dtype=torch.bfloat16)),
                                  torch.empty(6, 40), 4)
        assert scores.shape == (6, 10) and scores.dtype == torch.float32 and scores.device == q.device
        keys, values = torch.empty(6, 96, 64, dtype=torch.bfloat16), torch.empty(6, 96, 48, dtype=torch.bfloat16)
        for bias in (torch.empty(6, 96), torch.empty(6, 4, 96)):
            out = raw.attention(q, keys, values, bias, 0.125, 50.0)
            assert out.shape == (6, 4, 48) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="page_scores"):
            raw.page_scores(q, _meta_arg(fused_ops, torch.empty(6, 128, 40)), torch.empty(6, 40), 3)
        with pytest.raises(ValueError, match="attention"):
            raw.attention(q, keys, values, torch.empty(6, 95), 0.125)
    meta = _raw_ops(fused_ops).attention(*(torch.empty(s, device="meta")
                                           for s in ((2, 3, 8), (2, 5, 8), (2, 5, 4), (2, 3, 5))), 1.0)
    assert meta.shape == (2, 3, 4) and meta.device.type == "meta"


def test_opcheck(fused_ops):
    """torch.library.opcheck: schema, fake tensor agreement with the real kernel, AOT dispatch (dynamic shapes)."""
    query, meta, bias, _, _ = _score_inputs(2, 3, 16, 5, 2, torch.float32, "contiguous", seed=1)
    bias = bias.clamp(-10.0, 10.0)  # opcheck compares outputs of repeated runs: keep them finite
    torch.library.opcheck(_raw_ops(fused_ops).page_scores.default,
                          (query.to(DEVICE), _meta_arg(fused_ops, meta.to(DEVICE)), bias.to(DEVICE), 2))
    query, keys, values, bias = _attention_inputs(2, 3, 16, 8, 20, torch.float32, True, (), seed=2)
    dev = tuple(t.to(DEVICE) for t in (query, keys, values, bias))
    torch.library.opcheck(_raw_ops(fused_ops).attention.default, dev + (0.25, 5.0))
    torch.library.opcheck(_raw_ops(fused_ops).attention.default, dev[:3] + (dev[3][:, 0],) + (0.25,))


def test_compiled_step_keeps_each_op_as_one_node(fused_ops):
    """`torch.compile(fullgraph=True, backend="aot_eager")` of a function calling dispatch on the Triton backend: one
    graph, no break, each op one node of the Dynamo graph and of the AOT (ATen) graph, eager's results."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(query, meta, page_bias, keys, values, bias):
        scores = dispatch.page_scores(query, meta, page_bias, 2, backend=fused_ops.BACKEND)
        out = dispatch.attention(query * 2, keys, values, bias, 0.25, None, backend=fused_ops.BACKEND)
        return scores.amax(-1), out + 1

    query, meta, page_bias, _, _ = _score_inputs(2, 4, 32, 6, 2, torch.float32, "contiguous", seed=7)
    _, keys, values, bias = _attention_inputs(2, 4, 32, 16, 30, torch.float32, False, (), seed=8)
    args = tuple(t.to(DEVICE) for t in (query, meta, page_bias, keys, values, bias))
    eager = step(*args)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)(*args)
    assert counter.frame_count == 1
    targets = [str(node.target) for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    name = fused_ops.OPS_NAMESPACE
    assert targets.count(f"{name}.page_scores.default") == 1 and targets.count(f"{name}.attention.default") == 1

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=capture))(*args)
    aten = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert aten.count(_raw_ops(fused_ops).page_scores.default) == 1
    assert aten.count(_raw_ops(fused_ops).attention.default) == 1
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


@kernels_here
@pytest.mark.skipif(CUDA, reason="on a CPU under the interpreter; a GPU runs this step in eval/bench/gpu_bench.sh")
def test_generate_on_the_triton_kernels_compiles_in_two_graphs_with_the_pytorch_paths_tokens(monkeypatch):
    """The GPU's decode step as a whole (every op on the Triton backend, the near rows apart from the full tier as on a
    GPU), here under the interpreter: eager, its tokens are the PyTorch path's; compiled by `generate` (aot_eager,
    `fullgraph=True`, `dynamic=False`), no graph break, at most 2 graphs, the same tokens and promotions. The check of
    tests/test_compile.py, shortened (a 200-token prompt, 12 new tokens: stable re-ranks with promotions included)."""
    import dataclasses

    from conftest import left_padded_batch, tiny_model
    from test_compile import CFG, _compile_config, _graphs

    from fc_hf import FlexiCache, HeadProfile
    from fc_hf.compat import cache_kwargs
    from fc_hf.store import PageStore

    monkeypatch.setattr(PageStore, "split_on_cpu", True)
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    ids, mask = left_padded_batch(2, 200, pad_lengths=[0, 21])
    profile = HeadProfile.from_unstable(model.config, {(0, 0), (1, 1)})

    def generate(backend, **kw):
        cache = FlexiCache(model.config, dataclasses.replace(CFG, backend=backend), profile)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                 **cache_kwargs(model, cache), **kw)
        return out, cache.stats()["pages_promoted"]

    reference, promoted = generate("torch")
    assert promoted > 0
    eager, eager_promoted = generate("triton")
    assert torch.equal(eager, reference) and eager_promoted == promoted
    (out, compiled_promoted), graphs, breaks = _graphs(lambda: generate("triton", compile_config=_compile_config()))
    assert breaks == {} and graphs <= 2
    assert torch.equal(out, reference) and compiled_promoted == promoted


def test_dispatch_routes_to_the_ops_only_on_the_triton_backend(triton_ops, monkeypatch):
    """backend="triton", or FLEXICACHE_BACKEND=triton, calls the ops; "torch" and a CPU tensor by default call the
    PyTorch backend (checked with spies, so no kernel runs)."""
    calls = []
    monkeypatch.setattr(triton_ops, "page_scores", lambda *a: calls.append("page_scores") or "op")
    monkeypatch.setattr(triton_ops, "attention", lambda *a: calls.append("attention") or "op")
    query, meta, bias, _, _ = _score_inputs(1, 2, 8, 3, 1, torch.float32, "contiguous", seed=0)
    _, keys, values, tok = _attention_inputs(1, 2, 8, 8, 4, torch.float32, False, (), seed=0)

    assert dispatch.page_scores(query, meta, bias, 1, backend="triton") == "op"
    assert dispatch.attention(query, keys, values, tok, 1.0, backend="triton") == "op"
    assert isinstance(dispatch.page_scores(query, meta, bias, 1, backend="torch"), torch.Tensor)
    assert isinstance(dispatch.attention(query, keys, values, tok, 1.0), torch.Tensor)  # auto on a CPU tensor: torch
    assert calls == ["page_scores", "attention"]
    monkeypatch.setenv("FLEXICACHE_BACKEND", "triton")
    assert dispatch.attention(query, keys, values, tok, 1.0) == "op"
    assert dispatch.page_scores(query, meta, bias, 1, backend="torch") is not None and calls[-1] == "attention"


def test_native_backend_serves_cpu_tensors_only_and_falls_back_where_not_built(monkeypatch):
    """"native" routes CPU tensors to the C++ ops; another device's tensors pick as "auto" (here a meta tensor: the
    PyTorch backend); where the C++ kernels did not build, CPU tensors get the PyTorch backend too."""
    from fc_hf.kernels import native_ops

    monkeypatch.setattr(native_ops, "available", lambda: True)
    assert dispatch.backend_for(torch.zeros(1), "native") == "native"
    assert dispatch.fused(torch.zeros(1), "native") == "native"
    assert dispatch.backend_for(torch.zeros(1, device="meta"), "native") == "torch"
    monkeypatch.setenv("FLEXICACHE_BACKEND", "native")
    assert dispatch.backend_for(torch.zeros(1)) == "native" and dispatch.backend_for(torch.zeros(1), "torch") == "torch"
    monkeypatch.setattr(native_ops, "available", lambda: False)
    assert dispatch.backend_for(torch.zeros(1)) == "torch" and dispatch.fused(torch.zeros(1)) is None


def test_native_build_failure_warns_once_and_the_pytorch_backend_serves(tmp_path):
    """With no working compiler the C++ kernels do not build: one RuntimeWarning that says what to install, the reason
    kept in `build_error()`, and the same attention from the PyTorch backend."""
    script = textwrap.dedent("""
        import warnings
        import torch
        from fc_hf.kernels import dispatch, native_ops
        q, k, v, b = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.zeros(2, 5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [dispatch.attention(q, k, v, b, 1.0, backend="native") for _ in range(2)]
        assert not native_ops.available() and native_ops.build_error(), native_ops.build_error()
        texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(texts) == 1 and "Install a C++20 compiler" in texts[0] and "no-compiler" in texts[0], texts
        want = dispatch.attention(q, k, v, b, 1.0, backend="torch")
        assert all(torch.equal(g, want) for g in got)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLEXICACHE_BACKEND")}
    env.update(CXX=str(tmp_path / "no-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:] + run.stderr[-3000:]


def test_native_kernels_build_with_only_a_compiler_and_are_cached(tmp_path):
    """The C++ kernels build in a process that has a compiler and no ninja on its PATH (pip brings none); a second
    process loads the cached build without compiling (its compiler does not exist); builds no process loaded for 30
    days are removed when one is built, and recent ones kept."""
    import shutil

    folder = tmp_path / "extensions" / "flexicache_native"
    folder.mkdir(parents=True)
    stale, recent = folder / "flexicache_native_stale.so", folder / "flexicache_native_recent.so"
    for path, days in ((stale, 31), (recent, 1)):
        path.write_bytes(b"")
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - days * 86400))
    bin_dir = tmp_path / "bin"  # the PATH: only a compiler, which runs with the PATH it would have had
    bin_dir.mkdir()
    compiler = bin_dir / "c++"
    compiler.write_text(f"#!/bin/sh\nPATH='{os.environ['PATH']}' exec {shutil.which('c++') or 'c++'} \"$@\"\n")
    compiler.chmod(0o755)
    script = textwrap.dedent("""
        import shutil, sys, torch
        from fc_hf.kernels import native_ops
        assert shutil.which("ninja") is None
        torch.manual_seed(0)
        q, k, v, b = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.zeros(2, 5)
        print(native_ops.available(), native_ops.build_error(), float(native_ops.attention(q, k, v, b, 1.0).sum()))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLEXICACHE_BACKEND", "CXX")}
    env.update(PATH=str(bin_dir), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    outputs = []
    for cxx in (None, str(tmp_path / "no-compiler")):
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", env=env if cxx is None else
                             {**env, "CXX": cxx}, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        outputs.append(run.stdout.split())
    assert outputs[0][:2] == ["True", "None"] and outputs[1] == outputs[0], outputs
    built = sorted(p.name for p in folder.iterdir())
    assert len(built) == 2 and recent.name in built and stale.name not in built, built


def test_native_flags_a_compiler_refused_are_not_asked_again(tmp_path):
    """A compiler that refuses `-march=native` is asked once: the first process builds with plain `-O3` after the
    refusal, a second loads that build without calling the compiler at all."""
    import shutil

    calls = tmp_path / "calls"
    compiler = tmp_path / "c++"
    compiler.write_text(f"#!/bin/sh\necho \"$*\" | grep -q -- -march=native && echo N >> {calls} && exit 1\n"
                        f"echo O >> {calls}\nexec {shutil.which('c++') or 'c++'} \"$@\"\n")
    compiler.chmod(0o755)
    script = "from fc_hf.kernels import native_ops; print(native_ops.available(), native_ops.build_error())"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLEXICACHE_BACKEND")}
    env.update(CXX=str(compiler), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.split() == ["True", "None"], run.stdout[-2000:] + run.stderr[-3000:]
    assert calls.read_text().split() == ["N", "O"]  # the refusal, the plain build; nothing in the second process
    assert len(list((tmp_path / "extensions" / "flexicache_native").glob("*.failed"))) == 1


def test_triton_stays_optional():
    """The kernels' dispatch runs the CPU backends without importing triton (torch and transformers may
    import it themselves: torch._dynamo probes for it), and FlexiCache's core imports and runs without triton installed
    (its import blocked): dispatch answers a CPU backend, and forcing "triton" says what is missing."""
    script = textwrap.dedent("""
        import sys
        import torch
        from fc_hf.kernels import dispatch
        q, k, v, b = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.zeros(2, 5)
        dispatch.attention(q, k, v, b, 1.0)
        dispatch.page_scores(q, torch.randn(2, 16, 4), torch.zeros(2, 4), 2)
        assert "triton" not in sys.modules and "fc_hf.kernels.triton_ops" not in sys.modules, "triton imported"

        sys.modules["triton"] = None  # from here on, as if triton were not installed
        import fc_hf, fc_hf.cache, fc_hf.decode, fc_hf.selection
        assert not dispatch._triton_available() and dispatch.backend_for(q) in ("torch", "native")  # a CPU tensor
        assert dispatch.attention(q, k, v, b, 1.0).shape == (2, 3, 8)
        try:
            dispatch.attention(q, k, v, b, 1.0, backend="triton")
        except ImportError as e:
            assert "triton" in str(e)
        else:
            raise AssertionError("forcing triton without it did not fail")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:] + run.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# The sm_90 build (no GPU needed)
# --------------------------------------------------------------------------------------------------

_SM90_SCRIPT = """
import re, subprocess, sys, tempfile
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fc_hf.kernels import triton_ops as ops

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64"}

def ptxas():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            found = get_ptxas(90)
        except TypeError:
            found = get_ptxas()
        return getattr(found, "path", None) or found[0]
    except Exception:
        return None

def build(kernel, args, constexprs, options, label):
    signature, constants = {}, dict(constexprs)
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, int) and value == 1:  # as a launch specialises it
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32" if isinstance(value, int) else "fp32"
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=options)
    assert ".target sm_90" in compiled.asm["ptx"], label
    tool = ptxas()
    if tool is None:
        print(label, "built (no ptxas to read its resources)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(compiled.asm["ptx"])
        run = subprocess.run([tool, "-v", "--gpu-name=sm_90a", str(Path(tmp) / "k.ptx"), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    spills = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", run.stderr)
    regs = re.search(r"Used (\\d+) registers", run.stderr)
    print(label, "registers", regs and regs.group(1), "spills", spills and spills.groups())
    if spills and ("16-bit" in label or "no spill" in label):
        assert spills.groups() == ("0", "0"), f"{label} spills: {run.stderr}"

for dt in (torch.bfloat16, torch.float32):
    bits = "16-bit" if dt != torch.float32 else "fp32"
    q, meta = torch.empty(16, 4, 128, dtype=dt), torch.empty(16, 256, 1024, dtype=dt)
    _, a, c, o = ops._page_scores_launch(q, meta, torch.empty(16, 1024), 2, torch.empty(16, 512))
    build(ops._page_scores_kernel, a, c, o, f"page_scores {bits}")
    k, v = torch.empty(16, 1024, 128, dtype=dt), torch.empty(16, 1024, 128, dtype=dt)
    for bias, cap in ((torch.empty(16, 1024), None), (torch.empty(16, 4, 1024), 50.0)):
        for kernel, _, a, c, o in ops._attention_launches(q, k, v, bias, 0.1, cap, torch.empty(16, 4, 128, dtype=dt),
                                                          target=264):
            build(kernel, a, c, o, f"{kernel.__name__} {bits} softcap={cap}")
    long = lambda *shape: torch.zeros(*shape, dtype=torch.long)
    for near in (True, False):
        tier, win = torch.empty(16, 2048, 128, dtype=dt), torch.empty(13, 2048, 128, dtype=dt)
        near_k = torch.empty(4, 2048, 128, dtype=dt) if near else None
        a, c = ops._append_token_launch(torch.empty(16, 128, dtype=dt), torch.empty(16, 128, dtype=dt), long(()),
                                        long(()), tier, tier, torch.empty(16, 256, 1024, dtype=dt), long(16), win, win,
                                        long(13), long(16), near_k, near_k, long(16), 2)
        build(ops._append_token_kernel, a, c, {}, f"append_token {bits} near={near}")
    if dt == torch.float32:
        for c_n in (128, 512):
            a, c = ops._choose_launch(torch.empty(16, 4, c_n, 16), torch.empty(16, c_n), long(16, c_n), long(16), 64,
                                      8, 3.0e38, long(16, 16), torch.empty(16, 16), torch.empty(16, c_n),
                                      long(16, 64), long(16, 64))
            build(ops._choose_kernel, a, c, {}, f"choose, {c_n} candidates")
        tier, win = torch.empty(16, 2048, 128), torch.empty(13, 1152, 128)
        a, c = ops._move_windows_launch(long(16, 64), long(16), long(16), long(16), tier, tier, win, win, long(13, 72),
                                        long(13), long(13), long(13, 72), long(13), long(()), 128, 64, True)
        build(ops._move_windows_kernel, a, c, {}, "move_windows")
        for pages in (1024, 4096, 8192):
            a, c, o = ops._candidates_launch(torch.empty(16, pages), long(16, 16), torch.empty(16, 16), 64,
                                             torch.empty(16, 64), long(16, 64))
            build(ops._candidates_kernel, a, c, o, f"candidates, {pages} pages" + (" (no spill)" if pages < 8192
                                                                                   else ""))
    a, c, o = ops._chosen_attention_launch(torch.empty(16, 4, 128, 16), long(16, 64), long(16, 64), long(16),
                                           torch.empty(4096, 128, dtype=dt), torch.empty(16, 4, 128, dtype=dt))
    build(ops._chosen_attention_kernel, a, c, o, f"chosen_attention {bits}")
    _, a, c = ops._page_logits_launch(q, long(16, 64), long(16), 4, torch.empty(4, 2048, 128, dtype=dt), long(16),
                                      torch.empty(16, 2048, 128, dtype=dt), torch.empty(2, 129, 16), long(16), 0.1,
                                      torch.empty(16, 4, 64, 16))
    build(ops._page_logits_kernel, a, c, {}, f"page_logits {bits}")
print("built")
"""


@pytest.mark.skipif(triton is None or CUDA, reason="needs triton; with CUDA the kernel cases compile them anyway")
def test_kernels_compile_for_sm90():
    """Build every kernel variant the launchers make (16-bit and fp32, bias per row and per query head, softcap, the
    split and its combine) for sm_90 with Triton's compiler, in a process without the interpreter; the 16-bit ones must
    not spill registers (ptxas -v, where Triton ships ptxas)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    run = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], cwd=ROOT / "tests", env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "built" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def teardown_module():
    if MAX_ERR:
        print("\nlargest absolute errors:")
        for (what, dtype), err in sorted(MAX_ERR.items(), key=str):
            print(f"  {what:34s} {str(dtype).replace('torch.', ''):9s} {err:.2e}")

"""Triton kernels of the decode step, registered as `torch.library` custom ops.

Each op (`flexicache::page_scores`, `flexicache::attention`, `flexicache::append_token`, `flexicache::candidates`,
`flexicache::page_logits`, `flexicache::choose`, `flexicache::chosen_attention`, `flexicache::move_windows`) has the
contract of the `torch_backend`
function of the same name (read its docstring for the shapes) and a fake implementation (`register_fake`: output shape and dtype only, or nothing
for the ops that only write), so `torch.compile(fullgraph=True)` keeps a call as one opaque node of the graph and never
traces into Triton.
`dispatch.py` routes to them where `backend_for` answers "triton"; nothing else imports this module, so Triton stays an
optional dependency (this module imports it at the top).

On a CPU the kernels run only under Triton's interpreter (`TRITON_INTERPRET=1` set before `triton` is first imported);
that is how the tests run them without a GPU. There the bf16 dots of `attention` run in fp32 over the bf16-rounded
operands (the same products; the interpreter's bf16 `tl.dot` is wrong, see `_dot_fp32`), so the interpreter does not
execute the compiled bf16 `tl.dot` path: tests/test_triton_ops.py builds it for sm_90 instead.

Numerics, as the PyTorch backend:
- `page_scores`: the Quest bound `relu(q) . kmax + min(q, 0) . kmin + bias` in fp32 (the MinMax entries upcast; fp32
  products, "ieee" precision, never TF32), max over the GQA group, then over each page's S entries. +inf / -inf biases
  pass through (forced / never attendable pages).
- `attention`: logits `scaling * q . k` accumulated in fp32 (q cast to the keys' dtype first, as the backend does),
  optional softcap `tanh(s / c) * c`, plus the bias; an online softmax in fp32 (flash-decoding: the tokens split over
  programs, the splits merged by their log-sum-exp); the probabilities cast to the values' dtype for `p @ v`, fp32
  accumulation, output in the values' dtype.
- A query row whose bias masks every token (-inf everywhere) gives NaN, as `torch.softmax` over an all -inf row does
  in the backend; a +inf bias in `attention` (outside its contract: 0 or -inf) gives NaN as in the backend too. With no
  token at all (M == 0) the output is zeros, as the backend's empty matmul.
- `append_token`: copies and a max / min over a sub-page's tokens, so the writes are the backend's bit for bit (the
  decode step's PyTorch path makes the same writes in 6-13 ops; here one launch per layer and step).
- `candidates`: the backend's bound scores raised by the carried ones (a max), the C largest in page order: the
  backend's numbers exactly; of equal scores at the cut the lower pages are taken, where `torch.topk` does not say
  which (pages never attendable, -inf, are the usual tie).
- `page_logits`: `scaling * q . k + bias` per candidate token in fp32, the keys read in place from the near or the full
  tier; summed over the channels in one order whatever a token's place, so a token's logit is the same number
  whichever pages it is scored with (the backend fixes its products' shape for the same reason), to fp32 rounding of
  the backend's.
- `chosen_attention`: `attention`'s online softmax and `p @ v` over a ranking's own fp32 logits of the pages it chose
  (their values read in place): to rounding of the backend's softmax-then-product.
- `choose`: the mass is the softmax over a row's candidate tokens per query head, in fp32 (online over blocks of
  pages, then the pages' sums over the heads): to fp32 rounding of the backend's (`page_mass`, a summation order of
  its own), NaN where a head has no finite logit, the score itself where it is infinite. The top K and the carried
  candidates are choices among candidates, a page index and a constant score: the backend's exactly; of equal masses
  the first candidates are taken, where `torch.topk` does not say which (pages scored -inf may then differ).
- `move_windows`: a sort, copies and index arithmetic, so the backend's writes bit for bit (the stable tensors' extra
  row, which padded places write, aside: several places may write it at once, and nothing reads it).
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

BACKEND = "triton"  # the name `dispatch` routes by
OPS_NAMESPACE = "flexicache"  # torch.ops.flexicache.<name>

from .contracts import (check_append_token as _check_append_token, check_attention as _check_attention,
                        check_candidates as _check_candidates, check_choose as _check_choose,
                        check_chosen_attention as _check_chosen_attention, check_move_windows as _check_move_windows,
                        check_page_logits as _check_page_logits, check_page_scores as _check_page_scores,
                        fake_append_token, fake_attention, fake_candidates, fake_choose, fake_chosen_attention,
                        fake_move_windows, fake_page_logits, fake_page_scores)


# --------------------------------------------------------------------------------------------------
# Page scores
# --------------------------------------------------------------------------------------------------

@triton.jit
def _page_scores_kernel(
    q_ptr, meta_ptr, bias_ptr, out_ptr,
    G, D, E, PAGES,
    stride_qn, stride_qg, stride_qd,
    stride_mn, stride_mc, stride_me,
    stride_bn, stride_be,
    stride_on, stride_op,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_PAGES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: one row, BLOCK_PAGES pages (BLOCK_PAGES * S_PAD entry slots, slot j is entry j % S_PAD of the
    block's page j // S_PAD). The 2D channels of [kmax; kmin] are walked in chunks of BLOCK_C, each one `tl.dot` of the
    group's `[relu(q), min(q, 0)]` against the entries' chunk."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    BLOCK_E: tl.constexpr = BLOCK_PAGES * S_PAD

    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_E)
    sub = offs_j % S_PAD
    page = block * BLOCK_PAGES + offs_j // S_PAD
    entry = page * S + sub
    e_ok = (sub < S) & (page < PAGES)
    g_ok = offs_g < G

    acc = tl.zeros([BLOCK_G, BLOCK_E], dtype=tl.float32)
    for c0 in range(0, 2 * D, BLOCK_C):
        chan = c0 + offs_c
        c_ok = chan < 2 * D
        first = chan < D  # kmax channels, then kmin channels
        dq = tl.where(first, chan, chan - D)
        q = tl.load(q_ptr + row * stride_qn + offs_g[:, None] * stride_qg + dq[None, :] * stride_qd,
                    mask=g_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        q = tl.where(first[None, :], tl.maximum(q, 0.0), tl.minimum(q, 0.0))
        m = tl.load(meta_ptr + row * stride_mn + chan[:, None] * stride_mc + entry[None, :] * stride_me,
                    mask=c_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(q, m, input_precision="ieee")

    bias = tl.load(bias_ptr + row * stride_bn + entry * stride_be, mask=e_ok, other=0.0).to(tl.float32)
    bound = acc + bias[None, :]
    bound = tl.where(g_ok[:, None] & e_ok[None, :], bound, float("-inf"))
    best = tl.max(bound, axis=0)  # [BLOCK_E]: max over the group
    best = tl.max(tl.reshape(best, (BLOCK_PAGES, S_PAD)), axis=1)  # max over the page's entries
    offs_p = block * BLOCK_PAGES + tl.arange(0, BLOCK_PAGES)
    tl.store(out_ptr + row * stride_on + offs_p * stride_op, best, mask=offs_p < PAGES)


def _strides(prefix: str, suffixes: str, strides) -> dict:
    return {f"stride_{prefix}{c}": int(st) for c, st in zip(suffixes, strides, strict=True)}


def _page_scores_launch(query, meta, bias, subpages, out):
    """`(grid, args, constexprs, options)` of one `_page_scores_kernel` launch (host numbers of the shapes only).

    About 128 entry slots a program (BLOCK_PAGES pages of S_PAD slots), 64 channels a `tl.dot`, the group padded to 16
    rows: every `tl.dot` dimension at least 16, as compiled Triton requires. 8 warps: on sm_90 (Triton 3.9, `ptxas
    -v`) 65-80 registers and no spill for every dtype; over 4 warps the fp16 variant spilled about 100 bytes."""
    n, g, d = query.shape
    pages = out.shape[1]
    s_pad = triton.next_power_of_2(subpages)
    block_pages = max(1, 128 // s_pad)
    args = dict(q_ptr=query, meta_ptr=meta, bias_ptr=bias, out_ptr=out, G=g, D=d, E=meta.shape[2], PAGES=pages,
                **_strides("q", "ngd", query.stride()), **_strides("m", "nce", meta.stride()),
                **_strides("b", "ne", bias.stride()), **_strides("o", "np", out.stride()))
    constexprs = dict(S=subpages, S_PAD=s_pad, BLOCK_PAGES=block_pages, BLOCK_G=max(16, triton.next_power_of_2(g)),
                      BLOCK_C=max(16, min(64, triton.next_power_of_2(2 * d))))
    return (n, triton.cdiv(pages, block_pages)), args, constexprs, dict(num_warps=8)


@torch.library.custom_op("flexicache::page_scores", mutates_args=())
def page_scores(query: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor, subpages: int) -> torch.Tensor:
    """The Quest bound of each page (Triton); see `torch_backend.page_scores`. `[n, G, D]`, `[n, 2D, E]`, `[n, E]` ->
    `[n, E / S]` fp32."""
    _check_page_scores(query, meta, bias, subpages)
    _check_device(query, meta, bias)
    n, pages = query.shape[0], meta.shape[2] // subpages
    out = torch.empty(n, pages, device=query.device, dtype=torch.float32)
    if n == 0 or pages == 0:
        return out
    grid, args, constexprs, options = _page_scores_launch(query, meta, bias, subpages, out)
    _page_scores_kernel[grid](**args, **constexprs, **options)
    return out


page_scores.register_fake(fake_page_scores)


# --------------------------------------------------------------------------------------------------
# Decode attention
# --------------------------------------------------------------------------------------------------

@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PV_FP32: tl.constexpr):
    """One block of tokens of an online softmax: logits `s [BLOCK_G, BLOCK_N]` in the log2 domain (-inf where masked),
    their values `v [BLOCK_N, BLOCK_DV]`; the running max `m_i`, sum `l_i` and output `acc` -> updated. `p @ v` with the
    probabilities in the values' dtype (fp32 "ieee" dots where `PV_FP32`, see `_dot_fp32`)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # While a head has seen only masked tokens its max is -inf: shift by 0 so exp2 gives 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    if PV_FP32:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    G, D, DV, M, tokens_per_split,
    scaling, softcap,
    stride_qn, stride_qg, stride_qd,
    stride_kn, stride_km, stride_kd,
    stride_vn, stride_vm, stride_vd,
    stride_bn, stride_bg, stride_bm,
    stride_on, stride_og, stride_od,
    stride_pn, stride_ps, stride_pg, stride_pd,
    stride_ln, stride_ls, stride_lg,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    QK_FP32: tl.constexpr,
    PV_FP32: tl.constexpr,
):
    """One program: one row's G query heads (the rows of each `tl.dot`) over one split of its M tokens, BLOCK_N tokens
    an iteration, online softmax in the log2 domain. SPLIT: write the split's normalised output and log2-sum-exp for
    `_combine_kernel`; else the output itself."""
    row = tl.program_id(0)
    split = tl.program_id(1)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    q = tl.load(q_ptr + row * stride_qn + offs_g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)  # the backend's query.to(keys.dtype)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)

    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, M)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        ok = tok < end
        k = tl.load(k_ptr + row * stride_kn + tok[:, None] * stride_km + offs_d[None, :] * stride_kd,
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if QK_FP32:  # fp32 keys, or bf16 ones under the interpreter (see `_attention_launches`): the same products
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scaling
        if HAS_SOFTCAP:
            # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|): no overflow, exactly +-1 far out.
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0.0, -t, t) * softcap
        b = tl.load(b_ptr + row * stride_bn + offs_g[:, None] * stride_bg + tok[None, :] * stride_bm,
                    mask=g_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)
        s = tl.where(ok[None, :], (s + b) * 1.4426950408889634, float("-inf"))

        v = tl.load(v_ptr + row * stride_vn + tok[:, None] * stride_vm + offs_dv[None, :] * stride_vd,
                    mask=ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PV_FP32)

    if SPLIT:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        # A split with no attendable token weighs 0; a NaN (a +inf bias) stays NaN for the combine to propagate.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(part_o_ptr + row * stride_pn + split * stride_ps + offs_g[:, None] * stride_pg
                 + offs_dv[None, :] * stride_pd, o, mask=g_ok[:, None] & dv_ok[None, :])
        tl.store(part_lse_ptr + row * stride_ln + split * stride_ls + offs_g * stride_lg, lse, mask=g_ok)
    else:
        o = acc / l_i[:, None]  # 0 / 0 = NaN for a fully masked head, as torch.softmax in the backend
        tl.store(out_ptr + row * stride_on + offs_g[:, None] * stride_og + offs_dv[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & dv_ok[None, :])


@triton.jit
def _combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    SPLITS, DV,
    stride_pn, stride_ps, stride_pg, stride_pd,
    stride_ln, stride_ls, stride_lg,
    stride_on, stride_og, stride_od,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program: one (row, query head); the splits' outputs weighted by their share of the softmax."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < SPLITS
    dv_ok = offs_dv < DV
    lse = tl.load(part_lse_ptr + row * stride_ln + offs_s * stride_ls + g * stride_lg, mask=s_ok,
                  other=float("-inf"))
    has_nan = tl.max((lse != lse).to(tl.int32), axis=0) > 0
    lse = tl.where(lse != lse, float("-inf"), lse)
    mx = tl.max(lse, axis=0)
    w = tl.math.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))  # 0 for a split with no attendable token
    o = tl.load(part_o_ptr + row * stride_pn + offs_s[:, None] * stride_ps + g * stride_pg
                + offs_dv[None, :] * stride_pd, mask=s_ok[:, None] & dv_ok[None, :], other=0.0)
    den = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0.0, den, 1.0)
    res = tl.where(has_nan | (den == 0.0), float("nan"), res)  # all masked or +inf bias: NaN, as the backend
    tl.store(out_ptr + row * stride_on + g * stride_og + offs_dv * stride_od, res.to(out_ptr.dtype.element_ty),
             mask=dv_ok)


_MAX_SPLITS = 64


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _attention_blocks(channels: int, fp32: bool) -> tuple[int, int]:
    """`(BLOCK_N, num_warps)` of `_attention_kernel` for the larger of D and Dv and fp32 keys or values.

    Chosen from the sm_90 build (Triton 3.9, `ptxas -v`; no GPU run, so no timing behind them) as the largest token
    block that does not spill registers: 16-bit, up to 128 channels: 64 tokens over 8 warps (about 200 registers; over
    4 warps 248), 256 channels: 32 over 8 (about 215); fp32 (its "ieee" dots take far more registers and shared
    memory): 32 over 8 (about 90; 32 over 4 spilled 900 bytes), 256 channels: 16 over 4 (about 150)."""
    if fp32:
        return (32, 8) if channels <= 128 else (16, 4)
    return (64, 8) if channels <= 128 else (32, 8)


def _dot_fp32(dtype: torch.dtype) -> bool:
    """Whether `_attention_kernel` takes a `tl.dot` over operands of `dtype` in fp32 ("ieee": never TF32): for fp32,
    and for bf16 under the interpreter, whose `tl.dot` of bf16 operands gives garbage (Triton 3.9: it multiplies their
    raw bits; fp16 is right). The operands are rounded to `dtype` first, so the products are those of the 16-bit dot."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted())


def _attention_launches(query, keys, values, bias, scaling, softcap, out, target=None):
    """`[(kernel, grid, args, constexprs, options)]` of one attention call: `_attention_kernel`, then `_combine_kernel`
    when the tokens are split (host numbers of the shapes only; the split buffers are allocated here).

    BLOCK_N tokens an iteration, the group padded to 16 rows (`tl.dot`'s minimum). Splits: enough programs for about
    `target` (two per SM on CUDA; 4 elsewhere, so that small interpreter tests exercise the combine), at most one per
    BLOCK_N tokens and `_MAX_SPLITS`. `_attention_blocks` gives BLOCK_N and the warps.
    """
    n, g, d = query.shape
    m, dv = keys.shape[1], values.shape[2]
    block_n, warps = _attention_blocks(max(d, dv), torch.float32 in (keys.dtype, values.dtype))
    blocks = max(1, triton.cdiv(m, block_n))
    if target is None:
        device = query.device
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 4
    splits = max(1, min(blocks, triton.cdiv(target, max(n, 1)), _MAX_SPLITS))
    tokens_per_split = triton.cdiv(blocks, splits) * block_n
    splits = max(1, triton.cdiv(m, tokens_per_split))  # no empty trailing split
    if splits > 1:
        part_o = torch.empty(n, splits, g, dv, device=values.device, dtype=torch.float32)
        part_lse = torch.empty(n, splits, g, device=values.device, dtype=torch.float32)
    else:  # never touched: SPLIT is off
        part_o, part_lse = out.view(n, 1, g, dv), out[:, None, :, 0]
    b_strides = (bias.stride(0), 0, bias.stride(1)) if bias.dim() == 2 else bias.stride()
    block_dv = max(16, triton.next_power_of_2(dv))
    parts = {**_strides("p", "nsgd", part_o.stride()), **_strides("l", "nsg", part_lse.stride())}
    args = dict(q_ptr=query, k_ptr=keys, v_ptr=values, b_ptr=bias, out_ptr=out, part_o_ptr=part_o,
                part_lse_ptr=part_lse, G=g, D=d, DV=dv, M=m, tokens_per_split=tokens_per_split,
                scaling=float(scaling), softcap=float(softcap) if softcap is not None else 1.0,
                **_strides("q", "ngd", query.stride()), **_strides("k", "nmd", keys.stride()),
                **_strides("v", "nmd", values.stride()), **_strides("b", "ngm", b_strides),
                **_strides("o", "ngd", out.stride()), **parts)
    constexprs = dict(BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=max(16, triton.next_power_of_2(d)),
                      BLOCK_DV=block_dv, BLOCK_N=block_n, HAS_SOFTCAP=softcap is not None, SPLIT=splits > 1,
                      QK_FP32=_dot_fp32(keys.dtype), PV_FP32=_dot_fp32(values.dtype))
    launches = [(_attention_kernel, (n, splits), args, constexprs, dict(num_warps=warps))]
    if splits > 1:
        launches.append((_combine_kernel, (n, g),
                         dict(part_o_ptr=part_o, part_lse_ptr=part_lse, out_ptr=out, SPLITS=splits, DV=dv, **parts,
                              **_strides("o", "ngd", out.stride())),
                         dict(BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_DV=block_dv),
                         dict(num_warps=4)))
    return launches


def _check_device(*tensors):
    first = tensors[0].device
    if any(t.device != first for t in tensors):
        raise ValueError(f"the Triton kernels need every input on one device, got {[str(t.device) for t in tensors]}")
    if first.type != "cuda" and not interpreted():
        raise RuntimeError(f"the Triton backend runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, set "
                           f"before triton is first imported), got {first}; use FLEXICACHE_BACKEND=torch")


def interpreted() -> bool:
    """Whether this module's kernels run under Triton's interpreter (TRITON_INTERPRET=1 when they were defined)."""
    return not isinstance(_attention_kernel, triton.runtime.JITFunction)


@torch.library.custom_op("flexicache::attention", mutates_args=())
def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float,
              softcap: Optional[float] = None) -> torch.Tensor:
    """Decode attention over gathered tokens (Triton); see `torch_backend.attention`. `[n, G, D]`, `[n, M, D]`,
    `[n, M, Dv]`, `[n, M]` or `[n, G, M]` -> `[n, G, Dv]` in the values' dtype."""
    _check_attention(query, keys, values, bias)
    _check_device(query, keys, values, bias)
    n, g, d = query.shape
    m, dv = keys.shape[1], values.shape[2]
    if n == 0 or g == 0 or m == 0:
        return torch.zeros(n, g, dv, device=values.device, dtype=values.dtype)
    out = torch.empty(n, g, dv, device=values.device, dtype=values.dtype)
    for kernel, grid, args, constexprs, opts in _attention_launches(query, keys, values, bias, scaling, softcap, out):
        kernel[grid](**args, **constexprs, **opts)
    return out


attention.register_fake(fake_attention)


# --------------------------------------------------------------------------------------------------
# A decode token's writes
# --------------------------------------------------------------------------------------------------

@triton.jit
def _append_token_kernel(
    k_ptr, v_ptr, pos_ptr, len_ptr, fk_ptr, fv_ptr, meta_ptr, meta_row_ptr, wk_ptr, wv_ptr, wshift_ptr, local_ptr,
    nk_ptr, nv_ptr, near_ptr,
    D, DV, N_S,
    stride_kn, stride_kd, stride_vn, stride_vd,
    stride_fkn, stride_fkt, stride_fkd, stride_fvn, stride_fvt, stride_fvd,
    stride_mn, stride_mc, stride_me,
    stride_wkt, stride_wkd, stride_wvt, stride_wvd,
    stride_nkn, stride_nkt, stride_nkd, stride_nvn, stride_nvt, stride_nvd,
    SUB: tl.constexpr,
    BLOCK_SUB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NEAR: tl.constexpr,
):
    """One program: one row's token at `position`, written to the full tier, to its window (a stable row) or its near
    tier (the others, where apart), and the MinMax entry of its sub-page from that sub-page's SUB tokens (the new one
    taken from the registers, so no program reads what another wrote). Program 0 adds the token to the count."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    key = tl.load(k_ptr + row * stride_kn + offs_d * stride_kd, mask=d_ok)
    value = tl.load(v_ptr + row * stride_vn + offs_dv * stride_vd, mask=dv_ok)
    tl.store(fk_ptr + row * stride_fkn + pos * stride_fkt + offs_d * stride_fkd, key, mask=d_ok)
    tl.store(fv_ptr + row * stride_fvn + pos * stride_fvt + offs_dv * stride_fvd, value, mask=dv_ok)

    local = tl.load(local_ptr + row)  # among the stable rows; N_S (the extra row) for the others
    stable_d = (offs_d * 0 + local) < N_S  # as blocks: the interpreter takes no scalar in a mask
    stable_dv = (offs_dv * 0 + local) < N_S
    slot = tl.load(wshift_ptr + local) + pos  # `win_shift + position`: the flat window index
    tl.store(wk_ptr + slot * stride_wkt + offs_d * stride_wkd, key, mask=d_ok & stable_d)
    tl.store(wv_ptr + slot * stride_wvt + offs_dv * stride_wvd, value, mask=dv_ok & stable_dv)
    if NEAR:
        near = tl.load(near_ptr + row)
        tl.store(nk_ptr + near * stride_nkn + pos * stride_nkt + offs_d * stride_nkd, key, mask=d_ok & ~stable_d)
        tl.store(nv_ptr + near * stride_nvn + pos * stride_nvt + offs_dv * stride_nvd, value, mask=dv_ok & ~stable_dv)

    sub = pos // SUB
    offs_t = sub * SUB + tl.arange(0, BLOCK_SUB)
    t_ok = tl.arange(0, BLOCK_SUB) < SUB
    tokens = tl.load(fk_ptr + row * stride_fkn + offs_t[:, None] * stride_fkt + offs_d[None, :] * stride_fkd,
                     mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    # In fp32 (exact for a max or min of 16-bit values; Triton 3.6's interpreter has no 16-bit constants).
    tokens = tl.where((offs_t == pos)[:, None], key.to(tl.float32)[None, :], tokens.to(tl.float32))
    high = tl.max(tl.where(t_ok[:, None], tokens, float("-inf")), axis=0)
    low = tl.min(tl.where(t_ok[:, None], tokens, float("inf")), axis=0)
    # tl.max / tl.min skip NaN on a GPU; a NaN key makes its channel's bounds NaN, as amax / amin do.
    nan = tl.max((t_ok[:, None] & (tokens != tokens)).to(tl.int32), axis=0) > 0
    high = tl.where(nan, float("nan"), high)
    low = tl.where(nan, float("nan"), low)
    entry = meta_ptr + tl.load(meta_row_ptr + row) * stride_mn + sub * stride_me
    tl.store(entry + offs_d * stride_mc, high.to(meta_ptr.dtype.element_ty), mask=d_ok)
    tl.store(entry + (D + offs_d) * stride_mc, low.to(meta_ptr.dtype.element_ty), mask=d_ok)
    if row == 0:
        tl.atomic_add(len_ptr, 1)


@torch.library.custom_op("flexicache::append_token", mutates_args=("length", "full_k", "full_v", "meta", "win_k",
                                                                    "win_v", "near_k", "near_v"))
def append_token(keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, length: torch.Tensor,
                 full_k: torch.Tensor, full_v: torch.Tensor, meta: torch.Tensor, meta_row: torch.Tensor,
                 win_k: torch.Tensor, win_v: torch.Tensor, win_shift: torch.Tensor, stable_local: torch.Tensor,
                 near_k: torch.Tensor, near_v: torch.Tensor, near_place: torch.Tensor, subpage_len: int) -> None:
    """A decode token's writes in one launch (Triton); see `torch_backend.append_token`."""
    _check_append_token(keys, values, full_k, full_v, meta, win_k, win_v, near_k, near_v, subpage_len)
    _check_device(keys, values, position, length, full_k, full_v, meta, win_k, win_v, near_k, near_v)
    if keys.shape[0] == 0:
        return
    args, constexprs = _append_token_launch(keys, values, position, length, full_k, full_v, meta, meta_row, win_k,
                                            win_v, win_shift, stable_local, near_k, near_v, near_place, subpage_len)
    _append_token_kernel[(keys.shape[0],)](**args, **constexprs)


def _append_token_launch(keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift,
                         stable_local, near_k, near_v, near_place, subpage_len):
    """`(args, constexprs)` of the `_append_token_kernel` launch, one program a row. Without a near tier apart (`near_k`
    None or empty) the kernel's near pointers are the full tier's and NEAR is off."""
    near = near_k is not None and near_k.numel() > 0
    near_k, near_v = (near_k, near_v) if near else (full_k, full_v)
    d, dv = keys.shape[1], values.shape[1]
    args = dict(k_ptr=keys, v_ptr=values, pos_ptr=position, len_ptr=length, fk_ptr=full_k, fv_ptr=full_v,
                meta_ptr=meta, meta_row_ptr=meta_row, wk_ptr=win_k, wv_ptr=win_v, wshift_ptr=win_shift,
                local_ptr=stable_local, nk_ptr=near_k, nv_ptr=near_v, near_ptr=near_place, D=d, DV=dv,
                N_S=win_shift.shape[0] - 1,
                **_strides("k", "nd", keys.stride()), **_strides("v", "nd", values.stride()),
                **_strides("fk", "ntd", full_k.stride()), **_strides("fv", "ntd", full_v.stride()),
                **_strides("m", "nce", meta.stride()),
                **_strides("wk", "td", win_k.stride()[1:]), **_strides("wv", "td", win_v.stride()[1:]),
                **_strides("nk", "ntd", near_k.stride()), **_strides("nv", "ntd", near_v.stride()))
    constexprs = dict(SUB=subpage_len, BLOCK_SUB=triton.next_power_of_2(subpage_len),
                      BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv), NEAR=near)
    return args, constexprs


append_token.register_fake(fake_append_token)


# --------------------------------------------------------------------------------------------------
# Refinement's choice: the candidates' mass, the top K, the carried candidates
# --------------------------------------------------------------------------------------------------

@triton.jit
def _row_mass(logits_ptr, scores_ptr, out_ptr, row, G, C, stride_ln, stride_lg, stride_lc, stride_lp, stride_sn,
              stride_sc, stride_on, stride_oc, P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
              BLOCK_C: tl.constexpr):
    """Refinement's key of one row into `out`: first each head's softmax max and sum over all its candidates' tokens
    (online, BLOCK_C pages at a time), then per block of pages the mass of each page summed over the heads, over G, or
    the score where that is infinite. A head whose every token is -inf gives NaN, as `torch.softmax` does."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    base = logits_ptr + row * stride_ln
    peak = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    for g in range(0, G):
        m = float("-inf")
        z = 0.0
        for start in range(0, C, BLOCK_C):
            c_ok = start + offs_c < C
            x = tl.load(base + g * stride_lg + (start + offs_c)[:, None] * stride_lc + offs_p[None, :] * stride_lp,
                        mask=c_ok[:, None] & p_ok[None, :], other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(tl.max(x, axis=1), axis=0))
            live = m_new != float("-inf")  # until a finite logit, nothing to rescale or add
            added = tl.sum(tl.sum(tl.exp(x - m_new), axis=1), axis=0)
            z = tl.where(live, z * tl.exp(m - m_new) + added, 0.0)
            m = m_new
        peak = tl.where(offs_g == g, m, peak)
        total = tl.where(offs_g == g, z, total)
    for start in range(0, C, BLOCK_C):
        c_ok = start + offs_c < C
        mass = tl.zeros([BLOCK_C], dtype=tl.float32)
        for g in range(0, G):
            m = tl.sum(tl.where(offs_g == g, peak, 0.0), axis=0)
            z = tl.sum(tl.where(offs_g == g, total, 0.0), axis=0)
            x = tl.load(base + g * stride_lg + (start + offs_c)[:, None] * stride_lc + offs_p[None, :] * stride_lp,
                        mask=c_ok[:, None] & p_ok[None, :], other=float("-inf")).to(tl.float32)
            mass += tl.sum(tl.exp(x - m), axis=1) / z
        mass = mass / G
        score = tl.load(scores_ptr + row * stride_sn + (start + offs_c) * stride_sc, mask=c_ok, other=0.0)
        mass = tl.where(tl.abs(score) == float("inf"), score, mass)
        tl.store(out_ptr + row * stride_on + (start + offs_c) * stride_oc, mass, mask=c_ok)


@triton.jit
def _top_places(values, ok, COUNT):
    """`[BLOCK]` bool: the COUNT largest of `values` (fp32, where `ok`), of equal ones the first. As int32 in the
    floats' order (NaN above +inf, as `torch.topk` takes it) the COUNT-th largest is found by a binary search (32
    counts, no sort); the places above it and the first of those equal to it are taken."""
    bits = values.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(ok, key, -2147483648)  # the padded places below every mid the search tries
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    for _ in range(0, 32):  # the largest v with at least COUNT keys >= v
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0) >= COUNT
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    cut = lo.to(tl.int32)
    above = ok & (key > cut)
    at = ok & (key == cut)
    return above | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= COUNT - tl.sum(above.to(tl.int32), axis=0)))


@triton.jit
def _choose_kernel(
    logits_ptr, scores_ptr, cand_ptr, page_ptr, mass_ptr, top_ptr, chosen_ptr, cpages_ptr, cscores_ptr,
    G, C, K, W, score,
    stride_ln, stride_lg, stride_lc, stride_lp, stride_sn, stride_sc, stride_cn, stride_cc, stride_page,
    stride_mn, stride_mc, stride_tn, stride_tk, stride_hn, stride_hk, stride_pn, stride_pw, stride_qn, stride_qw,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_ALL: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CARRY: tl.constexpr,
):
    """One program: one row. Its candidates' mass (`_row_mass`, written out, read back whole); the K of most mass
    (`_top_places`), their places and pages in candidate order; the CARRY candidates of most mass, one at a time (the
    first of equal masses; NaN and +-inf count as 0), each with the page after it, both at most the page being filled,
    carried with `score` where the mass is positive (else -inf), the places past `2 CARRY` page 0 and -inf."""
    row = tl.program_id(0).to(tl.int64)
    _row_mass(logits_ptr, scores_ptr, mass_ptr, row, G, C, stride_ln, stride_lg, stride_lc, stride_lp, stride_sn,
              stride_sc, stride_mn, stride_mc, P, BLOCK_P, BLOCK_G, BLOCK_C)
    tl.debug_barrier()  # every thread's masses written before any reads them back
    offs_c = tl.arange(0, BLOCK_ALL)
    c_ok = offs_c < C
    mass = tl.load(mass_ptr + row * stride_mn + offs_c * stride_mc, mask=c_ok, other=0.0)
    cand = tl.load(cand_ptr + row * stride_cn + offs_c * stride_cc, mask=c_ok, other=0)
    taken = _top_places(mass, c_ok, K)
    place = tl.cumsum(taken.to(tl.int32), axis=0) - 1
    tl.store(top_ptr + row * stride_tn + place * stride_tk, offs_c.to(tl.int64), mask=taken)
    tl.store(chosen_ptr + row * stride_hn + place * stride_hk, cand, mask=taken)
    if CARRY:
        mass = tl.where((mass == mass) & (tl.abs(mass) != float("inf")), mass, 0.0)  # NaN, +-inf: 0
        key = tl.where(c_ok, mass, -2.0)  # the padded places below every mass (>= 0) and below a taken one (-1)
        limit = tl.load(page_ptr + row * stride_page)
        offs_w = tl.arange(0, BLOCK_W)
        pages = tl.zeros([BLOCK_W], dtype=tl.int64)
        scores = tl.full([BLOCK_W], float("-inf"), dtype=tl.float32)
        for j in tl.static_range(CARRY):
            best = tl.max(key, axis=0)
            at = tl.min(tl.where(key == best, offs_c, BLOCK_ALL), axis=0)  # the first place of the most mass
            page = tl.sum(tl.where(offs_c == at, cand, 0), axis=0).to(tl.int64)
            carried = tl.where(best > 0, score, float("-inf"))
            pages = tl.where(offs_w == 2 * j, tl.minimum(page, limit),
                             tl.where(offs_w == 2 * j + 1, tl.minimum(page + 1, limit), pages))
            scores = tl.where((offs_w == 2 * j) | (offs_w == 2 * j + 1), carried, scores)
            key = tl.where(offs_c == at, -1.0, key)
        w_ok = offs_w < W
        tl.store(cpages_ptr + row * stride_pn + offs_w * stride_pw, pages, mask=w_ok)
        tl.store(cscores_ptr + row * stride_qn + offs_w * stride_qw, scores, mask=w_ok)


def _choose_launch(logits, scores, cand, page, k, carry, score, pages_out, scores_out, mass, top, chosen):
    """`(args, constexprs)` of the `_choose_kernel` launch, one program a row; the mass about 1024 tokens a block."""
    n, g, c, p = logits.shape
    args = dict(logits_ptr=logits, scores_ptr=scores, cand_ptr=cand, page_ptr=page, mass_ptr=mass, top_ptr=top,
                chosen_ptr=chosen, cpages_ptr=pages_out, cscores_ptr=scores_out, G=g, C=c, K=k,
                W=pages_out.shape[1], score=float(score),
                **_strides("l", "ngcp", logits.stride()), **_strides("s", "nc", scores.stride()),
                **_strides("c", "nc", cand.stride()),
                stride_page=int(page.stride(0)) if page.dim() and page.numel() > 1 else 0,
                **_strides("m", "nc", mass.stride()), **_strides("t", "nk", top.stride()),
                **_strides("h", "nk", chosen.stride()), **_strides("p", "nw", pages_out.stride()),
                **_strides("q", "nw", scores_out.stride()))
    block_p = triton.next_power_of_2(p)
    constexprs = dict(P=p, BLOCK_P=block_p, BLOCK_G=triton.next_power_of_2(g),
                      BLOCK_C=max(1, min(triton.next_power_of_2(c), 1024 // block_p)),
                      BLOCK_ALL=triton.next_power_of_2(c), BLOCK_W=triton.next_power_of_2(max(1, pages_out.shape[1])),
                      CARRY=carry)
    return args, constexprs


@torch.library.custom_op("flexicache::choose", mutates_args=("pages_out", "scores_out"))
def choose(logits: torch.Tensor, scores: torch.Tensor, cand: torch.Tensor, page: torch.Tensor, k: int, carry: int,
           score: float, pages_out: torch.Tensor, scores_out: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refinement's choice in one launch (Triton); see `torch_backend.choose`. -> `(mass [n, C] fp32, top [n, K],
    pages [n, K])`, the carried candidates written into `pages_out` and `scores_out`."""
    _check_choose(logits, scores, cand, page, k, carry, pages_out, scores_out)
    _check_device(logits, scores, cand, page, pages_out, scores_out)
    n, c = scores.shape
    mass = torch.empty(n, c, device=scores.device, dtype=torch.float32)
    top = torch.empty(n, k, device=scores.device, dtype=torch.long)
    chosen = torch.empty(n, k, device=scores.device, dtype=cand.dtype)
    if n:
        args, constexprs = _choose_launch(logits, scores, cand, page, k, carry, score, pages_out, scores_out, mass,
                                          top, chosen)
        _choose_kernel[(n,)](**args, **constexprs)
    return mass, top, chosen


choose.register_fake(fake_choose)


# --------------------------------------------------------------------------------------------------
# Refinement's candidates
# --------------------------------------------------------------------------------------------------

@triton.jit
def _candidates_kernel(
    scores_ptr, cpages_ptr, cscores_ptr, out_scores_ptr, out_pages_ptr,
    PAGES, W,
    stride_sn, stride_sp, stride_cpn, stride_cpw, stride_csn, stride_csw, stride_osn, stride_osc, stride_opn,
    stride_opc,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: one row. Its scores raised to its carried candidates' (the max where a page is carried); the C
    largest (`_top_places`: of equal ones the lower pages) are the candidates, written in page order (a chosen page's
    place is a cumulative sum)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < PAGES
    chosen = _top_places(_raised_scores(scores_ptr, cpages_ptr, cscores_ptr, row, offs, ok, W, stride_sn, stride_sp,
                                        stride_cpn, stride_cpw, stride_csn, stride_csw), ok, C)
    place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_pages_ptr + row * stride_opn + place * stride_opc, offs.to(tl.int64), mask=chosen)
    raised = _raised_scores(scores_ptr, cpages_ptr, cscores_ptr, row, offs, chosen, W, stride_sn, stride_sp,
                            stride_cpn, stride_cpw, stride_csn, stride_csw)  # again: not held through the search
    tl.store(out_scores_ptr + row * stride_osn + place * stride_osc, raised, mask=chosen)


@triton.jit
def _raised_scores(scores_ptr, cpages_ptr, cscores_ptr, row, offs, ok, W, stride_sn, stride_sp, stride_cpn, stride_cpw,
                   stride_csn, stride_csw):
    """A row's page scores at `offs` (where `ok`), each carried page's raised to its carried score where higher."""
    raised = tl.load(scores_ptr + row * stride_sn + offs * stride_sp, mask=ok, other=float("-inf"))
    for j in range(0, W):
        page = tl.load(cpages_ptr + row * stride_cpn + j * stride_cpw)
        score = tl.load(cscores_ptr + row * stride_csn + j * stride_csw)
        raised = tl.where(offs == page, tl.maximum(raised, score), raised)
    return raised


def _candidates_launch(scores, carried_pages, carried_scores, count, out_scores, out_pages):
    """`(args, constexprs, options)` of the `_candidates_kernel` launch, one program a row (its pages in one block),
    a warp per 64 pages (4 to 32): on sm_90 (`ptxas -v`) no spill up to 4096 pages (64k tokens of 16), 40 bytes at
    8192."""
    args = dict(scores_ptr=scores, cpages_ptr=carried_pages, cscores_ptr=carried_scores, out_scores_ptr=out_scores,
                out_pages_ptr=out_pages, PAGES=scores.shape[1], W=carried_pages.shape[1],
                **_strides("s", "np", scores.stride()), **_strides("cp", "nw", carried_pages.stride()),
                **_strides("cs", "nw", carried_scores.stride()), **_strides("os", "nc", out_scores.stride()),
                **_strides("op", "nc", out_pages.stride()))
    block = triton.next_power_of_2(scores.shape[1])
    return args, dict(C=count, BLOCK=block), dict(num_warps=min(32, max(4, block // 64)))


@torch.library.custom_op("flexicache::candidates", mutates_args=())
def candidates(scores: torch.Tensor, carried_pages: torch.Tensor, carried_scores: torch.Tensor,
               count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Refinement's candidates in one launch (Triton); see `torch_backend.candidates`. -> `(scores [n, C] fp32,
    pages [n, C] int64)`."""
    _check_candidates(scores, carried_pages, carried_scores, count)
    _check_device(scores, carried_pages, carried_scores)
    n = scores.shape[0]
    out_scores = torch.empty(n, count, device=scores.device, dtype=torch.float32)
    out_pages = torch.empty(n, count, device=scores.device, dtype=torch.long)
    if n:
        args, constexprs, options = _candidates_launch(scores, carried_pages, carried_scores, count, out_scores,
                                                       out_pages)
        _candidates_kernel[(n,)](**args, **constexprs, **options)
    return out_scores, out_pages


candidates.register_fake(fake_candidates)


# --------------------------------------------------------------------------------------------------
# Refinement's logits, the pages' keys read in place
# --------------------------------------------------------------------------------------------------

@triton.jit
def _page_logits_kernel(
    q_ptr, pages_ptr, rows_ptr, nk_ptr, nidx_ptr, fk_ptr, tok_ptr, seq_ptr, out_ptr,
    G, D, C, NEAR, scaling,
    stride_qn, stride_qg, stride_qd, stride_pn, stride_pc, stride_rn, stride_ni,
    stride_nkr, stride_nkt, stride_nkd, stride_fkr, stride_fkt, stride_fkd,
    stride_tb, stride_tp, stride_tt, stride_sn, stride_on, stride_og, stride_oc, stride_ot,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_PAGES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SEQ: tl.constexpr,
):
    """One program: one row, BLOCK_PAGES of its pages (slot j is token j % BLOCK_P of the block's page j // BLOCK_P).
    A row before NEAR reads its keys from the near tier, the others from the full tier (two masked loads, one of them
    live). Each logit is summed over the channels in chunks of BLOCK_D in one order whatever the slot, so a token's
    logit is the same number whichever pages it is scored with (`PageSelector._logits_again` relies on that)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    BLOCK_T: tl.constexpr = BLOCK_PAGES * BLOCK_P
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    tok = offs_t % BLOCK_P
    cand = block * BLOCK_PAGES + offs_t // BLOCK_P
    t_ok = (tok < P) & (cand < C)
    page = tl.load(pages_ptr + row * stride_pn + cand * stride_pc, mask=t_ok, other=0).to(tl.int64)
    r = tl.load(rows_ptr + row * stride_rn).to(tl.int64)
    near_row = tl.load(nidx_ptr + r * stride_ni).to(tl.int64)
    near = (tl.zeros([BLOCK_T], dtype=tl.int64) + row) < NEAR  # per slot, as a mask must be
    position = page * P + tok
    near_at = nk_ptr + near_row * stride_nkr + position * stride_nkt
    full_at = fk_ptr + r * stride_fkr + position * stride_fkt
    g_ok = offs_g < G
    acc = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        d_ok = start + offs_d < D
        q = tl.load(q_ptr + row * stride_qn + offs_g[:, None] * stride_qg + (start + offs_d)[None, :] * stride_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        kd = (start + offs_d)[None, :]
        ok = t_ok[:, None] & d_ok[None, :]
        k = (tl.load(near_at[:, None] + kd * stride_nkd, mask=ok & near[:, None], other=0.0).to(tl.float32)
             + tl.load(full_at[:, None] + kd * stride_fkd, mask=ok & ~near[:, None], other=0.0).to(tl.float32))
        acc += tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    if HAS_SEQ:
        s = tl.load(seq_ptr + row * stride_sn).to(tl.int64)
    else:
        s = 0
    bias = tl.load(tok_ptr + s * stride_tb + page * stride_tp + tok * stride_tt, mask=t_ok, other=0.0)
    logits = acc * scaling + bias[None, :]
    out = out_ptr + row * stride_on + offs_g[:, None] * stride_og + (cand * stride_oc + tok * stride_ot)[None, :]
    tl.store(out, logits, mask=g_ok[:, None] & t_ok[None, :])


def _page_logits_launch(query, pages, rows, near, near_k, near_index, full_k, tokens, seq, scaling, out):
    """`(grid, args, constexprs)` of the `_page_logits_kernel` launch: about 64 tokens and 16 channels a chunk."""
    n, c = pages.shape
    p = tokens.shape[2]
    block_p = triton.next_power_of_2(p)
    block_pages = max(1, 64 // block_p)
    args = dict(q_ptr=query, pages_ptr=pages, rows_ptr=rows, nk_ptr=near_k, nidx_ptr=near_index, fk_ptr=full_k,
                tok_ptr=tokens, seq_ptr=rows if seq is None else seq, out_ptr=out, G=query.shape[1], D=query.shape[2],
                C=c, NEAR=near, scaling=float(scaling),
                **_strides("q", "ngd", query.stride()), **_strides("p", "nc", pages.stride()),
                stride_rn=int(rows.stride(0)), stride_ni=int(near_index.stride(0)),
                **_strides("nk", "rtd", near_k.stride()), **_strides("fk", "rtd", full_k.stride()),
                **_strides("t", "bpt", tokens.stride()), stride_sn=int(seq.stride(0)) if seq is not None else 0,
                **_strides("o", "ngct", out.stride()))
    constexprs = dict(P=p, BLOCK_P=block_p, BLOCK_PAGES=block_pages, BLOCK_G=triton.next_power_of_2(query.shape[1]),
                      BLOCK_D=16, HAS_SEQ=seq is not None)
    return (n, triton.cdiv(c, block_pages)), args, constexprs


@torch.library.custom_op("flexicache::page_logits", mutates_args=())
def page_logits(query: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, near: int, near_k: torch.Tensor,
                near_index: torch.Tensor, full_k: torch.Tensor, tokens: torch.Tensor, seq: Optional[torch.Tensor],
                scaling: float) -> torch.Tensor:
    """Refinement's logits of pages read in place, in one launch (Triton); see `torch_backend.page_logits`.
    -> `[n, G, C, P]` fp32."""
    _check_page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq)
    _check_device(query, pages, rows, near_k, near_index, full_k, tokens, *(() if seq is None else (seq,)))
    n, c = pages.shape
    out = torch.empty(n, query.shape[1], c, tokens.shape[2], device=query.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    grid, args, constexprs = _page_logits_launch(query, pages, rows, near, near_k, near_index, full_k, tokens, seq,
                                                 scaling, out)
    _page_logits_kernel[grid](**args, **constexprs)
    return out


page_logits.register_fake(fake_page_logits)


# --------------------------------------------------------------------------------------------------
# Attention over a ranking's own logits
# --------------------------------------------------------------------------------------------------

@triton.jit
def _chosen_attention_kernel(
    logits_ptr, top_ptr, pages_ptr, starts_ptr, v_ptr, out_ptr,
    G, K, DV,
    stride_ln, stride_lg, stride_lc, stride_lp, stride_tn, stride_tk, stride_pn, stride_pk, stride_sn,
    stride_vt, stride_vd, stride_on, stride_og, stride_od,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PV_FP32: tl.constexpr,
):
    """One program: one row's G query heads over its K chosen pages, BLOCK_K pages an iteration (slot j is token
    j % BLOCK_P of page j // BLOCK_P): the ranking's logits of the chosen pages (`top`, their places among the
    candidates) in an online softmax (log2 domain), the values read in place (`starts + pages`: pages of the flat
    tier), `p @ v` with the probabilities in the values' dtype as `_attention_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    BLOCK_T: tl.constexpr = BLOCK_K * BLOCK_P
    offs_g = tl.arange(0, BLOCK_G)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_t = tl.arange(0, BLOCK_T)
    tok = offs_t % BLOCK_P
    g_ok = offs_g < G
    dv_ok = offs_dv < DV
    start = tl.load(starts_ptr + row * stride_sn).to(tl.int64)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 + offs_t // BLOCK_P
        ok = (j < K) & (tok < P)
        place = tl.load(top_ptr + row * stride_tn + j * stride_tk, mask=ok, other=0).to(tl.int64)
        page = tl.load(pages_ptr + row * stride_pn + j * stride_pk, mask=ok, other=0).to(tl.int64)
        s = tl.load(logits_ptr + row * stride_ln + offs_g[:, None] * stride_lg
                    + (place * stride_lc + tok * stride_lp)[None, :], mask=g_ok[:, None] & ok[None, :],
                    other=float("-inf")) * 1.4426950408889634
        v = tl.load(v_ptr + ((start + page) * P + tok)[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                    mask=ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PV_FP32)
    o = acc / l_i[:, None]  # 0 / 0 = NaN for a fully masked head, as torch.softmax in the backend
    tl.store(out_ptr + row * stride_on + offs_g[:, None] * stride_og + offs_dv[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & dv_ok[None, :])


def _chosen_attention_launch(logits, top, pages, starts, values, out):
    """`(args, constexprs, options)` of the `_chosen_attention_kernel` launch, one program a row; tokens a block and
    warps as `_attention_kernel`'s (`_attention_blocks`)."""
    g, p, dv = logits.shape[1], logits.shape[3], values.shape[1]
    block_n, warps = _attention_blocks(dv, values.dtype == torch.float32)
    block_p = triton.next_power_of_2(p)
    args = dict(logits_ptr=logits, top_ptr=top, pages_ptr=pages, starts_ptr=starts, v_ptr=values, out_ptr=out, G=g,
                K=top.shape[1], DV=dv, **_strides("l", "ngcp", logits.stride()), **_strides("t", "nk", top.stride()),
                **_strides("p", "nk", pages.stride()), stride_sn=int(starts.stride(0)),
                **_strides("v", "td", values.stride()), **_strides("o", "ngd", out.stride()))
    constexprs = dict(P=p, BLOCK_P=block_p, BLOCK_K=max(1, block_n // block_p),
                      BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                      PV_FP32=_dot_fp32(values.dtype))
    return args, constexprs, dict(num_warps=warps)


@torch.library.custom_op("flexicache::chosen_attention", mutates_args=())
def chosen_attention(logits: torch.Tensor, top: torch.Tensor, pages: torch.Tensor, starts: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """Attention over a ranking's own logits of its chosen pages, in one launch (Triton); see
    `torch_backend.chosen_attention`. -> `[m, G, Dv]` in the values' dtype."""
    _check_chosen_attention(logits, top, pages, starts, values)
    _check_device(logits, top, pages, starts, values)
    m = top.shape[0]
    out = torch.empty(m, logits.shape[1], values.shape[1], device=values.device, dtype=values.dtype)
    if m:
        args, constexprs, options = _chosen_attention_launch(logits, top, pages, starts, values, out)
        _chosen_attention_kernel[(m,)](**args, **constexprs, **options)
    return out


chosen_attention.register_fake(fake_chosen_attention)


# --------------------------------------------------------------------------------------------------
# A re-rank's window moves
# --------------------------------------------------------------------------------------------------

@triton.jit
def _move_windows_kernel(
    pages_ptr, page_ptr, local_ptr, rows_ptr, fk_ptr, fv_ptr, wk_ptr, wv_ptr, wpages_ptr, wshift_ptr, wbase_ptr,
    wbias_ptr, sbatch_ptr, promoted_ptr,
    KR, PAGES, N_S, D, DV,
    stride_pn, stride_pk, stride_page,
    stride_fkr, stride_fkt, stride_fkd, stride_fvr, stride_fvt, stride_fvd,
    stride_wkn, stride_wkt, stride_wkd, stride_wvn, stride_wvt, stride_wvd,
    stride_wpn, stride_wpw, stride_wbn, stride_wbw,
    K: tl.constexpr,
    W: tl.constexpr,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    COUNT: tl.constexpr,
):
    """One program: one ranked row's new window (`fc_hf/tiers.py`: `plan_windows`, `newly_resident`, the copy of its
    first K pages from the full tier and `install_windows`). The ranking's pages in page order, the page being filled
    at position K - 1, a page that does not exist yet none (-1), the pages it will open after; pages not held before
    counted into `promoted` (COUNT) for a real stable row (`local < N_S`)."""
    i = tl.program_id(0).to(tl.int64)
    at = tl.load(page_ptr + i * stride_page)
    local = tl.load(local_ptr + i)
    row = tl.load(rows_ptr + i)
    offs_k = tl.arange(0, BLOCK_K)
    ranked = tl.load(pages_ptr + i * stride_pn + offs_k * stride_pk, mask=offs_k < KR, other=0)
    ranked = tl.where(offs_k < KR, ranked, PAGES + offs_k - KR)  # fewer pages than K: pages past the capacity
    ranked = tl.where(offs_k < K, ranked, 2 * PAGES + BLOCK_K)  # the padded places sort last
    pages = tl.sort(ranked)
    last = tl.sum(tl.where(offs_k == K - 1, pages, 0), axis=0)
    pages = tl.where(pages == at, last, pages)
    pages = tl.where(offs_k == K - 1, at, pages)
    k_ok = offs_k < K
    present = (pages <= at) & k_ok
    first = tl.where(present, pages, -1)

    offs_w = tl.arange(0, BLOCK_W)
    if COUNT:
        old = tl.load(wpages_ptr + local * stride_wpn + offs_w * stride_wpw, mask=offs_w < W, other=-2)
        held = tl.max((first[:, None] == old[None, :]).to(tl.int32), axis=1) > 0
        fresh = tl.sum((present & (held == 0)).to(tl.int64), axis=0)
        if local < N_S:
            tl.atomic_add(promoted_ptr, fresh)
    tl.debug_barrier()  # the old window read before it is written

    offs_t = tl.arange(0, BLOCK_P)
    k_tile = (offs_t < P)[:, None] & (tl.arange(0, BLOCK_D) < D)[None, :]
    v_tile = (offs_t < P)[:, None] & (tl.arange(0, BLOCK_DV) < DV)[None, :]
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    source = tl.where(present, pages, 0)
    for j in range(0, K):
        src = tl.sum(tl.where(offs_k == j, source, 0), axis=0)
        tokens = src * P + offs_t
        keys = tl.load(fk_ptr + row * stride_fkr + tokens[:, None] * stride_fkt + offs_d[None, :] * stride_fkd,
                       mask=k_tile)
        tl.store(wk_ptr + local * stride_wkn + (j * P + offs_t)[:, None] * stride_wkt + offs_d[None, :] * stride_wkd,
                 keys, mask=k_tile)
        values = tl.load(fv_ptr + row * stride_fvr + tokens[:, None] * stride_fvt + offs_dv[None, :] * stride_fvd,
                         mask=v_tile)
        tl.store(wv_ptr + local * stride_wvn + (j * P + offs_t)[:, None] * stride_wvt + offs_dv[None, :] * stride_wvd,
                 values, mask=v_tile)

    later = at + offs_w - K + 1  # positions K, K + 1, ...: the pages it will open
    seq = tl.load(sbatch_ptr + local)
    tl.store(wpages_ptr + local * stride_wpn + offs_k * stride_wpw, first, mask=k_ok)
    tl.store(wpages_ptr + local * stride_wpn + offs_w * stride_wpw, later, mask=(offs_w >= K) & (offs_w < W))
    null = PAGES  # no page, or one past the capacity: the token bias's null page
    first_row = seq * (PAGES + 1) + tl.where((first < 0) | (first >= PAGES), null, first)
    later_row = seq * (PAGES + 1) + tl.where(later >= PAGES, null, later)
    tl.store(wbias_ptr + local * stride_wbn + offs_k * stride_wbw, first_row, mask=k_ok)
    tl.store(wbias_ptr + local * stride_wbn + offs_w * stride_wbw, later_row, mask=(offs_w >= K) & (offs_w < W))
    tl.store(wshift_ptr + local, tl.load(wbase_ptr + local) + (K - 1 - at) * P)


def _move_windows_launch(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base,
                         win_bias_rows, stable_batch, promoted, num_pages, k, count):
    """`(args, constexprs)` of the `_move_windows_kernel` launch, one program a ranked row."""
    p = win_k.shape[1] // win_pages.shape[1] if win_pages.shape[1] else 1
    args = dict(pages_ptr=pages, page_ptr=page, local_ptr=local, rows_ptr=rows, fk_ptr=full_k, fv_ptr=full_v,
                wk_ptr=win_k, wv_ptr=win_v, wpages_ptr=win_pages, wshift_ptr=win_shift, wbase_ptr=win_base,
                wbias_ptr=win_bias_rows, sbatch_ptr=stable_batch, promoted_ptr=promoted, KR=pages.shape[1],
                PAGES=num_pages, N_S=win_pages.shape[0] - 1, D=full_k.shape[2], DV=full_v.shape[2],
                **_strides("p", "nk", pages.stride()),
                stride_page=int(page.stride(0)) if page.dim() and page.numel() > 1 else 0,
                **_strides("fk", "rtd", full_k.stride()), **_strides("fv", "rtd", full_v.stride()),
                **_strides("wk", "ntd", win_k.stride()), **_strides("wv", "ntd", win_v.stride()),
                **_strides("wp", "nw", win_pages.stride()), **_strides("wb", "nw", win_bias_rows.stride()))
    constexprs = dict(K=k, W=win_pages.shape[1], P=p, BLOCK_P=triton.next_power_of_2(p),
                      BLOCK_K=triton.next_power_of_2(k),
                      BLOCK_W=triton.next_power_of_2(win_pages.shape[1]),
                      BLOCK_D=triton.next_power_of_2(full_k.shape[2]),
                      BLOCK_DV=triton.next_power_of_2(full_v.shape[2]), COUNT=count)
    return args, constexprs


@torch.library.custom_op("flexicache::move_windows", mutates_args=("win_k", "win_v", "win_pages", "win_shift",
                                                                    "win_bias_rows", "promoted"))
def move_windows(pages: torch.Tensor, page: torch.Tensor, local: torch.Tensor, rows: torch.Tensor,
                 full_k: torch.Tensor, full_v: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                 win_pages: torch.Tensor, win_shift: torch.Tensor, win_base: torch.Tensor, win_bias_rows: torch.Tensor,
                 stable_batch: torch.Tensor, promoted: torch.Tensor, num_pages: int, k: int, count: bool) -> None:
    """A re-rank's window moves in one launch (Triton); see `torch_backend.move_windows`."""
    _check_move_windows(pages, page, local, rows, full_k, win_k, win_pages, num_pages, k)
    _check_device(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, promoted)
    if pages.shape[0] == 0:
        return
    args, constexprs = _move_windows_launch(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages,
                                            win_shift, win_base, win_bias_rows, stable_batch, promoted, num_pages, k,
                                            count)
    _move_windows_kernel[(pages.shape[0],)](**args, **constexprs)


move_windows.register_fake(fake_move_windows)


__all__ = ["append_token", "attention", "candidates", "choose", "chosen_attention", "move_windows", "page_logits",
           "page_scores"]

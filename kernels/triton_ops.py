"""Triton kernels of the decode step, registered as `torch.library` custom ops.

Each op (`flexicache::page_scores`, `flexicache::attention`, `flexicache::append_token`, `flexicache::carry_out`,
`flexicache::page_mass`, `flexicache::move_windows`) has the contract of the `torch_backend` function of the same name
(read its docstring for the shapes) and a fake implementation (`register_fake`: output shape and dtype only, or nothing
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
- `carry_out`: the backend's numbers exactly (a choice among candidates, a page index, a constant score); of equal
  masses the first candidate is carried, where `torch.topk` does not say which (the pages scored -inf, which carry
  nothing, may then differ).
- `page_mass`: the softmax over a row's candidate tokens per query head, in fp32 (online over blocks of pages, then the
  pages' sums over the heads): to fp32 rounding of the backend's (a summation order of its own), NaN where a head has
  no finite logit, the score itself where it is infinite.
- `move_windows`: a sort, copies and index arithmetic, so the backend's writes bit for bit (the stable tensors' extra
  row, which padded places write, aside: several places may write it at once, and nothing reads it).
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


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


def _check_page_scores(query, meta, bias, subpages):
    if query.dim() != 3 or meta.dim() != 3 or bias.dim() != 2:
        raise ValueError(f"page_scores: query [n, G, D], meta [n, 2D, E], bias [n, E]; got {tuple(query.shape)}, "
                         f"{tuple(meta.shape)}, {tuple(bias.shape)}")
    n, _, d = query.shape
    if meta.shape[0] != n or meta.shape[1] != 2 * d or tuple(bias.shape) != (n, meta.shape[2]):
        raise ValueError(f"page_scores: shapes do not match: query {tuple(query.shape)}, meta {tuple(meta.shape)}, "
                         f"bias {tuple(bias.shape)}")
    if subpages < 1 or meta.shape[2] % subpages:
        raise ValueError(f"page_scores: subpages ({subpages}) must divide the entries ({meta.shape[2]})")
    for name, t in (("query", query), ("meta", meta), ("bias", bias)):
        if t.dtype not in _FLOATS:
            raise TypeError(f"page_scores: {name} must be fp32, fp16 or bf16, got {t.dtype}")


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


@page_scores.register_fake
def _page_scores_fake(query, meta, bias, subpages):
    _check_page_scores(query, meta, bias, subpages)
    return query.new_empty((query.shape[0], meta.shape[2] // subpages), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Decode attention
# --------------------------------------------------------------------------------------------------

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

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # While a head has seen only masked tokens its max is -inf: shift by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + row * stride_vn + tok[:, None] * stride_vm + offs_dv[None, :] * stride_vd,
                    mask=ok[:, None] & dv_ok[None, :], other=0.0)
        if PV_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

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


def _check_attention(query, keys, values, bias):
    if query.dim() != 3 or keys.dim() != 3 or values.dim() != 3 or bias.dim() not in (2, 3):
        raise ValueError(f"attention: query [n, G, D], keys [n, M, D], values [n, M, Dv], bias [n, M] or [n, G, M]; "
                         f"got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(bias.shape)}")
    n, g, d = query.shape
    m = keys.shape[1]
    expected_bias = (n, m) if bias.dim() == 2 else (n, g, m)
    if (keys.shape[0] != n or keys.shape[2] != d or tuple(values.shape[:2]) != (n, m)
            or tuple(bias.shape) != expected_bias):
        raise ValueError(f"attention: shapes do not match: query {tuple(query.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}, bias {tuple(bias.shape)}")
    for name, t in (("query", query), ("keys", keys), ("values", values), ("bias", bias)):
        if t.dtype not in _FLOATS:
            raise TypeError(f"attention: {name} must be fp32, fp16 or bf16, got {t.dtype}")


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


@attention.register_fake
def _attention_fake(query, keys, values, bias, scaling, softcap=None):
    _check_attention(query, keys, values, bias)
    return values.new_empty((query.shape[0], query.shape[1], values.shape[2]))


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
    entry = meta_ptr + tl.load(meta_row_ptr + row) * stride_mn + sub * stride_me
    tl.store(entry + offs_d * stride_mc, high.to(meta_ptr.dtype.element_ty), mask=d_ok)
    tl.store(entry + (D + offs_d) * stride_mc, low.to(meta_ptr.dtype.element_ty), mask=d_ok)
    if row == 0:
        tl.atomic_add(len_ptr, 1)


def _check_append_token(keys, values, full_k, full_v, meta, win_k, win_v, near_k, near_v, subpage_len):
    n, d = keys.shape
    if values.shape[0] != n or full_k.shape[0] != n or full_v.shape[0] != n or meta.shape[:2] != (n, 2 * d):
        raise ValueError(f"append_token: keys [n, D], values [n, Dv], full tiers [n, C, *], meta [n, 2D, E]; got "
                         f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(full_k.shape)}, {tuple(meta.shape)}")
    if full_k.shape[1] % subpage_len or meta.shape[2] != full_k.shape[1] // subpage_len:
        raise ValueError(f"append_token: {meta.shape[2]} MinMax entries of {subpage_len} tokens do not cover the "
                         f"capacity {full_k.shape[1]}")
    for name, t in (("win_k", win_k), ("win_v", win_v)):
        if t.shape[0] > 1 and t.shape[1] and t.stride(0) != t.shape[1] * t.stride(1):  # (no window: nothing written)
            raise ValueError(f"append_token: {name} must be flat-indexable over its first two dims (contiguous rows)")
    if (near_k.numel() == 0) != (near_v.numel() == 0):
        raise ValueError("append_token: near_k and near_v are both given or both empty")


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


@append_token.register_fake
def _append_token_fake(keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift,
                       stable_local, near_k, near_v, near_place, subpage_len):
    _check_append_token(keys, values, full_k, full_v, meta, win_k, win_v, near_k, near_v, subpage_len)


# --------------------------------------------------------------------------------------------------
# A ranking's carried candidates
# --------------------------------------------------------------------------------------------------

@triton.jit
def _carry_out_kernel(
    cand_ptr, mass_ptr, page_ptr, pages_ptr, scores_ptr,
    C, W, score,
    stride_cn, stride_cc, stride_mn, stride_mc, stride_page, stride_pn, stride_pw, stride_sn, stride_sw,
    CARRY: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One program: one row's `CARRY` candidates of most mass, one at a time (the first of equal masses), each with
    the page after it, both at most the page being filled; the places past `2 CARRY` get page 0 and -inf."""
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    mass = tl.load(mass_ptr + row * stride_mn + offs_c * stride_mc, mask=c_ok, other=0.0)
    mass = tl.where((mass == mass) & (tl.abs(mass) != float("inf")), mass, 0.0)  # NaN, +-inf: 0
    key = tl.where(c_ok, mass, -2.0)  # the padded places below every mass (>= 0) and below a taken one (-1)
    cand = tl.load(cand_ptr + row * stride_cn + offs_c * stride_cc, mask=c_ok, other=0)
    limit = tl.load(page_ptr + row * stride_page)
    offs_w = tl.arange(0, BLOCK_W)
    pages = tl.zeros([BLOCK_W], dtype=tl.int64)
    scores = tl.full([BLOCK_W], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(CARRY):
        best = tl.max(key, axis=0)
        at = tl.min(tl.where(key == best, offs_c, BLOCK_C), axis=0)  # the first place of the most mass
        page = tl.sum(tl.where(offs_c == at, cand, 0), axis=0).to(tl.int64)
        carried = tl.where(best > 0, score, float("-inf"))
        pages = tl.where(offs_w == 2 * j, tl.minimum(page, limit),
                         tl.where(offs_w == 2 * j + 1, tl.minimum(page + 1, limit), pages))
        scores = tl.where((offs_w == 2 * j) | (offs_w == 2 * j + 1), carried, scores)
        key = tl.where(offs_c == at, -1.0, key)
    w_ok = offs_w < W
    tl.store(pages_ptr + row * stride_pn + offs_w * stride_pw, pages, mask=w_ok)
    tl.store(scores_ptr + row * stride_sn + offs_w * stride_sw, scores, mask=w_ok)


def _check_carry_out(cand, mass, page, carry, pages_out, scores_out):
    n, c = mass.shape
    if tuple(cand.shape) != (n, c) or pages_out.shape != scores_out.shape or pages_out.shape[0] != n:
        raise ValueError(f"carry_out: cand and mass [n, C], pages_out and scores_out [n, W]; got {tuple(cand.shape)}, "
                         f"{tuple(mass.shape)}, {tuple(pages_out.shape)}, {tuple(scores_out.shape)}")
    if not 0 < carry <= c or pages_out.shape[1] < 2 * carry or page.numel() not in (1, n):
        raise ValueError(f"carry_out: carry {carry} of {c} candidates into {pages_out.shape[1]} places, page of "
                         f"{page.numel()} entries (one, or one per row)")


def _carry_out_launch(cand, mass, page, carry, score, pages_out, scores_out):
    """`(args, constexprs)` of the `_carry_out_kernel` launch, one program a row."""
    n, c = mass.shape
    w = pages_out.shape[1]
    args = dict(cand_ptr=cand, mass_ptr=mass, page_ptr=page, pages_ptr=pages_out, scores_ptr=scores_out, C=c, W=w,
                score=float(score), **_strides("c", "nc", cand.stride()), **_strides("m", "nc", mass.stride()),
                stride_page=int(page.stride(0)) if page.dim() and page.numel() > 1 else 0,
                **_strides("p", "nw", pages_out.stride()), **_strides("s", "nw", scores_out.stride()))
    constexprs = dict(CARRY=carry, BLOCK_C=triton.next_power_of_2(c), BLOCK_W=triton.next_power_of_2(w))
    return args, constexprs


@torch.library.custom_op("flexicache::carry_out", mutates_args=("pages_out", "scores_out"))
def carry_out(cand: torch.Tensor, mass: torch.Tensor, page: torch.Tensor, carry: int, score: float,
              pages_out: torch.Tensor, scores_out: torch.Tensor) -> None:
    """A ranking's carried candidates in one launch (Triton); see `torch_backend.carry_out`."""
    _check_carry_out(cand, mass, page, carry, pages_out, scores_out)
    _check_device(cand, mass, page, pages_out, scores_out)
    if mass.shape[0] == 0:
        return
    args, constexprs = _carry_out_launch(cand, mass, page, carry, score, pages_out, scores_out)
    _carry_out_kernel[(mass.shape[0],)](**args, **constexprs)


@carry_out.register_fake
def _carry_out_fake(cand, mass, page, carry, score, pages_out, scores_out):
    _check_carry_out(cand, mass, page, carry, pages_out, scores_out)


# --------------------------------------------------------------------------------------------------
# Refinement's ranking key
# --------------------------------------------------------------------------------------------------

@triton.jit
def _page_mass_kernel(
    logits_ptr, scores_ptr, out_ptr,
    G, C,
    stride_ln, stride_lg, stride_lc, stride_lp, stride_sn, stride_sc, stride_on, stride_oc,
    P: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: one row. First each head's softmax max and sum over all its candidates' tokens (online, BLOCK_C
    pages at a time), then per block of pages the mass of each page summed over the heads, over G, or the score where
    that is infinite. A head whose every token is -inf gives NaN, as `torch.softmax` does."""
    row = tl.program_id(0).to(tl.int64)
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


def _check_page_mass(logits, scores):
    if logits.dim() != 4 or tuple(scores.shape) != (logits.shape[0], logits.shape[2]):
        raise ValueError(f"page_mass: logits [n, G, C, P], scores [n, C]; got {tuple(logits.shape)}, "
                         f"{tuple(scores.shape)}")


def _page_mass_launch(logits, scores, out):
    """`(args, constexprs)` of the `_page_mass_kernel` launch, one program a row, about 1024 tokens a block."""
    n, g, c, p = logits.shape
    args = dict(logits_ptr=logits, scores_ptr=scores, out_ptr=out, G=g, C=c,
                **_strides("l", "ngcp", logits.stride()), **_strides("s", "nc", scores.stride()),
                **_strides("o", "nc", out.stride()))
    block_p = triton.next_power_of_2(p)
    constexprs = dict(P=p, BLOCK_P=block_p, BLOCK_G=triton.next_power_of_2(g),
                      BLOCK_C=max(1, min(triton.next_power_of_2(c), 1024 // block_p)))
    return args, constexprs


@torch.library.custom_op("flexicache::page_mass", mutates_args=())
def page_mass(logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Refinement's ranking key from its logits (Triton); see `torch_backend.page_mass`. `[n, G, C, P]`, `[n, C]` ->
    `[n, C]` fp32."""
    _check_page_mass(logits, scores)
    _check_device(logits, scores)
    out = torch.empty(scores.shape, device=scores.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    args, constexprs = _page_mass_launch(logits, scores, out)
    _page_mass_kernel[(logits.shape[0],)](**args, **constexprs)
    return out


@page_mass.register_fake
def _page_mass_fake(logits, scores):
    _check_page_mass(logits, scores)
    return scores.new_empty(scores.shape, dtype=torch.float32)


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


def _check_move_windows(pages, page, local, rows, full_k, win_k, win_pages, num_pages, k):
    n = pages.shape[0]
    if local.shape != (n,) or rows.shape != (n,) or page.numel() not in (1, n) or pages.shape[1] > k:
        raise ValueError(f"move_windows: pages [n, <= K], local and rows [n], page one or [n]; got "
                         f"{tuple(pages.shape)}, {tuple(local.shape)}, {tuple(rows.shape)}, {tuple(page.shape)}")
    w = win_pages.shape[1]
    if w < k or win_k.shape[1] != w * (full_k.shape[1] // num_pages) or full_k.shape[1] % num_pages:
        raise ValueError(f"move_windows: windows of {w} pages ({win_k.shape[1]} tokens) for K = {k} and a full tier of "
                         f"{full_k.shape[1]} tokens in {num_pages} pages")


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


@move_windows.register_fake
def _move_windows_fake(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base,
                       win_bias_rows, stable_batch, promoted, num_pages, k, count):
    _check_move_windows(pages, page, local, rows, full_k, win_k, win_pages, num_pages, k)


__all__ = ["append_token", "attention", "carry_out", "move_windows", "page_mass", "page_scores"]

"""Triton sparse paged decode attention (flash-decoding over each row's selected pages).

Layout (as in flash-linear-attention): `@triton.jit` kernels, then the launchers that check shapes
and dtypes, then the public function with the same signature as `torch_backend.sparse_decode_attention`.

One program handles one row (a (sequence, KV head) pair) and one split of its selected pages, with
all G query heads of the GQA group packed as the rows of one `tl.dot`. Pages are reached through the
row's block table `slots` into the `[S, P, D]` pools. With more than one split a second kernel merges
the splits' partial outputs by their log-sum-exp.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_page_lists

_LOG2E = 1.4426950408889634


# Not specialised on their values (Triton compiles a variant per integer argument that is 1 or a multiple of 16): the
# length moves every step, the page counts and the page lists' row strides every page, the padding mask's length
# every step of a padded batch. Specialised, they would compile new variants in the middle of a decode.
_PER_STEP = ["num_entries", "seq_len", "tv_len", "pages_per_split", "stride_sn", "stride_pn", "stride_tb"]


@triton.jit(do_not_specialize=_PER_STEP)
def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, pidx_ptr, tv_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    num_entries, seq_len, tv_len, rows_per_batch, pages_per_split, head_dim, v_dim,
    qk_scale, softcap,
    stride_qn, stride_qg, stride_qd,
    stride_ks, stride_kp, stride_kd,
    stride_vs, stride_vp, stride_vd,
    stride_sn, stride_sm,
    stride_pn, stride_pm,
    stride_tb, stride_tl,
    stride_on, stride_og, stride_od,
    stride_an, stride_as, stride_ag, stride_ad,
    stride_ln, stride_ls, stride_lg,
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_PAD: tl.constexpr,
    PAGES_PER_BLOCK: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_TOKEN_VALID: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    SLOTS_BY_PAGE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    BLOCK_N: tl.constexpr = PAGES_PER_BLOCK * PAGE_PAD

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < v_dim
    # Token j of a block sits at offset (j % PAGE_PAD) of the block's (j // PAGE_PAD)-th page.
    tok = offs_n % PAGE_PAD
    page_of = offs_n // PAGE_PAD

    q = tl.load(
        q_ptr + row * stride_qn + offs_g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    batch = row // rows_per_batch

    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, num_entries)
    for e0 in range(first, last, PAGES_PER_BLOCK):
        entry = e0 + page_of
        e_ok = (entry < last) & (tok < PAGE_SIZE)
        pidx = tl.load(pidx_ptr + row * stride_pn + entry * stride_pm, mask=e_ok, other=-1)
        if SLOTS_BY_PAGE:  # slots_ptr is the block table [N, Pcap]: the page's slot, looked up here
            slot = tl.load(slots_ptr + row * stride_sn + tl.maximum(pidx, 0) * stride_sm, mask=e_ok & (pidx >= 0),
                           other=0)
        else:
            slot = tl.load(slots_ptr + row * stride_sn + entry * stride_sm, mask=e_ok, other=0)
        pos = pidx * PAGE_SIZE + tok
        ok = e_ok & (pidx >= 0) & (pos < seq_len)
        if HAS_TOKEN_VALID:
            pos_c = tl.minimum(tl.maximum(pos, 0), tv_len - 1)
            tv = tl.load(tv_ptr + batch * stride_tb + pos_c * stride_tl, mask=ok, other=0)
            ok = ok & (tv != 0)
        slot = slot.to(tl.int64)
        # Masked tokens are never loaded, so garbage past seq_len or in unused slots cannot leak in.
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + tok[:, None] * stride_kp + offs_d[None, :] * stride_kd,
            mask=ok[:, None] & d_ok[None, :], other=0.0,
        )
        if UPCAST:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # qk_scale = scaling (* log2 e when there is no softcap)
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), saturating cleanly at +-1; then move to the log2 domain.
            s = (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * softcap * 1.4426950408889634
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing attendable yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + tok[:, None] * stride_vp + offs_dv[None, :] * stride_vd,
            mask=ok[:, None] & dv_ok[None, :], other=0.0,
        )
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_mask = g_ok[:, None] & dv_ok[None, :]
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(
            part_o_ptr + row * stride_an + split * stride_as + offs_g[:, None] * stride_ag + offs_dv[None, :] * stride_ad,
            o, mask=o_mask,
        )
        tl.store(part_lse_ptr + row * stride_ln + split * stride_ls + offs_g * stride_lg, lse, mask=g_ok)
    else:
        tl.store(
            out_ptr + row * stride_on + offs_g[:, None] * stride_og + offs_dv[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty), mask=o_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    num_splits, v_dim,
    stride_an, stride_as, stride_ag, stride_ad,
    stride_ln, stride_ls, stride_lg,
    stride_on, stride_og, stride_od,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < num_splits
    dv_ok = offs_dv < v_dim
    lse = tl.load(part_lse_ptr + row * stride_ln + offs_s * stride_ls + g * stride_lg, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.math.exp2(lse - mx)  # 0 for splits with no attendable token
    o = tl.load(
        part_o_ptr + row * stride_an + offs_s[:, None] * stride_as + g * stride_ag + offs_dv[None, :] * stride_ad,
        mask=s_ok[:, None] & dv_ok[None, :], other=0.0,
    )
    den = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + row * stride_on + g * stride_og + offs_dv * stride_od, res.to(out_ptr.dtype.element_ty), mask=dv_ok)


def _block_sizes(page_size: int, head_dim: int) -> tuple[int, int]:
    """(PAGE_PAD, PAGES_PER_BLOCK): tokens per loop iteration = PAGE_PAD * PAGES_PER_BLOCK.

    With `_NUM_WARPS`, sized so that no variant spills registers on sm_90 with Triton 3.6 or 3.9
    (tests/test_kernel_compile.py): about 200 registers at 32 tokens of 128 channels. 64 tokens over 4 warps spilled
    (fp32 pools 600+ bytes on Triton 3.9; bf16 and fp16 too on Triton 3.6)."""
    page_pad = triton.next_power_of_2(page_size)
    tokens = 32 if head_dim <= 128 else 16
    return page_pad, max(1, tokens // page_pad)


_NUM_WARPS = 8


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(rows: int, entries: int, pages_per_block: int, device: torch.device) -> int:
    """Enough programs to fill the machine (about two per SM), never more splits than page blocks."""
    if device.type == "cuda":
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4  # the interpreter: small, but still exercises the combine pass
    blocks = triton.cdiv(entries, pages_per_block)
    return max(1, min(blocks, triton.cdiv(target, rows)))


def _check_inputs(query, k_pool, v_pool, slots, page_idx, token_valid, rows_per_batch, by_page=False):
    if query.dim() != 3 or k_pool.dim() != 3 or v_pool.dim() != 3:
        raise ValueError("query must be [N, G, D] and the pools [S, P, D]")
    n, _, d = query.shape
    if k_pool.shape[2] != d or v_pool.shape[:2] != k_pool.shape[:2]:
        raise ValueError(f"pool shapes {tuple(k_pool.shape)}/{tuple(v_pool.shape)} do not match head_dim {d}")
    check_page_lists(n, slots, page_idx, by_page, token_valid, rows_per_batch)
    for name, t in (("query", query), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp16, bf16 or fp32, got {t.dtype}")
    if k_pool.dtype != v_pool.dtype:
        raise TypeError(f"k_pool and v_pool dtypes differ: {k_pool.dtype} vs {v_pool.dtype}")


def _decode_plan(query, k_pool, v_pool, slots, page_idx, seq_len, scaling, token_valid, rows_per_batch, softcap,
                 out, num_splits, part_o=None, part_lse=None, by_page=False):
    """Grid, runtime arguments, constexprs and launch options of one `_sparse_decode_kernel` launch (also used by the
    compile test).

    `by_page`: `slots` is the block table `[N, Pcap]` (the kernel looks each page's slot up), not `[N, M]`."""
    n, g, d = query.shape
    m = page_idx.shape[1]
    page_size, dv = k_pool.shape[1], v_pool.shape[2]
    page_pad, ppb = _block_sizes(page_size, d)
    blocks = max(1, triton.cdiv(m, ppb))
    num_splits = max(1, min(num_splits, blocks))
    pages_per_split = triton.cdiv(blocks, num_splits) * ppb
    num_splits = max(1, triton.cdiv(m, pages_per_split))  # no empty trailing split
    split = num_splits > 1
    if split and (part_o is None or part_lse is None):
        part_o = torch.empty(n, num_splits, g, dv, device=query.device, dtype=torch.float32)
        part_lse = torch.empty(n, num_splits, g, device=query.device, dtype=torch.float32)
    if not split:
        part_o, part_lse = out, out[:, :, 0]  # never written: SPLIT is False
    tv = token_valid.view(torch.uint8) if token_valid is not None else slots  # never read without HAS_TOKEN_VALID
    upcast = not query.is_cuda or k_pool.dtype == torch.float32
    qk_scale = float(scaling) if softcap is not None else float(scaling) * _LOG2E
    args = dict(
        q_ptr=query, k_ptr=k_pool, v_ptr=v_pool, slots_ptr=slots, pidx_ptr=page_idx, tv_ptr=tv, out_ptr=out,
        part_o_ptr=part_o, part_lse_ptr=part_lse,
        num_entries=m, seq_len=int(seq_len), tv_len=tv.shape[1], rows_per_batch=int(rows_per_batch),
        pages_per_split=pages_per_split, head_dim=d, v_dim=dv,
        qk_scale=qk_scale, softcap=float(softcap) if softcap is not None else 1.0,
        stride_qn=query.stride(0), stride_qg=query.stride(1), stride_qd=query.stride(2),
        stride_ks=k_pool.stride(0), stride_kp=k_pool.stride(1), stride_kd=k_pool.stride(2),
        stride_vs=v_pool.stride(0), stride_vp=v_pool.stride(1), stride_vd=v_pool.stride(2),
        stride_sn=slots.stride(0), stride_sm=slots.stride(1),
        stride_pn=page_idx.stride(0), stride_pm=page_idx.stride(1),
        stride_tb=tv.stride(0), stride_tl=tv.stride(1),
        stride_on=out.stride(0), stride_og=out.stride(1), stride_od=out.stride(2),
        stride_an=part_o.stride(0), stride_as=part_o.stride(1), stride_ag=part_o.stride(-2), stride_ad=part_o.stride(-1),
        stride_ln=part_lse.stride(0), stride_ls=part_lse.stride(1), stride_lg=part_lse.stride(-1),
    )
    constexprs = dict(
        G=g, PAGE_SIZE=page_size, PAGE_PAD=page_pad, PAGES_PER_BLOCK=ppb,
        BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), HAS_TOKEN_VALID=token_valid is not None,
        HAS_SOFTCAP=softcap is not None, SPLIT=split, UPCAST=upcast, SLOTS_BY_PAGE=by_page,
    )
    return (n, num_splits), args, constexprs, dict(num_warps=_NUM_WARPS)


def _combine_plan(part_o, part_lse, out):
    """Grid, runtime arguments, constexprs and launch options of one `_combine_splits_kernel` launch."""
    n, s, g, dv = part_o.shape
    args = dict(
        part_o_ptr=part_o, part_lse_ptr=part_lse, out_ptr=out, num_splits=s, v_dim=dv,
        stride_an=part_o.stride(0), stride_as=part_o.stride(1), stride_ag=part_o.stride(2), stride_ad=part_o.stride(3),
        stride_ln=part_lse.stride(0), stride_ls=part_lse.stride(1), stride_lg=part_lse.stride(2),
        stride_on=out.stride(0), stride_og=out.stride(1), stride_od=out.stride(2),
    )
    constexprs = dict(BLOCK_S=triton.next_power_of_2(s), BLOCK_DV=triton.next_power_of_2(dv))
    return (n, g), args, constexprs, dict(num_warps=4)


def sparse_decode_attention_triton(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    page_idx: torch.Tensor,
    seq_len: int,
    scaling: float,
    token_valid: torch.Tensor | None = None,
    rows_per_batch: int = 1,
    softcap: float | None = None,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of each row's query heads over the tokens of its selected pages (flash-decoding).

    Same contract as `torch_backend.sparse_decode_attention`: a token is attended when its entry's
    `page_idx >= 0`, its position `page_idx * P + t < seq_len` and `token_valid[row // rows_per_batch, pos]`;
    softmax in fp32 over exactly those tokens, fp32 accumulation for fp16/bf16/fp32 inputs, output
    in the query's dtype, zeros for a row with no attendable token. Masked tokens are never loaded.

    Args:
        query (`torch.Tensor` of shape `[N, G, D]`): one decode query per query head.
        k_pool, v_pool (`torch.Tensor` of shape `[S, P, D]`): page pools.
        slots (`torch.Tensor` of shape `[N, M]`): pool slot of each selected page (0 = null block).
        page_idx (`torch.Tensor` of shape `[N, M]`): logical index of each selected page, -1 = unused entry.
        seq_len (`int`): logical sequence length (tokens at positions >= seq_len are masked).
        scaling (`float`): the model's softmax scale.
        token_valid (`torch.Tensor` of shape `[B, L]`, *optional*): padding mask, True = attend.
        rows_per_batch (`int`): rows per sequence, to map a row to its padding-mask row.
        softcap (`float`, *optional*): logit soft-capping (Gemma-2 style), `tanh(s / c) * c`.
        num_splits (`int`, *optional*): splits of each row's pages (default: enough programs to fill the device).
        out (`torch.Tensor` of shape `[N, G, Dv]`, *optional*): written with the result (any strides) and returned.
        table (`torch.Tensor` of shape `[N, Pcap]`, *optional*): the block table; given, `slots` is not used (may be
            None) and each page's slot is looked up in the kernel (no gather launch before it).

    Returns:
        `torch.Tensor` of shape `[N, G, D]` in the query's dtype.

    Example:
        >>> q = torch.randn(32, 4, 128, device="cuda", dtype=torch.bfloat16)
        >>> pool = torch.randn(2049, 16, 128, device="cuda", dtype=torch.bfloat16)
        >>> slots = torch.randint(1, 2049, (32, 64), device="cuda")
        >>> pages = torch.arange(64, device="cuda").expand(32, 64)
        >>> sparse_decode_attention_triton(q, pool, pool, slots, pages, 1024, 128 ** -0.5).shape
        torch.Size([32, 4, 128])
    """
    by_page = table is not None
    if by_page:
        slots = table
    _check_inputs(query, k_pool, v_pool, slots, page_idx, token_valid, rows_per_batch, by_page)
    n, g, _ = query.shape
    if out is None:
        out = torch.empty(n, g, v_pool.shape[2], device=query.device, dtype=query.dtype)
    elif out.shape != (n, g, v_pool.shape[2]) or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must be [N, G, Dv]={(n, g, v_pool.shape[2])} {query.dtype} on {query.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if n == 0:
        return out
    if page_idx.shape[1] == 0:
        return out.zero_()
    if num_splits is None:
        _, ppb = _block_sizes(k_pool.shape[1], query.shape[2])
        num_splits = _default_splits(n, page_idx.shape[1], ppb, query.device)
    grid, args, constexprs, options = _decode_plan(
        query, k_pool, v_pool, slots, page_idx, seq_len, scaling, token_valid, rows_per_batch, softcap, out, num_splits,
        by_page=by_page,
    )
    _sparse_decode_kernel[grid](**args, **constexprs, **options)
    if constexprs["SPLIT"]:
        grid, args, constexprs, options = _combine_plan(args["part_o_ptr"], args["part_lse_ptr"], out)
        _combine_splits_kernel[grid](**args, **constexprs, **options)
    return out


__all__ = ["sparse_decode_attention_triton"]

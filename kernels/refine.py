"""Triton refinement: the exact attention mass of each candidate page, mean over the GQA group.

A refined ranking (`FlexiCacheConfig.refine_pages`) reads the keys of C candidate pages and keeps
the K with the most attention mass among them. On the PyTorch backend that is a gather of the
candidates' keys, a matmul, a mask, a softmax over all C*P tokens and two reductions (about ten
ops, `torch_backend.candidate_mass`); here it is two launches:

1. `_candidate_lse_kernel`, one program per (row, block of candidates): each page's keys are read in
   place through the row's slots and reduced to one log-sum-exp per query head, `lse [N, G, C]`;
2. `_candidate_mass_kernel`, one program per row: `mass[c] = mean_g exp(lse[g, c] - logsumexp_c lse[g])`
   (the softmax over all candidate tokens, summed per page), with forced candidates (score +-inf) given
   their score, so the top-K keeps them first and drops all-padding pages last.

Layout (as in flash-linear-attention): `@triton.jit` kernels, the launch plans (shared with the
compile test), then the public function with the same contract as `torch_backend.candidate_mass`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_page_lists

# Candidate pages per program of the first kernel (one page per loop iteration).
_PAGES_PER_PROGRAM = 8


# Not specialised on their values (Triton compiles a variant per integer argument that is 1 or a multiple of 16): the
# length moves every step (the padding mask's too, in a padded batch), the candidate count and the page lists' row
# strides with the page count. Specialised, they would compile new variants in the middle of a decode.
@triton.jit(do_not_specialize=["num_cand", "seq_len", "tv_len", "stride_sn", "stride_pn", "stride_tb"])
def _candidate_lse_kernel(
    q_ptr, k_ptr, slots_ptr, pidx_ptr, tv_ptr, lse_ptr,
    num_cand, seq_len, tv_len, rows_per_batch, head_dim, scaling,
    stride_qn, stride_qg, stride_qd,
    stride_ks, stride_kp, stride_kd,
    stride_sn, stride_sm,
    stride_pn, stride_pm,
    stride_tb, stride_tl,
    stride_ln, stride_lg, stride_lc,
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_PAD: tl.constexpr,
    PAGES_PER_PROGRAM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_TOKEN_VALID: tl.constexpr,
    SLOTS_BY_PAGE: tl.constexpr,
):
    row = tl.program_id(0)
    first = tl.program_id(1) * PAGES_PER_PROGRAM
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tl.arange(0, PAGE_PAD)
    g_ok = offs_g < G
    d_ok = offs_d < head_dim
    # fp32 throughout: the ranking compares masses of near-equal pages, as the PyTorch backend does in fp32.
    q = tl.load(
        q_ptr + row * stride_qn + offs_g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)
    batch = row // rows_per_batch
    last = tl.minimum(first + PAGES_PER_PROGRAM, num_cand)
    for c in range(first, last):
        pidx = tl.load(pidx_ptr + row * stride_pn + c * stride_pm)
        if SLOTS_BY_PAGE:  # slots_ptr is the block table [N, Pcap]: the page's slot, looked up here
            slot = tl.load(slots_ptr + row * stride_sn + tl.maximum(pidx, 0) * stride_sm).to(tl.int64)
        else:
            slot = tl.load(slots_ptr + row * stride_sn + c * stride_sm).to(tl.int64)
        pos = pidx * PAGE_SIZE + tok
        ok = (tok < PAGE_SIZE) & (pos >= 0) & (pos < seq_len)  # pos >= 0: the entry is a page (pidx >= 0)
        if HAS_TOKEN_VALID:
            pos_c = tl.minimum(tl.maximum(pos, 0), tv_len - 1)
            tv = tl.load(tv_ptr + batch * stride_tb + pos_c * stride_tl, mask=ok, other=0)
            ok = ok & (tv != 0)
        # Masked tokens are never loaded (past the sequence's end a slot holds whatever was there).
        k = tl.load(
            k_ptr + slot * stride_ks + tok[:, None] * stride_kp + offs_d[None, :] * stride_kd,
            mask=ok[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling  # [BLOCK_G, PAGE_PAD]
        s = tl.where(ok[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + row * stride_ln + offs_g * stride_lg + c * stride_lc, lse, mask=g_ok)


@triton.jit(do_not_specialize=["num_cand"])
def _candidate_mass_kernel(
    lse_ptr, forced_ptr, mass_ptr,
    num_cand,
    stride_ln, stride_lg, stride_lc,
    stride_fn, stride_fc,
    stride_mn, stride_mc,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_C)
    g_ok = offs_g < G
    c_ok = offs_c < num_cand
    lse = tl.load(
        lse_ptr + row * stride_ln + offs_g[:, None] * stride_lg + offs_c[None, :] * stride_lc,
        mask=g_ok[:, None] & c_ok[None, :], other=float("-inf"),
    )
    mx = tl.max(lse, axis=1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    e = tl.exp(lse - mx[:, None])  # 0 for padded heads, padded candidates and pages with nothing attendable
    den = tl.sum(e, axis=1)
    probs = e / tl.where(den > 0.0, den, 1.0)[:, None]
    mass = tl.sum(probs, axis=0) / G
    forced = tl.load(forced_ptr + row * stride_fn + offs_c * stride_fc, mask=c_ok, other=0.0)
    mass = tl.where((forced == float("inf")) | (forced == float("-inf")), forced, mass)
    tl.store(mass_ptr + row * stride_mn + offs_c * stride_mc, mass, mask=c_ok)


def _check_inputs(query, k_pool, slots, pages, forced, token_valid, rows_per_batch, by_page=False):
    if query.dim() != 3 or k_pool.dim() != 3:
        raise ValueError("query must be [N, G, D] and k_pool [S, P, D]")
    n, _, d = query.shape
    if k_pool.shape[2] != d:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} does not match head_dim {d}")
    check_page_lists(n, slots, pages, by_page, token_valid, rows_per_batch)
    if forced.shape != pages.shape or forced.dtype != torch.float32:
        raise ValueError(f"forced must be fp32 [N, C]={tuple(pages.shape)}, got {forced.dtype} {tuple(forced.shape)}")
    if query.dtype not in FLOAT_DTYPES or k_pool.dtype not in FLOAT_DTYPES:
        raise TypeError(f"query/k_pool must be fp16, bf16 or fp32, got {query.dtype}/{k_pool.dtype}")


def _lse_plan(query, k_pool, slots, pages, seq_len, scaling, token_valid, rows_per_batch, lse, by_page=False):
    """Grid, runtime arguments, constexprs and launch options of one `_candidate_lse_kernel` launch (also used by the
    compile test).

    `by_page`: `slots` is the block table `[N, Pcap]` (the kernel looks each page's slot up), not `[N, C]`."""
    n, g, d = query.shape
    c = pages.shape[1]
    page_size = k_pool.shape[1]
    tv = token_valid.view(torch.uint8) if token_valid is not None else slots  # never read without HAS_TOKEN_VALID
    args = dict(
        q_ptr=query, k_ptr=k_pool, slots_ptr=slots, pidx_ptr=pages, tv_ptr=tv, lse_ptr=lse,
        num_cand=c, seq_len=int(seq_len), tv_len=tv.shape[1], rows_per_batch=int(rows_per_batch), head_dim=d,
        scaling=float(scaling),
        stride_qn=query.stride(0), stride_qg=query.stride(1), stride_qd=query.stride(2),
        stride_ks=k_pool.stride(0), stride_kp=k_pool.stride(1), stride_kd=k_pool.stride(2),
        stride_sn=slots.stride(0), stride_sm=slots.stride(1),
        stride_pn=pages.stride(0), stride_pm=pages.stride(1),
        stride_tb=tv.stride(0), stride_tl=tv.stride(1),
        stride_ln=lse.stride(0), stride_lg=lse.stride(1), stride_lc=lse.stride(2),
    )
    constexprs = dict(
        G=g, PAGE_SIZE=page_size, PAGE_PAD=max(16, triton.next_power_of_2(page_size)),
        PAGES_PER_PROGRAM=_PAGES_PER_PROGRAM, BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), HAS_TOKEN_VALID=token_valid is not None, SLOTS_BY_PAGE=by_page,
    )
    # 8 warps past 128 channels: a 4-warp program took ~190 registers there (fp16, head_dim 256), 8 take ~130.
    options = dict(num_warps=8 if d > 128 else 4)
    return (n, triton.cdiv(c, _PAGES_PER_PROGRAM)), args, constexprs, options


def _mass_plan(lse, forced, mass):
    """Grid, runtime arguments, constexprs and launch options of one `_candidate_mass_kernel` launch."""
    n, g, c = lse.shape
    args = dict(
        lse_ptr=lse, forced_ptr=forced, mass_ptr=mass, num_cand=c,
        stride_ln=lse.stride(0), stride_lg=lse.stride(1), stride_lc=lse.stride(2),
        stride_fn=forced.stride(0), stride_fc=forced.stride(1),
        stride_mn=mass.stride(0), stride_mc=mass.stride(1),
    )
    constexprs = dict(G=g, BLOCK_G=triton.next_power_of_2(g), BLOCK_C=triton.next_power_of_2(c))
    return (n,), args, constexprs, dict(num_warps=4)


def candidate_mass_triton(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    slots: torch.Tensor,
    pages: torch.Tensor,
    seq_len: int,
    scaling: float,
    forced: torch.Tensor,
    token_valid: torch.Tensor | None = None,
    rows_per_batch: int = 1,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention mass of each candidate page among all candidates' tokens, mean over the group, in two launches.

    Same contract as `torch_backend.candidate_mass`: a token counts when its page index is `>= 0`, its position
    `page * P + t < seq_len` and `token_valid[row // rows_per_batch, pos]`; logits `scaling * q.k` in fp32;
    candidates whose `forced` score is +-inf get that score instead of a mass.

    Args:
        query (`torch.Tensor` of shape `[N, G, D]`): decode queries.
        k_pool (`torch.Tensor` of shape `[S, P, D]`): the key pool the candidates live in.
        slots (`torch.Tensor` of shape `[N, C]`): pool slot of each candidate page.
        pages (`torch.Tensor` of shape `[N, C]`): logical index of each candidate page.
        seq_len (`int`): logical sequence length.
        scaling (`float`): the model's softmax scale.
        forced (`torch.Tensor` of shape `[N, C]`, fp32): the candidates' page scores (+inf forced, -inf all padding).
        token_valid (`torch.Tensor` of shape `[B, L]`, *optional*): padding mask, True = attend.
        rows_per_batch (`int`): rows per `token_valid` row.
        table (`torch.Tensor` of shape `[N, Pcap]`, *optional*): the block table; given, `slots` is not used (may be
            None) and each candidate's slot is looked up in the kernel.

    Returns:
        `torch.Tensor` of shape `[N, C]`, fp32.
    """
    by_page = table is not None
    if by_page:
        slots = table
    _check_inputs(query, k_pool, slots, pages, forced, token_valid, rows_per_batch, by_page)
    n, g, _ = query.shape
    c = pages.shape[1]
    mass = torch.empty(n, c, device=query.device, dtype=torch.float32)
    if n == 0 or c == 0:
        return mass
    lse = torch.empty(n, g, c, device=query.device, dtype=torch.float32)
    grid, args, constexprs, options = _lse_plan(query, k_pool, slots, pages, seq_len, scaling, token_valid,
                                                rows_per_batch, lse, by_page)
    _candidate_lse_kernel[grid](**args, **constexprs, **options)
    grid, args, constexprs, options = _mass_plan(lse, forced, mass)
    _candidate_mass_kernel[grid](**args, **constexprs, **options)
    return mass


__all__ = ["candidate_mass_triton"]

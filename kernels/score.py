"""Triton page scoring: the Quest upper bound of every page, max-reduced over each GQA group.

Layout (as in flash-linear-attention): the `@triton.jit` kernel, then the launcher that checks
shapes and dtypes, then the public function with the same signature as `torch_backend.score_pages`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES


# Not specialised on its value (Triton compiles a variant per argument that is 1 or a multiple of 16): the page count
# and the output's row stride (a fresh `[N, num_pages]` tensor) change every page, which would compile new variants
# in the middle of a decode.
@triton.jit(do_not_specialize=["num_pages", "stride_vn", "stride_on"])
def _score_pages_kernel(
    q_ptr, meta_ptr, valid_ptr, out_ptr,
    num_pages, head_dim, sink_pages,
    stride_qn, stride_qg, stride_qd,
    stride_mn, stride_mp, stride_md,
    stride_vn, stride_vp,
    stride_on, stride_op,
    G: tl.constexpr,
    SUBPAGES: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64: `row * stride_mn` passes 2^31 at long contexts (128k tokens and > 512 rows: 2D * Pcap * S per row).
    row = tl.program_id(0).to(tl.int64)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_ok = offs_p < num_pages
    q_row = q_ptr + row * stride_qn
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    # The meta tile is re-read once per query head of the group; after the first head it comes from cache.
    # A page's bound is the max over its SUBPAGES MinMax entries (page p holds entries p*S .. p*S + S-1).
    for g in range(G):
        for sub in range(SUBPAGES):
            m_row = meta_ptr + row * stride_mn + (offs_p * SUBPAGES + sub)[:, None] * stride_mp
            s = tl.zeros([BLOCK_P], tl.float32)
            for d0 in range(0, head_dim, BLOCK_D):
                d = d0 + offs_d
                d_ok = d < head_dim
                q = tl.load(q_row + g * stride_qg + d * stride_qd, mask=d_ok, other=0.0).to(tl.float32)
                tile_ok = p_ok[:, None] & d_ok[None, :]
                kmax = tl.load(m_row + d[None, :] * stride_md, mask=tile_ok, other=0.0).to(tl.float32)
                kmin = tl.load(m_row + (d[None, :] + head_dim) * stride_md, mask=tile_ok, other=0.0).to(tl.float32)
                # sum_i max(q_i kmin_i, q_i kmax_i) == relu(q).kmax + min(q, 0).kmin
                s += tl.sum(tl.maximum(q, 0.0)[None, :] * kmax + tl.minimum(q, 0.0)[None, :] * kmin, axis=1)
            best = tl.maximum(best, s)
    if HAS_VALID:
        ok = tl.load(valid_ptr + row * stride_vn + offs_p * stride_vp, mask=p_ok, other=0)
        best = tl.where(ok != 0, best, float("-inf"))
    # Forced pages: the one being filled, and the attention sink (the launcher passes 0 under padding).
    best = tl.where((offs_p == num_pages - 1) | (offs_p < sink_pages), float("inf"), best)
    tl.store(out_ptr + row * stride_on + offs_p * stride_op, best, mask=p_ok)


def _score_plan(query, meta, num_pages, page_valid, out, subpages=1, sink_pages=0):
    """Grid, runtime arguments, constexprs and launch options of one `_score_pages_kernel` launch (also used by the
    compile test)."""
    n, g, d = query.shape
    if meta.dim() != 3 or meta.shape[0] != n or meta.shape[2] != 2 * d:
        raise ValueError(f"meta must be [N={n}, Pcap, 2D={2 * d}], got {tuple(meta.shape)}")
    if subpages < 1 or not 1 <= num_pages * subpages <= meta.shape[1]:
        raise ValueError(f"num_pages={num_pages} x subpages={subpages} outside [1, {meta.shape[1]}] entries")
    if query.dtype not in FLOAT_DTYPES or meta.dtype not in FLOAT_DTYPES:
        raise TypeError(f"query/meta must be fp16, bf16 or fp32, got {query.dtype}/{meta.dtype}")
    if page_valid is not None:
        if page_valid.dtype != torch.bool or page_valid.shape[0] != n or page_valid.shape[1] < num_pages:
            raise ValueError(f"page_valid must be bool [N={n}, >={num_pages}], got {page_valid.dtype} {tuple(page_valid.shape)}")
        valid = page_valid.view(torch.uint8)
    else:
        valid = out  # never read: HAS_VALID is False
    # A [32, 64] tile per load over 8 warps: ~75 registers on sm_90, so several blocks share an SM (a [32, 128]
    # tile over 4 warps took 255 registers, two blocks per SM, on a memory-bound kernel).
    block_d = min(triton.next_power_of_2(d), 64)
    block_p = 32
    args = dict(
        q_ptr=query, meta_ptr=meta, valid_ptr=valid, out_ptr=out,
        num_pages=num_pages, head_dim=d, sink_pages=int(sink_pages) if page_valid is None else 0,
        stride_qn=query.stride(0), stride_qg=query.stride(1), stride_qd=query.stride(2),
        stride_mn=meta.stride(0), stride_mp=meta.stride(1), stride_md=meta.stride(2),
        stride_vn=valid.stride(0), stride_vp=valid.stride(1),
        stride_on=out.stride(0), stride_op=out.stride(1),
    )
    constexprs = dict(G=g, SUBPAGES=int(subpages), HAS_VALID=page_valid is not None, BLOCK_P=block_p, BLOCK_D=block_d)
    grid = (n, triton.cdiv(num_pages, block_p))
    return grid, args, constexprs, dict(num_warps=8)


def score_pages_triton(
    query: torch.Tensor,
    meta: torch.Tensor,
    num_pages: int,
    page_valid: torch.Tensor | None = None,
    subpages: int = 1,
    sink_pages: int = 0,
) -> torch.Tensor:
    """Quest upper bound of `q . k` over each page, max-reduced over each GQA group, in one launch.

    Same contract as `torch_backend.score_pages`: fp32 accumulation whatever the input dtype, a page's
    bound the max of its `subpages` entries', the last page and (without `page_valid`) the first
    `sink_pages` pages forced in with +inf, pages marked invalid set to -inf.

    Args:
        query (`torch.Tensor` of shape `[N, G, D]`): decode queries, one row per (sequence, KV head).
        meta (`torch.Tensor` of shape `[N, Pcap, 2D]`): packed `[kmax, kmin]` per entry (`subpages` entries per
            page); only the first `num_pages * subpages` entries are read.
        num_pages (`int`): pages that exist (the last one may be partially filled).
        page_valid (`torch.Tensor` of shape `[N, num_pages]`, *optional*): False for pages that hold
            no attendable token.
        subpages (`int`, *optional*, defaults to 1): MinMax entries per page.
        sink_pages (`int`, *optional*, defaults to 0): leading pages forced in (ignored with `page_valid`:
            under padding the sink starts at each row's first real page, `force_sink_pages`).

    Returns:
        `torch.Tensor` of shape `[N, num_pages]`, fp32.

    Example:
        >>> q = torch.randn(16, 4, 128, device="cuda", dtype=torch.bfloat16)
        >>> meta = torch.randn(16, 640, 256, device="cuda", dtype=torch.bfloat16)
        >>> score_pages_triton(q, meta, 600).shape
        torch.Size([16, 600])
    """
    out = torch.empty(query.shape[0], num_pages, device=query.device, dtype=torch.float32)
    grid, args, constexprs, options = _score_plan(query, meta, num_pages, page_valid, out, subpages, sink_pages)
    _score_pages_kernel[grid](**args, **constexprs, **options)
    return out

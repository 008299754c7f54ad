"""Triton decode append: one launch writes a step's key and value of every row of a head group into its pools.

A decode step appends one token per (sequence, KV head) at the same offset of the page being filled.
On the PyTorch backend that is an `index_copy_` per pool, after the layer has picked the group's heads
out of the model's K/V (`torch_backend.append_token`, the reference); here one program per row reads
its head's key and value straight from the model's `[B, H, D]` tensors (through the group's head
list) and writes both into the row's slot.

Layout (as in flash-linear-attention): the `@triton.jit` kernel, the launch plan (shared with the
compile test), then the public function with the same contract as `torch_backend.append_token`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES


# `offset` moves every step; specialised on its value (1, multiples of 16) it would compile new variants mid-decode.
@triton.jit(do_not_specialize=["offset"])
def _append_token_kernel(
    k_ptr, v_ptr, heads_ptr, slots_ptr, k_pool_ptr, v_pool_ptr,
    offset, head_dim, v_dim,
    stride_kb, stride_kh, stride_kd,
    stride_vb, stride_vh, stride_vd,
    stride_ks, stride_kp, stride_kpd,
    stride_vs, stride_vp, stride_vpd,
    HG: tl.constexpr,
    HAS_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // HG
    head = row % HG
    if HAS_HEADS:
        head = tl.load(heads_ptr + head)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    k = tl.load(k_ptr + b * stride_kb + head * stride_kh + offs_d * stride_kd, mask=d_ok)
    tl.store(k_pool_ptr + slot * stride_ks + offset * stride_kp + offs_d * stride_kpd, k, mask=d_ok)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < v_dim
    v = tl.load(v_ptr + b * stride_vb + head * stride_vh + offs_dv * stride_vd, mask=dv_ok)
    tl.store(v_pool_ptr + slot * stride_vs + offset * stride_vp + offs_dv * stride_vpd, v, mask=dv_ok)


def _append_plan(keys, values, heads, slots, k_pool, v_pool, offset):
    """Grid, runtime arguments, constexprs and launch options of one `_append_token_kernel` launch (also used by the
    compile test)."""
    batch, num_heads, d = keys.shape
    hg = num_heads if heads is None else heads.numel()
    args = dict(
        k_ptr=keys, v_ptr=values, heads_ptr=slots if heads is None else heads, slots_ptr=slots,
        k_pool_ptr=k_pool, v_pool_ptr=v_pool, offset=int(offset), head_dim=d, v_dim=values.shape[2],
        stride_kb=keys.stride(0), stride_kh=keys.stride(1), stride_kd=keys.stride(2),
        stride_vb=values.stride(0), stride_vh=values.stride(1), stride_vd=values.stride(2),
        stride_ks=k_pool.stride(0), stride_kp=k_pool.stride(1), stride_kpd=k_pool.stride(2),
        stride_vs=v_pool.stride(0), stride_vp=v_pool.stride(1), stride_vpd=v_pool.stride(2),
    )
    constexprs = dict(HG=hg, HAS_HEADS=heads is not None, BLOCK_D=triton.next_power_of_2(d),
                      BLOCK_DV=triton.next_power_of_2(values.shape[2]))
    return (batch * hg,), args, constexprs, dict(num_warps=4)


def append_token_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    heads: torch.Tensor | None,
    slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    offset: int,
) -> None:
    """Write one token per row: `k_pool[slots[b*Hg + i], offset] = keys[b, heads[i]]` (and the same for values).

    Same contract as `torch_backend.append_token`.

    Args:
        keys, values (`torch.Tensor` of shape `[B, H, D]` / `[B, H, Dv]`, any strides): the step's K/V of every
            KV head of the layer (e.g. the model's `[B, H, 1, D]` with the token dimension selected away).
        heads (`torch.Tensor` of shape `[Hg]`, *optional*): the group's heads, in row order (None: all H heads).
        slots (`torch.Tensor` of shape `[B * Hg]`): the pool slot of the page being filled, per row.
        k_pool, v_pool (`torch.Tensor` of shape `[S, P, D]` / `[S, P, Dv]`): the group's pools.
        offset (`int`): the token's position in its page.
    """
    if keys.dim() != 3 or values.dim() != 3 or keys.shape[:2] != values.shape[:2]:
        raise ValueError(f"keys/values must be [B, H, D] with the same B and H, got {tuple(keys.shape)}/{tuple(values.shape)}")
    if keys.shape[2] != k_pool.shape[2] or values.shape[2] != v_pool.shape[2]:
        raise ValueError("keys/values and the pools disagree on the head dimension")
    if keys.dtype != k_pool.dtype or values.dtype != v_pool.dtype or k_pool.dtype not in FLOAT_DTYPES:
        raise TypeError(f"keys/values must have the pools' dtype ({k_pool.dtype}), got {keys.dtype}/{values.dtype}")
    hg = keys.shape[1] if heads is None else heads.numel()
    if slots.dim() != 1 or slots.numel() != keys.shape[0] * hg:
        raise ValueError(f"slots must be [B * Hg = {keys.shape[0] * hg}], got {tuple(slots.shape)}")
    if not 0 <= offset < k_pool.shape[1]:
        raise ValueError(f"offset {offset} outside the page [0, {k_pool.shape[1]})")
    if slots.numel() == 0:
        return
    grid, args, constexprs, options = _append_plan(keys, values, heads, slots, k_pool, v_pool, offset)
    _append_token_kernel[grid](**args, **constexprs, **options)


__all__ = ["append_token_triton"]

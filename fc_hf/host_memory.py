"""Pinned host memory that CUDA kernels read and write in place: the full tier of the stable rows on a GPU.

With unified virtual addressing (every 64-bit CUDA process), page-locked host memory that CUDA allocated
(`cudaHostAlloc`, which backs `torch.empty(..., pin_memory=True)`) is mapped into every device's address space at the
same address. A kernel can then gather pages from it over PCIe with no staging copy and no host in the loop (ShadowKV
and RetroInfer read host-resident KV this way). torch has no tensor kind for such memory, so the pinned tensor is
wrapped as a CUDA tensor through the CUDA array interface: every torch op on it (`index_select`, `index_copy_`) runs on
the device against host memory, inside a decode step that compiles and replays like the rest.

Not yet run on a GPU (no device was lent while it was written): `mapped_host_zeros` falls back to device memory, with a
warning, wherever the wrapping fails.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

# The CUDA array interface has no bfloat16: the bytes are described as an integer type of the same width and the
# tensor is viewed back as the wanted dtype.
_TYPESTR_BY_WIDTH = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _MappedArray:
    """Describes a pinned host tensor to `torch.as_tensor` as device memory; holding it keeps the memory alive (torch
    holds this object for as long as the tensor made from it lives)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _TYPESTR_BY_WIDTH[host.element_size()],
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def mapped_host_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A zero tensor of `shape` in pinned host memory, as a CUDA tensor on `device` (its kernels read and write it over
    PCIe); None where `device` is not CUDA or the memory cannot be mapped (the caller keeps it in device memory)."""
    if device.type != "cuda":
        return None
    try:
        host = torch.zeros(shape, dtype=dtype, pin_memory=True)
        if not host.numel():
            return torch.zeros(shape, dtype=dtype, device=device)
        width = torch.empty((), dtype=dtype).element_size()
        wrapped = torch.as_tensor(_MappedArray(host.view(_int_dtype(width))), device=device)
        if wrapped.data_ptr() != host.data_ptr():  # a copy was made: not the host memory itself
            raise RuntimeError("the CUDA array interface copied the pinned memory")
        return wrapped.view(dtype)
    except (RuntimeError, TypeError, ValueError) as exc:
        logger.warning("FlexiCache could not map pinned host memory into %s (%s); the stable heads' full tier stays in "
                       "device memory.", device, exc)
        return None


def _int_dtype(width: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]

"""Pinned host memory that CUDA kernels read and write in place: the full tier (the host tier) on a GPU.

Host memory page-locked and registered with CUDA as mapped (`cudaHostRegister`, portable | mapped) has a device
address (`cuMemHostGetDevicePointer`; with unified addressing it is the host address itself). A kernel can then
gather pages from it over PCIe with no staging copy and no host in the loop (ShadowKV and RetroInfer read host-resident
KV this way). torch has no tensor kind for such memory, so it is wrapped as a CUDA tensor through the CUDA array
interface: every torch op on it (`index_select`, `index_copy_`) runs on the device against host memory, inside a decode
step that compiles and replays like the rest.

Registered rather than allocated pinned (`pin_memory=True`): torch's pinned allocator rounds every allocation up to a
power of two, up to twice the bytes for a tier of many GB.

Not yet run on a GPU (no device was lent while it was written): `mapped_host_zeros` falls back to device memory, with a
warning, wherever a step of it fails.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

# The CUDA array interface has no bfloat16: the bytes are described as an integer type of the same width and the
# tensor is viewed back as the wanted dtype.
_INT_OF_WIDTH = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"), 8: (torch.int64, "<i8")}
_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _MappedArray:
    """Describes registered host memory to `torch.as_tensor` at its device address; holding it keeps the memory alive
    (torch holds this object for as long as the tensor made from it lives)."""

    def __init__(self, host: torch.Tensor, device_address: int):
        self.host = host
        typestr = _INT_OF_WIDTH[host.element_size()][1]
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": typestr,
                                         "data": (device_address, False), "strides": None, "version": 3}


def mapped_host_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A zero tensor of `shape` in registered host memory, as a CUDA tensor on `device` (its kernels read and write it
    over PCIe); None where `device` is not CUDA or a step fails (the caller keeps the tensor in device memory)."""
    if device.type != "cuda":
        return None
    host = torch.zeros(shape, dtype=dtype)
    if not host.numel():
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = host.numel() * host.element_size()
    try:
        with torch.cuda.device(device):
            if int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _PORTABLE_MAPPED)) != 0:
                raise RuntimeError("cudaHostRegister failed")
            try:
                address = _device_address(host.data_ptr())
            except (RuntimeError, OSError, AttributeError):
                _unregister(host.data_ptr())
                raise
            array = _MappedArray(host.view(_INT_OF_WIDTH[host.element_size()][0]), address)
            # Unregistered when the last holder of the memory goes (its finalizer runs before the memory is freed).
            weakref.finalize(array, _unregister, host.data_ptr()).atexit = False  # at exit the process frees it
            wrapped = torch.as_tensor(array, device=device)
        if wrapped.data_ptr() != address:  # torch copied it: not the host memory itself
            raise RuntimeError("the CUDA array interface copied the memory")
        return wrapped.view(dtype)
    except (RuntimeError, TypeError, ValueError, OSError, AttributeError) as exc:
        logger.warning("FlexiCache could not map host memory into %s (%s); the stable heads' full tier stays in device "
                       "memory.", device, exc)
        return None


def _device_address(host_address: int) -> int:
    """The device address of registered host memory (the driver's `cuMemHostGetDevicePointer`)."""
    driver = ctypes.CDLL("libcuda.so.1")
    address = ctypes.c_uint64()
    status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(address), ctypes.c_void_p(host_address), ctypes.c_uint(0))
    if status != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed ({status})")
    return address.value


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)

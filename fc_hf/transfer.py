"""Host<->device page copies: a low-priority side stream with events on CUDA, plain copies elsewhere.

Ordering rules (CUDA):
- An offload (device -> host) waits for the compute stream to have written the pages.
- A promotion (host -> device) waits for the compute stream to have finished reading the slots it
  overwrites, and the compute stream waits for the promotion before it reads those slots again.
- The pinned staging buffer of a promotion is reused only after its previous copy has landed.
On a CPU the same calls copy synchronously, so the tier logic is exercised by the CPU tests.
"""

from __future__ import annotations

import torch


class PageTransfers:
    """Copies for one layer's tiered head group; one instance per store."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream = None
        if self.is_cuda:
            # Lowest priority: copies fill the gaps between compute kernels instead of delaying them.
            low, _high = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(device=device, priority=low)
        self._promotion_done: torch.cuda.Event | None = None
        self._offload_done: torch.cuda.Event | None = None
        self._staging: torch.Tensor | None = None
        self._staging_free: torch.cuda.Event | None = None

    def host_empty(self, shape, dtype) -> torch.Tensor:
        """Host memory for the host tier: pinned on CUDA so copies can be asynchronous."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def offload(self, host_dst: torch.Tensor, device_src: torch.Tensor) -> None:
        """Copy freshly filled pages `device_src` into their host slots `host_dst` (same shape)."""
        if not self.is_cuda:
            host_dst.copy_(device_src)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            host_dst.copy_(device_src, non_blocking=True)
            device_src.record_stream(self.stream)  # keep the gathered pages alive until copied
            self._offload_done = torch.cuda.Event()
            self._offload_done.record(self.stream)

    def wait_offloads(self) -> None:
        """Block the compute stream until every issued offload has landed (before freeing device slots)."""
        if self.is_cuda and self._offload_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._offload_done)

    def sync_host(self) -> None:
        """Block the host until all copies finished (before the host tier is reallocated or reordered)."""
        if self.is_cuda:
            self.stream.synchronize()

    def promote(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        dst_slots: torch.Tensor,
        host_k: torch.Tensor,
        host_v: torch.Tensor,
        host_index: torch.Tensor,
    ) -> None:
        """Copy host pages `host_*[host_index]` (flat `[Np*N, P, D]` views) into device slots `dst_slots`."""
        if host_index.numel() == 0:
            return
        if not self.is_cuda:
            idx = host_index.to(host_k.device)
            k_pool.index_copy_(0, dst_slots, host_k.index_select(0, idx))
            v_pool.index_copy_(0, dst_slots, host_v.index_select(0, idx))
            return
        count = host_index.numel()
        staging = self._staging_buffer(count, host_k)
        idx = host_index.cpu()
        torch.index_select(host_k, 0, idx, out=staging[0, :count])
        torch.index_select(host_v, 0, idx, out=staging[1, :count])
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the evicted slots are no longer being read
        with torch.cuda.stream(self.stream):
            landed = staging[:, :count].to(self.device, non_blocking=True)
            slots = dst_slots.to(self.device, non_blocking=True)
            k_pool.index_copy_(0, slots, landed[0])
            v_pool.index_copy_(0, slots, landed[1])
            self._promotion_done = torch.cuda.Event()
            self._promotion_done.record(self.stream)
            self._staging_free = self._promotion_done

    def wait_promotions(self) -> None:
        """Make the compute stream wait for issued promotions before it reads the promoted slots."""
        if self.is_cuda and self._promotion_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._promotion_done)
            self._promotion_done = None

    def _staging_buffer(self, count: int, like: torch.Tensor) -> torch.Tensor:
        if self._staging_free is not None:
            self._staging_free.synchronize()  # its previous copy must have left the buffer
        if self._staging is None or self._staging.shape[1] < count:
            self._staging = torch.empty((2, max(count, 64), *like.shape[1:]), dtype=like.dtype, pin_memory=True)
        return self._staging

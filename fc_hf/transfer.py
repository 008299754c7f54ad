"""Host<->device page copies: a low-priority side stream with events on CUDA, plain synchronous copies elsewhere.

`PageTransfers` decides *when* to wait; the copies and stream/event primitives are a `CudaStreams`. Tests swap in a
fake that runs each copy only when the code waits for it and fills its destination with NaN until then
(`tests/deferred_transfers.py`), so these ordering rules (CUDA) are exercised without a GPU:
- an offload (device -> host) waits for the compute stream to have written the pages;
- a promotion (host -> device) waits for the compute stream to have finished reading the slots it overwrites, and
  the compute stream waits for the promotion before it reads them again;
- a promotion's CPU gather of host pages needs their offloads landed in host memory: the host waits on their event;
- a device pool is replaced (grown, repacked) only after the compute stream waited for the promotions writing into
  it; the side stream marks the pools and slot indices it uses (`record_stream`), so no block it touches is reused;
- a promotion's pinned staging buffers are reused only after its previous copy has landed.
Every `non_blocking` copy has a contiguous pinned host side (`host_empty`) and a contiguous device side: anything
else turns it into a staged copy the host waits for, or a copy made on the side stream's own cached memory.
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors (integer indices, one dtype) on the host through one copy: a tier move's index work then syncs
    once (`with host_work:`), not at every `nonzero`, mask and check. On a CPU they are returned as they are."""
    if all(t.device.type == "cpu" for t in tensors):
        if HostWork.observer is not None:  # a CPU run has no copy to see: `flexicache bench ops` counts the call
            HostWork.observer()
        return tensors
    return one_copy_to_host(tensors)


def one_copy_to_host(tensors) -> tuple[torch.Tensor, ...]:
    """`to_host`'s copy: the tensors flattened into one, copied once, split back into their shapes."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    return tuple(part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (from `to_host`'s work) on `device` without a host wait: on CUDA through pinned memory (a copy
    from pageable memory waits for the stream to drain), which PyTorch's host allocator keeps until it is read."""
    streams = streams_for(device)
    if streams is None:
        return t.to(device)
    staged = streams.host_empty(t.shape, t.dtype)
    staged.copy_(t)
    return streams.upload(staged)


class HostWork:
    """`with host_work:` marks index work on `to_host`'s tensors: CPU ops, neither device kernels nor syncs on CUDA.

    `flexicache bench ops` counts the ops inside apart (on a CPU run it cannot tell a host tensor from a device one)."""

    active = 0  # blocks open now (read by the ops count)
    observer = None  # called by `to_host` on tensors already on the host, when set (by the ops count)

    def __enter__(self):
        HostWork.active += 1

    def __exit__(self, *exc):
        HostWork.active -= 1


host_work = HostWork()


class CudaStreams:
    """The CUDA primitives: copies on one low-priority side stream, completion events."""

    def __init__(self, device: torch.device):
        self.device = device
        # Lowest priority: copies fill the gaps between compute kernels instead of delaying them.
        low, _high = torch.cuda.Stream.priority_range()
        self.side = torch.cuda.Stream(device=device, priority=low)

    def host_empty(self, shape, dtype) -> torch.Tensor:
        """Pinned host memory, so copies can be asynchronous."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def upload(self, staged: torch.Tensor) -> torch.Tensor:
        """`staged` (contiguous, pinned) on the device, copied on the compute stream: later compute work sees it and
        the host does not wait. The host allocator keeps `staged`'s block until the copy has read it."""
        return staged.to(self.device, non_blocking=True)

    def _on_side(self, copy, uses) -> torch.cuda.Event:
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # after the compute work issued so far
        with torch.cuda.stream(self.side):
            copy()
            for t in uses:
                if t.is_cuda:
                    t.record_stream(self.side)  # not freed (and reused) before the side stream is done with it
            done = torch.cuda.Event()
            done.record(self.side)
        return done

    def offload(self, host_dst: torch.Tensor, device_src: torch.Tensor) -> torch.cuda.Event:
        """Copy `device_src` into pinned `host_dst`; returns the copy's event."""
        return self._on_side(lambda: host_dst.copy_(device_src, non_blocking=True), (device_src,))

    def promote(self, k_pool, v_pool, dst_slots, staged_k, staged_v) -> torch.cuda.Event:
        """Copy pinned `staged_k [C, P, D]`, `staged_v [C, P, Dv]` into device slots `dst_slots [C]`; returns the
        event."""

        def copy():
            k_pool.index_copy_(0, dst_slots, staged_k.to(self.device, non_blocking=True))
            v_pool.index_copy_(0, dst_slots, staged_v.to(self.device, non_blocking=True))

        return self._on_side(copy, (k_pool, v_pool, dst_slots))

    def read_back(self, host_srcs) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Device copies of pinned, contiguous `host_srcs`, made on the side stream after the copies issued before
        (stream order: the offloads that wrote them); returns the copies and their event."""
        dsts = [torch.empty(src.shape, dtype=src.dtype, device=self.device) for src in host_srcs]  # compute stream's

        def copy():
            for dst, src in zip(dsts, host_srcs):
                dst.copy_(src, non_blocking=True)

        return dsts, self._on_side(copy, dsts)

    def compute_wait(self, event) -> None:
        """The compute stream waits for `event` (the host does not)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, event) -> None:
        """The host waits for `event`."""
        event.synchronize()

    def host_sync(self) -> None:
        """The host waits for every copy issued so far."""
        self.side.synchronize()


_STREAMS: dict[torch.device, CudaStreams] = {}  # one per CUDA device, shared by every store


def streams_for(device: torch.device):
    """The stream primitives for `device`: `CudaStreams` on CUDA, None (synchronous copies) elsewhere.

    One per device, so every store of every cache copies on the same side stream: PyTorch caches freed device memory
    per stream, so a stream per store (hundreds in a model) would keep that many caches of copy buffers."""
    if device.type != "cuda":
        return None
    key = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if key not in _STREAMS:
        _STREAMS[key] = CudaStreams(key)
    return _STREAMS[key]


class PageTransfers:
    """Copies for one store's tiers; one instance per store. See the module docstring for the ordering rules."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.streams = streams_for(device)
        self._promotion_done = None
        self._offload_done = None
        # A promotion's pinned staging, keys and values apart: `[:count]` of each is contiguous, as an asynchronous
        # copy needs (a `[2, C, ...]` buffer's `[:, :count]` is not, below capacity).
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None
        self._staging_free = None

    def host_empty(self, shape, dtype) -> torch.Tensor:
        """Host memory for the host tier (pinned on CUDA)."""
        if self.streams is None:
            return torch.empty(shape, dtype=dtype)
        return self.streams.host_empty(shape, dtype)

    def offload(self, host_dst: torch.Tensor, device_src: torch.Tensor) -> None:
        """Copy freshly filled pages `device_src` into their host slots `host_dst` (same shape)."""
        if self.streams is None:
            host_dst.copy_(device_src)
            return
        # Made contiguous here, on the compute stream, where its memory is reused at once; inside the copy it would
        # be done on the side stream, in memory cached for that stream.
        self._offload_done = self.streams.offload(host_dst, device_src.contiguous())

    def wait_offloads(self) -> None:
        """The compute stream waits until every issued offload has read its pages (before freeing device slots)."""
        if self._offload_done is not None:
            self.streams.compute_wait(self._offload_done)

    def sync_host(self) -> None:
        """The host waits for all copies (before the host tier is read by the CPU, reallocated or reordered)."""
        if self.streams is not None:
            self.streams.host_sync()

    def land_offloads(self) -> None:
        """The host waits for this store's offloads (before the CPU reads the host tier); not for other stores' copies
        on the shared side stream, as `sync_host` does."""
        if self._offload_done is not None:
            self.streams.host_wait(self._offload_done)

    def fetch(self, host: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`host[index]` on the device, for the compute stream (`host`: a flat host-tier view, `index`: a host tensor).

        On CUDA the CPU gathers the rows, once their offloads have landed, into pinned memory, so the copy to the
        device is asynchronous (from a gather into ordinary memory it would be a copy the host waits for)."""
        if self.streams is None:
            return host.index_select(0, index)
        self.land_offloads()
        staged = self.streams.host_empty((index.numel(), *host.shape[1:]), host.dtype)
        torch.index_select(host, 0, index, out=staged)
        return self.streams.upload(staged)

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor `t` in host-tier memory (pinned on CUDA), e.g. a reordered host tier."""
        if self.streams is None:
            return t.contiguous()
        out = self.streams.host_empty(t.shape, t.dtype)
        out.copy_(t)
        return out

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
        if self.streams is None:
            idx = host_index.to(host_k.device)
            k_pool.index_copy_(0, dst_slots, host_k.index_select(0, idx))
            v_pool.index_copy_(0, dst_slots, host_v.index_select(0, idx))
            return
        # The CPU gathers host pages below: their offloads must be in host memory, not merely ordered on a stream.
        self.land_offloads()
        count = host_index.numel()
        staging_k, staging_v = self._staging_buffers(count, host_k, host_v)
        idx = host_index.cpu()
        torch.index_select(host_k, 0, idx, out=staging_k[:count])
        torch.index_select(host_v, 0, idx, out=staging_v[:count])
        self._promotion_done = self.streams.promote(k_pool, v_pool, dst_slots, staging_k[:count], staging_v[:count])
        self._staging_free = self._promotion_done

    def read_back(self, host_k: torch.Tensor, host_v: torch.Tensor):
        """Start device copies of host-tier pages (`[F, N, P, D]`, contiguous); `(keys, values, done)`, to be read only
        after `wait_read_back(done)`. The side stream runs them after the offloads issued earlier, which wrote them."""
        (keys, values), done = self.streams.read_back((host_k, host_v))
        return keys, values, done

    def wait_read_back(self, done) -> None:
        """The compute stream waits for a `read_back` before reading its copies."""
        self.streams.compute_wait(done)

    def wait_promotions(self) -> None:
        """Make the compute stream wait for issued promotions before it reads (or replaces) the pools they write."""
        if self._promotion_done is not None:
            self.streams.compute_wait(self._promotion_done)
            self._promotion_done = None

    def _staging_buffers(self, count: int, host_k: torch.Tensor, host_v: torch.Tensor):
        if self._staging_free is not None:
            self.streams.host_wait(self._staging_free)  # its previous copy must have left the buffers
        if self._staging is None or self._staging[0].shape[0] < count:
            rows = max(count, 64)
            self._staging = tuple(self.streams.host_empty((rows, *h.shape[1:]), h.dtype) for h in (host_k, host_v))
        return self._staging

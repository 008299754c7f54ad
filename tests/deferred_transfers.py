"""A test-only transfer backend that makes CUDA stream ordering checkable on a CPU (issue 14, item 3).

`DeferredStreams` implements the primitives `fc_hf.transfer.PageTransfers` orders its copies
with (`offload`, `promote`, `compute_wait`, `host_wait`/`host_sync`), as a worst-case GPU would run
them: a copy does not happen when it is issued but only when the code waits for it, its source is
read only then, and its destination holds NaN until then. What each kind of wait makes visible
follows CUDA:

- `compute_wait(event)` (the compute stream waits on an event) lands the copies up to that event
  whose destination is device memory (promotions): later device work sees them. It does not land
  offloads into host memory, since the CPU does not wait for a stream.
- `host_wait(event)` (event.synchronize) lands every copy up to that event; `host_sync()` lands all.

So reading a promoted slot before `wait_promotions`, copying a pool while a promotion into it is
pending, or gathering host pages with the CPU before their offload has landed all show up as NaN
(or as a page missing from a replaced pool) in the tests' outputs.

It also checks what makes those copies asynchronous on CUDA (`HostSideError` otherwise): the host side
of every copy (`offload`, `promote`, `upload`, `read_back`) is contiguous memory from this backend's
`host_empty` (pinned on CUDA; pinning itself cannot be seen on a CPU), and a device source is contiguous.

Use `deferred_transfers()` (a context manager) to make every store created inside it use this
backend; `FLEXICACHE_TEST_TRANSFERS=deferred` does so for a whole test run (see conftest.py).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

import fc_hf.transfer as transfer

NAN = float("nan")


class FakeEvent:
    pass


class HostSideError(AssertionError):
    """A copy's host side is not contiguous `host_empty` memory, or its device source is strided: on CUDA such a copy
    is staged through pageable memory and the host waits for it."""


class DeferredStreams:
    def __init__(self, device=None):
        self.queue: list[tuple[FakeEvent, object, str]] = []  # (event, copy, "host" | "device"), in issue order
        self.issued = {"offload": 0, "promote": 0, "upload": 0}
        self.landed_late = 0  # copies that were still pending when something waited for them
        self._pinned: dict[int, weakref.ref] = {}  # storage address -> the `host_empty` tensor that owns it

    def host_empty(self, shape, dtype) -> torch.Tensor:
        # Never-written host memory reads as NaN (integers: -1, an index that fails loudly).
        t = torch.full(shape, NAN if dtype.is_floating_point else -1, dtype=dtype)
        self._pinned[t.untyped_storage().data_ptr()] = weakref.ref(t)
        return t

    def check_host_side(self, t: torch.Tensor, what: str) -> None:
        """Raise `HostSideError` unless `t` is contiguous and lies in memory from `host_empty` (a view of it counts)."""
        owner = self._pinned.get(t.untyped_storage().data_ptr())
        if owner is None or owner() is None:
            raise HostSideError(f"{what}: host side {tuple(t.shape)} is not host_empty (pinned) memory")
        if not t.is_contiguous():
            raise HostSideError(f"{what}: host side {tuple(t.shape)} strides {t.stride()} is not contiguous")

    @staticmethod
    def check_device_side(t: torch.Tensor, what: str) -> None:
        if not t.is_contiguous():
            raise HostSideError(f"{what}: device side {tuple(t.shape)} strides {t.stride()} is not contiguous")

    def upload(self, staged) -> torch.Tensor:
        """A copy on the compute stream: later device work sees it, so it lands at once."""
        self.issued["upload"] += 1
        self.check_host_side(staged, "upload")
        return staged.clone()

    def _issue(self, copy, lands_in: str) -> FakeEvent:
        event = FakeEvent()
        self.queue.append((event, copy, lands_in))
        return event

    def offload(self, host_dst, device_src) -> FakeEvent:
        self.issued["offload"] += 1
        self.check_host_side(host_dst, "offload")
        self.check_device_side(device_src, "offload")
        host_dst.fill_(NAN)
        return self._issue(lambda: host_dst.copy_(device_src), "host")

    def promote(self, k_pool, v_pool, dst_slots, staged_k, staged_v) -> FakeEvent:
        self.issued["promote"] += 1
        self.check_host_side(staged_k, "promote (keys)")
        self.check_host_side(staged_v, "promote (values)")
        k_pool.index_fill_(0, dst_slots, NAN)
        v_pool.index_fill_(0, dst_slots, NAN)

        def copy():  # reads the staging buffers and the slot list now, as the side stream would
            k_pool.index_copy_(0, dst_slots, staged_k)
            v_pool.index_copy_(0, dst_slots, staged_v)

        return self._issue(copy, "device")

    def read_back(self, host_srcs):
        """Device copies of host memory: NaN until landed; landing one lands everything issued before it (a CUDA
        stream runs in order, so the offloads that wrote those host pages have finished by then)."""
        self.issued["read_back"] = self.issued.get("read_back", 0) + 1
        for src in host_srcs:
            self.check_host_side(src, "read_back")
        dsts = [torch.full_like(src, NAN) for src in host_srcs]

        def copy():
            for dst, src in zip(dsts, host_srcs):
                dst.copy_(src)

        return dsts, self._issue(copy, "read")

    def _land(self, upto: FakeEvent | None, kinds: tuple[str, ...]) -> None:
        if upto is not None and all(e is not upto for e, _, _ in self.queue):
            return  # already landed
        keep = []
        reached = False
        for event, copy, lands_in in self.queue:
            if not reached and lands_in in kinds:
                copy()
                self.landed_late += 1
            else:
                keep.append((event, copy, lands_in))
            reached = reached or event is upto
        self.queue = keep

    def compute_wait(self, event) -> None:
        if any(e is event and kind == "read" for e, _, kind in self.queue):
            self._land(event, ("device", "host", "read"))  # in stream order: everything before the read first
        else:
            self._land(event, ("device",))

    def host_wait(self, event) -> None:
        self._land(event, ("device", "host", "read"))

    def host_sync(self) -> None:
        self._land(None, ("device", "host", "read"))


@contextmanager
def deferred_transfers():
    """Every `PagedKV` created inside uses `DeferredStreams`; yields the list of backends created."""
    created = []
    real = transfer.streams_for

    def fake(device):
        streams = DeferredStreams(device)
        created.append(streams)
        return streams

    transfer.streams_for = fake
    try:
        yield created
    finally:
        transfer.streams_for = real

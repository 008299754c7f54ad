"""A test-only transfer backend that makes CUDA stream ordering checkable on a CPU (issue 14, item 3).

`DeferredStreams` implements the four primitives `fc_hf.transfer.PageTransfers` orders its copies
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

Use `deferred_transfers()` (a context manager) to make every store created inside it use this
backend; `FLEXICACHE_TEST_TRANSFERS=deferred` does so for a whole test run (see conftest.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import fc_hf.transfer as transfer

NAN = float("nan")


class FakeEvent:
    pass


class DeferredStreams:
    def __init__(self, device=None):
        self.queue: list[tuple[FakeEvent, object, str]] = []  # (event, copy, "host" | "device"), in issue order
        self.issued = {"offload": 0, "promote": 0}
        self.landed_late = 0  # copies that were still pending when something waited for them

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return torch.full(shape, NAN, dtype=dtype)  # never-written host memory reads as NaN

    def _issue(self, copy, lands_in: str) -> FakeEvent:
        event = FakeEvent()
        self.queue.append((event, copy, lands_in))
        return event

    def offload(self, host_dst, device_src) -> FakeEvent:
        self.issued["offload"] += 1
        host_dst.fill_(NAN)
        return self._issue(lambda: host_dst.copy_(device_src), "host")

    def promote(self, k_pool, v_pool, dst_slots, staged) -> FakeEvent:
        self.issued["promote"] += 1
        k_pool.index_fill_(0, dst_slots, NAN)
        v_pool.index_fill_(0, dst_slots, NAN)

        def copy():  # reads the staging buffer and the slot list now, as the side stream would
            k_pool.index_copy_(0, dst_slots, staged[0])
            v_pool.index_copy_(0, dst_slots, staged[1])

        return self._issue(copy, "device")

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
        self._land(event, ("device",))

    def host_wait(self, event) -> None:
        self._land(event, ("device", "host"))

    def host_sync(self) -> None:
        self._land(None, ("device", "host"))


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

"""The host tier of a stable head group: every full page, written once when it fills.

`host_k/host_v[page, row]` (`[Pcap, N, P, D]`, pinned on CUDA) hold the authoritative copy: dropping a device page copies
nothing, a promotion copies host -> device, and reads of pages not resident (refinement's candidates, a read-back for
tokens added to a filled cache) come from here. The copies go through the store's `PageTransfers` (fc_hf/transfer.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .slot_pool import gather_pages
from .transfer import host_work, to_device, to_host


@dataclass
class HostMark:
    """The host tier a mark keeps, by reference (pages written later lie past `pages`)."""

    host_k: torch.Tensor | None
    host_v: torch.Tensor | None
    pages: int


class HostTier:
    """Full pages of `rows` rows in host memory; see the module docstring."""

    def __init__(self, rows, page_size, head_dim, value_dim, dtype, transfers, grow_pages: int = 16):
        self.rows, self.page_size, self.head_dim, self.value_dim = rows, page_size, head_dim, value_dim
        self.dtype, self.transfers, self.grow_pages = dtype, transfers, grow_pages
        self.host_k = self.host_v = None
        self.pages = 0  # full pages written
        self._read_back: tuple | None = None  # (full pages, copy) started by `start_read_back`

    def nbytes(self) -> int:
        if self.host_k is None:
            return 0
        return self.host_k.numel() * self.host_k.element_size() + self.host_v.numel() * self.host_v.element_size()

    def write(self, first: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Pages `[first, end)` filled: `keys`/`values` `[N, end - first, P, D]` go to their host slots."""
        self._ensure(end)
        self.transfers.offload(self.host_k[first:end], keys.transpose(0, 1))
        self.transfers.offload(self.host_v[first:end], values.transpose(0, 1))
        self.pages = end

    def _ensure(self, pages: int) -> None:
        cap = 0 if self.host_k is None else self.host_k.shape[0]
        if pages <= cap:
            return
        # Geometric growth: regrowing copies the whole host tier, so it must stay rare on long decodes.
        new_cap = max(pages + self.grow_pages, cap + cap // 4)
        hk = self.transfers.host_empty((new_cap, self.rows, self.page_size, self.head_dim), self.dtype)
        hv = self.transfers.host_empty((new_cap, self.rows, self.page_size, self.value_dim), self.dtype)
        if self.host_k is not None:
            self.transfers.sync_host()
            hk[:cap].copy_(self.host_k)
            hv[:cap].copy_(self.host_v)
        self.host_k, self.host_v = hk, hv

    def fill(self, pages: torch.Tensor, slots: torch.Tensor, outs) -> None:
        """Where `slots` (of `pages [N, M]`, gathered into `outs`: `[N, M, P, D]` keys, then values if given) shows a
        full page not resident, write the page's host copy into the outputs instead: worked out on the host from one
        copy (one host sync on CUDA), then one `index_select` and one `index_copy_` per output through flat indices."""
        if not self.pages:
            return
        host_pages, host_slots = to_host(pages, slots)
        with host_work:
            rows, cols = ((host_slots == 0) & (host_pages < self.pages)).nonzero(as_tuple=True)
            host_rows = host_pages[rows, cols] * self.rows + rows
            dst = rows * pages.shape[1] + cols
        if not host_rows.numel():
            return
        dst = to_device(dst, outs[0].device)
        for out, host in zip(outs, (self.host_k, self.host_v)):
            # Gathered into pinned memory once this store's offloads have landed (`PageTransfers.fetch`), so the copy to
            # the device does not make the host wait.
            found = self.transfers.fetch(host.view(-1, *host.shape[2:]), host_rows)
            out.view(-1, *out.shape[2:]).index_copy_(0, dst, found)

    def full_page_keys(self, pages: torch.Tensor, workspace=None) -> torch.Tensor:
        """Keys `[N, C, P, D]` of `pages [N, C]` read from this tier in one gather, where the host tier is the device's
        own memory (a CPU: no transfers); a page past the full ones (the page being filled) reads the last full page's
        keys, for the caller to overwrite. With `workspace`: its "candidate_keys" buffer."""
        row = torch.arange(self.rows, device=pages.device)[:, None]
        flat = self.host_k.view(-1, self.page_size, self.head_dim)  # page-major: page * rows + row
        return gather_pages(flat, pages.clamp(max=self.pages - 1) * self.rows + row, workspace, "candidate_keys")

    def promote(self, k_pool, v_pool, rows: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy host pages (row, page) into device slots `slots` of the pools. `rows`, `pages` `[C]` are host tensors
        (the tier move's plan, `fc_hf.transfer.to_host`), `slots` `[C]` is on the device."""
        self.transfers.wait_offloads()
        with host_work:
            host_index = pages * self.rows + rows
        self.transfers.promote(k_pool, v_pool, slots, self.host_k.view(-1, self.page_size, self.head_dim),
                               self.host_v.view(-1, self.page_size, self.value_dim), host_index)

    # -- read-back of every full page (tokens added to a filled cache) -------------------------------------
    def start_read_back(self, full: int) -> int:
        """Start the device copy of the first `full` pages that the next `full_pages` reads (CUDA: on the side stream,
        so it overlaps the compute issued meanwhile; nothing to do where the device reads host memory). Returns the
        device bytes it allocated."""
        if not (full and self.transfers.streams is not None):
            return 0
        self._read_back = (full, self.transfers.read_back(self.host_k[:full], self.host_v[:full]))
        keys, values, _ = self._read_back[1]
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()

    def full_pages(self, full: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(keys, values, staged bytes)`: the first `full` pages `[F, N, P, D]` as the device can read them."""
        if self.transfers.streams is None:
            return self.host_k[:full], self.host_v[:full], 0
        started, self._read_back = self._read_back, None
        if started is None or started[0] != full:
            started = (full, self.transfers.read_back(self.host_k[:full], self.host_v[:full]))
        keys, values, done = started[1]
        self.transfers.wait_read_back(done)
        return keys, values, keys.numel() * keys.element_size() + values.numel() * values.element_size()

    # -- copies, row reshuffles, marks ---------------------------------------------------------------------
    def __deepcopy__(self, memo):
        """A copy in host memory of its own (pinned on CUDA), with the copying store's transfers (in `memo`)."""
        self.transfers.sync_host()
        new = HostTier.__new__(HostTier)
        memo[id(self)] = new
        skip = ("host_k", "host_v", "_read_back")
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k not in skip})
        new.host_k = new.host_v = new._read_back = None
        if self.host_k is not None:
            new.host_k = new.transfers.host_empty(self.host_k.shape, self.dtype).copy_(self.host_k)
            new.host_v = new.transfers.host_empty(self.host_v.shape, self.dtype).copy_(self.host_v)
        return new

    def select_rows(self, row_map: torch.Tensor) -> None:
        self.rows = row_map.numel()
        if self.host_k is not None:
            self.transfers.sync_host()
            cpu_map = row_map.cpu()
            self.host_k = self.transfers.host_copy(self.host_k[:, cpu_map])  # host-tier memory again (pinned on CUDA)
            self.host_v = self.transfers.host_copy(self.host_v[:, cpu_map])

    def snapshot(self) -> HostMark:
        return HostMark(self.host_k, self.host_v, self.pages)

    def restore(self, mark: HostMark) -> None:
        self.host_k, self.host_v, self.pages = mark.host_k, mark.host_v, mark.pages
        self._read_back = None

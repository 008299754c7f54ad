"""Paged KV storage of one head group of one layer: device slot pool, block table, host tier, MinMax cache.

Rows: one row per (sequence, KV head of the group), row = b * heads + h. Every row holds the same
number of tokens (transformers pads on the left), so page `p` of every row covers tokens
`[p*P, (p+1)*P)`.

Device tier: `k_pool`/`v_pool` of shape `[S, P, D]`; slot 0 is the shared all-zero null block, and
`table[row, page]` is the page's slot, or 0 when the page is not resident. Pages are allocated
from a free-slot stack, so dropping and promoting pages never touches the allocator.

Host tier (`tiered=True`): every full page is written once, when it fills, into
`host_k/host_v[page, row]` (`[Pcap, N, P, D]`, pinned on CUDA). The host copy is authoritative:
dropping a device page copies nothing; a promotion copies host -> device.

MinMax cache: `meta[row, page * S + s] = [kmax, kmin]` of sub-page `s` (`[N, Pcap * S, 2D]`, KV dtype;
`S = FlexiCacheConfig.subpages`, 2 by default at an even page size; 1 = the authors' one entry per page) for every full page,
written when the page fills, always on the device and never offloaded. It is stored channel-major
(`meta_t`, `[N, 2D, Pcap]`) and handed out as a transposed view: scoring reads it as the right-hand
side of a matmul, ~30% faster on a CPU in that layout, while pages are written only once.
"""

from __future__ import annotations

import copy
import math

import torch

from . import kernels
from .errors import FlexiCacheError
from .ledger import DeviceLedger
from .transfer import PageTransfers, host_work, to_device, to_host


def _grow_dim(t: torch.Tensor, dim: int, new_size: int, fill=0) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = new_size
    out = t.new_empty(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    out.narrow(dim, t.shape[dim], new_size - t.shape[dim]).fill_(fill)  # only the new part needs the fill
    return out


def gather_pages(pool: torch.Tensor, slots: torch.Tensor, workspace=None, name: str = "pages") -> torch.Tensor:
    """`pool[slots]` as `[*slots.shape, *pool.shape[1:]]`, through one `index_select` (advanced indexing with a
    2-D index is ~8x slower on a CPU, measured on a refinement's gather).

    A new tensor, or with `workspace` (`kernels.GatherWorkspace`) its reused buffer `name` (valid until the next
    gather under that name), so a hot path does not page-fault a fresh multi-MB tensor per layer and step."""
    flat = slots.reshape(-1)
    out = pool.index_select(0, flat) if workspace is None else workspace.gather(pool, flat, name)
    return out.view(*slots.shape, *pool.shape[1:])


class PagedKV:
    """Pages of `heads` KV heads for a batch of sequences; see the module docstring."""

    def __init__(
        self,
        batch: int,
        heads: int,
        page_size: int,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tiered: bool,
        grow_pages: int = 16,
        subpages: int = 1,
        page_means: bool = False,
        ledger=None,
    ):
        self.batch, self.heads, self.page_size = batch, heads, page_size
        self.head_dim, self.value_dim = head_dim, value_dim
        self.dtype, self.device, self.tiered = dtype, device, tiered
        self.rows = batch * heads
        self.subpages = subpages  # MinMax entries per page
        self.grow_pages = grow_pages  # capacity added per growth, in pages per row
        self.length = 0
        self.transfers = PageTransfers(device)
        # Counts the device bytes of the pools (and the cache's peak); `_set_pools` keeps it current.
        self.ledger = ledger if ledger is not None else DeviceLedger()
        self.k_pool = self.v_pool = None
        # Device tier: start with the null block only; `append` grows it to what the prompt needs.
        self._set_pools(torch.zeros(1, page_size, head_dim, dtype=dtype, device=device),
                        torch.zeros(1, page_size, value_dim, dtype=dtype, device=device))
        self.free = torch.empty(0, dtype=torch.long, device=device)
        self.n_free = 0
        self.table = torch.zeros(self.rows, 0, dtype=torch.long, device=device)
        self.meta_t = torch.zeros(self.rows, 2 * head_dim, 0, dtype=dtype, device=device)
        # Mean key and mean value of every full page (`[N, Pcap, D + Dv]`), for the tail estimate.
        self.page_means = torch.zeros(self.rows, 0, head_dim + value_dim, dtype=dtype, device=device) if page_means else None
        self.host_k = self.host_v = None
        self.host_pages = 0  # full pages written to the host tier
        # Bumped on every write to `table`; caches of its entries (here and in `HeadGroup`) are keyed on it.
        self.table_version = 0
        self._write_slots: tuple | None = None  # (page, table_version, slots [N]) of the page being filled
        # Set by `arrange_rows` (tiered groups on the PyTorch path), cleared by any slot move it did not plan:
        # {"pages": the arranged pages [N, M], "width": slots per row, "used": positions filled per row}.
        self.row_layout: dict | None = None
        self._read_back: tuple | None = None  # (full pages, copy) started by `start_read_back`
        self.counters = {"pages_offloaded": 0, "bytes_offloaded": 0, "pages_promoted": 0, "bytes_promoted": 0}
        self._marked = False  # a mark holds the table, free stack and pools: copy them before rewriting (`unshare`)

    def __deepcopy__(self, memo):
        """An independent store: every tensor copied once its pending copies have landed, the host tier into new
        host memory of its own (pinned on CUDA), and transfers (streams, events, staging) of its own."""
        self.transfers.wait_promotions()
        self.transfers.sync_host()
        new = PagedKV.__new__(PagedKV)
        memo[id(self)] = new
        new.transfers = PageTransfers(self.device)
        for name, value in self.__dict__.items():
            if name == "transfers":
                continue
            if name in ("host_k", "host_v") and value is not None:
                host = new.transfers.host_empty(value.shape, value.dtype)
                value = host.copy_(value)
            elif name == "_read_back":
                value = None
            else:
                value = copy.deepcopy(value, memo)
            new.__dict__[name] = value
        return new

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return math.ceil(self.length / self.page_size)

    @property
    def full_pages(self) -> int:
        return self.length // self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of K plus V."""
        return self.page_size * (self.head_dim + self.value_dim) * self.dtype.itemsize

    def slots_in_use(self) -> int:
        return self.k_pool.shape[0] - 1 - self.n_free

    def device_bytes(self) -> int:
        return self.k_pool.numel() * self.k_pool.element_size() + self.v_pool.numel() * self.v_pool.element_size()

    def _set_pools(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        """Make `k_pool`/`v_pool` the device tier (replacing any earlier pools), counted by the ledger."""
        old = 0 if self.k_pool is None else self.device_bytes()
        self.k_pool, self.v_pool = k_pool, v_pool
        self.ledger.resized(old, self.device_bytes())

    def free_device(self) -> None:
        """Drop the device tier (the cache is being released); the ledger stops counting it."""
        self.ledger.resized(self.device_bytes(), 0)
        self.k_pool = self.v_pool = None

    def host_bytes(self) -> int:
        if self.host_k is None:
            return 0
        return self.host_k.numel() * self.host_k.element_size() + self.host_v.numel() * self.host_v.element_size()

    def metadata_bytes(self) -> int:
        nbytes = self.meta_t.numel() * self.meta_t.element_size() + self.table.numel() * self.table.element_size()
        if self.page_means is not None:
            nbytes += self.page_means.numel() * self.page_means.element_size()
        return nbytes

    @property
    def meta(self) -> torch.Tensor:
        """`[N, Pcap * S, 2D]` view of the MinMax cache (kmax, kmin per sub-page; S = 1: per page)."""
        return self.meta_t.transpose(1, 2)

    # -- slot allocation -----------------------------------------------------------------------
    def slots_needed(self, new_tokens: int) -> int:
        """Device slots an append of `new_tokens` tokens would take from the free stack."""
        new_pages = math.ceil((self.length + new_tokens) / self.page_size) - self.num_pages
        return new_pages * self.rows

    def _alloc(self, count: int) -> torch.Tensor:
        layout = self.row_layout
        if layout is not None:  # the free stack's top is each row's next position: one page per row continues the rows
            if count == self.rows and layout["used"] < layout["width"]:
                layout["used"] += 1
            else:
                self.row_layout = None
        if count > self.n_free:
            # Spare pages per row: ~1.5% of what is held once this allocation is made (a prefill's pages
            # count too), at most `grow_pages`, so the allocation tracks the real size closely and
            # regrowth (a copy of the whole pool) stays rare.
            held = (self.slots_in_use() + count) // self.rows
            spare = min(self.grow_pages, max(1, held // 64))
            self._grow_pool(count - self.n_free + spare * self.rows)
        self.n_free -= count
        return self.free[self.n_free : self.n_free + count].clone()

    def alloc_slots(self, count: int) -> torch.Tensor:
        """`count` free device slots (the pool grows if it must), for a tier move that promotes more than it evicts."""
        self.row_layout = None  # not one page per row at the layout's next position
        return self._alloc(count)

    def release(self, slots: torch.Tensor) -> None:
        """Return device slots to the free stack (their pages stay on the host)."""
        count = slots.numel()
        if count == 0:
            return
        self.unshare()  # the entries above the stack top may be a mark's
        self.row_layout = None
        if self.n_free + count > self.free.numel():
            self.free = _grow_dim(self.free, 0, self.n_free + count)
        self.free[self.n_free : self.n_free + count] = slots.reshape(-1)
        self.n_free += count

    def _grow_pool(self, extra: int) -> None:
        self.transfers.wait_promotions()  # a pending promotion writes into the pool being copied
        self.row_layout = None
        old = self.k_pool.shape[0]
        self._set_pools(_grow_dim(self.k_pool, 0, old + extra), _grow_dim(self.v_pool, 0, old + extra))
        # New slots go to the bottom of the stack so recently freed slots are reused first.
        new = torch.arange(old, old + extra, device=self.device)
        self.free = torch.cat([new, self.free[: self.n_free]])
        self.n_free += extra

    def compact(self, headroom_slots: int) -> None:
        """Shrink the device pool to the resident pages plus `headroom_slots`, remapping the table.

        Called once a tiered group has dropped the pages outside its top-K: a pool keeps its
        allocation when slots are freed, so without this the device memory would not go down.
        """
        self.unshare()  # the table is rewritten in place
        self._repack(self.table, headroom_slots)

    def _repack(self, table: torch.Tensor, spare: int) -> None:
        """Copy the pages `table` points at into a fresh pool of exactly those + `spare` free slots.

        Each non-zero entry gets its own new slot, so a table whose rows share slots (duplicated
        beams) comes out with private copies.
        """
        self.transfers.wait_promotions()  # a pending promotion writes into the pool being copied
        self.row_layout = None
        resident = table != 0
        count = int(resident.sum())
        old_slots = table[resident]
        new_k = self.k_pool.new_zeros(1 + count + spare, *self.k_pool.shape[1:])
        new_v = self.v_pool.new_zeros(1 + count + spare, *self.v_pool.shape[1:])
        new_k[1 : 1 + count] = gather_pages(self.k_pool, old_slots)
        new_v[1 : 1 + count] = gather_pages(self.v_pool, old_slots)
        table[resident] = torch.arange(1, 1 + count, device=self.device)
        self._set_pools(new_k, new_v)
        self.table = table
        self.table_changed()
        self.free = torch.arange(1 + count, 1 + count + spare, device=self.device).flip(0)
        self.n_free = spare

    def arrange_rows(self, pages: torch.Tensor, headroom: int, holes: bool = False) -> None:
        """Lay the resident pages out row by row, so that they are read in place instead of gathered.

        `pages [N, M]` must be exactly the resident pages (each row's, each once: a tiered group right after its
        tier move). With `holes` (`budget_mass`: rows of fewer pages, valid entries first, -1 after) a -1 entry keeps
        its position as a zero page outside the table, for the reader to mask, and its slot goes to the bottom of the
        free stack. Row r's page `pages[r, j]` moves to slot `1 + r * W + j` (`W = M + headroom`), and the free
        stack becomes each row's next positions, first `M` for every row, so the pages opened until the next
        ranking (one per row at a time) continue the rows. While that holds (`row_layout`; any other slot move
        clears it), `row_view` gives the K/V of `pages` plus the pages opened since as views of the pools, in that
        order: what gathering their slots gives, without the copy. One copy of the resident pages per ranking.
        """
        self.transfers.wait_promotions()  # the promoted pages must have landed before they are moved
        self.unshare()  # the pools and the table are rewritten in place
        n, m = pages.shape
        width = m + headroom
        need = 1 + n * width
        empty = pages < 0
        old = self.slots_for(pages, holes)
        keys, values = gather_pages(self.k_pool, old), gather_pages(self.v_pool, old)  # copies
        if self.k_pool.shape[0] != need:
            self._set_pools(self.k_pool.new_zeros(need, *self.k_pool.shape[1:]),
                            self.v_pool.new_zeros(need, *self.v_pool.shape[1:]))
        self.k_pool[1:].view(n, width, *self.k_pool.shape[1:])[:, :m] = keys
        self.v_pool[1:].view(n, width, *self.v_pool.shape[1:])[:, :m] = values
        base = 1 + torch.arange(n, device=self.device)[:, None] * width  # [N, 1]
        new = base + torch.arange(m, device=self.device)
        # A -1 entry writes its row's first entry again (rows are valid first, so that one is a page): no -1 index
        # (the table's last column) and no host sync to find them.
        self.table.scatter_(1, torch.where(empty, pages[:, :1], pages), torch.where(empty, new[:, :1], new))
        self.table_changed()
        # Stack top (the end) = position m of rows 0..N-1, below it position m + 1, ...
        self.free = (base.view(1, n) + torch.arange(width - 1, m - 1, -1, device=self.device)[:, None]).reshape(-1)
        if holes:  # taken only once the rows' continuations are used up (which ends the layout anyway)
            self.free = torch.cat([new[empty], self.free])
        self.n_free = self.free.numel()
        self.row_layout = {"pages": pages, "width": width, "used": m}

    def row_view(self, arranged: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(keys [N, m*P, D], values [N, m*P, Dv])` as views of the pools: the pages `arranged` (the tensor given to
        `arrange_rows`, by identity) followed by the pages opened since, in that order, when the layout still holds
        and they are `m` per row; else None (gather their slots instead)."""
        layout = self.row_layout
        if layout is None or layout["pages"] is not arranged or layout["used"] != m:
            return None
        n, width, p = arranged.shape[0], layout["width"], self.page_size
        keys = self.k_pool[1:].view(n, width * p, self.head_dim)[:, : m * p]
        values = self.v_pool[1:].view(n, width * p, self.value_dim)[:, : m * p]
        return keys, values

    # -- writing ---------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor | None = None,
               backend: str | None = None) -> None:
        """Append `[B, heads, T, D]` keys/values for every row.

        With `heads` (`[heads]`), `keys`/`values` hold every KV head of the layer (`[B, H, T, D]`) and this store's
        are taken from them (at a decode step in the append itself: one Triton launch on that backend)."""
        t = keys.shape[2]
        if heads is not None and t > 1:
            keys, values, heads = keys.index_select(1, heads), values.index_select(1, heads), None
        start = self.length
        old_pages, old_full = self.num_pages, self.full_pages
        new_pages = math.ceil((start + t) / self.page_size)
        self._ensure_page_capacity(new_pages)
        if new_pages > old_pages:
            slots = self._alloc((new_pages - old_pages) * self.rows)
            self.table[:, old_pages:new_pages] = slots.view(new_pages - old_pages, self.rows).t()
            self.table_changed()
        if t == 1:  # a decode step: one token per row, into the page being filled at offset `off`
            page, off = divmod(start, self.page_size)
            kernels.append_token(keys.select(2, 0), values.select(2, 0), heads, self._page_slots(page), self.k_pool,
                                 self.v_pool, off, backend=backend)
        else:
            pos = torch.arange(start, start + t, device=self.device)
            flat = self.table[:, pos // self.page_size] * self.page_size + (pos % self.page_size)  # [N, T]
            self.k_pool.view(-1, self.head_dim).index_copy_(0, flat.reshape(-1), keys.reshape(-1, self.head_dim))
            self.v_pool.view(-1, self.value_dim).index_copy_(0, flat.reshape(-1), values.reshape(-1, self.value_dim))
        self.length = start + t
        if self.full_pages > old_full:
            self._pages_filled(old_full, self.full_pages)

    def append_offloaded(self, keys: torch.Tensor, values: torch.Tensor, keep: int) -> None:
        """Append `[B, heads, T, D]` tokens to a tiered store, keeping on the device only the first `keep` pages (the
        attention sink) and the page being filled.

        Every page this append fills goes to the host tier once, taken from `keys`/`values` themselves (its MinMax
        entries too), and never takes a device slot; the full pages resident before (a ranking's selection) leave the
        device as well, since the host holds every full page. So a long prompt fed in chunks never holds more than
        a chunk of a stable head on the device, and a new turn starts from the sink; the group ranks again at its
        next decode step and promotes its top-K (`HeadGroup.append`).
        """
        p, t = self.page_size, keys.shape[2]
        self.unshare()  # resident pages leave the table
        start, end = self.length, self.length + t
        old_full, old_pages = self.full_pages, self.num_pages
        full_end, pages_end = end // p, math.ceil(end / p)
        self._ensure_page_capacity(pages_end)
        self._drop_pages(keep, old_full)  # before allocating, so the new pages reuse the slots
        stay = [q for q in range(old_pages, pages_end) if q < keep or (q == pages_end - 1 and end % p)]
        if stay:
            slots = self._alloc(len(stay) * self.rows)
            self.table[:, stay] = slots.view(len(stay), self.rows).t()
            self.table_changed()
        k_rows = keys.reshape(self.rows, t, self.head_dim)
        v_rows = values.reshape(self.rows, t, self.value_dim)
        # Tokens that land in device pages: the old page being filled, kept pages, the new page being filled.
        on_device = sorted(set(stay) | ({old_full} if start % p else set()))
        if on_device:
            pos = torch.cat([torch.arange(max(start, q * p), min(end, (q + 1) * p)) for q in on_device]).to(self.device)
            flat = (self.table[:, pos // p] * p + pos % p).reshape(-1)
            self.k_pool.view(-1, self.head_dim).index_copy_(0, flat, k_rows.index_select(1, pos - start).reshape(
                -1, self.head_dim))
            self.v_pool.view(-1, self.value_dim).index_copy_(0, flat, v_rows.index_select(1, pos - start).reshape(
                -1, self.value_dim))
        if full_end > old_full:
            kf, vf = k_rows[:, : full_end * p - start], v_rows[:, : full_end * p - start]
            if start % p:  # the old page being filled is full now: its earlier tokens are on the device
                slot = self.table[:, old_full]
                kf = torch.cat([self.k_pool[slot][:, : start % p], kf], dim=1)
                vf = torch.cat([self.v_pool[slot][:, : start % p], vf], dim=1)
            filled = full_end - old_full
            self._pages_filled(old_full, full_end, kf.reshape(self.rows, filled, p, self.head_dim),
                               vf.reshape(self.rows, filled, p, self.value_dim))
            if start % p and old_full >= keep:
                self.transfers.wait_offloads()  # its offload reads the slot before the slot is reused
                self.release(self.table[:, old_full])
                self.table[:, old_full] = 0
                self.table_changed()
        self.length = end

    def _drop_pages(self, first: int, end: int) -> None:
        """Free the device slots of the resident pages among `[first, end)` (full pages: the host holds them)."""
        if end <= first:
            return
        slots = self.table[:, first:end]
        resident = slots[slots != 0]
        if resident.numel():
            self.transfers.wait_offloads()  # a dropped page's offload must have read its slot
            self.release(resident)
            self.table[:, first:end] = 0
            self.table_changed()

    def table_changed(self) -> None:
        """Call after writing `table` (anything that caches its entries re-reads them)."""
        self.table_version += 1

    def _page_slots(self, page: int) -> torch.Tensor:
        """`table[:, page]` as a contiguous `[N]` tensor, read once per page (and again after a table write)."""
        cached = self._write_slots
        if cached is None or cached[0] != page or cached[1] != self.table_version:
            cached = (page, self.table_version, self.table[:, page].contiguous())
            self._write_slots = cached
        return cached[2]

    def _pages_filled(self, first: int, end: int, keys: torch.Tensor | None = None,
                      values: torch.Tensor | None = None) -> None:
        """Pages `[first, end)` just became full: write their MinMax entries and their host copies.

        Their keys and values (`[N, F, P, D]`) are read from the device pool unless given."""
        if keys is None:
            slots = self.table[:, first:end]  # [N, F]
            keys = gather_pages(self.k_pool, slots)  # [N, F, P, D]
            values = gather_pages(self.v_pool, slots) if (self.tiered or self.page_means is not None) else None
        s = self.subpages
        sub = keys.reshape(keys.shape[0], (end - first) * s, self.page_size // s, self.head_dim)
        self.meta_t[:, :, first * s : end * s] = torch.cat([sub.amax(dim=2), sub.amin(dim=2)], dim=-1).transpose(1, 2)
        if self.page_means is not None:
            self.page_means[:, first:end] = torch.cat([keys.mean(dim=2), values.mean(dim=2)], dim=-1)
        if self.tiered:
            self._ensure_host_capacity(end)
            self.transfers.offload(self.host_k[first:end], keys.transpose(0, 1))
            self.transfers.offload(self.host_v[first:end], values.transpose(0, 1))
            self.host_pages = end
            n = (end - first) * self.rows
            self.counters["pages_offloaded"] += n
            self.counters["bytes_offloaded"] += n * self.page_bytes

    def _ensure_page_capacity(self, pages: int) -> None:
        cap = self.table.shape[1]
        if pages > cap:
            new_cap = pages + self.grow_pages
            self.table = _grow_dim(self.table, 1, new_cap)
            self.meta_t = _grow_dim(self.meta_t, 2, new_cap * self.subpages)
            if self.page_means is not None:
                self.page_means = _grow_dim(self.page_means, 1, new_cap)

    def _ensure_host_capacity(self, pages: int) -> None:
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

    # -- reading ---------------------------------------------------------------------------------
    def slots_for(self, page_idx: torch.Tensor, holes: bool = False) -> torch.Tensor:
        """Device slots of `[N, M]` logical pages (all >= 0: head groups never select a missing page); with `holes`
        (variable pages) -1 entries may appear and get slot 0, the all-zero null block."""
        if holes:
            return self.table.gather(1, page_idx.clamp(min=0)).masked_fill_(page_idx < 0, 0)
        return self.table.gather(1, page_idx)

    def check_resident(self, slots: torch.Tensor) -> None:
        """Raise instead of attending over the null block when a selected page is not on the device."""
        missing = slots == 0
        if bool(missing.any()):
            raise FlexiCacheError(
                f"{int(missing.sum())} selected pages are not resident on the device; this is a FlexiCache bug "
                "(please report it with your FlexiCacheConfig)."
            )

    def page_keys(self, pages: torch.Tensor, workspace=None) -> torch.Tensor:
        """Keys of logical pages `[N, C]` -> `[N, C, P, D]`, from the device where resident, else the host tier.

        For re-scoring selected candidates exactly (`FlexiCacheConfig.refine_pages`); tokens past the
        sequence's length in the page being filled are whatever the slot holds: mask them by position.
        With `workspace` (`kernels.GatherWorkspace`) the keys land in its reused "candidate_keys" buffer
        (`gather_pages`).
        """
        self.transfers.wait_promotions()
        slots = self.table.gather(1, pages)
        keys = gather_pages(self.k_pool, slots, workspace, "candidate_keys")
        self._fill_from_host(pages, slots, ((keys, self.host_k),))
        return keys

    def _fill_from_host(self, pages: torch.Tensor, slots: torch.Tensor, outs) -> None:
        """Where `slots` (of `pages [N, M]`, gathered into each `out [N, M, P, D]` of `outs`, pairs of (out, its host
        tier)) shows a full page not resident, write the page's host copy into `out` instead.

        Which pages those are is worked out on the host from one copy (one host sync on CUDA); then one
        `index_select` and one `index_copy_` per output, through flat row indices (advanced indexing with two index
        tensors on each side took ~1.6x as long: 1.43 vs 0.91 ms for 12 rows x 128 candidates)."""
        if not (self.tiered and self.host_pages):
            return
        host_pages, host_slots = to_host(pages, slots)
        with host_work:
            rows, cols = ((host_slots == 0) & (host_pages < self.host_pages)).nonzero(as_tuple=True)
            host_rows = host_pages[rows, cols] * self.rows + rows
            dst = rows * pages.shape[1] + cols
        if not host_rows.numel():
            return
        dst = to_device(dst, self.device)
        for out, host in outs:
            # Gathered into pinned memory once this store's offloads have landed (`PageTransfers.fetch`), so the copy to
            # the device does not make the host wait.
            found = self.transfers.fetch(host.view(-1, *host.shape[2:]), host_rows)
            out.view(-1, *out.shape[2:]).index_copy_(0, dst, found)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's K and V as `[B, heads, L, D]`, taken from the device where resident, else the host."""
        self.transfers.wait_promotions()  # the device pages read below may be a pending promotion's
        pages = self.num_pages
        slots = self.table[:, :pages]
        k = gather_pages(self.k_pool, slots)  # [N, Np, P, D], a copy
        v = gather_pages(self.v_pool, slots)
        every = torch.arange(pages, device=self.device).expand(self.rows, pages)
        self._fill_from_host(every, slots, ((k, self.host_k), (v, self.host_v)))
        k = k.view(self.batch, self.heads, pages * self.page_size, self.head_dim)[:, :, : self.length]
        v = v.view(self.batch, self.heads, pages * self.page_size, self.value_dim)[:, :, : self.length]
        return k, v

    def read_into(self, k_out: torch.Tensor, v_out: torch.Tensor, heads: torch.Tensor | None = None) -> int:
        """Write every token held into `k_out`/`v_out` (`[B, heads, >= L, D]` views, any strides; positions `[0, L)`);
        with `heads` (`[heads]`), into those heads of `[B, H, >= L, D]` tensors holding every head of the layer.

        A tiered store reads its full pages from the host tier (which holds them all; on CUDA through a device copy
        made on the side stream, started early by `start_read_back` where the cache could) and the page being
        filled from the device; an untiered store reads its pages from the device. Returns the bytes of the device
        copy it staged for this (0 when the host tier is host memory the device reads: a CPU run)."""
        p, length = self.page_size, self.length

        def put(out, lo, hi, src):  # src: [B, heads, hi - lo, D] (any strides)
            if heads is None:
                out[:, :, lo:hi].copy_(src)
            else:
                out[:, :, lo:hi].index_copy_(1, heads, src)

        if not self.tiered:
            pages = self.num_pages
            slots = self.table[:, :pages]
            for out, pool in ((k_out, self.k_pool), (v_out, self.v_pool)):
                gathered = gather_pages(pool, slots).view(self.batch, self.heads, pages * p, pool.shape[-1])
                put(out, 0, length, gathered[:, :, :length])
            return 0
        full, staged = self.full_pages, 0
        if full:
            host_k, host_v, staged = self._full_pages_for_read()
            for out, src in ((k_out, host_k), (v_out, host_v)):
                pages = src.view(full, self.batch, self.heads, p, src.shape[-1]).permute(1, 2, 0, 3, 4)  # [B, h, F, P, D]
                if heads is None:
                    out[:, :, : full * p].unflatten(2, (full, p)).copy_(pages)
                else:
                    out[:, :, : full * p].unflatten(2, (full, p)).index_copy_(1, heads, pages)
        if length > full * p:  # the page being filled is on the device
            slot = self.table[:, full]
            for out, pool in ((k_out, self.k_pool), (v_out, self.v_pool)):
                tail = pool[slot][:, : length - full * p]  # [N, r, D]
                put(out, full * p, length, tail.view(self.batch, self.heads, length - full * p, pool.shape[-1]))
        return staged

    def start_read_back(self) -> int:
        """Start the device copy of the host tier's full pages that the next `read_into` reads (CUDA: on the side
        stream, so it overlaps the compute issued meanwhile; nothing to do where the device reads host memory).
        Returns the device bytes it allocated."""
        if not (self.tiered and self.full_pages and self.transfers.streams is not None):
            return 0
        full = self.full_pages
        self._read_back = (full, self.transfers.read_back(self.host_k[:full], self.host_v[:full]))
        keys, values, _ = self._read_back[1]
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()

    def _full_pages_for_read(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(keys, values, staged bytes)`: the full pages `[F, N, P, D]` as the device can read them."""
        full = self.full_pages
        if self.transfers.streams is None:
            return self.host_k[:full], self.host_v[:full], 0
        started, self._read_back = self._read_back, None
        if started is None or started[0] != full:
            started = (full, self.transfers.read_back(self.host_k[:full], self.host_v[:full]))
        keys, values, done = started[1]
        self.transfers.wait_read_back(done)
        return keys, values, keys.numel() * keys.element_size() + values.numel() * values.element_size()

    # -- tier moves ------------------------------------------------------------------------------
    def promote(self, rows: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy host pages (row, page) into device slots `slots` (evicted slots being reused); the caller owns the table.

        `rows`, `pages` `[C]` are host tensors (the tier move's plan, `fc_hf.transfer.to_host`), `slots` `[C]` is on the
        device."""
        if rows.numel() == 0:
            return
        self.unshare()  # evicted slots are overwritten
        self.transfers.wait_offloads()
        with host_work:  # `rows` and `pages` are host tensors (the tier move's plan)
            host_index = pages * self.rows + rows
        self.transfers.promote(
            self.k_pool,
            self.v_pool,
            slots,
            self.host_k.view(-1, self.page_size, self.head_dim),
            self.host_v.view(-1, self.page_size, self.value_dim),
            host_index,
        )
        self.counters["pages_promoted"] += rows.numel()
        self.counters["bytes_promoted"] += rows.numel() * self.page_bytes

    # -- rollback (speculative decoding, `fc_hf/speculative.py`) -----------------------------------
    def mark(self) -> tuple:
        """What `restore` needs to put this store back as it is now, taken before a decode token while recording.

        Cheap: tensors are kept by reference. What later tokens write into them is either where no mark looks (past
        the mark's length: the page being filled, newly opened pages and their table columns, MinMax and host entries
        of pages filled since, free slots) or goes through `unshare` first (a tier move rewrites resident slots, the
        table and the free stack in place), and a grown tensor is a new one."""
        self._marked = True
        layout = None if self.row_layout is None else dict(self.row_layout)
        return (self.length, self.k_pool, self.v_pool, self.free, self.n_free, self.table, self.meta_t, self.page_means,
                self.host_k, self.host_v, self.host_pages, dict(self.counters), layout)

    def restore(self, mark: tuple) -> None:
        """Put back the state `mark` recorded: the tokens after it are gone, their pages' slots are back in the free
        stack where they were, their MinMax entries are zero again (as entries of pages not yet full always are)."""
        self.transfers.wait_promotions()  # a promotion issued since must not land in a pool read from now on
        (self.length, k_pool, v_pool, self.free, self.n_free, self.table, self.meta_t, self.page_means, self.host_k,
         self.host_v, self.host_pages, counters, layout) = mark
        self._set_pools(k_pool, v_pool)
        self.table[:, self.num_pages :] = 0  # pages opened since
        self.meta_t[:, :, self.full_pages * self.subpages :] = 0  # pages filled since
        if self.page_means is not None:
            self.page_means[:, self.full_pages :] = 0
        self.counters = dict(counters)
        self.row_layout = None if layout is None else dict(layout)
        self.table_changed()
        self._write_slots = self._read_back = None

    def drop_marks(self) -> None:
        """No mark refers to this store's tensors any more: tier moves write in place again."""
        self._marked = False

    def unshare(self) -> None:
        """Before rewriting the table, the free stack or resident slots in place: while a mark holds them, continue on
        copies, so the mark keeps what it saw (a stable head's tier move inside a verified block; rare and small)."""
        if not self._marked:
            return
        self.transfers.wait_promotions()
        self.ledger.transient(self.device_bytes())  # the marked pools live beside the copies until the marks go
        self._set_pools(self.k_pool.clone(), self.v_pool.clone())
        self.table, self.free = self.table.clone(), self.free.clone()
        self.table_changed()
        self._marked = False

    # -- batch reshuffles (beam search) ----------------------------------------------------------
    def row_map(self, batch_index: torch.Tensor) -> torch.Tensor:
        """Old row of every new row when new sequence i is old sequence `batch_index[i]`."""
        heads = torch.arange(self.heads, device=self.device)
        return (batch_index.to(self.device)[:, None] * self.heads + heads).reshape(-1)

    def select_rows(self, batch_index: torch.Tensor) -> torch.Tensor:
        """Keep/duplicate sequences: new sequence i is old sequence `batch_index[i]`; returns the row map.

        Duplicated sequences get their own copies of every resident page, so no slot is shared.
        """
        row_map = self.row_map(batch_index)
        self._repack(self.table[row_map], self.grow_pages * row_map.numel())
        self.meta_t = self.meta_t[row_map]
        if self.page_means is not None:
            self.page_means = self.page_means[row_map]
        if self.host_k is not None:
            self.transfers.sync_host()
            cpu_map = row_map.cpu()
            self.host_k = self.transfers.host_copy(self.host_k[:, cpu_map])  # host-tier memory again (pinned on CUDA)
            self.host_v = self.transfers.host_copy(self.host_v[:, cpu_map])
        self.batch = batch_index.numel()
        self.rows = self.batch * self.heads
        return row_map

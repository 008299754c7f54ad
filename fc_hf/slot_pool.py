"""The device tier of a paged store: slot pools, their free stack and the block table.

`k_pool`/`v_pool` are `[S, P, D]`; slot 0 is the shared all-zero null block, and `table[row, page]` is the page's slot,
or 0 when the page is not resident. Slots come from a free stack, so dropping and promoting pages never touches the
allocator; the pools grow when the stack runs dry and are repacked when a group gives memory back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import FlexiCacheError


def grow_dim(t: torch.Tensor, dim: int, new_size: int, fill=0) -> torch.Tensor:
    """`t` grown along `dim` to `new_size` (the new part filled with `fill`), a new tensor."""
    shape = list(t.shape)
    shape[dim] = new_size
    out = t.new_empty(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    out.narrow(dim, t.shape[dim], new_size - t.shape[dim]).fill_(fill)  # only the new part needs the fill
    return out


def gather_pages(pool: torch.Tensor, slots: torch.Tensor, workspace=None, name: str = "pages") -> torch.Tensor:
    """`pool[slots]` as `[*slots.shape, *pool.shape[1:]]` through one `index_select` (2-D advanced indexing is ~8x
    slower on a CPU); with `workspace` into its reused buffer `name`, valid until the next gather under that name."""
    flat = slots.reshape(-1)
    out = pool.index_select(0, flat) if workspace is None else workspace.gather(pool, flat, name)
    return out.view(*slots.shape, *pool.shape[1:])


@dataclass
class PoolMark:
    """The pool's state a mark keeps, by reference (`SlotPool.snapshot`)."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    free: torch.Tensor
    n_free: int
    table: torch.Tensor
    layout: dict | None


class SlotPool:
    """Device slots of `rows` rows of pages; `transfers` orders pool rewrites after promotions, `ledger` counts bytes."""

    def __init__(self, rows, page_size, head_dim, value_dim, dtype, device, transfers, ledger, grow_pages: int = 16):
        self.rows, self.device, self.transfers, self.ledger, self.grow_pages = rows, device, transfers, ledger, grow_pages
        self.k_pool = self.v_pool = None
        # Start with the null block only; appends grow it to what the prompt needs.
        self.set_pools(torch.zeros(1, page_size, head_dim, dtype=dtype, device=device),
                       torch.zeros(1, page_size, value_dim, dtype=dtype, device=device))
        self.free = torch.empty(0, dtype=torch.long, device=device)
        self.n_free = 0
        self.table = torch.zeros(rows, 0, dtype=torch.long, device=device)
        # Bumped on every write to `table`; caches of its entries (here and in `HeadGroup`) are keyed on it.
        self.table_version = 0
        self._write_slots: tuple | None = None  # (page, table_version, slots [N]) of the page being filled
        # Set by `arrange_rows`, cleared by any slot move it did not plan:
        # {"pages": the arranged pages [N, M], "width": slots per row, "used": positions filled per row}.
        self.row_layout: dict | None = None
        self.marked = False  # a mark holds the table, free stack and pools: copy them before rewriting (`unshare`)

    # -- sizes -------------------------------------------------------------------------------------
    def slots_in_use(self) -> int:
        return self.k_pool.shape[0] - 1 - self.n_free

    def device_bytes(self) -> int:
        return self.k_pool.numel() * self.k_pool.element_size() + self.v_pool.numel() * self.v_pool.element_size()

    def set_pools(self, k_pool: torch.Tensor | None, v_pool: torch.Tensor | None) -> None:
        """Make `k_pool`/`v_pool` the device tier (None: drop it), counted by the ledger."""
        old = 0 if self.k_pool is None else self.device_bytes()
        self.k_pool, self.v_pool = k_pool, v_pool
        self.ledger.resized(old, 0 if k_pool is None else self.device_bytes())

    def ensure_pages(self, pages: int, cap: int) -> None:
        """Room for `pages` pages per row in the table (grown to `cap` columns when short)."""
        if pages > self.table.shape[1]:
            self.table = grow_dim(self.table, 1, cap)

    # -- the block table -----------------------------------------------------------------------------
    def table_changed(self) -> None:
        """Call after writing `table` (anything that caches its entries re-reads them)."""
        self.table_version += 1

    def page_slots(self, page: int) -> torch.Tensor:
        """`table[:, page]` as a contiguous `[N]` tensor, read once per page (and again after a table write)."""
        cached = self._write_slots
        if cached is None or cached[0] != page or cached[1] != self.table_version:
            cached = (page, self.table_version, self.table[:, page].contiguous())
            self._write_slots = cached
        return cached[2]

    def slots_for(self, pages: torch.Tensor) -> torch.Tensor:
        """Device slots of `[N, M]` logical pages (0: not resident)."""
        return self.table.gather(1, pages)

    def check_resident(self, slots: torch.Tensor) -> None:
        """Raise instead of attending over the null block when a selected page is not on the device."""
        missing = slots == 0
        if bool(missing.any()):
            raise FlexiCacheError(
                f"{int(missing.sum())} selected pages are not resident on the device; this is a FlexiCache bug "
                "(please report it with your FlexiCacheConfig)."
            )

    def put(self, pages, slots: torch.Tensor) -> None:
        """`table[:, pages] = slots` (`[len(pages) * N]`, page-major, as `alloc` returns them)."""
        self.table[:, pages] = slots.view(-1, self.rows).t()
        self.table_changed()

    def drop(self, first: int, end: int) -> None:
        """Free the slots of the resident pages among `[first, end)` (their host copies stay)."""
        if end <= first:
            return
        slots = self.table[:, first:end]
        resident = slots[slots != 0]
        if resident.numel():
            self.transfers.wait_offloads()  # a dropped page's offload must have read its slot
            self.release(resident)
            self.table[:, first:end] = 0
            self.table_changed()

    # -- slots -------------------------------------------------------------------------------------
    def alloc(self, count: int, in_layout: bool = True) -> torch.Tensor:
        """`count` free slots (the pool grows if it must). `in_layout`: one page per row continues an arranged layout
        (`arrange_rows`) when the free stack's top is each row's next position; else the layout ends."""
        layout = self.row_layout
        if layout is not None:
            if in_layout and count == self.rows and layout["used"] < layout["width"]:
                layout["used"] += 1
            else:
                self.row_layout = None
        if count > self.n_free:
            # Spare pages per row: ~1.5% of what is held once this allocation is made (a prefill's pages
            # count too), at most `grow_pages`, so the allocation tracks the real size closely and
            # regrowth (a copy of the whole pool) stays rare.
            held = (self.slots_in_use() + count) // self.rows
            spare = min(self.grow_pages, max(1, held // 64))
            self._grow(count - self.n_free + spare * self.rows)
        self.n_free -= count
        return self.free[self.n_free : self.n_free + count].clone()

    def release(self, slots: torch.Tensor) -> None:
        """Return device slots to the free stack (their pages stay on the host)."""
        count = slots.numel()
        if count == 0:
            return
        self.unshare()  # the entries above the stack top may be a mark's
        self.row_layout = None
        if self.n_free + count > self.free.numel():
            self.free = grow_dim(self.free, 0, self.n_free + count)
        self.free[self.n_free : self.n_free + count] = slots.reshape(-1)
        self.n_free += count

    def _grow(self, extra: int) -> None:
        self.transfers.wait_promotions()  # a pending promotion writes into the pool being copied
        self.row_layout = None
        old = self.k_pool.shape[0]
        self.set_pools(grow_dim(self.k_pool, 0, old + extra), grow_dim(self.v_pool, 0, old + extra))
        # New slots go to the bottom of the stack so recently freed slots are reused first.
        self.free = torch.cat([torch.arange(old, old + extra, device=self.device), self.free[: self.n_free]])
        self.n_free += extra

    def compact(self, headroom_slots: int) -> None:
        """Shrink the pools to the resident pages plus `headroom_slots` once a tiered group dropped the pages outside
        its top-K (freed slots keep their allocation: without this device memory would not go down)."""
        self.unshare()  # the table is rewritten in place
        self.repack(self.table, headroom_slots)

    def repack(self, table: torch.Tensor, spare: int) -> None:
        """Copy the pages `table` points at into fresh pools of exactly those + `spare` free slots; `table` becomes
        the table. Each non-zero entry gets its own new slot, so a table whose rows share slots (duplicated beams)
        comes out with private copies."""
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
        self.set_pools(new_k, new_v)
        self.table = table
        self.table_changed()
        self.free = torch.arange(1 + count, 1 + count + spare, device=self.device).flip(0)
        self.n_free = spare

    def select_rows(self, row_map: torch.Tensor, spare: int) -> None:
        """Keep/duplicate rows: new row i is old row `row_map[i]`, every resident page copied (no shared slot)."""
        self.rows = row_map.numel()
        self.repack(self.table[row_map], spare)

    # -- pages read in place ----------------------------------------------------------------------------
    def arrange_rows(self, pages: torch.Tensor, headroom: int) -> None:
        """Make `pages [N, M]` (each row's, each once) the only resident pages, laid out row by row: `pages[r, j]` takes
        slot `1 + r * (M + headroom) + j`, and the free stack becomes each row's next positions, so the pages opened
        until the next ranking continue the rows. While that holds (`row_layout`; any other slot move clears it)
        `row_view` gives their K/V as views of the pools: one copy per ranking, no gather per step. The caller
        (`PagedKV.lay_out`) has read the pages' K/V before and writes them into their slots after; it has cleared the
        table entries of the pages resident before."""
        n, m = pages.shape
        width = m + headroom
        need = 1 + n * width
        if self.k_pool.shape[0] != need:
            self.set_pools(self.k_pool.new_zeros(need, *self.k_pool.shape[1:]),
                           self.v_pool.new_zeros(need, *self.v_pool.shape[1:]))
        base = 1 + torch.arange(n, device=self.device)[:, None] * width  # [N, 1]
        self.table.scatter_(1, pages, base + torch.arange(m, device=self.device))
        self.table_changed()
        # Stack top (the end) = position m of rows 0..N-1, below it position m + 1, ...
        self.free = (base.view(1, n) + torch.arange(width - 1, m - 1, -1, device=self.device)[:, None]).reshape(-1)
        self.n_free = self.free.numel()
        self.row_layout = {"pages": pages, "width": width, "used": m}

    def row_view(self, arranged: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(keys [N, m*P, D], values [N, m*P, Dv])` as views of the pools: the pages `arranged` (the tensor given to
        `arrange_rows`, by identity) followed by the pages opened since, in that order, when the layout still holds
        and they are `m` per row; else None (gather their slots instead)."""
        layout = self.row_layout
        if layout is None or layout["pages"] is not arranged or layout["used"] != m:
            return None
        n, width, p = arranged.shape[0], layout["width"], self.k_pool.shape[1]
        keys = self.k_pool[1:].view(n, width * p, -1)[:, : m * p]
        values = self.v_pool[1:].view(n, width * p, -1)[:, : m * p]
        return keys, values

    # -- marks (speculative decoding, `fc_hf/speculative.py`) ----------------------------------------------
    def snapshot(self) -> PoolMark:
        """The pools, free stack and table by reference; later writes go where no mark looks or through `unshare`."""
        self.marked = True
        layout = None if self.row_layout is None else dict(self.row_layout)
        return PoolMark(self.k_pool, self.v_pool, self.free, self.n_free, self.table, layout)

    def restore(self, mark: PoolMark, num_pages: int) -> None:
        """Back to `mark`, with the table entries of pages from `num_pages` on (opened since) cleared."""
        self.transfers.wait_promotions()  # a promotion issued since must not land in a pool read from now on
        self.set_pools(mark.k_pool, mark.v_pool)
        self.free, self.n_free, self.table = mark.free, mark.n_free, mark.table
        self.table[:, num_pages:] = 0
        self.row_layout = None if mark.layout is None else dict(mark.layout)
        self.table_changed()
        self._write_slots = None

    def unshare(self) -> None:
        """Before rewriting the table, the free stack or resident slots in place: while a mark holds them, continue on
        copies, so the mark keeps what it saw (a stable head's tier move inside a verified block; rare and small)."""
        if not self.marked:
            return
        self.transfers.wait_promotions()
        self.ledger.transient(self.device_bytes())  # the marked pools live beside the copies until the marks go
        self.set_pools(self.k_pool.clone(), self.v_pool.clone())
        self.table, self.free = self.table.clone(), self.free.clone()
        self.table_changed()
        self.marked = False

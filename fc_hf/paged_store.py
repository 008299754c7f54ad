"""Paged KV storage of one head group of one layer: the pages and their tiers, composed of three parts.

Rows: one row per (sequence, KV head of the group), row = b * heads + h. Every row holds the same number of tokens
(transformers pads on the left), so page `p` of every row covers tokens `[p*P, (p+1)*P)`.

- `pool` (`SlotPool`, slot_pool.py): the device tier, its free stack and the block table `[N, Pcap]`;
- `host` (`HostTier`, host_tier.py, tiered stores only): every full page, written once when it fills;
- `minmax` (`MinMaxCache`, minmax.py): per-channel key max/min of every full page, always on the device.

`PagedKV` writes tokens into them (a decode step's one token, a prompt's many, a stable group's prompt straight to the
host), reads pages back (refinement's candidate keys, every token for dense attention over a filled cache), and takes
marks of all three for speculative decoding's `crop`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from . import kernels
from .errors import FlexiCacheError
from .host_tier import HostMark, HostTier
from .ledger import DeviceLedger
from .minmax import MinMaxCache
from .slot_pool import PoolMark, SlotPool, gather_pages
from .transfer import PageTransfers, host_work, to_device, to_host

__all__ = ["PagedKV", "StoreMark", "gather_pages"]


@dataclass
class StoreMark:
    """What `PagedKV.restore` puts back: the length, the parts' snapshots and the copy counters."""

    length: int
    pool: PoolMark
    minmax: torch.Tensor
    host: HostMark | None
    counters: dict


class PagedKV:
    """Pages of `heads` KV heads for a batch of sequences; see the module docstring."""

    def __init__(self, batch: int, heads: int, page_size: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, tiered: bool, grow_pages: int = 16, subpages: int = 1, ledger=None):
        self.batch, self.heads, self.page_size = batch, heads, page_size
        self.head_dim, self.value_dim = head_dim, value_dim
        self.dtype, self.device, self.tiered = dtype, device, tiered
        self.rows = batch * heads
        self.grow_pages = grow_pages  # capacity added per growth, in pages per row
        self.length = 0
        self.transfers = PageTransfers(device)
        # Counts the device bytes of the pools (and the cache's peak).
        self.pool = SlotPool(self.rows, page_size, head_dim, value_dim, dtype, device, self.transfers,
                             ledger if ledger is not None else DeviceLedger(), grow_pages)
        self.minmax = MinMaxCache(self.rows, head_dim, page_size, subpages, dtype, device)
        self.host = HostTier(self.rows, page_size, head_dim, value_dim, dtype, self.transfers, grow_pages) if tiered \
            else None
        self.counters = {"pages_offloaded": 0, "bytes_offloaded": 0, "pages_promoted": 0, "bytes_promoted": 0}

    def __deepcopy__(self, memo):
        """An independent store: every tensor copied once its pending copies have landed, the host tier into new
        host memory of its own (pinned on CUDA), and transfers (streams, events, staging) of its own."""
        self.transfers.wait_promotions()
        new = PagedKV.__new__(PagedKV)
        memo[id(self)] = new
        memo[id(self.transfers)] = PageTransfers(self.device)  # the parts' copies share the new store's transfers
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    # -- sizes and the parts' tensors ------------------------------------------------------------------
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

    @property
    def k_pool(self) -> torch.Tensor:
        return self.pool.k_pool

    @property
    def v_pool(self) -> torch.Tensor:
        return self.pool.v_pool

    @property
    def table(self) -> torch.Tensor:
        return self.pool.table

    @property
    def meta(self) -> torch.Tensor:
        """`[N, Pcap * S, 2D]` view of the MinMax cache."""
        return self.minmax.meta

    def slots_in_use(self) -> int:
        return self.pool.slots_in_use()

    def slots_needed(self, new_tokens: int) -> int:
        """Device slots an append of `new_tokens` tokens would take from the free stack."""
        return (math.ceil((self.length + new_tokens) / self.page_size) - self.num_pages) * self.rows

    def device_bytes(self) -> int:
        return self.pool.device_bytes()

    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes()

    def metadata_bytes(self) -> int:
        return self.minmax.nbytes() + self.table.numel() * self.table.element_size()

    def free_device(self) -> None:
        """Drop the device tier (the cache is being released); the ledger stops counting it."""
        self.pool.set_pools(None, None)

    # -- writing ---------------------------------------------------------------------------------
    def _ensure_pages(self, pages: int) -> None:
        cap = pages + self.grow_pages
        self.pool.ensure_pages(pages, cap)
        self.minmax.ensure(pages, cap)

    def append(self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor | None = None,
               backend: str | None = None) -> None:
        """Append `[B, heads, T, D]` keys/values for every row.

        With `heads` (`[heads]`), `keys`/`values` hold every KV head of the layer (`[B, H, T, D]`) and this store's
        are taken from them (at a decode step in the append itself: one Triton launch on that backend)."""
        t, pool = keys.shape[2], self.pool
        if heads is not None and t > 1:
            keys, values, heads = keys.index_select(1, heads), values.index_select(1, heads), None
        start = self.length
        old_pages, old_full = self.num_pages, self.full_pages
        new_pages = math.ceil((start + t) / self.page_size)
        self._ensure_pages(new_pages)
        if new_pages > old_pages:
            pool.put(slice(old_pages, new_pages), pool.alloc((new_pages - old_pages) * self.rows))
        if t == 1:  # a decode step: one token per row, into the page being filled at offset `off`
            page, off = divmod(start, self.page_size)
            kernels.append_token(keys.select(2, 0), values.select(2, 0), heads, pool.page_slots(page), pool.k_pool,
                                 pool.v_pool, off, backend=backend)
        else:
            self._write(torch.arange(start, start + t, device=self.device), keys, values)
        self.length = start + t
        if self.full_pages > old_full:
            self._pages_filled(old_full, self.full_pages)

    def _write(self, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Tokens at positions `pos [T]` (their pages resident) from `keys`/`values` `[N or B x heads, T, D]`."""
        flat = (self.table[:, pos // self.page_size] * self.page_size + pos % self.page_size).reshape(-1)
        self.k_pool.view(-1, self.head_dim).index_copy_(0, flat, keys.reshape(-1, self.head_dim))
        self.v_pool.view(-1, self.value_dim).index_copy_(0, flat, values.reshape(-1, self.value_dim))

    def append_offloaded(self, keys: torch.Tensor, values: torch.Tensor, keep: int) -> None:
        """Append `[B, heads, T, D]` tokens to a tiered store, keeping on the device only the first `keep` pages (the
        attention sink) and the page being filled. Every page this append fills goes to the host tier (and its MinMax
        entries) from `keys`/`values` themselves, never taking a device slot, and the full pages resident before leave
        the device too: a prompt fed in chunks holds at most a chunk of a stable head on the device."""
        p, t, pool = self.page_size, keys.shape[2], self.pool
        pool.unshare()  # resident pages leave the table
        start, end = self.length, self.length + t
        old_full, old_pages = self.full_pages, self.num_pages
        full_end, pages_end = end // p, math.ceil(end / p)
        self._ensure_pages(pages_end)
        pool.drop(keep, old_full)  # before allocating, so the new pages reuse the slots
        stay = [q for q in range(old_pages, pages_end) if q < keep or (q == pages_end - 1 and end % p)]
        if stay:
            pool.put(stay, pool.alloc(len(stay) * self.rows))
        k_rows = keys.reshape(self.rows, t, self.head_dim)
        v_rows = values.reshape(self.rows, t, self.value_dim)
        # Tokens that land in device pages: the old page being filled, kept pages, the new page being filled.
        on_device = sorted(set(stay) | ({old_full} if start % p else set()))
        if on_device:
            pos = torch.cat([torch.arange(max(start, q * p), min(end, (q + 1) * p)) for q in on_device]).to(self.device)
            self._write(pos, k_rows.index_select(1, pos - start), v_rows.index_select(1, pos - start))
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
                pool.release(self.table[:, old_full])
                self.table[:, old_full] = 0
                pool.table_changed()
        self.length = end

    def _pages_filled(self, first: int, end: int, keys: torch.Tensor | None = None,
                      values: torch.Tensor | None = None) -> None:
        """Pages `[first, end)` just became full: write their MinMax entries and their host copies.

        Their keys and values (`[N, F, P, D]`) are read from the device pool unless given."""
        if keys is None:
            slots = self.table[:, first:end]  # [N, F]
            keys = gather_pages(self.k_pool, slots)  # [N, F, P, D]
            values = gather_pages(self.v_pool, slots) if self.tiered else None
        self.minmax.write(first, keys)
        if self.tiered:
            self.host.write(first, end, keys, values)
            n = (end - first) * self.rows
            self.counters["pages_offloaded"] += n
            self.counters["bytes_offloaded"] += n * self.page_bytes

    # -- reading ---------------------------------------------------------------------------------
    def slots_for(self, pages: torch.Tensor) -> torch.Tensor:
        """Device slots of `[N, M]` logical pages (all >= 0: head groups never select a missing page)."""
        return self.pool.slots_for(pages)

    def check_resident(self, slots: torch.Tensor) -> None:
        self.pool.check_resident(slots)

    def row_view(self, arranged: torch.Tensor, m: int):
        return self.pool.row_view(arranged, m)

    def page_keys(self, pages: torch.Tensor, workspace=None) -> torch.Tensor:
        """Keys of logical pages `[N, C]` -> `[N, C, P, D]` (device where resident, else host) for refinement; tokens
        past the length are whatever the slot holds (mask by position). With `workspace`: its "candidate_keys"."""
        self.transfers.wait_promotions()
        if self.tiered and self.transfers.streams is None and self.device.type == "cpu" and self.host.pages:
            return self._keys_from_host(pages, workspace)
        slots = self.table.gather(1, pages)
        keys = gather_pages(self.k_pool, slots, workspace, "candidate_keys")
        if self.tiered:
            self.host.fill(pages, slots, (keys,))
        return keys

    def _keys_from_host(self, pages: torch.Tensor, workspace=None) -> torch.Tensor:
        """`page_keys` where the host tier is the device's own memory (a CPU): every full page is read from the host
        tier, which holds them all, in one gather (not the resident ones from their slots and the rest written over
        them); the page being filled, which has no host copy, from its slot."""
        keys = self.host.full_page_keys(pages, workspace)
        (host_pages,) = to_host(pages)  # a no-op here; it keeps the index work counted as host work
        with host_work:
            r, c = (host_pages >= self.host.pages).nonzero(as_tuple=True)
        if r.numel():
            slots = self.table[r, pages[r, c]]
            keys.view(-1, self.page_size, self.head_dim).index_copy_(0, r * pages.shape[1] + c,
                                                                     self.k_pool.index_select(0, slots))
        return keys

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's K and V as `[B, heads, L, D]`, taken from the device where resident, else the host."""
        self.transfers.wait_promotions()  # the device pages read below may be a pending promotion's
        pages = self.num_pages
        slots = self.table[:, :pages]
        k = gather_pages(self.k_pool, slots)  # [N, Np, P, D], a copy
        v = gather_pages(self.v_pool, slots)
        if self.tiered:
            self.host.fill(torch.arange(pages, device=self.device).expand(self.rows, pages), slots, (k, v))
        k = k.view(self.batch, self.heads, pages * self.page_size, self.head_dim)[:, :, : self.length]
        v = v.view(self.batch, self.heads, pages * self.page_size, self.value_dim)[:, :, : self.length]
        return k, v

    def read_into(self, k_out: torch.Tensor, v_out: torch.Tensor, heads: torch.Tensor | None = None) -> int:
        """Write every token held into `k_out`/`v_out` (`[B, heads, >= L, D]` views, any strides; positions `[0, L)`);
        with `heads`, into those heads of tensors holding every head of the layer. A tiered store reads its full pages
        from the host tier (on CUDA through a device copy, started early by `start_read_back`), the page being filled
        from the device. Returns the bytes of the device copy it staged (0 on a CPU)."""
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
            host_k, host_v, staged = self.host.full_pages(full)
            for out, src in ((k_out, host_k), (v_out, host_v)):
                pages = src.view(full, self.batch, self.heads, p, src.shape[-1]).permute(1, 2, 0, 3, 4)  # [B, h, F, P, D]
                dst = out[:, :, : full * p].unflatten(2, (full, p))  # written through, not a copy of the pages first
                dst.copy_(pages) if heads is None else dst.index_copy_(1, heads, pages)
        if length > full * p:  # the page being filled is on the device
            slot = self.table[:, full]
            for out, pool in ((k_out, self.k_pool), (v_out, self.v_pool)):
                tail = pool[slot][:, : length - full * p]  # [N, r, D]
                put(out, full * p, length, tail.view(self.batch, self.heads, length - full * p, pool.shape[-1]))
        return staged

    def start_read_back(self) -> int:
        """Start the device copy of the host tier's full pages that the next `read_into` reads (see
        `HostTier.start_read_back`). Returns the device bytes it allocated."""
        return self.host.start_read_back(self.full_pages) if self.tiered else 0

    # -- tier moves ------------------------------------------------------------------------------
    def lay_out(self, pages: torch.Tensor, resident: torch.Tensor, headroom: int) -> int:
        """A tiered store's tier move on the PyTorch path: `pages [N, M]` (a ranking's) become the resident pages,
        laid out row by row (`SlotPool.arrange_rows`); the others among `resident [N, R]` (those resident now) drop
        out. Each page is copied once into its new slot, from its old slot (read out first: slots are reused) where
        resident, else straight from the host tier. `headroom`: free slots per row. Returns the pages promoted."""
        pool = self.pool
        self.transfers.wait_promotions()  # a pending promotion's pages are read below
        self.transfers.wait_offloads()  # the slots are rewritten: every offload must have read its page
        m = pages.shape[1]
        slots = pool.slots_for(pages)
        host_pages, host_slots = to_host(pages, slots)  # the plan: one host sync on CUDA
        with host_work:
            kept = host_slots != 0
            k_rows, k_cols = kept.nonzero(as_tuple=True)
            p_rows, p_cols = (~kept).nonzero(as_tuple=True)
            p_pages = host_pages[p_rows, p_cols]
            if p_pages.numel() and int(p_pages.max()) >= self.host.pages:
                raise FlexiCacheError("a selected page is neither on the device nor on the host; this is a FlexiCache "
                                      "bug (please report it with your FlexiCacheConfig).")
            k_src, k_at, p_at = host_slots[k_rows, k_cols], k_rows * m + k_cols, p_rows * m + p_cols
        k_src = to_device(k_src, self.device)
        kept_k, kept_v = self.k_pool.index_select(0, k_src), self.v_pool.index_select(0, k_src)  # copies
        pool.unshare()  # the pools and the table are rewritten in place
        pool.table.scatter_(1, resident, 0)
        pool.arrange_rows(pages, headroom)
        new_slots = pool.slots_for(pages).view(-1)  # each page's layout position, as `arrange_rows` wrote it
        k_dst = new_slots.index_select(0, to_device(k_at, self.device))
        self.k_pool.index_copy_(0, k_dst, kept_k)
        self.v_pool.index_copy_(0, k_dst, kept_v)
        promoted = p_pages.numel()
        if promoted:
            p_dst = new_slots.index_select(0, to_device(p_at, self.device))
            self.host.promote(self.k_pool, self.v_pool, p_rows, p_pages, p_dst)
        self.counters["pages_promoted"] += promoted
        self.counters["bytes_promoted"] += promoted * self.page_bytes
        return promoted

    def promote(self, rows: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy host pages (row, page) into device slots `slots` (evicted slots being reused); the caller owns the table.

        `rows`, `pages` `[C]` are host tensors (the tier move's plan, `fc_hf.transfer.to_host`), `slots` `[C]` is on the
        device."""
        if rows.numel() == 0:
            return
        self.pool.unshare()  # evicted slots are overwritten
        self.host.promote(self.k_pool, self.v_pool, rows, pages, slots)
        self.counters["pages_promoted"] += rows.numel()
        self.counters["bytes_promoted"] += rows.numel() * self.page_bytes

    # -- rollback (speculative decoding, `fc_hf/speculative.py`) -----------------------------------
    def mark(self) -> StoreMark:
        """What `restore` needs to put this store back as it is now, by reference: later writes go where no mark looks
        (past its length, free slots) or through `SlotPool.unshare` first (a tier move), and growth makes new tensors."""
        return StoreMark(self.length, self.pool.snapshot(), self.minmax.meta_t,
                         None if self.host is None else self.host.snapshot(), dict(self.counters))

    def restore(self, mark: StoreMark) -> None:
        """Put back the state `mark` recorded: the tokens after it are gone, their pages' slots are back in the free
        stack where they were, their MinMax entries are zero again (as entries of pages not yet full always are)."""
        self.length = mark.length
        self.pool.restore(mark.pool, self.num_pages)  # the table entries of pages opened since are cleared
        self.minmax.meta_t = mark.minmax
        self.minmax.clear_from(self.full_pages)  # pages filled since
        if self.host is not None:
            self.host.restore(mark.host)
        self.counters = dict(mark.counters)

    def drop_marks(self) -> None:
        """No mark refers to this store's tensors any more: tier moves write in place again."""
        self.pool.marked = False

    # -- batch reshuffles (beam search) ----------------------------------------------------------
    def select_rows(self, batch_index: torch.Tensor) -> torch.Tensor:
        """Keep/duplicate sequences: new sequence i is old sequence `batch_index[i]`; returns the row map.

        Duplicated sequences get their own copies of every resident page, so no slot is shared.
        """
        heads = torch.arange(self.heads, device=self.device)
        row_map = (batch_index.to(self.device)[:, None] * self.heads + heads).reshape(-1)
        self.pool.select_rows(row_map, self.grow_pages * row_map.numel())
        self.minmax.select_rows(row_map)
        if self.host is not None:
            self.host.select_rows(row_map)
        self.batch = batch_index.numel()
        self.rows = self.batch * self.heads
        return row_map

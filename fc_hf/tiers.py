"""Tier movement of a tiered (stable) head group: what is on the device after a re-rank.

After a ranking, the pages that stay keep their device slot, each newly selected page is copied
host -> device into the slot of a page that dropped out (no allocator churn), and slots left over
are freed. The first drop also shrinks the device pool (`SlotPool.compact`), so the memory saved is
given back. Which pages are chosen is `selection.py`'s business. On the PyTorch path, which reads
a group's pages in place, the tier move is `PagedKV.lay_out` instead: each selected page is copied
once, into its row's layout.
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .transfer import host_work, to_device, to_host


def move_tiers(store, old_pages: torch.Tensor, new_sel: torch.Tensor) -> int:
    """Make `new_sel [N, K]` the resident set of `store` (a `PagedKV`), whose resident pages are `old_pages [N, R]`.

    Copies only the promoted pages host -> device; returns how many were promoted. A row may gain pages (the first
    ranking after a prompt or a turn): promoted pages beyond the evicted slots take new slots (`kernels.promotion_plan`).
    """
    device, pool = store.device, store.pool
    old_slots = pool.slots_for(old_pages)
    # The plan (a few hundred indices) is worked out on the host from one copy: one host sync on CUDA per tier move,
    # not one per `nonzero` and check in it. The page being filled has no host copy yet; it is always selected, so it
    # is never evicted.
    host_old, host_slots, host_new = to_host(old_pages, old_slots, new_sel)
    with host_work:
        new_slots, p_rows, p_pages, p_slots, freed, n_rows, n_cols = kernels.promotion_plan(
            host_old, host_slots, host_new)
        if n_rows.numel():  # the first ranking after a prompt or a turn: more pages come in than leave
            p_rows, p_pages = torch.cat([p_rows, n_rows]), torch.cat([p_pages, host_new[n_rows, n_cols]])
    if freed.numel():
        store.transfers.wait_offloads()  # a dropped page's host copy must have landed
    # Rewrite the table: old entries out, new entries in (kept pages keep their slot, promoted pages
    # take an evicted page's slot, or a new one), then copy only the promoted pages host -> device.
    rows = torch.arange(store.rows, device=device)[:, None]
    pool.unshare()  # a mark (speculative decoding) keeps the table and slots as they were
    pool.table[rows.expand_as(old_pages), old_pages] = 0
    slots = to_device(new_slots, device)
    p_slots = to_device(p_slots, device)
    if n_rows.numel():
        fresh = pool.alloc(n_rows.numel(), in_layout=False)
        slots[to_device(n_rows, device), to_device(n_cols, device)] = fresh
        p_slots = torch.cat([p_slots, fresh])
    pool.table[rows.expand_as(new_sel), new_sel] = slots
    pool.table_changed()
    pool.release(to_device(freed, device))
    store.promote(p_rows, p_pages, p_slots)
    return int(p_rows.numel())


def compaction_headroom(store, rerank_interval: int) -> int:
    """Free device slots to keep after the first drop: the pages that can appear before the next ranking.

    Between re-ranks a group gains at most ceil(R / P) + 1 pages (+1 for the page being filled); a very
    long interval (permanent eviction) is capped at one growth step, since the pool grows on demand.
    """
    pages_between = min(math.ceil(rerank_interval / store.page_size) + 2, store.grow_pages)
    return pages_between * store.rows

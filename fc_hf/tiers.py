"""Tier movement of a tiered (stable) head group: what is on the device after a re-rank.

After a ranking, the pages that stay keep their device slot, each newly selected page is copied
host -> device into the slot of a page that dropped out (no allocator churn), and slots left over
are freed. The first drop also shrinks the device pool (`PagedKV.compact`), so the memory saved is
given back. Which pages are chosen is `selection.py`'s business.
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .transfer import host_work, to_device, to_host


def move_tiers(store, old_pages: torch.Tensor, new_sel: torch.Tensor, variable: bool = False) -> int:
    """Make `new_sel [N, K]` the resident set of `store`, whose resident pages are `old_pages [N, R]`.

    Copies only the promoted pages host -> device; returns how many were promoted. `variable` (`budget_mass`): both
    may hold -1 entries (no page), and a row may gain or lose pages: promoted pages beyond the evicted slots take new
    slots, evicted slots beyond the promoted pages are freed (`kernels.promotion_plan`).
    """
    device = store.device
    old_slots = store.slots_for(old_pages, holes=variable)
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
    store.unshare()  # a mark (speculative decoding) keeps the table and slots as they were
    if variable:  # only real entries are written (a -1 index would be the table's last column)
        old_ok, new_ok = old_pages >= 0, new_sel >= 0
        store.table[rows.expand_as(old_pages)[old_ok], old_pages[old_ok]] = 0
    else:
        store.table[rows.expand_as(old_pages), old_pages] = 0
    slots = to_device(new_slots, device)
    p_slots = to_device(p_slots, device)
    if n_rows.numel():
        fresh = store.alloc_slots(n_rows.numel())
        slots[to_device(n_rows, device), to_device(n_cols, device)] = fresh
        p_slots = torch.cat([p_slots, fresh])
    if variable:
        store.table[rows.expand_as(new_sel)[new_ok], new_sel[new_ok]] = slots[new_ok]
    else:
        store.table[rows.expand_as(new_sel), new_sel] = slots
    store.table_changed()
    store.release(to_device(freed, device))
    store.promote(p_rows, p_pages, p_slots)
    return int(p_rows.numel())


def compaction_headroom(store, rerank_interval: int) -> int:
    """Free device slots to keep after the first drop: the pages that can appear before the next ranking.

    Between re-ranks a group gains at most ceil(R / P) + 1 pages (+1 for the page being filled); a very
    long interval (permanent eviction) is capped at one growth step, since the pool grows on demand.
    """
    pages_between = min(math.ceil(rerank_interval / store.page_size) + 2, store.grow_pages)
    return pages_between * store.rows

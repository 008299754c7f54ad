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


def move_tiers(store, old_pages: torch.Tensor, new_sel: torch.Tensor) -> int:
    """Make `new_sel [N, K]` the resident set of `store`, whose resident pages are `old_pages [N, R]`.

    Copies only the promoted pages host -> device; returns how many were promoted.
    """
    old_slots = store.slots_for(old_pages)
    # The page being filled has no host copy yet; it is always selected, so it is never evicted.
    new_slots, p_rows, p_pages, p_slots, freed = kernels.promotion_plan(old_pages, old_slots, new_sel)
    if freed.numel():
        store.transfers.wait_offloads()  # a dropped page's host copy must have landed
    # Rewrite the table: old entries out, new entries in (kept pages keep their slot, promoted pages
    # take an evicted page's slot), then copy only the promoted pages host -> device.
    rows = torch.arange(store.rows, device=store.device)[:, None]
    store.table[rows.expand_as(old_pages), old_pages] = 0
    store.table[rows.expand_as(new_sel), new_sel] = new_slots
    store.table_changed()
    store.release(freed)
    store.promote(p_rows, p_pages, p_slots)
    return int(p_rows.numel())


def compaction_headroom(store, rerank_interval: int) -> int:
    """Free device slots to keep after the first drop: the pages that can appear before the next ranking.

    Between re-ranks a group gains at most ceil(R / P) + 1 pages (+1 for the page being filled); a very
    long interval (permanent eviction) is capped at one growth step, since the pool grows on demand.
    """
    pages_between = min(math.ceil(rerank_interval / store.page_size) + 2, store.grow_pages)
    return pages_between * store.rows

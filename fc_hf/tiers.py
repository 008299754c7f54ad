"""The tier move of stable rows that ranked: their windows (device tier) take their new pages from the host tier.

Planned on the device in fixed shapes (a padded place is a row that writes into the stable tensors' extra row), so a
step with a ranking is the same launches as any other. A window's positions `[0, K - 1)` take the ranking's pages other
than the page being filled, position `K - 1` the page being filled, and the later positions the pages it will open
before its next ranking. Pages newly resident are counted (`promoted`); on a CPU every page is copied from the host
tier (host memory is the device's own); the Triton path reads the pages already in the window from the device.
"""

from __future__ import annotations

import torch

from .kernels import dispatch as kernels


def move_windows(store, local: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, page: torch.Tensor,
                 promoted: torch.Tensor) -> None:
    """Make `pages [n, K]` (a ranking's, the page being filled `page` among them) the windows of the stable rows at
    `local [n]` (indices among the stable rows; the extra row for a padded place), whose rows are `rows [n]`; add the
    pages not resident before to `promoted` (a device counter)."""
    k, p = store.cfg.pages_per_head, store.page_size
    n_stable = store.rows.n_stable
    if pages.shape[1] < k:  # a capacity of fewer than K pages: the other places hold pages past it (none)
        filler = torch.arange(store.pages, store.pages + k - pages.shape[1], device=pages.device)
        pages = torch.cat([pages, filler.expand(pages.shape[0], -1)], dim=1)
    # In page order (a window's content does not depend on the order a ranking found its pages in), the page being
    # filled last among the ranked pages (`pages[:, K-1]`), where its later tokens are written.
    pages = pages.sort(dim=1).values
    pages = torch.where(pages == page, pages[:, k - 1 :], pages)
    pages[:, k - 1] = page
    present = pages <= page  # a ranking may fill up with pages that do not exist yet: none
    old = store.win_pages.index_select(0, local)
    resident = (pages[:, :, None] == old[:, None, :]).any(-1)
    if store.host_tier:  # without a host tier (offload off) a window is filled from device memory: no promotion
        promoted.add_((present & ~resident & (local < n_stable)[:, None]).sum())
    source = (rows[:, None] * store.pages + torch.where(present, pages, 0)).view(-1)
    n = local.numel()
    backend = store.cfg.backend
    keys = kernels.gather_pages(store.full_k.view(-1, p, store.head_dim), source, backend=backend).view(n, k * p, -1)
    values = kernels.gather_pages(store.full_v.view(-1, p, store.value_dim), source, backend=backend).view(n, k * p, -1)
    store.win_k[:, : k * p].index_copy_(0, local, keys)
    store.win_v[:, : k * p].index_copy_(0, local, values)
    later = page + store.later_pages  # the pages it will open, at positions K, K + 1, ...
    store.win_pages.index_copy_(0, local, torch.cat([torch.where(present, pages, -1), later.expand(n, -1)], dim=1))
    store.win_shift.index_copy_(0, local, store.win_base.index_select(0, local) + (k - 1 - page) * p)
    store.window_tokens(local)

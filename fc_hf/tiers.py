"""The tier move of stable rows that ranked: their windows (device tier) take their new pages from the host tier.

Planned on the device in fixed shapes (a padded place is a row that writes into the stable tensors' extra row), so a
step with a ranking is the same launches as any other. A window's positions `[0, K - 1)` take the ranking's pages other
than the page being filled, position `K - 1` the page being filled, and the later positions the pages it will open
before its next ranking. Pages newly resident are counted (`promoted`); on a CPU every page is copied from the host
tier (host memory is the device's own). On the Triton backend a move is one launch (`flexicache::move_windows`, the
same writes).

`plan_windows` (what a ranking makes of a window), `newly_resident` (what it promotes), `window_pages_of` (a
window's tokens read from the full tier) and `install_windows` (a window made a row's) are shared with a verification
block's moves (`fc_hf/block.py`); `fill_later_pages` fills the pages opened since a ranking (`profile="auto"`'s
re-split, `fc_hf/online.py`); `refill_windows` reads windows back after a crop (`fc_hf/verify.py`). Every write of a
window other than a decode token's goes through here.
"""

from __future__ import annotations

import torch

from .kernels import dispatch as kernels
from .rows import page_index


def plan_windows(store, pages: torch.Tensor, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The windows a ranking's `pages [n, K]` make, the page being filled `page` (a scalar, or one per ranking `[n]`)
    among them: `(window [n, W]` (the page at each position, -1 for none), `source [n, K]` (the pages the first K
    positions read, 0 for none), `present [n, K])`."""
    k = store.cfg.pages_per_head
    at = page.view(-1, 1) if page.dim() else page
    if pages.shape[1] < k:  # a capacity of fewer than K pages: the other places hold pages past it (none)
        filler = torch.arange(store.pages, store.pages + k - pages.shape[1], device=pages.device)
        pages = torch.cat([pages, filler.expand(pages.shape[0], -1)], dim=1)
    # In page order (a window's content does not depend on the order a ranking found its pages in), the page being
    # filled last among the ranked pages (`pages[:, K-1]`), where its later tokens are written.
    pages = pages.sort(dim=1).values
    pages = torch.where(pages == at, pages[:, k - 1 :], pages)
    pages[:, k - 1] = page
    present = pages <= at  # a ranking may fill up with pages that do not exist yet: none
    later = at + store.later_pages  # the pages it will open, at positions K, K + 1, ...
    window = torch.cat([torch.where(present, pages, store.no_page), later.expand(pages.shape[0], -1)], dim=1)
    return window, pages * present, present  # (a device constant, a product: no scalar tensor made per call)


def newly_resident(window: torch.Tensor, old: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """`[n, K]` bool: the present pages of new windows `window [n, W]` that the old windows `old [n, W]` did not hold."""
    k = present.shape[1]
    return present > (window[:, :k, None] == old[:, None, :]).any(-1)  # present and not held (`>` on bools: one op)


def window_pages_of(store, rows: torch.Tensor, window: torch.Tensor, tier: torch.Tensor) -> torch.Tensor:
    """The tokens of windows `window [n, W]` of rows `rows [n]` read from the full tier `tier` (`full_k` or `full_v`):
    `[n, W * P, D]`; a position without a page (or past the capacity) reads page 0 (its tokens are masked)."""
    p = store.page_size
    page = torch.where((window >= 0) & (window < store.pages), window, 0)
    source = page_index(rows[:, None], page, store.pages).view(-1)
    return kernels.gather_pages(tier.view(-1, p, tier.shape[-1]), source,
                                backend=store.cfg.backend).view(rows.numel(), -1, tier.shape[-1])


def move_windows(store, local: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, page: torch.Tensor,
                 promoted: torch.Tensor, span: tuple[int, int] | None = None) -> None:
    """Make `pages [n, K]` (a ranking's, the page being filled `page` among them) the windows of the stable rows at
    `local [n]` (indices among the stable rows; the extra row for a padded place), whose rows are `rows [n]`; add the
    pages not resident before to `promoted` (a device counter). `span`: `local` is the stable rows `[start, end)`,
    known on the host (an eager step)."""
    k, p = store.cfg.pages_per_head, store.page_size
    if fused := kernels.fused(pages, store.cfg.backend):  # all of the below in one call
        kernels.move_windows(pages, page, local, rows, store.full_k, store.full_v, store.win_k, store.win_v,
                             store.win_pages, store.win_shift, store.win_base, store.win_bias_rows,
                             store.rows.stable_batch, promoted, store.pages, k, store.host_tier, backend=fused)
        return
    window, source, present = plan_windows(store, pages, page)
    if store.host_tier:  # without a host tier (offload off) a window is filled from device memory: no promotion
        fresh = newly_resident(window, store.win_pages.index_select(0, local), present)
        promoted.add_((fresh if span is not None else fresh & (local < store.rows.n_stable)[:, None]).sum())
    n = local.numel()
    at = page_index(rows[:, None], source, store.pages).view(-1)
    backend = store.cfg.backend
    for tier, win in ((store.full_k, store.win_k), (store.full_v, store.win_v)):
        pages_of = tier.view(-1, p, tier.shape[-1])
        if span is not None and store.device.type == "cpu" and not torch.compiler.is_compiling():
            # Straight into each window (a window's first K pages are contiguous): one pass over the bytes, not a
            # gather then a scatter (3-4x faster on a CPU); a launch per row, so not on an accelerator, and not traced
            # (the loop would fix the count of stable rows, which depends on the batch size, in the graph).
            for i, j in enumerate(range(*span)):
                torch.index_select(pages_of, 0, at[i * k : (i + 1) * k], out=win[j, : k * p].view(k, p, -1))
        else:
            win[:, : k * p].index_copy_(0, local, kernels.gather_pages(pages_of, at, backend=backend).view(n, k * p, -1))
    base = store.win_base[span[0] : span[1]] if span is not None else store.win_base.index_select(0, local)
    install_windows(store, local, window, torch.add(base, k - 1 - page, alpha=p),
                    seq=None if span is None else store.rows.stable_batch[span[0] : span[1]])


def install_windows(store, local: torch.Tensor, window: torch.Tensor, shift: torch.Tensor, keys=None, values=None,
                    seq: torch.Tensor | None = None) -> None:
    """Make `window [n, W]` (the page at each position) the windows of the stable rows `local [n]`, with write shifts
    `shift [n]`; their tokens `keys`/`values [n, W * P, D]` where given (else the caller wrote them). `seq`: the rows'
    sequences, where the caller has them."""
    if keys is not None:
        store.win_k.index_copy_(0, local, keys)
        store.win_v.index_copy_(0, local, values)
    store.win_pages.index_copy_(0, local, window)
    store.win_shift.index_copy_(0, local, shift)
    store.window_tokens(local, window, seq)


def refill_windows(store, local: torch.Tensor) -> None:
    """The windows of stable rows `local` read again from the full tier by their `win_pages` (a crop's restore: the
    tokens a window holds are the full tier's)."""
    window = store.win_pages.index_select(0, local)
    rows = store.rows.stable.index_select(0, local)
    store.window_tokens(local, window)
    store.win_k.index_copy_(0, local, window_pages_of(store, rows, window, store.full_k))
    store.win_v.index_copy_(0, local, window_pages_of(store, rows, window, store.full_v))


def fill_later_pages(store, length: int) -> None:
    """Copy into each stable row's window the tokens (of the first `length`) of the pages opened since its ranking
    (positions K, K + 1, ...)."""
    k, p, n_s = store.cfg.pages_per_head, store.page_size, store.rows.n_stable
    later = store.win_pages[:n_s, k:]  # [N_S, W - K]
    window = torch.where(later * p < length, later, store.no_page)  # a page not opened yet: none (its tokens masked)
    for full, win in ((store.full_k, store.win_k), (store.full_v, store.win_v)):
        win[:n_s, k * p :] = window_pages_of(store, store.rows.stable, window, full)

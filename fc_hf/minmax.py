"""The MinMax cache of a paged store: per-channel key maxima and minima of every full page, the page scores' input.

`meta[row, page * S + s] = [kmax, kmin]` of sub-page `s` (`S = FlexiCacheConfig.subpages`, 2 by default at an even page
size; 1 = the authors' one entry per page), written when the page fills, always on the device and never offloaded; the
entries of pages not yet full are zero. It is stored channel-major (`meta_t`, `[N, 2D, Pcap * S]`) and handed out as
a transposed view: scoring reads it as the right-hand side of a matmul, ~30% faster on a CPU in that layout, while
pages are written only once.
"""

from __future__ import annotations

import torch

from .slot_pool import grow_dim


class MinMaxCache:
    """MinMax entries of `rows` rows of pages; see the module docstring."""

    def __init__(self, rows: int, head_dim: int, page_size: int, subpages: int, dtype, device):
        self.page_size, self.subpages = page_size, subpages
        self.meta_t = torch.zeros(rows, 2 * head_dim, 0, dtype=dtype, device=device)

    @property
    def meta(self) -> torch.Tensor:
        """`[N, Pcap * S, 2D]` view (kmax, kmin per sub-page)."""
        return self.meta_t.transpose(1, 2)

    def nbytes(self) -> int:
        return self.meta_t.numel() * self.meta_t.element_size()

    def ensure(self, pages: int, cap: int) -> None:
        """Room for `pages` pages per row (grown to `cap` pages when short)."""
        if pages * self.subpages > self.meta_t.shape[2]:
            self.meta_t = grow_dim(self.meta_t, 2, cap * self.subpages)

    def write(self, first: int, keys: torch.Tensor) -> None:
        """The entries of pages `first, first + 1, ...` from their keys `[N, F, P, D]`."""
        s, f = self.subpages, keys.shape[1]
        sub = keys.reshape(keys.shape[0], f * s, self.page_size // s, keys.shape[-1])
        self.meta_t[:, :, first * s : (first + f) * s] = torch.cat([sub.amax(dim=2), sub.amin(dim=2)], -1).transpose(1, 2)

    def clear_from(self, full: int) -> None:
        """Zero the entries of pages `full, ...` (after a mark's restore: pages filled since are not full any more)."""
        self.meta_t[:, :, full * self.subpages :] = 0

    def select_rows(self, row_map: torch.Tensor) -> None:
        self.meta_t = self.meta_t[row_map]

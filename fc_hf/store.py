"""The preallocated tensors of one FlexiCache layer: every token's K/V, the stable rows' windows, the MinMax cache.

Shapes are fixed by the capacity (`capacity` tokens, `pages = capacity / P` pages per row) and never change during a
decode step, so a step compiles once and replays (CUDA graphs); they change only outside it (`grow`, a batch change).
Rows are `b * H + h` (the model's order); N = B * H, N_S the stable rows.

- `full_k/full_v [N, capacity, D]`: every token of every row, written as it comes (a prompt's tokens, each decode
  token). For the ranked-every-step (unstable) and streaming rows this is their device tier. For stable rows it is the
  host tier: every page, written once, read back when a ranking promotes a page or a prompt on a filled cache attends
  over it. On a CPU this is one allocation (host memory is the device's own); `tier_bytes` splits it by row kind.
  On CUDA with offload on it is pinned host memory mapped into the device (`fc_hf/host_memory.py`), and the rows
  whose every page stays on the device (unstable, streaming) keep theirs apart as well:
- `near_k/near_v [N_E + N_X, capacity, D]` (`near_apart`): those rows' tokens in device memory, read by their
  attention and refinement (`RowIndex.near`; `near_index [N]` a row's place there). Without the split they are the
  full tier itself and `near_index` is the row.
- `win_k/win_v [N_S + 1, W * P, D]`: a stable row's window, its device tier: positions `[0, K - 1)` hold the pages of
  its last ranking other than the page then being filled, position `K - 1 + i` the page being filled at that ranking
  plus `i` (the pages opened since, `W = K + ceil(R / P) + 1` positions). The extra last row takes the writes of the
  other rows, so a write over all rows needs no pick of the stable ones.
- `meta [N, 2D, pages * S]`: per sub-page the channel max then min of its keys (channel-major: the scoring matmul's
  right-hand side), its rows kind by kind (`RowIndex.kind_order`: unstable, stable, streaming), so the rows an eager
  step ranks (the unstable rows and a phase's stable rows) are one or two views, scored without a copy
  (`minmax_views`). An entry is exact once its sub-page is full; the page being filled is always selected, so its
  entries are never read before.
- `length_t` (a device tensor: a decode step changes no Python number) and `length`, its host mirror, kept where the
  host drives the writes (prompts, eager decode steps).

Window bookkeeping of each stable row (rewritten by a ranking, `fc_hf/tiers.py`): `win_pages [N_S + 1, W]` the page
at each window position (-1: none), `win_shift [N_S + 1]` the flat window index of position 0 of the page being filled
minus its first token's position (a token at position `pos` of the page being filled or a later one goes to
`win_shift + pos`), `win_bias_rows [N_S + 1, W]` each window page's row in a step's token bias (`StepBias.page_rows`).
"""

from __future__ import annotations

import copy
import functools
import math

import torch
from transformers.utils import logging

from .host_memory import mapped_host_zeros
from .kernels import dispatch as kernels
from .rows import HeadKinds, RowIndex, page_index

logger = logging.get_logger(__name__)


def window_pages(cfg, capacity_pages: int) -> int:
    """W: window positions of a stable row: its K - 1 ranked pages, the page being filled at its ranking and the pages
    opened before its next ranking (at most R steps later; capped by the capacity for a very long interval)."""
    return cfg.pages_per_head + min(math.ceil(cfg.rerank_interval / cfg.page_size) + 1, capacity_pages)


@functools.cache
def _warn_no_host_tier(device: torch.device) -> None:
    logger.warning(
        "FlexiCache on %s keeps the stable heads' full tier in device memory (pinned host memory is mapped into CUDA "
        "devices only, and here it was not), so its device KV is dense's plus the windows; memory reports count it "
        "as device memory. The CPU path and the accounting by role are unaffected; see docs/gpu.md.", device.type)


def mark_static(*holders) -> None:
    """Mark the tensors `holders` hold (their attributes) as static addresses: a compiled decode step reads and writes
    them in place, and CUDA graphs (generate's reduce-overhead compile) take such inputs as they are rather than copying
    them in at every replay or, for the ones it writes, skipping the graph (transformers' `StaticLayer` marks its K/V
    so). Called wherever they are made (outside a decode step)."""
    if torch.compiler.is_compiling():
        return
    for holder in holders:
        for value in vars(holder).values():
            if type(value) is torch.Tensor:
                torch._dynamo.mark_static_address(value)


class PageStore:
    """One layer's tensors (see the module docstring)."""

    # Tests set this to keep the near rows apart on a CPU as on a GPU (the full tier then plays the mapped host memory).
    split_on_cpu = False

    def __init__(self, kinds: HeadKinds, cfg, batch: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int, host_tier: bool):
        self.kinds, self.cfg = kinds, cfg
        self.batch, self.heads = batch, kinds.num_heads
        self.head_dim, self.value_dim, self.dtype, self.device = head_dim, value_dim, dtype, torch.device(device)
        self.page_size, self.subpages = cfg.page_size, cfg.subpages
        self.host_tier = host_tier  # stable rows' full tier counts as host memory (offload on)
        self.rows = RowIndex(kinds, batch, self.device)
        self.n = self.rows.rows
        self._held = 0  # the host's count of tokens per row (`length`)
        self.length_t = torch.zeros((), dtype=torch.long, device=self.device)  # the device's count
        self.traced = False  # a compiled decode step was traced on this store (`length`)
        self.capacity = 0
        self.full_k = self.full_v = self.meta = self.near_k = self.near_v = None
        self.full_mapped = False  # the full tier is mapped host memory (CUDA)
        self._allocate(capacity)
        if host_tier and self.full_tier_on_accelerator:
            _warn_no_host_tier(self.device)
        n_s = self.rows.n_stable
        self.window = window_pages(cfg, self.capacity // self.page_size) if n_s else 0  # no stable row: no window
        wp = self.window * self.page_size
        self.win_k = torch.zeros(n_s + 1, wp, head_dim, dtype=dtype, device=self.device)
        self.win_v = torch.zeros(n_s + 1, wp, value_dim, dtype=dtype, device=self.device)
        self.win_pages = torch.full((n_s + 1, self.window), -1, dtype=torch.long, device=self.device)
        self.win_shift = torch.zeros(n_s + 1, dtype=torch.long, device=self.device)
        # Each window page's row in a step's token bias (`StepBias.page_rows`), from `win_pages` (`window_tokens`).
        self.win_bias_rows = torch.zeros(n_s + 1, self.window, dtype=torch.long, device=self.device)
        # Flat index of each stable row's position 0 in `win_k.view(-1, D)`.
        self.win_base = torch.arange(n_s + 1, device=self.device) * wp
        # Pages a window's positions K, K + 1, ... hold, after the page being filled at its ranking.
        self.later_pages = torch.arange(1, max(1, self.window - cfg.pages_per_head + 1), device=self.device)
        self.no_page = torch.full((), -1, dtype=torch.long, device=self.device)  # a window place without a page

    # -- sizes ----------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens held per row, as a host number: the host's own count while it drove every write. A compiled decode
        step advances only the device's count (`length_t`), so once one was traced the device's is read (a sync: only
        outside decode steps, and in eager steps of such a cache). Every host write sets both."""
        return int(self.length_t) if self.traced else self._held

    @length.setter
    def length(self, held: int) -> None:
        self._held = held

    def hold(self, length: int) -> None:
        """Hold `length` tokens per row from now on, in both counts (the host's and the device's): a write the host
        drives that does not advance `length_t` itself."""
        self._held = length
        self.length_t.fill_(length)

    @property
    def pages(self) -> int:
        """Pages per row the capacity holds."""
        return self.capacity // self.page_size

    @property
    def num_pages(self) -> int:
        return -(-self.length // self.page_size)

    @property
    def page_bytes(self) -> int:
        return self.page_size * (self.head_dim + self.value_dim) * self.dtype.itemsize

    def tier_bytes(self) -> dict[str, int]:
        """Bytes allocated: `device` (unstable and streaming rows' pages, the windows), `host` (stable rows' pages, the
        host tier; on the device when offload is off), `metadata` (MinMax and window bookkeeping)."""
        per_row = self.capacity * (self.head_dim + self.value_dim) * self.dtype.itemsize
        stable = self.rows.n_stable * per_row
        windows = (self.win_k.numel() + self.win_v.numel()) * self.dtype.itemsize
        metadata = self.meta.numel() * self.meta.element_size() + sum(
            t.numel() * t.element_size() for t in (self.win_pages, self.win_shift))
        if self.near_apart:  # the full tier holds every row in host memory; the near rows are on the device too
            return {"device": self.rows.n_near * per_row + windows, "host": self.n * per_row, "metadata": metadata}
        host = self.host_tier and not self.full_tier_on_accelerator
        device = (self.n * per_row - stable) + windows + (0 if host else stable)
        return {"device": device, "host": stable if host else 0, "metadata": metadata}

    @property
    def full_tier_on_accelerator(self) -> bool:
        """The stable rows' full tier sits in the accelerator's own memory: on an accelerator whose host memory could not
        be mapped (not CUDA, or the mapping failed), where it is counted as device memory. On a CPU host memory is the
        device's own, and the split is by role (what a deployment keeps where)."""
        return self.device.type not in ("cpu", "meta") and not self.full_mapped

    @property
    def near_apart(self) -> bool:
        """The near rows (unstable, streaming) keep their tokens apart from the full tier, in device memory (see the
        module docstring)."""
        return bool(self.host_tier and self.rows.n_stable and self.rows.n_near) and (
            self.full_mapped or (self.split_on_cpu and self.device.type == "cpu"))

    # -- allocation -----------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        """Tensors for `capacity` tokens per row, the tokens held so far copied over."""
        p, s, d, dv = self.page_size, self.subpages, self.head_dim, self.value_dim
        capacity = -(-capacity // p) * p
        old = (self.full_k, self.full_v, self.meta, self.near_k, self.near_v)
        was_apart = self.near_apart
        self.full_mapped = bool(self.host_tier and self.rows.n_stable and self.device.type == "cuda")
        self.full_k = self._full((self.n, capacity, d))
        self.full_v = self._full((self.n, capacity, dv))
        self.meta = torch.zeros(self.n, 2 * d, capacity // p * s, dtype=self.dtype, device=self.device)
        self._near_tier(capacity)
        if old[0] is not None and self.length:
            held = self.length
            self.full_k[:, :held] = old[0][:, :held]
            self.full_v[:, :held] = old[1][:, :held]
            entries = -(-held // p) * s
            self.meta[:, :, :entries] = old[2][:, :, :entries]
            if self.near_apart:
                near = slice(None) if was_apart else self.rows.near
                self.near_k[:, :held] = old[3][near, :held]
                self.near_v[:, :held] = old[4][near, :held]
        self.capacity = capacity

    def _full(self, shape) -> torch.Tensor:
        """A full-tier tensor: mapped pinned host memory where `full_mapped` asks for it (else it turns off)."""
        if self.full_mapped:
            mapped = mapped_host_zeros(shape, self.dtype, self.device)
            if mapped is not None:
                return mapped
            self.full_mapped = False
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _near_tier(self, capacity: int) -> None:
        """`near_k/near_v` and `near_index` for the current rows (views of the full tier unless `near_apart`)."""
        if self.near_apart:
            shape = (self.rows.n_near, capacity)
            self.near_k = torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=self.device)
            self.near_v = torch.zeros(*shape, self.value_dim, dtype=self.dtype, device=self.device)
        self._link_near()

    def _link_near(self) -> None:
        """`near_index` for the current rows; without the split the near tier is the full tier itself."""
        if self.near_apart:
            self.near_index = self.rows.near_place
        else:
            self.near_k, self.near_v = self.full_k, self.full_v
            self.near_index = torch.arange(self.n, device=self.device)

    def __deepcopy__(self, memo):
        """An independent copy (a prefilled cache copied per question) whose full tier stays in the memory the
        original's is in. Mapped host memory is a CUDA tensor to torch: a plain deepcopy would copy the whole host tier
        into device memory. Where the copy cannot be mapped it is in device memory, as a new cache's would be."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        if self.full_mapped:  # `_full` allocates as the original was allocated (and turns `full_mapped` off if it fails)
            new.__dict__.update(full_mapped=True, dtype=self.dtype, device=self.device)
            for old in (self.full_k, self.full_v):
                memo[id(old)] = new._full(old.shape).copy_(old)  # the near tier is this very tensor where not apart
        for key, value in self.__dict__.items():
            if key not in new.__dict__:
                new.__dict__[key] = copy.deepcopy(value, memo)
        if not new.full_mapped and self.full_mapped:  # no separate near tier without mapped host memory
            new._link_near()
        return new

    def grow(self, capacity: int) -> None:
        """Room for `capacity` tokens per row (outside a decode step: it makes new tensors)."""
        if capacity > self.capacity:
            self._allocate(capacity)
            window = window_pages(self.cfg, self.pages) if self.rows.n_stable else 0
            if window != self.window:  # a very long re-rank interval: the window holds every page opened since
                self._widen_windows(window)
            self.window_tokens()  # the token bias has a row per page: its indices move

    def _widen_windows(self, window: int) -> None:
        wp, old_wp = window * self.page_size, self.window * self.page_size
        shift = self.win_shift - self.win_base
        for name in ("win_k", "win_v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], wp, old.shape[2])
            new[:, :old_wp] = old
            setattr(self, name, new)
        pages = self.win_pages.new_full((self.win_pages.shape[0], window), -1)
        pages[:, : self.window] = self.win_pages
        k = self.cfg.pages_per_head
        anchor = self.win_pages[:, k - 1 : k]  # the page being filled at each row's ranking (-1: never ranked)
        later = anchor + torch.arange(self.window - k + 1, window - k + 1, device=self.device)
        pages[:, self.window :] = torch.where(anchor >= 0, later, -1)
        self.win_pages, self.window = pages, window
        self.later_pages = torch.arange(1, window - k + 1, device=self.device)
        self.win_bias_rows = self.win_bias_rows.new_zeros(self.win_bias_rows.shape[0], window)
        self.win_base = torch.arange(self.win_k.shape[0], device=self.device) * wp
        self.win_shift = self.win_base + shift

    # -- writing ----------------------------------------------------------------------------------------
    def write_prompt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append `[B, H, T, D]` tokens (a prompt, a prefill chunk, a new turn) and the MinMax entries of the pages they
        touch. The caller has made room (`grow`)."""
        start, t = self.length, keys.shape[2]
        end = start + t
        keys, values = keys.reshape(self.n, t, self.head_dim), values.reshape(self.n, t, self.value_dim)
        self.full_k[:, start:end] = keys
        self.full_v[:, start:end] = values
        if self.near_apart:
            self.near_k[:, start:end] = keys.index_select(0, self.rows.near)
            self.near_v[:, start:end] = values.index_select(0, self.rows.near)
        p = self.page_size
        first, last = start // p, -(-end // p)
        if self.near_apart:  # the full tier is host memory: only the partial pages' other tokens are read from it
            tokens = torch.cat([self.full_k[:, first * p : start], keys, self.full_k[:, end : last * p]], dim=1)
        else:
            tokens = self.full_k[:, first * p : last * p]
        self.write_meta(first, last, tokens)
        self.hold(end)

    def write_meta(self, first: int, end: int, tokens: torch.Tensor) -> None:
        """MinMax entries of pages `[first, end)` from their keys `tokens [N, (end - first) * P, D]` (the last page's
        may hold stale tokens past the length: an entry is read only once its page is full)."""
        p, s = self.page_size, self.subpages
        sub = tokens.reshape(self.n, (end - first) * s, p // s, self.head_dim)
        lo, hi = torch.aminmax(sub, dim=2)  # [N, F*S, D]
        self.meta[:, :, first * s : end * s] = self.in_kind_order(torch.cat([hi, lo], dim=-1).transpose(1, 2))

    def refresh_subpages(self, subs: torch.Tensor) -> None:
        """MinMax entries of sub-pages `subs [m]` recomputed from their tokens (a decode token's, a block's)."""
        sub_len = self.page_size // self.subpages
        keys = self.full_k.view(self.n, -1, sub_len, self.head_dim)
        self.meta.index_copy_(2, subs, self.in_kind_order(kernels.subpage_minmax(keys, subs)))

    def in_kind_order(self, entries: torch.Tensor) -> torch.Tensor:
        """Per-row `entries [N, ...]` in row order -> in the MinMax cache's row order."""
        return entries if self.rows.kind_major else entries.index_select(0, self.rows.kind_order)

    # -- reading ------------------------------------------------------------------------------------------
    def minmax(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The MinMax entries `[n, 2D, pages * S]` of rows `rows [n]` (every row with None), in that order (a copy
        unless that is the cache's own order)."""
        if rows is None:
            return self.meta if self.rows.kind_major else self.meta.index_select(0, self.rows.kind_place)
        return self.meta.index_select(0, self.rows.kind_place.index_select(0, rows))

    def minmax_views(self, start: int, end: int) -> list[torch.Tensor]:
        """The MinMax entries of the unstable rows then of the stable rows `[start, end)` (indices among them), as views
        of the cache (no copy): one where they are adjacent, else two."""
        n_e = self.rows.n_unstable
        if start == 0:
            return [self.meta[: n_e + end]]
        blocks = [self.meta[: n_e]] if n_e else []
        return blocks + [self.meta[n_e + start : n_e + end]]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token held, `[B, H, L, D]` views of the full tier."""
        k = self.full_k.view(self.batch, self.heads, self.capacity, self.head_dim)[:, :, : self.length]
        v = self.full_v.view(self.batch, self.heads, self.capacity, self.value_dim)[:, :, : self.length]
        if k.device != self.device:
            k, v = k.to(self.device), v.to(self.device)
        return k, v

    # -- rows ---------------------------------------------------------------------------------------------------
    def select_rows(self, batch_index: torch.Tensor) -> None:
        """Keep / duplicate sequences: new sequence i is old sequence `batch_index[i]` (beam search). In place when the
        batch size stays (static addresses), else new tensors."""
        h = self.heads
        index = batch_index.to(self.device)
        rows = (index[:, None] * h + torch.arange(h, device=self.device)).reshape(-1)
        new_batch = index.numel()
        old_rows = self.rows
        new_rows = RowIndex(self.kinds, new_batch, self.device)
        # A stable row's window rows follow their rows; the trash row stays last.
        s_map = torch.cat([old_rows.stable_local[rows[new_rows.stable]],
                           torch.tensor([old_rows.n_stable], device=self.device)])
        same = new_batch == self.batch
        # `win_shift` holds flat indices: its rows move to new window rows.
        shift = self.win_shift.index_select(0, s_map) - self.win_base.index_select(0, s_map)
        meta_map = old_rows.kind_place.index_select(0, rows.index_select(0, new_rows.kind_order))
        maps = [("full_k", rows), ("full_v", rows), ("meta", meta_map), ("win_k", s_map), ("win_v", s_map),
                ("win_pages", s_map), ("win_bias_rows", s_map)]
        if self.near_apart:  # a near row's tokens follow its row
            near_map = old_rows.near_place.index_select(0, rows.index_select(0, new_rows.near))
            maps += [("near_k", near_map), ("near_v", near_map)]
        for name, row_map in maps:
            t = getattr(self, name)
            picked = t.index_select(0, row_map)
            if same:
                t.copy_(picked)
            elif self.full_mapped and name in ("full_k", "full_v"):  # a new full tier in mapped host memory again
                setattr(self, name, self._full(picked.shape).copy_(picked))
            else:
                setattr(self, name, picked)
        if not same:
            self.batch, self.n, self.rows = new_batch, new_batch * h, new_rows
            self._link_near()
            self.win_base = torch.arange(new_rows.n_stable + 1, device=self.device) * self.win_k.shape[1]
            self.win_shift = torch.empty_like(shift)
        self.win_shift.copy_(self.win_base + shift)
        self.window_tokens()  # a row's sequence may have changed: its token bias row with it

    def empty(self) -> None:
        """Hold no token, keeping every tensor (a reset cache; the next prompt aims the windows)."""
        self.hold(0)
        self.win_pages.fill_(-1)

    def put_back_windows(self, win_pages: torch.Tensor, win_shift: torch.Tensor) -> torch.Tensor:
        """Make the windows' pages and shifts these earlier copies again (a crop); -> the stable rows whose pages
        changed, whose tokens are to be read back (an eager host read: a crop is never compiled)."""
        changed = (self.win_pages != win_pages).any(dim=1)
        self.win_pages.copy_(win_pages)
        self.win_shift.copy_(win_shift)
        return changed[:-1].nonzero().flatten()

    def aim_windows(self, position: int) -> None:
        """Empty the windows and point their writes at position `K - 1` for the page of `position` (after a prompt,
        before the next step's ranking fills them)."""
        shift = (self.cfg.pages_per_head - 1 - position // self.page_size) * self.page_size
        self.win_shift.copy_(self.win_base + shift)
        self.win_pages.fill_(-1)  # nothing of the windows is kept: the next ranking fills them from the host tier
        self.window_tokens()

    def window_tokens(self, local: torch.Tensor | None = None, window: torch.Tensor | None = None,
                      seq: torch.Tensor | None = None) -> None:
        """`win_bias_rows` of the stable rows `local` (all with None) from their `win_pages` (or `window`, what was just
        written there) and their sequences (`seq`, where the caller has them)."""
        if local is None:
            local = torch.arange(self.rows.n_stable + 1, device=self.device)
        if window is None:
            window = self.win_pages.index_select(0, local)
        if seq is None:
            seq = self.rows.stable_batch.index_select(0, local)
        self.win_bias_rows.index_copy_(0, local, self.bias_rows(seq, window))

    def bias_rows(self, seq: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Each page's row in a step's token bias (`StepBias.page_rows`) for windows `window [n, W]` of sequences
        `seq [n]`: page `p` of sequence `b` is row `b * (pages + 1) + p`; no page (-1, or one past the capacity) is the
        null page `pages` (masked). -> `[n, W]`."""
        pages = self.pages
        page = window.clamp(-1, pages).remainder(pages + 1)  # -1 and past the capacity: the null page `pages`
        return page_index(seq[:, None], page, pages + 1)

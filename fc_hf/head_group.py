"""A head group: KV heads of one layer that share a ranking schedule and a paged store.

`HeadGroup` composes a `PageSelector` (selection.py: which pages), the tier moves (tiers.py: where they live) and a
`PagedKV` store, and owns the schedule: when the group ranks, what it reads between rankings, when a deferred ranking
takes effect. A layer's groups: unstable (every page on the device, ranked every step), stable (top-K on the device,
every full page on the host, ranked at the first decode step and every `rerank_interval` steps, reading in between its
last top-K plus the pages created since) and streaming (the LServe-like baseline: sink + recent pages). One store per
group keeps its metadata contiguous: a step scores only the groups that are due, with no loop over heads.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from . import kernels
from .paged_store import PagedKV, StoreMark, gather_pages
from .selection import NEG_INF, PageSelector
from .tiers import compaction_headroom, move_tiers

UNSTABLE, STABLE, STREAMING = "unstable", "stable", "streaming"

_UNTIMED = nullcontext()


@dataclass
class GroupMark:
    """What `HeadGroup.restore` puts back (speculative decoding, `fc_hf/speculative.py`): the store's mark and the
    group's selection state, schedule and counters."""

    store: StoreMark
    sel: torch.Tensor | None
    pages_at_rank: int
    pending: tuple | None
    compacted: bool
    rankings: int
    promotions: int  # entries of `promoted_fractions`
    rank_next: bool
    after_append: bool
    counts: dict
    carried: tuple | None


class HeadGroup:
    def __init__(self, kind: str, heads: list[int], cfg, timings: dict | None, workspace=None):
        self.kind = kind
        self.heads = heads
        self.cfg = cfg
        self.selector = PageSelector(cfg, workspace)
        self.workspace = workspace  # the cache's gather buffers (kernels.GatherWorkspace), or None
        self.interval = {UNSTABLE: 1, STABLE: cfg.rerank_interval}.get(kind)
        self.tiered = kind == STABLE and cfg.offload
        self.store: PagedKV | None = None
        self.head_index: torch.Tensor | None = None
        self.sel: torch.Tensor | None = None  # [N, <=K] pages chosen at the last ranking
        self.last_read: torch.Tensor | None = None  # [N, M] pages read at the last decode step
        # Pages chosen at rankings and rows ranked; pages attended over decode steps and row-steps (`stats()` means);
        # pages whose MinMax entries were scored, candidates whose keys were read, read pages whose keys the attention
        # did not read again (`bytes_read`).
        self.counts = dict.fromkeys(("ranked_pages", "ranked_rows", "read_pages", "read_rows", "scored_pages",
                                     "candidate_pages", "reused_pages"), 0)
        self.pages_at_rank = 0  # pages that existed at the last ranking
        self.pending: tuple[torch.Tensor, int] | None = None  # deferred ranking, applied after attention
        self.compacted = False
        self.rankings = 0
        self.promoted_fractions: list[float] = []
        self.timings = timings
        # Between rankings a stable group reads the same pages from the same slots for many steps: the
        # pages are kept until the selection or the page count changes, their slots until the table does.
        self._pages_memo: tuple | None = None  # (sel, pages_at_rank, num_pages, rows, pages)
        self._slots_memo: tuple | None = None  # (pages, table_version, slots)
        self._checked_slots: torch.Tensor | None = None  # the slots the residency check last passed
        # Set by a multi-token append (a prompt, a prefill chunk, a new turn): the group ranks at the next decode step
        # and applies that ranking at once, whatever its schedule; the ranking's promotions are not a re-rank's.
        self.rank_next = False
        self._after_append = False

    def init_store(self, batch, head_dim, value_dim, dtype, device, ledger=None):
        self.head_index = torch.tensor(self.heads, device=device)
        self.store = PagedKV(batch, len(self.heads), self.cfg.page_size, head_dim, value_dim, dtype, device,
                             tiered=self.tiered, subpages=self.cfg.subpages, ledger=ledger)

    def append(self, keys: torch.Tensor, values: torch.Tensor, prompt: bool, heads: torch.Tensor | None = None,
               backend: str | None = None) -> None:
        """Append `[B, heads, T, D]` tokens (with `heads`: every KV head of the layer, this group's taken from them):
        a decode step's token, or `prompt` tokens (a prompt, a chunk, a turn), which leave a tiered group only its sink
        and the page being filled on the device (`PagedKV.append_offloaded`); the group ranks at its next step."""
        if not prompt:
            self.store.append(keys, values, heads=heads, backend=backend)
            return
        if self.tiered:
            if heads is not None:
                keys, values = keys.index_select(1, heads), values.index_select(1, heads)
            self.store.append_offloaded(keys, values, keep=self.cfg.sink_pages)
            store = self.store
            sink = min(self.cfg.sink_pages, store.full_pages)
            self.sel = torch.arange(sink, device=store.device).expand(store.rows, sink)
            self.pages_at_rank = store.full_pages  # the page being filled, if any, is "created since"
        else:
            self.store.append(keys, values, heads=heads, backend=backend)
        self.rank_next = True
        self._after_append = self.tiered
        self.pending = None
        self._pages_memo = self._slots_memo = self._checked_slots = None
        self.selector.forget()  # nothing ranked before these tokens is re-used
        self.selector.carried = None

    def slots_after(self, tokens: int, batch: int, decode: bool = False) -> int:
        """Device slots this group holds once `tokens` more tokens are in (`decode`: as decode steps, the tokens
        speculative decoding verifies) and (at a decode step that ranks after a prompt or a turn) its first ranking has
        promoted its top-K: what `max_device_pages` is checked against."""
        p = self.cfg.page_size
        store = self.store
        length = 0 if store is None else store.length
        rows = batch * len(self.heads) if store is None else store.rows
        end = length + tokens
        if self.tiered and tokens > 1 and not decode:  # the sink and the page being filled (`PagedKV.append_offloaded`)
            return (min(self.cfg.sink_pages, end // p) + (end % p > 0)) * rows
        held = math.ceil(end / p) * rows if store is None else store.slots_in_use() + store.slots_needed(tokens)
        if self.tiered and self.rank_next:
            held = max(held, min(self.cfg.pages_per_head, math.ceil(end / p)) * rows)
        return held

    def _timed(self, name):
        """Times the block into `timings[name]` when timings are on; else a shared no-op (no generator per call)."""
        return _UNTIMED if self.timings is None else self._timing(name)

    @contextmanager
    def _timing(self, name):
        if self.store.device.type == "cuda":
            torch.cuda.synchronize(self.store.device)
        t0 = time.perf_counter()
        yield
        if self.store.device.type == "cuda":
            torch.cuda.synchronize(self.store.device)
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    def _count(self, **added) -> None:
        for key, value in added.items():
            self.counts[key] += value

    # -- selection -----------------------------------------------------------------------------
    def is_due(self, step: int) -> bool:
        """Whether this group ranks its pages at decode step `step` (1-based)."""
        return self.kind != STREAMING and (self.rank_next or self.is_scheduled(step))

    def is_scheduled(self, step: int) -> bool:
        """Whether the schedule alone (not a `rank_next` set by an append) ranks at step `step`."""
        return self.kind != STREAMING and (step == 1 or step % self.interval == 0)

    def pages_for_step(self, step: int, query: torch.Tensor, page_valid: torch.Tensor | None, scaling: float = 1.0,
                       token_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Logical pages `[N, M]` this group attends to at decode step `step` (all exist and are resident)."""
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None
        store = self.store
        if self.kind == STREAMING:
            memo = self._pages_memo
            if memo is None or memo[2] != store.num_pages or memo[3] != store.rows:
                memo = (None, None, store.num_pages, store.rows,
                        self.selector.streaming_pages(store.rows, store.num_pages, store.device))
                self._pages_memo = memo
            return memo[4]
        if self.is_due(step):
            with self._timed("scoring"):
                scores = self.selector.scores(query, store, page_valid)
            with self._timed("selection"):
                new_sel = self.selector.select(scores, query, store, scaling, token_valid, len(self.heads))
            self.rankings += 1
            self._count(ranked_rows=new_sel.shape[0], ranked_pages=new_sel.numel(),
                        scored_pages=new_sel.shape[0] * store.num_pages, candidate_pages=self.selector.candidates_read)
            forced, self.rank_next = self.rank_next, False
            if step > 1 and self.tiered and self.cfg.promotion == "deferred" and not forced:
                # Attend with the current pages now; promote after this step's attention.
                self.pending = (new_sel, store.num_pages)
            else:
                self._apply(new_sel, store.num_pages)
        return self._resident_pages()

    def _resident_pages(self) -> torch.Tensor:
        """Pages this group reads and holds on the device now: last top-K plus pages created since, `[N, R]`."""
        store = self.store
        if self.sel is not None and self.pages_at_rank == store.num_pages:
            return self.sel
        memo = self._pages_memo
        if memo is not None and memo[0] is self.sel and memo[1] == self.pages_at_rank and memo[2] == store.num_pages \
                and memo[3] == store.rows:
            return memo[4]
        if self.sel is None:  # right after prefill: everything is resident
            pages = torch.arange(store.num_pages, device=store.device).expand(store.rows, store.num_pages)
        else:
            since = torch.arange(self.pages_at_rank, store.num_pages, device=store.device)
            pages = torch.cat([self.sel, since.expand(store.rows, since.numel())], dim=1)
        self._pages_memo = (self.sel, self.pages_at_rank, store.num_pages, store.rows, pages)
        return pages

    def _slots_for(self, pages: torch.Tensor) -> torch.Tensor:
        """Device slots of `pages`; the same pages object under an unchanged table gives the same slots."""
        store = self.store
        memo = self._slots_memo
        if memo is not None and memo[0] is pages and memo[1] == store.pool.table_version:
            return memo[2]
        slots = store.slots_for(pages)
        self._slots_memo = (pages, store.pool.table_version, slots)
        return slots

    def _apply(self, new_sel: torch.Tensor, pages_at_rank: int) -> None:
        """Make `new_sel` the current selection; for a tiered group move pages between tiers."""
        if self.tiered:
            with self._timed("promotion"):
                self._move_tiers(new_sel, pages_at_rank)
        self.sel = new_sel
        self.pages_at_rank = pages_at_rank

    def adopt_selection(self, sel: torch.Tensor, pages_at_rank: int, carried: tuple | None = None) -> None:
        """Take `sel [N, <=K]`, ranked when `pages_at_rank` pages existed, as this group's last ranking (and `carried`,
        the candidates it carries on): `profile="auto"`'s re-split groups continue from the warm-up's ranking."""
        self._apply(sel, pages_at_rank)
        self.selector.carried = carried
        self.rank_next = False  # ranked already: the schedule goes on as if this group had made that ranking

    def _move_tiers(self, new_sel: torch.Tensor, pages_at_rank: int) -> None:
        store = self.store
        headroom = compaction_headroom(store, self.interval)
        if pages_at_rank == store.num_pages and kernels.backend_for(store.k_pool, self.cfg.backend) == "torch":
            # The PyTorch attention reads the pages in place until the next ranking (no gather per step): the pages are
            # laid out row by row, the promoted ones straight from the host; the layout is also the compaction (a
            # pool of the resident pages plus the headroom).
            promoted = store.lay_out(new_sel, self._resident_pages(), headroom // store.rows)
        else:
            promoted = move_tiers(store, self._resident_pages(), new_sel)
            if not self.compacted:  # after the first drop, give the freed device memory back
                store.pool.compact(headroom)
        self.compacted = True
        if not self._after_append:  # the first ranking after a prompt or a turn fills the device from the sink
            self.promoted_fractions.append(promoted / max(1, new_sel.numel()))
        self._after_append = False

    # -- attention -------------------------------------------------------------------------------
    def _where(self, pages: torch.Tensor, triton: bool, check: bool):
        """How the attention finds `pages` `[N, M]`: `(row_kv, slots)`. On the PyTorch path a tiered group reads them in
        place between rankings (`row_kv`, views of the pools: `PagedKV.lay_out`); on Triton the kernel looks their
        slots up in the block table. Otherwise, or to check residency, `slots` (None when not needed)."""
        row_kv = None if triton or self.sel is None else self.store.row_view(self.sel, pages.shape[1])
        slots = None if (triton or row_kv is not None) and not check else self._slots_for(pages)
        if check and self._checked_slots is not slots:
            # Slots come out of a table look-up; the same look-up (pages and table unchanged: any tier move writes the
            # table) was already checked, so a stable group checks once per ranking or new page.
            self.store.check_resident(slots)
            self._checked_slots = slots
        return row_kv, slots

    def attend(self, query: torch.Tensor, step: int, token_valid: torch.Tensor | None, page_valid: torch.Tensor | None,
               scaling: float, softcap: float | None, check: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sparse decode attention for this group. `query [N, G, D]` -> `[N, G, Dv]` (written into `out` if given)."""
        store = self.store
        pages = self.last_read = self.pages_for_step(step, query, page_valid, scaling, token_valid)
        # A refined ranking at this step already scored these keys. Not re-used under a softcap (the capped logits are
        # not the ranking's) or on Triton (its kernel reads the keys in-kernel anyway); offered every step to clear them.
        triton = kernels.backend_for(query, self.cfg.backend) == "triton"
        logits = self.selector.take_logits(pages, wanted=softcap is None and not triton)
        store.transfers.wait_promotions()
        with self._timed("gather_attention"):
            row_kv, slots = self._where(pages, triton, check)
            self._count(read_pages=pages.numel(), read_rows=pages.shape[0],
                        reused_pages=0 if logits is None else pages.numel())
            out = kernels.sparse_decode_attention(
                query, store.k_pool, store.v_pool, slots, pages, store.length, scaling, token_valid, len(self.heads),
                softcap, backend=self.cfg.backend, workspace=self.workspace, logits=logits, out=out,
                table=store.table if slots is None else None, row_kv=row_kv,
                in_range=True,  # every page read is a page of the sequence: never past its end, never -1
            )
        if self.pending is not None:
            # Deferred promotion: start the copies now, so they overlap the rest of the step.
            self._apply(*self.pending)
            self.pending = None
        return out

    # -- several decode steps at once (speculative decoding's verification, `FlexiCacheLayer.attend`) -------------
    def can_attend_block(self) -> bool:
        """Whether `attend_block` serves this stable group between its rankings (the caller checks the schedule, the
        backend and the batch). Groups that rank at every step attend a block one step at a time."""
        return self.kind == STABLE and self.pending is None and self.store is not None

    def attend_block(self, query: torch.Tensor, lengths: torch.Tensor, scaling: float, check: bool,
                     out: torch.Tensor) -> list[int]:
        """`t` consecutive decode steps of one sequence at once, a stable group between its rankings, their tokens
        appended already: each query attends as its own step would (`FlexiCacheLayer.attend`), to the last selection
        plus the pages opened until its step. `query [N, t, G, D]` (N = this group's heads, batch 1; contiguous),
        `lengths [t]` the sequence length at each step, written into `out [N, t, G, Dv]`; query j masks the tokens after
        its own (positions >= lengths[j]). Returns the pages each step read (for the layer's marks)."""
        store = self.store
        n, t, g, d = query.shape
        p = store.page_size
        self.selector.forget()
        store.transfers.wait_promotions()
        pages = self._resident_pages()  # the last step's; an earlier step's are these without the pages opened since
        m = pages.shape[1]
        # Pages each step reads: those of its page count.
        reads = [n * (m - store.num_pages + -(-int(length) // p)) for length in lengths.tolist()]
        with self._timed("gather_attention"):
            row_kv, slots = self._where(pages, False, check)
            if row_kv is not None:
                keys, values = row_kv
            else:
                keys = gather_pages(store.k_pool, slots, self.workspace, "k").view(n, m * p, -1)
                values = gather_pages(store.v_pool, slots, self.workspace, "v").view(n, m * p, -1)
            # Query j's tokens: positions < lengths[j] (the pages are whole pages of the sequence).
            pos = (pages[:, :, None] * p + torch.arange(p, device=pages.device)).view(n, 1, m * p)
            bias = torch.zeros(n, t, m * p, dtype=keys.dtype, device=keys.device)
            bias.masked_fill_(pos >= lengths.view(1, t, 1), NEG_INF)
            bias = bias[:, :, None].expand(n, t, g, m * p).reshape(n, t * g, m * p)
            logits = torch.baddbmm(bias, query.view(n, t * g, d).to(keys.dtype), keys.transpose(1, 2), alpha=scaling)
            probs = torch.softmax(logits.float(), dim=-1)
            out.view(n, t * g, -1).copy_(torch.matmul(probs.to(values.dtype), values))
        self._count(read_pages=sum(reads), read_rows=n * t)
        return reads

    # -- rollback (speculative decoding, `fc_hf/speculative.py`) -----------------------------------
    def mark(self) -> GroupMark:
        """This group's selection state and schedule now, with its store's mark (see `PagedKV.mark`)."""
        return GroupMark(self.store.mark(), self.sel, self.pages_at_rank, self.pending, self.compacted, self.rankings,
                         len(self.promoted_fractions), self.rank_next, self._after_append, dict(self.counts),
                         self.selector.carried)

    def restore(self, mark: GroupMark) -> None:
        self.sel, self.pages_at_rank, self.pending, self.compacted = mark.sel, mark.pages_at_rank, mark.pending, \
            mark.compacted
        self.rankings, self.rank_next, self._after_append = mark.rankings, mark.rank_next, mark.after_append
        self.counts = dict(mark.counts)
        self.selector.carried = mark.carried
        self.store.restore(mark.store)
        del self.promoted_fractions[mark.promotions:]
        self._pages_memo = self._slots_memo = self._checked_slots = None
        self.selector.forget()

    def select_rows(self, batch_index: torch.Tensor) -> None:
        if self.store is None:
            return
        row_map = self.store.select_rows(batch_index)
        if self.sel is not None:
            self.sel = self.sel[row_map]
        if self.selector.carried is not None:
            self.selector.carried = tuple(t[row_map] for t in self.selector.carried)
        if self.pending is not None:
            self.pending = (self.pending[0][row_map], self.pending[1])

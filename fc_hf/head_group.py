"""A head group: KV heads of one layer that share a ranking schedule and a paged store.

`HeadGroup` composes a `PageSelector` (selection.py: which pages), the tier moves (tiers.py: where
they live) and a `PagedKV` store (paged_store.py), and owns the schedule: when the group ranks, what
it reads between rankings, and when a deferred ranking takes effect.

Each FlexiCache layer splits its KV heads into up to three groups:
- unstable: every page on the device, re-ranked every `unstable_rerank_interval` steps (1);
- stable: tiered (top-K on the device, every full page on the host), re-ranked at the first decode
  step and every `rerank_interval` steps, attending in between to its last top-K plus the pages
  created since;
- streaming (LServe-like baseline only): sink + most recent pages, never ranked.
Splitting by group keeps each group's metadata contiguous, so a step scores only the groups that
are due, with no Python loop over heads.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext

import torch

from . import kernels
from .budget_mass import entry_counts, with_pages_since
from .paged_store import PagedKV, gather_pages
from .selection import NEG_INF, PageSelector, tail_terms
from .tiers import compaction_headroom, move_tiers

UNSTABLE, STABLE, STREAMING = "unstable", "stable", "streaming"

_UNTIMED = nullcontext()


class HeadGroup:
    def __init__(self, kind: str, heads: list[int], cfg, timings: dict | None, workspace=None, split=None):
        self.kind = kind
        self.heads = heads
        self.cfg = cfg
        self.selector = PageSelector(cfg, cfg.stable_page_score if kind == STABLE else None, workspace, split)
        self.workspace = workspace  # the cache's gather buffers (kernels.GatherWorkspace), or None
        if kind == UNSTABLE:
            self.interval = cfg.unstable_rerank_interval
        elif kind == STABLE:
            self.interval = cfg.rerank_interval
        else:
            self.interval = None
        self.tiered = kind == STABLE and cfg.offload
        self.store: PagedKV | None = None
        self.head_index: torch.Tensor | None = None
        self.sel: torch.Tensor | None = None  # [N, <=K] pages chosen at the last ranking
        # `budget_mass` / `budget_split="mass"` (`fc_hf/budget_mass.py`): rows hold a variable number of pages, valid
        # entries first, -1 after.
        self.variable = cfg.variable_pages and kind != STREAMING
        # Pages chosen at rankings (summed over rows; a tensor under `budget_mass`, no sync) and rows ranked; pages
        # attended over decode steps and row-steps: `FlexiCache.stats()` means.
        self.ranked_pages = 0
        self.ranked_rows = 0
        self.read_pages = 0
        self.read_rows = 0
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
        self.store = PagedKV(
            batch, len(self.heads), self.cfg.page_size, head_dim, value_dim, dtype, device, tiered=self.tiered,
            subpages=self.cfg.subpages, page_means=self.cfg.tail_estimate, ledger=ledger,
        )

    def append(self, keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor | None = None,
               backend: str | None = None) -> None:
        """Append `[B, heads, T, D]` tokens (with `heads`: every KV head of the layer, this group's taken from them).

        One token is a decode step's. Several (a prompt, a prefill chunk, a new turn of a conversation) leave a tiered
        group only its sink and the page being filled on the device (`PagedKV.append_offloaded`), and every group
        ranks at its next decode step: the selection made before these tokens does not know them.
        """
        if keys.shape[2] == 1:
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
        if self.selector.split is not None:  # budget_split="mass": the next first decode step measures it again
            self.selector.split.reset()
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
            most = self.cfg.mass_max_pages if self.variable else self.cfg.pages_per_head
            held = max(held, min(most, math.ceil(end / p)) * rows)
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

    # -- selection -----------------------------------------------------------------------------
    def is_due(self, step: int) -> bool:
        """Whether this group ranks its pages at decode step `step` (1-based)."""
        return self.kind != STREAMING and (self.rank_next or self.is_scheduled(step))

    def is_scheduled(self, step: int) -> bool:
        """Whether the schedule alone (not a `rank_next` set by an append) ranks at step `step`."""
        return self.kind != STREAMING and (step == 1 or step % self.interval == 0)

    def _rank(self, query: torch.Tensor, page_valid: torch.Tensor | None, scaling: float,
              token_valid: torch.Tensor | None) -> torch.Tensor:
        # Exact scoring reads every token: it takes the padding mask per row (row = b * heads + h); refinement takes
        # the step's mask and the rows per sequence (its bias table is shared by every layer of the step).
        rows_valid = None
        if token_valid is not None and self.selector.how == "exact":
            rows_valid = token_valid.repeat_interleave(len(self.heads), dim=0)
        with self._timed("scoring"):
            scores = self.selector.scores(query, self.store, page_valid, scaling, rows_valid)
        with self._timed("selection"):
            return self.selector.select(scores, query, self.store, scaling, token_valid, len(self.heads))

    def pages_for_step(
        self, step: int, query: torch.Tensor, page_valid: torch.Tensor | None, scaling: float = 1.0,
        token_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logical pages `[N, M]` this group attends to at decode step `step` (all exist and are resident; -1 entries,
        not attended, only with variable pages)."""
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None
        if self.kind == STREAMING:
            store = self.store
            memo = self._pages_memo
            if memo is None or memo[2] != store.num_pages or memo[3] != store.rows:
                memo = (None, None, store.num_pages, store.rows,
                        self.selector.streaming_pages(store.rows, store.num_pages, store.device))
                self._pages_memo = memo
            return memo[4]
        store = self.store
        if self.is_due(step):
            new_sel = self._rank(query, page_valid, scaling, token_valid)
            self.rankings += 1
            self.ranked_rows += new_sel.shape[0]
            self.ranked_pages = self.ranked_pages + ((new_sel >= 0).sum() if self.variable else new_sel.numel())
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
        elif self.variable and not self._torch_path():
            # valid entries first (the Triton kernel stops at each row's count)
            pages = with_pages_since(self.sel, self.pages_at_rank, store.num_pages)
        else:  # the PyTorch path masks -1 entries wherever they are: the order of the in-place layout
            since = torch.arange(self.pages_at_rank, store.num_pages, device=store.device)
            pages = torch.cat([self.sel, since.expand(store.rows, since.numel())], dim=1)
        self._pages_memo = (self.sel, self.pages_at_rank, store.num_pages, store.rows, pages)
        return pages

    def _torch_path(self) -> bool:
        """Whether this group's attention runs on the PyTorch backend (where its pages may be read in place)."""
        return kernels.backend_for(self.store.k_pool, self.cfg.backend) == "torch"

    def _slots_for(self, pages: torch.Tensor) -> torch.Tensor:
        """Device slots of `pages`; the same pages object under an unchanged table gives the same slots."""
        store = self.store
        memo = self._slots_memo
        if memo is not None and memo[0] is pages and memo[1] == store.table_version:
            return memo[2]
        slots = store.slots_for(pages, holes=self.variable)  # -1 entries (variable pages): the null block
        self._slots_memo = (pages, store.table_version, slots)
        return slots

    def _apply(self, new_sel: torch.Tensor, pages_at_rank: int) -> None:
        """Make `new_sel` the current selection; for a tiered group move pages between tiers."""
        if self.tiered:
            with self._timed("promotion"):
                self._move_tiers(new_sel, pages_at_rank)
        self.sel = new_sel
        self.pages_at_rank = pages_at_rank

    def adopt_selection(self, sel: torch.Tensor, pages_at_rank: int, carried: torch.Tensor | None = None) -> None:
        """Take `sel [N, <=K]`, ranked when `pages_at_rank` pages existed, as this group's last ranking.

        For `profile="auto"`: a group built at the end of the warm-up inherits the ranking its heads made at
        that (re-rank) step; a tiered group then keeps only those pages on the device, as after that ranking.
        """
        self._apply(sel, pages_at_rank)
        self.selector.carried = carried
        self.rank_next = False  # ranked already: the schedule goes on as if this group had made that ranking

    def _move_tiers(self, new_sel: torch.Tensor, pages_at_rank: int) -> None:
        store = self.store
        promoted = move_tiers(store, self._resident_pages(), new_sel, variable=self.variable)
        if not self._after_append:  # the first ranking after a prompt or a turn fills the device from the sink
            chosen = int((new_sel >= 0).sum()) if self.variable else new_sel.numel()
            self.promoted_fractions.append(promoted / max(1, chosen))
        self._after_append = False
        headroom = compaction_headroom(store, self.interval)
        if pages_at_rank == store.num_pages and self._torch_path():
            # The PyTorch attention reads the pages in place until the next ranking (no gather per step); the
            # layout is also the compaction (a pool of the resident pages plus the headroom). With variable pages a
            # row's -1 entries keep their place in it as zero pages, masked by the attention (`_resident_pages`).
            store.arrange_rows(new_sel, headroom // store.rows, holes=self.variable)
            self.compacted = True
        elif not self.compacted:
            # After the first drop, give the freed device memory back.
            store.compact(headroom)
            self.compacted = True

    # -- attention -------------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        step: int,
        token_valid: torch.Tensor | None,
        page_valid: torch.Tensor | None,
        scaling: float,
        softcap: float | None,
        check: bool,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse decode attention for this group. `query [N, G, D]` -> `[N, G, Dv]` (written into `out` if given)."""
        store = self.store
        pages = self.pages_for_step(step, query, page_valid, scaling, token_valid)
        self.last_read = pages
        # A refined ranking at this step already scored these keys. Not re-used under a softcap (the capped logits are
        # not the ranking's) or on Triton (its kernel reads the keys in-kernel anyway); offered every step to clear them.
        triton = kernels.backend_for(query, self.cfg.backend) == "triton"
        logits = self.selector.take_logits(pages, wanted=softcap is None and not triton)
        store.transfers.wait_promotions()
        with self._timed("gather_attention"):
            # On Triton the kernel looks the pages' slots up in the block table (no gather launch before it).
            # On the PyTorch path a tiered group reads its pages in place between rankings (`PagedKV.arrange_rows`).
            row_kv = None if triton or self.sel is None else store.row_view(self.sel, pages.shape[1])
            slots = None if (triton or row_kv is not None) and not check else self._slots_for(pages)
            if check and self._checked_slots is not slots:
                # Slots come out of a table look-up; the same look-up (pages and table unchanged: any tier move
                # writes the table) was already checked, so a stable group checks once per ranking or new page.
                store.check_resident(slots.masked_fill(pages < 0, 1) if self.variable else slots)
                self._checked_slots = slots
            tail = None
            if store.page_means is not None and store.full_pages:
                tail = tail_terms(query, store.page_means, pages, store.full_pages, store.page_size, scaling,
                                  page_valid, softcap)
            counts = None
            if self.variable:  # per-row counts: the Triton kernel stops each row there; the PyTorch path masks the
                # -1 entries wherever they are (after a ranking's pages come the pages opened since: `_resident_pages`)
                counts = entry_counts(pages)
                self.read_pages = self.read_pages + counts.sum()
                if not triton:
                    counts = None
            else:
                self.read_pages += pages.numel()
            self.read_rows += pages.shape[0]
            out = kernels.sparse_decode_attention(
                query, store.k_pool, store.v_pool, slots, pages, store.length, scaling,
                token_valid, len(self.heads), softcap, backend=self.cfg.backend, workspace=self.workspace, tail=tail,
                # every page read is a page of the sequence: never past its end, never -1 (but under `budget_mass`)
                in_range=not self.variable,
                logits=logits, out=out, table=store.table if slots is None else None, row_kv=row_kv, counts=counts,
            )
        if self.pending is not None:
            # Deferred promotion: start the copies now, so they overlap the rest of the step.
            self._apply(*self.pending)
            self.pending = None
        return out

    def pages_read(self) -> torch.Tensor:
        """The pages `[N, M]` this group read at its last decode step (-1 entries: none; diagnosis and tests)."""
        return self.last_read

    # -- several decode steps at once (speculative decoding's verification, `FlexiCacheLayer.attend`) -------------
    def can_attend_block(self) -> bool:
        """Whether `attend_block` serves this stable group between its rankings (the caller checks the schedule, the
        backend and the batch). Groups that rank at every step attend a block one step at a time."""
        return self.kind == STABLE and self.pending is None and not self.variable and self.store is not None

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
        num_pages = store.num_pages
        counts = [-(-(store.length - t + 1 + j) // p) for j in range(t)]  # each step's page count
        self.selector.forget()
        store.transfers.wait_promotions()
        full = torch.div(lengths, p, rounding_mode="floor")  # [t] full pages at each step
        pages = self._resident_pages()  # the last step's; an earlier step's are these without the pages opened since
        m = pages.shape[1]
        reads = [n * (m - (num_pages - c)) for c in counts]  # pages each step reads (its page count's)
        with self._timed("gather_attention"):
            row_kv = None if self.sel is None else store.row_view(self.sel, m)
            slots = None if row_kv is not None and not check else self._slots_for(pages)
            if check and self._checked_slots is not slots:
                store.check_resident(slots)
                self._checked_slots = slots
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
            q = query.view(n, t * g, d)
            logits = torch.baddbmm(bias, q.to(keys.dtype), keys.transpose(1, 2), alpha=scaling).float()
            if store.page_means is not None and store.full_pages:
                tl, tv = self._tail_block(query, pages[:, None].expand(n, t, m), full, scaling)
                logits = torch.cat([logits, tl.view(n, t * g, -1)], -1)
                values = torch.cat([values[:, None].expand(n, t, *values.shape[1:]), tv.view(n, t, *tv.shape[1:])], 2)
                probs = torch.softmax(logits, dim=-1).view(n * t, g, -1)
                out.view(n * t, g, -1).copy_(torch.matmul(probs.to(values.dtype), values.reshape(n * t, *values.shape[2:])))
            else:
                probs = torch.softmax(logits, dim=-1)
                out.view(n, t * g, -1).copy_(torch.matmul(probs.to(values.dtype), values))
        self.read_pages += sum(reads)
        self.read_rows += n * t
        return reads

    def _tail_block(self, query: torch.Tensor, read: torch.Tensor, full: torch.Tensor, scaling: float):
        """`tail_terms` of `t` steps: `query [N, t, G, D]`, the pages each reads `read [N, t, M]`, the full pages of each
        `full [t]` -> `(logits [N*t, G, F], values [N*t, F, Dv])` with F the full pages now (later ones -inf for a step)."""
        store = self.store
        n, t, g, d = query.shape
        f = store.full_pages
        means = store.page_means[:, :f]
        logits = torch.matmul(query.view(n, t * g, d).float(), means[..., :d].float().transpose(1, 2)) * scaling
        logits = logits + math.log(store.page_size)
        skip = torch.zeros(n, t, f + 1, dtype=torch.bool, device=query.device)
        skip.scatter_(2, read.clamp(max=f), True)
        skip = skip[..., :f] | (torch.arange(f, device=query.device)[None, :] >= full[:, None])[None]
        logits = logits.view(n, t, g, f).masked_fill(skip[:, :, None], NEG_INF).view(n * t, g, f)
        values = means[..., d:][:, None].expand(n, t, f, means.shape[-1] - d).reshape(n * t, f, -1)
        return logits, values

    def patched_mark(self, mark: tuple, read_pages: int, read_rows: int) -> tuple:
        """`mark` (taken before a token of a block, `attend_block`) with the read counters as they stand once the steps
        before that token have run (a block changes nothing else of a stable group)."""
        *rest, (ranked_pages, ranked_rows, _, _), carried = mark
        return (*rest, (ranked_pages, ranked_rows, read_pages, read_rows), carried)

    # -- rollback (speculative decoding, `fc_hf/speculative.py`) -----------------------------------
    def mark(self) -> tuple:
        """This group's selection state and schedule now, with its store's mark (see `PagedKV.mark`)."""
        return (self.store.mark(), self.sel, self.pages_at_rank, self.pending, self.compacted, self.rankings,
                len(self.promoted_fractions), self.rank_next, self._after_append,
                (self.ranked_pages, self.ranked_rows, self.read_pages, self.read_rows), self.selector.carried)

    def restore(self, mark: tuple) -> None:
        store_mark, self.sel, self.pages_at_rank, self.pending, self.compacted, self.rankings, fractions, \
            self.rank_next, self._after_append, counters, self.selector.carried = mark
        self.ranked_pages, self.ranked_rows, self.read_pages, self.read_rows = counters
        self.store.restore(store_mark)
        del self.promoted_fractions[fractions:]
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
        if self.selector.split is not None and self.selector.split_counts is not None:
            self.selector.split_counts = self.selector.split_counts[row_map]
        if self.pending is not None:
            self.pending = (self.pending[0][row_map], self.pending[1])


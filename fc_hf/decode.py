"""The decode step of one FlexiCache layer: append the token, rank the rows due, move their windows, attend.

Fixed shapes and device tensors only, no host number that changes from step to step and no host sync, so the step
compiles once and replays (CUDA graphs). An eager step ranks only the stable rows of its phase (known on the host), so
its launches repeat with the period `rerank_interval`. Per layer and step:
- `append`: the token goes into every row's full tier, each stable row's window, and the MinMax entry of its sub-page;
- `attend`: the unstable rows and this step's stable rows (`fc_hf/schedule.py`; all of them at the first step after a
  prompt) rank in one `PageSelector.rank`; the stable rows that ranked get their new windows (`fc_hf/tiers.py`; with
  `promotion="deferred"` after this step's attention, as the authors' vLLM version does); the unstable rows attend over
  their chosen pages (re-using the ranking's logits), the stable rows over their windows, the streaming rows over
  their sink and recent pages. `DecodeContext` carries what the step's layers share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kernels import dispatch as kernels
from .schedule import due_rows
from .selection import Ranking
from .step_bias import StepBias
from .tiers import move_windows


@dataclass
class DecodeContext:
    """One forward's decode step on one device: the new token's `position` (a device scalar), the decode step `step`
    since the last prompt (1-based, a device scalar), and the step's `bias`, filled from the mask by the first layer
    that attends (`ready`)."""

    position: torch.Tensor
    step: torch.Tensor
    bias: StepBias
    ready: bool = field(default=False)
    _shared: dict = field(default_factory=dict)  # per-step values computed once for the layers that share them

    def _once(self, key: tuple, make):
        """`make()`, computed once per step for the layers that share `key` when eager. Computed per layer when traced:
        a key holding a number Dynamo made symbolic (a batch-dependent row count once the batch size changed, under
        generate's default `dynamic=None`) would specialise it again, and the compiler fuses the repeats anyway."""
        if torch.compiler.is_compiling():
            return make()
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def due(self, n_stable: int, interval: int, places: torch.Tensor) -> torch.Tensor:
        """`schedule.due_rows` at this step, computed once for the layers that share a count of stable rows."""
        return self._once((n_stable, interval, places.numel()), lambda: due_rows(self.step, n_stable, interval, places))

    def subpage(self, length: int) -> torch.Tensor:
        """`[1]`: the sub-page of `length` tokens the new token falls in, computed once for the layers that share it."""
        return self._once(("subpage", length), lambda: (self.position // length).view(1))

    def token_slots(self, row_starts: torch.Tensor) -> torch.Tensor:
        """`[N]`: where the new token goes in each row's full tier (`row_starts + position`), computed once for the
        layers that share a row count (every layer of a cache: they share one capacity, so one `row_starts`)."""
        return self._once(("slots", row_starts.shape[0]), lambda: row_starts + self.position)

    def masks(self, attention_mask) -> StepBias:
        if not self.ready:
            self.bias.update(attention_mask, self.position)
            self.ready = True
        return self.bias


def append(layer, key: torch.Tensor, value: torch.Tensor, ctx: DecodeContext) -> None:
    """Write one decode token `[B, H, 1, D]` at `ctx.position` into every row's full tier (and the near rows' own,
    where they are apart), each stable row's window and the MinMax entry of the sub-page it falls in (recomputed from
    that sub-page's tokens)."""
    store = layer.store
    n, d, dv = store.n, store.head_dim, store.value_dim
    pos = ctx.position
    keys, values = key.reshape(n, d), value.reshape(n, dv)
    if fused := kernels.fused(keys, layer.cfg.backend):  # every write below in one call
        near = ((store.near_k, store.near_v) if store.near_apart  # else none: the full tier holds the near rows
                else (keys.new_empty(0, 1, d), values.new_empty(0, 1, dv)))
        kernels.append_token(keys, values, pos, store.length_t, store.full_k, store.full_v, store.meta,
                             store.rows.kind_place, store.win_k, store.win_v, store.win_shift, store.rows.stable_local,
                             *near, store.rows.near_place, store.page_size // store.subpages, backend=fused)
        return
    at = ctx.token_slots(layer.row_starts)
    store.full_k.view(-1, d).index_copy_(0, at, keys)
    store.full_v.view(-1, dv).index_copy_(0, at, values)
    if store.near_apart:
        near, at = store.rows.near, layer.near_starts + pos
        store.near_k.view(-1, d).index_copy_(0, at, keys.index_select(0, near))
        store.near_v.view(-1, dv).index_copy_(0, at, values.index_select(0, near))
    stable = store.rows.stable
    if stable.numel():
        slot = store.win_shift[: stable.numel()] + pos
        if not layer.every_row_stable:  # where every row is stable, stable row j is row j (half of SmolLM2's layers)
            keys, values = keys.index_select(0, stable), values.index_select(0, stable)
        store.win_k.view(-1, d).index_copy_(0, slot, keys)
        store.win_v.view(-1, dv).index_copy_(0, slot, values)
    store.refresh_subpages(ctx.subpage(store.page_size // store.subpages))
    store.length_t.add_(1)


def attend(layer, query: torch.Tensor, ctx: DecodeContext, attention_mask, scaling: float,
           softcap: float | None) -> torch.Tensor:
    """One decode step's attention for `layer`, its token appended: `query [B, Hq, 1, D]` -> `[B, 1, Hq, Dv]`."""
    store, selector, rows = layer.store, layer.selector, layer.store.rows
    b, hq, _, d = query.shape
    n, g = store.n, hq // store.heads
    bias = ctx.masks(attention_mask)
    q = query.reshape(n, g, d)
    # Where one kind holds every row its result is the output; else each kind's rows are written into it.
    out = None if layer.every_row_unstable or layer.every_row_stable else query.new_empty(n, g, store.value_dim)
    n_e, n_s = rows.n_unstable, rows.n_stable
    stable_ranked, span = None, (0, 0)  # span: the stable rows ranked, where the host knows them (eager)
    if n_s and layer.rank_all:  # the first step after a prompt: every stable row, its new window at once
        stable_ranked, span = layer.stable_all, (0, n_s)
    elif n_s and layer.host_step is not None:  # eager: this phase's rows, none on a phase without any
        stable_ranked, span = layer.phase_rows(layer.host_step)
    elif n_s:  # compiled: the phase's rows padded to `ceil(n_s / R)` places (the same graph every step)
        stable_ranked, span = ctx.due(n_s, layer.cfg.rerank_interval, layer.places), None
    ranking, real = None, None
    if n_e or stable_ranked is not None:
        row_range = None
        if layer.host_step is not None:  # eager: the rows known on the host, none padded (made once per span)
            ranked, real, seq, row_range = layer.step_rows(span)
        else:
            ranked = rows.unstable if stable_ranked is None else torch.cat(
                [rows.unstable, layer.stable_rows.index_select(0, stable_ranked)])
            real, seq = ranked.clamp(max=n - 1), None  # a padded place computes on a real row
        minmax = None if span is None else store.minmax_views(*span)  # read in place (kind-major MinMax rows)
        queries = q.index_select(0, real) if row_range is None else q[row_range]
        ranking = selector.rank(queries, ranked, store, bias, scaling, minmax, near=n_e, real=real, seq=seq,
                                row_range=row_range)
        layer.note_ranking(ranking, n_e, ranked)
    if n_e:
        out = _put(out, rows.unstable, _attend_unstable(layer, q, ranking, bias, scaling, softcap))
    deferred = layer.cfg.promotion == "deferred" and not layer.rank_all
    if n_s:
        moves = stable_ranked is not None
        if moves and not deferred:
            _move(layer, ranking, stable_ranked, real[n_e:], bias, span)
        layer.note_windows()
        out = _put(out, rows.stable, _attend_windows(layer, q, bias, scaling, softcap))
        if moves and deferred:
            _move(layer, ranking, stable_ranked, real[n_e:], bias, span)
        layer.rank_all = False
    if rows.n_streaming:
        out = _put(out, rows.streaming, _attend_streaming(layer, q, bias, scaling, softcap))
    return out.view(b, hq, store.value_dim).unsqueeze(1)


def _move(layer, ranking: Ranking, stable_ranked: torch.Tensor, rows: torch.Tensor, bias: StepBias, span) -> None:
    """The new windows of the stable rows that ranked (`stable_ranked` among them; their rows `rows`, a padded place
    on a real row), the last `len(rows)` of `ranking`."""
    n = rows.shape[0]
    move_windows(layer.store, stable_ranked, rows, ranking.pages[ranking.pages.shape[0] - n :], bias.page,
                 layer.promoted, span)


def _put(out: torch.Tensor | None, rows: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """The step's output with `result` as rows `rows` of it (`out` None: `result` covers every row)."""
    return result if out is None else out.index_copy_(0, rows, result)


def _attend_unstable(layer, q, ranking: Ranking, bias: StepBias, scaling, softcap) -> torch.Tensor:
    rows = layer.store.rows
    return attend_chosen(layer, ranking, rows.n_unstable, layer.unstable_page_starts,
                         lambda: q if layer.every_row_unstable else q.index_select(0, rows.unstable),
                         lambda: rows.batch_of.index_select(0, rows.unstable), bias, scaling, softcap)


def attend_chosen(layer, ranking: Ranking, m: int, page_starts: torch.Tensor, queries, sequences, bias: StepBias,
                  scaling, softcap) -> torch.Tensor:
    """Attention of the first `m` rows of `ranking` over the pages it chose for them -> `[m, G, Dv]`: the ranking's own
    logits of those pages re-used where it kept them (refinement, no softcap), else their keys gathered. `page_starts
    [m, 1]`: each row's first page in the near tier (`PageStore.near_index`: the rows are unstable); `queries()` and
    `sequences()` give the rows' queries `[m, G, D]` and sequences `[m]`, read only on the second path."""
    store = layer.store
    chosen = ranking.pages[:m]
    if ranking.logits is not None and softcap is None:  # the ranking's own logits of the chosen pages
        return kernels.chosen_attention(ranking.logits, ranking.top[:m], chosen, page_starts.view(-1),
                                        store.near_v.view(-1, store.value_dim), backend=layer.cfg.backend)
    tok = bias.page_tokens(sequences()[:, None], chosen)
    return attend_near_pages(layer, queries(), (page_starts + chosen).view(-1), tok, scaling, softcap)


def attend_near_pages(layer, queries: torch.Tensor, at: torch.Tensor, tok: torch.Tensor, scaling,
                      softcap) -> torch.Tensor:
    """Attention of `m` rows' `queries [m, G, D]` over pages of the near tier: `at [m * K]` their flat page indices
    (each row's first page, `PageStore.near_index`, plus the pages it reads), `tok [m, K * P]` the tokens' bias. The one
    way unstable and streaming rows find their pages; stable rows read their windows in place."""
    store, backend, p, m = layer.store, layer.cfg.backend, layer.store.page_size, queries.shape[0]
    keys = kernels.gather_pages(store.near_k.view(-1, p, store.head_dim), at, backend=backend)
    values = kernels.gather_pages(store.near_v.view(-1, p, store.value_dim), at, backend=backend)
    return kernels.attention(queries, keys.view(m, -1, store.head_dim), values.view(m, -1, store.value_dim), tok,
                             scaling, softcap, backend=backend)


def _attend_windows(layer, q, bias: StepBias, scaling, softcap) -> torch.Tensor:
    store, rows = layer.store, layer.store.rows
    n_s = rows.n_stable
    every = layer.every_row_stable
    q_s = q if every else q.index_select(0, rows.stable)
    tok = bias.page_rows.index_select(0, store.win_bias_rows[:n_s].view(-1)).view(n_s, -1)
    return kernels.attention(q_s, store.win_k[:n_s], store.win_v[:n_s], tok, scaling, softcap,
                             backend=layer.cfg.backend)


def _attend_streaming(layer, q, bias: StepBias, scaling, softcap) -> torch.Tensor:
    """The LServe-like baseline's streaming rows: the first `streaming_sink_pages` pages and the most recent ones, K in
    all (every page while there are at most K)."""
    store, rows, cfg = layer.store, layer.store.rows, layer.cfg
    k, sink = min(cfg.pages_per_head, store.pages), cfg.streaming_sink_pages
    recent = bias.page - (k - sink - 1) + layer.recent_offsets  # [K - sink]
    pages = torch.where(bias.page < k, layer.first_pages, torch.cat([layer.first_pages[:sink], recent]))
    tok = bias.page_tokens(rows.batch_of.index_select(0, rows.streaming)[:, None], pages)
    return attend_near_pages(layer, q.index_select(0, rows.streaming), (layer.streaming_page_starts + pages).view(-1),
                             tok, scaling, softcap)

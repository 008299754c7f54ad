"""A verification block's decode steps in one set of launches (issue 49, item 4).

Speculative decoding (`fc_hf/speculative.py`) verifies `t` drafted tokens in one forward. Each of them must attend as
it would at its own step of plain decoding: appended, its rows ranked (the unstable rows, and the stable rows whose
staggered re-rank falls on its step), the stable rows that ranked given their new windows, then attention. The steps
depend on each other in three ways only, and the block keeps each:
- the tokens: step `j` sees the tokens up to its own. All `t` are written first; each step's masks (`StepBias.for_block`,
  one sequence per step and sequence) hide the later ones. A page's MinMax entry then holds later tokens only while
  the page is being filled at that step, and that page is always chosen (forced), so no score differs;
- the carried candidates: a ranking takes those of its row's previous one. `PageSelector.rank_block` ranks every entry
  at once, in rounds until the carried pages settle (one round when a row keeps its pages);
- the windows: a stable row's window changes at its ranking. Each query attends the window of its step: the window
  as it stood before the block (in the device tier, the block's tokens appended to it), or the one a ranking in the
  block made (read from the full tier). Every such window attends the queries of the steps it serves (consecutive ones,
  padded to the most any window serves) in one batched attention.

So the work is one ranking of all entries (per round), one gather per kind of row, one attention per kind of window,
whatever `t` is. The schedule (which rows rank at which step) is the host's: a verification is eager. After the block
the layer is as `t` plain steps would leave it, and `marks` returns, for each token, what `crop` restores
(`fc_hf/verify.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode import attend_chosen, attend_near_pages
from .kernels import dispatch as kernels
from .schedule import phase_range
from .tiers import install_windows, newly_resident, plan_windows, window_pages_of


@dataclass
class LayerMark:
    """A layer as it stood before a decode token."""

    length: int
    rank_all: bool
    carried: tuple
    promoted: torch.Tensor
    win_pages: torch.Tensor  # [N_S + 1, W]
    win_shift: torch.Tensor  # [N_S + 1]


@dataclass
class BlockPlan:
    """Which rows rank at which step of a block of `t` tokens, on the host. Entries are the unstable rows of every
    step (step-major), then the stable rows due at each step: `rows`, `steps`, `local` (among the stable rows, -1 for an
    unstable row), `prev` (the entry of the same row at an earlier step, -1 for none)."""

    t: int
    rows: list[int]
    steps: list[int]
    local: list[int]
    prev: list[int]
    n_unstable: int  # entries of unstable rows: t * N_E
    by_local: dict  # stable row -> its entries, in step order

    @classmethod
    def make(cls, layer, held: int, t: int) -> "BlockPlan":
        rows = layer.store.rows
        unstable, stable = rows.unstable_rows, rows.stable_rows
        r, n_s = layer.cfg.rerank_interval, len(stable)
        entries = [(row, j, -1) for j in range(t) for row in unstable]
        for j in range(t):
            if not n_s:
                break
            if layer.rank_all and j == 0:
                due = range(n_s)
            else:
                due = range(*phase_range((held + j - layer.prompt_end + 1) % r, n_s, r))
            entries += [(stable[l], j, l) for l in due]
        last: dict[int, int] = {}
        prev = [-1] * len(entries)
        for e in sorted(range(len(entries)), key=lambda e: entries[e][1]):  # in step order
            prev[e] = last.get(entries[e][0], -1)
            last[entries[e][0]] = e
        by_local: dict[int, list[int]] = {}
        for e, (_, _, local) in enumerate(entries):
            if local >= 0:
                by_local.setdefault(local, []).append(e)  # entries are in step order per row
        return cls(t, [x[0] for x in entries], [x[1] for x in entries], [x[2] for x in entries], prev,
                   t * len(unstable), by_local)

    def last_entries(self, before: int) -> dict[int, int]:
        """The last entry of each row at a step `< before` (the rankings that apply to its token `before`), by row."""
        last: dict[int, int] = {}
        for e, (row, step) in enumerate(zip(self.rows, self.steps)):
            if step < before and (row not in last or self.steps[last[row]] < step):
                last[row] = e
        return last

    def latest(self, local: int, before: int, strict: bool = True) -> int:
        """The last stable entry of stable row `local` at a step `< before` (`<=` without `strict`), -1 for none."""
        found = -1
        for e in self.by_local.get(local, ()):
            if self.steps[e] < before or (not strict and self.steps[e] == before):
                found = e
        return found


def append_block(layer, keys: torch.Tensor, values: torch.Tensor, held: int) -> None:
    """Write the block's `t` tokens `[B, H, t, D]` at positions `held..held + t - 1`: every row's full tier, the MinMax
    entries of the sub-pages they fall in, and each stable row's window as it stands (where the window reaches the
    position; the stable rows that rank in the block get theirs from the full tier)."""
    store = layer.store
    n, d, dv, t = store.n, store.head_dim, store.value_dim, keys.shape[2]
    positions = torch.arange(held, held + t, device=store.device)
    at = (layer.row_starts[:, None] + positions).view(-1)
    k, v = keys.reshape(n * t, d), values.reshape(n * t, dv)
    store.full_k.view(-1, d).index_copy_(0, at, k)
    store.full_v.view(-1, dv).index_copy_(0, at, v)
    if store.near_apart:
        near = store.rows.near
        at = (layer.near_starts[:, None] + positions).view(-1)
        store.near_k.view(-1, d).index_copy_(0, at, keys.reshape(n, t, d).index_select(0, near).view(-1, d))
        store.near_v.view(-1, dv).index_copy_(0, at, values.reshape(n, t, dv).index_select(0, near).view(-1, dv))
    n_s = store.rows.n_stable
    if n_s:
        span = store.win_k.shape[1]
        slot = store.win_shift[:n_s, None] + positions
        inside = (slot >= store.win_base[:n_s, None]) & (slot < store.win_base[:n_s, None] + span)
        slot = torch.where(inside, slot, store.win_base[n_s]).view(-1)  # out of reach: the extra row's first slot
        pick = store.rows.stable
        store.win_k.view(-1, d).index_copy_(0, slot, keys.reshape(n, t, d).index_select(0, pick).view(-1, d))
        store.win_v.view(-1, dv).index_copy_(0, slot, values.reshape(n, t, dv).index_select(0, pick).view(-1, dv))
    sub_len = store.page_size // store.subpages
    subs = torch.tensor(sorted({(held + j) // sub_len for j in range(t)}), device=store.device)
    store.refresh_subpages(subs)
    store.length_t.add_(t)


def attend_block(layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention_mask,
                 scaling: float, softcap: float | None) -> tuple[torch.Tensor, list]:
    """The block's `t` decode steps for `layer`: `query [B, Hq, t, D]` and the tokens' `keys`/`values`
    `[B, H, t, D]` -> (`[B, t, Hq, Dv]`, the state before each token for `crop`: `BlockMarks`)."""
    store, rows, selector, cfg = layer.store, layer.store.rows, layer.selector, layer.cfg
    b, hq, t, d = query.shape
    n, g, dv, dev = store.n, hq // store.heads, store.value_dim, store.device
    held = layer.length
    plan = BlockPlan.make(layer, held, t)
    before = _Before(layer, plan)
    append_block(layer, keys, values, held)
    bias = layer.forward.block_bias(layer, attention_mask, torch.arange(held, held + t, device=dev))
    q = query.permute(2, 0, 1, 3).reshape(t * n, g, d)  # step j's row i at j * N + i
    out = query.new_empty(t * n, g, dv)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731 - host plans
    ranking, carried = None, None
    if plan.rows:
        e_rows, e_steps = as_tensor(plan.rows), as_tensor(plan.steps)
        seq = e_steps * b + rows.batch_of.index_select(0, e_rows)
        # The unstable entries of a step are the unstable rows in the MinMax cache's order: read in place, not gathered.
        minmax = store.minmax_views(0, 0) * t if plan.n_unstable else []
        if len(plan.rows) > plan.n_unstable:
            minmax.append(store.minmax(e_rows[plan.n_unstable :]))
        ranking, carried = selector.rank_block(q.index_select(0, e_steps * n + e_rows), e_rows, seq,
                                               as_tensor(plan.prev), store, bias, scaling, near=plan.n_unstable,
                                               minmax=minmax)
        if plan.n_unstable:
            _unstable(layer, q, ranking, e_rows, e_steps, seq, plan.n_unstable, bias, scaling, softcap, out)
    windows = None
    if rows.n_stable:
        windows = _stable(layer, q, plan, ranking, bias, scaling, softcap, out, as_tensor)
    if rows.n_streaming:
        _streaming(layer, q, t, bias, scaling, softcap, out)
    marks = before.marks(layer, plan, carried, windows)
    _settle(layer, plan, carried, windows, as_tensor)
    store.length = held + t
    if plan.n_unstable:
        layer.note_ranking(type(ranking)(ranking.pages[plan.n_unstable - rows.n_unstable : plan.n_unstable]),
                           rows.n_unstable)
    return out.view(t, b, hq, dv).transpose(0, 1), marks


def _unstable(layer, q, ranking, e_rows, e_steps, seq, m, bias, scaling, softcap, out) -> None:
    """The unstable rows of every step over their chosen pages (the ranking's logits re-used, as a step does)."""
    at = e_steps[:m] * layer.store.n + e_rows[:m]
    starts = layer.store.near_index.index_select(0, e_rows[:m])[:, None] * layer.store.pages
    result = attend_chosen(layer, ranking, m, starts, lambda: q.index_select(0, at),
                           lambda: seq[:m], bias, scaling, softcap)
    out.index_copy_(0, at, result)


@dataclass
class _Windows:
    """The windows the block's stable rankings made: per stable entry its `window [E_S, W]` pages, `shift [E_S]`,
    tokens `keys`/`values [E_S, W * P, D]` (from the full tier) and the pages it promoted `promoted [E_S]`."""

    window: torch.Tensor
    shift: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    promoted: torch.Tensor


def _stable(layer, q, plan: BlockPlan, ranking, bias, scaling, softcap, out, as_tensor) -> _Windows | None:
    """The stable rows: each query over the window of its step (see the module docstring)."""
    store, rows = layer.store, layer.store.rows
    n_s, n, t = rows.n_stable, store.n, plan.t
    k, p = layer.cfg.pages_per_head, store.page_size
    first = plan.n_unstable
    made = None
    # The windows as they stood (views) and the block's own: attended apart, so the stable rows' windows are not copied.
    blocks = [(store.win_k[:n_s], store.win_v[:n_s])]
    tok, source_rows = store.win_bias_rows[:n_s], rows.stable
    if len(plan.rows) > first:
        e_rows, local = as_tensor(plan.rows[first:]), as_tensor(plan.local[first:])
        e_steps = as_tensor(plan.steps[first:])
        page = bias.page.index_select(0, e_steps * store.batch)
        window, _, present = plan_windows(store, ranking.pages[first:], page)
        before = [plan.latest(plan.local[e], plan.steps[e]) for e in range(first, len(plan.rows))]
        old = torch.cat([store.win_pages[:n_s], window]).index_select(0, as_tensor(
            [n_s + b - first if b >= 0 else plan.local[e] for e, b in zip(range(first, len(plan.rows)), before)]))
        fresh = newly_resident(window, old, present).sum(dim=1) if store.host_tier else window.new_zeros(len(local))
        made = _Windows(window, store.win_base.index_select(0, local) + (k - 1 - page) * p,
                        window_pages_of(store, e_rows, window, store.full_k),
                        window_pages_of(store, e_rows, window, store.full_v), fresh)
        blocks.append((made.keys, made.values))
        tok = torch.cat([tok, store.bias_rows(rows.batch_of.index_select(0, e_rows), window)])
        source_rows = torch.cat([source_rows, e_rows])
    m, g = tok.shape[0], q.shape[1]
    # Each query attends the window of its step: the one before the block, or the last ranking's that applies then.
    deferred = layer.cfg.promotion == "deferred"
    uses: list[list[int]] = [[] for _ in range(m)]  # per window, the steps whose query attends it (consecutive)
    window_of = []  # per (step, stable row), step-major
    for j in range(t):
        for local in range(n_s):
            e = plan.latest(local, j, strict=False)
            if e >= 0 and deferred and plan.steps[e] == j and not (layer.rank_all and j == 0):
                e = plan.latest(local, j)  # a deferred move applies after its step's attention
            window_of.append((n_s + e - first) if e >= 0 else local)
            uses[window_of[-1]].append(j)
    # A window attends its steps' queries only: [m, S * G] queries (S: the most steps a window serves; a window serving
    # fewer repeats its last step's, thrown away), each step's masks.
    span = max(len(x) for x in uses)
    start = [x[0] if x else 0 for x in uses]
    steps = as_tensor([[min(s + i, t - 1) for i in range(span)] for s in start])  # [m, S]
    queries = q.index_select(0, (steps * n + source_rows[:, None]).view(-1)).view(m, span * g, -1)
    stride = store.batch * (store.pages + 1)  # one step's block of token-bias page rows
    mask = bias.page_rows.index_select(0, (tok[:, None, :] + (steps * stride)[:, :, None]).view(-1)).view(m, span, 1, -1)
    mask = mask.expand(-1, -1, g, -1).reshape(m, span * g, -1)
    result, begin = [], 0
    for keys, values in blocks:
        end = begin + keys.shape[0]
        result.append(kernels.attention(queries[begin:end], keys, values, mask[begin:end], scaling, softcap,
                                        backend=layer.cfg.backend))
        begin = end
    result = (torch.cat(result) if len(result) > 1 else result[0]).view(m * span, g, -1)
    pick = [w * span + i // n_s - start[w] for i, w in enumerate(window_of)]
    at = (torch.arange(t, device=q.device)[:, None] * n + rows.stable).view(-1)
    out.index_copy_(0, at, result.index_select(0, as_tensor(pick)))
    return made


def _streaming(layer, q, t, bias, scaling, softcap, out) -> None:
    """The streaming rows of every step: the sink and the most recent pages of the step's page being filled."""
    store, rows, cfg = layer.store, layer.store.rows, layer.cfg
    n_x, n, k = rows.n_streaming, store.n, min(cfg.pages_per_head, store.pages)
    sink = cfg.streaming_sink_pages
    page = bias.page.view(t, store.batch)[:, :1]  # [t, 1]: every sequence of a step shares its position
    recent = page - (k - sink - 1) + layer.recent_offsets
    pages = torch.where(page < k, layer.first_pages, torch.cat([layer.first_pages[:sink].expand(t, -1), recent], 1))
    at = (layer.streaming_page_starts.view(1, n_x, 1) + pages[:, None, :]).view(-1)  # [t, N_X, K]
    seq = (torch.arange(t, device=q.device)[:, None] * store.batch + rows.batch_of.index_select(0, rows.streaming))
    tok = bias.page_tokens(seq[:, :, None], pages[:, None, :])
    where = (torch.arange(t, device=q.device)[:, None] * n + rows.streaming).view(-1)
    out.index_copy_(0, where, attend_near_pages(layer, q.index_select(0, where), at, tok.view(t * n_x, -1), scaling,
                                                softcap))


class _Before:
    """What a layer held before the block, for the marks of its tokens."""

    def __init__(self, layer, plan: BlockPlan):
        store = layer.store
        self.length = layer.length
        self.rank_all = layer.rank_all
        self.carried = layer.selector.mark()
        self.promoted = layer.promoted.clone()
        self.win_pages, self.win_shift = store.win_pages.clone(), store.win_shift.clone()

    def marks(self, layer, plan: BlockPlan, carried, made: _Windows | None) -> list:
        """The state before each token `j`: every ranking of the steps before `j` applied (the carried candidates,
        the windows and the pages promoted), the count of tokens `length + j`."""
        t, dev = plan.t, self.promoted.device
        rows = layer.store.n + 1
        first = plan.n_unstable
        carried_rows, window_rows = [], []
        for j in range(t):
            last = plan.last_entries(j)
            carried_rows.append([rows + last[r] if r in last else r for r in range(rows)])
            n_s = self.win_pages.shape[0] - 1
            latest = [plan.latest(l, j) for l in range(n_s)]
            window_rows.append([n_s + 1 + e - first if e >= 0 else l for l, e in enumerate(latest)] + [n_s])
        marks = []
        index = torch.tensor(carried_rows, device=dev)
        if carried is not None:
            pages = torch.cat([self.carried[0], carried[0]]).index_select(0, index.view(-1)).view(t, rows, -1)
            scores = torch.cat([self.carried[1], carried[1]]).index_select(0, index.view(-1)).view(t, rows, -1)
        else:
            pages, scores = (x.expand(t, *x.shape) for x in self.carried)
        windows = torch.tensor(window_rows, device=dev).view(-1)
        win_pages, win_shift = self.win_pages, self.win_shift
        promoted = self.promoted.expand(t)
        if made is not None:
            win_pages = torch.cat([win_pages, made.window])
            win_shift = torch.cat([win_shift, made.shift])
            per_step = torch.zeros(t + 1, dtype=torch.long, device=dev).index_add_(
                0, torch.tensor(plan.steps[first:], device=dev) + 1, made.promoted)
            promoted = self.promoted + per_step.cumsum(0)[:t]
        win_pages = win_pages.index_select(0, windows).view(t, self.win_pages.shape[0], win_pages.shape[1])
        win_shift = win_shift.index_select(0, windows).view(t, self.win_shift.shape[0])
        for j in range(t):
            marks.append(LayerMark(self.length + j, self.rank_all and j == 0, (pages[j], scores[j]), promoted[j],
                                   win_pages[j], win_shift[j]))
        return marks


def _settle(layer, plan: BlockPlan, carried, made: _Windows | None, as_tensor) -> None:
    """Leave the layer as the block's last step would: each row's last carried candidates, each stable row's last
    window, the pages promoted."""
    store, selector = layer.store, layer.selector
    last = plan.last_entries(plan.t)
    if carried is not None and last:
        rows, entries = as_tensor(list(last)), as_tensor(list(last.values()))
        selector.carry_on(rows, carried[0].index_select(0, entries), carried[1].index_select(0, entries))
    if made is not None:
        first = plan.n_unstable
        # Every ranking's window installed as made (no copy): a row's last into the row, the earlier ones into the
        # stable tensors' extra row, which nothing reads.
        local = [store.rows.n_stable] * len(made.window)
        for e in last.values():
            if e >= first:
                local[e - first] = plan.local[e]
        install_windows(store, as_tensor(local), made.window, made.shift, made.keys, made.values)
        layer.promoted.add_(made.promoted.sum())
    layer.rank_all = False

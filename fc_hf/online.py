"""Online head classification: `FlexiCache(config, cache_config, profile="auto")` needs no offline profile.

Warm-up: for the first `W = warmup_steps` decode steps every head is unstable (Quest) and the cache records each
(layer, KV head, row)'s pages. At step W + 1 the trace goes through the profiler's metrics (`fc_hf.stability`), the
`unstable_fraction` of heads unstable in the most windows stay unstable, and each layer re-splits its heads into the
groups a cache built with that profile has (`regroup`), each continuing from its heads' step-W ranking (W is a multiple
of `rerank_interval`). With no window defined yet (the budget covers every sequence) it retries W steps later.
Zero warm-up: the trace is the prompt's last `OBSERVED_QUERIES` positions' own top-K at prefill; without a prefill
query a warm-up of `FALLBACK_STEPS` (rounded up to a multiple of `rerank_interval`) is used instead.
"""

from __future__ import annotations

import math

import torch

from .selection import POS_INF
from .schedule import phase_of
from .stability import count_unstable, select_unstable, temporal_stability

TS_WINDOW = 16  # SPEC §2: W of the temporal stability (the offline profiles use 16 too)
OBSERVED_QUERIES = 32  # prompt positions traced at prefill by the zero-warm-up variant (two TS windows)
FALLBACK_STEPS = 32  # warm-up when `warmup_steps=0` observed nothing


def warmup_period(cfg) -> int:
    """Steps between classification attempts: `warmup_steps`, or the fallback when it is 0."""
    if cfg.warmup_steps:
        return cfg.warmup_steps
    return cfg.rerank_interval * max(1, math.ceil(FALLBACK_STEPS / cfg.rerank_interval))


def check_auto_config(cfg) -> None:
    """Raise `ValueError` unless `cfg` allows `profile="auto"` to end up exactly as a from-start profile."""
    w = cfg.warmup_steps
    if w == 1:
        raise ValueError('profile="auto" needs FlexiCacheConfig.warmup_steps >= 2 (a TS window compares a step with '
                         "later ones), or 0 for the prefill's observation window.")
    interval = cfg.rerank_interval
    if w % interval:
        fix = interval * max(1, round(w / interval))
        raise ValueError(
            f'profile="auto" needs FlexiCacheConfig.warmup_steps ({w}) to be a multiple of rerank_interval ({interval}), '
            f"so the heads are re-split right after a step at which a stable head ranks; try warmup_steps={fix}."
        )
    if cfg.streaming_heads:
        raise ValueError('profile="auto" classifies every KV head; it does not combine with streaming_heads.')


def classify_trace(samples, unstable_fraction: float, window: int = TS_WINDOW):
    """`(unstable set, tally)` of traces `[(topk [D, L, H, K], num_pages [D]), ...]` (one per sample): TS of each,
    then one classification over all their windows; `(None, tally)` when no window is defined."""
    ts_list = [temporal_stability(topk, num_pages, window) for topk, num_pages in samples]
    ts_list = [ts for ts in ts_list if ts.shape[0]]  # a trace shorter than one window has none
    if not ts_list:
        return None, None
    tally = count_unstable(ts_list, unstable_fraction)
    if tally["windows"] == 0:
        return None, tally
    return select_unstable(tally["counts"], tally["ts_sum"] / tally["ts_n"], tally["n_unstable"]), tally


class OnlineClassifier:
    """The warm-up trace of one `FlexiCache` (its FlexiCache layers `layer_ids`, `num_kv_heads` each) and the
    classification made from it (see the module docstring)."""

    def __init__(self, layer_ids: list[int], num_kv_heads: int, cfg):
        self.layer_ids = list(layer_ids)
        self.num_kv_heads = num_kv_heads
        self.cfg = cfg
        self.k = cfg.pages_per_head
        self.period = warmup_period(cfg)
        self.boundary = cfg.warmup_steps  # a layer about to start step boundary + 1 asks `decide`
        self.start = 0  # trace slot i holds decode step start + 1 + i (or, observing, prompt position i of the window)
        self.observing = cfg.warmup_steps == 0  # the trace of attempt 0 comes from the prefill
        self.topk: dict[int, torch.Tensor] = {}  # layer -> [slots, rows, K] selected pages, -1 = none
        self.valid: dict[int, torch.Tensor] = {}  # layer -> [slots, batch] pages of each row (padding excluded)
        self.filled: dict[int, int] = {}  # layer -> trace slots written in this attempt
        self.unstable: set[tuple[int, int]] | None = None
        self.classified_after_step: int | None = None  # the new groups serve steps after this one
        self.postponed_at: list[int] = []
        self.reorders: list[tuple[int, list[int]]] = []  # (decode steps done, batch index) of each batch reshuffle
        self.tally: dict | None = None
        self.window_used: int | None = None
        self.samples = 0
        self.warmup_rankings = 0  # rankings of the warm-up groups, kept for `stats()`

    @property
    def done(self) -> bool:
        return self.unstable is not None

    # -- recording ----------------------------------------------------------------------------
    def _buffers(self, layer: int, slots: int, rows: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        topk = self.topk.get(layer)
        if topk is None or topk.shape[0] < slots or topk.shape[1] != rows:
            self.topk[layer] = torch.full((slots, rows, self.k), -1, dtype=torch.int32, device=device)
            self.valid[layer] = torch.zeros(slots, batch, dtype=torch.int32, device=device)
        return self.topk[layer], self.valid[layer]

    def record_step(self, layer: int, step: int, sel: torch.Tensor, bias, batch: int) -> None:
        """Keep layer `layer`'s selection `sel [B*H, K]` of decode step `step` and, from the step's masks `bias`
        (`StepBias`), the pages each sequence has (no device sync). A page the selection filled up with, one that does
        not exist yet, is recorded as none (-1)."""
        slot = step - self.start - 1
        if self.done or not 0 <= slot < self.period:
            return
        topk, valid = self._buffers(layer, self.period, sel.shape[0], batch, sel.device)
        topk[slot, :, : sel.shape[1]] = torch.where(sel <= bias.page, sel, -1)
        topk[slot, :, sel.shape[1]:] = -1
        valid[slot] = bias.valid_pages()
        self.filled[layer] = slot + 1

    def observe_prefill(self, layer: int, query: torch.Tensor, store, attention_mask) -> None:
        """Trace the prompt's last `OBSERVED_QUERIES` positions of one layer at prefill (zero warm-up): each position's
        top-K by the page score with a decode step's forcing (not refined: that would read every candidate's keys for
        every position). `query [B, Hq, T, D]`, the layer's warm-up `store`, the prefill's mask (`[B, 1, T, L]`) or
        None."""
        if not self.observing or self.done:
            return
        b, hq, t, d = query.shape
        h, p, sub = self.num_kv_heads, store.page_size, store.subpages
        w = min(OBSERVED_QUERIES, t)
        n, g = b * h, hq // h
        length = store.length
        positions = torch.arange(length - w, length, device=query.device)  # absolute token positions
        current = positions // p  # the page being filled at each position
        num_pages = int(current[-1]) + 1
        q = query[:, :, t - w :].reshape(b, h, g, w, d).reshape(n, g * w, d)
        # The Quest bound of every sub-page, max over the sub-pages of a page and over the group (`PageSelector`).
        q2 = torch.cat([q.float().clamp(min=0), q.float().clamp(max=0)], dim=-1)
        bounds = torch.matmul(q2, store.minmax()[:, :, : num_pages * sub].float())  # [N, G*w, Np*S]
        bounds = bounds.view(n, g, w, num_pages, sub).amax(dim=(1, 4))  # [N, w, Np]
        allowed = torch.arange(num_pages, device=query.device)[None, :] <= current[:, None]  # causal, [w, Np]
        allowed = allowed[None].expand(n, w, num_pages)
        page_valid = _page_valid(attention_mask, length, num_pages, p)
        if page_valid is not None:
            allowed = allowed & page_valid[:, None, :].repeat_interleave(h, dim=0)
        scores = bounds.masked_fill(~allowed, float("-inf"))
        topk, valid = self._buffers(layer, max(self.period, w), n, b, query.device)
        topk[:w] = -1
        valid[:w] = allowed.reshape(b, h, w, num_pages)[:, 0].sum(-1).t().to(valid.dtype)  # pages of each row there
        for c in current.unique().tolist():  # a handful of pages: the window spans about w / P of them
            idx = (current == c).nonzero().flatten()
            s = scores[:, idx, : c + 1].reshape(-1, c + 1).clone()  # [N * |idx|, c + 1]
            # The forcing a decode step applies (`StepBias`), relative to this position's page.
            s[:, c] = POS_INF
            pv = None if page_valid is None else page_valid[:, : c + 1].repeat_interleave(h * idx.numel(), dim=0)
            s = _force_sink(s, self.cfg.sink_pages, pv)
            chosen = s.topk(min(self.k, c + 1), dim=-1).indices.view(n, idx.numel(), -1)
            topk[idx, :, : chosen.shape[-1]] = chosen.transpose(0, 1).to(topk.dtype)
        self.filled[layer] = w

    def trace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.topk.values(), *self.valid.values()))

    def select_rows(self, layer: int, batch_index: torch.Tensor, steps_done: int = 0) -> None:
        """Follow a batch reshuffle (beam search) after decode step `steps_done`: new sequence i continues old sequence
        `batch_index[i]`. The reshuffles are kept (`reorders`): a re-split needs where each sequence was at earlier
        steps (`regroup`)."""
        if self.done:
            return
        if layer == self.layer_ids[0]:
            self.reorders.append((steps_done, batch_index.detach().cpu().tolist()))
        if layer not in self.topk:
            return
        index = batch_index.to(self.topk[layer].device)
        heads = torch.arange(self.num_kv_heads, device=index.device)
        rows = (index[:, None] * self.num_kv_heads + heads).reshape(-1)
        self.topk[layer] = self.topk[layer][:, rows]
        self.valid[layer] = self.valid[layer][:, index]

    # -- classification -------------------------------------------------------------------------
    def trace(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The current attempt's trace, one `(topk [D, L, H, K], num_pages [D])` per batch row (on the CPU); L counts
        FlexiCache layers only, D the steps every layer recorded."""
        if not self.topk or any(layer not in self.topk for layer in self.layer_ids):
            return []
        d = min(self.filled.get(layer, 0) for layer in self.layer_ids)
        if d == 0:
            return []
        topk = torch.stack([self.topk[layer][:d].cpu() for layer in self.layer_ids], dim=1).long()  # [D, L, B*H, K]
        valid = self.valid[self.layer_ids[0]][:d].cpu().long()  # [D, B]
        d_, layers, rows, k = topk.shape
        batch = rows // self.num_kv_heads
        per_row = topk.view(d_, layers, batch, self.num_kv_heads, k)
        return [(per_row[:, :, i].contiguous(), valid[:, i].contiguous()) for i in range(batch)]

    def ts_window(self) -> int:
        """TS window of the current attempt: 16 (SPEC §2), or the whole trace when it is shorter (a short warm-up)."""
        return min(TS_WINDOW, OBSERVED_QUERIES if self.observing else self.period)

    def decide(self, step: int) -> set[tuple[int, int]] | None:
        """Classify at the end of decode step `step` (the boundary); None postpones by one period. Each layer about
        to start step `step + 1` asks; the first call classifies, the others get the same answer."""
        if self.done or step != self.boundary:
            return self.unstable
        samples = self.trace()
        found, tally = classify_trace(samples, self.cfg.unstable_fraction, self.ts_window())
        if found is None:
            self.postponed_at.append(step)
            self.observing = False
            self.start = step
            self.boundary = step + self.period
            self.filled = {}
            return None
        self.unstable = {(self.layer_ids[i], h) for i, h in found}
        self.tally = tally
        self.window_used = self.ts_window()
        self.samples = len(samples)
        self.classified_after_step = step
        # The trace stays until each layer has re-split its heads (`regroup` takes a stable row's last ranking from it).
        self.final_trace = self.topk
        self.topk, self.valid, self.filled = {}, {}, {}
        return self.unstable

    def unstable_in(self, layer: int) -> set[int]:
        return {h for l, h in (self.unstable or ()) if l == layer}

    # -- reports -------------------------------------------------------------------------------
    def summary(self) -> dict:
        """What `FlexiCache.stats()["auto_profile"]` shows."""
        out = {
            "warmup_steps": self.cfg.warmup_steps,
            "state": "classified" if self.done else "warming up",
            "observed_prefill": self.cfg.warmup_steps == 0 and self.done and not self.postponed_at,
            "classified_after_step": self.classified_after_step,
            "postponed_at_steps": list(self.postponed_at),
            "unstable": sorted(self.unstable) if self.done else None,
            "samples": self.samples if self.done else None,
            "windows": self.tally["windows"] if self.tally else None,
        }
        return out

    def extra(self) -> dict:
        """How the classification was made, for `HeadProfile.extra`."""
        ts_mean = (self.tally["ts_sum"] / self.tally["ts_n"]).float()
        return {
            "source": 'FlexiCache(profile="auto"): online classification of the run itself',
            "warmup_steps": self.cfg.warmup_steps,
            "classified_after_step": self.classified_after_step,
            "observed_prefill_queries": OBSERVED_QUERIES if self.cfg.warmup_steps == 0 and not self.postponed_at else None,
            "postponed_at_steps": list(self.postponed_at),
            "page_size": self.cfg.page_size,
            "token_budget": self.cfg.token_budget,
            "pages_per_head": self.k,
            "window": self.window_used,
            "unstable_fraction": self.cfg.unstable_fraction,
            "n_unstable": self.tally["n_unstable"],
            "samples": self.samples,
            "windows": self.tally["windows"],
            "layers": list(self.layer_ids),
            "mean_ts": [[None if x != x else round(x, 4) for x in row] for row in ts_mean.double().tolist()],
            "unstable_counts": self.tally["counts"].tolist(),
        }


def _page_valid(attention_mask, length: int, num_pages: int, page_size: int) -> torch.Tensor | None:
    """`[B, Np]`: pages with an attendable token, from a prefill's mask (its last query row), or None."""
    if not isinstance(attention_mask, torch.Tensor):
        return None
    row = attention_mask[:, 0, -1, :length]
    ok = row if row.dtype == torch.bool else row >= 0
    padded = ok.new_zeros(ok.shape[0], num_pages * page_size)
    padded[:, :length] = ok
    return padded.view(ok.shape[0], num_pages, page_size).any(-1)


def _force_sink(scores: torch.Tensor, sink_pages: int, page_valid: torch.Tensor | None) -> torch.Tensor:
    """+inf on each row's first `sink_pages` attendable pages (`StepBias`'s forcing), in place."""
    pages = scores.shape[-1]
    sink = min(int(sink_pages), pages)
    if sink <= 0:
        return scores
    if page_valid is None:
        scores[:, :sink] = POS_INF
        return scores
    first = page_valid.to(torch.int8).argmax(dim=1, keepdim=True)
    idx = (first + torch.arange(sink, device=scores.device)).clamp_(max=pages - 1)
    return scores.scatter_(1, idx, torch.where(page_valid.gather(1, idx), POS_INF, float("-inf")).to(scores.dtype))


def regroup(layer, unstable: set[int]) -> None:
    """Re-split `layer`'s heads (all unstable during the warm-up) into the kinds a cache built with `unstable` has,
    keeping every token: a new store receives the K/V held as a prompt's; each stable row's window takes the warm-up's
    ranking of the step at which a from-start cache last ranked that row (`fc_hf/schedule.py`), and the pages opened
    since; the carried candidates stay."""
    from .rows import HeadKinds
    from .tiers import fill_later_pages, move_windows

    auto = layer.auto
    steps = layer.decode_steps()
    layer.regrouped_after_step = steps
    old_store, carried = layer.store, layer.selector
    kinds = HeadKinds.split(layer.num_kv_heads, unstable, set())
    if old_store is None:
        layer.kinds = kinds
        return
    auto.warmup_rankings += old_store.n * steps
    k, v = old_store.dense()
    held, prompt_end = layer.length, layer.prompt_end
    before = layer.device_bytes()
    layer.kinds = kinds
    layer._build(old_store.batch, old_store.capacity)
    store = layer.store
    layer.ledger.resized(before, 0)
    store.write_prompt(k, v)
    layer.prompt_end_t.fill_(prompt_end)
    layer.selector.restore(carried.mark())  # the old selector's carried candidates go on
    layer.rank_all = steps == 0 and bool(kinds.stable)  # classified from the prefill: the first step ranks them all
    store.aim_windows(held)
    trace = auto.final_trace.pop(layer.layer_idx, None)
    rows = store.rows
    if trace is None or not rows.n_stable or steps == 0:
        return
    scratch = torch.zeros((), dtype=torch.long, device=store.device)
    for j, row in enumerate(rows.stable.tolist()):
        last = _last_ranking(row, store.heads, kinds, steps, layer.cfg.rerank_interval, auto.reorders, store.batch)
        slot = max(0, last - auto.start - 1)
        local = torch.tensor([j], device=store.device)
        index = rows.stable[j : j + 1]
        page = torch.tensor((prompt_end + last - 1) // store.page_size, device=store.device)
        pages = trace[slot].index_select(0, index).long()
        pages = torch.where(pages >= 0, pages, page + 1)  # none: a page that does not exist then
        move_windows(store, local, index, pages, page, scratch)
    fill_later_pages(store, held)


def _last_ranking(row: int, heads: int, kinds, steps: int, interval: int, reorders, batch: int) -> int:
    """The decode step (<= `steps`) at which a from-start cache last ranked the stable row now at `row`: each step
    ranks the stable rows whose place in the batch has that step's phase (`fc_hf/schedule.py`), and a batch reshuffle
    moves a sequence (with its window) to another place, so its places are followed back through `reorders`."""
    b, h = divmod(row, heads)
    stable = list(kinds.stable)
    for step in range(steps, 0, -1):
        position = b
        for done, index in reversed(reorders):  # reshuffles after `step`: where the sequence was at `step`
            if done >= step:
                position = index[position]
        if step == 1 or step % interval == phase_of(position * len(stable) + stable.index(h), batch * len(stable),
                                                     interval):
            return step
    return 1

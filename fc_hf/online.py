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

from . import kernels
from .errors import FlexiCacheError
from .selection import POS_INF
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

    def record_step(self, layer: int, step: int, sel: torch.Tensor, num_pages: int,
                    page_valid: torch.Tensor | None, batch: int) -> None:
        """Keep layer `layer`'s selection `sel [B*H, <=K]` of decode step `step` (no device sync)."""
        slot = step - self.start - 1
        if self.done or not 0 <= slot < self.period:
            return
        topk, valid = self._buffers(layer, self.period, sel.shape[0], batch, sel.device)
        topk[slot, :, : sel.shape[1]] = sel
        topk[slot, :, sel.shape[1]:] = -1
        if page_valid is None:
            valid[slot] = num_pages
        else:
            valid[slot] = page_valid.sum(dim=1)
        self.filled[layer] = slot + 1

    def observe_prefill(self, layer: int, query: torch.Tensor, store, page_valid: torch.Tensor | None) -> None:
        """Trace the prompt's last `OBSERVED_QUERIES` positions of one layer at prefill (zero warm-up): each position's
        top-K by the page score with a decode step's forcing (not refined: that would read every candidate's keys for
        every position). `query [B, Hq, T, D]`, the layer's warm-up `store`, `page_valid [B, Np]` or None."""
        if not self.observing or self.done:
            return
        b, hq, t, d = query.shape
        h, p = self.num_kv_heads, store.page_size
        w = min(OBSERVED_QUERIES, t)
        n, g = b * h, hq // h
        positions = torch.arange(store.length - w, store.length, device=query.device)  # absolute token positions
        current = positions // p  # the page being filled at each position
        num_pages = int(current[-1]) + 1
        q = query[:, :, t - w :].reshape(b, h, g, w, d).reshape(n, g * w, d)
        sub = store.minmax.subpages
        # The Quest bound of every sub-page, max over the sub-pages of a page and over the group (`PageSelector`).
        bounds = kernels.torch_backend.bounds_per_head(q, store.meta, num_pages * sub)  # [N, G*w, Np*S]
        bounds = bounds.view(n, g, w, num_pages, sub).amax(dim=(1, 4))  # [N, w, Np]
        allowed = torch.arange(num_pages, device=query.device)[None, :] <= current[:, None]  # causal, [w, Np]
        allowed = allowed[None].expand(n, w, num_pages)
        if page_valid is not None:
            allowed = allowed & page_valid[:, None, :num_pages].repeat_interleave(h, dim=0)
        scores = bounds.masked_fill(~allowed, float("-inf"))
        topk, valid = self._buffers(layer, max(self.period, w), n, b, query.device)
        topk[:w] = -1
        valid[:w] = allowed.reshape(b, h, w, num_pages)[:, 0].sum(-1).t().to(valid.dtype)  # pages of each row there
        for c in current.unique().tolist():  # a handful of pages: the window spans about w / P of them
            idx = (current == c).nonzero().flatten()
            s = scores[:, idx, : c + 1].reshape(-1, c + 1).clone()  # [N * |idx|, c + 1]
            # The forcing a decode step applies (PageSelector.scores), relative to this position's page.
            s[:, c] = POS_INF
            pv = None if page_valid is None else page_valid[:, : c + 1].repeat_interleave(h * idx.numel(), dim=0)
            s = kernels.force_sink_pages(s, self.cfg.sink_pages, pv)
            chosen = kernels.select_topk(s, self.k).view(n, idx.numel(), -1)
            topk[idx, :, : chosen.shape[-1]] = chosen.transpose(0, 1).to(topk.dtype)
        self.filled[layer] = w

    def trace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.topk.values(), *self.valid.values()))

    def select_rows(self, layer: int, batch_index: torch.Tensor) -> None:
        """Follow a batch reshuffle (beam search): new sequence i continues old sequence `batch_index[i]`."""
        if layer not in self.topk or self.done:
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
        self.topk, self.valid, self.filled = {}, {}, {}  # the trace is not needed any more
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


def regroup(layer, unstable: set[int]) -> None:
    """Re-split `layer`'s heads (one warm-up group) into the groups a cache built with `unstable` would have, keeping
    every token: each new group's store receives its heads' K/V as a prompt's, then takes their last selection (and
    carried candidates) as its own, moving tiers as that ranking would have."""
    if len(layer.groups) != 1:
        raise FlexiCacheError("FlexiCache bug: profile='auto' re-splits a layer whose heads form one warm-up group.")
    warm = layer.groups[0]
    layer.owner.auto.warmup_rankings += warm.rankings
    layer.regrouped_after_step = layer.steps
    if not layer.is_initialized:
        layer.groups = layer._make_groups(unstable, set())
        return
    k, v = layer.dense_kv()
    layer.groups = layer._make_groups(unstable, set())

    def rows(t, idx):  # a warm-up tensor's rows `[B * H, X]` of the heads `idx`
        t = t.view(layer.batch, layer.num_kv_heads, -1)
        return t.index_select(1, idx).reshape(-1, t.shape[-1])

    carried = warm.selector.carried
    for group in layer.groups:
        group.init_store(layer.batch, layer.head_dim, layer.value_dim, layer.dtype, layer.device, layer.owner.ledger)
        idx = group.head_index
        group.append(k.index_select(1, idx), v.index_select(1, idx), prompt=True)
        if warm.sel is not None:
            group.adopt_selection(rows(warm.sel, idx), warm.pages_at_rank,
                                  None if carried is None else tuple(rows(t, idx) for t in carried))
    warm.store.free_device()
    warm.store = None

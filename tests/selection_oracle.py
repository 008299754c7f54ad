"""Drive a FlexiCache with random K/V and queries and check every step against brute force.

`run_case(case)` builds a `RecordingCache` from a tiny config, prefills it through `cache.update`,
then decodes: at every step each layer gets a random key/value through `update` and a random
query through FlexiCache's attention function, exactly the calls a model makes. Between steps it
may reorder the batch (beam search). It raises `AssertionError` at the first difference from:

- the schedule: the unstable rows rank at every step; a stable row at the first step after the prompt and then at
  every step `s` with `s % R` its phase (`fc_hf.schedule`: row `j` of `n` stable rows has phase `floor(j R / n)`);
  streaming rows never;
- the selection: a ranking picks pages whose brute-force scores (`kernels.bruteforce.page_scores_bruteforce`, then
  `refine_scores_bruteforce` with `refine_pages` and the pages the row's last ranking carried, `carried_bruteforce`,
  recomputed from the recorded keys, queries and padding) are the top K (compared as score sets, so exact ties may go
  either way; pages that do not exist yet, which a ranking may fill up with, are none);
- what is read: an unstable row its ranking; a stable row its last ranking plus every page created since (with
  `promotion="deferred"` a ranking after the first takes effect one step late); a streaming row the sink and the most
  recent pages;
- the attention output: brute-force attention over exactly those pages' tokens of the recorded K/V;
- the MinMax metadata: after every append and beam reorder, every full page's entries equal the min/max of the keys it
  was given (`kernels.bruteforce.minmax_bruteforce`).

The messages name which check failed ("selection", "read", "attention", "metadata", "schedule"), so
mutant tests can require the right one to fire.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from conftest import tiny_config
from robustness_helpers import RecordingCache

import fc_hf.decode as decode
from fc_hf import FlexiCacheConfig, HeadProfile
from fc_hf.attention import flexicache_attention_forward
from fc_hf.kernels import bruteforce
from fc_hf.schedule import phase_of
from fc_hf.selection import PageSelector

TOL = 1e-5
NEG_INF = float("-inf")


@contextmanager
def spy(log: dict):
    """Record each layer's ranking (`PageSelector.rank`: the rows it ranked, the pages chosen) and the stable rows'
    window pages at the moment they attend."""
    real_rank, real_windows = PageSelector.rank, decode._attend_windows

    def rank(selector, query, rows, store, bias, scaling, minmax=None, **kw):
        out = real_rank(selector, query, rows, store, bias, scaling, minmax, **kw)
        log["ranked"] = (rows.clone(), out.pages.clone())
        return out

    def windows(layer, *a, **k):
        log["windows"] = layer.store.win_pages[: layer.store.rows.n_stable].clone()
        return real_windows(layer, *a, **k)

    PageSelector.rank, decode._attend_windows = rank, windows
    try:
        yield
    finally:
        PageSelector.rank, decode._attend_windows = real_rank, real_windows


def assert_top_k(chosen: list[int], scores: list[float], k: int, where: str) -> None:
    """`chosen` (pages that exist) are distinct pages whose scores are the `k` largest of `scores` (as a multiset, to a
    tolerance). A page that can never be attended (-inf: no attendable token) and one that does not exist yet are the
    same choice, none, which a ranking may fill its K places up with while there are fewer pages to choose."""
    chosen = [c for c in chosen if c < len(scores)]
    assert len(chosen) == len(set(chosen)) <= k, f"selection {where}: pages {chosen}, K={k}"
    got = sorted((scores[p] for p in chosen if scores[p] != NEG_INF), reverse=True)
    want = [s for s in bruteforce.top_scores_bruteforce(scores, k) if s != NEG_INF]
    assert len(got) == len(want), f"selection {where}: chose pages {sorted(chosen)} ({got}), the top {k} are {want}"
    for a, b in zip(got, want):
        same = a == b if math.isinf(a) or math.isinf(b) else abs(a - b) <= TOL + TOL * abs(b)
        assert same, f"selection {where}: chose pages {sorted(chosen)} with scores {got}, the top {k} are {want}"


class Row:
    """What one (sequence, KV head) row must read: its last ranking, the page being filled then, its carried pages."""

    def __init__(self):
        self.sel: list[int] | None = None
        self.at_rank = 0  # the page being filled at the last ranking
        self.carried: list[int] = []
        self.pending: tuple | None = None  # promotion="deferred": a ranking not in effect yet


def _kinds(layer: int, kv_heads: int, unstable, streaming) -> dict[int, str]:
    unstable = {h for l, h in unstable if l == layer}
    streaming = {h for l, h in streaming if l == layer}
    return {h: "streaming" if h in streaming else "unstable" if h in unstable else "stable" for h in range(kv_heads)}


def run_case(case: dict) -> None:
    """Run one drawn case (see `tests/test_selection_oracle.py`); raises AssertionError on the first mismatch."""
    layers, kv, ratio, d = case["layers"], case["kv_heads"], case["ratio"], case["head_dim"]
    config = tiny_config("llama", layers=layers, heads=kv * ratio, kv_heads=kv, head_dim=d)
    cfg = FlexiCacheConfig(**case["cfg"])
    pairs = [(l, h) for l in range(layers) for h in range(kv)]
    unstable = set(pairs) if case["unstable"] is None else set(case["unstable"])
    profile = None if case["unstable"] is None else HeadProfile.from_unstable(config, unstable)
    cache = RecordingCache(config, cfg, profile, max_cache_len=case["prompt"] + case["decode"])
    g = torch.Generator().manual_seed(case["seed"])
    batch, prompt, scaling = len(case["pads"]), case["prompt"], case["scaling"]
    valid = torch.ones(batch, prompt, dtype=torch.bool)
    for i, pad in enumerate(case["pads"]):
        valid[i, :pad] = False
        if case["holes"][i] is not None:
            start, width = case["holes"][i]
            valid[i, start : min(start + width, prompt - 1)] = False

    def kv_states(t):
        return torch.randn(batch, kv, t, d, generator=g), torch.randn(batch, kv, t, d, generator=g)

    for layer in range(layers):
        cache.update(*kv_states(prompt), layer)
    _check_metadata(cache, cfg, "after prefill")
    rows = {layer: [[Row() for _ in range(kv)] for _ in range(batch)] for layer in range(layers)}
    for step in range(1, case["decode"] + 1):
        valid = torch.cat([valid, valid.new_ones(batch, 1)], 1)
        mask = valid[:, None, None, :]
        for layer in range(layers):
            key, value = cache.update(*kv_states(1), layer)
            query = torch.randn(batch, kv * ratio, 1, d, generator=g)
            log = {}
            with spy(log):
                out, _ = flexicache_attention_forward(None, query, key, value, mask, scaling=scaling)
            kinds = _kinds(layer, kv, unstable, cfg.streaming_heads)
            _check_layer(cache, cfg, kinds, rows[layer], log, layer, step, query, out, valid, scaling)
        _check_metadata(cache, cfg, f"after step {step}")
        if step in case["reorders"]:
            order = case["reorders"][step]
            cache.reorder_cache(torch.tensor(order))
            valid = valid[order]
            rows = {layer: [[_copy(r) for r in rows[layer][b]] for b in order] for layer in rows}
            _check_metadata(cache, cfg, f"after the reorder at step {step}")


def _copy(row: Row) -> Row:
    new = Row()
    new.sel, new.at_rank, new.carried, new.pending = row.sel, row.at_rank, list(row.carried), row.pending
    return new


def _check_layer(cache, cfg, kinds, rows, log, layer, step, query, out, valid, scaling):
    k, p = cfg.pages_per_head, cfg.page_size
    length = valid.shape[1]
    num_pages = -(-length // p)
    page = num_pages - 1
    keys_all, values_all = cache.seen[layer]
    batch, kv = len(rows), len(kinds)
    ratio = query.shape[1] // kv
    stable = [(b, h) for b in range(batch) for h in range(kv) if kinds[h] == "stable"]
    interval = cfg.rerank_interval
    ranked_rows, ranked_pages = log.get("ranked", (torch.empty(0, dtype=torch.long), None))
    ranked_at = {int(r): i for i, r in enumerate(ranked_rows.tolist()) if r < batch * kv}
    for b in range(batch):
        for h in range(kv):
            kind, state, n = kinds[h], rows[b][h], b * kv + h
            where = f"layer {layer} {kind} row {n} step {step}"
            if kind == "unstable":
                due = True
            elif kind == "stable":
                j = stable.index((b, h))
                due = step == 1 or (step >= 2 and step % interval == phase_of(j, len(stable), interval))
            else:
                due = False
            assert (n in ranked_at) == due, f"schedule {where}: ranked={n in ranked_at}, due={due}"
            q = query[b, h * ratio : (h + 1) * ratio, 0]
            new_sel = None
            if due:
                scores = bruteforce.page_scores_bruteforce(q, keys_all[b, h], valid[b], cfg)
                if cfg.candidate_pages:
                    scores = bruteforce.refine_scores_bruteforce(q, keys_all[b, h], valid[b], scores,
                                                                 cfg.candidate_pages, p, scaling, state.carried)
                    if cfg.carried_pages:
                        state.carried = bruteforce.carried_bruteforce(scores, cfg.carried_pages)
                chosen = [c for c in ranked_pages[ranked_at[n]].tolist() if c < num_pages]
                assert_top_k(chosen, scores, k, where)
                new_sel = chosen
            if kind == "unstable":
                want = new_sel
            elif kind == "streaming":
                want = bruteforce.streaming_pages_bruteforce(num_pages, k, cfg.streaming_sink_pages)
            else:
                deferred = cfg.promotion == "deferred" and step > 1
                if due and not deferred:
                    state.sel, state.at_rank = new_sel, page
                want = state.sel + list(range(state.at_rank + 1, num_pages))
                window = [w for w in log["windows"][stable.index((b, h))].tolist() if 0 <= w <= page]
                assert len(window) == len(set(window)) and set(window) == set(want), (
                    f"read {where}: reads pages {sorted(window)}, expected {sorted(set(want))}")
                if due and deferred:
                    state.sel, state.at_rank = new_sel, page
            allowed = torch.zeros(length, dtype=torch.bool)
            for pg in want:
                allowed[pg * p : (pg + 1) * p] = True
            allowed &= valid[b]
            brute = bruteforce.dense_attention_bruteforce(q[None], keys_all[b, h][None], values_all[b, h][None],
                                                          allowed[None], scaling)
            got = out[b, 0, h * ratio : (h + 1) * ratio]
            assert torch.allclose(got, brute[0], rtol=1e-4, atol=1e-5), f"attention {where}: {got} != {brute[0]}"


def _check_metadata(cache, cfg, where):
    p, s = cfg.page_size, cfg.subpages
    for layer in cache.flexi_layers:
        keys = cache.seen[layer.layer_idx][0]
        store = layer.store
        meta = store.minmax().transpose(1, 2).tolist()  # [N, entries, 2D], rows in row order
        d = store.head_dim
        for n in range(store.n):
            b, h = divmod(n, store.heads)
            entries = bruteforce.minmax_bruteforce(keys[b, h], p, s)
            for page, subs in enumerate(entries):
                for j, (kmax, kmin) in enumerate(subs):
                    entry = meta[n][page * s + j]
                    assert entry[:d] == kmax and entry[d:] == kmin, (
                        f"metadata {where}: layer {layer.layer_idx} row {n} page {page} sub-page {j}"
                    )

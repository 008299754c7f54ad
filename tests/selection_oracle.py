"""Drive a FlexiCache with random K/V and queries and check every step against brute force.

`run_case(case)` builds a `RecordingCache` from a tiny config, prefills it through `cache.update`,
then decodes: at every step each layer gets a random key/value through `update` and a random
query through FlexiCache's attention function, exactly the calls a model makes. Between steps it
may reorder the batch (beam search). It raises `AssertionError` at the first difference from:

- the selection: at every step a head group is due (stable: step 1 and every `rerank_interval`;
  unstable: every step; streaming: never) it must rank, and only then; its ranking must pick pages
  whose brute-force scores (`kernels.bruteforce.page_scores_bruteforce`, then
  `refine_scores_bruteforce` with `refine_pages` and the pages the group's last ranking carried,
  `carried_bruteforce`, recomputed from the recorded keys, queries and padding) are the top K
  (compared as score sets, so exact ties may go either way);
- what is read: at a ranking, the new selection (with `promotion="deferred"`, a tiered group's
  later rankings take effect one step late); between rankings, the last selection plus every page
  created since; streaming heads, the sink and the most recent pages;
- the attention output: brute-force attention over exactly those pages' tokens of the recorded K/V;
- the MinMax metadata: after every append, beam reorder and compaction, every full page's entries
  equal the min/max of the keys it was given (`kernels.bruteforce.minmax_bruteforce`).

The messages name which check failed ("selection", "read", "attention", "metadata", "schedule"), so
mutant tests can require the right one to fire.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
from conftest import tiny_config
from deferred_transfers import deferred_transfers
from robustness_helpers import RecordingCache

from fc_hf import FlexiCacheConfig, HeadProfile
from fc_hf.attention import flexicache_attention_forward
from fc_hf.head_group import STABLE, STREAMING, UNSTABLE, HeadGroup
from fc_hf.selection import PageSelector
from fc_hf.kernels import bruteforce

TOL = 1e-5
NEG_INF = float("-inf")


@contextmanager
def spy_groups(log: dict):
    """Record, per head group, the ranking its selector returned (`PageSelector.select`, keyed by the selector) and
    the pages `pages_for_step` returned."""
    real_select, real_pages = PageSelector.select, HeadGroup.pages_for_step

    def select(selector, *a, **k):
        out = real_select(selector, *a, **k)
        log.setdefault(selector, {})["ranked"] = out.clone()
        return out

    def pages(group, *a, **k):
        out = real_pages(group, *a, **k)
        log.setdefault(group, {})["read"] = out.clone()
        return out

    PageSelector.select, HeadGroup.pages_for_step = select, pages
    try:
        yield
    finally:
        PageSelector.select, HeadGroup.pages_for_step = real_select, real_pages


def assert_top_k(chosen: list[int], scores: list[float], k: int, where: str) -> None:
    """`chosen` are distinct pages whose scores are the `k` largest of `scores` (as a multiset, to a tolerance)."""
    assert len(chosen) == len(set(chosen)) == min(k, len(scores)), f"selection {where}: pages {chosen}, K={k}"
    got = sorted((scores[p] for p in chosen), reverse=True)
    want = bruteforce.top_scores_bruteforce(scores, k)
    for a, b in zip(got, want):
        same = a == b if math.isinf(a) or math.isinf(b) else abs(a - b) <= TOL + TOL * abs(b)
        assert same, f"selection {where}: chose pages {sorted(chosen)} with scores {got}, the top {k} are {want}"


class Expected:
    """What one head group must read: its last selection and the pages that existed then."""

    def __init__(self):
        self.sel: list[list[int]] | None = None
        self.at_rank = 0
        self.carried: dict[int, list[int]] = {}  # row -> pages its last refined ranking carries

    def reorder(self, rows: list[int]) -> None:
        if self.sel is not None:
            self.sel = [self.sel[r] for r in rows]
        self.carried = {new: self.carried[old] for new, old in enumerate(rows) if old in self.carried}


def _kinds(layer: int, kv_heads: int, unstable, streaming) -> dict[str, list[int]]:
    unstable = {h for l, h in unstable if l == layer}
    streaming = {h for l, h in streaming if l == layer}
    return {
        STREAMING: sorted(streaming),
        UNSTABLE: sorted(unstable - streaming),
        STABLE: sorted(set(range(kv_heads)) - unstable - streaming),
    }


def run_case(case: dict) -> None:
    """Run one drawn case (see `tests/test_selection_oracle.py`); raises AssertionError on the first mismatch.

    With `case["deferred_copies"]`, tier copies go through the deferred fake backend (`deferred_transfers`).
    """
    with deferred_transfers() if case.get("deferred_copies") else nullcontext():
        _run_case(case)


def _run_case(case: dict) -> None:
    layers, kv, ratio, d = case["layers"], case["kv_heads"], case["ratio"], case["head_dim"]
    config = tiny_config("llama", layers=layers, heads=kv * ratio, kv_heads=kv, head_dim=d)
    cfg = FlexiCacheConfig(**case["cfg"])
    pairs = [(l, h) for l in range(layers) for h in range(kv)]
    unstable = set(pairs) if case["unstable"] is None else set(case["unstable"])
    profile = None if case["unstable"] is None else HeadProfile.from_unstable(config, unstable)
    cache = RecordingCache(config, cfg, profile)
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
    expected = {}
    for step in range(1, case["decode"] + 1):
        valid = torch.cat([valid, valid.new_ones(batch, 1)], 1)
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        for layer in range(layers):
            key, value = cache.update(*kv_states(1), layer)
            query = torch.randn(batch, kv * ratio, 1, d, generator=g)
            log = {}
            with spy_groups(log):
                out, _ = flexicache_attention_forward(None, query, key, value, mask, scaling=scaling)
            fc_layer = cache.layers[layer]
            kinds = _kinds(layer, kv, unstable, cfg.streaming_heads)
            assert {grp.kind: grp.heads for grp in fc_layer.groups} == {k: h for k, h in kinds.items() if h}
            for group in fc_layer.groups:
                state = expected.setdefault(group, Expected())
                where = f"layer {layer} {group.kind} step {step}"
                entry = {**log.get(group, {}), **log.get(group.selector, {})}
                _check_group(cache, cfg, group, state, entry, layer, step, query, out, valid, scaling, where)
        _check_metadata(cache, cfg, f"after step {step}")
        if step in case["reorders"]:
            rows = case["reorders"][step]
            cache.reorder_cache(torch.tensor(rows))
            valid = valid[rows]
            heads_of = {grp: len(grp.heads) for lay in cache.flexi_layers for grp in lay.groups}
            for group, state in expected.items():
                hg = heads_of[group]
                state.reorder([b * hg + j for b in rows for j in range(hg)])
            _check_metadata(cache, cfg, f"after the reorder at step {step}")


def _check_group(cache, cfg, group, state, log, layer, step, query, out, valid, scaling, where):
    k, p = cfg.pages_per_head, cfg.page_size
    length = valid.shape[1]
    num_pages = -(-length // p)
    keys_all, values_all = cache.seen[layer]
    heads = group.heads
    batch, ratio = valid.shape[0], query.shape[1] // cache.layers[layer].num_kv_heads
    rows = [(b, h) for b in range(batch) for h in heads]
    interval = cfg.rerank_interval if group.kind == STABLE else 1
    due = group.kind != STREAMING and (step == 1 or step % interval == 0)
    assert ("ranked" in log) == due, f"schedule {where}: ranked={'ranked' in log}, due={due}"
    read = log["read"].tolist()
    deferred = group.kind == STABLE and cfg.offload and cfg.promotion == "deferred" and step > 1
    new_sel = None
    if due:
        ranked = log["ranked"].tolist()
        for n, (b, h) in enumerate(rows):
            q = query[b, h * ratio : (h + 1) * ratio, 0]
            scores = bruteforce.page_scores_bruteforce(q, keys_all[b, h], valid[b], cfg)
            if cfg.candidate_pages and len(scores) > k:
                scores = bruteforce.refine_scores_bruteforce(q, keys_all[b, h], valid[b], scores, cfg.candidate_pages, p,
                                                             scaling, state.carried.get(n, ()))
                if cfg.carried_pages:
                    state.carried[n] = bruteforce.carried_bruteforce(scores, cfg.carried_pages)
            assert_top_k(ranked[n], scores, k, f"{where} row {n}")
        new_sel = ranked
    for n, (b, h) in enumerate(rows):
        if group.kind == STREAMING:
            want = bruteforce.streaming_pages_bruteforce(num_pages, k, cfg.streaming_sink_pages)
        elif due and not deferred:
            want = new_sel[n]
        else:
            want = state.sel[n] + list(range(state.at_rank, num_pages))
        assert len(read[n]) == len(set(read[n])) and set(read[n]) == set(want), (
            f"read {where} row {n}: reads pages {sorted(read[n])}, expected {sorted(want)}"
        )
        allowed = torch.zeros(length, dtype=torch.bool)
        for page in want:
            allowed[page * p : (page + 1) * p] = True
        allowed &= valid[b]
        q = query[b, h * ratio : (h + 1) * ratio, 0]
        brute = bruteforce.dense_attention_bruteforce(q[None], keys_all[b, h][None], values_all[b, h][None], allowed[None], scaling)
        got = out[b, 0, h * ratio : (h + 1) * ratio]
        assert torch.allclose(got, brute[0], rtol=1e-4, atol=1e-5), f"attention {where} row {n}: {got} != {brute[0]}"
    if due:
        state.sel, state.at_rank = new_sel, num_pages


def _check_metadata(cache, cfg, where):
    p, s = cfg.page_size, cfg.subpages
    for layer in cache.flexi_layers:
        keys = cache.seen[layer.layer_idx][0]
        for group in layer.groups:
            store = group.store
            meta = store.meta.tolist()
            d = store.head_dim
            for n in range(store.rows):
                b, h = divmod(n, len(group.heads))
                entries = bruteforce.minmax_bruteforce(keys[b, group.heads[h]], p, s)
                for page, subs in enumerate(entries):
                    for j, (kmax, kmin) in enumerate(subs):
                        entry = meta[n][page * s + j]
                        assert entry[:d] == kmax and entry[d:] == kmin, (
                            f"metadata {where}: layer {layer.layer_idx} {group.kind} row {n} page {page} sub-page {j}"
                        )

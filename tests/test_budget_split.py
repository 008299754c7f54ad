"""`FlexiCacheConfig(budget_split="mass")` (issue 32, item 2): the model's pages, K per ranked head, split between its
heads by one attention-mass threshold measured at the first decode step (`fc_hf.budget_mass.MassSplit`).

- `MassSplit.allocate` against a brute force: per sequence, forced pages and the floor first, then the candidates of
  largest mass over every ranked head, no head past its ceiling or its candidates; the total is K x ranked heads.
- `choose_counts`: each row's top-`count` candidates by key, forced ones first.
- The whole cache: after the first decode step every ranked head's later rankings keep its allocated count (stable
  tiered heads too, every slot accounted for), a sequence's heads average K pages per ranking, a copy carries its own
  split, a new prompt measures again, and what the split cannot serve is refused with a clear error.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile
from fc_hf.budget_mass import MassSplit, choose_counts, entry_counts

INF = float("inf")


# -- the allocation ---------------------------------------------------------------------------------

def _allocate_bruteforce(reports, k, lo, hi):
    """Per sequence: each row's base (forced pages and the floor, at most its ceiling), then the largest masses among
    what rows may add, one at a time (ties to the earlier row and column)."""
    out = {i: [] for i in reports}
    batch = next(iter(reports.values()))[0].shape[0] // next(iter(reports.values()))[1]
    for b in range(batch):
        rows, pool = [], []
        for i, (key, heads) in reports.items():
            for h in range(heads):
                ranked = sorted(key[b * heads + h].tolist(), reverse=True)
                c = len(ranked)
                most = min(hi, c)
                base = min(max(sum(v == INF for v in ranked), min(lo, c)), most)
                rows.append([i, base])
                pool += [(v if v != -INF else -3e38, len(rows) - 1, j) for j, v in enumerate(ranked) if base <= j < most]
        total = sum(heads for _, heads in reports.values())
        left = max(0, k * total - sum(r[1] for r in rows))
        for _, row, _ in sorted(pool, key=lambda e: (-e[0], e[1], e[2]))[:left]:
            rows[row][1] += 1
        for i, count in rows:
            out[i].append(count)
    # rows are b * heads + h within each group
    result = {}
    for i, (key, heads) in reports.items():
        per_b = [out[i][b * heads:(b + 1) * heads] for b in range(batch)]
        result[i] = [c for chunk in per_b for c in chunk]
    return result


@pytest.mark.parametrize("seed", range(12))
def test_allocation_matches_bruteforce(seed):
    g = torch.Generator().manual_seed(seed)
    batch, c = 2, int(torch.randint(4, 12, (1,), generator=g))
    k, lo = int(torch.randint(2, c, (1,), generator=g)), int(torch.randint(1, 3, (1,), generator=g))
    hi = int(torch.randint(k, c + 3, (1,), generator=g))
    reports = {}
    for i, heads in enumerate([1, 2, 3][: int(torch.randint(1, 4, (1,), generator=g))]):
        mass = torch.softmax(torch.randn(batch * heads, c, generator=g) * 3, dim=1)
        mass = torch.round(mass * 50) / 50  # ties across rows and columns
        key = mass.clone()
        forced = torch.rand(batch * heads, c, generator=g) < 0.15
        key[forced] = INF
        key[torch.rand(batch * heads, c, generator=g) < 0.05] = -INF  # all-padding candidates
        reports[i] = (key, heads)
    split = MassSplit(k, lo, hi)
    got = {i: v.tolist() for i, v in split.allocate(reports).items()}
    assert got == _allocate_bruteforce(reports, k, lo, hi)
    for b in range(batch):  # K per ranked head on average where the bases fit and the candidates suffice
        total = sum(h for _, h in reports.values())
        counts = sum(sum(got[i][b * h:(b + 1) * h]) for i, (_, h) in reports.items())
        bases = sum(min(max(int(torch.isposinf(key[b * h + r]).sum()), min(lo, c)), min(hi, c))
                    for key, h in reports.values() for r in range(h))
        room = sum(min(hi, c) for _, h in reports.values() for _ in range(h))
        assert counts == max(bases, min(k * total, room))


def test_choose_counts_keeps_each_rows_top_by_key():
    cand = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    key = torch.tensor([[0.1, INF, 0.5, 0.2, 0.0], [0.3, 0.2, 0.1, INF, INF]])
    sel, order, counts = choose_counts(cand, key, torch.tensor([3, 1]), hi=4)
    assert counts.tolist() == [3, 2]  # row 1: raised to its two forced candidates
    assert sel.tolist() == [[11, 12, 13], [23, 24, -1]]
    assert order.tolist() == [[1, 2, 3], [3, 4, -1]]
    sel, _, counts = choose_counts(cand, key, torch.tensor([9, 9]), hi=4, trim=False)
    assert counts.tolist() == [5, 5] and sel.shape == (2, 4)  # cut to the candidates; width the ceiling


# -- the whole cache --------------------------------------------------------------------------------

def _decode(model, cache, ids, mask, steps):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), mask


def _config(**kw):
    return FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=3, budget_split="mass",
                            budget_mass_min_pages=1, **kw)


def _groups(cache):
    return [g for layer in cache.flexi_layers for g in layer.groups if g.kind != "streaming"]


@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_rankings_keep_the_allocated_counts(promotion):
    model = tiny_model("llama", layers=3)
    profile = HeadProfile.from_unstable(model.config, [(0, 0), (2, 1)])  # mixed layers, one all stable
    cfg = _config(promotion=promotion)
    cache = FlexiCache(model.config, cfg, profile)
    assert len(cache.mass_split.members) == len(_groups(cache)) == 5
    ids, mask = left_padded_batch(2, 90, pad_lengths=[0, 5])
    _, mask = _decode(model, cache, ids, mask, 1)  # the first decode step: K each, then the split
    counts = [g.selector.split_counts for g in _groups(cache)]
    assert all(c is not None for c in counts)
    for g in _groups(cache):
        assert entry_counts(g.sel).tolist() == [cfg.pages_per_head] * g.store.rows  # step 1 kept K
    k, heads = cfg.pages_per_head, sum(len(g.heads) for g in _groups(cache))
    for b in range(2):
        assert sum(int(c.view(2, -1)[b].sum()) for c in counts) == k * heads  # K per ranked head on average
    assert len({int(v) for c in counts for v in c}) > 1  # the split is not even
    ranked = 0
    for _ in range(8):  # rankings after the split: each row holds its count
        before = [g.rankings for g in _groups(cache)]
        _, mask = _decode(model, cache, ids[:, -1:], torch.cat([mask, torch.ones_like(mask[:, :1])], 1), 0)
        for g, rankings in zip(_groups(cache), before):
            store = g.store
            if g.rankings > rankings and g.pending is None:  # ranked this step, applied
                assert entry_counts(g.sel).tolist() == g.selector.split_counts.tolist()
                ranked += 1
            if g.kind == "stable":
                held = int(entry_counts(g._resident_pages()).sum())
                assert int((store.table[:, : store.num_pages] != 0).sum()) == held == store.slots_in_use()
    assert ranked >= 8
    for b in range(2):  # every group has ranked since the split: the heads' selections average K per head
        assert sum(int(entry_counts(g.sel).view(2, -1)[b].sum()) for g in _groups(cache)) == k * heads


def test_a_copy_carries_its_own_split_and_decodes_as_the_original():
    model = tiny_model("llama", layers=2)
    cache = FlexiCache(model.config, _config(), HeadProfile.from_unstable(model.config, [(0, 0)]))
    ids, mask = left_padded_batch(1, 80)
    _, mask = _decode(model, cache, ids, mask, 3)
    twin = copy.deepcopy(cache)
    assert [id(m) for m in twin.mass_split.members] == [id(g.selector) for g in _groups(twin)]
    assert [m.split_counts.tolist() for m in twin.mass_split.members] == \
        [m.split_counts.tolist() for m in cache.mass_split.members]
    tok = ids[:, -1:]
    a, _ = _decode(model, cache, tok, torch.cat([mask, torch.ones_like(tok)], 1), 6)
    b, _ = _decode(model, twin, tok, torch.cat([mask, torch.ones_like(tok)], 1), 6)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_new_prompt_measures_the_split_again():
    model = tiny_model("llama", layers=2)
    cache = FlexiCache(model.config, _config(), None)
    ids, mask = left_padded_batch(1, 80)
    _, mask = _decode(model, cache, ids, mask, 2)
    assert all(m.split_counts is not None for m in cache.mass_split.members)  # measured at the first step
    turn = left_padded_batch(1, 40, seed=3)[0]
    with torch.no_grad():
        model(input_ids=turn, attention_mask=torch.cat([mask, torch.ones_like(turn)], 1), past_key_values=cache,
              use_cache=True)
    assert all(m.split_counts is None for m in cache.mass_split.members)  # forgotten by the turn
    _decode(model, cache, turn[:, -1:], torch.ones(1, cache.get_seq_length() + 1, dtype=torch.long), 1)
    again = [m.split_counts for m in cache.mass_split.members]
    assert all(c is not None for c in again)  # measured again at the turn's first step
    heads = sum(len(g.heads) for g in _groups(cache))
    assert sum(int(c.sum()) for c in again) == cache.cache_config.pages_per_head * heads


def test_even_split_runs_no_split_code():
    cache = FlexiCache(tiny_model("llama", layers=2).config, FlexiCacheConfig(page_size=4, token_budget=16), None)
    assert cache.mass_split is None and all(g.selector.split is None and not g.variable for g in _groups(cache))


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_split="heads"), 'must be "even"'),
    (dict(budget_split="mass", budget_mass=0.9), "set one"),
    (dict(budget_split="mass", refine_pages=0), "refine_pages=None"),
    (dict(budget_split="mass", tail_estimate=True), "tail_estimate=False"),
    (dict(budget_split="mass", page_score="exact"), "page_score='exact'"),
    (dict(budget_mass_max_pages=8), "budget_split='mass'"),
])
def test_bad_settings_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlexiCacheConfig(page_size=4, token_budget=16, **kwargs)


def test_speculative_decoding_and_auto_are_refused_before_anything_changes():
    model = tiny_model("llama", layers=2)
    cache = FlexiCache(model.config, _config(), None)
    ids = left_padded_batch(1, 60)[0]
    with pytest.raises(FlexiCacheError, match='budget_split="even"'):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4,
                       do_sample=False, prompt_lookup_num_tokens=3, pad_token_id=0)
    assert cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="budget_split='mass'"):
        FlexiCache(model.config, _config(warmup_steps=3), "auto")

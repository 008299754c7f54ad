"""The pages FlexiCache chooses, recomputed by brute force at every step (issue 14, item 1).

A property test (hypothesis) draws shapes, padding, beam reorders and every selection option of
`FlexiCacheConfig` (score_subpages, refine_pages, carry_pages, sink_pages, streaming heads, the
re-rank interval, offload, promotion mode) and runs `selection_oracle.run_case`, which checks the
ranking, what is read between rankings, the attention output and the MinMax metadata against
brute force at every step (see tests/selection_oracle.py). Random continuous K/V and queries make
exact score ties (other than forced and padding pages) a probability-0 event; ties are compared as
score sets anyway.

The mutant tests below apply a known bug with monkeypatch and require the oracle to catch it, with
the check that should fire.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from selection_oracle import run_case

import fc_hf.selection as selection
import fc_hf.store as store_module
from fc_hf.step_bias import StepBias

EXAMPLES = int(os.environ.get("FLEXICACHE_HYPOTHESIS_EXAMPLES", "30"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def cases(draw):
    layers = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 3))
    page_size = draw(st.integers(1, 8))
    k = draw(st.integers(3, 8))
    sink = draw(st.integers(0, min(2, k - 1)))
    prompt = draw(st.integers(2, (k + 3) * page_size + 8))  # mostly more pages than K: ranking has to choose
    batch = draw(st.integers(1, 3))
    decode = draw(st.integers(1, 20))
    pads = [0] + [draw(st.integers(0, prompt - 1)) for _ in range(batch - 1)]
    holes = [draw(st.one_of(st.none(), st.tuples(st.integers(pad, prompt - 1), st.integers(0, 9)))) for pad in pads]
    pairs = [(l, h) for l in range(layers) for h in range(kv_heads)]
    reorder_steps = draw(st.sets(st.integers(1, decode), max_size=3))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    cfg = dict(
        page_size=page_size,
        token_budget=k * page_size,
        rerank_interval=draw(st.integers(1, 7)),
        offload=draw(st.integers(0, 3)) > 0,  # mostly tiered
        promotion=draw(st.sampled_from(["sync", "deferred"])),
        refine_pages=draw(st.sampled_from([0, None, None, k + draw(st.integers(1, 4))])),  # None: the default, 2K
        carry_pages=draw(st.sampled_from([None, None, 0, 2])),  # None: the default, max(1, K // 8)
        score_subpages=draw(st.sampled_from([None] + [s for s in (1, 2, 4) if page_size % s == 0])),  # None: 2 if even
        sink_pages=sink,
        streaming_heads=(draw(st.sampled_from(pairs)),) if draw(st.integers(0, 3)) == 0 else (),
        streaming_sink_pages=draw(st.integers(1, k - 1)),
    )
    return dict(
        layers=layers, kv_heads=kv_heads, ratio=draw(st.sampled_from([1, 2, 3])), head_dim=head_dim,
        prompt=prompt, decode=decode, pads=pads, holes=holes, cfg=cfg,
        unstable=None if draw(st.integers(0, 3)) == 0 else draw(st.sets(st.sampled_from(pairs))),  # None: all unstable
        reorders={s: [draw(st.integers(0, batch - 1)) for _ in range(batch)] for s in sorted(reorder_steps)},
        scaling=draw(st.sampled_from([0.1, head_dim**-0.5, 1.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@SETTINGS
@given(case=cases())
def test_selection_reads_attention_and_metadata_match_bruteforce(case):
    run_case(case)


# -- mutants: each must be caught ------------------------------------------------------------------

# One fixed case with every forcing option on, all heads stable and tiered (re-ranked every 3 steps),
# left padding and two beam reorders.
BASE = dict(
    layers=1, kv_heads=2, ratio=2, head_dim=8, prompt=37, decode=12, pads=[0, 5], holes=[None, None],
    unstable=[], scaling=8**-0.5, seed=7, reorders={4: [1, 0], 8: [1, 1]},
    # refine_pages=0: the mutants below break the Quest bound itself, which refinement would partly hide.
    cfg=dict(page_size=4, token_budget=24, rerank_interval=3, sink_pages=1, refine_pages=0),
)


def _case(**cfg):
    return {**BASE, "cfg": {**BASE["cfg"], **cfg}}


def test_fixed_case_passes():
    """The fixed case the mutants run on is itself correct (so a mutant's failure is the mutant's)."""
    for promotion in ("sync", "deferred"):
        run_case(_case(promotion=promotion, score_subpages=2))
    run_case(_case(refine_pages=9))
    run_case(_case(refine_pages=None))  # the default (2K)
    run_case(CARRY)


# Refinement over 9 of 13+ pages with 2 carried pages (and their successors): the carried candidates decide rankings.
CARRY = {**_case(refine_pages=9, carry_pages=2), "unstable": [(0, 0)], "decode": 16}


def test_mutant_kmax_kmin_swapped_in_scoring(monkeypatch):
    real = selection.kernels.page_scores

    def swapped(query, meta, *args, **kwargs):
        blocks = [meta] if isinstance(meta, torch.Tensor) else meta  # the cache's views, or a gathered copy
        d = blocks[0].shape[1] // 2
        return real(query, [torch.cat([m[:, d:], m[:, :d]], 1) for m in blocks], *args, **kwargs)

    monkeypatch.setattr(selection.kernels, "page_scores", swapped)
    with pytest.raises(AssertionError, match="^selection"):
        run_case(_case())


def test_mutant_kmax_kmin_swapped_when_written(monkeypatch):
    real = store_module.PageStore.write_meta

    def swapped(self, first, end, *args):
        real(self, first, end, *args)
        s, d = self.subpages, self.head_dim
        entries = self.meta[:, :, first * s : end * s]
        entries.copy_(torch.cat([entries[:, d:], entries[:, :d]], 1))

    monkeypatch.setattr(store_module.PageStore, "write_meta", swapped)
    with pytest.raises(AssertionError, match="^metadata after prefill"):
        run_case(_case())


def _stale_metadata_after_reorder(monkeypatch):
    """Mutant: beam reorders move the pages but not the MinMax cache."""
    real = store_module.PageStore.select_rows

    def stale(self, batch_index):
        old = self.meta.clone()
        real(self, batch_index)
        self.meta.copy_(old)

    monkeypatch.setattr(store_module.PageStore, "select_rows", stale)


def test_mutant_stale_metadata_after_reorder(monkeypatch):
    _stale_metadata_after_reorder(monkeypatch)
    with pytest.raises(AssertionError, match="^metadata after the reorder at step 4"):
        run_case(_case())


def test_mutant_stale_metadata_caught_by_selection_alone(monkeypatch):
    """Without the metadata check, the stale MinMax cache still shows as a wrong selection."""
    import selection_oracle

    _stale_metadata_after_reorder(monkeypatch)
    monkeypatch.setattr(selection_oracle, "_check_metadata", lambda *a: None)
    with pytest.raises(AssertionError, match="^selection"):
        run_case(_case())


def test_mutant_sink_one_page_late(monkeypatch):
    real = StepBias.update

    def late(self, mask, position):
        real(self, mask, position)
        entries = self.pages.view(self.batch, self.num_pages, self.subpages)
        first = entries[:, :, 0]
        sink = torch.isposinf(first) & (torch.arange(self.num_pages) != self.page)  # the sink pages
        moved = torch.roll(sink, 1, dims=1)
        first.masked_fill_(sink & ~moved, 0.0).masked_fill_(moved & ~sink, float("inf"))

    monkeypatch.setattr(StepBias, "update", late)
    with pytest.raises(AssertionError, match="^selection"):
        run_case(_case())


def test_mutant_refinement_skipped(monkeypatch):
    """refine_pages set, but the top K of the proposal score are kept as they are."""
    real = selection.PageSelector.rank

    def bound_only(self, *args, **kwargs):
        refine, self.refine = self.refine, 0
        try:
            return real(self, *args, **kwargs)
        finally:
            self.refine = refine

    monkeypatch.setattr(selection.PageSelector, "rank", bound_only)
    with pytest.raises(AssertionError, match="^selection"):
        run_case(_case(refine_pages=9))


def test_mutant_carried_pages_dropped(monkeypatch):
    """A ranking forgets what the previous one carried."""
    real = selection.PageSelector._carry_out

    def nothing(self, *args):
        pages, scores = real(self, *args)
        return pages, torch.full_like(scores, float("-inf"))

    monkeypatch.setattr(selection.PageSelector, "_carry_out", nothing)
    monkeypatch.setenv("FLEXICACHE_BACKEND", "torch")  # `_carry_out` is the PyTorch path's; `choose` carries its own
    with pytest.raises(AssertionError, match="^selection"):
        run_case(CARRY)


def test_mutant_carried_successors_dropped(monkeypatch):
    """Only the carried pages themselves, not the page after each, become candidates."""
    real = selection.PageSelector._carry_out

    def no_successor(self, *args):
        pages, scores = real(self, *args)
        scores = scores.clone()
        scores[:, 1::2] = float("-inf")  # the successors' entries (after each page's own) carry nothing
        return pages, scores

    monkeypatch.setattr(selection.PageSelector, "_carry_out", no_successor)
    monkeypatch.setenv("FLEXICACHE_BACKEND", "torch")  # `_carry_out` is the PyTorch path's; `choose` carries its own
    with pytest.raises(AssertionError, match="^selection"):
        run_case(CARRY)


def test_mutant_stable_heads_forget_pages_created_since_rank(monkeypatch):
    """A window drops the pages opened after its ranking (they are not read)."""
    real = store_module.PageStore.window_tokens

    def forgetful(self, local=None, window=None, seq=None):
        k = self.cfg.pages_per_head
        if window is not None:
            window = window.clone()
            window[:, k:] = -1
        saved = self.win_pages[:, k:].clone()
        self.win_pages[:, k:] = -1
        real(self, local, window, seq)
        self.win_pages[:, k:] = saved

    monkeypatch.setattr(store_module.PageStore, "window_tokens", forgetful)
    with pytest.raises(AssertionError, match="^attention"):
        run_case(_case(offload=False))

"""Copies of one prefilled cache are independent (`copy.deepcopy`, the docs' "one document, many questions").

Several copies of one prefilled cache, and the original after them, are continued interleaved (a turn on one, a turn
on another, ...), with turns long enough that each one's host tier grows past what the prefill allocated (the caches
are made with a capacity of the document and a few tokens, `max_cache_len`). At a full
budget every copy must equal a `DynamicCache` copy used the same way, turn by turn (tokens exactly, logits to fp32
rounding); at a low budget (sparse decoding) copies continued the same way must agree bit for bit, and each copy must
produce exactly what a fresh copy continued alone produces. Copies that shared host memory fail both:
`test_copies_sharing_the_host_tier_are_caught` runs them under a deepcopy that shares it.
"""

import copy

import pytest
from conftest import tiny_model
from test_tokens_on_filled_cache import FULL, LOW, _batch, _generate, _mixed, _more, _same
from transformers import DynamicCache

from fc_hf import FlexiCache
from fc_hf.compat import cache_kwargs

pytestmark = pytest.mark.usefixtures("no_grad")

NEW = 4  # tokens generated per turn

# (cache, new prompt tokens, their seed) in turn order. With pages of 4 a 43-token document leaves 10 full pages on the
# host; the short turns first write into the host capacity that prefill allocated (where copies sharing host memory
# would overwrite each other's pages, read back by that copy's next turn), the long ones make every host tier grow.
FULL_TURNS = [("a", 9, 1), ("b", 7, 2), ("c", 11, 3), ("a", 30, 4), ("orig", 8, 5), ("b", 60, 6), ("a", 45, 7),
              ("c", 70, 8), ("orig", 75, 9), ("b", 6, 10), ("a", 5, 11)]


def _continue(model, caches, turns, start):
    """Run `turns` on `caches` ({name: cache}; turns of other names are skipped), each name's conversation growing
    from `start` ((ids, mask) of the prefilled document) by a turn's new tokens, then `NEW` generated ones.
    Returns {name: [generate output per turn]} and {name: [whether its host tier grew in that turn]}."""
    convo = {name: start for name in caches}
    outs = {name: [] for name in caches}
    grew = {name: [] for name in caches}
    for name, tokens, seed in turns:
        if name not in caches:
            continue
        ids, mask = _more(*convo[name], tokens, seed)
        cache = caches[name]
        flexi = isinstance(cache, FlexiCache)
        host = cache.memory_report()["host_kv_bytes"] if flexi else 0
        out = _generate(model, ids, mask, cache, new=NEW)
        if flexi:
            grew[name].append(cache.memory_report()["host_kv_bytes"] > host)
        outs[name].append(out)
        convo[name] = (out.sequences, mask)  # `_more` extends the mask over the generated tokens
    return outs, grew


def _prefill(model, cache, doc, doc_mask):
    model(input_ids=doc, attention_mask=doc_mask, **cache_kwargs(model, cache))
    return cache


def _full_budget_copies_equal_dynamic_cache(model, batch):
    doc, doc_mask = _batch(batch, 43)
    results = {}
    for kind, make in (("dense", lambda: DynamicCache(config=model.config)),
                       ("flexi", lambda: FlexiCache(model.config, FULL, _mixed(model), max_cache_len=64))):
        orig = _prefill(model, make(), doc, doc_mask)
        caches = {"a": copy.deepcopy(orig), "b": copy.deepcopy(orig), "c": copy.deepcopy(orig), "orig": orig}
        results[kind] = _continue(model, caches, FULL_TURNS, (doc, doc_mask))
    (dense, _), (flexi, grew) = results["dense"], results["flexi"]
    for name in dense:
        for turn, (out, ref) in enumerate(zip(flexi[name], dense[name])):
            try:
                _same(out, ref)
            except AssertionError as e:
                raise AssertionError(f"{name}'s turn {turn} differs from DynamicCache's: {e}") from e
    return flexi, grew


@pytest.mark.parametrize("batch", [1, 3])
def test_copies_continued_interleaved_equal_dynamic_cache_copies_at_full_budget(batch):
    """Three copies and the original, turns interleaved across host-tier growth: each equals its DynamicCache twin."""
    model = tiny_model("llama")
    _, grew = _full_budget_copies_equal_dynamic_cache(model, batch)
    for name, turns in grew.items():
        assert any(turns), f"{name}'s host tier never grew: the turns are too short to test growth"


# Sparse: a and b are continued the same way (the same new tokens), c and the original each their own way, all
# interleaved. A 150-token document leaves 37 full pages on the host; the turns of 60 tokens and more grow it.
LOW_TURNS = [("a", 9, 1), ("b", 9, 1), ("c", 13, 2), ("a", 7, 3), ("c", 60, 4), ("b", 7, 3), ("orig", 5, 5),
             ("a", 70, 6), ("b", 70, 6), ("c", 6, 7), ("orig", 80, 8), ("a", 5, 9), ("b", 5, 9)]


def _low_budget_copies_are_independent(model, batch):
    doc, doc_mask = _batch(batch, 150)
    orig = _prefill(model, FlexiCache(model.config, LOW, _mixed(model), max_cache_len=192), doc, doc_mask)
    pristine = copy.deepcopy(orig)  # never continued: the fresh copies below are made from it
    caches = {"a": copy.deepcopy(orig), "b": copy.deepcopy(orig), "c": copy.deepcopy(orig), "orig": orig}
    outs, grew = _continue(model, caches, LOW_TURNS, (doc, doc_mask))
    for turn, (a, b) in enumerate(zip(outs["a"], outs["b"])):  # continued the same way: the same, bit for bit
        try:
            _same(a, b, atol=0)
        except AssertionError as e:
            raise AssertionError(f"copies a and b continued the same way differ at turn {turn}: {e}") from e
    for name in caches:  # each as a fresh copy continued alone (its turns, the same tokens)
        fresh, _ = _continue(model, {name: copy.deepcopy(pristine)}, LOW_TURNS, (doc, doc_mask))
        for turn, (out, ref) in enumerate(zip(outs[name], fresh[name])):
            try:
                _same(out, ref, atol=0)
            except AssertionError as e:
                raise AssertionError(f"{name}'s turn {turn} differs from a fresh copy continued alone: {e}") from e
    return grew


@pytest.mark.parametrize("batch", [1, 3])
def test_copies_at_low_budget_are_independent(batch):
    """Sparse decoding (budget 16 of 150+ tokens): copies continued alike agree; none is changed by another's turns."""
    model = tiny_model("llama")
    grew = _low_budget_copies_are_independent(model, batch)
    for name, turns in grew.items():
        assert any(turns), f"{name}'s host tier never grew: the turns are too short to test growth"


def test_copies_sharing_the_host_tier_are_caught(monkeypatch):
    """The tests above have teeth: under a deepcopy whose copies share the original's full tier (the stable heads' host
    tier; everything else copied) both fail. If this test fails because nothing was caught, the scenarios no longer
    write into a shared tier before reading it back: update the mutation."""
    from fc_hf.store import PageStore

    shared = []

    def sharing(self, memo):
        new = PageStore.__new__(PageStore)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in ("full_k", "full_v") else copy.deepcopy(value, memo)
        shared.append(True)
        return new

    monkeypatch.setattr(PageStore, "__deepcopy__", sharing, raising=False)
    model = tiny_model("llama")
    with pytest.raises(AssertionError, match="differs from DynamicCache's"):
        _full_budget_copies_equal_dynamic_cache(model, 1)
    assert shared
    shared.clear()
    with pytest.raises(AssertionError, match="differs from a fresh copy continued alone"):
        _low_budget_copies_are_independent(model, 1)
    assert shared

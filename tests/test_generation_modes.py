"""Every `generate` mode a user may reach with a FlexiCache: what works matches dense, what cannot work refuses clearly.

Greedy / beam search / `cache=` + sampling at a full budget are in test_core_equivalence.py; here:
sampling with several return sequences and beam sampling, left padding at a LOW budget, stopping
criteria, a 2k-token generation, both cache spellings, assisted decoding and prompt lookup, and the refused paths
(static cache, torch.compile).
"""

import pytest
import torch
import transformers
from conftest import left_padded_batch, tiny_model
from packaging.version import Version
from robustness_helpers import RecordingCache, forced_decode, tiny_tokenizer, words
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError, HeadProfile
from fc_hf.schedule import ranked_rows

FULL = FlexiCacheConfig(page_size=4, token_budget=128, rerank_interval=3)
LOW = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=5)
HAS_CACHE_KWARG = Version(transformers.__version__) >= Version("5.24.0")


# One torch thread comes from conftest.py; every test here runs without autograd.
pytestmark = pytest.mark.usefixtures("no_grad")


def _mixed(config):
    return HeadProfile.from_unstable(config, [(0, 1)])  # layer 0 mixed, layer 1 all stable (tiered)


def _gen(model, ids, mask, cache, **kw):
    kw.setdefault("max_new_tokens", 10)
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, pad_token_id=0, **kw)


@pytest.mark.parametrize(
    "kw",
    [dict(do_sample=True, num_return_sequences=3, top_k=20), dict(do_sample=True, num_beams=2, num_return_sequences=2)],
    ids=["sample-n3", "beam-sample"],
)
def test_sampling_modes_match_dense_at_full_budget(kw):
    model = tiny_model("llama")
    ids, mask = left_padded_batch(2, 23, pad_lengths=[0, 6])
    torch.manual_seed(11)
    ref = _gen(model, ids, mask, DynamicCache(config=model.config), **kw)
    torch.manual_seed(11)
    cache = FlexiCache(model.config, FULL, _mixed(model.config))
    out = _gen(model, ids, mask, cache, **kw)
    assert torch.equal(out, ref)
    assert cache.layers[0].batch == out.shape[0]  # the cache followed generate's expansion of the batch


@pytest.mark.parametrize("profile", ["quest", "mixed"])
def test_left_padding_at_low_budget_equals_unpadded_rows(profile):
    """Pads that are whole pages must not change what a row attends to, even when pages are dropped.

    A row padded by a multiple of page_size has the same pages as the row alone, shifted by whole
    pages; padding pages must never be chosen over real ones, and the logits must agree with the
    unpadded single-row run at every step (rows longer and shorter than the budget, and a row with
    fewer real pages than K while the batch has more).
    """
    model = tiny_model("llama")
    prof = None if profile == "quest" else _mixed(model.config)
    # Every row ranks at every step here (R = 1): a stable row's phase follows its place in the batch
    # (fc_hf/schedule.py), so at R > 1 a row alone ranks at other steps than in the batch; padding is checked there by
    # tests/test_selection_oracle.py.
    low = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=1)
    g = torch.Generator().manual_seed(0)
    lens = [45, 37, 29, 5]  # pads 0, 8, 16, 40: multiples of page_size 4
    width = max(lens)
    rows = [torch.randint(1, 97, (n,), generator=g) for n in lens]
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    forced = torch.randint(1, 97, (len(lens), 30), generator=g)
    batch = forced_decode(model, FlexiCache(model.config, low, prof), ids, mask, forced)
    for i, r in enumerate(rows):
        alone = forced_decode(model, FlexiCache(model.config, low, prof), r[None], torch.ones(1, len(r), dtype=torch.long),
                              forced[i : i + 1])
        torch.testing.assert_close(batch[i], alone[0], rtol=1e-5, atol=1e-5, msg=f"row {i} (pad {width - len(r)})")


def test_eos_stops_rows_independently_and_matches_dense():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(3, 25, pad_lengths=[0, 4, 9])
    free = _gen(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=12, do_sample=False)
    eos = int(free[0, 25 + 3])  # row 0 stops at its 4th new token; the others may run on
    ref = _gen(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=12, do_sample=False, eos_token_id=eos)
    cache = FlexiCache(model.config, FULL, _mixed(model.config))
    out = _gen(model, ids, mask, cache, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, ref)
    assert (out[0, 25 + 4 :] == 0).all()  # row 0 finished and was padded


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_custom_stopping_criteria_and_stop_strings():
    model = tiny_model("llama")
    tok = tiny_tokenizer()
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, LOW, _mixed(model.config))
    out = _gen(model, ids, mask, cache, max_new_tokens=30, do_sample=False, stopping_criteria=StoppingCriteriaList([_StopAfter(27)]))
    assert out.shape[1] == 27 and cache.get_seq_length() == 26
    free = _gen(model, ids, mask, FlexiCache(model.config, LOW, _mixed(model.config)), max_new_tokens=12, do_sample=False)
    stop = tok.convert_ids_to_tokens(int(free[0, 20 + 5]))  # the 6th new token's text
    first = next(i for i in range(20, 32) if int(free[0, i]) == int(free[0, 25]))
    out = _gen(model, ids, mask, FlexiCache(model.config, LOW, _mixed(model.config)), max_new_tokens=12, do_sample=False,
               stop_strings=[stop], tokenizer=tok)
    assert out.shape[1] == first + 1 and torch.equal(out[0], free[0, : first + 1])


def test_long_generation_2k_tokens_low_budget():
    """2048 new tokens, K=8 pages of 8, tiers on: runs, re-ranks on schedule, loses nothing, stays bounded."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=8)
    ids, mask = left_padded_batch(2, 30, pad_lengths=[0, 9])
    cfg = FlexiCacheConfig(page_size=8, token_budget=64, rerank_interval=16)
    cache = RecordingCache(model.config, cfg, _mixed(model.config))
    out = _gen(model, ids, mask, cache, max_new_tokens=2048, min_new_tokens=2048, do_sample=False)
    assert out.shape == (2, 30 + 2048)
    st = cache.stats()
    assert st["decode_steps"] == 2047
    # Rows ranked: layer 0 has 2 stable rows (batch 2 x 1 head), layer 1 four, each row every 16 steps at its phase.
    literal = sum(1 for n in (2, 4) for j in range(n) for s in range(1, 2048) if s == 1 or s % 16 == j * 16 // n)
    assert st["reranks_stable"] == ranked_rows(2047, 2, 16) + ranked_rows(2047, 4, 16) == literal
    assert st["reranks_unstable"] == 2 * 2047 and st["pages_promoted"] > 0  # layer 0's unstable rows, every step
    cache.assert_nothing_lost("after 2048 tokens")
    mem = cache.memory_report()
    assert mem["host_kv_bytes"] > 0
    assert mem["device_kv_bytes"] < 0.4 * mem["dense_kv_bytes"]  # 1 unstable head of 4, the rest ~K+R/P pages of 260


def test_long_generation_2k_tokens_full_budget_equals_dense():
    """Teacher-forced along dense's own 2048-token greedy continuation, logits agree at every step."""
    model = tiny_model("llama", layers=1, heads=4, kv_heads=2, head_dim=8)
    ids, mask = left_padded_batch(1, 24)
    ref = _gen(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=2048, min_new_tokens=2048,
               do_sample=False, output_logits=True, return_dict_in_generate=True)
    forced = ref.sequences[:, 24:-1]
    cfg = FlexiCacheConfig(page_size=16, token_budget=2080, rerank_interval=16)
    logits = forced_decode(model, FlexiCache(model.config, cfg, _mixed(model.config)), ids, mask, forced)
    dense = torch.stack(ref.logits[1:], 1)
    torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spelling", ["past_key_values", "cache"])
def test_both_cache_spellings_low_budget(spelling):
    if spelling == "cache" and not HAS_CACHE_KWARG:
        pytest.skip("transformers < 5.24 has no `cache=` argument")
    model = tiny_model("llama")
    ids, mask = left_padded_batch(2, 33, pad_lengths=[0, 5])
    base = FlexiCache(model.config, LOW, _mixed(model.config))
    ref = _gen(model, ids, mask, base, do_sample=False)
    cache = FlexiCache(model.config, LOW, _mixed(model.config))
    out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=10, do_sample=False,
                         **{spelling: cache})
    assert torch.equal(out, ref) and cache.stats() == base.stats()


@pytest.mark.parametrize("kw", [dict(assistant="model"), dict(prompt_lookup_num_tokens=3)], ids=["assistant", "prompt-lookup"])
def test_assisted_decoding_gives_greedy_tokens(kw):
    """Assisted decoding and prompt lookup crop the cache after each verification: FlexiCache takes the rejected
    tokens back exactly, so the tokens are plain greedy decoding's (tests/test_speculative.py goes further)."""
    model = tiny_model("llama")
    if kw.get("assistant"):
        kw = dict(assistant_model=tiny_model("llama", seed=1))
    ids, _ = left_padded_batch(1, 20)
    ids = torch.cat([ids, ids[:, 4:12]], 1)  # a repeated span: prompt lookup has candidates
    ref = _gen(model, ids, torch.ones_like(ids), FlexiCache(model.config, LOW, _mixed(model.config)), do_sample=False,
               max_new_tokens=24)
    cache = FlexiCache(model.config, LOW, _mixed(model.config))
    assert cache.is_croppable
    out = _gen(model, ids, torch.ones_like(ids), cache, do_sample=False, max_new_tokens=24, **kw)
    assert torch.equal(out, ref)


def test_static_cache_implementation_refused():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, LOW)
    with pytest.raises(ValueError, match="cache_implementation.*Please use only one"):
        _gen(model, ids, mask, cache, cache_implementation="static")
    assert cache.get_seq_length() == 0


def test_generation_without_use_cache_refused():
    """`use_cache=False` re-feeds the whole sequence each step; FlexiCache must refuse, not double-append."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(1, 20)
    cache = FlexiCache(model.config, LOW)
    with pytest.raises(FlexiCacheError, match="use_cache=False"):
        _gen(model, ids, mask, cache, use_cache=False, max_new_tokens=3, do_sample=False)
    assert cache.get_seq_length() == 20


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_half_precision_full_budget_close_to_dense(dtype, atol):
    model = tiny_model("llama").to(dtype)
    ids, mask = left_padded_batch(2, 40, pad_lengths=[0, 5])
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = _gen(model, ids, mask, DynamicCache(config=model.config), **kw)
    out = _gen(model, ids, mask, FlexiCache(model.config, FULL, _mixed(model.config)), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=atol)
    low = _gen(model, ids, mask, FlexiCache(model.config, LOW, _mixed(model.config)), **kw)
    assert all(torch.isfinite(x).all() for x in low.logits)
    assert low.sequences.dtype == torch.long


def test_pipeline_style_words_tokenizer_roundtrip():
    """The tiny tokenizer used by the pipeline tests maps words to ids and back."""
    tok = tiny_tokenizer()
    assert tok(words([5, 6, 90]))["input_ids"] == [5, 6, 90]
    assert tok.decode([5, 6, 90]) == "w5 w6 w90"

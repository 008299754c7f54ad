"""What FlexiCache reads of transformers' `generate` from the call stack (`fc_hf/speculative.py`): no public hook passes
it, so these fail loudly on any supported transformers version (5.17-5.x) where it moved. `make test` runs them on the
newest, `make test-oldest` on 5.17."""

import copy
import sys

import pytest
import torch
from conftest import tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, FlexiCacheError
from fc_hf import cache as cache_module
from fc_hf import speculative
from fc_hf.compat import cache_kwargs

pytestmark = pytest.mark.usefixtures("no_grad")


def test_generate_prefill_stage_is_found(monkeypatch):
    """Every forward of generate's prompt stage (a chunked prompt of 2 x 64 + 1 tokens, its last chunk one token) is
    found inside `GenerationMixin._prefill`, and no decode step is."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    seen = []
    real = speculative.in_prefill

    def spy():
        found = real()
        if sys._getframe(1).f_code.co_name == "_start_forward":  # a forward's own question (`is_compileable` asks too)
            seen.append(found)
        return found

    monkeypatch.setattr(cache_module, "in_prefill", spy)
    ids = torch.randint(3, 90, (1, 129), generator=torch.Generator().manual_seed(0))
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=8, token_budget=32))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, prefill_chunk_size=64,
                   **cache_kwargs(model, cache))
    assert seen == [True, False, False, False]  # asked for one-token forwards only: the last chunk, then 3 steps
    assert not real()  # and outside generate, nothing is found


def test_assisted_loop_prompt_is_found(monkeypatch):
    """Prompt lookup starts recording from transformers' assisted loop: FlexiCache finds the loop's prompt there."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    found = []
    real = speculative.assisted_loop
    monkeypatch.setattr(cache_module, "assisted_loop", lambda: found.append(real()) or found[-1])
    ids = torch.randint(3, 90, (1, 70), generator=torch.Generator().manual_seed(1))
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=8, token_budget=32))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                   prompt_lookup_num_tokens=3, **cache_kwargs(model, cache))
    assert found and torch.equal(found[0][0], ids) and found[0][1] == "draft"
    assert real() == (None, None)  # outside generate, nothing is found


@pytest.mark.parametrize("mode", ["mtp", "dflash"])
def test_drafting_modes_of_5_25_are_refused_before_anything_is_written(monkeypatch, mode):
    """transformers 5.25's MTP and DFlash drafters: FlexiCache refuses them at `activate_past_recording`, in the loop,
    with the cache still empty. The drafter itself is replaced by prompt lookup (no tiny model has MTP weights or a
    DFlash assistant); what FlexiCache reads is the loop's generation config."""
    from transformers import GenerationConfig
    from transformers.generation import utils as generation_utils

    if not hasattr(GenerationConfig(), "use_mtp"):
        pytest.skip("this transformers version has no MTP / DFlash drafting (5.25+)")
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    real = generation_utils.GenerationMixin._get_candidate_generator

    def lookup_drafter(self, generation_config, *args, **kwargs):  # the mode's drafter, standing in as prompt lookup
        plain = copy.deepcopy(generation_config)
        plain.use_mtp, plain.speculation_type, plain.prompt_lookup_num_tokens = None, None, 3
        return real(self, plain, *args, **kwargs)

    monkeypatch.setattr(generation_utils.GenerationMixin, "_get_candidate_generator", lookup_drafter)
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=8, token_budget=32))
    flags = {"use_mtp": True} if mode == "mtp" else {"speculation_type": "dflash", "prompt_lookup_num_tokens": 3}
    with pytest.raises(FlexiCacheError, match="does not support"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, **flags,
                       **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0


def test_recording_on_an_empty_cache_outside_the_loop_refuses():
    """Outside the loop, where the prompt ends is unknown: refuse rather than attend drafts densely."""
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=8, token_budget=32))
    with pytest.raises(FlexiCacheError, match="where the prompt ends"):
        cache.activate_past_recording()
    model(input_ids=torch.randint(3, 90, (1, 20)), **cache_kwargs(model, cache))
    cache.activate_past_recording()  # a filled cache: every later token is a decode step
    assert cache.forward.loop_prompt_end is None

"""The real SmolLM2-135M-Instruct on a recall task: FlexiCache must beat realistic broken selections.

The task (`fc_hf.eval.fidelity.make_tasks`, SPEC §5): a 2,048-token King James Bible prompt whose
end asks to repeat, word for word, a passage that starts 1,536 tokens back; then 64 tokens of that
passage are teacher-forced. The score is the share of steps whose next-token prediction agrees with
dense attention's. At a 512-token budget (a quarter of the prompt), every method below reads the same
number of pages per head; only *which* pages differ:

- flexicache: the bundled head profile, stable heads re-ranked every 8 steps (defaults);
- no-rerank: the top-K chosen at the first decode step stays (permanent eviction, SnapKV-like);
- recency: every head reads the sink page and the most recent pages only (StreamingLLM-like);
- random: FlexiCache's schedule and forcing, but random page scores.

Measured here (2026-11-30, this file's settings): flexicache 0.875, quest (every head every step)
0.875, no-rerank 0.625, recency 0.484, random 0.484 (dense recalls the passage's tokens with 0.84
accuracy). The bound sits between the best control and flexicache. Why this task: on plain
continuation broken selections score 0.85-0.87 at a quarter of the prompt (issue 14's review), and
with the passage only 1,024 tokens back no-rerank still reached 0.81 here (flexicache 0.84); a
far passage is what only re-ranking recovers.
"""

import pytest
import torch
from conftest import require_asset
from transformers import DynamicCache

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile, register
from fc_hf.kernels import dispatch
from fc_hf.profile import PROFILE_DIR

BUDGET = 512
BOUND = 0.75  # best control 0.625 (40 of 64 steps), flexicache 0.875 (56 of 64)
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def recall():
    """The model, the task, dense's predictions at every forced step and the prompt's K/V (prefilled once)."""
    from fc_hf.assets import load_model
    from fc_hf.eval.fidelity import make_tasks

    require_asset(MODEL)
    require_asset("kjv")
    register()
    model, tok = load_model(MODEL, attn_implementation="sdpa")
    task = make_tasks(tok, kinds=("recall",), prompt_tokens=2048, forced_tokens=64, distances=(1536,))[0]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([task.prompt_ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        prompt_kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        dense = _forced_predictions(model, cache, task.target_ids)
    model.set_attn_implementation("flexicache")
    return model, task, prompt_kv, dense


def _forced_predictions(model, cache, targets) -> list[int]:
    preds = []
    for token in targets[:-1]:
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        preds.append(int(out.logits[0, -1].argmax()))
    return preds


def _agreement(recall, cache) -> float:
    """Load the prompt's K/V into `cache` as a prefill forward would, teacher-force the passage, compare with dense."""
    model, task, prompt_kv, dense = recall
    with torch.no_grad():
        for idx, (k, v) in enumerate(prompt_kv):
            cache.update(k, v, idx)
        preds = _forced_predictions(model, cache, task.target_ids)
    return sum(a == b for a, b in zip(preds, dense)) / len(dense)


def _cache(model, method):
    config = model.config
    cfg = FlexiCacheConfig(token_budget=BUDGET)
    stable = HeadProfile.from_unstable(config, [])
    if method == "flexicache":
        return FlexiCache(config, cfg, HeadProfile.load(PROFILE_DIR / f"{MODEL}.json", config))
    if method == "random":  # random pages: with refinement the random bound would only propose candidates, and carried
        # pages let exact re-scoring keep the good ones it stumbles on (0.86 here: not a control any more)
        return FlexiCache(config, FlexiCacheConfig(token_budget=BUDGET, refine_pages=0),
                          HeadProfile.load(PROFILE_DIR / f"{MODEL}.json", config))
    if method == "no-rerank":
        return FlexiCache(config, FlexiCacheConfig(token_budget=BUDGET, rerank_interval=10**9), stable)
    if method == "recency":
        heads = tuple((l, h) for l in range(config.num_hidden_layers) for h in range(config.num_key_value_heads))
        return FlexiCache(config, FlexiCacheConfig(token_budget=BUDGET, streaming_heads=heads), stable)
    raise ValueError(method)


def test_flexicache_recalls_above_the_bound(recall):
    cache = _cache(recall[0], "flexicache")
    assert _agreement(recall, cache) >= BOUND
    stats, report = cache.stats(), cache.memory_report()
    assert stats["decode_steps"] == 64 and stats["pages_promoted"] > 0
    assert report["host_kv_bytes"] > 0 and report["device_kv_bytes"] < report["dense_kv_bytes"]


@pytest.mark.parametrize("method", ["no-rerank", "recency", "random"])
def test_controls_fall_below_the_bound(recall, method, monkeypatch):
    if method == "random":
        g = torch.Generator().manual_seed(0)

        def random_scores(query, meta, bias, subpages, backend=None):
            # The step's bias as the real scoring adds it: +inf forces the page being filled and the sink, -inf rules
            # out pages with no attendable token; every other page scores at random.
            forced = bias.view(bias.shape[0], -1, subpages).amax(dim=-1)
            return torch.rand(forced.shape, generator=g) + forced

        monkeypatch.setattr(dispatch, "page_scores", random_scores)
    assert _agreement(recall, _cache(recall[0], method)) < BOUND

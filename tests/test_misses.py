"""The confident-miss diagnosis (`flexicache eval misses`, `eval/misses.py`): its replay of a step reproduces the
FlexiCache run it diagnoses, its `fresh` ranking is the cache's own, and its causes add up."""

import pytest
import torch
from conftest import tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.eval import misses
from fc_hf.eval.shared_prefill import dense_prefill, forced_decode

pytestmark = pytest.mark.usefixtures("no_grad")


def _run(carry_pages=None, steps=14, kv_heads=2, unstable=((0, 1), (1, 0))):
    model = tiny_model("llama", layers=2, heads=2 * kv_heads, kv_heads=kv_heads)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 97, (150,), generator=g).tolist()
    target = torch.randint(1, 97, (steps,), generator=g).tolist()
    cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=4, carry_pages=carry_pages)
    profile = HeadProfile.from_unstable(model.config, list(unstable))
    prefill = dense_prefill(model, prompt)
    cache = FlexiCache(model.config, cfg, profile)
    logprobs, recorder = misses.flexicache_forced(model, prefill, cache, target)
    return model, prefill, prompt, target, cache, logprobs, misses.StepReplay(model, cache, len(prompt), target, recorder)


def test_replay_reproduces_the_run_and_dense_attention():
    model, prefill, prompt, target, cache, logprobs, replay = _run()
    for i in range(len(target)):  # every step, with the pages each head read, over the K/V the cache holds
        assert torch.allclose(replay.logits(i, replay.actual(i)), logprobs[i], atol=1e-4), f"step {i}"
    dense = torch.stack(list(forced_decode(model, prefill, "dense", None, target)))
    # Step 0's K/V before it are the prompt's: exact attention there is dense decoding's step.
    assert torch.allclose(replay.logits(0, replay.dense), dense[0], atol=1e-4)
    assert not torch.allclose(logprobs[0], dense[0], atol=1e-4)  # the budget is sparse: the two differ


@pytest.mark.parametrize("carry_pages", [0, None])  # None: the default carried candidates, restored per step
def test_fresh_ranking_is_the_caches_own_and_causes_are_consistent(carry_pages):
    *_, replay = _run(carry_pages=carry_pages)
    checked = 0
    for i in range(1, 14):
        for row in misses.head_losses(replay, i):
            assert -1e-5 <= row["actual"] <= 1 + 1e-5 and row["fresh"] <= row["oracle"] + 1e-5
            assert all(v >= -1e-6 for v in row["loss"].values())
            assert abs(row["loss"]["broad"] - (1 - row["oracle"])) < 1e-5
            if row["ranked"]:  # ranked at this step: the diagnosis's ranking is exactly the one the cache made
                assert row["fresh_is_actual"], (i, row["layer"], row["head"])
                checked += 1
            if row["kind"] == "stable" and not row["ranked"]:
                assert row["loss"]["stale"] == pytest.approx(max(0.0, row["fresh"] - row["actual"]))
    # The two unstable heads at every step; the stable ones (one per layer, phase 0 of R = 4) at steps 4, 8 and 12.
    assert checked == 13 * 2 + 3 * 2


def test_recorded_rankings_follow_the_staggered_schedule():
    """Three stable heads a layer rank at their own phases (`fc_hf/schedule.py`): the recorder's `ranked` follows the
    schedule, a ranked head read what a fresh ranking chooses, and between its rankings a stable head reads its last
    ranking's pages and the pages opened since."""
    from fc_hf.schedule import phase_of

    *_, replay = _run(kv_heads=4, unstable=((0, 2), (1, 0)))
    steps = replay.recorder.steps
    for layer in (0, 1):
        stable = [h for h, kind in steps[0][layer]["kinds"].items() if kind == "stable"]
        assert len(stable) == 3
        last = {}
        for i, rec in enumerate(steps):
            s = i + 1  # the decode step since the prompt
            page = (replay.prompt_len + i) // replay.cfg.page_size
            heads = {row["head"]: row for row in misses.head_losses(replay, i) if row["layer"] == layer}
            for j, h in enumerate(stable):
                due = s == 1 or s % 4 == phase_of(j, 3, 4)
                assert rec[layer]["ranked"][h] == due, (layer, i, h)
                pages = rec[layer]["pages"][h].tolist()
                if due:
                    assert heads[h]["fresh_is_actual"], (layer, i, h)
                    last[h] = (pages, page)
                else:
                    before, at = last[h]
                    assert pages == sorted(set(before) | set(range(at + 1, page + 1))), (layer, i, h)
    # Every step ranks one stable head of each layer (phases 0, 1, 2 of R = 4; none at phase 3), all at step 1.
    ranked = [sum(steps[i][layer]["ranked"][h] for layer in (0, 1) for h in range(4)) for i in range(len(steps))]
    assert ranked == [8] + [2 + 2 * ((i + 1) % 4 != 3) for i in range(1, len(steps))]


def test_verdict_is_the_largest_loss_at_the_decisive_heads():
    heads = [{"layer": 0, "head": 0, "loss": {"stale": 0.1, "bound miss": 0.4, "outranked": 0.0, "broad": 0.2}},
             {"layer": 1, "head": 1, "loss": {"stale": 0.9, "bound miss": 0.0, "outranked": 0.0, "broad": 0.0}}]
    step = {"dense": {"top1_is_dense": True}, "heads_to_flip": 1, "heads": heads,
            "head_gain": [{"layer": 0, "head": 0, "gain": 5.0}, {"layer": 1, "head": 1, "gain": 0.1}]}
    assert misses.verdict(step) == "bound miss"  # head (1, 1) lost more, but flipping needs only head (0, 0)
    step["heads_to_flip"] = None  # 12 did not flip it: the 3 of largest gain
    assert misses.verdict(step) == "stale"
    step["dense"]["top1_is_dense"] = False
    assert misses.verdict(step) == "earlier tokens"


def test_dense_reference_and_a_comparison_in_another_dtype():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    other = tiny_model("llama", layers=2, heads=4, kv_heads=2).to(torch.bfloat16)
    other.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 97, (80,), generator=g).tolist()
    case = misses.Case("random", prompt, None, 10)
    prefill = dense_prefill(model, prompt)
    target, dense = misses.dense_reference(model, prefill, case)  # dense's greedy answer, with its log-probs
    assert target == dense.argmax(-1).tolist() and len(target) == 10
    forced = torch.stack(list(forced_decode(model, prefill, "dense", None, target[:-1])))
    assert torch.allclose(dense[1:], forced, atol=1e-5)
    cfg = FlexiCacheConfig(page_size=4, token_budget=16)
    row = misses.compare_case(model, case, prefill, target, dense, cfg, None,
                              versus=(other, dense_prefill(other, prompt)))
    assert row["misses"] == [] and len(row["method_top1"]) == 10
    same = misses.compare_case(model, case, prefill, target, dense, cfg, None, versus=(model, prefill))
    assert same["first_part"] is None and same["method_top1"] == same["dense_top1"]  # the model against itself
    sparse = misses.compare_case(model, case, prefill, target, dense, cfg, None)
    assert sparse["dense_top1"] == target and sparse["method_top1"][0] == target[0]  # the prefill is exact


def test_stale_rows_are_the_stable_heads_between_re_ranks():
    from fc_hf.eval import stale

    model, prefill, prompt, target, cache, logprobs, replay = _run(carry_pages=0)
    rows = stale.stale_rows(model, cache, "random", len(prompt), target, replay.recorder, replay.cfg)
    # Heads (0, 0) and (1, 1) are stable, R = 4: they rank at steps 1, 4, 8, 12 (0-based 0, 3, 7, 11); 14 steps.
    assert sorted({(r["layer"], r["head"]) for r in rows}) == [(0, 0), (1, 1)]
    assert sorted({r["step"] for r in rows}) == [1, 2, 4, 5, 6, 8, 9, 10, 12, 13]
    assert {r["since"] for r in rows} == {1, 2, 3}
    for r in rows:  # the same stale loss the miss diagnosis reports for that head and step
        mine = next(h for h in misses.head_losses(replay, r["step"]) if (h["layer"], h["head"]) == (r["layer"], r["head"]))
        assert mine["loss"]["stale"] == pytest.approx(max(0.0, r["fresh"] - r["actual"]), abs=1e-6)
        assert -1 - 1e-5 <= r["cos"] <= 1 + 1e-5
    text = stale.stale_markdown(rows)
    assert "| 3 | 4 |" in text and "| 1 | 8 |" in text and "| cos |" in text  # since 3: steps 6 and 10

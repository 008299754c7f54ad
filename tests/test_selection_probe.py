"""The selection-quality probe (`fc_hf.eval.selection_probe`): its numbers against brute force and their bounds."""

import math

import pytest
import torch

from fc_hf.eval.selection_probe import DEFAULT_POLICIES, Policy, ProbeTotals, probe_layer, probe_text
from fc_hf.kernels.bruteforce import score_pages_bruteforce


def _case(h=2, g=3, length=203, t=5, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(h, g, t, d, generator=gen)
    k = torch.randn(h, length, d, generator=gen)
    v = torch.randn(h, length, d, generator=gen)
    return q, k, v, torch.arange(length - t, length)


def test_full_budget_captures_everything():
    q, k, v, pos = _case()
    res = probe_layer(q, k, v, pos, 0.35, 16, 16 * 16, 1, DEFAULT_POLICIES)
    for name, m in res.items():
        torch.testing.assert_close(m["mass_mean"], torch.ones_like(m["mass_mean"]), msg=name)
        assert float(m["out_err"].max()) < 1e-5, name


def test_oracle_is_an_upper_bound_of_every_policy():
    q, k, v, pos = _case(seed=1)
    res = probe_layer(q, k, v, pos, 0.35, 8, 64, 1, DEFAULT_POLICIES)
    for name, m in res.items():
        assert bool((m["mass_mean"] <= res["oracle"]["mass_mean"] + 1e-6).all()), name
    assert float(res["quest"]["mass_mean"].mean()) < float(res["oracle"]["mass_mean"].mean())


def test_quest_mass_matches_a_bruteforce_selection():
    h, g, length, t, d, page, budget = 1, 2, 90, 3, 4, 8, 32
    q, k, v, pos = _case(h, g, length, t, d, seed=2)
    res = probe_layer(q, k, v, pos, 0.5, page, budget, 1, (Policy("quest"),))
    for i, p in enumerate(pos.tolist()):
        last = p // page
        full = k[0, : last * page].view(last, page, d)
        scores = score_pages_bruteforce(q[0, :, i][None], full.amin(1)[None], full.amax(1)[None])[0].tolist()
        scores[0] = math.inf  # sink
        order = sorted(range(last), key=lambda j: -scores[j])
        chosen = set(order[: budget // page - 1]) | {last}
        probs = torch.softmax(q[0, :, i] @ k[0, : p + 1].T * 0.5, dim=-1)  # [G, p+1]
        mass = [sum(float(probs[hh, j]) for j in range(p + 1) if j // page in chosen) for hh in range(g)]
        assert res["quest"]["mass_mean"][0, i].item() == pytest.approx(sum(mass) / g, abs=1e-5)
        assert res["quest"]["mass_min"][0, i].item() == pytest.approx(min(mass), abs=1e-5)


def test_probe_text_runs_on_a_tiny_model():
    from conftest import tiny_model

    model = tiny_model("llama")
    totals = ProbeTotals(model.config.num_hidden_layers, DEFAULT_POLICIES)
    ids = torch.randint(1, 90, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    probe_text(model, ids, 8, 16, 128, 1, DEFAULT_POLICIES, totals)
    assert model.config._attn_implementation == "flexicache"  # restored
    assert sorted({key[1] for key in totals.sums}) == list(range(model.config.num_hidden_layers))
    for pol in DEFAULT_POLICIES:
        if not pol.tail:
            assert 0.0 < totals.mean(pol.name, "mass_mean") <= totals.mean("oracle", "mass_mean") + 1e-6

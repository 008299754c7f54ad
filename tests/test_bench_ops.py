"""`flexicache bench ops` counts what it says: kernel-launching aten ops (views left out) and host syncs.

Smoke size (a 2-layer tiny model, a 132-token context): counts only, no timing.
"""

from __future__ import annotations

import pytest
import torch

import fc_hf.decode as fc_decode
from fc_hf import FlexiCacheConfig
from fc_hf.eval.bench import common as bench_common
from fc_hf.eval.bench import ops as bench_ops

# 8.25 pages of 16, 4 pages of budget; steps 12 and 13 fill a page and open the next, R = 8 divides steps 8 and 16.
PROMPT, BUDGET, STEPS = 132, 64, 16


def test_views_and_allocations_are_not_counted_compute_and_syncs_are():
    x = torch.randn(4, 3)
    with bench_ops.OpCounter() as c:
        y = x.view(3, 4).t().unsqueeze(0).expand(2, 4, 3)[:, 1]  # views only
        torch.empty(5)
        z = y + 1  # 1
        torch.index_select(x, 0, torch.tensor([0, 2]), out=torch.empty(2, 3))  # lift_fresh (a view) + index_select.out
        z.sum().item()  # sum + _local_scalar_dense (a sync)
        x[x > 0]  # gt + index with a bool mask (a sync)
        x.nonzero()  # a sync
    assert c.ops[("outside",)] == 7
    assert dict(c.syncs) == {"_local_scalar_dense": 1, "index(bool mask)": 1, "nonzero": 1}


@pytest.fixture(scope="module")
def tiny():
    config = bench_common.model_config("tiny", max_positions=1024)
    model = bench_common.build_model(config)
    profile = bench_common.spread_profile(config, 0.25)
    return model, config, profile


def _case(tiny, method):
    model, config, profile = tiny
    case = bench_ops.count_case(model, config, method, BUDGET, PROMPT, STEPS, profile if method == "flexicache" else None)
    case.update(shape="tiny", profile=None, summary=bench_ops.summarize(case), env={})
    return case


def test_counts_per_method_first_step_and_the_steps_after(tiny):
    cases = {m: _case(tiny, m) for m in ("dense", "quest", "flexicache")}
    s = {m: c["summary"] for m, c in cases.items()}
    assert FlexiCacheConfig().rerank_interval == 8
    for m in cases:
        assert s[m]["first"]["steps"] == 1 and s[m]["steady"]["steps"] == STEPS - 1
        # A step's ops depend on nothing that changes as pages fill (step 12) and open (step 13): dense's and Quest's
        # steps 2..16 issue the same ops; an eager FlexiCache step ranks the stable rows of its phase, so its ops repeat
        # with the period R = 8 (step s as step s + 8), whatever the pages.
        steady = s[m]["steady"]
        ops = [(st["layer_ops"], st["cache_ops"], st["attn_ops"], st["outside_ops"]) for st in cases[m]["steps"]]
        if m == "flexicache":
            assert all(ops[i] == ops[i + 8] for i in range(1, STEPS - 8)), ops
            assert steady["min_ops_per_layer"] < steady["max_ops_per_layer"]  # phases with and without a stable row
        else:
            assert steady["min_ops_per_layer"] == steady["max_ops_per_layer"] == steady["ops_per_layer"], m
            assert len(set(ops[1:])) == 1, m
        # No decode step syncs with the host, the first included.
        assert s[m]["first"]["syncs_per_step"] == s[m]["steady"]["syncs_per_step"] == 0, (m, s[m]["steady"]["sync_kinds"])
        assert all(st["outside_ops"] > 0 for st in cases[m]["steps"])
        top = steady["top_ops_per_layer"]
        assert top and sum(top.values()) <= steady["ops_per_layer"] + 1e-9
    assert 0 < s["dense"]["steady"]["ops_per_layer"] < s["quest"]["steady"]["ops_per_layer"]
    assert s["dense"]["steady"]["cache_attn_per_layer"] > 0
    # Every step ranks (each layer its unstable rows and a slice of its stable ones: top-K every step); dense never.
    for m in ("quest", "flexicache"):
        assert all(st["by_op"].get("topk", 0) > 0 for st in cases[m]["steps"]), m
    assert not any(st["by_op"].get("topk") for st in cases["dense"]["steps"])
    # Step 1 is apart for FlexiCache only: it ranks every stable row at once (Quest has none).
    assert s["quest"]["first"]["ops_per_layer"] == s["quest"]["steady"]["ops_per_layer"]
    assert s["flexicache"]["first"]["ops_per_layer"] != s["flexicache"]["steady"]["ops_per_layer"]
    table = bench_ops.markdown_table(list(cases.values()))
    assert "| tiny | flexicache | torch | 2-16 mean |" in table and "| tiny | dense | torch (sdpa) | 1 (first) |" in table
    assert "1.00×" in table


def test_summary_reports_the_spread_of_the_steps():
    """Steps 2..N are summarized by their mean with min and max, step 1 apart: a step unlike the others shows."""
    steps = [{"step": i, "layer_ops": ops, "cache_ops": 1, "attn_ops": 2, "outside_ops": 3, "triton_launches": 0,
              "triton_layer_launches": 0, "syncs": {"nonzero": 1} if i == 3 else {}, "by_op": {"mm": ops}}
             for i, ops in enumerate([50, 20, 40, 20], start=1)]
    summary = bench_ops.summarize({"layers": 2, "steps": steps})
    assert summary["first"]["ops_per_layer"] == 25 and summary["first"]["syncs_per_step"] == 0
    steady = summary["steady"]
    assert steady["steps"] == 3 and steady["ops_per_layer"] == pytest.approx(40 / 3)
    assert (steady["min_ops_per_layer"], steady["max_ops_per_layer"]) == (10, 20)
    assert steady["syncs_per_step"] == pytest.approx(1 / 3) and steady["top_ops_per_layer"] == {"mm": 13.33}


def test_a_planted_item_is_counted_once_per_layer_and_step(tiny, monkeypatch):
    original = fc_decode.attend

    def attend(layer, query, *args, **kwargs):
        query.sum().item()  # a host sync in every FlexiCache layer's decode attention
        return original(layer, query, *args, **kwargs)

    monkeypatch.setattr(fc_decode, "attend", attend)
    case = _case(tiny, "flexicache")
    _, config, _ = tiny
    for kind in ("first", "steady"):
        assert case["summary"][kind]["sync_kinds"] == {"_local_scalar_dense": config.num_hidden_layers}


def test_a_left_padded_batch_is_counted_with_its_mask(tiny, monkeypatch):
    """`--ops-padded-batch`: the decode steps get the batch's padding mask, so FlexiCache's step masks its padding
    (`StepBias.update` sees the padded positions), and still no decode step syncs."""
    from fc_hf.step_bias import StepBias

    seen = []
    original = StepBias.update

    def update(self, mask, position):
        seen.append((mask, position))  # kept, looked at after the counts (looking now would add ops)
        return original(self, mask, position)

    monkeypatch.setattr(StepBias, "update", update)
    mask = bench_ops.padding_mask(3, 10, 4)
    assert mask.sum(1).tolist() == [10, 8, 6] and bench_ops.padding_mask(1, 10, 4) is None
    model, config, profile = tiny
    case = bench_ops.count_case(model, config, "flexicache", BUDGET, PROMPT, 4, profile, batch=3, padding=40)
    assert case["batch"] == 3 and case["padding"] == 40
    assert all(st["syncs"] == {} for st in case["steps"])
    assert len(seen) == 4  # once per step, for all the layers
    for step_mask, position in seen:  # every step saw the padding: the last row's first 40 tokens not attended
        row = step_mask[:, 0, -1, : int(position) + 1]
        ok = row if row.dtype == torch.bool else row >= 0
        assert ok[0].all() and not ok[2, :40].any() and ok[2, 40:].all()


def test_regenerated_report_keeps_the_ops_section(tmp_path):
    from fc_hf.eval.bench import report as bench_report

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# old\n\n## Decode throughput\n\nold table\n\n## Decode-step ops (issue 17)\n\n"
                                        "| a | b |\n|---|---|\n\n## Prefill\n\nold\n")
    text = bench_report.write_report(tmp_path / "empty", docs).read_text()
    assert "## Decode-step ops (issue 17)\n\n| a | b |" in text
    assert "old table" not in text and text.count("## Decode-step ops") == 1


def test_comparison_table_puts_before_and_after_side_by_side(tiny):
    before = [_case(tiny, m) for m in ("dense", "quest")]
    after = [dict(c, steps=[dict(s, layer_ops=s["layer_ops"] / 2) for s in c["steps"]]) for c in before]
    table = bench_ops.comparison_table(before, after)
    row = next(line for line in table.splitlines() if line.startswith("| tiny | quest | torch | steady |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # Halved (to the table's one decimal), and the ratios are to each run's own dense.
    assert abs(float(cells[4]) - 2 * float(cells[5])) <= 0.1 + 1e-9 and float(cells[4]) != float(cells[5])
    assert cells[6] == cells[7]


def test_on_the_triton_path_refinement_and_its_attention_are_the_ops():
    """Counted on the Triton path (a worker under the interpreter, as `--ops-backends triton`): FlexiCache's decode
    steps refine and attend the unstable rows through the ops (`flexicache::candidates`, `page_logits`, `choose`,
    `chosen_attention`), one launch each per ranking, and issue none of the PyTorch path's ops for them (top-k, sort,
    the carried raise, the logits' product, softmax, the product with the values); no step syncs with the host."""
    pytest.importorskip("triton")
    spec = {"shape": "tiny", "backend": "triton", "methods": ["flexicache"], "budget": BUDGET, "prompt": PROMPT,
            "steps": STEPS, "unstable_fraction": 0.25, "options": {}}
    (case,) = bench_ops._run_worker(spec, timeout=600)
    fused = {"_candidates_kernel", "_page_logits_kernel", "_choose_kernel"}
    for step in case["steps"]:
        assert not {"topk", "sort", "scatter_reduce", "baddbmm", "_softmax", "bmm"} & set(step["by_op"]), step["by_op"]
        assert fused <= set(step["triton"]) and len({step["triton"][name] for name in fused}) == 1, step["triton"]
        assert step["triton"].get("_chosen_attention_kernel") and not step["syncs"]

"""`flexicache bench ops` counts what it says: kernel-launching aten ops (views left out) and host syncs.

Smoke size (a 2-layer tiny model, a 136-token context): counts only, no timing.
"""

from __future__ import annotations

import pytest
import torch

from fc_hf import FlexiCacheConfig
from fc_hf.eval.bench import common as bench_common
from fc_hf.eval.bench import ops as bench_ops
from fc_hf.head_group import HeadGroup

PROMPT, BUDGET, STEPS = 132, 64, 16  # 8.25 pages of 16, 4 pages of budget, re-ranks at steps 8 and 16 (R = 8)


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


def test_host_copies_count_as_syncs_and_host_work_apart():
    """A `to_host` copy is one sync even on a CPU run (where it issues no op); ops inside `host_work` run on the
    host on CUDA too, so they are counted apart, neither as kernel launches nor as syncs."""
    from fc_hf.transfer import HostWork, host_work, to_host

    x = torch.arange(6)
    c = bench_ops.OpCounter()
    HostWork.observer = c.count_host_copy
    try:
        with c:
            (h,) = to_host(x)
            with host_work:
                h.nonzero()  # a sync were it on the device
                h + 1
            x + 1  # 1
    finally:
        HostWork.observer = None
    assert dict(c.syncs) == {"device->host copy": 1}
    assert c.host_ops == 2 and c.ops[("outside",)] == 1


def test_one_copy_to_host_keeps_every_tensor():
    from fc_hf.transfer import one_copy_to_host

    a, b, c = torch.arange(6).view(2, 3), torch.arange(10, 16).view(2, 3), torch.arange(20, 28).view(2, 4)
    got = one_copy_to_host((a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(got, (a, b, c)))


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


def test_counts_per_method_and_step_kind(tiny):
    cases = {m: _case(tiny, m) for m in ("dense", "quest", "flexicache")}
    kinds = [s["kind"] for s in cases["dense"]["steps"]]
    # 132 + 12 = 144 fills page 8 at step 12; step 13 opens page 9; steps 8 and 16 re-rank the stable heads.
    assert FlexiCacheConfig().rerank_interval == 8
    assert kinds[0] == "first" and kinds[11] == kinds[12] == "page" and kinds[7] == kinds[15] == "rerank"
    assert kinds.count("plain") == 11
    s = {m: c["summary"] for m, c in cases.items()}
    assert 0 < s["dense"]["plain"]["ops_per_layer"] < s["quest"]["plain"]["ops_per_layer"]
    assert s["dense"]["plain"]["cache_attn_per_layer"] > 0
    assert s["flexicache"]["rerank"]["ops_per_layer"] > s["flexicache"]["plain"]["ops_per_layer"]
    # The steady state issues no host sync (CUDA's defaults: residency check off).
    for m in ("dense", "quest", "flexicache"):
        assert s[m]["plain"]["syncs_per_step"] == 0, (m, s[m]["plain"]["sync_kinds"])
    # A re-rank's tier moves (stable groups) sync once each for their plan and once for their host-only candidates
    # (6 syncs per group before: nonzeros, masks and checks on the device).
    _, config, profile = tiny
    tiered = sum(len([h for l, h in profile.unstable if l == layer]) < config.num_key_value_heads
                 for layer in range(config.num_hidden_layers))
    rerank = s["flexicache"]["rerank"]
    assert rerank["sync_kinds"] == {"device->host copy": 2 * tiered}, rerank["sync_kinds"]
    assert rerank["host_ops_per_step"] > 0 and s["flexicache"]["plain"]["host_ops_per_step"] == 0
    assert all(c["steps"][0]["outside_ops"] > 0 for c in cases.values())
    table = bench_ops.markdown_table(list(cases.values()))
    assert "| tiny | flexicache | torch | plain |" in table and "1.00×" in table


def test_a_planted_item_is_counted_once_per_group_and_layer(tiny, monkeypatch):
    original = HeadGroup.attend

    def attend(self, query, *args, **kwargs):
        query.sum().item()  # a host sync on every decode step of every head group
        return original(self, query, *args, **kwargs)

    monkeypatch.setattr(HeadGroup, "attend", attend)
    case = _case(tiny, "flexicache")
    _, config, profile = tiny
    groups = sum(1 + (0 < len([h for l, h in profile.unstable if l == layer]) < config.num_key_value_heads)
                 for layer in range(config.num_hidden_layers))
    plain = case["summary"]["plain"]
    assert plain["sync_kinds"] == {"_local_scalar_dense": groups}


def test_a_left_padded_batch_is_counted_with_its_mask(tiny, monkeypatch):
    """`--ops-padded-batch`: the decode steps get the batch's padding mask, so FlexiCache takes its padded path; it
    adds one sync per step to dense's (its check of the step's mask for padding, made once per step for all layers)."""
    from fc_hf import FlexiCache

    seen = []
    original = FlexiCache.padding_info

    def padding_info(self, *args, **kwargs):
        token_valid, page_valid = original(self, *args, **kwargs)
        seen.append(token_valid is not None)
        return token_valid, page_valid

    monkeypatch.setattr(FlexiCache, "padding_info", padding_info)
    mask = bench_ops.padding_mask(3, 10, 4)
    assert mask.sum(1).tolist() == [10, 8, 6] and bench_ops.padding_mask(1, 10, 4) is None
    model, config, profile = tiny
    got = {}
    for method in ("dense", "flexicache"):
        case = bench_ops.count_case(model, config, method, BUDGET, PROMPT, 4, profile if method != "dense" else None,
                                    batch=3, padding=40)
        assert case["batch"] == 3 and case["padding"] == 40
        got[method] = case["steps"][1:]
    for dense, flexi in zip(got["dense"], got["flexicache"]):
        assert sum(flexi["syncs"].values()) == sum(dense["syncs"].values()) + 1, (dense["syncs"], flexi["syncs"])
    assert seen and all(seen)  # every decode step of FlexiCache saw padding


def test_residency_check_shows_up_as_syncs(tiny):
    model, config, _ = tiny
    case = bench_ops.count_case(model, config, "quest", BUDGET, PROMPT, 4, None, residency_check=True)
    assert [s["syncs"].get("_local_scalar_dense", 0) for s in case["steps"][1:]] == [config.num_hidden_layers] * 3


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
    row = next(line for line in table.splitlines() if line.startswith("| tiny | quest | torch | plain |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # Halved (to the table's one decimal), and the ratios are to each run's own dense.
    assert abs(float(cells[4]) - 2 * float(cells[5])) <= 0.1 + 1e-9 and float(cells[4]) != float(cells[5])
    assert cells[6] == cells[7]

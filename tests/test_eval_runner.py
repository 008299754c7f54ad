"""Results folders, profile resolution, an end-to-end fidelity run on a tiny model, summary, CLI."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fc_hf.eval import fidelity, generation, methods, profile_choice, results, summary
from fc_hf.eval.cli import build_parser
from fc_hf.profile import HeadProfile

TEXT = "".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog. " for i in range(300))


class CharTokenizer:
    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 96 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def text_tokens(tokenizer, n, offset):
    return tokenizer(TEXT[offset:offset + n])["input_ids"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def test_rundir_resume_and_mismatch(tmp_path):
    run = results.RunDir(tmp_path / "r", {"bench": "x", "budget": 1024, "tasks": ["a"]})
    run.append({"id": "a", "score": 1.0})
    with open(run.predictions_file, "a") as f:
        f.write('{"id": "b", "sco')  # a line cut by an interrupted write
    again = results.RunDir(tmp_path / "r", {"bench": "x", "budget": 1024, "tasks": ["a", "b"]})  # tasks may grow
    assert again.done_ids() == {"a"}
    assert json.loads((tmp_path / "r" / "config.json").read_text())["tasks"] == ["a", "b"]
    with pytest.raises(ValueError, match="budget"):
        results.RunDir(tmp_path / "r", {"bench": "x", "budget": 2048})


def test_config_diff_counts_a_key_on_one_side_only_and_names_dict_entries():
    assert results.config_diff({"a": 1}, {"a": 1}) == []
    assert results.config_diff({"a": 1}, {"a": 1, "b": None}) == ["b"]  # missing vs None is a difference
    assert results.config_diff({"a": 1, "b": None}, {"a": 1}) == ["b"]
    assert results.config_diff({"a": 1, "started": "x"}, {"a": 1}) == []  # extensible keys never count
    old, new = {"d": {"x": 1, "y": 2}}, {"d": {"x": 1, "y": 3, "z": None}}
    assert results.config_diff(old, new) == ["d.y", "d.z"]


def test_rundir_refuses_a_folder_made_before_the_selection_defaults_were_recorded(tmp_path, monkeypatch):
    from dataclasses import fields

    from fc_hf.config import FlexiCacheConfig

    defaults = methods.cache_defaults()
    json.dumps(defaults)  # JSON-safe
    assert {k: defaults[k] for k in ("score_subpages", "refine_pages", "subpages", "candidate_pages")} == {
        "score_subpages": None, "refine_pages": None, "subpages": 2, "candidate_pages": 128}
    assert set(defaults) >= {f.name for f in fields(FlexiCacheConfig)}
    cfg = {"bench": "x", "budget": 1024, "cache_defaults": defaults}
    results.RunDir(tmp_path / "now", cfg)
    results.RunDir(tmp_path / "now", cfg)  # same settings: resumes
    # A folder from before: only five fields recorded, so a change of score_subpages / refine_pages went unseen.
    old = {k: defaults[k] for k in ("page_size", "rerank_interval", "sink_pages", "promotion", "offload")}
    results.RunDir(tmp_path / "before", {**cfg, "cache_defaults": old})
    with pytest.raises(ValueError, match=r"cache_defaults\.candidate_pages.*cache_defaults\.score_subpages.*another --out"):
        results.RunDir(tmp_path / "before", cfg)
    # The same fields resolving otherwise (a changed default) is refused too.
    monkeypatch.setattr(FlexiCacheConfig, "subpages", property(lambda self: 1))
    with pytest.raises(ValueError, match=r"\(cache_defaults\.subpages\)"):
        results.RunDir(tmp_path / "now", {**cfg, "cache_defaults": methods.cache_defaults()})


def test_resolve_profile_revotes_without_the_evaluated_task(tiny, tmp_path):
    per_task = {"ruler_vt": [[0, 0], [1, 1]], "fidelity": [[0, 1]], "gov_report": [[0, 1], [1, 0]]}
    prof = HeadProfile.from_unstable(tiny.config, [(0, 0), (1, 1)], extra={"per_task_unstable": per_task, "tasks": list(per_task)})
    path = prof.save(tmp_path / "p.json")
    got, note = profile_choice.resolve_profile("tiny", tiny.config, "ruler_vt", str(path))
    assert got.unstable == {(0, 1), (1, 0)}  # (0,1) has two votes, then (1,0); ruler_vt's own set is ignored
    assert "excluded ['ruler_vt']" in note
    got, _ = profile_choice.resolve_profile("tiny", tiny.config, "fidelity", str(path))
    assert (0, 1) in got.unstable and len(got.unstable) == 2


def test_resolve_profile_without_per_task_sets_says_so(tiny, tmp_path):
    path = HeadProfile.from_unstable(tiny.config, [(1, 0)], extra={"tasks": ["a"]}).save(tmp_path / "p.json")
    got, note = profile_choice.resolve_profile("tiny", tiny.config, "ruler_vt", str(path))
    assert got.unstable == {(1, 0)} and "could not be excluded" in note


def test_resolve_profile_fallback_is_marked(tiny):
    got, note = profile_choice.resolve_profile("no-such-model-xyz", tiny.config, "ruler_vt")
    assert note == profile_choice.FALLBACK_NOTE and len(got.unstable) == 1  # 25% of 4 heads
    again, _ = profile_choice.resolve_profile("no-such-model-xyz", tiny.config, "ruler_vt")
    assert again.unstable == got.unstable  # deterministic


def test_fidelity_run_end_to_end_resumes_and_summarizes(tiny, tmp_path, capsys):
    kwargs = dict(methods=["dense", "no-rerank", "quest"], budgets=[32], out=tmp_path, prompt_tokens=160, forced_tokens=6,
                  distances=(48,), free_run_tokens=3, model_bundle=(tiny, CharTokenizer(), None), text_tokens=text_tokens)
    res = fidelity.run_fidelity("tiny", **kwargs)
    assert set(res) == {"dense", "no-rerank-b32", "quest-b32"}
    assert res["dense"]["score"] == 1.0
    for name in ("no-rerank-b32", "quest-b32"):
        s = res[name]["summary"]
        assert set(s) == {"all", "continue", "recall"} and s["all"]["steps"] == 12
        assert 0.0 <= s["all"]["agreement"] <= 1.0 and s["all"]["kl"] >= 0.0
        assert 0 <= s["all"]["free_run_agreement"] <= 3
    folder = tmp_path / "fidelity" / "tiny" / "p160-f6" / "quest-b32"
    assert {p.name for p in folder.iterdir()} == {"config.json", "predictions.jsonl", "metrics.json"}
    rows = [json.loads(l) for l in (folder / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["continue-o0", "recall-d48-o0"] and len(rows[0]["agree"]) == 6
    # A second call finds everything done and appends nothing.
    fidelity.run_fidelity("tiny", **kwargs)
    assert len((folder / "predictions.jsonl").read_text().splitlines()) == 2

    path = summary.write_summary(tmp_path, plots=True)
    text = path.read_text()
    assert "fidelity — tiny — p160-f6" in text and "| quest@32 |" in text and "| no-rerank@32 |" in text
    assert (tmp_path / "agreement-tiny-p160-f6.png").stat().st_size > 1000


def test_retention_table_and_plot(tmp_path):
    rows = [
        {"bench": "ruler", "model": "m", "setting": "a", "method": "dense", "budget": None, "score": 0.8},
        {"bench": "ruler", "model": "m", "setting": "b", "method": "dense", "budget": None, "score": 0.0},
        {"bench": "ruler", "model": "m", "setting": "a", "method": "flexicache", "budget": 1024, "score": 0.6},
        {"bench": "ruler", "model": "m", "setting": "b", "method": "flexicache", "budget": 1024, "score": 0.0},
        {"bench": "ruler", "model": "m", "setting": "a", "method": "flexicache", "budget": 2048, "score": 0.8},
    ]
    ret = summary.retention(rows)
    assert ret["flexicache@1024"] == {"a": pytest.approx(0.75), "b": None}
    table = summary.retention_table(rows)
    lines = table.splitlines()
    assert lines[0] == "| method | a | b | avg retention |"
    assert lines[2].startswith("| dense |") and "| flexicache@1024 | 0.600 (0.750) | 0.000 (n/a) | 0.750 |" in table
    assert "| flexicache@2048 | 0.800 (1.000) | — | 1.000 |" in table
    assert "Dense scores below 0.5 on b:" in table
    # A dense score of a few lucky hits is no baseline either: 0.25 -> retention not measured.
    low = [dict(r, score=0.25) if (r["setting"], r["method"]) == ("b", "dense") else r for r in rows]
    assert summary.retention(low)["flexicache@1024"]["b"] is None
    png = summary.plot_retention(rows, tmp_path / "r.png", "t")
    assert png.stat().st_size > 1000


def test_ablation_table_follows_the_paper_order():
    ruler = [{"bench": "ruler", "model": "m", "setting": "a", "method": m, "budget": b, "score": sc, "n": 4}
             for m, b, sc in [("dense", None, 0.8), ("no-rerank", 1024, 0.4), ("uniform", 1024, 0.6),
                              ("flexicache", 1024, 0.8), ("flexicache", 2048, 0.8), ("quest", 1024, 0.8)]]
    fid = [{"bench": "fidelity", "model": "m", "setting": "p4", "method": "flexicache", "budget": 1024,
            "summary": {"all": {"agreement": 0.9}, "recall": {"agreement": 0.85}}}]
    lines = summary.ablation_table(ruler + fid).splitlines()
    assert lines[0] == "| step | RULER avg retention | recall agree (p4) |"
    assert [l.split(" | ")[0] for l in lines[2:]] == ["| no-rerank@1024", "| uniform@1024", "| flexicache@1024",
                                                      "| flexicache@2048"]
    assert lines[2] == "| no-rerank@1024 | 0.500 | — |" and lines[4] == "| flexicache@1024 | 1.000 | 0.850 |"
    assert summary.retention_table(ruler).splitlines()[0] == "| method | a (n=4) | avg retention |"
    assert summary.ablation_table([]) is None


def test_cli_parses_lists():
    args = build_parser().parse_args(["fidelity", "--methods", "dense,quest", "--budgets", "1024,2048", "--distances", "2048"])
    assert args.methods == ["dense", "quest"] and args.budgets == [1024, 2048] and args.distances == [2048]
    args = build_parser().parse_args(["ruler"])
    assert args.tasks == ["niah_single_1", "ruler_vt"] and args.methods == ["dense", "flexicache", "quest", "no-rerank"]
    with pytest.raises(ValueError, match="Unknown method"):
        methods.method_runs(["dense", "h2o"], [1024])


def test_longbench_run_offline_skips_missing_and_scores_fixture(tiny, tmp_path, capsys):
    from benchmark_records import records_folder

    data = records_folder() / "longbench"
    res = generation.run_longbench("tiny", ["passage_count", "qasper"], ["dense"], [64], tmp_path, data=str(data),
                               max_prompt_tokens=64, model_bundle=(tiny, CharTokenizer(), None))
    assert set(res) == {"passage_count"}  # qasper has no fixture: skipped with one line
    assert "qasper" in capsys.readouterr().out
    m = res["passage_count"]["dense"]
    assert m["n"] == 1 and 0.0 <= m["score"] <= 100.0


def test_excluded_tasks_follow_shared_material():
    profiler_tasks = ["kjv-continue", "kjv-recall", "kjv-summary", "ruler-niah", "ruler-vt"]
    assert profile_choice.excluded_tasks("fidelity", profiler_tasks) == ["kjv-continue", "kjv-recall"]
    assert profile_choice.excluded_tasks("niah_multikey_2", profiler_tasks) == ["ruler-niah"]
    assert profile_choice.excluded_tasks("ruler_vt", profiler_tasks) == ["ruler-vt"]
    assert profile_choice.excluded_tasks("hotpotqa", profiler_tasks) == []


def test_resolve_profile_keeps_profile_when_no_task_shares_material(tiny, tmp_path):
    prof = HeadProfile.from_unstable(tiny.config, [(0, 0)], extra={"per_task_unstable": {"ruler-vt": [[0, 0]]}})
    got, note = profile_choice.resolve_profile("tiny", tiny.config, "hotpotqa", str(prof.save(tmp_path / "p.json")))
    assert got.unstable == {(0, 0)} and "none shares" in note


def test_parse_cache_options():
    assert methods.parse_cache_options("carry_pages=0,rerank_interval=8,offload=false,pairs=0:1") == {
        "carry_pages": 0, "rerank_interval": 8, "offload": False, "pairs": (0, 1)}
    assert methods.parse_cache_options(None) == {}


def test_summary_labels_cache_option_variants_apart():
    row = {"method": "quest", "budget": 1024, "cache_options": {"streaming_heads": [0, 1]}}
    assert summary._label(row) == "quest@1024 streaming_heads=0:1"
    assert summary._label({"method": "quest", "budget": 1024}) == "quest@1024"
    assert summary._order("quest@1024") < summary._order("quest@1024 streaming_heads=0:1")


def test_rundir_reads_answers_holding_unicode_line_separators(tmp_path):
    run = results.RunDir(tmp_path / "r", {"bench": "x"})
    run.append({"id": "a", "prediction": "one\u2028two\x85three"})
    assert [r["prediction"] for r in run.predictions()] == ["one\u2028two\x85three"] and run.done_ids() == {"a"}

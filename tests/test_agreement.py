"""`flexicache eval agreement` (eval/agreement.py) on hand-made run folders, and `--cache-options` of
`flexicache eval leval|longbench` (tiny model from conftest's `model_folder`, fixture data, no network)."""

import json
from pathlib import Path

import pytest

from fc_hf.eval import cli, generation
from fc_hf.eval.agreement import (agreement_markdown, agreement_stats, agreement_table, answer_f1, bootstrap_indices,
                                  pair_rows)

from benchmark_records import records_folder

FIXTURES = records_folder()  # invented L-Eval / LongBench records, written to a temporary folder


def _run(root: Path, task: str, run: str, rows, bench="leval", model="m", **config):
    folder = root / bench / model / task / run
    folder.mkdir(parents=True)
    method, _, budget = run.partition("-b")
    cfg = {"bench": bench, "model": model, "task": task, "method": method, "max_prompt_tokens": 4096,
           "budget": int(budget.split("-")[0]) if budget else None, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "predictions.jsonl").write_text(
        "".join(json.dumps({"id": i, "prediction": p, "score": s, "prompt_tokens": 100}) + "\n" for i, p, s in rows))
    return folder


@pytest.fixture
def root(tmp_path):
    """financial_qa (open-ended) and quality (exam): dense, quest-b64 (differs), flexicache-b64 (= dense on
    financial_qa only). Ids "d" (dense only) and "e" (quest only) have no partner."""
    _run(tmp_path, "financial_qa", "dense",
         [("a", "The cat sat on the mat", 1.0), ("b", "blue", 0.5), ("c", "", 0.0), ("d", "only dense", 1.0)])
    _run(tmp_path, "financial_qa", "quest-b64",
         [("e", "extra", 1.0), ("a", "cat sat on a hat", 0.5), ("b", "Blue.", 0.5), ("c", "  ", 0.0)])
    _run(tmp_path, "financial_qa", "flexicache-b64",
         [("a", "The cat sat on the mat", 1.0), ("b", "blue", 0.5), ("c", "", 0.0), ("d", "only dense", 1.0)])
    _run(tmp_path, "quality", "dense", [("x", "A", 1.0), ("y", "B", 0.0)])
    _run(tmp_path, "quality", "quest-b64", [("x", "A", 1.0), ("y", "C", 1.0)])
    return tmp_path


def _row(rows, task, run):
    (hit,) = [r for r in rows if r["task"] == task and r["run"] == run]
    return hit


def test_answer_f1_uses_qa_normalisation_and_two_empty_answers_agree():
    # "the" / "a" are dropped: {cat, sat, on, mat} vs {cat, sat, on, hat} -> P = R = 3/4
    assert answer_f1("The cat sat on the mat", "cat sat on a hat") == pytest.approx(0.75)
    assert answer_f1("Blue.", "blue") == 1.0
    assert answer_f1("", "  ") == 1.0 and answer_f1("the", "") == 1.0  # both normalise to nothing
    assert answer_f1("", "blue") == 0.0 and answer_f1("red", "blue") == 0.0
    # bag of words: "x y y" vs "y" -> P = 1/3, R = 1
    assert answer_f1("x y y", "y") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))


def test_pairs_keep_only_ids_in_both_runs():
    dense = [{"id": 1, "score": 0}, {"id": "2", "score": 0}, {"id": "3", "score": 0}]
    method = [{"id": "3", "score": 1}, {"id": "1", "score": 1}, {"id": "4", "score": 1}]
    assert [(d["id"], m["id"]) for d, m in pair_rows(dense, method)] == [(1, "1"), ("3", "3")]


def test_per_task_numbers_match_hand_computed_values(root):
    rows = agreement_table(root, "leval", resamples=500)
    r = _row(rows, "financial_qa", "quest-b64")
    assert r["n"] == 3 and not r["pooled"] and r["max_prompt_tokens"] == 4096  # "d" and "e" left out
    assert r["method_score"] == pytest.approx(1 / 3) and r["dense_score"] == pytest.approx(0.5)
    assert r["retention"] == pytest.approx(2 / 3)
    assert r["agreement"] == pytest.approx((0.75 + 1 + 1) / 3)
    assert r["identical"] == pytest.approx(1 / 3)  # only "c" ("" vs "  "); "Blue." != "blue"
    q = _row(rows, "quality", "quest-b64")
    assert (q["n"], q["method_score"], q["dense_score"], q["retention"], q["agreement"], q["identical"]) == (
        2, 1.0, 0.5, 2.0, 0.5, 0.5)


def test_pooled_rows_weight_questions_and_split_open_ended_from_exam(root):
    rows = agreement_table(root, "leval", resamples=500)
    pooled = _row(rows, "all", "quest-b64")
    assert pooled["pooled"] and pooled["tasks"] == 2 and pooled["n"] == 5
    assert pooled["method_score"] == pytest.approx(0.6) and pooled["dense_score"] == pytest.approx(0.5)
    assert pooled["retention"] == pytest.approx(1.2)
    assert pooled["agreement"] == pytest.approx((0.75 + 1 + 1 + 1 + 0) / 5)
    assert pooled["identical"] == pytest.approx(2 / 5)
    assert _row(rows, "open-ended", "quest-b64")["agreement"] == pytest.approx(_row(rows, "financial_qa", "quest-b64")["agreement"])
    assert _row(rows, "exam", "quest-b64")["n"] == 2
    # flexicache-b64 exists on one task only: its pooled row covers that task
    assert _row(rows, "all", "flexicache-b64")["tasks"] == 1
    assert [r["run"] for r in rows if r["task"] == "financial_qa"] == ["flexicache-b64", "quest-b64"]  # method order


def test_intervals_contain_the_estimate_and_have_zero_width_when_answers_equal_dense(root):
    rows = agreement_table(root, "leval", resamples=500)
    for r in rows:
        for key in ("retention", "agreement"):
            assert r[f"{key}_low"] <= r[key] + 1e-12 and r[key] <= r[f"{key}_high"] + 1e-12, (r, key)
    same = _row(rows, "financial_qa", "flexicache-b64")
    assert same["n"] == 4 and same["identical"] == 1.0
    assert (same["agreement_low"], same["agreement"], same["agreement_high"]) == (1.0, 1.0, 1.0)
    assert (same["retention_low"], same["retention"], same["retention_high"]) == (1.0, 1.0, 1.0)
    differs = _row(rows, "financial_qa", "quest-b64")
    assert differs["agreement_high"] - differs["agreement_low"] > 0.05


def test_interval_shrinks_with_more_questions():
    pairs = [({"score": s, "prediction": "a b"}, {"score": t, "prediction": p})
             for s, t, p in [(1, 1, "a b"), (1, 0, "c"), (0, 1, "a"), (1, 1, "b a")]]
    few, many = agreement_stats({"t": pairs}), agreement_stats({"t": pairs * 16})
    assert few["agreement"] == pytest.approx(many["agreement"])
    assert many["agreement_high"] - many["agreement_low"] < 0.6 * (few["agreement_high"] - few["agreement_low"])
    assert many["retention_high"] - many["retention_low"] < 0.6 * (few["retention_high"] - few["retention_low"])
    assert agreement_stats({"t": pairs}, seed=3) == agreement_stats({"t": pairs}, seed=3)  # seeded


def test_pooled_bootstrap_is_stratified_by_task():
    # every question of task a agrees fully, none of task b: resampling within each task keeps the pooled
    # agreement at exactly 0.5; resampling across tasks would not
    agree = ({"score": 1, "prediction": "yes"}, {"score": 1, "prediction": "yes"})
    disagree = ({"score": 1, "prediction": "yes"}, {"score": 1, "prediction": "no"})
    stats = agreement_stats({"a": [agree] * 5, "b": [disagree] * 5})
    assert (stats["agreement_low"], stats["agreement"], stats["agreement_high"]) == (0.5, 0.5, 0.5)


def test_dense_scoring_nothing_gives_no_retention(tmp_path):
    _run(tmp_path, "t", "dense", [("a", "x", 0.0)])
    _run(tmp_path, "t", "quest-b64", [("a", "x", 1.0)])
    (r,) = agreement_table(tmp_path, "leval")
    assert r["retention"] is None and r["retention_low"] is None and r["agreement"] == 1.0


def test_runs_on_other_prompts_or_without_dense_are_left_out(tmp_path):
    _run(tmp_path, "t", "dense", [("a", "x", 1.0)])
    _run(tmp_path, "t", "quest-b64", [("a", "x", 1.0)], max_prompt_tokens=8192)
    _run(tmp_path, "u", "quest-b64", [("a", "x", 1.0)])  # no dense run beside it
    with pytest.warns(UserWarning, match="max_prompt_tokens"):
        assert agreement_table(tmp_path, "leval") == []


def test_runs_with_another_answer_length_are_left_out(tmp_path):
    _run(tmp_path, "t", "dense", [("a", "x", 1.0)], max_new_tokens=64)
    _run(tmp_path, "t", "quest-b64", [("a", "x", 1.0)], max_new_tokens=16)
    _run(tmp_path, "t", "flexicache-b64", [("a", "x", 1.0)], max_new_tokens=64)
    with pytest.warns(UserWarning, match="max_new_tokens"):
        assert [r["run"] for r in agreement_table(tmp_path, "leval")] == ["flexicache-b64"]


def test_resamples_without_a_dense_score_are_counted_and_marked(root):
    rows = agreement_table(root, "leval", resamples=500)
    q = _row(rows, "quality", "quest-b64")  # dense scores x: 1, y: 0; a resample of y twice has no ratio
    idx = bootstrap_indices([2], 500, 0)
    assert q["retention_dropped"] == int((idx == 1).all(axis=1).sum()) > 0
    assert _row(rows, "financial_qa", "quest-b64")["retention_dropped"] >= 0
    text = agreement_markdown(rows, resamples=500)
    assert f"| quality | quest-b64 | 2 | 1.000 / 0.500 | 2.000 [" in text
    assert next(line for line in text.splitlines() if line.startswith("| quality | quest-b64")).count(
        f"†{q['retention_dropped']} |") == 1
    assert "in N of the 500 resamples dense's mean score was 0" in text
    none = [dict(r, retention_dropped=0) for r in rows]
    assert "†" not in agreement_markdown(none, resamples=500)


def test_filters_by_model_and_task(root):
    _run(root, "financial_qa", "dense", [("a", "x", 1.0)], model="other")
    _run(root, "financial_qa", "quest-b64", [("a", "y", 0.0)], model="other")
    assert {r["model"] for r in agreement_table(root, "leval")} == {"m", "other"}
    rows = agreement_table(root, "leval", model="m", tasks=["quality"])
    assert {(r["model"], r["task"]) for r in rows} == {("m", "quality")}  # one task: no pooled row
    assert agreement_table(root, "longbench") == []


def test_cli_prints_and_writes_the_table(root, capsys):
    out = root / "report" / "agreement.md"
    assert cli.main(["agreement", "--results", str(root), "--out", str(out), "--resamples", "300", "--seed", "1"]) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out
    assert "## m — prompts ≤ 4096 tokens" in text and "300 resamples" in text and "seed 1" in text
    assert "| financial_qa | quest-b64 | 3 | 0.333 / 0.500 | 0.667 [" in text
    assert "| **all** (2 tasks) | quest-b64 | 5 | 0.600 / 0.500 | 1.200 [" in text
    assert cli.main(["agreement", "--results", str(root), "--bench", "longbench"]) == 1  # nothing to compare


def test_control_root_adds_a_dense_row_in_another_dtype_and_refuses_other_prompts(root, tmp_path):
    ctrl = tmp_path / "ctrl"
    _run(ctrl, "financial_qa", "dense", [("a", "The cat sat on a mat", 1.0), ("b", "blue", 0.5), ("c", "", 0.0)],
         dtype="bfloat16")
    _run(ctrl, "quality", "dense", [("x", "A", 1.0), ("y", "B", 0.0)], dtype="bfloat16", max_prompt_tokens=2048)
    rows = {(r["task"], r["run"]): r for r in agreement_table(root, "leval", resamples=200, control=ctrl)}
    fin = rows[("financial_qa", "dense-bfloat16")]
    assert fin["n"] == 3 and fin["agreement"] == pytest.approx((answer_f1("The cat sat on a mat", "The cat sat on the mat") + 2) / 3)
    with pytest.warns(UserWarning, match="max_prompt_tokens differ"):
        agreement_table(root, "leval", resamples=50, control=ctrl)
    assert ("quality", "dense-bfloat16") not in rows  # other prompts: no noise-floor row
    assert [run for (task, run) in rows if task == "financial_qa"][0] == "dense-bfloat16"  # listed first
    # A control in dense's own dtype says nothing about numerical noise: refused, with a warning.
    same = tmp_path / "same"
    _run(same, "financial_qa", "dense", [("a", "x", 1.0)])
    with pytest.warns(UserWarning, match="same dtype"):
        assert not [r for r in agreement_table(root, "leval", resamples=50, control=same) if r["run"].startswith("dense-")]


def test_cli_out_naming_a_folder_writes_the_table_inside_it(root):
    # The results root is what the other eval commands call --out; it must not crash with IsADirectoryError.
    assert cli.main(["agreement", "--results", str(root), "--out", str(root), "--resamples", "50"]) == 0
    assert "| financial_qa | quest-b64 | 3 |" in (root / "agreement-leval.md").read_text()


def _folders(out: Path, bench: str, task: str) -> dict[str, dict]:
    return {p.name: json.loads((p / "config.json").read_text()) for p in sorted((out / bench).glob(f"*/{task}/*"))}


def test_leval_and_longbench_cli_pass_cache_options_to_every_non_dense_cache(model_folder, tmp_path, monkeypatch):
    made = []
    real = generation.make_cache

    def spy(method, model, budget=1024, profile=None, base=None, **kw):
        made.append((method, base.page_size, base.rerank_interval))
        return real(method, model, budget, profile, base=base, **kw)

    monkeypatch.setattr(generation, "make_cache", spy)
    common = ["--model", str(model_folder), "--methods", "dense,quest", "--budgets", "64", "--out", str(tmp_path),
              "--max-prompt-tokens", "400", "--limit", "1"]
    leval_args = ["leval", *common, "--data", str(FIXTURES / "leval"), "--tasks", "multidoc_qa", "--max-new-tokens", "2"]
    assert cli.main([*leval_args, "--cache-options", "page_size=8,rerank_interval=4"]) == 0
    assert ("quest", 8, 4) in made and all(m == "dense" or (p, r) == (8, 4) for m, p, r in made)
    runs = _folders(tmp_path, "leval", "multidoc_qa")
    assert set(runs) == {"dense", "quest-b64-page_size=8-rerank_interval=4"}
    quest = runs["quest-b64-page_size=8-rerank_interval=4"]
    assert quest["cache_options"] == {"page_size": 8, "rerank_interval": 4} and quest["cache_defaults"]["page_size"] == 8
    assert "cache_options" not in runs["dense"] and runs["dense"]["cache_defaults"]["page_size"] == 16
    assert runs["dense"]["max_new_tokens"] == quest["max_new_tokens"] == 2  # agreement compares it (SAME_PROMPT_KEYS)

    # without options: a folder of its own for quest, the same dense folder (its answer is not redone)
    made.clear()
    assert cli.main(leval_args) == 0
    assert set(_folders(tmp_path, "leval", "multidoc_qa")) == {"dense", "quest-b64", "quest-b64-page_size=8-rerank_interval=4"}
    assert [m for m, _, _ in made] == ["quest"] and made[0][1] == 16
    dense_rows = (tmp_path / "leval" / model_folder.name / "multidoc_qa" / "dense" / "predictions.jsonl").read_text()
    assert dense_rows.count("\n") == 1
    assert {r["run"] for r in agreement_table(tmp_path, "leval")} == {"quest-b64", "quest-b64-page_size=8-rerank_interval=4"}

    assert cli.main(["longbench", *common, "--data", str(FIXTURES / "longbench"), "--tasks", "passage_count",
                     "--cache-options", "page_size=8"]) == 0
    assert set(_folders(tmp_path, "longbench", "passage_count")) == {"dense", "quest-b64-page_size=8"}



def test_versus_adds_each_runs_paired_f1_difference_on_shared_questions(root, capsys):
    """`--versus RUN`: other run - RUN, F1 vs dense per question both answered (financial_qa: a, b, c; "d" has no
    quest answer), the pooled row stratified by task (quality has no flexicache run: no stratum)."""
    rows = agreement_table(root, versus="quest-b64")
    flexi = _row(rows, "financial_qa", "flexicache-b64")
    # flexicache answers as dense (F1 1 each); quest: a 0.75, b 1 ("Blue." = "blue"), c 1 (both empty)
    assert flexi["difference"] == pytest.approx((0.25 + 0 + 0) / 3) and flexi["difference_n"] == 3
    assert flexi["difference_low"] <= flexi["difference"] <= flexi["difference_high"]
    pooled = _row(rows, "all", "flexicache-b64")
    assert pooled["difference"] == pytest.approx(flexi["difference"]) and pooled["difference_n"] == 3
    assert "difference" not in _row(rows, "financial_qa", "quest-b64")  # the reference itself
    assert "difference" not in _row(agreement_table(root), "financial_qa", "flexicache-b64")  # only when asked
    assert cli.main(["agreement", "--results", str(root), "--versus", "quest-b64"]) == 0
    out = capsys.readouterr().out
    assert "F1 - quest-b64 [95% CI] (n)" in out and "+0.083 [" in out

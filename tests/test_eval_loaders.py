"""LongBench and L-Eval loaders on JSONL fixtures in the benchmarks' schema; prompts; hub fallback."""

import json
from pathlib import Path

import pytest

from fc_hf.eval import leval, longbench, sources

from benchmark_records import records_folder

FIXTURES = records_folder()  # invented L-Eval / LongBench records, written to a temporary folder


class WordTokenizer:
    """Whitespace tokenizer: one id per word, enough to test truncation and prompt layout."""

    chat_template = None

    def __init__(self):
        self.vocab, self.words = {}, []

    def __call__(self, text, add_special_tokens=False):
        ids = []
        for w in text.split(" "):
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return {"input_ids": ids}

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def test_longbench_local_folder_and_file():
    recs = longbench.load_longbench("hotpotqa", local=FIXTURES / "longbench")
    assert [r["answers"] for r in recs] == [["Paris"], ["Philip K. Dick", "Philip Kindred Dick"]]
    one = longbench.load_longbench("hotpotqa", local=FIXTURES / "longbench" / "hotpotqa.jsonl", limit=1)
    assert len(one) == 1 and one[0]["_id"] == "hotpotqa-0"


def test_longbench_missing_task_file_prints_one_line_and_skips(capsys):
    assert longbench.load_longbench("qasper", local=FIXTURES / "longbench") is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "qasper" in out[0] and "skipped" in out[0]


def test_unknown_task_raises():
    with pytest.raises(KeyError):
        longbench.load_longbench("not_a_task", local=FIXTURES / "longbench")
    with pytest.raises(KeyError):
        leval.load_leval("gsm100", local=FIXTURES / "leval")  # closed-ended, but not among the tasks scored here


def test_wrong_schema_raises(tmp_path):
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match="LongBench schema"):
        longbench.load_longbench("hotpotqa", local=tmp_path)


def test_bad_json_line_names_file_and_line(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2"):
        sources.read_jsonl(f)


def test_hub_unreachable_skips_with_one_line(monkeypatch, capsys):
    import datasets

    def boom(*a, **k):
        raise ConnectionError("Couldn't reach 'THUDM/LongBench' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    assert longbench.load_longbench("hotpotqa") is None
    assert leval.load_leval("financial_qa") is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2
    assert "THUDM/LongBench" in out[0] and "skipped" in out[0]
    assert "L4NLP/LEval" in out[1]


def test_hub_path_used_when_no_local(monkeypatch):
    import datasets

    seen = {}

    def fake(hub_id, task, split):
        seen.update(hub_id=hub_id, task=task, split=split)
        return [{"input": "q", "context": "c", "answers": ["a"]}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert longbench.load_longbench("musique") == [{"input": "q", "context": "c", "answers": ["a"]}]
    assert seen == {"hub_id": "THUDM/LongBench", "task": "musique", "split": "test"}


def test_longbench_prompt_layout_and_middle_truncation():
    tok = WordTokenizer()
    rec = longbench.load_longbench("hotpotqa", local=FIXTURES / "longbench")[0]
    ids = longbench.build_prompt_ids(tok, "hotpotqa", rec, max_prompt_tokens=10_000)
    text = tok.decode(ids)
    assert rec["context"].split(" ")[3] in text and text.rstrip().endswith("Answer:")
    assert rec["input"] in text
    short = longbench.build_prompt_ids(tok, "hotpotqa", rec, max_prompt_tokens=12)
    assert len(short) == 12 and short[:6] == ids[:6] and short[-6:] == ids[-6:]
    assert tok.decode(short) == longbench.prompt_text(tok, "hotpotqa", rec, 12)  # the text lm-eval's task gets


def test_truncate_middle():
    assert longbench.truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert longbench.truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert longbench.truncate_middle([1, 2], 5) == [1, 2]


def test_longbench_scoring_on_fixtures():
    lb = FIXTURES / "longbench"
    trec = longbench.load_longbench("trec", local=lb)[0]
    assert longbench.score_sample("trec", "Mountain\nQuestion: next", trec) == 1.0
    count = longbench.load_longbench("passage_count", local=lb)[0]
    assert longbench.score_sample("passage_count", "2", count) == 1.0
    retr = longbench.load_longbench("passage_retrieval_en", local=lb)[0]
    assert longbench.score_sample("passage_retrieval_en", "Paragraph 1", retr) == 0.0
    lcc = longbench.load_longbench("lcc", local=lb)[0]
    assert longbench.score_sample("lcc", "    return total\n", lcc) == 1.0
    zh = longbench.load_longbench("multifieldqa_zh", local=lb)[0]
    assert longbench.score_sample("multifieldqa_zh", "北京", zh) == 1.0


def test_prompt_file_overrides(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"hotpotqa": "Q: {input}\nC: {context}\nA:"}))
    prompts = longbench.load_prompts(f)
    assert prompts["hotpotqa"].startswith("Q: ") and prompts["musique"] == longbench.PROMPTS["musique"]


def test_leval_flattens_instructions_and_picks_metric():
    samples = leval.load_leval("financial_qa", local=FIXTURES / "leval")
    assert [s["instruction"] for s in samples] == ["What was the revenue growth in the quarter?", "Who is the chief executive?"]
    assert all(s["evaluation"] == "f1" for s in samples)
    assert leval.score_sample("Jane Smith", samples[1]) == 1.0
    # A record marked for LLM judging falls back to the task's automatic metric (ROUGE for summaries).
    news = leval.load_leval("news_summ", local=FIXTURES / "leval")
    assert news[0]["evaluation"] == "rouge"
    assert leval.score_sample("Heavy rain flooded the city centre on Monday.", news[0]) == pytest.approx(1.0)


def test_leval_mismatched_lists_raise(tmp_path):
    (tmp_path / "financial_qa.jsonl").write_text(json.dumps({"input": "d", "instructions": ["a", "b"], "outputs": ["x"]}) + "\n")
    with pytest.raises(ValueError, match="2 instructions but 1 outputs"):
        leval.load_leval("financial_qa", local=tmp_path)


def test_leval_prompt_keeps_head_and_tail_and_asks_length():
    tok = WordTokenizer()
    s = dict(leval.load_leval("financial_qa", local=FIXTURES / "leval")[0])
    s["document"] = " ".join(f"w{i}" for i in range(500))
    s = leval.add_prompts([s], tok, max_length=120 + leval.CHAT_RESERVE)[0]
    ids = leval.prompt_ids(tok, s)
    text = tok.decode(ids)
    assert 100 <= len(ids) <= 120
    assert "w0" in text and "w499" in text and "w250" not in text  # head and tail kept, the middle cut
    assert "about 7 words" in text and s["instruction"] in text and text.endswith("Answer:")
    uncut = leval.add_prompts([dict(s)], tok, max_length=None)[0]
    assert "w250" in uncut["prompt"]


def test_leval_questions_of_a_document_share_its_cut_text_whatever_the_limit():
    tok = WordTokenizer()
    full = leval.load_leval("multidoc_qa", local=FIXTURES / "leval", tokenizer=tok, max_length=160)
    assert [(s["doc_index"], s["inst_index"]) for s in full] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    docs = [s["prompt"].split("\n\nInstruction:")[0] for s in full]
    assert docs[0] == docs[1] == docs[2] != docs[3] == docs[4]
    assert "Martha" in docs[0] and "112 steps" in docs[0] and "1923" not in docs[0]  # the middle is cut
    assert leval.load_leval("multidoc_qa", local=FIXTURES / "leval", tokenizer=tok, max_length=160, limit=1)[0] == full[0]
    assert full[3]["evaluation"] == "f1"  # marked "human": the task's automatic metric


def test_leval_exam_tasks_load_prompt_and_score():
    tok = WordTokenizer()
    quality = leval.load_leval("quality", local=FIXTURES / "leval", tokenizer=tok)
    assert [s["evaluation"] for s in quality] == ["exam"] * 3
    assert "letter of the correct option" in quality[0]["prompt"] and quality[0]["prompt"].endswith("Answer:")
    assert leval.score_sample(" B", quality[0]) == 1.0 and leval.score_sample("A", quality[0]) == 0.0
    coursera = leval.load_leval("coursera", local=FIXTURES / "leval")
    assert leval.score_sample("AC", coursera[0]) == 0.25 and leval.score_sample("ABC", coursera[0]) == 1.0
    # sci_fi and topic_retrieval_longchat: the *_from_the_real_data tests below (no copy of their records is kept here)
    assert set(leval.MAX_NEW_TOKENS) == set(leval.TASKS)


def test_task_file_found_one_folder_down(tmp_path):
    for sub in ("Open-ended-tasks", "Closed-ended-tasks"):
        (tmp_path / sub).mkdir()
    src = FIXTURES / "leval"
    (tmp_path / "Open-ended-tasks" / "financial_qa.jsonl").write_text((src / "financial_qa.jsonl").read_text())
    (tmp_path / "Closed-ended-tasks" / "quality.jsonl").write_text((src / "quality.jsonl").read_text())
    assert len(leval.load_leval("financial_qa", local=tmp_path)) == 2
    assert len(leval.load_leval("quality", local=tmp_path)) == 3
    (tmp_path / "Closed-ended-tasks" / "financial_qa.jsonl").write_text("")
    with pytest.raises(ValueError, match="several folders"):
        leval.load_leval("financial_qa", local=tmp_path)


SHARED_LEVAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "leval" / "closed-ended"


@pytest.mark.skipif(not (SHARED_LEVAL / "topic_retrieval_longchat.jsonl").exists(),
                    reason="the L-Eval data folder (../shared/data/leval) is not on this machine")
def test_leval_topic_retrieval_from_the_real_data():
    """Topic retrieval is read from the benchmark's own file at run time (no copy of it is kept in the repository)."""
    samples = leval.load_leval("topic_retrieval_longchat", local=SHARED_LEVAL, limit=2)
    assert len(samples) == 2 and all(s["evaluation"] == "exam" for s in samples)
    record = json.loads((SHARED_LEVAL / "topic_retrieval_longchat.jsonl").read_text().split("\n", 1)[0])
    assert leval.score_sample(record["outputs"][1], samples[1]) == 1.0
    assert leval.score_sample("an answer naming no topic of the chat", samples[1]) == 0.0


@pytest.mark.skipif(not (SHARED_LEVAL / "sci_fi.jsonl").exists(),
                    reason="the L-Eval data folder (../shared/data/leval) is not on this machine")
def test_leval_sci_fi_from_the_real_data():
    """True/False judgements are read from the benchmark's own file at run time and scored on the answer before
    its "[fact: ...]" note (no copy of the records is kept in the repository)."""
    samples = leval.load_leval("sci_fi", local=SHARED_LEVAL, limit=3)
    assert len(samples) == 3 and all(s["evaluation"] == "exam" for s in samples)
    record = json.loads((SHARED_LEVAL / "sci_fi.jsonl").read_text().split("\n", 1)[0])
    for sample, output in zip(samples, record["outputs"]):
        answer = output.split()[0]  # "True" or "False"
        other = {"True": "False", "False": "True"}[answer]
        assert leval.score_sample(answer, sample) == 1.0 and leval.score_sample(other, sample) == 0.0

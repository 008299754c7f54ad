"""LongBench / L-Eval scoring functions: hand-computed values and a cross-check against rouge_score."""

import math

import pytest

from fc_hf.eval import metrics as M


def test_normalize_answer_drops_case_punctuation_articles():
    assert M.normalize_answer("The  Eiffel Tower, in an old Paris!") == "eiffel tower in old paris"


@pytest.mark.parametrize(
    "pred,ref,expected",
    [
        ("Paris", "paris.", 1.0),
        ("the city of Paris", "Paris", 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # tokens: city of paris vs paris
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("a a b", "a b b", 2 * (2 / 3) * (2 / 3) / (4 / 3)),  # bag overlap counts repeats: {a:1, b:1}
    ],
)
def test_qa_f1(pred, ref, expected):
    assert M.qa_f1(pred, ref) == pytest.approx(expected)


def test_qa_f1_zh_is_character_level():
    assert M.qa_f1_zh("北京。", "北京") == pytest.approx(1.0)
    assert M.qa_f1_zh("北京市", "北京") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))


def test_rouge_l_known_value():
    # LCS("the cat sat on the mat", "the cat lay on a mat") = the cat on mat = 4 words; 6 and 6 words.
    assert M.rouge_l("the cat sat on the mat", "the cat lay on a mat") == pytest.approx(4 / 6)
    assert M.rouge_l("", "anything") == 0.0


def test_rouge_n_bigrams():
    # bigrams: pred {ab, bc, cd}, ref {ab, bc, ce}: overlap 2 of 3 each.
    assert M.rouge_n("a b c d", "a b c e", 2) == pytest.approx(2 / 3)


def test_rouge_matches_rouge_score_package():
    rs = pytest.importorskip("rouge_score.rouge_scorer")
    scorer = rs.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    pairs = [
        ("Heavy rain flooded the city centre on Monday.", "On Monday heavy rain fell and flooded the centre."),
        ("The report finds spending rose 10% over two years", "Spending rose ten percent in two years, the agency found."),
        ("a b a b a", "b a b a b a"),
    ]
    for pred, ref in pairs:
        s = scorer.score(ref, pred)
        assert M.rouge_n(pred, ref, 1) == pytest.approx(s["rouge1"].fmeasure)
        assert M.rouge_n(pred, ref, 2) == pytest.approx(s["rouge2"].fmeasure)
        assert M.rouge_l(pred, ref) == pytest.approx(s["rougeL"].fmeasure)
        geo = (s["rouge1"].fmeasure * s["rouge2"].fmeasure * s["rougeL"].fmeasure) ** (1 / 3)
        assert M.leval_rouge(pred, ref) == pytest.approx(geo)


def test_classification_score():
    classes = ["Individual", "City", "Mountain", "Other location"]
    assert M.classification_score("Mountain", "Mountain", classes) == 1.0
    assert M.classification_score("Mountain or City", "Mountain", classes) == 0.5
    assert M.classification_score("City", "Mountain", classes) == 0.0
    # "location" inside "Other location" is a substring of the reference, not a second mention.
    assert M.classification_score("Other location", "Other location", ["location", "Other location"]) == 1.0


def test_retrieval_and_count():
    assert M.retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert M.retrieval_score("Paragraph 2 or Paragraph 7", "Paragraph 2") == 0.5
    assert M.retrieval_score("I do not know", "Paragraph 2") == 0.0
    assert M.retrieval_zh_score("段落3", "段落3") == 1.0
    assert M.count_score("There are 2 unique paragraphs", "2") == 1.0
    assert M.count_score("2 or 3", "2") == 0.5
    assert M.count_score("none", "2") == 0.0


def test_code_sim_skips_fences_and_comments():
    pred = "```python\n# the answer\n    return total\n```"
    assert M.code_sim_score(pred, "    return total") == 1.0
    assert 0.0 < M.code_sim_score("    return tot", "    return total") < 1.0


def test_score_longbench_first_line_and_best_answer():
    assert M.score_longbench("triviaqa", "Paris\nQuestion: something else", ["Paris"]) == 1.0
    assert M.score_longbench("hotpotqa", "Philip K. Dick", ["P. Dick", "Philip K. Dick"]) == 1.0
    assert M.score_longbench("hotpotqa_e", "Paris", ["Paris"]) == 1.0
    assert M.score_longbench("trec", "Mountain", ["Mountain"], ["City", "Mountain"]) == 1.0
    with pytest.raises(KeyError):
        M.score_longbench("no_such_task", "x", ["x"])


def test_score_leval_dispatch():
    assert M.score_leval("f1", "Jane Smith", ["Jane Smith"]) == 1.0
    assert M.score_leval("rouge", "heavy rain flooded", ["heavy rain flooded"]) == pytest.approx(1.0)
    assert M.score_leval("rouge", "one", ["one"]) == 0.0  # no bigram: the geometric mean is 0
    with pytest.raises(ValueError):
        M.score_leval("LLM", "x", ["x"])


def test_best_of_empty_references_is_zero():
    assert M.best_of(M.qa_f1, "x", []) == 0.0
    assert not math.isnan(M.best_of(M.rouge_l, "x", ["y"]))


@pytest.mark.parametrize("answer,several,expected", [
    ("B", False, "B"), (" C) because", False, "C"), ("Answer: D", False, "A"),  # L-Eval: first A-D anywhere
    ("none of them", False, "A"), ("", False, ""), ("AB", True, "AB"), ("DB.", True, "BD"),
    ("A, C and D", True, "AC"),  # a capital ending the answer does not stand alone (L-Eval's pattern)
    ("B. pear\nD. cherry\nQuestion 3: A", True, "BD"), ("I think ACD", True, "ACD"),
])
def test_leval_answer_letters(answer, several, expected):
    assert M.leval_answer_letters(answer, several=several) == expected


def test_score_leval_exam_rules():
    assert M.leval_reference_letters("(C) The telephone failed") == "C" and M.leval_reference_letters("ABD") == "ABD"
    assert M.score_leval_exam("quality", " B", ["(B) Because two grain ships ran aground"]) == 1.0
    assert M.score_leval_exam("tpo", "C", ["B"]) == 0.0
    assert M.score_leval_exam("coursera", "AB", ["ABC"]) == 0.25  # some of several correct options
    assert M.score_leval_exam("coursera", "ABD", ["ABC"]) == 0.0 and M.score_leval_exam("coursera", "CAB", ["ABC"]) == 1.0
    assert M.score_leval_exam("quality", "   ", ["(A) x"]) == 0.0
    assert M.score_leval_exam("sci_fi", "False. The story says", ["False [fact: True]"]) == 1.0
    assert M.score_leval_exam("sci_fi", "It is true", ["False [fact: False]"]) == 0.0
    assert M.score_leval_exam("sci_fi", "Maybe", ["True [fact: True]"]) == 0.0
    topic = ["The history of tea"]
    assert M.score_leval_exam("topic_retrieval_longchat", "\nthe History of Tea.\nthen bread", topic) == 1.0
    assert M.score_leval_exam("topic_retrieval_longchat", "Bread baking\nThe history of tea", topic) == 0.0  # first line only
    with pytest.raises(KeyError):
        M.score_leval_exam("gsm100", "4", ["4"])

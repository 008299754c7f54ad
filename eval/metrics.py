"""Scoring functions of LongBench and L-Eval, written for this project from the benchmarks' papers.

LongBench (Bai et al., 2023) scores each sample against every reference answer and keeps the
best; a task's score is 100 x the mean over samples. L-Eval's open-ended tasks use token F1 or
ROUGE (the geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L F-measures). All functions here take
one prediction and one reference and return a float in [0, 1]; `best_of` and `LONGBENCH_METRICS`
do the rest.

L-Eval's closed-ended ("exam") tasks score exact match after the answer is parsed as L-Eval's
`Evaluation/auto_eval.py` and `em.py` parse it (`score_leval_exam`): option letters for multiple
choice (a quarter point when a coursera answer picks only some of several correct options), True /
False for sci_fi, the reference topic inside the answer's first line for topic retrieval.

Where this differs from the official scripts (say so when comparing with published numbers):
ROUGE uses a lower-cased alphanumeric tokenizer and no stemming, code similarity uses difflib's
ratio (the official script uses fuzzywuzzy, which is the same measure when python-Levenshtein is
absent), and the Chinese variants split into characters rather than jieba words. L-Eval's sci_fi
score averages "loyalty" (answered from the document) and "fact" (the question asked again without
the document); only loyalty is scored here, as fact involves no long context.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Iterable, Sequence

__all__ = [
    "normalize_answer",
    "token_f1",
    "qa_f1",
    "qa_f1_zh",
    "rouge_n",
    "rouge_l",
    "rouge_l_zh",
    "leval_rouge",
    "classification_score",
    "retrieval_score",
    "retrieval_zh_score",
    "count_score",
    "code_sim_score",
    "best_of",
    "LONGBENCH_METRICS",
    "FIRST_LINE_TASKS",
    "score_longbench",
    "score_leval",
    "LEVAL_CHOICE_TASKS",
    "leval_reference_letters",
    "leval_answer_letters",
    "leval_true_false",
    "score_leval_exam",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_ZH_PUNCT = set("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_WORD = re.compile(r"[a-z0-9]+")


# -- normalisation and tokenisation ----------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, drop punctuation and English articles, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _normalize_zh(text: str) -> str:
    text = text.lower()
    return "".join(ch for ch in text if ch not in _PUNCT and ch not in _ZH_PUNCT and not ch.isspace())


def _words(text: str) -> list[str]:
    """Lower-cased alphanumeric words (the tokenizer ROUGE uses here)."""
    return _WORD.findall(text.lower())


# -- token overlap -----------------------------------------------------------------------------------
def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Harmonic mean of token precision and recall, counting repeated tokens (bag of words)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    """Token F1 after `normalize_answer` (LongBench's QA metric, L-Eval's "f1")."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str) -> float:
    """Character-level F1 for Chinese answers (approximates the official jieba word split)."""
    return token_f1(list(_normalize_zh(prediction)), list(_normalize_zh(reference)))


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _f_measure(overlap: float, n_pred: int, n_ref: int) -> float:
    if overlap == 0 or n_pred == 0 or n_ref == 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_ref
    return 2 * precision * recall / (precision + recall)


def rouge_n(prediction: str, reference: str, n: int = 1) -> float:
    """ROUGE-N F-measure on lower-cased alphanumeric words."""
    pred, ref = _ngrams(_words(prediction), n), _ngrams(_words(reference), n)
    return _f_measure(sum((pred & ref).values()), sum(pred.values()), sum(ref.values()))


def _lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def _rouge_l_tokens(pred: Sequence[str], ref: Sequence[str]) -> float:
    return _f_measure(_lcs_length(pred, ref), len(pred), len(ref))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (longest common subsequence of words)."""
    return _rouge_l_tokens(_words(prediction), _words(reference))


def rouge_l_zh(prediction: str, reference: str) -> float:
    """ROUGE-L over characters, for the Chinese LongBench tasks."""
    return _rouge_l_tokens(list(_normalize_zh(prediction)), list(_normalize_zh(reference)))


def leval_rouge(prediction: str, reference: str) -> float:
    """L-Eval's ROUGE score: geometric mean of the ROUGE-1, ROUGE-2 and ROUGE-L F-measures."""
    r1, r2, rl = rouge_n(prediction, reference, 1), rouge_n(prediction, reference, 2), rouge_l(prediction, reference)
    return (r1 * r2 * rl) ** (1.0 / 3.0)


# -- LongBench's task-specific scores ------------------------------------------------------------------
def classification_score(prediction: str, reference: str, all_classes: Iterable[str] = ()) -> float:
    """1/m if the reference class is among the m class names the prediction mentions, else 0.

    A mentioned class that is a proper substring of the reference (e.g. "city" inside "city name")
    is not counted as a separate mention.
    """
    mentioned = [c for c in all_classes if c in prediction]
    mentioned = [c for c in mentioned if not (c in reference and c != reference)]
    return 1.0 / len(mentioned) if reference in mentioned else 0.0


def _numbers_share(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, reference: str) -> float:
    """Share of the numbers in the prediction that name the reference's "Paragraph N"."""
    found = re.findall(r"Paragraph (\d+)", reference)
    return _numbers_share(prediction, found[0]) if found else 0.0


def retrieval_zh_score(prediction: str, reference: str) -> float:
    """Chinese variant of `retrieval_score` (the reference reads "段落N")."""
    found = re.findall(r"段落(\d+)", reference)
    return _numbers_share(prediction, found[0]) if found else 0.0


def count_score(prediction: str, reference: str) -> float:
    """Share of the numbers in the prediction that equal the reference count."""
    return _numbers_share(prediction, str(reference).strip())


def code_sim_score(prediction: str, reference: str) -> float:
    """Edit similarity of the first real code line of the prediction with the reference line.

    Lines that are empty after stripping, or hold markdown fences or comments, are skipped: a chat
    model often wraps code in them.
    """
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return difflib.SequenceMatcher(None, line, reference).ratio()


# -- aggregation ---------------------------------------------------------------------------------------
def best_of(metric: Callable[..., float], prediction: str, references: Sequence[str], **kwargs) -> float:
    """The best score of `prediction` over several acceptable references (0 when there are none)."""
    return max((metric(prediction, ref, **kwargs) for ref in references), default=0.0)


LONGBENCH_METRICS: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1,
    "qasper": qa_f1,
    "multifieldqa_en": qa_f1,
    "multifieldqa_zh": qa_f1_zh,
    "hotpotqa": qa_f1,
    "2wikimqa": qa_f1,
    "musique": qa_f1,
    "dureader": rouge_l_zh,
    "gov_report": rouge_l,
    "qmsum": rouge_l,
    "multi_news": rouge_l,
    "vcsum": rouge_l_zh,
    "trec": classification_score,
    "triviaqa": qa_f1,
    "samsum": rouge_l,
    "lsht": classification_score,
    "passage_count": count_score,
    "passage_retrieval_en": retrieval_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

# Few-shot tasks whose model output is cut at the first line before scoring (the model tends to go
# on with another made-up example).
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def score_longbench(task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """One LongBench sample's score in [0, 1].

    Args:
        task (`str`): LongBench task name, e.g. "hotpotqa" (a "_e" suffix for LongBench-E is accepted).
        prediction (`str`): the model's answer.
        answers (`list[str]`): the reference answers; the best match counts.
        all_classes (`list[str]`, *optional*): class names (classification tasks only).
    """
    base = task[:-2] if task.endswith("_e") else task
    if base not in LONGBENCH_METRICS:
        raise KeyError(f"Unknown LongBench task {task!r}; known: {sorted(LONGBENCH_METRICS)}")
    if base in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRICS[base]
    if metric is classification_score:
        return best_of(metric, prediction, answers, all_classes=all_classes or ())
    return best_of(metric, prediction, answers)


def score_leval(evaluation: str, prediction: str, references: Sequence[str]) -> float:
    """One L-Eval open-ended answer's score in [0, 1]: `evaluation` is the record's "f1" or "rouge"."""
    kind = evaluation.lower()
    if kind == "f1":
        return best_of(qa_f1, prediction, references)
    if kind == "rouge":
        return best_of(leval_rouge, prediction, references)
    raise ValueError(f"L-Eval metric {evaluation!r} is not automatic; only 'f1' and 'rouge' are scored here.")


# -- L-Eval's closed-ended ("exam") tasks ------------------------------------------------------------------
# Multiple-choice tasks -> whether an answer may name several options (coursera: one or more correct).
LEVAL_CHOICE_TASKS = {"coursera": True, "quality": False, "tpo": False}
_OPTION_LETTERS = "ABCD"
_STANDALONE_CAPITAL = re.compile(r"\s*[A-Z](?=[\s.)])")
_LETTER_RUN = re.compile(f"[{_OPTION_LETTERS}]+")


def leval_reference_letters(reference: str) -> str:
    """The option letters of a multiple-choice reference, taken from its first word ("(B) The ..." -> "B",
    "ACD" -> "ACD"); "A" when that word has none (L-Eval's rule)."""
    words = reference.split()
    return "".join(ch for ch in (words[0] if words else "") if ch in _OPTION_LETTERS) or "A"


def leval_answer_letters(response: str, several: bool = False) -> str:
    """The option letters a model's answer names, parsed as L-Eval parses it ("" for an empty answer).

    One-answer tasks take the first capital A-D anywhere in the answer. Several-answer tasks (and
    one-answer tasks whose answer has no A-D at all) take a leading run of letters when it has two or
    more, else that letter plus every capital standing alone (before a space, "." or ")") before any
    "Question", else the first run of A-D letters; with nothing found L-Eval guesses "A".
    """
    if not response.strip():
        return ""
    if response in _OPTION_LETTERS:
        return response
    if not several:
        first = next((ch for ch in response if ch in _OPTION_LETTERS), None)
        if first is not None:
            return first
    lead = len(response) - len(response.lstrip(_OPTION_LETTERS))
    if lead > 1:
        return "".join(sorted(set(response[:lead])))
    rest = response[lead:].split("Question")[0]
    found = response[:lead] + "".join(m.strip() for m in _STANDALONE_CAPITAL.findall(rest))
    letters = "".join(sorted({ch for ch in found if ch in _OPTION_LETTERS}))
    if letters:
        return letters
    run = _LETTER_RUN.search(rest)
    return run.group(0) if run else "A"


def leval_true_false(text: str) -> str:
    """"true" / "false" from the first word that contains either (lower-cased), else "<error>"."""
    for word in text.lower().split():
        if "true" in word:
            return "true"
        if "false" in word:
            return "false"
    return "<error>"


def _first_real_line(text: str) -> str:
    """The first line longer than one character (the whole text when there is none)."""
    return next((line for line in text.split("\n") if len(line) > 1), text)


def _leval_exam_one(task: str, prediction: str, reference: str) -> float:
    if task in LEVAL_CHOICE_TASKS:
        answer = leval_answer_letters(prediction, several=LEVAL_CHOICE_TASKS[task])
        gold = leval_reference_letters(reference)
        if not answer:
            return 0.0
        if answer == gold:
            return 1.0
        return 0.25 if set(answer) <= set(gold) else 0.0
    if task == "sci_fi":  # reference "True [fact: False]": the part before "[fact:" is the document's answer
        gold = reference.lower().split("[fact:")[0].strip()
        return float(leval_true_false(prediction.split("[fact:")[0]) == gold)
    if task == "topic_retrieval_longchat":
        squeeze = lambda t: t.lower().replace(" ", "")  # noqa: E731
        return float(squeeze(reference) in squeeze(_first_real_line(prediction)))
    raise KeyError(f"{task!r} is not one of L-Eval's closed-ended tasks scored here")


def score_leval_exam(task: str, prediction: str, references: Sequence[str]) -> float:
    """One closed-ended L-Eval answer's score in [0, 1], the best over `references`.

    Args:
        task (`str`): "coursera", "quality", "tpo" (multiple choice), "sci_fi" (True/False) or
            "topic_retrieval_longchat" (name a topic of a long chat).
        prediction (`str`): the model's answer.
        references (`list[str]`): the record's output(s) for the question.
    """
    return max((_leval_exam_one(task, prediction, ref) for ref in references), default=0.0)

"""Scoring functions of LongBench and L-Eval, written for this project from the benchmarks' papers.

LongBench (Bai et al., 2023) scores each sample against every reference answer and keeps the
best; a task's score is 100 x the mean over samples. L-Eval's open-ended tasks use token F1 or
ROUGE (the geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L F-measures). All functions here take
one prediction and one reference and return a float in [0, 1]; `best_of` and `LONGBENCH_METRICS`
do the rest.

Where this differs from the official scripts (say so when comparing with published numbers):
ROUGE uses a lower-cased alphanumeric tokenizer and no stemming, code similarity uses difflib's
ratio (the official script uses fuzzywuzzy, which is the same measure when python-Levenshtein is
absent), and the Chinese variants split into characters rather than jieba words.
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

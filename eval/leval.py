"""L-Eval (L4NLP/LEval): open-ended tasks scored with F1 or ROUGE, closed-ended ("exam") tasks with exact match.

An L-Eval record is one long document with several questions: `input` (the document),
`instructions` (list of questions or tasks), `outputs` (list of references, one per instruction),
`source` and `evaluation` ("f1", "rouge", "exam", "LLM" or "human"). `load_leval` flattens it into
one sample per instruction. The hub has one configuration per task; offline, point `local` at a
folder of `<task>.jsonl` files in that schema (the benchmark's `LEval-data/` folder: its task files
may sit one folder down, e.g. `Open-ended-tasks/`, `Closed-ended-tasks/`).

Scoring: an open-ended record marked "f1" or "rouge" uses that metric; records marked for human or
LLM judging fall back to the task's metric in `TASK_METRIC` (F1 for question answering, ROUGE for
summaries and writing), so every sample gets an automatic score. As the benchmark recommends for
n-gram metrics, the prompt asks for about as many words as the reference has. Closed-ended tasks
(`EXAM_TASKS`) ask for a short answer and score it as L-Eval's own scripts do
(`metrics.score_leval_exam`).

Prompts: the document first, then the question (L-Eval's layout), so every question of a document
shares the prompt's prefix (`shared_prefill.PrefixReuse` prefills it once). A document too long for
`max_length` keeps its head and tail (LongBench's middle truncation), cut once per record to leave
room for the record's longest question: all its questions see the same document text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .metrics import score_leval, score_leval_exam
from .prompts import cut_middle, encode_prompt
from .sources import load_records

__all__ = [
    "HUB_ID", "TASKS", "TASK_METRIC", "EXAM_TASKS", "DEFAULT_TASKS", "MAX_NEW_TOKENS", "CHAT_RESERVE",
    "load_leval", "add_prompts", "prompt_ids", "score_sample",
]

HUB_ID = "L4NLP/LEval"

TASK_METRIC = {
    "financial_qa": "f1",
    "legal_contract_qa": "f1",
    "multidoc_qa": "f1",
    "narrative_qa": "f1",
    "natural_question": "f1",
    "scientific_qa": "f1",
    "gov_report_summ": "rouge",
    "meeting_summ": "rouge",
    "news_summ": "rouge",
    "paper_assistant": "rouge",
    "patent_summ": "rouge",
    "review_summ": "rouge",
    "tv_show_summ": "rouge",
}
# Closed-ended tasks with exact-match scoring: multiple choice, true/false, topic retrieval.
EXAM_TASKS = ("coursera", "quality", "tpo", "sci_fi", "topic_retrieval_longchat")
TASKS = tuple(TASK_METRIC) + EXAM_TASKS
# The paper scores "9 open-ended tasks" without naming them; these are the nine whose documents
# best fit a small model's window (shortest average length in the benchmark's statistics).
DEFAULT_TASKS = (
    "financial_qa", "gov_report_summ", "multidoc_qa", "news_summ", "paper_assistant",
    "patent_summ", "scientific_qa", "tv_show_summ", "meeting_summ",
)
# Generated tokens per answer: open-ended answers run to a paragraph, exam answers are a letter or a few words.
MAX_NEW_TOKENS = {**{t: 256 for t in TASK_METRIC}, **{t: 32 for t in EXAM_TASKS}}
# Prompt tokens kept free for a chat template's markers when the document is cut to `max_length`.
CHAT_RESERVE = 32

_SYSTEM = (
    "You are given a long document and then an instruction about it: a question to answer, a summary to "
    "write, or a passage to draft. Follow the instruction using the document."
)
_ONE_OPTION = ("You are given a long document and then a multiple-choice question about it with exactly one correct "
               "option.", "Reply with the letter of the correct option only (like A or B), without explanation.")
# Exam task -> (what precedes the document, the answer instruction after the question).
_EXAM_PROMPTS = {
    "coursera": ("You are given a long document and then a multiple-choice question about it. One or several options "
                 "may be correct.", "Reply with the letters of all correct options only (like A or BD), without "
                 "explanation."),
    "quality": _ONE_OPTION,
    "tpo": _ONE_OPTION,
    "sci_fi": ("You are given a science-fiction story and then a statement about the world it describes. Judge the "
               "statement by the story, not by real-world knowledge.", "Reply with True or False only."),
    "topic_retrieval_longchat": (
        "Below is the record of a long conversation between a USER and an ASSISTANT on several topics. Each topic "
        "begins with the USER saying 'I would like to discuss the topic of <TOPIC>'. Remember every <TOPIC>: you "
        "will be asked for one of them.", "Reply with the topic's name only."),
}
assert set(_EXAM_PROMPTS) == set(EXAM_TASKS)


def _check(task: str) -> None:
    if task not in TASKS:
        raise KeyError(f"Unknown L-Eval task {task!r}; known: {sorted(TASKS)}")


def _head(task: str) -> str:
    return (_EXAM_PROMPTS[task][0] if task in _EXAM_PROMPTS else _SYSTEM) + "\n\nDocument:\n"


def _tail(task: str, instruction: str, reference: str) -> str:
    if task in _EXAM_PROMPTS:
        return f"\n\nQuestion: {instruction}\n{_EXAM_PROMPTS[task][1]}\nAnswer:"
    words = max(1, len(str(reference).split()))
    return f"\n\nInstruction: {instruction}\nAnswer in about {words} words.\nAnswer:"


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def add_prompts(samples: list[dict[str, Any]], tokenizer, max_length: int | None) -> list[dict[str, Any]]:
    """Give every sample its `prompt` text; each document is cut once, for all its questions among `samples`
    (pass a task's samples before any limit, so that a prompt does not depend on the limit)."""
    by_doc: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for sample in samples:
        by_doc.setdefault((sample["task"], sample["doc_index"]), []).append(sample)
    for (task, _), group in by_doc.items():
        head = _head(task)
        tails = [_tail(task, s["instruction"], s["reference"]) for s in group]
        document = group[0]["document"]
        if max_length is not None:
            fixed = _count(tokenizer, head) + max(_count(tokenizer, t) for t in tails)
            document = cut_middle(tokenizer, document, max(0, max_length - fixed - CHAT_RESERVE))
        for sample, tail in zip(group, tails):
            sample["prompt"] = head + document + tail
    return samples


def load_leval(
    task: str, local: str | Path | None = None, limit: int | None = None, tokenizer=None, max_length: int | None = None,
) -> list[dict[str, Any]] | None:
    """One sample per (document, instruction) of an L-Eval task; None when the data is unavailable.

    Args:
        task (`str`): an L-Eval task (`TASKS`).
        local (`str` or `Path`, *optional*): a `<task>.jsonl` file or a folder of them (else the hub).
        limit (`int`, *optional*): keep the first `limit` samples (prompts are built before the cut, so a
            sample's prompt never depends on `limit`).
        tokenizer (*optional*): when given, each sample also gets its `prompt` text.
        max_length (`int`, *optional*): prompt tokens (before any chat template, which gets `CHAT_RESERVE`):
            longer documents keep their head and tail. None: documents are never cut.

    Each sample has `task`, `document`, `instruction`, `reference`, `evaluation` (the metric actually used:
    "f1", "rouge" or "exam"), `doc_index` and `inst_index` (and `prompt` with a tokenizer).
    """
    _check(task)
    records = load_records("L-Eval", HUB_ID, task, local=local)
    if records is None:
        return None
    samples = []
    for d, r in enumerate(records):
        missing = {"input", "instructions", "outputs"} - set(r)
        if missing:
            raise ValueError(f"L-Eval {task} record {d} lacks {sorted(missing)}: not the L-Eval schema.")
        if len(r["instructions"]) != len(r["outputs"]):
            raise ValueError(f"L-Eval {task} record {d}: {len(r['instructions'])} instructions but {len(r['outputs'])} outputs.")
        declared = str(r.get("evaluation", "")).lower()
        if task in EXAM_TASKS:
            metric = "exam"
        else:
            metric = declared if declared in ("f1", "rouge") else TASK_METRIC[task]
        for i, (inst, ref) in enumerate(zip(r["instructions"], r["outputs"])):
            samples.append({"task": task, "document": r["input"], "instruction": inst, "reference": ref,
                            "evaluation": metric, "doc_index": d, "inst_index": i})
    if tokenizer is not None:
        add_prompts(samples, tokenizer, max_length)
    return samples[:limit] if limit is not None else samples


def prompt_ids(tokenizer, sample: dict[str, Any], chat: bool = True) -> list[int]:
    """Token ids of a sample's `prompt` (from `load_leval(..., tokenizer=...)`), as lm-eval's HFLM encodes it."""
    return encode_prompt(tokenizer, sample["prompt"], chat=chat)


def score_sample(prediction: str, sample: dict[str, Any]) -> float:
    """The sample's score in [0, 1]."""
    refs = sample["reference"] if isinstance(sample["reference"], list) else [sample["reference"]]
    if sample["evaluation"] == "exam":
        return score_leval_exam(sample["task"], prediction, refs)
    return score_leval(sample["evaluation"], prediction, refs)

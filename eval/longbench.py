"""LongBench (THUDM/LongBench): records, prompts, generation lengths and scoring.

A LongBench record has the fields `input` (the question or query; may be empty), `context` (the
long document), `answers` (list of reference strings), `length`, `dataset`, `language`,
`all_classes` (class names or null) and `_id`. The hub holds one configuration per task; offline,
point `local` at a folder of `<task>.jsonl` files in that schema (the benchmark's own data archive
unpacks to exactly that).

Prompts: `PROMPTS` below are this project's wording of each task's instruction, with the same
layout as the benchmark's (instruction, document, the instruction again, the question, an answer
cue). Retention (score / dense score) does not depend on the wording; absolute scores do, so to
compare with published numbers pass the benchmark's own `dataset2prompt.json` as `prompt_file`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .metrics import LONGBENCH_METRICS, score_longbench
from .prompts import cut_middle, encode_prompt, truncate_middle
from .sources import load_records

__all__ = [
    "HUB_ID",
    "TASKS_EN",
    "TASKS_ZH",
    "MAX_NEW_TOKENS",
    "PROMPTS",
    "NO_CHAT_TEMPLATE",
    "load_longbench",
    "load_prompts",
    "prompt_text",
    "build_prompt_ids",
    "truncate_middle",
    "score_sample",
]

HUB_ID = "THUDM/LongBench"

# The 16 English tasks of the paper's Table 2 (LongBench's English set).
TASKS_EN = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
TASKS_ZH = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")

# Generation lengths used by the benchmark for each task.
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}

# Few-shot and code tasks are continuations, not chat turns: no chat template for them.
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

_QA_PASSAGES = (
    "Use the passages below to answer the question. Reply with the answer alone, no other words.\n\n"
    "Passages:\n{context}\n\n"
    "Use the passages above to answer the question. Reply with the answer alone, no other words.\n\n"
    "Question: {input}\nAnswer:"
)
PROMPTS = {
    "narrativeqa": (
        "Below is a story (a novel or a film script) and then a question about it. Answer as briefly as "
        "possible, in one phrase if you can, without explaining.\n\nStory: {context}\n\n"
        "Answer the question about the story above as briefly as possible, in one phrase if you can, "
        "without explaining.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "Below is a scientific paper and then a question about it. Answer as briefly as possible, in one "
        "phrase or sentence. If the paper does not answer it, write \"unanswerable\"; for a yes/no question "
        "write \"yes\", \"no\" or \"unanswerable\". Do not explain.\n\nArticle: {context}\n\n"
        "Answer the question about the paper above as briefly as possible, in one phrase or sentence. If the "
        "paper does not answer it, write \"unanswerable\"; for a yes/no question write \"yes\", \"no\" or "
        "\"unanswerable\". Do not explain.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the text below, then answer a question about it briefly.\n\n{context}\n\n"
        "Answer the question using the text above. Give only the answer, no other words.\n\n"
        "Question: {input}\nAnswer:"
    ),
    "multifieldqa_zh": "阅读下面的文字，然后用中文简要回答问题。\n\n{context}\n\n请根据上文回答问题，只给出答案，不要写其他内容。\n\n问题：{input}\n回答：",
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": "请根据下面的文章回答问题。\n\n文章：{context}\n\n请根据上面的文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": (
        "Below is a report from a government agency. Summarise it in about one page.\n\nReport:\n{context}\n\n"
        "Now summarise the report above in about one page.\n\nSummary:"
    ),
    "qmsum": (
        "Below is the transcript of a meeting and then a query (a question or an instruction). Respond to the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\n"
        "Respond to the query about the transcript above in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "Below are several news articles. Summarise all of them in about one page.\n\nNews:\n{context}\n\n"
        "Now summarise all of the news above in about one page.\n\nSummary:"
    ),
    "vcsum": "下面是一份会议记录。请读完后写一段总结，概括会议内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Classify the type of the last question. Some labelled example questions come first.\n\n{context}\n{input}",
    "triviaqa": (
        "Answer the question from the passage. Give only the answer, no other words. Some worked examples "
        "come first.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarise the dialogue in a few short sentences. Some worked examples come first.\n\n{context}\n\n{input}",
    "lsht": "请判断下面这条新闻的类别。先给出一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "Below are paragraphs taken from Wikipedia; some may appear more than once. Read them carefully and "
        "count how many different paragraphs there are once duplicates are removed.\n\n{context}\n\n"
        "How many unique paragraphs are there after removing duplicates? Reply with the number only, "
        "e.g. 1, 2, 3.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Below are 30 paragraphs from Wikipedia and then an abstract of one of them. Find the paragraph the "
        "abstract summarises.\n\n{context}\n\nThe abstract:\n\n{input}\n\n"
        "Reply with the paragraph's number in the form \"Paragraph 1\", \"Paragraph 2\", and so on.\n\n"
        "The answer is: "
    ),
    "passage_retrieval_zh": (
        "下面有若干段文字，以及其中某一段的摘要。请找出摘要来自哪一段。\n\n{context}\n\n摘要如下\n\n{input}\n\n"
        "请写出该段落的编号，格式为\"段落1\"、\"段落2\"等。\n\n答案是："
    ),
    "lcc": "Complete the code below.\n{context}Next line of code:\n",
    "repobench-p": "Complete the code below.\n{context}{input}Next line of code:\n",
}
assert set(PROMPTS) == set(MAX_NEW_TOKENS) == set(LONGBENCH_METRICS)


def load_longbench(task: str, local: str | Path | None = None, limit: int | None = None) -> list[dict[str, Any]] | None:
    """Records of one LongBench task (hub `THUDM/LongBench`, or `local` JSONL); None when unavailable.

    Args:
        task (`str`): task name, e.g. "hotpotqa"; "<task>_e" selects LongBench-E.
        local (`str` or `Path`, *optional*): a `<task>.jsonl` file or a folder of them.
        limit (`int`, *optional*): keep the first `limit` records.
    """
    base = task[:-2] if task.endswith("_e") else task
    if base not in PROMPTS:
        raise KeyError(f"Unknown LongBench task {task!r}; known: {sorted(PROMPTS)}")
    records = load_records("LongBench", HUB_ID, task, local=local)
    if records is None:
        return None
    for i, r in enumerate(records):
        missing = {"context", "input", "answers"} - set(r)
        if missing:
            raise ValueError(f"LongBench {task} record {i} lacks {sorted(missing)}: not the LongBench schema.")
    return records[:limit] if limit is not None else records


def load_prompts(path: str | Path | None) -> dict[str, str]:
    """`PROMPTS`, with entries replaced by those of a `{task: template}` JSON file when given."""
    prompts = dict(PROMPTS)
    if path is not None:
        prompts.update(json.loads(Path(path).read_text(encoding="utf-8")))
    return prompts


def prompt_text(tokenizer, task: str, record: dict[str, Any], max_prompt_tokens: int | None,
                prompts: dict[str, str] | None = None) -> str:
    """One sample's prompt text (no chat template), middle-truncated to `max_prompt_tokens` tokens (None: whole).

    The text is what both routes hand on: `build_prompt_ids` here, and the lm-eval tasks in
    `lm_eval_tasks/longbench/` (which lm-eval then wraps in the chat template with `--apply_chat_template`).
    """
    base = task[:-2] if task.endswith("_e") else task
    template = (prompts or PROMPTS)[base]
    text = template.replace("{context}", record.get("context") or "").replace("{input}", record.get("input") or "")
    return text if max_prompt_tokens is None else cut_middle(tokenizer, text, max_prompt_tokens)


def build_prompt_ids(
    tokenizer, task: str, record: dict[str, Any], max_prompt_tokens: int, prompts: dict[str, str] | None = None,
    chat: bool = True,
) -> list[int]:
    """Token ids of one sample's prompt, middle-truncated to `max_prompt_tokens`.

    The chat template (when the tokenizer has one and `chat`) wraps the prompt as a user turn, except for
    the few-shot and code tasks in `NO_CHAT_TEMPLATE`. Truncation happens on the raw prompt, before the
    template, so the template's markers are never cut. Encoded as lm-eval's HFLM encodes (`prompts.encode_prompt`).
    """
    base = task[:-2] if task.endswith("_e") else task
    text = prompt_text(tokenizer, task, record, max_prompt_tokens, prompts)
    return encode_prompt(tokenizer, text, chat=chat and base not in NO_CHAT_TEMPLATE)


def score_sample(task: str, prediction: str, record: dict[str, Any]) -> float:
    """The sample's score in [0, 1] (the benchmark reports 100 x the task mean)."""
    return score_longbench(task, prediction, record["answers"], record.get("all_classes"))

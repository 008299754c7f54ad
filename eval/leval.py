"""L-Eval (L4NLP/LEval): open-ended long-document tasks scored with F1 or ROUGE.

An L-Eval record is one long document with several questions: `input` (the document),
`instructions` (list of questions or tasks), `outputs` (list of references, one per instruction),
`source` and `evaluation` ("f1", "rouge", "exam", "LLM" or "human"). `load_leval` flattens it into
one sample per instruction. The hub has one configuration per task; offline, point `local` at a
folder of `<task>.jsonl` files in that schema (the benchmark's `LEval-data/Generation/` folder).

Scoring: a record marked "f1" or "rouge" uses that metric; records marked for human or LLM judging
fall back to the task's metric in `TASK_METRIC` (F1 for question answering, ROUGE for summaries
and writing), so every sample gets an automatic score. As the benchmark recommends for n-gram
metrics, the prompt asks for about as many words as the reference has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .metrics import score_leval
from .sources import load_records

__all__ = ["HUB_ID", "TASKS", "TASK_METRIC", "DEFAULT_TASKS", "load_leval", "build_prompt_ids", "score_sample"]

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
TASKS = tuple(TASK_METRIC)
# The paper scores "9 open-ended tasks" without naming them; these are the nine whose documents
# best fit a small model's window (shortest average length in the benchmark's statistics).
DEFAULT_TASKS = (
    "financial_qa", "gov_report_summ", "multidoc_qa", "news_summ", "paper_assistant",
    "patent_summ", "scientific_qa", "tv_show_summ", "meeting_summ",
)

_SYSTEM = (
    "You are given a long document and then an instruction about it: a question to answer, a summary to "
    "write, or a passage to draft. Follow the instruction using the document."
)


def load_leval(task: str, local: str | Path | None = None, limit: int | None = None) -> list[dict[str, Any]] | None:
    """One sample per (document, instruction) of an L-Eval task; None when the data is unavailable.

    Each sample has `document`, `instruction`, `reference`, `evaluation` (the metric actually used),
    `doc_index` and `inst_index`.
    """
    if task not in TASK_METRIC:
        raise KeyError(f"Unknown or closed-ended L-Eval task {task!r}; open-ended tasks: {sorted(TASK_METRIC)}")
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
        metric = declared if declared in ("f1", "rouge") else TASK_METRIC[task]
        for i, (inst, ref) in enumerate(zip(r["instructions"], r["outputs"])):
            samples.append({
                "document": r["input"], "instruction": inst, "reference": ref, "evaluation": metric,
                "doc_index": d, "inst_index": i,
            })
    return samples[:limit] if limit is not None else samples


def build_prompt_ids(tokenizer, sample: dict[str, Any], max_prompt_tokens: int, chat: bool = True) -> list[int]:
    """Token ids of one sample's prompt; the document is cut at its end to fit `max_prompt_tokens`."""
    words = max(1, len(str(sample["reference"]).split()))
    tail = f"\n\nInstruction: {sample['instruction']}\nAnswer in about {words} words.\nAnswer:"
    head = _SYSTEM + "\n\nDocument:\n"
    fixed = len(tokenizer(head + tail, add_special_tokens=False)["input_ids"])
    room = max(0, max_prompt_tokens - fixed - 32)  # 32: room for the chat template's markers
    doc_ids = tokenizer(sample["document"], add_special_tokens=False)["input_ids"][:room]
    text = head + tokenizer.decode(doc_ids) + tail
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def score_sample(prediction: str, sample: dict[str, Any]) -> float:
    """The sample's score in [0, 1]."""
    refs = sample["reference"] if isinstance(sample["reference"], list) else [sample["reference"]]
    return score_leval(sample["evaluation"], prediction, refs)

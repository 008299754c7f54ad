"""lm-eval task configs for L-Eval and LongBench, read from a local folder given at run time (or the hub).

This folder is an lm-eval include path (`flexicache eval tasks-path` prints it):

    leval/       leval_<task> for every L-Eval task (`leval.TASKS`); groups leval_open, leval_exam, leval
    longbench/   flexicache_longbench_<task> for every LongBench task; group flexicache_longbench

The YAML files name the hooks below; everything else comes from `--metadata` (merged by lm-eval
with `--model_args`), so no path is ever written into a config:

| key | meaning |
|---|---|
| `leval_data` / `longbench_data` | a folder of `<task>.jsonl` in the benchmark's schema (directly or one folder down) or one file; absent: the hub (`L4NLP/LEval`, `THUDM/LongBench`) |
| `max_length` | prompt tokens: a longer document keeps its head and tail (L-Eval: `CHAT_RESERVE` tokens are left for a chat template); absent: no cut |
| `tokenizer` | the tokenizer that counts them (default: `pretrained` of `--model_args`) |
| `longbench_prompts` | optional JSON `{task: template}` replacing this project's LongBench prompts (e.g. the benchmark's `dataset2prompt.json`) |

Prompts, truncation and scoring are those of `flexicache eval leval|longbench` (`leval.py`,
`longbench.py`, `metrics.py`), so both routes give the model the same tokens (run lm-eval with
`--apply_chat_template` when the harness uses the chat template, as it does for instruct models).
Each hook builds the whole task at once: a document's questions see the same cut document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TASKS_PATH", "leval_dataset", "leval_results", "longbench_dataset", "longbench_results"]

TASKS_PATH = Path(__file__).resolve().parent


def _tokenizer(metadata: dict[str, Any]):
    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if name is None:
        raise ValueError("these tasks need a tokenizer to cut documents to max_length: pass pretrained= in --model_args "
                         "or \"tokenizer\" in --metadata.")
    if not isinstance(name, (str, Path)):
        return name  # a tokenizer object (programmatic use)
    from transformers import AutoTokenizer

    from fc_hf import assets

    return AutoTokenizer.from_pretrained(assets.model_path(name) if name in assets.MODELS else name)


def _max_length(metadata: dict[str, Any]) -> int | None:
    value = metadata.get("max_length")
    return None if value in (None, "", 0) else int(value)


def _dataset(rows: list[dict[str, Any]]):
    import datasets

    return {"test": datasets.Dataset.from_list(rows)}


def _no_data(benchmark: str, task: str, key: str):
    return RuntimeError(f"{benchmark} {task}: no data (see the line above); pass --metadata '{{\"{key}\": FOLDER}}' with "
                        f"a folder holding {task}.jsonl.")


def leval_dataset(leval_task: str, **metadata) -> dict:
    """`custom_dataset` of the leval_* tasks: one row per question, with its `prompt` and `reference`."""
    from .. import leval

    samples = leval.load_leval(leval_task, local=metadata.get("leval_data"))
    if samples is None:
        raise _no_data("L-Eval", leval_task, "leval_data")
    leval.add_prompts(samples, _tokenizer(metadata), _max_length(metadata))
    keys = ("task", "prompt", "instruction", "reference", "evaluation", "doc_index", "inst_index")
    return _dataset([{k: s[k] for k in keys} for s in samples])


def leval_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """`process_results` of the leval_* tasks: the sample's score in [0, 1] (`leval.score_sample`)."""
    from .. import leval

    return {"score": leval.score_sample(results[0], doc)}


def longbench_dataset(longbench_task: str, **metadata) -> dict:
    """`custom_dataset` of the flexicache_longbench_* tasks: LongBench records with their `prompt`."""
    from .. import longbench

    records = longbench.load_longbench(longbench_task, local=metadata.get("longbench_data"))
    if records is None:
        raise _no_data("LongBench", longbench_task, "longbench_data")
    tok, max_length = _tokenizer(metadata), _max_length(metadata)
    prompts = longbench.load_prompts(metadata.get("longbench_prompts"))
    return _dataset([{
        "task": longbench_task, "prompt": longbench.prompt_text(tok, longbench_task, r, max_length, prompts),
        "answers": list(r["answers"]), "all_classes": r.get("all_classes"), "_id": str(r.get("_id", i)),
    } for i, r in enumerate(records)])


def longbench_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """`process_results` of the flexicache_longbench_* tasks: the sample's score in [0, 1]."""
    from .. import longbench

    return {"score": longbench.score_sample(doc["task"], results[0], doc)}

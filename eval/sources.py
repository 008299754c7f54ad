"""Where benchmark records come from: the dataset hub, or a local JSONL file in the same schema.

This machine (and many clusters) cannot reach the hub. A benchmark that cannot load its data is
skipped with one printed line; nothing ever stands in for missing data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl", "write_jsonl", "local_file", "load_records"]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (blank lines skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number} is not valid JSON ({e.msg}).") from None
    return records


def write_jsonl(path: str | Path, records) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def local_file(local: str | Path, task: str) -> Path | None:
    """`local` is either the task's JSONL file or a folder holding `<task>.jsonl`, directly or one folder
    down (LongBench's archive unpacks to `data/`, L-Eval's to `Open-ended-tasks/` and `Closed-ended-tasks/`)."""
    local = Path(local)
    if local.is_file():
        return local
    if (local / f"{task}.jsonl").is_file():
        return local / f"{task}.jsonl"
    found = sorted(local.glob(f"*/{task}.jsonl"))
    if len(found) > 1:
        raise ValueError(f"{task}.jsonl is in several folders under {local}: {[str(p) for p in found]}; pass one of them.")
    return found[0] if found else None


def load_records(
    benchmark: str, hub_id: str, task: str, split: str = "test", local: str | Path | None = None
) -> list[dict[str, Any]] | None:
    """Load one task's records from `local` when given, else from the hub.

    Args:
        benchmark (`str`): name used in messages, e.g. "LongBench".
        hub_id (`str`): dataset id on the hub, e.g. "THUDM/LongBench".
        task (`str`): the dataset configuration (task) name.
        split (`str`, *optional*, defaults to "test"): hub split.
        local (`str` or `Path`, *optional*): a JSONL file or a folder of `<task>.jsonl` files.

    Returns:
        The records as dicts, or None (after printing one line) when they cannot be loaded.
    """
    if local is not None:
        path = local_file(local, task)
        if path is None:
            print(f"{benchmark} {task}: no {task}.jsonl under {local}; skipped.")
            return None
        return read_jsonl(path)
    try:
        import datasets

        data = datasets.load_dataset(hub_id, task, split=split)
    except Exception as e:  # noqa: BLE001 - any hub failure means "no data here", and we say so
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        print(f"{benchmark} {task}: cannot load {hub_id} from the hub ({reason}); skipped. "
              f"Pass a local JSONL folder to run offline.")
        return None
    return [dict(r) for r in data]

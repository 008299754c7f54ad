"""Results folders: one per configuration, resumable sample by sample, with progress bars.

Layout: `<out>/<bench>/<model>/<setting>/<method>[-b<budget>][-<option>=<value>...]/` holding
- `config.json`: everything that defines the run (a resumed run must match it exactly),
- `predictions.jsonl`: one line per finished sample (a resumed run skips those),
- `metrics.json`: the aggregate, rewritten after every sample (`score` is the headline number).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["RunDir", "run_name", "run_folder", "read_predictions", "progress", "finished_metrics", "config_diff",
           "write_json", "EXTENSIBLE"]

# Config keys that only add samples (a resumed run may extend them) or only describe the run.
EXTENSIBLE = frozenset({"started", "profile_note", "tasks", "distances", "offsets", "kinds", "limit"})


def _option_text(value) -> str:
    return ":".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def run_name(method: str, budget: int | None) -> str:
    return "dense" if method == "dense" else f"{method}-b{budget}"


def run_folder(method: str, budget: int | None, cache_options: dict | None = None) -> str:
    """A run's folder name: `run_name` plus the cache options that set it apart (e.g. "-page_size=8")."""
    return run_name(method, budget) + "".join(f"-{k}={_option_text(v)}" for k, v in sorted((cache_options or {}).items()))


def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a `predictions.jsonl` file ([] when it does not exist); a line cut by an interrupted write is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    # split("\n"), not splitlines(): an answer may hold U+2028 or U+0085, which JSON leaves unescaped.
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by an interrupted write: that sample is simply redone
    return rows


def _differ(old: dict[str, Any], new: dict[str, Any], key: str) -> bool:
    # A key on one side only differs, whatever the other side's value (even None): a setting recorded now and not
    # then (e.g. a new cache field) means the old run may have been made under another value of it.
    return (key in old) != (key in new) or old.get(key) != new.get(key)


def config_diff(old: dict[str, Any], new: dict[str, Any], extensible=EXTENSIBLE) -> list[str]:
    """The keys (outside `extensible`) on which two run configs differ: resuming across them would mix results.

    A key present on one side and missing on the other is a difference. Where both values are dicts (e.g.
    `cache_defaults`), the differing entries are named `key.entry`.
    """
    diff = []
    for k in sorted(set(old) | set(new)):
        if k in extensible or not _differ(old, new, k):
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            diff += [f"{k}.{e}" for e in sorted(set(a) | set(b)) if _differ(a, b, e)]
        else:
            diff.append(k)
    return diff


def write_json(path: str | Path, data: Any) -> None:
    """Write `data` as indented JSON through a temporary file, so an interrupted write never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def progress(iterable, desc: str, total: int | None = None):
    """A progress bar over `iterable` (tqdm), as every evaluation loop shows one."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True)


class RunDir:
    """One configuration's results folder.

    Args:
        path (`Path`): the folder (created if needed).
        config (`dict`): the run's defining settings; if the folder already has a different
            `config.json` (other than in `EXTENSIBLE` keys), resuming would mix incompatible results,
            so this raises.
    """

    EXTENSIBLE = EXTENSIBLE

    def __init__(self, path: str | Path, config: dict[str, Any]):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = json.loads(json.dumps(config))  # normalise tuples etc. as they will be stored
        cfg_file = self.path / "config.json"
        if cfg_file.exists():
            old = json.loads(cfg_file.read_text())
            diff = config_diff(old, self.config, self.EXTENSIBLE)
            if diff:
                raise ValueError(
                    f"{self.path} holds a run with different settings ({', '.join(diff)}); use another --out "
                    "or delete that folder."
                )
            self.config["started"] = old.get("started")
        else:
            self.config["started"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        cfg_file.write_text(json.dumps(self.config, indent=1) + "\n")

    @property
    def predictions_file(self) -> Path:
        return self.path / "predictions.jsonl"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.json"

    def predictions(self) -> list[dict[str, Any]]:
        return read_predictions(self.predictions_file)

    def done_ids(self) -> set[str]:
        return {str(r["id"]) for r in self.predictions()}

    def append(self, row: dict[str, Any]) -> None:
        with open(self.predictions_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        write_json(self.metrics_file, {**self.config, **metrics})

    def metrics(self) -> dict[str, Any] | None:
        """The run's `metrics.json` (config included), or None before its first finished sample."""
        return json.loads(self.metrics_file.read_text()) if self.metrics_file.exists() else None


def finished_metrics(runs, prefix: str = "") -> dict[str, dict[str, Any]]:
    """`{prefix + folder name: metrics}` of the runs (`RunDir`s) that have finished at least one sample."""
    found = {prefix + run.path.name: run.metrics() for run in runs}
    return {name: metrics for name, metrics in found.items() if metrics is not None}

"""Free-running quality: does a sparse cache make the model's own greedy continuation degenerate?

Teacher forcing (`fidelity.py`) compares next-token predictions on a fixed text; here each method
generates on its own, as in real use, and what is measured is the continuation itself. Over N prompts
(by default 10 King James Bible passages at spread offsets and 10 L-Eval documents, interleaved), each
exactly `length` tokens of raw text with no instruction or question, every method generates
`new_tokens` greedy tokens from one shared dense prefill (`shared_prefill.py`). Generation runs the
full length (an end-of-sequence token does not stop it; rows record where one first appeared), so all
continuations have the same length.

Per prompt and method:

- `rep4`: the repeated-4-gram rate of the continuation (`repeated_ngram_rate`, on token ids);
- `first_divergence`: the position of the first token that differs from dense's continuation (the
  number of leading tokens identical to dense's; `new_tokens` when the two are identical).

Per method, over prompts (`summarize`): mean rep4 next to dense's on the same prompts, the mean difference
method - dense with a paired bootstrap 95% interval (prompts resampled with replacement within each
source, `agreement.bootstrap_indices`; the difference is taken per prompt, so method and dense are always
drawn together), the mean and median first divergence, and the share of continuations identical to
dense's. Groups: "all", and each source apart when there are several.

Prompts: `kjv:OFFSET` is `fc_hf.assets.text_tokens` (exactly `length` tokens starting near character
OFFSET); `leval:TASK:RECORD` is that record's document (`input`) read from the L-Eval data folder at run
time, tokenized without special tokens and cut to `length` tokens keeping its head and tail
(`prompts.truncate_middle`, the rule `leval.py` cuts documents by); `leval:TASK` is the task's first record
with at least `length` tokens (its longest when none is). No chat template: the model continues the text.

Results: one JSON file (`config`, per-prompt `rows` holding every method's tokens, text and numbers,
and the `summary`), rewritten after every prompt; a rerun skips (prompt, method) pairs already in it,
and refuses a file made with other settings, the profile's unstable set included (`profile_unstable`, a hash:
the same --profile name may resolve to another set once the bundled profile is remade). The Markdown table is
printed and written beside it (.md).

    flexicache eval freerun --model smollm2-135m-instruct --methods dense,quest,flexicache --budgets 1024
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .agreement import bootstrap_indices, percentile_interval, with_interval
from .leval import TASKS as LEVAL_TASKS
from .loading import load_model
from .methods import cache_defaults, make_cache, method_runs, prepare_model
from .profile_choice import resolve_profile
from .prompts import truncate_middle
from .results import config_diff, progress, run_folder, write_json
from .shared_prefill import common_prefix_length, dense_prefill, eos_token_ids, greedy_decode
from .sources import local_file, read_jsonl

__all__ = [
    "KJV_OFFSETS", "DEFAULT_LEVAL_ROOT", "FreerunPrompt", "repeated_ngram_rate", "default_specs", "make_prompt",
    "summarize", "freerun_markdown", "run_freerun", "profile_identity",
]

# 10 passages spread over the text (about 4.2 million characters).
KJV_OFFSETS = tuple(range(0, 4_000_000, 400_000))
LEVAL_PROMPTS = 10
DEFAULT_LEVAL_ROOT = "../shared/data/leval"


def repeated_ngram_rate(tokens: Sequence[int], n: int = 4) -> float:
    """Share of a sequence's token n-grams that already occurred earlier in the same sequence.

    The n-grams are the `len(tokens) - n + 1` windows `tokens[i:i + n]`; window i counts as repeated when
    an identical window starts at some j < i (overlapping allowed). The rate is repeated windows / all
    windows: 0 when no n-gram recurs, approaching 1 when the sequence loops. Only the sequence itself
    counts (a continuation is not compared with its prompt). A sequence shorter than `n` has no n-gram
    and gets 0.0. Examples with n=4: [1, 2, 3, 4, 1, 2, 3, 4] -> 1/5 (the last window repeats the first);
    seven equal tokens -> 3/4 (every window after the first).
    """
    seen: set[tuple[int, ...]] = set()
    repeated = total = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(int(t) for t in tokens[i:i + n])
        total += 1
        if gram in seen:
            repeated += 1
        else:
            seen.add(gram)
    return repeated / total if total else 0.0


@dataclass
class FreerunPrompt:
    """One prompt: `id` (its resolved spec, e.g. "leval:financial_qa:0"), `source` ("kjv" or "leval"), token ids."""

    id: str
    source: str
    ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


def default_specs(leval_root: str | Path | None = DEFAULT_LEVAL_ROOT, kjv: int = len(KJV_OFFSETS),
                  leval: int = LEVAL_PROMPTS) -> list[str]:
    """`kjv:OFFSET` for the first `kjv` of `KJV_OFFSETS` and `leval:TASK` for the first `leval` L-Eval tasks
    (in `leval.TASKS` order) with a file under `leval_root`, interleaved (kjv, leval, kjv, ...) so that any
    `--limit` keeps both sources. Without L-Eval data, the KJV prompts only (one line says so)."""
    kjv_specs = [f"kjv:{offset}" for offset in KJV_OFFSETS[:kjv]]
    tasks = [t for t in LEVAL_TASKS if local_file(leval_root, t)] if leval_root and Path(leval_root).is_dir() else []
    if not tasks and leval:
        print(f"freerun: no L-Eval task file under {leval_root}; KJV prompts only.")
    leval_specs = [f"leval:{t}" for t in tasks[:leval]]
    mixed = [s for pair in zip(kjv_specs, leval_specs) for s in pair]
    n = min(len(kjv_specs), len(leval_specs))
    return mixed + kjv_specs[n:] + leval_specs[n:]


def make_prompt(spec: str, tokenizer, length: int, leval_root: str | Path | None = DEFAULT_LEVAL_ROOT,
                text_tokens=None) -> FreerunPrompt:
    """The prompt of one spec: `kjv:OFFSET`, `leval:TASK:RECORD` or `leval:TASK` (module docstring).

    `text_tokens` (`fn(tokenizer, n, offset) -> ids`) replaces `fc_hf.assets.text_tokens` for KJV prompts.
    """
    kind, *rest = spec.split(":")
    if kind == "kjv" and len(rest) <= 1:
        if text_tokens is None:
            from fc_hf import assets

            text_tokens = assets.text_tokens
        offset = int(rest[0]) if rest and rest[0] else 0
        return FreerunPrompt(f"kjv:{offset}", "kjv", list(text_tokens(tokenizer, length, offset)), {"offset": offset})
    if kind == "leval" and len(rest) in (1, 2):
        task = rest[0]
        path = local_file(leval_root, task) if leval_root else None
        if path is None:
            raise FileNotFoundError(f"freerun {spec}: no {task}.jsonl under {leval_root} (give --leval-data).")
        records = read_jsonl(path)
        encode = lambda r: tokenizer(str(records[r]["input"]), add_special_tokens=False)["input_ids"]  # noqa: E731
        if len(rest) == 2:
            record = int(rest[1])
            if not 0 <= record < len(records):
                raise IndexError(f"freerun {spec}: {task} has {len(records)} records.")
            doc = encode(record)
        else:
            record, doc = 0, []
            for r in range(len(records)):  # the first long enough, else the longest
                ids = encode(r)
                if len(ids) > len(doc) or len(ids) >= length:
                    record, doc = r, ids
                if len(doc) >= length:
                    break
        if not doc:
            raise ValueError(f"freerun {spec}: the document of {task} record {record} is empty.")
        return FreerunPrompt(f"leval:{task}:{record}", "leval", truncate_middle(doc, length),
                             {"task": task, "record": record, "document_tokens": len(doc)})
    raise ValueError(f"unknown freerun prompt {spec!r}: use kjv:OFFSET, leval:TASK or leval:TASK:RECORD.")


def _run_names(rows: Sequence[dict]) -> list[str]:
    """Every run in the rows, dense first, the others in order of first appearance."""
    names = dict.fromkeys(["dense"])
    for row in rows:
        names.update(dict.fromkeys(row["runs"]))
    return list(names)


def summarize(rows: Sequence[dict[str, Any]], resamples: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """One dict per (group, run) over the prompts holding both that run and dense (module docstring).

    Rows: `{"id", "source", "runs": {run name: {"rep4", "first_divergence", "identical", ...}}}`. Each dict:
    group ("all" or a source), run, n, rep4 (the run's mean), dense_rep4 (dense's mean on the same prompts),
    diff (mean of rep4 - dense rep4) with diff_low / diff_high (bootstrap 95%), first_divergence_mean,
    first_divergence_median, identical (share of prompts). Every row's resampling starts from `seed`.
    """
    sources = list(dict.fromkeys(r["source"] for r in rows))
    groups = [("all", sources)] + ([(s, [s]) for s in sources] if len(sources) > 1 else [])
    out = []
    for group, members in groups:
        for run in _run_names(rows):
            # Stratum after stratum, as bootstrap_indices lays them out.
            strata = [[r for r in rows if r["source"] == s and run in r["runs"] and "dense" in r["runs"]]
                      for s in members]
            strata = [s for s in strata if s]
            pairs = [r for s in strata for r in s]
            if not pairs:
                continue
            rate = np.array([r["runs"][run]["rep4"] for r in pairs], dtype=float)
            dense = np.array([r["runs"]["dense"]["rep4"] for r in pairs], dtype=float)
            diff = rate - dense
            low, high = percentile_interval(diff[bootstrap_indices([len(s) for s in strata], resamples, seed)].mean(axis=1))
            divergence = [r["runs"][run]["first_divergence"] for r in pairs]
            out.append({
                "group": group, "run": run, "n": len(pairs), "rep4": float(rate.mean()), "dense_rep4": float(dense.mean()),
                "diff": float(diff.mean()), "diff_low": low, "diff_high": high,
                "first_divergence_mean": float(np.mean(divergence)),
                "first_divergence_median": float(statistics.median(divergence)),
                "identical": float(np.mean([bool(r["runs"][run]["identical"]) for r in pairs])),
            })
    return out


def freerun_markdown(summary: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    """Markdown: one table per group (all prompts first)."""
    head = (f"# Free-running quality — {config['model']}, {config['length']}-token prompts, {config['new_tokens']} "
            "greedy tokens\n\n"
            "rep-4: repeated-4-gram rate of the continuation (share of its token 4-grams that already occurred "
            "earlier in it; 0 = no repetition), mean over prompts. Δ vs dense: mean of (method - dense) per prompt "
            f"[95% paired bootstrap interval, {config['resamples']} resamples of the prompts within each source, seed "
            f"{config['seed']}]. First divergence: position of the first token differing from dense's continuation "
            f"({config['new_tokens']} when identical), mean / median. Identical: share of continuations equal to dense's.\n")
    if not summary:
        return head + "\nNo prompt finished yet.\n"
    parts = [head]
    for group in dict.fromkeys(s["group"] for s in summary):
        rows = [s for s in summary if s["group"] == group]
        lines = [f"## {group} ({max(r['n'] for r in rows)} prompts)\n",
                 "| run | n | rep-4 | dense rep-4 | Δ vs dense [95% CI] | first divergence (mean / median) | identical |",
                 "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['run']} | {r['n']} | {r['rep4']:.3f} | {r['dense_rep4']:.3f} | {with_interval(r, 'diff')} | "
                         f"{r['first_divergence_mean']:.1f} / {r['first_divergence_median']:.1f} | {r['identical']:.2f} |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def profile_identity(profile) -> str:
    """A short hash of a profile's unstable (layer, KV head) set: what the run's `flexicache` actually used."""
    pairs = sorted([int(l), int(h)] for l, h in profile.unstable)
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def _compare_with_dense(row: dict[str, Any]) -> None:
    dense = row["runs"].get("dense")
    for entry in row["runs"].values():
        same = None if dense is None else common_prefix_length(entry["tokens"], dense["tokens"])
        entry["first_divergence"] = same
        entry["identical"] = None if dense is None else entry["tokens"] == dense["tokens"]


def run_freerun(
    model_name: str, methods: Sequence[str], budgets: Sequence[int], out: str | Path | None = None,
    length: int = 4096, new_tokens: int = 256, specs: Sequence[str] | None = None, limit: int | None = None,
    leval_root: str | Path | None = DEFAULT_LEVAL_ROOT, profile_arg: str | None = None, dtype: str = "float32",
    cache_options: dict | None = None, resamples: int = 2000, seed: int = 0, model_bundle=None, text_tokens=None,
) -> tuple[dict[str, Any], str]:
    """Every method's greedy continuation of every prompt, compared with dense's; returns (results, Markdown).

    Args:
        model_name: a bundled model name or a local model folder.
        methods, budgets: as `methods.method_runs` takes them; dense is always run (the reference).
        out: the results JSON (default `results/freerun/<model>-p<length>-n<new_tokens>.json`); the
            Markdown goes beside it (.md). An existing file is resumed.
        length, new_tokens: prompt tokens and generated tokens.
        specs: prompt specs (module docstring); default `default_specs(leval_root)`. `limit`: the first ones.
        cache_options: `FlexiCacheConfig` fields for every non-dense method (they name its run, as in
            `generation.py`).
        resamples, seed: the bootstrap's.
        model_bundle: (model, tokenizer, folder) instead of loading `model_name`.
        text_tokens: replaces `fc_hf.assets.text_tokens` for KJV prompts (tests).
    """
    from fc_hf.config import FlexiCacheConfig

    model, tok, _ = model_bundle or load_model(model_name, dtype)
    base = FlexiCacheConfig(**(cache_options or {}))
    profile, note = resolve_profile(model_name, model.config, "freerun", profile_arg)
    runs = method_runs(methods, budgets)
    runs = [("dense", None)] + [r for r in runs if r != ("dense", None)]
    names = {r: run_folder(r[0], r[1], None if r[0] == "dense" else cache_options) for r in runs}
    config = {
        "bench": "freerun", "model": Path(model_name).name, "dtype": dtype, "length": length, "new_tokens": new_tokens,
        "cache_options": cache_options or None, "cache_defaults": cache_defaults(base),
        "profile": profile_arg or "bundled-or-fallback", "profile_unstable": profile_identity(profile),
        "profile_note": note, "resamples": resamples, "seed": seed,
    }
    config = json.loads(json.dumps(config))  # as it will be stored (tuples become lists)
    out = Path(out or Path("results") / "freerun" / f"{config['model']}-p{length}-n{new_tokens}.json")
    rows: dict[str, dict[str, Any]] = {}
    if out.exists():
        old = json.loads(out.read_text(encoding="utf-8"))
        diff = config_diff(old["config"], config, extensible={"started", "profile_note", "resamples", "seed"})
        if diff:
            raise ValueError(f"{out} holds results made with other settings ({', '.join(diff)}); use another --out "
                             "or delete that file.")
        config["started"] = old["config"].get("started")
        rows = {r["id"]: r for r in old["rows"]}
    else:
        config["started"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> tuple[dict[str, Any], str]:
        summary = summarize(list(rows.values()), resamples, seed)
        results = {"config": config, "summary": summary, "rows": list(rows.values())}
        write_json(out, results)
        text = freerun_markdown(summary, config)
        out.with_suffix(".md").write_text(text, encoding="utf-8")
        return results, text

    specs = list(specs) if specs else default_specs(leval_root)
    specs = specs[:limit] if limit else specs
    eos_ids = eos_token_ids(model, tok)
    print(f"freerun: {len(specs)} prompts of {length} tokens, {new_tokens} new tokens, runs "
          f"{', '.join(names.values())}; profile: {note}")
    for spec in progress(specs, "freerun prompts"):
        prompt = make_prompt(spec, tok, length, leval_root, text_tokens)
        row = rows.setdefault(prompt.id, {"id": prompt.id, "source": prompt.source, "prompt_tokens": len(prompt.ids),
                                          "meta": prompt.meta, "runs": {}})
        if row["prompt_tokens"] != len(prompt.ids):
            raise ValueError(f"{out}: prompt {prompt.id} had {row['prompt_tokens']} tokens, now {len(prompt.ids)}.")
        pending = [r for r in runs if names[r] not in row["runs"]]
        if not pending:
            continue
        t0 = time.time()
        prefill = dense_prefill(model, prompt.ids)  # one dense prefill serves every method (shared_prefill.py)
        row.setdefault("prefill_seconds", round(time.time() - t0, 1))
        for method, budget in pending:
            t0 = time.time()
            cache = make_cache(method, model, budget or 1024, profile, base=base)
            tokens = greedy_decode(model, prefill, method, cache, new_tokens)
            row["runs"][names[(method, budget)]] = {
                "tokens": tokens, "text": tok.decode(tokens), "rep4": repeated_ngram_rate(tokens),
                "eos": next((i for i, t in enumerate(tokens) if t in eos_ids), None),
                "seconds": round(time.time() - t0, 1),
            }
        _compare_with_dense(row)
        save()
    prepare_model(model, "dense")
    return save()

"""Long-generation fidelity: does a sparse cache make the same next-token predictions as dense?

Why teacher forcing (SPEC §5): a small model's own greedy continuation soon repeats itself, and then
recent tokens carry everything and every method looks perfect. Here the decoder is fed *real* text,
one token per step, and at every step the method's next-token distribution is compared with dense
attention's on exactly the same prefix. Two kinds of task, both cut from the bundled King James
Bible (`fc_hf.assets.text_tokens`):

- ``continue``: a document, then its true continuation.
- ``recall``: a document, an instruction to repeat a passage that lies `distance` tokens back, then
  that passage. A method that has dropped or never re-selects the passage's pages cannot copy it:
  this is where permanent eviction collapses.

Per forced step: top-1 agreement with dense and KL(dense || method) of the next-token distributions;
also each side's accuracy on the true next token. Secondary: the free-running agreement length (how
many greedy tokens method and dense produce identically from the prompt).

`run_fidelity` runs every method over the tasks into results folders (`results.py`), one dense
prefill per task shared by all methods (`shared_prefill.py`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from fc_hf.compat import cache_kwargs
from fc_hf.config import FlexiCacheConfig

from .loading import load_model
from .methods import cache_defaults, make_cache, method_runs, prepare_model
from .profile_choice import resolve_profile
from .results import RunDir, finished_metrics, progress, run_folder
from .shared_prefill import common_prefix_length, dense_prefill, forced_decode, greedy_decode

__all__ = [
    "FidelityTask",
    "make_tasks",
    "RECALL_INSTRUCTION",
    "forced_logprobs",
    "compare_steps",
    "agreement_length",
    "summarize",
    "run_fidelity",
]

RECALL_INSTRUCTION = "\n\nRepeat, word for word, the passage above that begins with \"{cue}\":\n\n"


@dataclass
class FidelityTask:
    """One teacher-forced sequence.

    Attributes:
        name (`str`): unique id, e.g. "recall-d3584-o0".
        kind (`str`): "continue" or "recall".
        prompt_ids (`list[int]`): the prompt (prefilled densely by every method).
        target_ids (`list[int]`): n_forced + 1 tokens; step i feeds target_ids[i] and is scored on
            predicting target_ids[i + 1], so every scored prediction is a decode step.
        meta (`dict`): distance, offset and lengths.
    """

    name: str
    kind: str
    prompt_ids: list[int]
    target_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_tasks(
    tokenizer,
    kinds: Sequence[str] = ("continue", "recall"),
    prompt_tokens: int = 4096,
    forced_tokens: int = 256,
    distances: Sequence[int] = (2048, 3584),
    offsets: Sequence[int] = (0,),
    text_tokens=None,
) -> list[FidelityTask]:
    """Build the teacher-forcing tasks.

    Args:
        tokenizer: the model's tokenizer.
        kinds (`tuple[str]`, *optional*): "continue" and/or "recall".
        prompt_tokens (`int`, *optional*, defaults to 4096): prompt length in tokens (instruction included).
        forced_tokens (`int`, *optional*, defaults to 256): scored decode steps per task.
        distances (`tuple[int]`, *optional*): for recall, how far back (in tokens, from the end of
            the document) each passage starts; each must be >= forced_tokens + 1 and < the document.
        offsets (`tuple[int]`, *optional*): character offsets into the text; one task set per offset.
        text_tokens (*optional*): `fn(tokenizer, n_tokens, offset) -> list[int]` giving real text
            (defaults to `fc_hf.assets.text_tokens`, the King James Bible).

    Returns:
        `list[FidelityTask]`: for each offset, one continue task, then one recall task per distance.
    """
    if text_tokens is None:
        from fc_hf.assets import text_tokens
    n = forced_tokens + 1
    tasks = []
    for offset in offsets:
        if "continue" in kinds:
            ids = list(text_tokens(tokenizer, prompt_tokens + n, offset))
            tasks.append(FidelityTask(
                f"continue-o{offset}", "continue", ids[:prompt_tokens], ids[prompt_tokens:],
                {"offset": offset, "prompt_tokens": prompt_tokens, "forced_tokens": forced_tokens},
            ))
        if "recall" in kinds:
            doc = list(text_tokens(tokenizer, prompt_tokens, offset))
            for distance in distances:
                # Size the document so document + instruction is about prompt_tokens long.
                probe = RECALL_INSTRUCTION.format(cue=tokenizer.decode(doc[:8]))
                d_len = prompt_tokens - len(tokenizer(probe, add_special_tokens=False)["input_ids"])
                if not (n <= distance <= d_len):
                    raise ValueError(
                        f"recall distance {distance} must lie in [{n}, {d_len}] for a {prompt_tokens}-token prompt "
                        f"and {forced_tokens} forced tokens."
                    )
                document = doc[:d_len]
                start = d_len - distance
                passage = document[start:start + n]
                cue = tokenizer.decode(passage[:8]).strip()
                instruction = tokenizer(RECALL_INSTRUCTION.format(cue=cue), add_special_tokens=False)["input_ids"]
                tasks.append(FidelityTask(
                    f"recall-d{distance}-o{offset}", "recall", document + list(instruction), list(passage),
                    {"offset": offset, "distance": distance, "prompt_tokens": len(document) + len(instruction),
                     "forced_tokens": forced_tokens, "passage_start": start},
                ))
    if not tasks:
        raise ValueError(f"No fidelity tasks: kinds must include 'continue' or 'recall', got {kinds!r}.")
    return tasks


def _forward_kwargs(model, cache) -> dict[str, Any]:
    return {**cache_kwargs(model, cache), "use_cache": True}


def _fresh_dense_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def forced_logprobs(model, task: FidelityTask, cache=None) -> Iterator[torch.Tensor]:
    """Prefill the prompt, then feed the forced tokens one at a time; yield each step's log-probs.

    Args:
        model: a causal LM whose attention implementation matches `cache` (see `methods.prepare_model`).
        task (`FidelityTask`): prompt and forced tokens.
        cache (*optional*): a fresh cache; None uses a dense `DynamicCache`.

    Yields:
        `torch.Tensor` of shape `[V]` (fp32 log-probabilities): step i's prediction of target_ids[i + 1].
    """
    device = next(model.parameters()).device
    cache = _fresh_dense_cache(model) if cache is None else cache
    kwargs = _forward_kwargs(model, cache)
    prompt = torch.tensor([task.prompt_ids], device=device)
    model(input_ids=prompt, logits_to_keep=1, **kwargs)
    for token in task.target_ids[:-1]:
        out = model(input_ids=torch.tensor([[token]], device=device), **kwargs)
        yield torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def compare_steps(dense_logprobs: torch.Tensor, method_logprobs: Iterator[torch.Tensor], targets: Sequence[int]) -> dict[str, list]:
    """Per-step agreement, KL(dense || method) and accuracies.

    Args:
        dense_logprobs (`torch.Tensor` of shape `[S, V]`): dense log-probs per step.
        method_logprobs: iterable of `[V]` log-prob tensors, one per step (S of them).
        targets (`list[int]`): the S true next tokens.

    Returns:
        dict of per-step lists: "agree" (0/1), "kl" (nats), "method_correct" (0/1), "dense_correct" (0/1).
    """
    out = {"agree": [], "kl": [], "method_correct": [], "dense_correct": []}
    for i, lp in enumerate(method_logprobs):
        d = dense_logprobs[i]
        top_d, top_m = int(d.argmax()), int(lp.argmax())
        kl = float(torch.sum(d.exp() * (d - lp)).clamp_min(0.0))  # clamp: fp32 noise can dip below 0
        out["agree"].append(int(top_d == top_m))
        out["kl"].append(kl)
        out["method_correct"].append(int(top_m == targets[i]))
        out["dense_correct"].append(int(top_d == targets[i]))
    if len(out["agree"]) != len(targets):
        raise RuntimeError(f"compared {len(out['agree'])} steps but expected {len(targets)}")
    return out


# Number of leading tokens on which two generations agree.
agreement_length = common_prefix_length


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate per-task rows (each with per-step lists) into overall and per-kind means."""

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else math.nan

    def block(sel):
        steps = lambda k: [v for r in sel for v in r[k]]  # noqa: E731
        res = {
            "agreement": mean(steps("agree")),
            "kl": mean(steps("kl")),
            "method_accuracy": mean(steps("method_correct")),
            "dense_accuracy": mean(steps("dense_correct")),
            "tasks": len(sel),
            "steps": len(steps("agree")),
        }
        runs = [r["free_run_agreement"] for r in sel if r.get("free_run_agreement") is not None]
        if runs:
            res["free_run_agreement"] = mean(runs)
        return res

    summary = {"all": block(rows)}
    for kind in sorted({r["kind"] for r in rows}):
        summary[kind] = block([r for r in rows if r["kind"] == kind])
    return summary


def run_fidelity(
    model_name: str, methods: Sequence[str], budgets: Sequence[int], out: str | Path, prompt_tokens: int = 4096,
    forced_tokens: int = 256, distances: Sequence[int] = (2048, 3584), offsets: Sequence[int] = (0,),
    kinds: Sequence[str] = ("continue", "recall"), free_run_tokens: int = 64, profile_arg: str | None = None,
    dtype: str = "float32", model_bundle=None, text_tokens=None, cache_options: dict | None = None,
) -> dict[str, dict]:
    """Teacher-forced fidelity of each method against dense; returns {run name: metrics}.

    Tasks are the outer loop so that dense log-probs are computed once per task and shared by all
    methods; every (method, budget) has its own results folder. `cache_options` (e.g.
    `{"carry_pages": 0}`) set `FlexiCacheConfig` fields for every method and name the folders.
    """
    model, tok, _ = model_bundle or load_model(model_name, dtype)
    tasks = make_tasks(tok, kinds, prompt_tokens, forced_tokens, distances, offsets, text_tokens=text_tokens)
    profile, note = resolve_profile(model_name, model.config, "fidelity", profile_arg)
    print(f"fidelity: {len(tasks)} tasks; profile: {note}")
    setting = f"p{prompt_tokens}-f{forced_tokens}"
    base = FlexiCacheConfig(**(cache_options or {}))
    base_cfg = {
        "bench": "fidelity", "model": Path(model_name).name, "setting": setting, "dtype": dtype,
        "prompt_tokens": prompt_tokens, "forced_tokens": forced_tokens, "distances": list(distances),
        "offsets": list(offsets), "kinds": list(kinds), "free_run_tokens": free_run_tokens,
        "tasks": [t.name for t in tasks], "cache_defaults": cache_defaults(base),
    }
    runs = {}
    for method, budget in method_runs(methods, budgets):
        cfg = {**base_cfg, "method": method, "budget": budget, "cache_options": cache_options or None,
               "profile": (profile_arg or "bundled-or-fallback") if method == "flexicache" else None,
               "profile_note": note if method == "flexicache" else None}
        name = run_folder(method, budget, cache_options)
        runs[(method, budget)] = RunDir(Path(out) / "fidelity" / cfg["model"] / setting / name, cfg)

    dense_free: dict[str, list[int]] = {}
    for task in progress(tasks, "fidelity tasks"):
        pending = [(k, r) for k, r in runs.items() if task.name not in r.done_ids()]
        if not pending:
            continue
        prefill = dense_prefill(model, task.prompt_ids)  # one dense prefill serves every method (shared_prefill.py)
        forced = task.target_ids[:-1]
        dense = torch.stack(list(forced_decode(model, prefill, "dense", None, forced)))
        targets = task.target_ids[1:]
        if free_run_tokens:
            dense_free[task.name] = greedy_decode(model, prefill, "dense", None, free_run_tokens)
        for (method, budget), run in progress(pending, f"methods on {task.name}"):
            t0 = time.time()
            if method == "dense":
                steps = compare_steps(dense, iter(dense), targets)
                free_len = free_run_tokens if free_run_tokens else None
            else:
                fresh = lambda: make_cache(method, model, budget, profile, base=base)  # noqa: E731
                steps = compare_steps(dense, forced_decode(model, prefill, method, fresh(), forced), targets)
                free_len = None
                if free_run_tokens:
                    gen = greedy_decode(model, prefill, method, fresh(), free_run_tokens)
                    free_len = agreement_length(gen, dense_free[task.name])
            run.append({"id": task.name, "kind": task.kind, "meta": task.meta, **steps,
                        "free_run_agreement": free_len, "seconds": round(time.time() - t0, 1)})
            summary = summarize(run.predictions())
            run.write_metrics({"score": summary["all"]["agreement"], "summary": summary})
    prepare_model(model, "dense")
    return finished_metrics(runs.values())

"""`flexicache eval chunked`: chunked prefill and prefix reuse on real models, at a real budget (issue 28).

The prefill is exact with any chunking, so a FlexiCache must decode after a chunked prefill as after one prefill,
wherever `DynamicCache`'s own chunked and unchunked prefills decode alike (they differ only by the attention's
rounding over other chunk shapes, which can flip a near-tie). Per prompt (a King James passage plus a recall
question), greedy decoding of `--new` tokens:

- dense (`DynamicCache` + sdpa) prefilled whole and with `prefill_chunk_size`, FlexiCache the same two ways: equal
  tokens, and the largest per-step logit difference of each pair (FlexiCache's against dense's own);
- prefix reuse: the passage prefilled once into a FlexiCache, `copy.deepcopy` for each of two questions, against a
  fresh FlexiCache given passage + question in one prefill: equal tokens and logit difference.

    flexicache eval chunked --model smollm2-135m-instruct --lengths 4096,8192 --prompts 3 --out results/chunked
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from fc_hf.compat import cache_kwargs
from fc_hf.profile import HeadProfile

from .fidelity import RECALL_INSTRUCTION
from .loading import load_model
from .methods import make_cache, method_profile, prepare_model

__all__ = ["run_chunked", "chunked_table"]


def _generate(model, ids, cache, new: int, chunk: int | None = None):
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, prefill_chunk_size=chunk,
                         pad_token_id=0, **cache_kwargs(model, cache))
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits)[:, 0].float()


def _dense(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _compare(a, b) -> dict:
    """Equal tokens, the first step they differ, and the largest logit difference over the steps both fed alike."""
    tokens_a, logits_a = a
    tokens_b, logits_b = b
    first = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
    upto = len(tokens_a) if first is None else first + 1  # the step that differs was still fed the same tokens
    return {"equal": first is None, "first_difference": first,
            "max_logit_diff": float((logits_a[:upto] - logits_b[:upto]).abs().max())}


def _prompt(tokenizer, length: int, offset: int) -> tuple[list[int], list[list[int]]]:
    """A passage of about `length` tokens and two recall questions about it (token ids, no special tokens)."""
    from fc_hf.assets import text_tokens

    doc = list(text_tokens(tokenizer, length, offset))
    questions = []
    for back in (length // 2, length // 5):
        cue = tokenizer.decode(doc[length - back : length - back + 8]).strip()
        questions.append(tokenizer(RECALL_INSTRUCTION.format(cue=cue), add_special_tokens=False)["input_ids"])
    return doc, questions


def run_chunked(model_name: str, lengths, prompts: int, chunk: int, budget: int, new: int, out: Path,
                dtype: str = "float32", profile=None, questions: int = 2, first_prompt: int = 0) -> list[dict]:
    model, tokenizer, _ = load_model(model_name, dtype)
    prepare_model(model, "flexicache")
    prof = method_profile("flexicache", model.config, HeadProfile.load(profile or _shipped(model_name), model.config))
    rows = []
    out.mkdir(parents=True, exist_ok=True)
    for length in lengths:
        for i in range(first_prompt, first_prompt + prompts):
            doc, asked = _prompt(tokenizer, length, offset=50_000 * (i + 1))
            asked = asked[:questions]
            ids = torch.tensor([doc + asked[0]])
            t0 = time.perf_counter()
            with torch.inference_mode():
                flexi = lambda: make_cache("flexicache", model, budget, prof)  # noqa: E731
                runs = {
                    "dense/one": _generate(model, ids, _dense(model), new),
                    "dense/chunked": _generate(model, ids, _dense(model), new, chunk),
                    "flexicache/one": _generate(model, ids, flexi(), new),
                    "flexicache/chunked": _generate(model, ids, flexi(), new, chunk),
                }
                shared = flexi()
                model(input_ids=torch.tensor([doc]), **cache_kwargs(model, shared))
                prefix = []
                for q in asked:
                    both = torch.tensor([doc + q])
                    prefix.append(_compare(_generate(model, both, copy.deepcopy(shared), new),
                                           _generate(model, both, flexi(), new)))
            row = {"model": model_name, "length": len(doc) + len(asked[0]), "prompt": i, "chunk": chunk,
                   "budget": budget, "new_tokens": new,
                   "dense_chunked_vs_one": _compare(runs["dense/chunked"], runs["dense/one"]),
                   "flexicache_chunked_vs_one": _compare(runs["flexicache/chunked"], runs["flexicache/one"]),
                   "prefix_copy_vs_fresh": prefix, "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / f"chunked-{model_name}.jsonl").open("a").write(json.dumps(row) + "\n")
    return rows


def _shipped(model_name: str) -> Path:
    from fc_hf.profile import PROFILE_DIR

    return Path(PROFILE_DIR) / f"{Path(model_name).name}.json"


def chunked_table(rows: list[dict]) -> str:
    """Markdown: per model and length, how often each pair decoded alike and the logit differences."""
    lines = ["| model | prompt tokens | n | dense chunked = one | FlexiCache chunked = one (where dense agrees) | "
             "max logit diff, dense own | max logit diff, FlexiCache | copy per question = fresh prefill | "
             "max logit diff, copy vs fresh |", "|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["model"], row["length"] // 1024), []).append(row)
    for (model, _), group in sorted(groups.items()):
        dense_eq = [r for r in group if r["dense_chunked_vs_one"]["equal"]]
        flexi_eq = sum(r["flexicache_chunked_vs_one"]["equal"] for r in dense_eq)
        prefix = [p for r in group for p in r["prefix_copy_vs_fresh"]]
        lines.append(
            f"| {model} | {min(r['length'] for r in group)}-{max(r['length'] for r in group)} | {len(group)} | "
            f"{len(dense_eq)}/{len(group)} | {flexi_eq}/{len(dense_eq)} | "
            f"{max(r['dense_chunked_vs_one']['max_logit_diff'] for r in group):.2e} | "
            f"{max(r['flexicache_chunked_vs_one']['max_logit_diff'] for r in group):.2e} | "
            f"{sum(p['equal'] for p in prefix)}/{len(prefix)} | {max(p['max_logit_diff'] for p in prefix):.2e} |")
    return "\n".join(lines) + "\n"

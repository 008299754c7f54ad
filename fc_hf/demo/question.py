"""`flexicache demo`: a question about a long document, answered by the bundled SmolLM2 with dense attention and
with FlexiCache.

The document is ~7k tokens of the bundled King James Bible with one planted sentence (a needle, as RULER's
niah tasks plant one) at 40% of its depth; the question asks for it through the model's chat template. The
methods: dense (`DynamicCache` + sdpa); FlexiCache (budget 1024, shipped profile) with the document prefilled once
and the cache copied for the question (prefix reuse, `copy.deepcopy`); FlexiCache prefilled in chunks
(`prefill_chunk_size`); and FlexiCache with prompt lookup (`prompt_lookup_num_tokens`). Per method:
the answer, whether it holds the planted number, decode tokens/s, device KV at its peak and after the answer, and
at how many of dense's answer tokens it predicts dense's next token when fed dense's answer (teacher forcing).
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, StoppingCriteriaList

from ..assets.text import long_prompt
from ..cache import FlexiCache
from ..compat import cache_kwargs
from ..config import FlexiCacheConfig
from .common import (StepClock, demo_parser, divergence_line, first_difference, load_demo_model, quiet,
                     teacher_forced_agreement)

NEEDLE = "The special magic number for the silver lighthouse is {number}."
QUESTION = "What is the special magic number for the silver lighthouse mentioned in the text above?"
NUMBER = "7302948"
DEPTH = 0.4
CHUNK = 2048


def build_prompt(tokenizer, doc_tokens: int) -> tuple[torch.Tensor, int]:
    """`(ids [1, L], prefix)`: the chat-templated document with the needle and the question; `ids[:, :prefix]` stops
    before the question (the part a cache can hold once and copy for any question)."""
    doc = long_prompt(tokenizer, doc_tokens, offset=2_000_000)
    cut = doc.find("\n", int(len(doc) * DEPTH))
    cut = int(len(doc) * DEPTH) if cut < 0 else cut
    text = f"{doc[:cut]}\n{NEEDLE.format(number=NUMBER)}\n{doc[cut:]}\n\n{QUESTION}"
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    question = len(tokenizer(f"\n\n{QUESTION}", add_special_tokens=False)["input_ids"])
    return ids, ids.shape[1] - question - 8  # a few tokens of slack before the question and the turn's end


def _device_bytes(cache) -> tuple[int, int]:
    """`(peak, held now)` device KV bytes of a cache (a DynamicCache holds its peak at the end)."""
    if isinstance(cache, FlexiCache):
        report = cache.memory_report()
        return report["peak_device_kv_bytes"], report["device_kv_bytes"]
    held = sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in cache.layers)
    return held, held


def _answer(model, ids, cache, new_tokens: int, keep_logits: bool = False, **generate_kw) -> dict:
    """One greedy answer: its tokens, decode tok/s, device KV at the peak and after; dense's next-token logits with
    `keep_logits` (to say how close a near tie was where another answer parts from it)."""
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), output_logits=keep_logits,
                             return_dict_in_generate=True, **generate_kw, **cache_kwargs(model, cache))
    peak, held = _device_bytes(cache)
    return {"tokens": out.sequences[0, ids.shape[1] :], "tok_s": clock.decode_tokens_per_s(), "peak": peak,
            "held": held, "logits": torch.cat(out.logits).float() if keep_logits else None}


def main(argv: list[str] | None = None) -> int:
    p = demo_parser("flexicache demo", __doc__)
    p.add_argument("--document-tokens", type=int, default=7168, help="document length (SmolLM2 holds 8192 positions)")
    p.add_argument("--new-tokens", type=int, default=24, help="most tokens of an answer")
    p.add_argument("--chunk", type=int, default=CHUNK, help="prefill_chunk_size of the chunked row")
    args = p.parse_args(argv)
    with quiet():
        return _demo(args)


def _demo(args) -> int:
    model, tokenizer, profile, profile_note = load_demo_model(args)
    ids, prefix = build_prompt(tokenizer, args.document_tokens)
    cfg = FlexiCacheConfig(token_budget=args.budget)
    name = "FlexiCache" if profile is not None else "Quest (no profile)"

    dense = _answer(model, ids, DynamicCache(config=model.config), args.new_tokens, keep_logits=True)
    shared = FlexiCache(model.config, cfg, profile)  # the document, prefilled once
    with torch.no_grad():
        model(input_ids=ids[:, :prefix], use_cache=True, **cache_kwargs(model, shared))
    rows = [("DynamicCache + sdpa", dense, len(dense["tokens"]))]
    copied = _answer(model, ids, copy.deepcopy(shared), args.new_tokens)
    agree = teacher_forced_agreement(model, ids[:, prefix:], dense["tokens"], copy.deepcopy(shared))
    rows.append((f"{name} {args.budget}, document copied", copied, agree))
    chunked = _answer(model, ids, FlexiCache(model.config, cfg, profile), args.new_tokens, prefill_chunk_size=args.chunk)
    rows.append((f"{name} {args.budget}, chunked prefill", chunked, None))
    # Assisted decoding feeds the whole prompt in its first forward: it starts from an empty cache.
    lookup = _answer(model, ids, FlexiCache(model.config, cfg, profile), args.new_tokens, prompt_lookup_num_tokens=10)
    rows.append((f"{name} {args.budget}, prompt lookup", lookup, None))

    n = len(dense["tokens"])
    table = [("method", "answer", "correct", "decode tok/s", "device KV MB: peak / after", "dense's tokens (forced)")]
    for label, run, forced in rows:
        text = tokenizer.decode(run["tokens"], skip_special_tokens=True).strip().replace("\n", " ")
        table.append((label, repr(text[:40]), "yes" if NUMBER in text else "no", f"{run['tok_s']:.1f}",
                      f"{run['peak'] / 1e6:.1f} / {run['held'] / 1e6:.1f}",
                      "-" if forced is None else f"{forced}/{n}"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    print(f"{args.model}: a {ids.shape[1]}-token King James document with one planted sentence at {DEPTH:.0%} depth, "
          f"asked for its number ({NUMBER}); {name} with {profile_note}.\n")
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    same = [label for label, run, _ in rows[2:] if torch.equal(run["tokens"], copied["tokens"])]
    print(f"\nThe prefill is exact either way, so every {name} row decodes from the same state: "
          f"{len(same)} of {len(rows) - 2} give the copied row's answer token for token"
          + ("." if len(same) == len(rows) - 2 else " (the others differ by the prefill's rounding over other chunk "
             "shapes, which can flip a near tie)."))
    if not torch.equal(copied["tokens"], dense["tokens"]):
        first = first_difference(dense["tokens"], copied["tokens"])
        shown = [repr(tokenizer.decode(run["tokens"][first : first + 1])) for run in (dense, copied)]
        print(f"{name}'s answer is not dense's: at answer token {first} dense says {shown[0]}, {name} {shown[1]}. "
              + divergence_line(first, dense["logits"], agree, n)
              + f" A larger budget keeps more pages per head: flexicache demo --budget {2 * args.budget}.")
    print("Device KV: the K/V a cache holds on the accelerator (here CPU memory), its peak counted by the cache itself "
          "(FlexiCache: page pools plus a chunk's one-layer read-back); metadata not included.")
    return 0

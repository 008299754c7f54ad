"""`flexicache demo --continue`: dense vs FlexiCache continuing a long raw King James passage.

Prints one table - decode tokens/s, device KV bytes, and at how many of dense's generated tokens
FlexiCache, fed the same tokens (teacher forcing), predicts the same next token - and the two
continuations, and where they first differ with dense's margin there (free-running texts part for good at
the first near tie, so the margin says whether a difference is a near-tie flip); `--verbose` adds
FlexiCache's tier and re-rank statistics. Library warnings, logging and progress bars are silenced while
the demo runs (its own calls use the cache keyword the installed transformers prefers,
`compat.cache_kwargs`).
"""

from __future__ import annotations


import torch
from transformers import DynamicCache, StoppingCriteriaList

from ..assets import text_tokens
from ..cache import FlexiCache
from ..compat import cache_kwargs
from ..config import FlexiCacheConfig
from .common import StepClock, demo_parser, divergence_line, first_difference, load_demo_model, quiet, teacher_forced_agreement


def _cache_device_bytes(cache) -> int:
    if isinstance(cache, FlexiCache):
        return cache.memory_report()["device_kv_bytes"]
    return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in cache.layers)


def _run(model, ids, cache, new_tokens: int, keep_logits: bool = False):
    """Greedy `new_tokens`: `(tokens, decode tok/s, device KV bytes, raw next-token logits [new_tokens, V] or None)`.

    Logits only with `keep_logits` (dense's run: its margin where the texts part); the other run keeps none."""
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), output_logits=keep_logits,
            return_dict_in_generate=True, **cache_kwargs(model, cache),
        )
    logits = torch.cat(out.logits).float() if keep_logits else None
    return out.sequences[0, ids.shape[1] :], clock.decode_tokens_per_s(), _cache_device_bytes(cache), logits


def main(argv: list[str] | None = None) -> int:
    p = demo_parser("flexicache demo --continue", __doc__)
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--verbose", action="store_true", help="also print FlexiCache's tier and re-rank statistics")
    args = p.parse_args(argv)
    with quiet():
        return _demo(args)


def _demo(args) -> int:
    model, tokenizer, profile, profile_note = load_demo_model(args)
    ids = torch.tensor([text_tokens(tokenizer, args.prompt_tokens, offset=1_000_000)])

    dense_cache = DynamicCache(config=model.config)
    dense_out, dense_tps, dense_bytes, dense_logits = _run(model, ids, dense_cache, args.new_tokens, keep_logits=True)
    cache = FlexiCache(model.config, FlexiCacheConfig(token_budget=args.budget), profile)
    fc_out, fc_tps, fc_bytes, _ = _run(model, ids, cache, args.new_tokens)
    first_diff = first_difference(dense_out, fc_out)
    report, stats = cache.memory_report(), cache.stats()
    forced = FlexiCache(model.config, FlexiCacheConfig(token_budget=args.budget), profile)
    agree = teacher_forced_agreement(model, ids, dense_out, forced)

    n = len(dense_out)
    rows = [
        ("method", "decode tok/s", "device KV MB", "next token = dense's (teacher-forced)"),
        ("DynamicCache + sdpa", f"{dense_tps:.1f}", f"{dense_bytes / 1e6:.1f}", f"{n}/{n}"),
        (f"{'FlexiCache' if profile is not None else 'Quest (no profile)'} (budget {args.budget})", f"{fc_tps:.1f}", f"{fc_bytes / 1e6:.1f}", f"{agree}/{n}"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print(f"{args.model}: {ids.shape[1]}-token King James prompt, {n} greedy tokens; FlexiCache with {profile_note}.\n")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if args.verbose:
        print(f"\nFlexiCache: free-running output first differs from dense at token {first_diff}; "
              f"host KV {report['host_kv_bytes'] / 1e6:.1f} MB, MinMax+tables {report['metadata_bytes'] / 1e6:.1f} MB; "
              f"{stats['reranks_stable']} stable / {stats['reranks_unstable']} unstable re-ranks, "
              f"{stats['pages_promoted']} pages promoted.")
    print("\nDense continuation:     ", repr(tokenizer.decode(dense_out[:40])))
    print("FlexiCache continuation:", repr(tokenizer.decode(fc_out[:40])))
    print(divergence_line(first_diff, dense_logits, agree, n))
    return 0

"""`flexicache demo`: dense vs FlexiCache on the bundled SmolLM2 over a long King James prompt.

Prints decode tokens/s, device KV bytes, and at how many of dense's generated tokens FlexiCache,
fed the same tokens (teacher forcing), predicts the same next token.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from .assets import load_model, text_tokens
from .attention import register
from .cache import FlexiCache
from .config import FlexiCacheConfig
from .profile import PROFILE_DIR, HeadProfile

DEFAULT_MODEL = "smollm2-135m-instruct"


class _StepClock(StoppingCriteria):
    """Records when each new token is ready (the first one right after the prefill) and shows progress."""

    def __init__(self, total: int, label: str):
        self.times: list[float] = []
        self.bar = tqdm(total=total, desc=label, unit="tok", leave=False)

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def decode_tokens_per_s(self) -> float:
        if len(self.times) < 2:
            return float("nan")
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def _cache_device_bytes(cache) -> int:
    if isinstance(cache, FlexiCache):
        return cache.memory_report()["device_kv_bytes"]
    return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in cache.layers)


def _run(model, ids, cache, new_tokens: int, label: str):
    clock = _StepClock(new_tokens, label)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]),
        )
    clock.bar.close()
    return out[0, ids.shape[1] :], clock.decode_tokens_per_s(), _cache_device_bytes(cache)


def _teacher_forced_agreement(model, ids, target, cache) -> int:
    """Feed dense's own continuation token by token; count steps where FlexiCache predicts the same next token.

    Free-running outputs diverge for good at the first near-tie, so this is the fair per-token measure.
    """
    preds = []
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for t in tqdm(range(len(target)), desc="teacher-forced", unit="tok", leave=False):
            preds.append(int(out.logits[0, -1].argmax()))
            if t + 1 < len(target):
                out = model(input_ids=target[None, t : t + 1], past_key_values=cache, use_cache=True)
    return sum(int(p == int(y)) for p, y in zip(preds, target))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flexicache demo", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name or local folder")
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--profile", default=None, help="head profile JSON (default: the bundled one for the model)")
    args = p.parse_args(argv)

    register()
    print(f"Loading {args.model} ...", flush=True)
    model, tokenizer = load_model(args.model, attn_implementation="flexicache")
    profile_path = args.profile or PROFILE_DIR / f"{args.model}.json"
    try:
        profile = HeadProfile.load(profile_path, model.config)
        profile_note = f"profile {profile_path} ({len(profile.unstable)} unstable KV heads)"
    except Exception as e:  # noqa: BLE001 - the demo still runs, as Quest, and says why
        profile = None
        profile_note = f"no usable profile ({e}); every head unstable (Quest)"
    ids = torch.tensor([text_tokens(tokenizer, args.prompt_tokens, offset=1_000_000)])
    print(f"Prompt: {ids.shape[1]} tokens of the King James Bible; generating {args.new_tokens} tokens twice.", flush=True)

    dense_out, dense_tps, dense_bytes = _run(model, ids, DynamicCache(config=model.config), args.new_tokens, "dense")
    cache = FlexiCache(model.config, FlexiCacheConfig(token_budget=args.budget), profile)
    fc_out, fc_tps, fc_bytes = _run(model, ids, cache, args.new_tokens, "flexicache")
    first_diff = next((i for i, (a, b) in enumerate(zip(dense_out.tolist(), fc_out.tolist())) if a != b), len(fc_out))
    report, stats = cache.memory_report(), cache.stats()
    forced = FlexiCache(model.config, FlexiCacheConfig(token_budget=args.budget), profile)
    agree = _teacher_forced_agreement(model, ids, dense_out, forced)

    n = len(dense_out)
    rows = [
        ("method", "decode tok/s", "device KV MB", "next token = dense's (teacher-forced)"),
        ("DynamicCache + sdpa", f"{dense_tps:.1f}", f"{dense_bytes / 1e6:.1f}", f"{n}/{n}"),
        (f"FlexiCache (budget {args.budget})", f"{fc_tps:.1f}", f"{fc_bytes / 1e6:.1f}", f"{agree}/{n}"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"\nFlexiCache: {profile_note}; free-running output first differs from dense at token {first_diff}; "
          f"host KV {report['host_kv_bytes'] / 1e6:.1f} MB, MinMax+tables {report['metadata_bytes'] / 1e6:.1f} MB; "
          f"{stats['reranks_stable']} stable / {stats['reranks_unstable']} unstable re-ranks, "
          f"{stats['pages_promoted']} pages promoted.")
    print("\nDense continuation:     ", repr(tokenizer.decode(dense_out[:40])))
    print("FlexiCache continuation:", repr(tokenizer.decode(fc_out[:40])))
    return 0

"""Speculative decoding on a FlexiCache: what transformers' assisted loop asks of a cache, and how FlexiCache answers.

transformers' `GenerationMixin._assisted_decoding` (`generate(..., prompt_lookup_num_tokens=k)`, `assistant_model=`)
drives the target model's cache so (5.24, batch 1 only):
1. `cache.activate_past_recording()`, on the empty cache;
2. one forward of the prompt followed by the first candidate tokens;
3. `cache.crop(-rejected)` after each forward (`crop(0)` when every candidate was accepted);
4. forwards of `1 + candidates` tokens on the filled cache: the last accepted token, then the new candidates.

Plain FlexiCache decoding attends densely at the prefill and sparsely at each decode step. So that the verified tokens
are exactly plain decoding's, while recording every token after the prompt is a decode step, even inside a forward of
several (`FlexiCacheLayer.prompt_tokens`): the layer appends them one at a time and attends each query as its own
step would (`FlexiCacheLayer.attend`; runs of them without a stable re-rank in one set of ops per head group, where
that is exact, `FlexiCacheLayer._block_plan`). Before each such token every layer keeps a mark (`FlexiCacheLayer._mark`:
lengths, step counters, each group's selection and schedule, each store's tensors by reference, copied only when a
tier move would rewrite them in place, `PagedKV.unshare`; in a batched run the marks are taken before each append and
then given each group's selection, schedule and counters as its single steps would have left them, since a batched
run's steps change no store); `crop(-n)` restores the mark at `length - n` and every
crop drops the marks, so the cache is then the one that never saw the rejected tokens, and nothing accumulates.
Marks rather than an undo of each operation: restoring one is a handful of assignments, and what they restore is
plain to check against a cache that never saw the rolled-back tokens (tests/test_speculative.py,
tests/test_batched_verify.py).

Where the prompt ends. The first forward does not say where the prompt stops and the candidates start: no argument
generate passes reaches the cache, and it starts empty. `activate_past_recording` reads it from the assisted loop
that calls it (its `input_ids`, the prompt, `assisted_loop_prompt`). Called any other way, the first forward on an
empty cache is taken whole as the prompt and every later token as a decode step.

When recording ends. transformers leaves it on after the loop; it marks a cache given to `generate` at the start of
every call (`_is_user_defined`), and FlexiCache ends recording there (`FlexiCache.deactivate_past_recording`, also
callable by hand), so a later turn of a conversation attends densely again, as without speculative decoding.
"""

from __future__ import annotations

import torch

from .errors import FlexiCacheError

LOOP = "_assisted_decoding"  # GenerationMixin's speculative loop (transformers 4.x and 5.x)


def assisted_loop_prompt(frame, depth: int = 4) -> torch.Tensor | None:
    """The prompt ids `[B, L]` of transformers' assisted-decoding loop when `frame` (or one of the `depth` frames
    calling it) is that loop, else None (recording activated another way)."""
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == LOOP:
            ids = frame.f_locals.get("input_ids")
            return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] else None
        frame = frame.f_back
    return None


def check_loop_start(prompt: torch.Tensor, held: int) -> None:
    """Refuse what FlexiCache cannot verify exactly, before anything is written: several sequences (transformers refuses
    them too, a moment later) and a filled cache (the loop feeds the whole prompt again in its first forward)."""
    if prompt.shape[0] > 1:
        raise FlexiCacheError(
            "Assisted decoding and prompt lookup verify one sequence at a time (transformers' assisted loop is batch 1 "
            f"only); this batch has {prompt.shape[0]}. Generate the sequences one by one, each with its own "
            "FlexiCache, or decode the batch without assistant_model / prompt_lookup_num_tokens."
        )
    if held:
        raise FlexiCacheError(
            f"Assisted decoding feeds the whole prompt in its first forward, so it starts from an empty cache; this "
            f"FlexiCache holds {held} tokens. Use a new FlexiCache (a copy of a prefilled one cannot be continued this "
            "way), or continue this one without assistant_model / prompt_lookup_num_tokens. Nothing was written."
        )


def check_auto_profile(auto) -> None:
    """profile="auto" classifies its heads from its warm-up's decode steps, one per forward: refuse until it has."""
    if auto is not None and not auto.done:
        raise FlexiCacheError(
            'A FlexiCache with profile="auto" classifies its heads from the decode steps of its warm-up, which '
            "speculative decoding would verify several per forward and partly take back. Build the cache with a "
            "profile instead: a bundled one, or the one an earlier profile=\"auto\" run found "
            "(FlexiCache(config, cache_config, profile=earlier_cache.profile_found()))."
        )

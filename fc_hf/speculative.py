"""What FlexiCache reads of transformers' `generate`, and what speculative decoding asks of the cache.

**Where generate stands.** No public hook passes either of these to a cache or an attention function (5.17-5.x), so
both are read from the call stack; `tests/test_generate_frames.py` fails on every supported version the day they move.
- `in_prefill()`: a forward inside `GenerationMixin._prefill` (by the function's name): its tokens are a prompt, so a
  one-token prefill chunk or turn attends densely, as one prefill would; one token elsewhere is a decode step.
- `assisted_loop_prompt()`: the prompt of transformers' assisted loop (`_assisted_decoding`'s local `input_ids`),
  whose first forward is the prompt followed by the first drafts. When recording starts on an empty cache and the
  loop is not found, `FlexiCache.activate_past_recording` raises rather than attend the drafts densely.

**Speculative decoding** (`generate(..., prompt_lookup_num_tokens=k)` or `assistant_model=`, batch 1): the loop calls
`activate_past_recording()` on the empty cache, runs the prompt plus the first drafts, then forwards of `1 + drafts`
tokens, each followed by `crop(-rejected)`. While recording, every token after the prompt is a decode step, each query
attending as its own step would (`VerifiedDecoding`, fc_hf/verify.py), with a mark before each token that `crop`
restores; the cache is then the one that never saw the rejected tokens. `generate` ends recording at the start of each
call given the cache (`FlexiCache._is_user_defined`), so a later turn attends densely again.
"""

from __future__ import annotations

import sys

import torch

from .errors import FlexiCacheError

PREFILL = "_prefill"  # GenerationMixin's prompt stage (transformers 5.17 - 5.x)
LOOP = "_assisted_decoding"  # GenerationMixin's speculative loop
_GENERATION = ("transformers", "generation")  # the path of the module that defines both


def _generation_frame(name: str, depth: int):
    """The first of the `depth` frames above the caller of `in_prefill` / `assisted_loop_prompt` that is `name` in
    transformers' generation package, else None. The name is compared first: `in_prefill` walks the stack at every
    decode step, where no frame matches and no file name is read."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == name and tuple(code.co_filename.replace("\\", "/").split("/")[-3:-1]) == _GENERATION:
            return frame
        frame = frame.f_back
    return None


def in_prefill(depth: int = 48) -> bool:
    """Whether the caller runs inside `generate`'s prompt stage (`GenerationMixin._prefill`)."""
    return _generation_frame(PREFILL, depth) is not None


def generate_max_length(depth: int = 48, loop: bool = True) -> int | None:
    """`generation_config.max_length` of the `generate` call the caller runs in (its prompt stage, or with `loop` the
    assisted loop's forwards), else None: the tokens per sequence that call will hold, what `StaticCache` is sized to."""
    prefill = _generation_frame(PREFILL, depth)
    frame = prefill or (_generation_frame(LOOP, depth) if loop else None)
    config = None if frame is None else frame.f_locals.get("generation_config")
    length = getattr(config, "max_length", None)
    if not isinstance(length, int) or length <= 0:
        return None
    # Prompt lookup's last verification may run past max_length by its drafts (transformers crops them after).
    return length + (0 if prefill else int(getattr(config, "prompt_lookup_num_tokens", None) or 0))


def assisted_loop_prompt(depth: int = 6) -> torch.Tensor | None:
    """The prompt ids `[B, L]` of transformers' assisted loop when the caller runs in it, else None."""
    return assisted_loop(depth)[0]


def assisted_loop(depth: int = 6) -> tuple[torch.Tensor | None, str | None]:
    """`(prompt ids [B, L], drafting mode)` of transformers' assisted loop when the caller runs in it, else `(None,
    None)`. The mode is "mtp" or "dflash" for the drafters transformers 5.25 added (its generation config's `use_mtp`,
    `speculation_type`), else "draft" (prompt lookup, an assistant model)."""
    frame = _generation_frame(LOOP, depth)
    if frame is None:
        return None, None
    ids = frame.f_locals.get("input_ids")
    config = frame.f_locals.get("generation_config")
    mode = "draft"
    if getattr(config, "use_mtp", None):
        mode = "mtp"
    elif getattr(config, "speculation_type", None) == "dflash":
        mode = "dflash"
    return (ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] else None), mode


def check_loop_start(prompt: torch.Tensor | None, held: int, mode: str | None = "draft") -> None:
    """Refuse what FlexiCache cannot verify exactly, before anything is written: a drafting mode it was not checked
    with (MTP, DFlash), an unknown prompt end, several sequences (transformers refuses them too, a moment later) and a
    filled cache (the loop feeds the whole prompt again in its first forward)."""
    if mode in ("mtp", "dflash"):
        name = {"mtp": "multi-token prediction (use_mtp=True)", "dflash": 'DFlash drafting (speculation_type="dflash")'}
        raise FlexiCacheError(
            f"FlexiCache does not support {name[mode]} yet: its verification is checked against prompt lookup and "
            "assistant-model drafts only (fc_hf/speculative.py). Use prompt_lookup_num_tokens=... or assistant_model=... "
            "with a FlexiCache, or run this drafter with transformers' own cache (pass no cache). Nothing was written."
        )
    if prompt is None:
        raise FlexiCacheError(
            "Past recording started on an empty FlexiCache outside transformers' assisted-decoding loop, or in a version "
            "whose loop FlexiCache cannot read (fc_hf/speculative.py): where the prompt ends and the draft tokens begin "
            "is unknown, and the drafts would attend densely instead of as decode steps. Prefill the prompt first, or "
            "use a transformers version the tests cover (5.17-5.25). Nothing was written."
        )
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

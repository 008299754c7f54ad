"""Several decode steps in one forward, and taking them back: what a layer does for speculative decoding.

`VerifiedDecoding` is the part of `FlexiCacheLayer` (fc_hf/layer.py) that serves transformers' assisted loop
(`fc_hf/speculative.py` says how it drives the cache): while recording, a mark before each decode token (`LayerMark`),
the block of decode tokens a verification forward brings attended exactly as plain decoding would (each token
appended, ranked and attended as at its own step: `fc_hf/block.py` does the whole block in one set of launches; the
loop of single steps, `batched_verify = False`, is the reference the tests compare it with), and `crop(-n)` restoring
the state before the rejected tokens.

What a decode token changes and a mark keeps: the count of tokens, the carried candidates, the stable rows' window
pages (the tokens a window holds are the full tier's: a crop reads back the windows whose pages it restores), the
promotion counter and whether the next step ranks every stable row. Tokens past the kept length stay in the tensors,
masked, until overwritten; the MinMax entry of the page being filled is recomputed at every append.
"""

from __future__ import annotations

import torch

from . import decode
from .block import LayerMark, attend_block
from .errors import FlexiCacheError
from .grad_modes import storage_mode
from .tiers import refill_windows


class VerifiedDecoding:
    """Marks, crops and blocks of decode tokens for `FlexiCacheLayer` (see the module docstring)."""

    def _init_verification(self) -> None:
        # While recording, a mark before each decode token, dropped at each crop; the decode tokens of a forward with
        # several (K, V, and the prompt's K/V before them, or None) until its attention takes them.
        self.record_past = False
        self._marks: list[LayerMark] = []
        self._block: tuple | None = None
        self.batched_verify = True

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Mark every decode token from now on (`crop`). `recurrent_states_to_keep` (transformers >= 5.25) counts
        recurrent-state steps, which an attention layer does not have: it is accepted and not used."""
        self.record_past = True

    def _mark(self) -> LayerMark:
        store = self.store
        return LayerMark(self.length, self.rank_all, self.selector.mark(), self.promoted.clone(),
                         store.win_pages.clone(), store.win_shift.clone())

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last `-tokens_to_remove` tokens (the rejected candidates of a verification), exactly: the
        layer is then as if it had never seen them. 0 commits. Either way the marks taken since the last crop go."""
        target = self.crop_mark(tokens_to_remove)
        if target is not None:
            with storage_mode():
                self._restore(target)
        self.commit()

    def _restore(self, mark: LayerMark) -> None:
        store = self.store
        local = store.put_back_windows(mark.win_pages, mark.win_shift)
        if local.numel():
            refill_windows(store, local)
        self.selector.restore(mark.carried)
        self.promoted.copy_(mark.promoted)
        self.rank_all = mark.rank_all
        store.hold(mark.length)

    def crop_mark(self, tokens_to_remove: int) -> LayerMark | None:
        """The mark `crop(tokens_to_remove)` restores (None for 0); raises, changing nothing, when there is none."""
        if tokens_to_remove > 0:
            raise FlexiCacheError(
                f"crop({tokens_to_remove}): FlexiCache takes the number of tokens to remove as a negative number "
                "(crop(-n)), as transformers' caches do; crop(0) keeps every token."
            )
        if tokens_to_remove == 0:
            return None
        held = self.length
        target = held + tokens_to_remove
        for mark in self._marks:
            if mark.length == target:
                return mark
        raise FlexiCacheError(
            f"crop({tokens_to_remove}) on a FlexiCache holding {held} tokens: it can take back only decode "
            f"tokens fed since its last crop while recording past states ({len(self._marks)} now). Call "
            "cache.activate_past_recording() before those tokens (transformers' assisted decoding and prompt lookup "
            "do). Nothing was changed."
        )

    def commit(self) -> None:
        """Drop the marks: the tokens fed so far stay."""
        self._marks.clear()

    def block_tokens(self) -> int:
        """Decode tokens of this forward's block (a verification forward), 0 without one."""
        return 0 if self._block is None else self._block[0].shape[2]

    def take_prompt_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K/V the prompt's queries attend over when this forward began with a prompt before its decode steps (the
        first forward of speculative decoding; the attention function attends them densely), else None."""
        return None if self._block is None else self._block[2]

    def _attend_verified(self, query: torch.Tensor, block, attention_mask, scaling: float, softcap) -> torch.Tensor:
        """The block's decode steps: every query appends, ranks and attends as it would at its own step of plain
        decoding, including a stable row's re-rank among them, which the queries after it see. `query [B, Hq, T, D]`
        -> `[B, T, Hq, D]`."""
        keys, values, _ = block
        b, hq, t, _ = query.shape
        if keys.shape[2] != t:
            raise FlexiCacheError(
                f"FlexiCache layer {self.layer_idx} was given {keys.shape[2]} decode tokens but {t} queries."
            )
        if self.batched_verify:
            out, marks = attend_block(self, query, keys, values, attention_mask, scaling, softcap)
            if self.record_past:
                self._marks.extend(marks)
            return out
        out = query.new_empty(b, t, hq, self.value_dim)
        rows = attention_mask.shape[2] if isinstance(attention_mask, torch.Tensor) else 0
        for j in range(t):
            self._decode_token(keys[:, :, j : j + 1], values[:, :, j : j + 1], own_context=True)
            mask = None if not rows else attention_mask[:, :, rows - t + j : rows - t + j + 1]
            out[:, j : j + 1] = decode.attend(self, query[:, :, j : j + 1], self.context, mask, scaling, softcap)
        return out

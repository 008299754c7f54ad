"""Several decode steps in one forward, and taking them back: what a layer does for speculative decoding.

`VerifiedDecoding` is the part of `FlexiCacheLayer` (fc_hf/layer.py) that serves transformers' assisted loop
(`fc_hf/speculative.py` says how it drives the cache): while recording, a mark before each decode token (`LayerMark`),
the block of decode tokens a verification forward brings attended step by step as plain decoding would (stable groups
between their rankings reading the block's pages once), and `crop(-n)` restoring the mark at `length - n`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from . import kernels
from .errors import FlexiCacheError
from .grad_modes import storage_mode
from .head_group import STABLE, GroupMark


@dataclass
class LayerMark:
    """A layer as it stood before a decode token: its length, its step counter and each group's mark."""

    length: int
    steps: int
    groups: list[GroupMark]


class VerifiedDecoding:
    """Marks, crops and blocks of decode tokens for `FlexiCacheLayer` (see the module docstring)."""

    def _init_verification(self) -> None:
        # While recording, a mark before each decode token, dropped at each crop; the decode tokens of a forward with
        # several (K, V, and the prompt's K/V before them, or None) until its attention takes them.
        self.record_past = False
        self._marks: list[LayerMark] = []
        self._block: tuple | None = None
        # A block of decode tokens batches its stable groups' reads where that is exact (`_block_plan`);
        # FLEXICACHE_BATCHED_VERIFY=0 (or this attribute False) runs every block one step at a time.
        self.batched_verify = os.environ.get("FLEXICACHE_BATCHED_VERIFY", "1") != "0"

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Mark every decode token from now on (`crop`). `recurrent_states_to_keep` (transformers >= 5.25) counts
        recurrent-state steps, which an attention layer does not have: it is accepted and not used."""
        self.record_past = True

    def _mark(self) -> LayerMark:
        return LayerMark(self.length, self.steps, [group.mark() for group in self.groups])

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last `-tokens_to_remove` tokens (the rejected candidates of a verification), exactly: the
        layer is then as if it had never seen them. 0 commits. Either way the marks taken since the last crop go."""
        mark = self.crop_mark(tokens_to_remove)
        if mark is not None:
            with storage_mode():
                for group, group_mark in zip(self.groups, mark.groups):
                    group.restore(group_mark)
            self.length, self.steps = mark.length, mark.steps
        self.commit()

    def crop_mark(self, tokens_to_remove: int) -> LayerMark | None:
        """The mark `crop(tokens_to_remove)` restores (None for 0); raises, changing nothing, when there is none."""
        if tokens_to_remove > 0:
            raise FlexiCacheError(
                f"crop({tokens_to_remove}): FlexiCache takes the number of tokens to remove as a negative number "
                "(crop(-n)), as transformers' caches do; crop(0) keeps every token."
            )
        if tokens_to_remove == 0:
            return None
        target = self.length + tokens_to_remove
        for mark in self._marks:
            if mark.length == target:
                return mark
        raise FlexiCacheError(
            f"crop({tokens_to_remove}) on a FlexiCache holding {self.length} tokens: it can take back only decode "
            f"tokens fed since its last crop while recording past states ({len(self._marks)} now). Call "
            "cache.activate_past_recording() before those tokens (transformers' assisted decoding and prompt lookup "
            "do). Nothing was changed."
        )

    def commit(self) -> None:
        """Drop the marks: the tokens fed so far stay."""
        self._marks.clear()
        for store in self.stores():
            store.drop_marks()

    def take_prompt_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K/V the prompt's queries attend over when this forward began with a prompt before its decode steps (the
        first forward of speculative decoding; the attention function attends them densely), else None."""
        return None if self._block is None else self._block[2]

    def _attend_verified(self, query: torch.Tensor, block, attention_mask, scaling: float, softcap) -> torch.Tensor:
        """The block's decode steps: every query ranks, selects and attends as it would at its own step of plain
        decoding, including a stable head's re-rank among them, which the queries after it see. `query [B, Hq, T, D]`
        -> `[B, T, Hq, D]`."""
        keys, values, _ = block
        b, hq, t, _ = query.shape
        if keys.shape[2] != t:
            raise FlexiCacheError(
                f"FlexiCache layer {self.layer_idx} was given {keys.shape[2]} decode tokens but {t} queries."
            )
        out = query.new_empty(b, t, hq, self.value_dim)
        for start, end, batched in self._block_plan(query, attention_mask, t, softcap):
            if batched:
                out[:, start:end] = self._attend_block(query[:, :, start:end], keys[:, :, start:end],
                                                       values[:, :, start:end], scaling)
                continue
            for j in range(start, end):
                self._decode_token(keys[:, :, j : j + 1], values[:, :, j : j + 1])
                out[:, j : j + 1] = self._attend_step(query[:, :, j : j + 1], attention_mask, scaling, softcap)
        return out

    def _block_plan(self, query: torch.Tensor, attention_mask, t: int, softcap) -> list[tuple[int, int, bool]]:
        """How a block of `t` decode tokens runs: `(start, end, batched)` spans in order. Batched spans
        (`_attend_block`) are runs of >= 2 steps with no stable re-rank among them, where that is exact and something
        is shared (PyTorch backend, one sequence without padding, no softcap, no profile="auto", stable groups that can
        read a block); the rest runs one step at a time, as plain decoding."""
        single = [(0, t, False)]
        stable = [g for g in self.groups if g.kind == STABLE]
        if (not self.batched_verify or t < 2 or query.shape[0] != 1 or softcap is not None or self.owner.auto is not None
                or not self.record_past or not stable or kernels.backend_for(query, self.cfg.backend) != "torch"
                or not all(g.can_attend_block() for g in stable)):
            return single
        if self.owner.padding_info(attention_mask, self.length + t, self.cfg.page_size)[0] is not None:
            return single
        free = []  # per step: no stable ranking at it (rank_next: the first step only)
        for j in range(t):
            step = self.steps + j + 1
            free.append(not any((g.rank_next and j == 0) or g.is_scheduled(step) for g in stable))
        plan, start = [], 0
        while start < t:
            end = start + 1
            while end < t and free[end] and free[start]:
                end += 1
            batched = free[start] and end - start >= 2
            if plan and not batched and not plan[-1][2]:
                plan[-1] = (plan[-1][0], end, False)
            else:
                plan.append((start, end, batched))
            start = end
        return plan

    def _attend_block(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
        """The attention of `t` decode steps (`_block_plan`): `query [1, Hq, t, D]`, their K/V `[1, H, t, D]` ->
        `[1, t, Hq, Dv]`. Token j is appended, then the groups that rank at every step attend query j exactly as a
        step does (`HeadGroup.attend`); once all are in, each stable group reads its pages once for the t queries
        (`HeadGroup.attend_block`). The marks taken before these tokens get the stable groups' read counters as the
        single steps would have left them, so `crop` restores exactly."""
        _, hq, t, d = query.shape
        g = hq // self.num_kv_heads
        first = len(self._marks)
        lengths = torch.arange(self.length + 1, self.length + t + 1, device=query.device)
        check = self.owner.residency_check_for(self.device)
        perm, spans, inverse = self._head_order()
        q = query[0].view(self.num_kv_heads, g, t, d).transpose(1, 2)  # [H, t, G, D]
        q = (q if perm is None else q.index_select(0, perm)).contiguous()
        ordered = query.new_empty(self.num_kv_heads, t, g, self.value_dim)
        for j in range(t):
            self._decode_token(keys[:, :, j : j + 1], values[:, :, j : j + 1])
            for grp, (lo, hi) in zip(self.groups, spans):
                if grp.kind != STABLE:
                    ordered[lo:hi, j] = grp.attend(q[lo:hi, j], self.steps, None, None, scaling, None, check)
        for at, (grp, (lo, hi)) in enumerate(zip(self.groups, spans)):
            if grp.kind != STABLE:
                continue
            pages, rows = grp.counts["read_pages"], grp.counts["read_rows"]
            reads = grp.attend_block(q[lo:hi], lengths, scaling, check, ordered[lo:hi])
            for i in range(t - 1):  # the mark before token i + 1: the counters once step i has run
                mark = self._marks[first + i + 1].groups[at]
                counts = {**mark.counts, "read_pages": pages + sum(reads[: i + 1]), "read_rows": rows + (i + 1) * (hi - lo)}
                self._marks[first + i + 1].groups[at] = replace(mark, counts=counts)
        out = ordered if inverse is None else ordered.index_select(0, inverse)
        return out.transpose(0, 1).reshape(1, t, hq, self.value_dim)

"""Which rows of a layer rank when: the kinds of a layer's KV heads and the row indices of each kind.

A row is one (sequence, KV head) pair, numbered `b * H + h` (the model's `[B, H, ...]` order, kept by every per-row
tensor of the store). A head is
- "unstable" (`E`): ranked at every decode step, every page on the device;
- "streaming" (`X`, the LServe-like baseline): attends to its sink and most recent pages, never ranked;
- "stable" (`S`): ranked at the first decode step after a prompt, then every `rerank_interval` steps, each row at its
  own phase (`fc_hf/schedule.py`); its selected pages sit in a window on the device, every page in the host tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNSTABLE, STREAMING, STABLE = "unstable", "streaming", "stable"


def page_index(first: torch.Tensor, pages: torch.Tensor, stride: int) -> torch.Tensor:
    """The flat index of pages `pages` of rows (or sequences) `first`, each `stride` pages long: `first * stride +
    pages`, broadcast, in one op (a decode step issues many of these)."""
    return torch.add(pages, first, alpha=stride)


@dataclass(frozen=True)
class HeadKinds:
    """The heads of one layer by kind (each list sorted)."""

    num_heads: int
    unstable: tuple[int, ...]
    streaming: tuple[int, ...]
    stable: tuple[int, ...]

    @classmethod
    def split(cls, num_heads: int, unstable: set[int], streaming: set[int]) -> "HeadKinds":
        stable = set(range(num_heads)) - set(unstable) - set(streaming)
        return cls(num_heads, tuple(sorted(set(unstable) - set(streaming))), tuple(sorted(streaming)), tuple(sorted(stable)))

    def kind_of(self, head: int) -> str:
        return UNSTABLE if head in self.unstable else STREAMING if head in self.streaming else STABLE


class RowIndex:
    """Row indices of each kind for a batch of `batch` sequences, on `device`.

    `unstable`, `streaming`, `stable`: the rows of each kind, sequence-major (`[N_E]`, `[N_X]`, `[N_S]`, long);
    `stable_local [N]`: each row's position among the stable rows, `N_S` for the others (a stable-row tensor's extra last
    row, which writes of the other rows land in); `batch_of [N]`: each row's sequence; `stable_batch [N_S + 1]`: each
    stable row's (0 for the extra row); `kind_order [N]`: the rows kind by kind (unstable, stable, streaming: the order
    of the MinMax cache's rows, `PageStore.meta`), `kind_place [N]` each row's place in it; `near [N_E + N_X]`: the rows
    whose every page stays on the device (unstable and streaming, in row order), `near_place [N]` each one's place among
    them (0 for a stable row: never read through it)."""

    def __init__(self, kinds: HeadKinds, batch: int, device):
        h = kinds.num_heads
        self.kinds, self.batch, self.rows = kinds, batch, batch * h

        def rows(heads):
            return [b * h + x for b in range(batch) for x in heads]

        stable = rows(kinds.stable)
        local = [len(stable)] * self.rows
        for i, row in enumerate(stable):
            local[row] = i
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long).to(device)  # noqa: E731 - built on the host
        self.unstable, self.streaming, self.stable = as_tensor(rows(kinds.unstable)), as_tensor(rows(kinds.streaming)), \
            as_tensor(stable)
        self.stable_local = as_tensor(local)
        self.batch_of = as_tensor([n // h for n in range(self.rows)])
        self.stable_batch = as_tensor([n // h for n in stable] + [0])  # [N_S + 1]: each stable row's sequence, 0 extra
        order = rows(kinds.unstable) + stable + rows(kinds.streaming)
        place = [0] * self.rows
        for i, row in enumerate(order):
            place[row] = i
        self.kind_order, self.kind_place = as_tensor(order), as_tensor(place)
        near = sorted(rows(kinds.unstable) + rows(kinds.streaming))
        near_place = [0] * self.rows
        for i, row in enumerate(near):
            near_place[row] = i
        self.near, self.near_place = as_tensor(near), as_tensor(near_place)
        self.kind_major = order == list(range(self.rows))  # the rows are already in kind order (one sequence, ...)
        # The same on the host, for plans made before a step (a verification block's schedule).
        self.unstable_rows, self.streaming_rows, self.stable_rows = rows(kinds.unstable), rows(kinds.streaming), stable

    @property
    def n_unstable(self) -> int:
        return self.unstable.numel()

    @property
    def n_streaming(self) -> int:
        return self.streaming.numel()

    @property
    def n_near(self) -> int:
        return self.near.numel()

    @property
    def n_stable(self) -> int:
        return self.stable.numel()

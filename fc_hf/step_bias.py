"""What every layer of a decode step reads of the attention mask: which tokens and pages may be attended.

transformers hands a compileable cache's decode step the mask of the whole capacity (`get_mask_sizes` gives the
capacity; the mask is True up to the current position, except padding). `StepBias.update` turns it, once per step and
device, into preallocated buffers that every FlexiCache layer on that device reads:
- `tokens [B, pages + 1, P]` (fp32): 0 where the token may be attended, -inf where not; page `pages` is a null page
  (all -inf) that window places without a page point to. `page_rows` views it as rows of a page, `flat` as tokens.
- `pages [B, pages * S]` (fp32): the scoring bias of each MinMax entry: -inf for a page with no attendable token
  (padding, not yet written), +inf on the first entry of the forced pages (the page being filled, the sink: the first
  `sink_pages` attendable pages), 0 elsewhere.
- `page`: the page being filled (a device scalar; per sequence for a verification block's, `for_block`).
Everything is computed on the device from the mask and the length: no host number changes from step to step.
"""

from __future__ import annotations

import torch

from .rows import page_index

NEG_INF = float("-inf")
POS_INF = float("inf")


class StepBias:
    """A decode step's masks on one device for a batch of `batch` sequences and `pages` pages of `page_size` tokens
    (see the module docstring)."""

    def __init__(self, batch: int, pages: int, page_size: int, subpages: int, sink_pages: int, device):
        self.batch, self.num_pages, self.page_size, self.subpages, self.sink = batch, pages, page_size, subpages, sink_pages
        self.tokens = torch.full((batch, pages + 1, page_size), NEG_INF, device=device)
        self.pages = torch.zeros(batch, pages * subpages, device=device)
        self.page = torch.zeros((), dtype=torch.long, device=device)
        self._index = torch.arange(pages, device=device)
        self._positions = torch.arange(pages * page_size, device=device)
        self._zero, self._neg_inf = torch.zeros((), device=device), torch.full((), NEG_INF, device=device)
        self._sink = torch.arange(max(1, sink_pages), device=device)

    @property
    def page_rows(self) -> torch.Tensor:
        return self.tokens.view(-1, self.page_size)

    @property
    def flat(self) -> torch.Tensor:
        return self.tokens.view(-1)

    def page_tokens(self, seq: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The token bias of pages `pages` of sequences `seq` (broadcast against each other to `[..., M]`) ->
        `[..., M * P]`."""
        if self.batch == 1 and torch.broadcast_shapes(seq.shape, pages.shape) == pages.shape:
            at = pages  # one sequence: the page is the index (no add)
        else:
            at = page_index(seq, pages, self.num_pages + 1)
        return self.page_rows.index_select(0, at.reshape(-1)).view(*at.shape[:-1], -1)

    def of_sequences(self, seq: torch.Tensor) -> torch.Tensor:
        """`[n, pages * S]`: the scoring bias of sequences `seq [n]` (a view with one sequence)."""
        return self.pages.expand(seq.shape[0], -1) if self.batch == 1 else self.pages.index_select(0, seq)

    def update(self, mask: torch.Tensor | None, position: torch.Tensor) -> None:
        """This step's buffers from the mask (`[B, 1, T, capacity]` bool or additive float, its last query row; None:
        every token up to `position`) and `position`, the current token's (a device scalar)."""
        self._fill(None if mask is None else mask[:, 0, -1], position)

    @classmethod
    def for_block(cls, step: "StepBias", mask: torch.Tensor | None, positions: torch.Tensor) -> "StepBias":
        """The masks of a verification block's `t` decode steps at once, as one `StepBias` of `t * B` sequences (step
        `j`'s sequence `b` is `j * B + b`): the mask's last `t` query rows, the steps' `positions [t]`; `page` is then
        each sequence's page being filled `[t * B]`."""
        t, b = positions.numel(), step.batch
        bias = cls(t * b, step.num_pages, step.page_size, step.subpages, step.sink, positions.device)
        bias.page = positions.new_zeros(t * b)
        rows = None if mask is None else mask[:, 0, mask.shape[2] - t :].transpose(0, 1).reshape(t * b, -1)
        bias._fill(rows, positions.repeat_interleave(b))
        return bias

    def _fill(self, rows: torch.Tensor | None, position: torch.Tensor) -> None:
        """The buffers from each sequence's mask row (`[B, L]`; None: causal) and its token's `position` (a scalar
        shared by every sequence, or one per sequence `[B]`)."""
        b, pages, p = self.batch, self.num_pages, self.page_size
        tokens = self.tokens[:, :pages].view(b, pages * p)
        at = position.view(-1, 1)  # [1, 1] or [B, 1]
        if rows is None:
            tokens.copy_(torch.where(self._positions <= at, 0.0, NEG_INF).expand(b, -1))
        else:
            row = rows[:, : pages * p]
            ok = row if row.dtype == torch.bool else row >= 0  # an additive mask: 0 to attend, very negative not to
            if ok.shape[-1] < pages * p:  # a mask of the tokens so far only (a caller's own): the rest is not attended
                tokens[:, ok.shape[-1] :] = NEG_INF
            tokens[:, : ok.shape[-1]].copy_(torch.where(ok, self._zero, self._neg_inf))
        # Causal whatever the mask says (a caller's padding-only mask): nothing past the step's own token, which is
        # attended (a short mask may miss it).
        tokens.masked_fill_(self._positions > at, NEG_INF).scatter_(1, at.expand(b, 1), 0.0)
        page = at // p
        self.page.copy_(page.view(()) if self.page.dim() == 0 else page.view(-1).expand(b))
        valid = self.tokens[:, :pages].amax(dim=-1) == 0  # [B, pages]: an attendable token in the page
        bias = torch.where(valid, 0.0, NEG_INF)
        if self.sink:
            first = valid.to(torch.int8).argmax(dim=1, keepdim=True)  # each sequence's first attendable page
            sink = (first + self._sink).clamp_(max=pages - 1)
            bias.scatter_(1, sink, torch.where(valid.gather(1, sink), POS_INF, NEG_INF))
        bias.scatter_(1, page.expand(b, 1), POS_INF)
        entries = self.pages.view(b, pages, self.subpages)
        entries[:, :, 0] = bias
        if self.subpages > 1:  # the other entries of a forced page: its score is the max over its entries anyway
            entries[:, :, 1:] = bias.clamp(max=0.0)[:, :, None]

    def valid_pages(self) -> torch.Tensor:
        """`[B]`: pages with an attendable token this step."""
        return (self.tokens[:, : self.num_pages].amax(dim=-1) == 0).sum(dim=1)

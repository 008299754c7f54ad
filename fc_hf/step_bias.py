"""What every layer of a decode step reads of the attention mask: which tokens and pages may be attended.

transformers hands a compileable cache's decode step the mask of the whole capacity (`get_mask_sizes` gives the
capacity; the mask is True up to the current position, except padding). `StepBias.update` turns it, once per step and
device, into preallocated buffers that every FlexiCache layer on that device reads:
- `tokens [B, pages + 1, P]` (fp32): 0 where the token may be attended, -inf where not; page `pages` is a null page
  (all -inf) that window places without a page point to. `page_rows` views it as rows of a page, `flat` as tokens.
- `pages [B, pages * S]` (fp32): the scoring bias of each MinMax entry: -inf for a page with no attendable token
  (padding, not yet written), +inf on the first entry of the forced pages (the page being filled, the sink: the first
  `sink_pages` attendable pages), 0 elsewhere.
- `page`: the page being filled (a device scalar).
Everything is computed on the device from the mask and the length: no host number changes from step to step.
"""

from __future__ import annotations

import torch

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

    def update(self, mask: torch.Tensor | None, position: torch.Tensor) -> None:
        """This step's buffers from the mask (`[B, 1, T, capacity]` bool or additive float, its last query row; None:
        every token up to `position`) and `position`, the current token's (a device scalar)."""
        b, pages, p = self.batch, self.num_pages, self.page_size
        tokens = self.tokens[:, :pages].view(b, pages * p)
        if mask is None:
            ok = (self._index[:, None] * p + torch.arange(p, device=tokens.device)).view(-1) <= position
            tokens.copy_(torch.where(ok, 0.0, NEG_INF).expand(b, -1))
        else:
            row = mask[:, 0, -1, : pages * p]
            ok = row if row.dtype == torch.bool else row >= 0  # an additive mask: 0 to attend, very negative not to
            if ok.shape[-1] < pages * p:  # a mask of the tokens so far only (a caller's own): the rest is not attended
                tokens[:, ok.shape[-1] :] = NEG_INF
            tokens[:, : ok.shape[-1]].copy_(torch.where(ok, self._zero, self._neg_inf))
        # Causal whatever the mask says (a caller's padding-only mask): nothing past the step's own token, which is
        # attended (a short mask may miss it).
        tokens.masked_fill_(self._positions > position, NEG_INF).index_fill_(1, position.view(1), 0.0)
        self.page.copy_(position // p)
        valid = self.tokens[:, :pages].amax(dim=-1) == 0  # [B, pages]: an attendable token in the page
        bias = torch.where(valid, 0.0, NEG_INF)
        if self.sink:
            first = valid.to(torch.int8).argmax(dim=1, keepdim=True)  # each sequence's first attendable page
            sink = (first + self._sink).clamp_(max=pages - 1)
            bias.scatter_(1, sink, torch.where(valid.gather(1, sink), POS_INF, NEG_INF))
        bias.index_fill_(1, self.page.view(1), POS_INF)
        entries = self.pages.view(b, pages, self.subpages)
        entries[:, :, 0] = bias
        if self.subpages > 1:  # the other entries of a forced page: its score is the max over its entries anyway
            entries[:, :, 1:] = bias.clamp(max=0.0)[:, :, None]

    def valid_pages(self) -> torch.Tensor:
        """`[B]`: pages with an attendable token this step."""
        return (self.tokens[:, : self.num_pages].amax(dim=-1) == 0).sum(dim=1)

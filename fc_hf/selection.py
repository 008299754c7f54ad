"""Selection policy: which pages a head group attends to at a ranking.

One place owns scoring, forcing and choosing. Where the chosen pages live (device or host) is `tiers.py`'s business;
when a group ranks is `HeadGroup`'s.

- Score: the Quest bound `relu(q).kmax + min(q,0).kmin` of every MinMax entry, max over the query heads of the GQA
  group (the authors'), and with `score_subpages=S` over a page's S sub-pages (`page_size / S` tokens each).
- Forcing: the page being filled and `sink_pages` leading pages (the attention sink) are always chosen (+inf).
- Refinement (`refine_pages=C`, default 2K; 0 = off): the score proposes C candidates, their keys are read and the K
  with the most exact attention mass among them (softmax over the candidates' tokens, mean over the group) are chosen.
  Its logits are kept for that step's attention, which then reads only the chosen pages' values.
- Carried candidates (`carry_pages`): a refined ranking's pages of most mass, and the page after each, are candidates of
  the next ranking whatever their bound (a copy head reading a passage token by token keeps its page).
"""

from __future__ import annotations

import torch

from . import kernels

POS_INF = float("inf")
NEG_INF = float("-inf")
# A carried page's score: above every bound, below the forced pages' +inf (it is a candidate, not a choice).
CARRIED_SCORE = torch.finfo(torch.float32).max


class PageSelector:
    """Chooses `K = cfg.pages_per_head` pages per row from a paged store's MinMax metadata; `workspace` (the cache's
    `kernels.GatherWorkspace`, optional) holds refinement's gathered keys and the step's bias table."""

    def __init__(self, cfg, workspace=None):
        self.cfg = cfg
        self.workspace = workspace
        self.k = cfg.pages_per_head
        self.refine = cfg.candidate_pages
        self.carry = cfg.carried_pages
        # (chosen pages, their indices among the candidates, the candidates' logits [N, G, C, P]) of the last refined
        # ranking, for that step's attention (`take_logits`).
        self._chosen_logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Carried candidates, pages and scores `[N, 2 * carry]` (docs/eval/misses.md). State of the group like its
        # selection: marks, copies and row reorders carry it.
        self.carried: tuple[torch.Tensor, torch.Tensor] | None = None
        self._successor = self._raised = None  # constants of `_carry`
        self.candidates_read = 0  # candidate pages whose keys the last `select` read (all rows)

    def scores(self, query: torch.Tensor, store, page_valid: torch.Tensor | None) -> torch.Tensor:
        """Scores `[N, Np]` (fp32) of every page of `store` for `query [N, G, D]`: the forced pages at +inf, pages
        without a valid token (`page_valid [N, Np]`) at -inf. One launch on Triton."""
        cfg = self.cfg
        scores = kernels.score_pages(query, store.meta, store.num_pages, page_valid, backend=cfg.backend,
                                     subpages=cfg.subpages, sink_pages=cfg.sink_pages if page_valid is None else 0)
        if page_valid is not None:  # the sink: the first pages holding a valid token
            scores = kernels.force_sink_pages(scores, cfg.sink_pages, page_valid)
        return scores

    def select(self, scores: torch.Tensor, query: torch.Tensor, store, scaling: float,
               token_valid: torch.Tensor | None = None, rows_per_batch: int = 1) -> torch.Tensor:
        """The pages `[N, min(K, Np)]` chosen from `scores` (`scores()`), refined exactly when `refine_pages` is set.

        `token_valid [B, L]` (optional): the padding mask, row n of the store being sequence n // `rows_per_batch`."""
        self._chosen_logits = None
        self.candidates_read = 0
        if not self.refine or scores.shape[-1] <= self.k:
            return kernels.select_topk(scores, self.k)
        if self.carried is not None:
            scores.scatter_reduce_(1, self.carried[0], self.carried[1], "amax")
        # The candidates [N, C] and their scores (+inf: forced, kept first; -inf: all padding, kept last) in one op.
        cand_scores, cand = torch.topk(scores, min(self.refine, scores.shape[-1]), dim=-1, sorted=False)
        self.candidates_read = cand.numel()
        logits = None
        if kernels.backend_for(query, self.cfg.backend) == "triton":
            # Two launches read the candidates' keys in place and give their masses (kernels/refine.py).
            if store.tiered:  # a stable group's candidates may be on the host only: read them into one buffer
                keys = store.page_keys(cand, self.workspace)
                pool = keys.view(-1, *keys.shape[2:])
                slots = torch.arange(pool.shape[0], device=cand.device).view_as(cand)
                table = None
            else:  # every page is on the device: the kernel looks each candidate's slot up in the block table
                pool, slots, table = store.k_pool, None, store.table
            mass = kernels.candidate_mass(query, pool, slots, cand, store.length, scaling, cand_scores,
                                          token_valid, rows_per_batch, backend="triton", table=table)
        else:
            # The candidates' logits are kept: the step's attention re-uses the chosen pages' (`take_logits`).
            keys = store.page_keys(cand, self.workspace)  # [N, C, P, D]
            logits = kernels.torch_backend.candidate_logits(query, keys, cand, store.length, scaling,
                                                            token_valid, rows_per_batch, workspace=self.workspace)
            mass = kernels.torch_backend.mass_from_logits(logits, store.page_size, cand_scores,
                                                          padded=token_valid is not None)
        if self.carry:
            self._carry(cand, mass, scores.shape[-1])
        top = torch.topk(mass, self.k, dim=-1).indices  # [N, K]
        chosen = cand.gather(1, top)
        if logits is not None:
            n, c = cand.shape
            self._chosen_logits = (chosen, top, logits.view(n, logits.shape[1], c, store.page_size))
        return chosen

    def _carry(self, cand: torch.Tensor, mass: torch.Tensor, num_pages: int) -> None:
        """Keep, for the next ranking, the `carry_pages` candidates of most mass, and the page after each (the last page
        at most): `(pages [N, 2 * carry], scores)`, a score -inf where a row had fewer candidates of positive, finite
        mass (neither forced nor all padding); `select` raises their scores up to `CARRIED_SCORE` (forced stay)."""
        top = mass.nan_to_num(posinf=0.0, neginf=0.0).topk(min(self.carry, mass.shape[1]), dim=-1)
        best = cand.gather(1, top.indices)[..., None]  # [N, carry, 1]
        if self._successor is None:
            self._successor = torch.arange(2, device=cand.device)
            self._raised = torch.tensor([CARRIED_SCORE, NEG_INF], device=cand.device)
        pages = (best + self._successor).clamp_(max=num_pages - 1).flatten(1)
        score = torch.where(top.values[..., None] > 0, self._raised[0], self._raised[1]).expand(-1, -1, 2)
        self.carried = (pages, score.flatten(1))

    def forget(self) -> None:
        """Drop the last ranking's logits (tokens were added since: they are no step's any more)."""
        self._chosen_logits = None

    def take_logits(self, pages: torch.Tensor, wanted: bool = True) -> torch.Tensor | None:
        """The logits `[N, G, K*P]` (scaled and masked) the last ranking computed for `pages`, if `pages` is exactly what
        it chose, so that step's attention reads only the values; cleared by every call (`wanted=False` only clears:
        an attention that reads the keys anyway)."""
        stash, self._chosen_logits = self._chosen_logits, None
        if not wanted or stash is None or stash[0] is not pages:
            return None
        _, top, logits = stash  # [N, K], [N, G, C, P]
        n, g, _, p = logits.shape
        return logits.gather(2, top[:, None, :, None].expand(n, g, top.shape[1], p)).view(n, g, -1)

    def streaming_pages(self, rows: int, num_pages: int, device) -> torch.Tensor:
        """Sink + most recent pages `[rows, min(K, Np)]` (the LServe-like baseline's streaming heads)."""
        if num_pages <= self.k:
            idx = torch.arange(num_pages, device=device)
        else:
            sink = self.cfg.streaming_sink_pages
            recent = torch.arange(num_pages - (self.k - sink), num_pages, device=device)
            idx = torch.cat([torch.arange(sink, device=device), recent])
        return idx.expand(rows, idx.numel())

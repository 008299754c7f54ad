"""Selection policy: which pages a set of rows attends to at a ranking. One entry, `PageSelector.rank`.

Every shape is fixed by the store's capacity (the step compiles once); pages that do not exist yet and pages with no
attendable token are ruled out by the step's bias (`fc_hf.step_bias.StepBias`), never by a Python length.

- Score: the Quest bound `relu(q).kmax + min(q,0).kmin` of every MinMax entry, max over the query heads of the GQA
  group (the authors') and over a page's `score_subpages` sub-pages.
- Forcing: the page being filled and `sink_pages` leading attendable pages are always chosen (+inf, in the bias).
- Refinement (`refine_pages=C`, default 2K; 0 = off): the score proposes C candidates, their keys are read and the K
  with the most exact attention mass among them (softmax over the candidates' tokens, mean over the group) are chosen.
  Its logits are kept for that step's attention, which then reads only the chosen pages' values.
- Carried candidates (`carry_pages`): a refined ranking's pages of most mass, and the page after each, are candidates of
  the next ranking whatever their bound (a copy head reading a passage token by token keeps its page). The selector
  owns them (`carried_pages/carried_scores [N + 1, 2c]`, the last row taking padded rows' writes); `mark`, `restore`,
  `forget` and `select_rows` are their only other writers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import dispatch as kernels

POS_INF = float("inf")
NEG_INF = float("-inf")
# A carried page's score: above every bound, below the forced pages' +inf (it is a candidate, not a choice).
CARRIED_SCORE = torch.finfo(torch.float32).max


@dataclass
class Ranking:
    """What a ranking of `n` rows chose: `pages [n, K]`; with refinement the `candidates [n, C]` the bound proposed
    (carried pages raised), `top [n, K]` (the chosen ones' places among them) and `logits [n, G, C, P]` (the
    candidates' scaled, masked fp32 logits, for that step's attention)."""

    pages: torch.Tensor
    top: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


class PageSelector:
    """Chooses `K = cfg.pages_per_head` pages per row from a `PageStore` (see the module docstring)."""

    def __init__(self, cfg, rows: int, device):
        self.cfg = cfg
        self.k = cfg.pages_per_head
        self.refine = cfg.candidate_pages
        self.carry = cfg.carried_pages
        width = max(1, 2 * self.carry)
        self.carried_pages = torch.zeros(rows + 1, width, dtype=torch.long, device=device)
        self.carried_scores = torch.full((rows + 1, width), NEG_INF, device=device)
        self._successor = torch.arange(2, device=device)

    # -- the ranking -------------------------------------------------------------------------------------------
    def rank(self, query: torch.Tensor, rows: torch.Tensor, store, bias, scaling: float) -> Ranking:
        """Rank rows `rows [n]` (a row index; `store.n` for a padded place, whose results are not kept) for their queries
        `query [n, G, D]` at this step. `bias` is the step's `StepBias`."""
        cfg, store_rows = self.cfg, store.n
        real = rows.clamp(max=store_rows - 1)  # padded places compute on a real row; their writes go to the extra row
        seq = store.rows.batch_of.index_select(0, real)
        scores = kernels.page_scores(query, store.meta.index_select(0, real), bias.pages.index_select(0, seq),
                                     store.subpages, backend=cfg.backend)
        k = min(self.k, scores.shape[-1])
        if not self.refine:
            return Ranking(torch.topk(scores, k, dim=-1, sorted=False).indices)
        if self.carry:
            scores.scatter_reduce_(1, self.carried_pages.index_select(0, rows), self.carried_scores.index_select(0, rows),
                                   "amax")
        cand_scores, cand = torch.topk(scores, min(self.refine, scores.shape[-1]), dim=-1, sorted=False)
        n, c = cand.shape
        keys = kernels.gather_pages(store.full_k.view(-1, store.page_size, store.head_dim),
                                    (real[:, None] * store.pages + cand).view(-1), backend=cfg.backend)
        tok_bias = bias.page_rows.index_select(0, (seq[:, None] * (store.pages + 1) + cand).view(-1))  # [n*C, P]
        mass, logits = kernels.candidate_mass(query, keys.view(n, c * store.page_size, -1), tok_bias.view(n, -1),
                                              cand_scores, scaling, store.page_size, backend=cfg.backend)
        if self.carry:
            self._carry(rows, cand, mass, bias.page)
        top = torch.topk(mass, k, dim=-1, sorted=False).indices
        return Ranking(cand.gather(1, top), top, logits, cand)

    def _carry(self, rows: torch.Tensor, cand: torch.Tensor, mass: torch.Tensor, page: torch.Tensor) -> None:
        """Carry, into the rows' next ranking, their `carry_pages` candidates of most mass and the page after each (the
        page being filled, `page`, at most); a score of -inf where a row had fewer candidates of positive, finite mass
        (neither forced nor never attendable)."""
        top = mass.nan_to_num(posinf=0.0, neginf=0.0).topk(min(self.carry, mass.shape[1]), dim=-1)
        best = cand.gather(1, top.indices)[..., None]  # [n, carry, 1]
        pages = torch.minimum(best + self._successor, page).flatten(1)
        score = torch.where(top.values[..., None] > 0, CARRIED_SCORE, NEG_INF).expand(-1, -1, 2).flatten(1)
        missing = self.carried_pages.shape[1] - pages.shape[1]
        if missing:  # fewer candidates than pages to carry (a small capacity): the other places carry nothing
            pages = torch.cat([pages, pages.new_zeros(pages.shape[0], missing)], dim=1)
            score = torch.cat([score, score.new_full((score.shape[0], missing), NEG_INF)], dim=1)
        self.carried_pages.index_copy_(0, rows, pages)
        self.carried_scores.index_copy_(0, rows, score)

    # -- the selector's state ------------------------------------------------------------------------------------
    def forget(self) -> None:
        """Tokens were added as a prompt: nothing ranked before them is carried on."""
        self.carried_scores.fill_(NEG_INF)

    def mark(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.carried_pages.clone(), self.carried_scores.clone()

    def restore(self, mark) -> None:
        self.carried_pages.copy_(mark[0])
        self.carried_scores.copy_(mark[1])

    def select_rows(self, rows: torch.Tensor) -> None:
        """New row i continues old row `rows[i]` (beam search, a batch expansion)."""
        extra = rows.new_full((1,), self.carried_pages.shape[0] - 1)
        index = torch.cat([rows, extra])
        if index.numel() == self.carried_pages.shape[0]:
            self.carried_pages.copy_(self.carried_pages.index_select(0, index))
            self.carried_scores.copy_(self.carried_scores.index_select(0, index))
        else:
            self.carried_pages = self.carried_pages.index_select(0, index)
            self.carried_scores = self.carried_scores.index_select(0, index)

"""Selection policy: which pages a head group attends to at a ranking.

One place owns scoring (the page bound), combining over the GQA group, forcing (the attention sink,
a recent window and the page being filled) and choosing (top-K). Where the chosen pages live
(device or host) is `tiers.py`'s business; when a group ranks is `HeadGroup`'s.

Policies (`FlexiCacheConfig` options):
- `page_score="quest"`: the Quest bound `relu(q).kmax + min(q,0).kmin` of every page, max over the
  query heads of the GQA group (the authors' selection).
- `page_score="group_mean"`: each query head's bounds become a distribution over pages
  (`softmax(scaling * bound)`), and the group's page score is the mean of those distributions, so one
  high-norm query head does not choose for the whole group.
- `score_subpages=S`: MinMax metadata kept for `page_size / S`-token sub-pages; a page's bound is the
  max of its sub-pages' bounds (tighter; selection is still of whole pages; S times the metadata).
- `recent_pages=R`: the R pages before the page being filled are always selected (inside the budget).
- `page_score="exact"`: the true attention mass of every page (softmax over every key, mean over the
  group) — reads every key of the head, so it is the oracle the others approach, not a cheap policy;
  `stable_page_score="exact"` uses it for stable heads only, at their re-rank every R steps.
- `refine_pages=C` (default 2K; 0 = off): the score picks C >= K candidate pages, whose keys are then
  read and scored exactly (true attention mass among the candidates, mean over the group); the top K of
  those are chosen. Costs reading the candidates' keys at every ranking; it is the default because no
  cheaper policy came close (docs/eval/selection.md).
- `budget_mass=p`: refinement's candidates, but each row keeps the smallest set reaching mass p among them (forced
  pages in, between a floor and a ceiling of pages): a variable number of pages per row (`fc_hf/budget_mass.py`).
- `tail_estimate=True`: the unselected full pages are not dropped from the softmax but stand in as one
  term each, `P * exp(scaling * q.mean_key)` with the page's mean value (RetroInfer-like); needs the
  per-page mean key and value beside MinMax (`D + Dv` more metadata values per page).
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .budget_mass import choose_by_mass, choose_counts
from .config import PAGE_SCORES

POS_INF = float("inf")
NEG_INF = float("-inf")
# A carried page's score: above every bound, below the forced pages' +inf (it is a candidate, not a choice).
CARRIED_SCORE = torch.finfo(torch.float32).max


def head_bounds(query: torch.Tensor, meta: torch.Tensor, entries: int) -> torch.Tensor:
    """Quest bound of every metadata entry for every query head: `[N, G, D]`, `[N, >=E, 2D]` -> `[N, G, E]` fp32."""
    return kernels.torch_backend.bounds_per_head(query, meta, entries)


def combine_group(bounds: torch.Tensor, how: str, scaling: float, page_valid: torch.Tensor | None) -> torch.Tensor:
    """Per-head page bounds `[N, G, Np]` -> one score per page `[N, Np]` (fp32), invalid pages at -inf."""
    if page_valid is not None:
        bounds = bounds.masked_fill(~page_valid[:, None, :], NEG_INF)
    if how == "quest":
        return bounds.amax(dim=1)
    if how == "group_mean":
        scores = torch.softmax(bounds * scaling, dim=-1).mean(dim=1)
        if page_valid is not None:  # keep all-padding pages below every real page
            scores = scores.masked_fill(~page_valid, NEG_INF)
        return scores
    raise ValueError(f"unknown page_score {how!r}; expected one of {PAGE_SCORES}")


def exact_page_mass(query: torch.Tensor, keys: torch.Tensor, length: int, page_size: int, scaling: float,
                    token_valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """True attention mass of every page, mean over the group: `[N, G, D]`, `[N, Np*P, D]` -> `[N, Np]` fp32.

    `token_valid_rows [N, L]` (optional) masks padding; positions >= `length` are masked.
    """
    n, g, _ = query.shape
    logits = torch.matmul(query.float(), keys.float().transpose(1, 2)) * scaling  # [N, G, Np*P]
    ok = torch.arange(keys.shape[1], device=keys.device) < length
    ok = ok[None].expand(n, -1)
    if token_valid_rows is not None:
        ok = ok.clone()
        ok[:, :length] &= token_valid_rows[:, :length]
    probs = torch.softmax(logits.masked_fill(~ok[:, None], NEG_INF), dim=-1).nan_to_num(0.0)
    return probs.view(n, g, -1, page_size).sum(-1).mean(1)


def tail_terms(query: torch.Tensor, page_means: torch.Tensor, read: torch.Tensor, full_pages: int, page_size: int,
               scaling: float, page_valid: torch.Tensor | None = None, softcap: float | None = None):
    """Softmax terms standing for the full pages a step does not read (`tail_estimate`).

    Each unread full page becomes one term: logit `scaling * q.mean_key (+ log P for its P tokens)`
    with value `mean_value`. Read pages, the page being filled and all-padding pages get -inf.

    Args:
        query (`torch.Tensor` of shape `[N, G, D]`): decode queries.
        page_means (`torch.Tensor` of shape `[N, >= full_pages, D + Dv]`): mean key then mean value per page.
        read (`torch.Tensor` of shape `[N, M]`): the logical pages the step reads exactly.
        full_pages (`int`): pages that are full (only those have means).

    Returns:
        `(logits [N, G, full_pages] fp32, values [N, full_pages, Dv])`.
    """
    d = query.shape[-1]
    means = page_means[:, :full_pages]
    logits = torch.matmul(query.float(), means[..., :d].float().transpose(1, 2)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + math.log(page_size)  # the page's P tokens
    skip = torch.zeros(query.shape[0], full_pages + 1, dtype=torch.bool, device=query.device)
    skip.scatter_(1, read.clamp(max=full_pages), True)  # the page being filled maps to the spare column
    skip = skip[:, :full_pages]
    if page_valid is not None:
        skip |= ~page_valid[:, :full_pages]
    return logits.masked_fill(skip[:, None], NEG_INF), means[..., d:]


def force_recent_pages(scores: torch.Tensor, recent: int) -> torch.Tensor:
    """Force the `recent` pages before the last one (+inf), in place; the last page is forced elsewhere."""
    num_pages = scores.shape[-1]
    lo = max(0, num_pages - 1 - recent)
    if recent > 0 and lo < num_pages - 1:
        scores[:, lo : num_pages - 1] = POS_INF
    return scores


class PageSelector:
    """Chooses `K = cfg.pages_per_head` pages per row from a paged store's MinMax metadata.

    Args:
        cfg (`FlexiCacheConfig`): page size, budget, `page_score`, `score_subpages`, `sink_pages`,
            `recent_pages`, kernel backend.
        page_score (`str`, *optional*): this selector's page score (None: `cfg.page_score`).
        workspace (`kernels.GatherWorkspace`, *optional*): the cache's workspace; refinement takes the step's
            table of positions past the sequence's end from it instead of building its own.
    """

    def __init__(self, cfg, page_score: str | None = None, workspace=None, split=None):
        self.cfg = cfg
        self.workspace = workspace  # the cache's kernels.GatherWorkspace (shared per-step tables), or None
        self.k = cfg.pages_per_head
        self.subpages = cfg.subpages
        self.how = page_score or cfg.page_score
        self.recent = cfg.recent_pages
        self.refine = cfg.candidate_pages
        # `budget_mass` / `budget_split="mass"`: a variable number of pages per row (`fc_hf/budget_mass.py`); else K.
        self.variable = cfg.variable_pages
        self.mass = cfg.budget_mass
        self.split = split  # budget_split="mass": the cache's `MassSplit`; it sets `split_counts` [rows] (None: K)
        if split is not None:
            split.join(self)
        self.floor = cfg.mass_min_pages if self.variable else None
        # (chosen pages, their indices among the candidates, the candidates' logits [N, G, C, P]) of the last refined
        # ranking, for that step's attention (`take_logits`).
        self._chosen_logits: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Carried candidates, pages and scores `[N, 2 * carry]` (`FlexiCacheConfig.carry_pages`): the pages of most exact mass at the
        # last refined ranking and the page after each. The next ranking's candidates always include them, whatever
        # their bound: a head that reads a passage token by token (a copy head on a needle) keeps its page when a new
        # query's loose bound drops it (docs/eval/misses.md). State of the group like its selection: marks, copies
        # and row reorders carry it.
        self.carry = cfg.carried_pages
        self.carried: tuple[torch.Tensor, torch.Tensor] | None = None
        self._successor = self._raised = None  # constants of `_carry`

    def page_scores(
        self, query: torch.Tensor, meta: torch.Tensor, num_pages: int, page_valid: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Scores `[N, Np]` (fp32) of every page from `meta [N, >= Np*S, 2D]`; `scores()` applies the forcing.

        (The Quest scoring already puts the page being filled and, without padding, the sink at +inf; `scores()`
        forces them on the other paths.)
        """
        s = self.subpages
        if self._kernel_scored():  # one launch on Triton: the group and sub-page max, the forced pages
            sink = self.cfg.sink_pages if page_valid is None else 0
            return kernels.score_pages(query, meta, num_pages, page_valid, backend=self.cfg.backend, subpages=s,
                                       sink_pages=sink)
        bounds = head_bounds(query, meta, num_pages * s)
        if s > 1:  # a sub-page not yet written (in the page being filled) is all zeros; that page is forced anyway
            bounds = bounds.view(*bounds.shape[:2], num_pages, s).amax(dim=-1)
        return combine_group(bounds, self.how, scaling, page_valid)

    def scores(
        self, query: torch.Tensor, store, page_valid: torch.Tensor | None, scaling: float = 1.0,
        token_valid_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Page scores `[N, Np]` (fp32) with the forced pages at +inf and all-padding pages at -inf."""
        num_pages = store.num_pages
        if self.how == "exact":
            pages = torch.arange(num_pages, device=store.device).expand(store.rows, num_pages)
            keys = store.page_keys(pages).reshape(store.rows, num_pages * store.page_size, -1)
            scores = exact_page_mass(query, keys, store.length, store.page_size, scaling, token_valid_rows)
            if page_valid is not None:
                scores = scores.masked_fill(~page_valid, NEG_INF)
        else:
            scores = self.page_scores(query, store.meta, num_pages, page_valid, scaling)
        force_recent_pages(scores, self.recent)
        if self._kernel_scored() and page_valid is None:  # the Quest scoring has forced the last page and the sink
            return scores
        if not self._kernel_scored():
            scores[:, num_pages - 1] = POS_INF  # the page being filled
        return kernels.force_sink_pages(scores, self.cfg.sink_pages, page_valid)

    def _kernel_scored(self) -> bool:
        return self.how == "quest"

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The top-K pages of each row, `[N, min(K, Np)]` (all pages when there are at most K)."""
        return kernels.select_topk(scores, self.k)

    def select(self, scores: torch.Tensor, query: torch.Tensor, store, scaling: float,
               token_valid: torch.Tensor | None = None, rows_per_batch: int = 1) -> torch.Tensor:
        """The pages `[N, min(K, Np)]` chosen from `scores` (`scores()`), refined exactly when `refine_pages` is set.

        `token_valid [B, L]` (optional): the padding mask, row n of the store being sequence n // `rows_per_batch`."""
        self._chosen_logits = None
        if self.variable:  # every page when the floor covers them all; else by mass (no -1 entries before)
            if scores.shape[-1] <= self.floor:
                return kernels.select_topk(scores, scores.shape[-1])
            return self._refine(query, store, scores, scaling, token_valid, rows_per_batch)
        if not self.refine or self.how == "exact" or scores.shape[-1] <= self.k:
            return self.choose(scores)
        return self._refine(query, store, scores, scaling, token_valid, rows_per_batch)

    def _refine(self, query, store, scores, scaling, token_valid, rows_per_batch):
        """Top-C candidates by score, then the K with the most exact attention mass among them (forced pages kept)."""
        if self.carried is not None:
            self._raise_carried(scores)
        # The candidates [N, C] and their scores (+inf: forced, kept first; -inf: all padding, kept last) in one op.
        cand_scores, cand = torch.topk(scores, min(self.refine, scores.shape[-1]), dim=-1, sorted=False)
        # `budget_mass` needs every candidate's own mass (forced ones too): the masses come without the forcing.
        forced = cand_scores if not self.variable else torch.zeros_like(cand_scores)
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
            mass = kernels.candidate_mass(query, pool, slots, cand, store.length, scaling, forced,
                                          token_valid, rows_per_batch, backend="triton", table=table)
        else:
            # The candidates' logits are kept: the step's attention re-uses the chosen pages' (`take_logits`).
            keys = store.page_keys(cand, self.workspace)  # [N, C, P, D]
            logits = kernels.torch_backend.candidate_logits(query, keys, cand, store.length, scaling,
                                                            token_valid, rows_per_batch, workspace=self.workspace)
            mass = kernels.torch_backend.mass_from_logits(logits, store.page_size, forced,
                                                          padded=token_valid is not None)
        if self.carry and not self.variable:
            self._carry(cand, mass, scores.shape[-1])
        if self.variable:
            key = torch.where(torch.isinf(cand_scores), cand_scores, mass)
            if self.mass is not None:
                chosen, top, _ = choose_by_mass(cand, mass, key, self.mass, self.floor, self.cfg.mass_max_pages,
                                                trim=not cand.is_cuda)
            else:  # budget_split="mass": K each until every ranked group has reported its masses, then its split
                counts = self.split_counts
                if counts is None:
                    counts = torch.full((cand.shape[0],), self.k, dtype=torch.long, device=cand.device)
                    self.split.report(self, key, rows_per_batch)
                chosen, top, _ = choose_counts(cand, key, counts, self.cfg.mass_max_pages, trim=not cand.is_cuda)
        else:
            top = torch.topk(mass, self.k, dim=-1).indices  # [N, K]
            chosen = cand.gather(1, top)
        if logits is not None:
            n, c = cand.shape
            self._chosen_logits = (chosen, top, logits.view(n, logits.shape[1], c, store.page_size))
        return chosen

    def _raise_carried(self, scores: torch.Tensor) -> None:
        """Scores of the carried pages up to `CARRIED_SCORE` in `scores [N, Np]` (in place), so they are candidates;
        forced pages (+inf) stay forced, entries that carry nothing (-inf) change nothing."""
        scores.scatter_reduce_(1, self.carried[0], self.carried[1], "amax")

    def _carry(self, cand: torch.Tensor, mass: torch.Tensor, num_pages: int) -> None:
        """Keep, for the next ranking, the `carry_pages` candidates of most mass, and the page after each (the last page
        at most): `(pages [N, 2 * carry], scores)`, a score -inf where a row had fewer candidates of positive, finite
        mass (neither forced nor all padding)."""
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
        """The logits `[N, G, K*P]` the last ranking computed for `pages`, if `pages` is exactly what it chose; cleared.

        They are already scaled and masked, so that step's attention reads only the pages' values. Valid only for
        the query of the step that ranked: the caller offers every step's pages (any later call finds them
        cleared), and they are returned only when it attends to that selection as it is (not deferred, no page
        created since). `wanted=False` only clears them (an attention that reads the keys anyway): nothing is gathered.
        """
        stash, self._chosen_logits = self._chosen_logits, None
        if not wanted or stash is None or stash[0] is not pages:
            return None
        _, top, logits = stash  # [N, K], [N, G, C, P]
        n, g, _, p = logits.shape
        if self.variable:  # `budget_mass` / `budget_split`: -1 entries (past a row's count) are not attended
            unused = top < 0
            picked = logits.gather(2, top.clamp(min=0)[:, None, :, None].expand(n, g, top.shape[1], p))
            return picked.masked_fill(unused[:, None, :, None], NEG_INF).view(n, g, -1)
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

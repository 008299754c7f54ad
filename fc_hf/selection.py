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
        # device constants: a Python float in torch.where is one more launch per call
        self._carried_score = torch.tensor(CARRIED_SCORE, device=device)
        self._neg_inf = torch.tensor(NEG_INF, device=device)

    # -- the ranking -------------------------------------------------------------------------------------------
    def rank(self, query: torch.Tensor, rows: torch.Tensor, store, bias, scaling: float,
             minmax: list[torch.Tensor] | None = None, near: int = 0, real: torch.Tensor | None = None,
             seq: torch.Tensor | None = None, row_range: slice | None = None) -> Ranking:
        """Rank rows `rows [n]` (a row index; `store.n` for a padded place, whose results are not kept) for their queries
        `query [n, G, D]` at this step. `bias` is the step's `StepBias`. `minmax`: the rows' MinMax entries as views of
        the cache (`PageStore.minmax_views`), where the caller knows them on the host; else they are gathered. `near`:
        the leading rows that are unstable (their candidates' keys are read from the near tier, `_logits`).
        `real`, `seq`: the rows with padded places on a real row, and their sequences, where the caller has them.
        `row_range`: a `slice` where `rows` is the rows `[first, end)` (their carried candidates read and written in
        place)."""
        if real is None:
            real = rows.clamp(max=store.n - 1)  # padded places compute on a real row; their writes go to the extra row
        if seq is None:
            seq = store.rows.batch_of.index_select(0, real)
        scores = self._scores(query, real, seq, store, bias, minmax)
        if not self.refine:
            return Ranking(self._top(scores))
        carried = None
        if self.carry:
            carried = ((self.carried_pages[row_range], self.carried_scores[row_range]) if row_range is not None
                       else (self.carried_pages.index_select(0, rows), self.carried_scores.index_select(0, rows)))
        # A row range's carried candidates are written in place by `_refine` (read by `_candidates` before).
        ranking, out = self._refine(query, real, seq, *self._candidates(scores, carried), store, bias, bias.page,
                                    scaling, near, into=carried if row_range is not None else None)
        if self.carry and row_range is None:
            self.carried_pages.index_copy_(0, rows, out[0])
            self.carried_scores.index_copy_(0, rows, out[1])
        return ranking

    def rank_block(self, query: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, prev: torch.Tensor, store, bias,
                   scaling: float, near: int = 0, minmax: list[torch.Tensor] | None = None) -> tuple[Ranking, tuple | None]:
        """Rank the entries of a verification block at once, each as its own step would: entry `e` ranks row
        `rows[e]` for query `query[e]` over the masks of block sequence `seq[e]` (`bias`: `StepBias.for_block`).
        `prev [E]`: the entry of the same row the step before (-1: none in the block), whose carried candidates
        this entry's ranking takes (the selector's state for a row's first). `minmax`: the entries' MinMax entries as
        blocks of views where the caller knows them (as `rank`'s), else gathered.

        A ranking takes the carried candidates of the one before it, so the entries are ranked in rounds: the first
        with the carried state as it stood before the block; then each entry whose `prev` carried out other pages (as
        sets, which is all a ranking reads of them) than it ranked with ranks again with those, until none does: then
        each entry ranked as its own step would. A copy head that keeps its pages settles in the first round; each
        round fixes at least one more step of every chain. A round after the first reads only the keys of candidates an
        entry did not have before (`_refine`'s `known`). Each round reads which entries changed (a host sync; a
        verification is eager). Returns the ranking and each entry's carried candidates out
        (`(pages [E, 2c], scores [E, 2c])`, None without carrying); the selector's state is not written."""
        real = rows.clamp(max=store.n - 1)
        scores = self._scores(query, real, seq, store, bias, minmax)
        if not self.refine:
            return Ranking(self._top(scores)), None
        page = bias.page.index_select(0, seq)
        if not self.carry:
            return self._refine(query, real, seq, *self._candidates(scores, None), store, bias, page, scaling,
                                near)[0], None
        state = (self.carried_pages.index_select(0, rows), self.carried_scores.index_select(0, rows))
        has_prev = (prev >= 0)[:, None]
        before = prev.clamp(min=0)
        held = self._carried_set(*state, store.pages)
        cand_scores, cand = self._candidates(scores, state)
        ranking, out = self._refine(query, real, seq, cand_scores, cand, store, bias, page, scaling, near)
        out = tuple(x.clone() for x in out)  # written per entry below (the scores may be an expanded view)
        for _ in range(int(rows.numel())):
            nxt = tuple(torch.where(has_prev, x.index_select(0, before), s) for x, s in zip(out, state))
            nxt_held = self._carried_set(*nxt, store.pages)
            changed = (nxt_held != held).any(dim=1).nonzero().flatten()  # a host sync
            if not changed.numel():
                return ranking, out
            held.index_copy_(0, changed, nxt_held.index_select(0, changed))
            # Other carried pages may still give the same candidates (and the same forced / never-attendable ones):
            # then the same ranking. Only the entries whose candidates changed rank again.
            new_scores, new_cand = self._candidates(scores.index_select(0, changed),
                                                    tuple(x.index_select(0, changed) for x in nxt))
            same = (new_cand == cand.index_select(0, changed)).all(1) & (
                torch.isinf(new_scores) == torch.isinf(cand_scores.index_select(0, changed))).all(1)
            pick = (~same).nonzero().flatten()  # a host sync
            redo = changed.index_select(0, pick)
            if not redo.numel():
                continue
            new_scores, new_cand = new_scores.index_select(0, pick), new_cand.index_select(0, pick)
            known = (cand.index_select(0, redo), ranking.logits.index_select(0, redo))
            cand.index_copy_(0, redo, new_cand)
            cand_scores.index_copy_(0, redo, new_scores)
            again, moved = self._refine(query.index_select(0, redo), real.index_select(0, redo),
                                        seq.index_select(0, redo), new_scores, new_cand, store, bias,
                                        page.index_select(0, redo), scaling, known=known)
            for name in ("pages", "top", "logits", "candidates"):
                getattr(ranking, name).index_copy_(0, redo, getattr(again, name))
            for x, y in zip(out, moved):
                x.index_copy_(0, redo, y)
        raise AssertionError("carried candidates did not settle within a round per entry")  # a chain has E links

    @staticmethod
    def _carried_set(pages: torch.Tensor, scores: torch.Tensor, n_pages: int) -> torch.Tensor:
        """`[E, pages + 1]` bool: the pages an entry's carried candidates raise (finite score); column `pages` none."""
        at = torch.where(torch.isfinite(scores), pages, n_pages)
        return torch.zeros(pages.shape[0], n_pages + 1, dtype=torch.bool, device=pages.device).scatter_(1, at, True)

    def _scores(self, query, real, seq, store, bias, minmax=None) -> torch.Tensor:
        return kernels.page_scores(query, store.minmax(real) if minmax is None else minmax, bias.of_sequences(seq),
                                   store.subpages, backend=self.cfg.backend)

    def _top(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.topk(scores, min(self.k, scores.shape[-1]), dim=-1, sorted=False).indices

    def _candidates(self, scores: torch.Tensor, carried) -> tuple[torch.Tensor, torch.Tensor]:
        """Refinement's candidates: the `refine_pages` best bounds, `carried` raised among them, in page order (so the
        same candidates are the same ranking whatever raised them). -> `(scores [n, C], pages [n, C])`."""
        return kernels.candidates(scores, *(carried or (None, None)), min(self.refine, scores.shape[-1]),
                                  backend=self.cfg.backend)

    def _refine(self, query, real, seq, cand_scores, cand, store, bias, page, scaling, near: int = 0,
                known: tuple | None = None, into: tuple | None = None) -> tuple[Ranking, tuple]:
        """Refinement of candidates `cand [n, C]` (`_candidates`): their exact attention mass, the top K. Returns the
        ranking and the candidates it carries out (written into `into`, `(pages, scores)`, where given). The first
        `near` rows are unstable (`_logits`). `known`: `(candidates [n, C'], logits [n, G, C', P])` of an
        earlier refinement of the same queries (a verification block's later round, `rank_block`): only the candidates
        it lacked have their keys read."""
        k = min(self.k, store.pages)
        if known is None:
            logits = self._logits(query, real, seq, cand, store, bias, scaling, near)
        else:
            logits = self._logits_again(query, real, seq, cand, *known, store, bias, scaling)
        if fused := kernels.fused(logits, self.cfg.backend):  # the mass, top K and carried out in one call
            n, carry = cand.shape[0], min(self.carry, cand.shape[1])
            out = into if into is not None else (self.carried_pages.new_empty(n, self.carried_pages.shape[1]),
                                                 self.carried_scores.new_empty(n, self.carried_scores.shape[1]))
            _, top, pages = kernels.choose(logits, cand_scores, cand, page, k, carry, CARRIED_SCORE, *out,
                                           backend=fused)
            return Ranking(pages, top, logits, cand), out if self.carry else None
        mass = kernels.page_mass(logits, cand_scores)
        out = self._carry_out(cand, mass, page, into) if self.carry else None
        top = torch.topk(mass, k, dim=-1, sorted=False).indices
        return Ranking(cand.gather(1, top), top, logits, cand), out

    def _logits_again(self, query, real, seq, cand, old_cand, old_logits, store, bias, scaling) -> torch.Tensor:
        """`[n, G, C, P]`: the logits of candidates `cand [n, C]` (in page order), those of `old_cand` (in page order)
        taken from `old_logits`, the others computed (a token's logit does not depend on the other candidates, so
        the numbers are the ones a full refinement computes, `candidate_logits`). Counting the new ones is a host sync
        (eager only)."""
        g, p = old_logits.shape[1], old_logits.shape[3]
        at = torch.searchsorted(old_cand, cand).clamp(max=old_cand.shape[1] - 1)
        new = old_cand.gather(1, at) != cand
        logits = old_logits.gather(2, at[:, None, :, None].expand(-1, g, -1, p))
        count = int(new.sum(1).max())  # a host sync
        if count:
            # Each row's new candidates first (padded with old ones, computed again to the same numbers).
            order = new.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :count]
            fresh = self._logits(query, real, seq, cand.gather(1, order), store, bias, scaling)
            logits.scatter_(2, order[:, None, :, None].expand(-1, g, -1, p), fresh)
        return logits

    def _logits(self, query, real, seq, pages, store, bias, scaling, near: int = 0) -> torch.Tensor:
        """`[n, G, C, P]`: the logits of pages `pages [n, C]` of rows `real` for their queries (`kernels.page_logits`:
        the keys read in place, the first `near` rows' from the near tier, where it is apart)."""
        return kernels.page_logits(query, pages, real, near if store.near_apart else 0, store.near_k, store.near_index,
                                   store.full_k, bias.tokens, None if bias.batch == 1 else seq, scaling,
                                   backend=self.cfg.backend)

    def _carry_out(self, cand: torch.Tensor, mass: torch.Tensor, page: torch.Tensor,
                   into: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What a ranking carries into its row's next one: its `carry_pages` candidates of most mass and the page after
        each (the page being filled, `page` (a scalar or one per ranking), at most); a score of -inf where a row had
        fewer candidates of positive, finite mass (neither forced nor never attendable). Written into `into`
        (`(pages, scores)` views of the state) where given. The PyTorch path (the Triton backend's is `choose`'s)."""
        top = mass.nan_to_num(posinf=0.0, neginf=0.0).topk(min(self.carry, mass.shape[1]), dim=-1)
        best = cand.gather(1, top.indices)[..., None]  # [n, carry, 1]
        n, carry = best.shape[:2]
        limit = page.view(-1, 1, 1) if page.dim() else page
        missing = self.carried_pages.shape[1] - 2 * carry
        direct = into is not None and not missing  # the results' own places: no copy after
        pages = torch.minimum(best + self._successor, limit, out=into[0].view(n, carry, 2) if direct else None)
        score = torch.where((top.values[..., None] > 0).expand(-1, -1, 2), self._carried_score, self._neg_inf,
                            out=into[1].view(n, carry, 2) if direct else None)
        if direct:
            return into
        pages, score = pages.flatten(1), score.flatten(1)
        if missing:  # fewer candidates than pages to carry (a small capacity): the other places carry nothing
            pages = torch.cat([pages, pages.new_zeros(pages.shape[0], missing)], dim=1)
            score = torch.cat([score, score.new_full((score.shape[0], missing), NEG_INF)], dim=1)
        if into is not None:
            into[0].copy_(pages)
            into[1].copy_(score)
            return into
        return pages, score

    # -- the selector's state ------------------------------------------------------------------------------------
    def forget(self) -> None:
        """Tokens were added as a prompt: nothing ranked before them is carried on."""
        self.carried_scores.fill_(NEG_INF)

    def mark(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.carried_pages.clone(), self.carried_scores.clone()

    def restore(self, mark) -> None:
        self.carried_pages.copy_(mark[0])
        self.carried_scores.copy_(mark[1])

    def carry_on(self, rows: torch.Tensor, pages: torch.Tensor, scores: torch.Tensor) -> None:
        """Rows `rows` go on with these carried candidates (`pages`, `scores` `[len(rows), W]`): a verified block's
        last ranking of each."""
        self.carried_pages.index_copy_(0, rows, pages)
        self.carried_scores.index_copy_(0, rows, scores)

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

"""Brute-force oracles for tests: the literal formulas, in float64 where it matters, no shortcuts.

Nothing in production calls these. The PyTorch backend (`torch_backend.py`) and the Triton kernels
are checked against them.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def score_pages_bruteforce(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The literal formula `sum_i max(q_i*kmin_i, q_i*kmax_i)`, max over the group. `[N,G,D]`,`[N,Np,D]` -> `[N,Np]`.

    No forcing, no masking: for tests only.
    """
    q = query.float()[:, :, None, :]  # [N, G, 1, D]
    lo = q * kmin.float()[:, None]
    hi = q * kmax.float()[:, None]
    return torch.maximum(lo, hi).sum(-1).amax(dim=1)


def dense_attention_bruteforce(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Dense attention over `[N, L, D]` keys with a `[N, L]` boolean mask; for tests. Returns `[N, G, D]` (fp32)."""
    logits = torch.einsum("ngd,nld->ngl", query.double(), keys.double()) * scaling
    logits = logits.masked_fill(~allowed[:, None, :], NEG_INF)
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.einsum("ngl,nld->ngd", probs, values.double()).float()



# -- selection oracle ------------------------------------------------------------------------------
# One (sequence, KV head) row at a time, plain loops over pages and query heads, float64, the literal
# formulas of SPEC §2 and of `FlexiCacheConfig`'s selection options. Shared by the selection property
# test and by policy tests; `fc_hf/selection.py` is the production path it checks.

POS_INF = float("inf")


def minmax_bruteforce(keys: torch.Tensor, page_size: int, subpages: int = 1) -> list[list[tuple[list, list]]]:
    """MinMax entries of the full pages of one row's keys `[L, D]`: `out[page][sub] = (kmax, kmin)`, lists of D floats.

    Only full pages have entries (the MinMax entry of a page is written when the page fills).
    """
    rows = keys.tolist()
    sub = page_size // subpages
    out = []
    for page in range(len(rows) // page_size):
        entries = []
        for s in range(subpages):
            start = page * page_size + s * sub
            chunk = rows[start : start + sub]
            entries.append(([max(c) for c in zip(*chunk)], [min(c) for c in zip(*chunk)]))
        out.append(entries)
    return out


def quest_bound_bruteforce(q: list, kmax: list, kmin: list) -> float:
    """`sum_i max(q_i * kmin_i, q_i * kmax_i)` of one query head over one MinMax entry (lists of floats, float64)."""
    return sum(max(qi * lo, qi * hi) for qi, lo, hi in zip(q, kmin, kmax))


def page_scores_bruteforce(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, cfg) -> list[float]:
    """The score of every page of one row under `cfg`'s policy, forced pages at +inf.

    Args:
        query (`torch.Tensor` of shape `[G, D]`): the row's query heads (its GQA group).
        keys (`torch.Tensor` of shape `[L, D]`): every key the row holds, in order (padding included).
        valid (`torch.Tensor` of shape `[L]`, bool): False for padding (tokens the mask hides).
        cfg (`FlexiCacheConfig`): `page_size`, `score_subpages`, `sink_pages`.

    Returns:
        `list[float]` of length `ceil(L / page_size)`. The policy, literally:
        - a page's bound for one query head is the max over its sub-pages' MinMax entries of the Quest
          bound; a page without an entry (the page being filled, not yet full) has all-zero entries,
          so its bound is 0; its score is the max over the group's query heads of the bound;
        - a page with no attendable token scores -inf;
        - forcing, in this order: the last page (the one being filled), then the first `sink_pages` pages starting at
          the row's first attendable page (clamped to the last page; a forced sink page without an attendable token
          gets -inf).
    """
    p, subpages = cfg.page_size, cfg.subpages
    length, dim = keys.shape
    num_pages = -(-length // p)
    entries = minmax_bruteforce(keys, p, subpages)
    zero = [0.0] * dim
    flags = valid.tolist()
    attendable = [any(flags[i * p : (i + 1) * p]) for i in range(num_pages)]
    scores = []
    for page in range(num_pages):
        page_entries = entries[page] if page < len(entries) else [(zero, zero)] * subpages
        bound = max(quest_bound_bruteforce(q, kmax, kmin) for q in query.tolist() for kmax, kmin in page_entries)
        scores.append(bound if attendable[page] else NEG_INF)
    scores[num_pages - 1] = POS_INF
    if cfg.sink_pages:
        first = attendable.index(True) if any(attendable) else 0
        for i in range(cfg.sink_pages):
            page = min(first + i, num_pages - 1)
            scores[page] = POS_INF if attendable[page] else NEG_INF
    return scores


def _page_masses(queries: list, keys: list, valid: list, page_size: int, scaling: float) -> list[list[float]]:
    """Per query head, the softmax mass of each page's attendable tokens (`masses[g][page]`)."""
    num_pages = -(-len(keys) // page_size)
    out = []
    for q in queries:
        logits = [scaling * sum(a * b for a, b in zip(q, k)) for k in keys]
        top = max(x for x, ok in zip(logits, valid) if ok)
        weights = [math.exp(x - top) if ok else 0.0 for x, ok in zip(logits, valid)]
        total = sum(weights)
        out.append([sum(weights[i * page_size : (i + 1) * page_size]) / total for i in range(num_pages)])
    return out


def refine_scores_bruteforce(
    query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scores: list[float], candidates: int, page_size: int,
    scaling: float, carried=(),
) -> list[float]:
    """`refine_pages`: the top-`candidates` pages by `scores` re-scored by their exact attention mass.

    The pages in `carried` (the last ranking's, `carried_bruteforce`) come right after the forced pages (+inf) when the
    candidates are taken, whatever their own score. The mass of a candidate page is, averaged over
    the query heads, the share of the softmax (of scaling * q.k over the attendable tokens of the candidate pages
    only) that falls on its tokens. Forced pages (+inf) stay +inf and pages without an attendable token -inf; pages
    that are not candidates score -inf (the selection is the top K of the result).
    """
    def proposal(i):  # a carried page comes before every page that is not forced, all padding ones included
        return (1, 0.0) if i in carried else (0, scores[i])

    forced = [i for i in range(len(scores)) if scores[i] == math.inf]
    rest = sorted((i for i in range(len(scores)) if scores[i] != math.inf), key=proposal, reverse=True)
    order = (forced + rest)[:candidates]
    flags = valid.tolist()
    token_ok = [flags[i] and (i // page_size) in order for i in range(len(flags))]
    masses = _page_masses(query.tolist(), keys.tolist(), token_ok, page_size, scaling)
    out = [NEG_INF] * len(scores)
    for page in order:
        if math.isinf(scores[page]) and (scores[page] > 0 or page not in carried):
            out[page] = scores[page]
        else:
            out[page] = sum(m[page] for m in masses) / len(masses)
    return out


def carried_bruteforce(refined: list[float], carry: int) -> list[int]:
    """The pages a ranking carries to the next one: of its `carry` candidates of largest exact mass, those whose mass
    is positive and finite (neither forced nor all padding), and the page after each (the last page at most)."""
    best = sorted(range(len(refined)), key=lambda i: refined[i] if not math.isinf(refined[i]) else 0.0,
                  reverse=True)[:carry]
    best = [i for i in best if not math.isinf(refined[i]) and refined[i] > 0]
    return best + [min(i + 1, len(refined) - 1) for i in best]


def top_scores_bruteforce(scores: list[float], k: int) -> list[float]:
    """The `k` largest scores, descending (the selection's scores; which of several tied pages is taken is free)."""
    return sorted(scores, reverse=True)[:k]


def streaming_pages_bruteforce(num_pages: int, k: int, sink: int) -> list[int]:
    """Pages a streaming head (LServe-like baseline) reads: all when at most `k`, else `sink` first + the last `k - sink`."""
    if num_pages <= k:
        return list(range(num_pages))
    return list(range(sink)) + list(range(num_pages - (k - sink), num_pages))


def candidate_mass_bruteforce(
    query: torch.Tensor,
    keys: torch.Tensor,
    allowed: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    scaling: float,
    forced: torch.Tensor,
) -> torch.Tensor:
    """Refinement's ranking key, literally: per query head the softmax over every allowed token of the candidate
    pages, summed per page, averaged over the group; forced (+-inf) candidates keep their score. For tests.

    `query [N, G, D]`, logical `keys [N, L, D]`, `allowed [N, L]` (inside the sequence, not padding), candidate
    `pages [N, C]`, `forced [N, C]` -> `[N, C]` (fp64 inside, fp32 out).
    """
    n, g, _ = query.shape
    c = pages.shape[1]
    out = torch.zeros(n, c, dtype=torch.float64)
    for row in range(n):
        tokens = [int(pg) * page_size + t for pg in pages[row].tolist() for t in range(page_size)]
        ok = torch.tensor([t < allowed.shape[1] and bool(allowed[row, t]) for t in tokens])
        if not ok.any():
            continue
        k = keys[row].double()[torch.tensor(tokens).clamp(max=keys.shape[1] - 1)]  # [C*P, D]
        for head in range(g):
            logits = (k @ query[row, head].double()) * scaling
            probs = torch.softmax(logits.masked_fill(~ok, NEG_INF), dim=0)
            out[row] += probs.view(c, page_size).sum(-1) / g
    return torch.where(torch.isinf(forced.double()), forced.double(), out).float()

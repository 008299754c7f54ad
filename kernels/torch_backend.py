"""The PyTorch backend of FlexiCache's decode step: the production path on a CPU and the reference of the Triton path.

Each function has a fixed-shape contract (no host number that changes from step to step, no host sync), so a step
made of them compiles. They are checked against the brute-force oracles of `bruteforce.py` (which nothing in
production calls) and, through the cache, against dense attention.

Shapes used throughout:
    n  rows (one row = one (sequence, KV head) pair) of a call
    G  query heads per KV head (GQA group size)
    D  head_dim, Dv value dim
    P  tokens per page, S MinMax entries (sub-pages) per page
    E  MinMax entries of a row (pages of the capacity x S)
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
POS_INF = float("inf")


def page_scores(query: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor, subpages: int) -> torch.Tensor:
    """The Quest upper bound of `q . k` over each page, max over the GQA group and the page's sub-pages.

    `max(q_i * kmin_i, q_i * kmax_i)` summed over channels equals `relu(q) . kmax + min(q, 0) . kmin`: one matmul
    against the MinMax entries, in fp32, with `bias` (+inf: a forced page, -inf: a page with no attendable token) added
    inside it.

    Args:
        query (`torch.Tensor` of shape `[n, G, D]`): the decode queries.
        meta (`torch.Tensor` of shape `[n, 2D, E]`, or a list of such blocks whose rows stack to `n`): each entry's
            channel max (first D) then min. Blocks are views of the MinMax cache, read in place (no gather).
        bias (`torch.Tensor` of shape `[n, E]`): added to each entry's bound.
        subpages (`int`): S; a page's score is the max over its S entries.

    Returns:
        `torch.Tensor` of shape `[n, E / S]`, fp32.
    """
    best = quest_bounds(query, meta, bias).amax(dim=1)  # [n, E]: over the group
    # Then over each page's sub-pages: two reductions, each over one dim, are 5-7x faster on a CPU than one over both.
    return best if subpages == 1 else best.view(best.shape[0], -1, subpages).amax(dim=2)


def quest_bounds(query: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Quest bound of every MinMax entry for every query head, fp32: `[n, G, D]`, `[n, 2D, E]` (or row blocks of
    it, `page_scores`) (, `bias [n, E]`) -> `[n, G, E]`, as one matmul `[relu(q), min(q, 0)] @ [kmax; kmin]` per block."""
    q = query.float()
    low, high = _halves(q.device)
    q2 = q[:, :, None, :].clamp(low, high).reshape(*q.shape[:2], -1)  # [relu(q), min(q, 0)] in one broadcast clamp
    if not isinstance(meta, torch.Tensor) and len(meta) == 1:
        meta = meta[0]
    if isinstance(meta, torch.Tensor):
        if bias is None:
            return torch.matmul(q2, meta.float())
        return torch.baddbmm(bias[:, None, :], q2, meta.float())
    out = q2.new_empty(q2.shape[0], q2.shape[1], meta[0].shape[-1])
    start = 0
    for block in meta:
        end = start + block.shape[0]
        if bias is None:
            torch.matmul(q2[start:end], block.float(), out=out[start:end])
        else:
            torch.baddbmm(bias[start:end, None, :], q2[start:end], block.float(), out=out[start:end])
        start = end
    return out


_HALVES: dict = {}


def _halves(device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(low, high) [2, 1]` that clamp a query's copies to its positive then its negative part: made once per device
    when eager; constants of the graph when compiled (a global written while tracing would be a guard to fail)."""
    def make():
        return torch.tensor([[0.0], [NEG_INF]], device=device), torch.tensor([[POS_INF], [0.0]], device=device)

    if torch.compiler.is_compiling():
        return make()
    if device not in _HALVES:
        _HALVES[device] = make()
    return _HALVES[device]


def candidates(scores: torch.Tensor, carried_pages: torch.Tensor | None, carried_scores: torch.Tensor | None,
               count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Refinement's candidates: the `count` best of the page scores `scores [n, pages]`, a carried page
    (`carried_pages [n, W]`, None: none) raised to its carried score `carried_scores [n, W]` where that is higher, in
    page order (the same candidates are then the same ranking whatever raised them) -> `(scores [n, C], pages [n, C])`.
    Of equal scores at the cut `torch.topk` does not say which it takes; the Triton backend's `flexicache::candidates`
    takes the lower pages."""
    if carried_pages is not None:
        scores = scores.scatter_reduce(1, carried_pages, carried_scores, "amax")
    cand_scores, cand = torch.topk(scores, count, dim=-1, sorted=False)
    cand, order = cand.sort(dim=1)
    return cand_scores.gather(1, order), cand


LOGIT_PAGES = 16  # pages per product of `candidate_logits`


def candidate_logits(query: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, scaling: float,
                     page_size: int) -> torch.Tensor:
    """Refinement's logits: `scaling * q . k + bias` of every candidate token, `[n, G, D]`, `[n, C * P, D]` (the
    candidates' keys, page after page), `[n, C * P]` (0 or -inf per token) -> `[n, G, C * P]` (fp32; `page_logits` reads
    the keys and bias in place, the step's attention re-uses the logits). Computed `LOGIT_PAGES` pages per matrix
    product, the last padded: every product has one shape, so a token's logit is the same number whichever other
    candidates it is scored with (a BLAS may round a product's edge columns otherwise), and a verification block's later
    rounds compute only their new candidates' (`PageSelector`)."""
    n, m, d = keys.shape
    g = query.shape[1]
    span = LOGIT_PAGES * page_size
    chunks = -(-m // span)
    pad = chunks * span - m
    if pad:
        keys, bias = torch.nn.functional.pad(keys, (0, 0, 0, pad)), torch.nn.functional.pad(bias, (0, pad))
    q = query.float()[:, None].expand(n, chunks, g, d).reshape(n * chunks, g, d)
    logits = torch.baddbmm(bias.view(n * chunks, 1, span), q, keys.float().view(n * chunks, span, d).transpose(1, 2),
                           alpha=scaling)
    return logits.view(n, chunks, g, span).transpose(1, 2).reshape(n, g, chunks * span)[..., :m]


def page_logits(query: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, near: int, near_k: torch.Tensor,
                near_index: torch.Tensor, full_k: torch.Tensor, tokens: torch.Tensor, seq: torch.Tensor | None,
                scaling: float) -> torch.Tensor:
    """Refinement's logits of pages read where they are: `candidate_logits` of the keys of pages `pages [n, C]` of rows
    `rows [n]` with their token bias -> `[n, G, C, P]` (the Triton backend's `flexicache::page_logits` in one launch).

    Args:
        query (`torch.Tensor` of shape `[n, G, D]`).
        pages (`torch.Tensor` of shape `[n, C]`): page indices.
        rows (`torch.Tensor` of shape `[n]`): each one's row of the full tier.
        near (`int`): the first `near` rows read the near tier `near_k [*, T, D]` at row `near_index[row]` (0: every
            row reads the full tier, which holds the same keys).
        full_k (`torch.Tensor` of shape `[N, T, D]`): the full tier, T = pages of a row x P.
        tokens (`torch.Tensor` of shape `[B, T / P + 1, P]`): the step's token bias (`StepBias.tokens`).
        seq (`torch.Tensor` of shape `[n]` or None): each one's sequence of `tokens` (None: one sequence).
        scaling (`float`): the model's softmax scale.
    """
    n, c = pages.shape
    p = tokens.shape[2]
    per_row = full_k.shape[1] // p

    def gather(tier, first, at):
        return tier.view(-1, p, tier.shape[-1]).index_select(0, torch.add(at, first[:, None], alpha=per_row).view(-1))

    keys = gather(full_k, rows, pages) if not near else gather(near_k, near_index.index_select(0, rows[:near]),
                                                                 pages[:near])
    if near and near < n:
        keys = torch.cat([keys, gather(full_k, rows[near:], pages[near:])])
    at = pages if seq is None else torch.add(pages, seq[:, None], alpha=tokens.shape[1])
    bias = tokens.view(-1, p).index_select(0, at.view(-1)).view(n, c * p)
    return candidate_logits(query, keys.view(n, c * p, -1), bias, scaling, p).view(n, query.shape[1], c, p)


def page_mass(logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Refinement's ranking key: the exact attention mass of each candidate page among the candidates' tokens, from
    their logits `[n, G, C, P]` (`candidate_logits`) and the candidates' page `scores [n, C]` -> `[n, C]`. Per query
    head the softmax over every candidate token, summed per page, averaged over the group. A candidate whose score is
    infinite keeps it (+inf: forced, first; -inf: never attendable, last)."""
    n, g, c, p = logits.shape
    mass = torch.softmax(logits.view(n, g, c * p), dim=-1).view(n, g, c, p).sum(-1).mean(1)
    return torch.where(torch.isinf(scores), scores, mass)


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float,
              softcap: float | None = None) -> torch.Tensor:
    """Decode attention of each row's query heads over its tokens `keys`/`values` with an additive `bias`.

    Args:
        query (`torch.Tensor` of shape `[n, G, D]`).
        keys, values (`torch.Tensor` of shape `[n, M, D]`, `[n, M, Dv]`).
        bias (`torch.Tensor` of shape `[n, M]`, or `[n, G, M]` per query row): 0 where a token may be attended, -inf
            where not.
        scaling (`float`), softcap (`float`, *optional*): `tanh(s / c) * c` on the scaled logits (Gemma-2 style).

    Returns:
        `torch.Tensor` of shape `[n, G, Dv]` in the values' dtype (softmax in fp32).
    """
    bias = bias if bias.dim() == 3 else bias[:, None, :]
    if softcap is None:
        logits = torch.baddbmm(bias.to(keys.dtype), query.to(keys.dtype), keys.transpose(1, 2), alpha=scaling)
    else:
        logits = torch.matmul(query.to(keys.dtype), keys.transpose(1, 2)).float() * scaling
        logits = torch.tanh(logits / softcap) * softcap + bias
    return attention_from_logits(logits, values)


def chosen_attention(logits: torch.Tensor, top: torch.Tensor, pages: torch.Tensor, starts: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """Attention of `m` rows over the pages a refined ranking chose, re-using its logits (the keys are not read again):
    its logits `logits [n >= m, G, C, P]` at the chosen places `top [m, K]`, the values of the chosen pages
    `pages [m, K]` read from the flat tier `values [tokens, Dv]` (pages of P tokens) at page `starts[i] + page`
    -> `[m, G, Dv]` (`attention_from_logits`; the Triton backend's `flexicache::chosen_attention` in one launch)."""
    m, k = top.shape
    g, p = logits.shape[1], logits.shape[3]
    at = (starts[:, None] + pages).view(-1)
    chosen = values.view(-1, p, values.shape[1]).index_select(0, at).view(m, k * p, -1)
    return attention_from_logits(logits[:m].gather(2, top[:, None, :, None].expand(m, g, k, p)).view(m, g, k * p),
                                 chosen)


def attention_from_logits(logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`softmax(logits) @ values` (softmax in fp32): `[n, G, M]`, `[n, M, Dv]` -> `[n, G, Dv]` in the values' dtype."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.matmul(probs.to(values.dtype), values)


def gather_pages(tier: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pages `index [m]` of a tier viewed as `[rows * pages, P, D]` -> `[m, P, D]` (a copy)."""
    return tier.index_select(0, index)


def subpage_minmax(keys: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """The MinMax entry of sub-page `sub` (a `[1]` index) of every row: `keys [n, entries, P/S, D]` -> `[n, 2D, 1]`
    (channel max, then min)."""
    tokens = keys.index_select(1, sub)
    if tokens.device.type == "cpu":  # two reductions: 3x faster than aminmax over a middle dim on a CPU
        low, high = tokens.amin(dim=2), tokens.amax(dim=2)
    else:
        low, high = torch.aminmax(tokens, dim=2)
    return torch.cat([high, low], dim=-1).transpose(1, 2)


def append_token(keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, length: torch.Tensor,
                 full_k: torch.Tensor, full_v: torch.Tensor, meta: torch.Tensor, meta_row: torch.Tensor,
                 win_k: torch.Tensor, win_v: torch.Tensor, win_shift: torch.Tensor, stable_local: torch.Tensor,
                 near_k: torch.Tensor, near_v: torch.Tensor, near_place: torch.Tensor, subpage_len: int) -> None:
    """A decode token's writes, the contract of the Triton backend's one-launch `flexicache::append_token` (the decode
    step's PyTorch path, `fc_hf/decode.py:append`, makes the same writes with indices it shares across layers).

    Args:
        keys, values (`torch.Tensor` of shape `[n, D]`, `[n, Dv]`): the token of each row (row order).
        position, length (`torch.Tensor`, long scalars): where the token goes; the count of tokens, `+= 1`.
        full_k, full_v (`torch.Tensor` of shape `[n, C, D]`, `[n, C, Dv]`): every row's full tier, written at
            `position`.
        meta (`torch.Tensor` of shape `[n, 2D, E]`), meta_row (`[n]`): the MinMax entry of the sub-page of
            `subpage_len` tokens the token falls in, recomputed from that sub-page's tokens (channel max, then min),
            goes to row `meta_row[r]` (the MinMax cache's kind order).
        win_k, win_v (`torch.Tensor` of shape `[N_S + 1, W * P, D]`, ... `Dv]`), win_shift (`[N_S + 1]`), stable_local
            (`[n]`): a stable row (`stable_local < N_S`) also writes its window at flat index
            `win_shift[stable_local] + position`.
        near_k, near_v (`torch.Tensor` of shape `[N_near, C, D]`, ... `Dv]`, or empty), near_place (`[n]`): where
            given, the other rows also write their near tier, row `near_place[r]`.
    """
    n, d = keys.shape
    n_s = win_shift.shape[0] - 1
    rows = torch.arange(n, device=keys.device)
    full_k[rows, position] = keys
    full_v[rows, position] = values
    stable = stable_local < n_s
    slot = win_shift[stable_local] + position
    win_k.view(-1, d)[slot[stable]] = keys[stable]
    win_v.view(-1, values.shape[1])[slot[stable]] = values[stable]
    if near_k.numel():
        near_k[near_place[~stable], position] = keys[~stable]
        near_v[near_place[~stable], position] = values[~stable]
    sub = position // subpage_len
    tokens = full_k.view(n, -1, subpage_len, d)[:, sub]  # [n, subpage_len, D]
    meta[meta_row, :, sub] = torch.cat([tokens.amax(dim=1), tokens.amin(dim=1)], dim=-1)
    length.add_(1)


def carry_out(cand: torch.Tensor, mass: torch.Tensor, page: torch.Tensor, carry: int, score: float,
              pages_out: torch.Tensor, scores_out: torch.Tensor) -> None:
    """What a refined ranking carries into its row's next one (`PageSelector`), part of `choose`'s contract (the
    selector's PyTorch path computes the same with fewer copies).

    Args:
        cand, mass (`torch.Tensor` of shape `[n, C]`): the candidates and their attention mass (+-inf and NaN count
            as 0).
        page (`torch.Tensor`, a scalar or `[n]`): the page being filled, which no carried page passes (a later one is
            carried as it).
        carry (`int`, at most C): the candidates of most mass carried, each with the page after it.
        score (`float`): a carried page's score where its mass is positive (else -inf: nothing carried).
        pages_out, scores_out (`torch.Tensor` of shape `[n, W]`, W >= 2 carry): written: the pairs in order of mass,
            then page 0 and -inf in the places past `2 carry`.
    """
    top = mass.nan_to_num(posinf=0.0, neginf=0.0).topk(carry, dim=-1)
    best = cand.gather(1, top.indices)
    limit = page.view(-1, 1) if page.dim() else page
    pages_out.zero_()
    scores_out.fill_(NEG_INF)
    pages_out[:, : 2 * carry] = torch.minimum(torch.stack([best, best + 1], dim=-1).flatten(1), limit)
    scores_out[:, : 2 * carry] = torch.where(top.values > 0, score, NEG_INF).repeat_interleave(2, dim=1)


def choose(logits: torch.Tensor, scores: torch.Tensor, cand: torch.Tensor, page: torch.Tensor, k: int, carry: int,
           score: float, pages_out: torch.Tensor, scores_out: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refinement's choice from its logits `[n, G, C, P]`, the contract of the Triton backend's one-launch
    `flexicache::choose` (the selector's PyTorch path takes the same steps): the candidates' mass (`page_mass`, their
    page `scores [n, C]`), the K of most mass (`top [n, K]`, their places; `cand.gather(1, top)`, their pages), and,
    with `carry` > 0, the carried candidates written into `pages_out` and `scores_out` (`carry_out`).
    -> `(mass [n, C], top [n, K], pages [n, K])`."""
    mass = page_mass(logits, scores)
    if carry:
        carry_out(cand, mass, page, carry, score, pages_out, scores_out)
    top = torch.topk(mass, k, dim=-1, sorted=False).indices
    return mass, top, cand.gather(1, top)


def move_windows(pages: torch.Tensor, page: torch.Tensor, local: torch.Tensor, rows: torch.Tensor,
                 full_k: torch.Tensor, full_v: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
                 win_pages: torch.Tensor, win_shift: torch.Tensor, win_base: torch.Tensor, win_bias_rows: torch.Tensor,
                 stable_batch: torch.Tensor, promoted: torch.Tensor, num_pages: int, k: int, count: bool) -> None:
    """A re-rank's window moves, the contract of the Triton backend's one-launch `flexicache::move_windows` (the
    decode step's PyTorch path is `fc_hf/tiers.py:move_windows`, in fewer copies).

    Stable rows `local [n]` (`N_S`, the stable tensors' extra row, for a padded place), whose rows are `rows [n]`, take
    the pages `pages [n, <= K]` a ranking chose, the page being filled `page` (a scalar or `[n]`) among them:
    - the window `win_pages[local] [W]`: the pages in page order, the page being filled at position K - 1, a page past
      it (not there yet) none (-1), then at positions K, K + 1, ... the pages it will open;
    - its first K pages' tokens `win_k/win_v[local, : K * P]` from the full tier `full_k/full_v [rows, C, *]` (a
      position without a page reads page 0: its tokens are masked);
    - `win_shift[local] = win_base[local] + (K - 1 - page) * P`; `win_bias_rows[local]`: each window page's row in the
      token bias, `seq * (pages + 1) + page`, no page or one past the capacity the null page `pages`;
    - `count`: `promoted += ` the present pages the old window did not hold, over the real stable rows.
    """
    n, w, p = pages.shape[0], win_pages.shape[1], full_k.shape[1] // num_pages
    at = page.view(-1, 1) if page.dim() else page
    if pages.shape[1] < k:
        filler = torch.arange(num_pages, num_pages + k - pages.shape[1], device=pages.device)
        pages = torch.cat([pages, filler.expand(n, -1)], dim=1)
    pages = pages.sort(dim=1).values
    pages = torch.where(pages == at, pages[:, k - 1 :], pages)
    pages[:, k - 1] = page
    present = pages <= at
    later = (at + torch.arange(1, w - k + 1, device=pages.device)).expand(n, -1)
    window = torch.cat([torch.where(present, pages, -1), later], dim=1)
    if count:
        held = (window[:, :k, None] == win_pages[local][:, None, :]).any(-1)
        promoted += (present & ~held & (local < win_pages.shape[0] - 1)[:, None]).sum()
    tokens = ((pages * present)[:, :, None] * p + torch.arange(p, device=pages.device)).view(n, -1)
    win_k[local, : k * p] = full_k[rows[:, None], tokens]
    win_v[local, : k * p] = full_v[rows[:, None], tokens]
    win_pages[local] = window
    win_shift[local] = win_base[local] + (k - 1 - page) * p
    seq = stable_batch[local][:, None]
    win_bias_rows[local] = seq * (num_pages + 1) + window.clamp(-1, num_pages).remainder(num_pages + 1)

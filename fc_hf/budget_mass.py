"""Budget by attention mass (`FlexiCacheConfig.budget_mass`, issue 32): a variable number of pages per head.

Choice. Refinement already computes, for each ranked row (one (sequence, KV head)), the exact attention mass of each
of its C candidate pages among the candidates (`selection.PageSelector._refine`). With `budget_mass=p` a row keeps
the forced pages (sink, recent window, page being filled) and then candidates in order of mass until the kept mass
reaches p: the smallest set holding the forced pages whose mass among the candidates is >= p. Its size is clamped to
`[mass_min_pages, mass_max_pages]` (and to C). `choose_by_mass` does that for all rows at once.

Representation: a selection stays one `[N, W]` tensor per head group, padded per row with -1 after the row's pages
(valid entries first), W the widest row of that ranking (CPU) or the ceiling (CUDA, where the width would cost a
device sync per ranking); a row's count is its number of entries >= 0. Chosen over alternatives because
- every consumer already takes `[N, M]` page lists: -1 entries are the "unused entry" the decode kernels and the
  PyTorch reference already mask (`torch_backend.token_mask`, the Triton kernel's `pidx >= 0`), and the tier move's
  plan (`torch_backend.promotion_plan`) already treats -1 as an empty entry, so a stable head's set can grow or shrink
  between re-ranks with the same swap map (promoted pages beyond the evicted slots take new slots, evicted ones beyond
  the promoted are freed);
- memory stays bounded by the ceiling: at most `mass_max_pages` + the pages created since the last re-rank are
  resident per stable row, as with K today;
- buckets (groups of rows by size) would split a group's one launch into several and re-split at every ranking;
  ragged (CSR) lists would need new kernels and a new tier plan.
Cost of padded entries: the Triton decode kernel takes per-row counts (valid entries first) and stops each row at its
count, so padded entries cost nothing there. The PyTorch path reads (or gathers) and masks up to the group's widest
row (-1 entries point at the null block); that is why the width is trimmed to the widest row on the CPU.

What differs from the fixed budget (K pages) path, only with variable pages (`budget_mass` or `budget_split="mass"`):
the decode's page lists carry -1 entries (so the PyTorch path masks by `token_mask`, not the in-range bias table;
there a ranking's list keeps its -1 entries before the pages opened since, the order of the in-place layout, whose
-1 positions are zero pages outside the table: `PagedKV.arrange_rows(holes=True)`; the Triton path gets valid
entries first and per-row counts), and a group that ranks may hold more than K pages. Without them none of this
code runs.
"""

from __future__ import annotations

import torch


def choose_by_mass(cand: torch.Tensor, mass: torch.Tensor, key: torch.Tensor, p: float, lo: int, hi: int,
                   trim: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The smallest set of candidates per row reaching mass `p`, forced candidates first, clamped to `[lo, hi]`.

    Args:
        cand (`torch.Tensor` of shape `[N, C]`): candidate pages (logical indices).
        mass (`torch.Tensor` of shape `[N, C]`): each candidate's exact attention mass among the candidates, mean over
            the group (>= 0; 0 for a page with nothing attendable), fp32.
        key (`torch.Tensor` of shape `[N, C]`): the ranking key, +inf for forced candidates, -inf for all-padding ones,
            else the mass (as refinement ranks them).
        p (`float`): the mass to reach, in (0, 1]; 1.0 keeps every candidate (up to `hi`).
        lo, hi (`int`): floor and ceiling of pages per row (forced pages count).
        trim (`bool`): width = the widest row (else `min(hi, C)`, no device sync).

    Returns:
        `(sel [N, W], order [N, W], counts [N])`: the chosen pages, valid entries first (by descending key), -1 after a
        row's `counts`; `order` their columns among the candidates (-1 likewise).
    """
    n, c = cand.shape
    key_sorted, order = torch.sort(key, dim=1, descending=True, stable=True)
    forced = torch.isposinf(key_sorted).sum(1)
    if p >= 1.0:
        need = torch.full((n,), c, dtype=torch.long, device=cand.device)
    else:
        m = mass.gather(1, order)
        before = torch.cumsum(m, dim=1) - m  # mass kept before each candidate (masses >= 0: non-decreasing)
        need = (before < p).sum(1)  # the shortest prefix whose mass reaches p
    counts = torch.maximum(need, forced).clamp(min=min(lo, c), max=min(hi, c))
    return _take(cand, order, counts, min(hi, c), trim)


def choose_counts(cand: torch.Tensor, key: torch.Tensor, counts: torch.Tensor, hi: int,
                  trim: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`counts [N]` candidates per row by descending `key` (forced ones, at +inf, first), as `choose_by_mass` returns
    them; a row's count is raised to its forced candidates and cut to the candidates (`budget_split="mass"`)."""
    c = cand.shape[1]
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    counts = torch.maximum(counts.to(cand.device), torch.isposinf(key).sum(1)).clamp(max=c)
    return _take(cand, order, counts, min(hi, c), trim)


def _take(cand: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, most: int, trim: bool):
    """The first `counts` columns of `order` per row: `(sel, order, counts)`, -1 past a row's count; width the widest
    row (`trim`) or `most`."""
    width = int(counts.max()) if trim and cand.shape[0] else most
    order = order[:, :width]
    pad = torch.arange(width, device=cand.device)[None, :] >= counts[:, None]
    sel = cand.gather(1, order).masked_fill(pad, -1)
    return sel, order.masked_fill(pad, -1), counts


class MassSplit:
    """`budget_split="mass"`: the model's pages, K per ranked head, split between its heads by attention mass.

    At the first decode step after a prompt every ranked head group ranks and keeps K pages per head, as "even" does,
    and reports each row's ranking keys among its candidates (`report`: the exact mass among the candidates, +inf for
    forced pages). Once every ranked group has reported, `allocate` gives every ranked head of a sequence
    its count for the rankings after: the forced pages and the floor first, then the N - (those) candidates of largest
    mass over all the sequence's heads (N = K x ranked heads; no head past the ceiling or its candidates). One
    threshold on mass thus decides every head's count: a head whose attention sits on a few pages gives pages to one
    whose attention is spread. Masses are comparable across heads: each row's sum to 1 over its candidates. The
    average stays K per ranked head at every ranking (below it only where the candidates run out; above it only
    where forced pages and floors alone exceed N).

    A multi-token append (a new prompt, a prefill chunk, a turn) forgets the split (`reset`); the next first decode
    step measures again. Rows are `b * heads + h` in each group (a sequence's rows share its N)."""

    def __init__(self, pages_per_head: int, lo: int, hi: int):
        self.k, self.lo, self.hi = pages_per_head, lo, hi
        # The ranked groups' selectors (`join`); each holds its rows' counts as `split_counts` (None: K each), so a
        # copy of the cache (`copy.deepcopy`) carries its own split with its own selectors.
        self.members: list = []
        self.reports: dict[int, tuple[torch.Tensor, int]] = {}  # member index -> (keys [rows, C], heads)

    def join(self, selector) -> None:
        selector.split_index, selector.split_counts = len(self.members), None
        self.members.append(selector)

    def reset(self) -> None:
        self.reports = {}
        for member in self.members:
            member.split_counts = None

    def report(self, selector, key: torch.Tensor, heads: int) -> None:
        """`key [rows, C]`: a ranked group's candidates' keys at the first decode step (`heads` KV heads per sequence).
        The last group to report allocates every member's counts."""
        self.reports[selector.split_index] = (key, heads)
        if len(self.reports) == len(self.members):
            for index, counts in self.allocate(self.reports).items():
                self.members[index].split_counts = counts
            self.reports = {}

    def allocate(self, reports: dict) -> dict[int, torch.Tensor]:
        """Each reporter's counts `[rows]` (see the class docstring), by member index."""
        parts, meta = [], []
        for owner, (key, heads) in reports.items():
            rows, c = key.shape
            batch = rows // heads
            ranked = torch.sort(key.float(), dim=1, descending=True).values
            forced = torch.isposinf(ranked).sum(1)
            most = min(self.hi, c)
            base = torch.maximum(forced, torch.full_like(forced, min(self.lo, c))).clamp(max=most)
            col = torch.arange(c, device=key.device)[None, :]
            # Candidates a head may add: past its base, below its ceiling; all-padding ones (-inf) last of those.
            extra = torch.where((col >= base[:, None]) & (col < most),
                                ranked.clamp(min=torch.finfo(torch.float32).min), ranked.new_tensor(float("-inf")))
            parts.append(extra.view(batch, heads * c))
            meta.append((owner, batch, heads, c, base))
        values = torch.cat(parts, dim=1)  # [B, all ranked heads' candidates]
        total = sum(heads for _, _, heads, _, _ in meta)
        base_sum = sum(base.view(batch, heads).sum(1) for _, batch, heads, _, base in meta)  # [B]
        left = (self.k * total - base_sum).clamp(min=0)
        order = torch.sort(values, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(values.shape[1], device=values.device)
                                                .expand_as(order))
        taken = (rank < left[:, None]) & torch.isfinite(values)  # -inf: not a candidate a head may add
        out, start = {}, 0
        for owner, batch, heads, c, base in meta:
            mine = taken[:, start : start + heads * c].reshape(batch * heads, c)
            out[owner] = base + mine.sum(1)
            start += heads * c
        return out


def with_pages_since(sel: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """`sel [N, W]` (valid entries first, -1 after) followed by pages `[start, end)` in every row, still valid first.

    `[N, W + end - start]`: row r is its valid entries of `sel`, then `start .. end - 1`, then -1."""
    n, w = sel.shape
    s = end - start
    if s <= 0:
        return sel
    counts = (sel >= 0).sum(1, keepdim=True)  # [N, 1]
    j = torch.arange(w + s, device=sel.device)[None, :]
    ext = torch.cat([sel, sel.new_full((n, s), -1)], dim=1)
    since = (start + j - counts).to(sel.dtype)
    return torch.where(j < counts, ext, torch.where(j < counts + s, since, sel.new_full((), -1)))


def entry_counts(pages: torch.Tensor) -> torch.Tensor:
    """Per-row count of a valid-first page list `[N, M]` (entries >= 0), int32 `[N]`."""
    return (pages >= 0).sum(1, dtype=torch.int32)

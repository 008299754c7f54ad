"""The PyTorch backend of FlexiCache's kernels: the production path on a CPU (and wherever Triton is not used).

The Triton kernels (`score.py`, `decode.py`) are tested against these functions; both are tested
against the brute-force oracles in `bruteforce.py`, which nothing in production calls. Written
without Python loops over heads or pages: every function works on all rows (one row = one
(sequence, KV head) pair) at once.

Shapes used throughout:
    N  rows = batch * KV heads of one head group
    G  query heads per KV head (GQA group size)
    D  head_dim
    S  slots in a page pool (slot 0 is the shared, all-zero null block)
    P  tokens per page
"""

from __future__ import annotations

import functools

import torch

NEG_INF = float("-inf")
POS_INF = float("inf")


def pack_minmax(kmax: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    """Interleave page max/min keys as one `[..., 2D]` tensor so scoring is one matmul."""
    return torch.cat([kmax, kmin], dim=-1)


def bounds_per_head(query: torch.Tensor, meta: torch.Tensor, entries: int) -> torch.Tensor:
    """Quest bound of the first `entries` metadata entries for every query head, fp32.

    `[N, G, D]`, `[N, >=E, 2D]` (packed `[kmax, kmin]`) -> `[N, G, E]`: `relu(q).kmax + min(q,0).kmin` as one matmul.
    """
    q = query.float()
    if torch.is_grad_enabled() and q.requires_grad:  # out= below does not record autograd
        q2 = torch.cat([q.clamp(min=0), q.clamp(max=0)], dim=-1)
    else:  # the same two clamps written straight into one [N, G, 2D] buffer: no concatenation op
        d = q.shape[-1]
        q2 = q.new_empty(*q.shape[:-1], 2 * d)
        torch.clamp(q, min=0, out=q2[..., :d])
        torch.clamp(q, max=0, out=q2[..., d:])
    return torch.matmul(q2, meta[:, :entries].float().transpose(1, 2))


def score_pages(
    query: torch.Tensor,
    meta: torch.Tensor,
    num_pages: int,
    page_valid: torch.Tensor | None = None,
    subpages: int = 1,
    sink_pages: int = 0,
) -> torch.Tensor:
    """Quest upper bound of `q . k` over each page, max-reduced over each GQA group.

    `max(q_i*kmin_i, q_i*kmax_i)` summed over channels equals `relu(q).kmax + min(q,0).kmin`, which
    is one matmul against the packed metadata. Scores are computed in fp32. The last page (the one
    being filled) is forced in with +inf; pages marked invalid (all padding) get -inf.

    Args:
        query (`torch.Tensor` of shape `[N, G, D]`): decode queries, one row per (sequence, KV head).
        meta (`torch.Tensor` of shape `[N, Pcap, 2D]`): packed `[kmax, kmin]` per page; only the first
            `num_pages` pages are read.
        num_pages (`int`): pages that exist (the last one may be partially filled).
        page_valid (`torch.Tensor` of shape `[N, num_pages]`, *optional*): False for pages that hold
            no attendable token.
        subpages (`int`, *optional*, defaults to 1): MinMax entries per page (`meta` holds `S` per page); a page's
            bound is the max of its sub-pages' (one reduction over the group and the sub-pages together).
        sink_pages (`int`, *optional*, defaults to 0): leading pages forced in with +inf, without `page_valid`
            only (under padding the sink starts at each row's first real page: `force_sink_pages`).

    Returns:
        `torch.Tensor` of shape `[N, num_pages]`, fp32.
    """
    bounds = bounds_per_head(query, meta, num_pages * subpages)  # [N, G, Np*S]
    # The group max, then the sub-page max (a max is exact in any order): one reduction over the two non-adjacent
    # dims at once is 3-6x slower on a CPU than these two (33 vs 9 us for 3 query heads x 2,048 entries).
    scores = bounds.amax(dim=1)  # [N, Np*S]
    if subpages > 1:
        scores = scores.view(scores.shape[0], num_pages, subpages).amax(dim=-1)
    if page_valid is not None:
        scores = scores.masked_fill(~page_valid, NEG_INF)
        scores[:, num_pages - 1] = POS_INF
        return scores
    # The sink and the page being filled in one fill.
    return scores.index_fill_(1, forced_pages_index(num_pages, sink_pages, scores.device), POS_INF)


@functools.lru_cache(maxsize=16)
def _forced_pages_index(num_pages: int, sink_pages: int, device: torch.device, inference: bool) -> torch.Tensor:
    sink = min(max(int(sink_pages), 0), num_pages - 1)
    return torch.tensor([*range(sink), num_pages - 1], device=device)


def forced_pages_index(num_pages: int, sink_pages: int, device) -> torch.Tensor:
    """The pages a ranking without padding always keeps, `[0, sink_pages) + [num_pages - 1]`, as an index tensor
    built once per page count (an index of a few entries would otherwise be a host-to-device copy per call)."""
    return _forced_pages_index(num_pages, sink_pages, torch.device(device), torch.is_inference_mode_enabled())


def force_sink_pages(scores: torch.Tensor, sink_pages: int, page_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Force each row's first `sink_pages` attendable pages into the selection (score +inf), in place.

    The Quest bound misses attention sinks: the first tokens draw a large share of attention from
    most queries with keys that do not stand out channel by channel. Under left padding the sink is
    the first page holding a real token, so the forced pages start there; all-padding pages stay -inf.

    Args:
        scores (`torch.Tensor` of shape `[N, Np]`): page scores from `score_pages`.
        sink_pages (`int`): how many leading pages to force (0: leave scores as they are).
        page_valid (`torch.Tensor` of shape `[N, Np]`, *optional*): False for all-padding pages.

    Returns:
        `scores`, modified in place.
    """
    num_pages = scores.shape[-1]
    sink = min(int(sink_pages), num_pages)
    if sink <= 0:
        return scores
    if page_valid is None:
        scores[:, :sink] = POS_INF
        return scores
    first = page_valid.to(torch.int8).argmax(dim=1, keepdim=True)  # first attendable page per row
    idx = (first + torch.arange(sink, device=scores.device)).clamp_(max=num_pages - 1)
    forced = torch.where(page_valid.gather(1, idx), POS_INF, NEG_INF).to(scores.dtype)
    return scores.scatter_(1, idx, forced)


def append_token(keys: torch.Tensor, values: torch.Tensor, heads: torch.Tensor | None, slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, offset: int) -> None:
    """Write one token per row: `k_pool[slots[b*Hg + i], offset] = keys[b, heads[i]]` (and the same for values).

    `keys [B, H, D]`, `values [B, H, Dv]` (any strides), `heads [Hg]` the group's heads in row order (None: all
    H), `slots [B * Hg]`. The reference of `append.append_token_triton`. A contiguous source (one group holding
    every head) is one `index_copy_` per pool; a span of a batch's heads is written as it lies, without a copy
    into rows first."""
    for pool, src in ((k_pool, keys), (v_pool, values)):
        if heads is not None:
            src = src.index_select(1, heads)
        if src.is_contiguous():
            pool.select(1, offset).index_copy_(0, slots, src.view(-1, src.shape[-1]))
        else:
            pool.select(1, offset).index_put_((slots.view(src.shape[0], src.shape[1]),), src)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the top-`k` pages per row (all pages when there are at most `k`). `[N, Np]` -> `[N, min(k, Np)]`."""
    num_pages = scores.shape[-1]
    if num_pages <= k:
        return torch.arange(num_pages, device=scores.device).expand(scores.shape[0], num_pages).contiguous()
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def past_end_bias(seq_len: int, page_size: int, device, dtype=torch.float32) -> torch.Tensor:
    """`[ceil(seq_len / P), P]`: -inf at the positions of each page at or past `seq_len` (only the last page has
    any), 0 elsewhere. Row `p` of it, added to page `p`'s logits, masks the tokens a sequence of `seq_len` tokens
    does not have; added inside the logits' matmul (`baddbmm`), it costs no extra op."""
    pages = -(-seq_len // page_size)
    past = torch.arange(pages * page_size, device=device) >= seq_len
    return torch.zeros(pages * page_size, device=device, dtype=dtype).masked_fill_(past, NEG_INF).view(pages, page_size)


def masked_logits(query: torch.Tensor, keys: torch.Tensor, pages: torch.Tensor, seq_len: int, scaling: float,
                  workspace: "GatherWorkspace | None" = None, token_valid: torch.Tensor | None = None,
                  rows_per_batch: int = 1) -> torch.Tensor:
    """`scaling * q.k` of the tokens of pages of the sequence, positions past `seq_len` (and padding) at -inf.

    `query [N, G, D]`, `keys [N, M*P, D]` (the tokens of `pages [N, M]`, every entry in `[0, ceil(seq_len / P))`)
    -> `[N, G, M*P]` in the keys' dtype: one lookup of the pages' rows of a bias table and one `baddbmm` that
    scales and masks as it multiplies. Without `token_valid` the table is `past_end_bias` (shared by all calls of
    one length through `workspace`); with it (`[B, L]`, True = attend; row n is sequence n // `rows_per_batch`),
    `padding_bias`, one row per (sequence, page), shared by all calls of one step through `workspace`, and the
    lookup adds each row's sequence offset first (three ops).
    """
    n, m = pages.shape
    page_size = keys.shape[1] // m
    if token_valid is None:
        table = (workspace.past_end_bias(seq_len, page_size, keys.device, keys.dtype) if workspace is not None
                 else past_end_bias(seq_len, page_size, keys.device, keys.dtype))
        index = pages.reshape(-1)
    else:
        table = (workspace.padding_bias(token_valid, seq_len, page_size, keys.dtype) if workspace is not None
                 else padding_bias(token_valid, seq_len, page_size, keys.dtype))
        pages_total = -(-seq_len // page_size)
        first = (workspace.row_offsets(n, rows_per_batch, pages_total, pages.device) if workspace is not None
                 else row_offsets(n, rows_per_batch, pages_total, pages.device))
        index = (pages + first).reshape(-1)
    bias = table.index_select(0, index).view(n, 1, m * page_size)
    return torch.baddbmm(bias, query.to(keys.dtype), keys.transpose(1, 2), alpha=scaling)


def row_offsets(rows: int, rows_per_batch: int, pages: int, device) -> torch.Tensor:
    """`[rows, 1]`: each row's first row in a `padding_bias` table of `pages` pages per sequence."""
    return (torch.arange(rows, device=device) // rows_per_batch * pages)[:, None]


def padding_bias(token_valid: torch.Tensor, seq_len: int, page_size: int, dtype=torch.float32) -> torch.Tensor:
    """`[B * ceil(seq_len / P), P]`: row `b * pages + p` is 0 at the positions of page `p` that sequence `b` may
    attend (`token_valid [B, L]` True and inside `seq_len`) and -inf elsewhere (padding, past the end)."""
    b = token_valid.shape[0]
    pages = -(-seq_len // page_size)
    ok = torch.zeros(b, pages * page_size, dtype=torch.bool, device=token_valid.device)
    ok[:, :seq_len] = token_valid[:, :seq_len]
    bias = torch.zeros(b * pages, page_size, dtype=dtype, device=token_valid.device)
    return bias.masked_fill_(~ok.view(b * pages, page_size), NEG_INF)


def candidate_logits(query: torch.Tensor, keys: torch.Tensor, pages: torch.Tensor, seq_len: int, scaling: float,
                     token_valid: torch.Tensor | None = None, rows_per_batch: int = 1,
                     workspace: "GatherWorkspace | None" = None):
    """fp32 logits `[N, G, C*P]` of the keys `[N, C, P, D]` of candidate pages `[N, C]` (pages of the sequence),
    scaled, with positions past `seq_len` and padding (`token_valid [B, L]`, optional, `rows_per_batch` rows per
    sequence) at -inf, both as one bias inside the matmul (`masked_logits`)."""
    n, c, p, d = keys.shape
    flat = keys.view(n, c * p, d).float()
    return masked_logits(query.float(), flat, pages, seq_len, scaling, workspace, token_valid, rows_per_batch)


def mass_from_logits(logits: torch.Tensor, page_size: int, forced: torch.Tensor, padded: bool) -> torch.Tensor:
    """Attention mass of each candidate page among all candidates' tokens, mean over the group, `[N, C]` fp32.

    `logits [N, G, C*P]` (`candidate_logits`); candidates whose `forced` score `[N, C]` is +-inf get that score (kept
    first / dropped last by a top-K). `padded`: a row may have no attendable token (its NaN softmax becomes 0)."""
    probs = torch.softmax(logits, dim=-1)
    if padded:
        probs = probs.nan_to_num(0.0)
    n, g, _ = logits.shape
    mass = probs.view(n, g, -1, page_size).sum(-1).mean(1)
    return torch.where(torch.isinf(forced), forced, mass)


def candidate_mass(query: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, seq_len: int,
                   scaling: float, forced: torch.Tensor, token_valid: torch.Tensor | None = None,
                   rows_per_batch: int = 1, table: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention mass `[N, C]` of candidate pages, mean over the group (the refinement's ranking key).

    The reference of the Triton kernels (`refine.candidate_mass_triton`, same contract). `query [N, G, D]`;
    the candidates `pages [N, C]` are pages of the sequence, their keys at `slots [N, C]` of `k_pool [S, P, D]`;
    `forced [N, C]` fp32 scores (+-inf: forced / all padding); `token_valid [B, L]` padding mask with
    `rows_per_batch` rows per sequence; `table [N, Pcap]` (the block table) stands in for `slots` when they are
    None. fp32 whatever the input dtype."""
    if slots is None:
        slots = table.gather(1, pages)
    n, c = slots.shape
    keys = k_pool.index_select(0, slots.reshape(-1)).view(n, c, *k_pool.shape[1:])
    logits = candidate_logits(query, keys, pages, seq_len, scaling, token_valid, rows_per_batch)
    return mass_from_logits(logits, k_pool.shape[1], forced, token_valid is not None)


def token_mask(
    page_idx: torch.Tensor,
    page_size: int,
    seq_len: int,
    token_valid: torch.Tensor | None,
    rows_per_batch: int,
) -> torch.Tensor:
    """Which gathered tokens may be attended: inside the sequence, on a real page, not padding.

    Args:
        page_idx (`torch.Tensor` of shape `[N, M]`): logical page per selected entry, -1 for unused entries.
        page_size (`int`): tokens per page.
        seq_len (`int`): logical length of every sequence in the batch.
        token_valid (`torch.Tensor` of shape `[B, L]`, *optional*): padding mask, True = attend.
        rows_per_batch (`int`): rows per sequence (KV heads in the group); row n belongs to sequence n // rows_per_batch.

    Returns:
        `torch.Tensor` of shape `[N, M * page_size]`, bool.
    """
    n, m = page_idx.shape
    pos = (page_idx[:, :, None] * page_size + torch.arange(page_size, device=page_idx.device)).view(n, m * page_size)
    # An unused entry (-1) maps to negative positions, so one range check also drops it.
    ok = (pos >= 0) & (pos < seq_len)
    if token_valid is not None:
        if rows_per_batch == 1:  # already one mask row per row: its first N rows, a view
            tv = token_valid[:n]
        else:
            tv = token_valid[torch.arange(n, device=page_idx.device) // rows_per_batch]  # [N, L]
        ok &= tv.gather(1, pos.clamp(0, tv.shape[1] - 1))
    return ok


class GatherWorkspace:
    """Gather buffers reused across the layers and steps of one cache.

    A fresh multi-MB tensor per layer and step is mmap'ed and page-faulted by glibc every time, which
    made the CPU step ~2.5x slower at batch 4 / budget 2048. Each cache owns one workspace (so two
    caches decoding in two threads never share a buffer) and drops it on `release()`.
    """

    def __init__(self):
        self._buffers: dict = {}  # key -> tensor (only tensors: `nbytes` and `clear` see all of them)
        self._stamps: dict = {}  # key -> what a cached table was built for (its length, its mask)

    def __deepcopy__(self, memo):
        """A copied cache gets buffers of its own (none yet): two caches never share a workspace."""
        return GatherWorkspace()

    def gather(self, pool: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
        """`pool[flat]` written into a reused buffer; valid until the next call with the same `name`."""
        # Inference-mode tensors cannot be written outside inference mode (and vice versa): one buffer each.
        key = (name, pool.device, pool.dtype, tuple(pool.shape[1:]), torch.is_inference_mode_enabled())
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < flat.numel():
            buf = pool.new_empty((flat.numel(), *pool.shape[1:]))
            self._buffers[key] = buf
        out = buf[: flat.numel()]
        torch.index_select(pool, 0, flat, out=out)
        return out

    def past_end_bias(self, seq_len: int, page_size: int, device, dtype=torch.float32) -> torch.Tensor:
        """`past_end_bias(seq_len, page_size, device, dtype)`, shared by every layer and head group of a decode step.

        One table is kept and updated in place when the length changes: only its last row has -inf entries, so a
        new length rewrites that row from a table of the `P + 1` possible rows (one copy; one more to clear the
        previous last row when a page is opened) instead of building the table anew (four ops) at every step.
        The returned view is valid until the next call with another length."""
        key = ("past_end_bias", page_size, torch.device(device), dtype, torch.is_inference_mode_enabled())
        rows_key = key + ("rows",)  # row j: -inf from position j on (the last page holding j tokens)
        table = self._buffers.get(key)
        pages = -(-seq_len // page_size)
        if pages == 0:
            return past_end_bias(seq_len, page_size, device, dtype)
        if table is None or table.shape[0] < pages:
            ends = torch.arange(page_size + 1, device=device)[:, None]
            rows = torch.zeros(page_size + 1, page_size, device=device, dtype=dtype)
            self._buffers[rows_key] = rows.masked_fill_(torch.arange(page_size, device=device)[None, :] >= ends, NEG_INF)
            table = self._buffers[key] = torch.zeros(max(2 * pages, 64), page_size, device=device, dtype=dtype)
            old_length = None
        else:
            old_length = self._stamps[key]
        if old_length != seq_len:
            old_pages = None if old_length is None else -(-old_length // page_size)
            if old_pages is not None and old_pages != pages:  # the old last page is full now: no -inf left in it
                table[old_pages - 1].zero_()
            table[pages - 1].copy_(self._buffers[rows_key][seq_len - (pages - 1) * page_size])
            self._stamps[key] = seq_len
        return table[:pages]

    def padding_bias(self, token_valid: torch.Tensor, seq_len: int, page_size: int, dtype=torch.float32):
        """`padding_bias(token_valid, seq_len, page_size, dtype)`, built once per step: every layer and head group
        gets the same padding mask object (`FlexiCache.padding_info`) and length, so only the latest is kept."""
        key = ("padding_bias", page_size, token_valid.device, dtype, torch.is_inference_mode_enabled())
        stamp = self._stamps.get(key)
        if stamp is None or stamp[0] is not token_valid or stamp[1] != seq_len:
            self._buffers[key] = padding_bias(token_valid, seq_len, page_size, dtype)
            self._stamps[key] = (token_valid, seq_len)
        return self._buffers[key]

    def row_offsets(self, rows: int, rows_per_batch: int, pages: int, device) -> torch.Tensor:
        """`row_offsets(rows, rows_per_batch, pages, device)`, kept until the page count changes (one per group size)."""
        key = ("row_offsets", rows, rows_per_batch, torch.device(device), torch.is_inference_mode_enabled())
        if self._stamps.get(key) != pages:
            self._buffers[key] = row_offsets(rows, rows_per_batch, pages, device)
            self._stamps[key] = pages
        return self._buffers[key]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values() if isinstance(b, torch.Tensor))

    def clear(self) -> None:
        self._buffers.clear()
        self._stamps.clear()


def sparse_decode_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    page_idx: torch.Tensor,
    seq_len: int,
    scaling: float,
    token_valid: torch.Tensor | None = None,
    rows_per_batch: int = 1,
    softcap: float | None = None,
    workspace: GatherWorkspace | None = None,
    in_range: bool = False,
    logits: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    row_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention of each row's query heads over the tokens of its selected pages.

    One `index_select` gathers the pages of all rows at once; the GQA group's query heads are
    packed as rows of one batched matmul. Softmax runs in fp32 over exactly the attendable tokens.

    Args:
        query (`torch.Tensor` of shape `[N, G, D]`): one decode query per query head.
        k_pool, v_pool (`torch.Tensor` of shape `[S, P, D]`): page pools.
        slots (`torch.Tensor` of shape `[N, M]`): pool slot of each selected page (0 = null block).
        page_idx (`torch.Tensor` of shape `[N, M]`): logical index of each selected page, -1 = unused entry.
        seq_len (`int`): logical sequence length (tokens at positions >= seq_len are masked).
        scaling (`float`): the model's softmax scale.
        token_valid (`torch.Tensor` of shape `[B, L]`, *optional*): padding mask, True = attend.
        rows_per_batch (`int`): rows per sequence, to map a row to its padding-mask row.
        softcap (`float`, *optional*): logit soft-capping (Gemma-2 style), `tanh(s / c) * c`.
        workspace (`GatherWorkspace`, *optional*): reused gather buffers; None allocates fresh ones.
        in_range (`bool`, *optional*, defaults to False): the caller guarantees every `page_idx` entry is a page
            of the sequence, in `[0, ceil(seq_len / P))` (no -1 entries). Then, without `softcap`, the mask is one
            lookup in a bias table of the positions past `seq_len` (and, with `token_valid`, of the padding; shared
            by all calls of one step through `workspace`) added inside the scaled matmul (`masked_logits`); without
            `token_valid` every row has an attendable token, so no NaN from an empty row needs clearing (a NaN or
            inf in the inputs then propagates, as in dense attention). Same result for finite inputs.
        logits (`torch.Tensor` of shape `[N, G, M*P]`, *optional*): the scaled fp32 logits of exactly these pages'
            tokens, in this order, with every non-attendable position already at -inf (the ranking computed them:
            `fc_hf.selection.PageSelector` with refinement). The keys are then not read; not with `softcap`.
        out (`torch.Tensor` of shape `[N, G, Dv]`, *optional*): written with the result (e.g. a span of a layer's
            output, so the caller need not copy it there) and returned.
        table (`torch.Tensor` of shape `[N, Pcap]`, *optional*): the block table, to look the slots up from when
            `slots` is None (the Triton kernel does so in-kernel).
        row_kv (`tuple`, *optional*): `(keys [N, M*P, D], values [N, M*P, Dv])`, the pages' tokens already laid out
            per row (views of the pools: `PagedKV.row_view`); then nothing is gathered and `slots` is not read.

    Returns:
        `torch.Tensor` of shape `[N, G, D]` in the query's dtype.
    """
    n, m = page_idx.shape
    page_size, dim = k_pool.shape[1], k_pool.shape[2]
    if row_kv is None:
        if slots is None:
            slots = table.gather(1, page_idx.clamp(min=0)).masked_fill_(page_idx < 0, 0)  # unused entries: null block
        flat = slots.reshape(-1)
        values = v_pool.index_select(0, flat) if workspace is None else workspace.gather(v_pool, flat, "v")
        values = values.view(n, m * page_size, v_pool.shape[2])
    else:
        values = row_kv[1]
    if logits is not None:  # computed (and masked) by the ranking: the keys are not read again
        if softcap is not None:
            raise ValueError("precomputed logits cannot be soft-capped after masking; pass logits=None with softcap.")
    else:
        if row_kv is not None:
            keys = row_kv[0]
        else:
            keys = k_pool.index_select(0, flat) if workspace is None else workspace.gather(k_pool, flat, "k")
            keys = keys.view(n, m * page_size, dim)
        if in_range and softcap is None:
            logits = masked_logits(query, keys, page_idx, seq_len, scaling, workspace, token_valid,
                                   rows_per_batch).float()  # [N, G, M*P]
        else:
            logits = torch.matmul(query.to(keys.dtype), keys.transpose(1, 2)).float() * scaling
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            ok = token_mask(page_idx, page_size, seq_len, token_valid, rows_per_batch)
            logits = logits.masked_fill(~ok[:, None, :], NEG_INF)
    probs = torch.softmax(logits, dim=-1)
    if not (in_range and token_valid is None):
        # A row with no attendable token (a fully padded sequence) gets zeros, not NaN.
        probs = torch.nan_to_num(probs, nan=0.0)
    if out is None:
        return torch.matmul(probs.to(values.dtype), values).to(query.dtype)
    if out.dtype == values.dtype:
        return torch.matmul(probs.to(values.dtype), values, out=out)
    return out.copy_(torch.matmul(probs.to(values.dtype), values))


def promotion_plan(
    old_pages: torch.Tensor,
    old_slots: torch.Tensor,
    new_pages: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The "swap map" of a re-rank: which resident pages stay, which are promoted and into which slot.

    Every row keeps the resident pages that are still selected; each promoted page takes the slot
    of one evicted page of the same row (no allocation) while there are any; evicted slots left over
    are freed. Between re-ranks a stable head only gains pages, so a re-rank always finds a slot; the
    first ranking after a prompt or a new turn starts from the sink (`PagedKV.append_offloaded`), and
    its promoted pages beyond the evicted ones are returned apart, to take newly allocated slots.

    Args:
        old_pages (`torch.Tensor` of shape `[N, R]`): resident logical pages per row, -1 = empty entry.
        old_slots (`torch.Tensor` of shape `[N, R]`): their device slots (ignored where old_pages is -1).
        new_pages (`torch.Tensor` of shape `[N, K]`): newly selected pages per row, -1 = empty entry.

    Returns:
        (new_slots, promo_rows, promo_pages, promo_slots, freed_slots, need_rows, need_cols):
        `new_slots [N, K]` the device slot of every new page (0 for empty entries and for the pages that need a
        new slot); `promo_rows, promo_pages, promo_slots [C]` the host->device copy list into evicted slots;
        `freed_slots [F]` device slots no longer used; `need_rows, need_cols [E]` the entries of `new_pages`
        promoted without an evicted slot to take.
    """
    n, r = old_pages.shape
    device = old_pages.device
    # kept[n, j]: old entry j is still selected; hit[n, i]: new entry i is already resident.
    eq = (old_pages[:, :, None] == new_pages[:, None, :]) & (old_pages[:, :, None] >= 0)
    kept = eq.any(dim=2)
    hit = eq.any(dim=1)
    hit_slot = (eq.long() * old_slots[:, :, None]).sum(dim=1)  # slot of the matching old entry
    promoted = (~hit) & (new_pages >= 0)
    evicted = (~kept) & (old_pages >= 0)
    # The c-th promoted page of a row takes the c-th evicted slot of that row, while there are.
    promo_rank = torch.cumsum(promoted.long(), dim=1) - 1
    evict_rank = torch.cumsum(evicted.long(), dim=1) - 1
    n_promo = promoted.sum(1)
    swapped = promoted & (promo_rank < evicted.sum(1)[:, None])
    # Table of evicted slots per row, in order: [N, R], unused entries 0.
    evict_tab = torch.zeros(n, r, dtype=old_slots.dtype, device=device)
    rows_e, cols_e = evicted.nonzero(as_tuple=True)
    evict_tab[rows_e, evict_rank[rows_e, cols_e]] = old_slots[rows_e, cols_e]
    rows_p, cols_p = swapped.nonzero(as_tuple=True)
    promo_slots = evict_tab[rows_p, promo_rank[rows_p, cols_p]]
    new_slots = torch.where(hit, hit_slot, torch.zeros_like(hit_slot))
    new_slots[rows_p, cols_p] = promo_slots
    # Evicted slots beyond the number of promotions in the row are freed.
    free_mask = evicted & (evict_rank >= n_promo[:, None])
    freed = old_slots[free_mask]
    need_rows, need_cols = (promoted & ~swapped).nonzero(as_tuple=True)
    return new_slots, rows_p, new_pages[rows_p, cols_p], promo_slots, freed, need_rows, need_cols

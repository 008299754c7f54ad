"""The argument checks and fake implementations of the decode step's fused ops, shared by their Triton
(`triton_ops.py`) and C++ CPU (`native_ops.py`) implementations: a call outside an op's contract raises a `ValueError`
or `TypeError` that names the shapes it got, on either backend and while compiling."""

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_page_scores(query, meta, bias, subpages):
    """`meta`: one tensor, or row blocks (views of the MinMax cache, the C++ op's argument) checked as if stacked."""
    blocks = [meta] if isinstance(meta, torch.Tensor) else list(meta)
    if query.dim() != 3 or bias.dim() != 2 or not blocks or any(
            b.dim() != 3 or b.shape[1:] != blocks[0].shape[1:] or b.dtype != blocks[0].dtype for b in blocks):
        raise ValueError(f"page_scores: query [n, G, D], meta [n, 2D, E] (or row blocks of it, one dtype), "
                         f"bias [n, E]; got {tuple(query.shape)}, {[tuple(b.shape) for b in blocks]}, "
                         f"{tuple(bias.shape)}")
    n, _, d = query.shape
    rows, channels, entries = sum(b.shape[0] for b in blocks), blocks[0].shape[1], blocks[0].shape[2]
    if rows != n or channels != 2 * d or tuple(bias.shape) != (n, entries):
        raise ValueError(f"page_scores: shapes do not match: query {tuple(query.shape)}, meta "
                         f"{[tuple(b.shape) for b in blocks]}, bias {tuple(bias.shape)}")
    if subpages < 1 or entries % subpages:
        raise ValueError(f"page_scores: subpages ({subpages}) must divide the entries ({entries})")
    for name, t in (("query", query), ("meta", blocks[0]), ("bias", bias)):
        if t.dtype not in FLOATS:
            raise TypeError(f"page_scores: {name} must be fp32, fp16 or bf16, got {t.dtype}")


def check_attention(query, keys, values, bias):
    if query.dim() != 3 or keys.dim() != 3 or values.dim() != 3 or bias.dim() not in (2, 3):
        raise ValueError(f"attention: query [n, G, D], keys [n, M, D], values [n, M, Dv], bias [n, M] or [n, G, M]; "
                         f"got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(bias.shape)}")
    n, g, d = query.shape
    m = keys.shape[1]
    expected_bias = (n, m) if bias.dim() == 2 else (n, g, m)
    if (keys.shape[0] != n or keys.shape[2] != d or tuple(values.shape[:2]) != (n, m)
            or tuple(bias.shape) != expected_bias):
        raise ValueError(f"attention: shapes do not match: query {tuple(query.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}, bias {tuple(bias.shape)}")
    for name, t in (("query", query), ("keys", keys), ("values", values), ("bias", bias)):
        if t.dtype not in FLOATS:
            raise TypeError(f"attention: {name} must be fp32, fp16 or bf16, got {t.dtype}")


def check_append_token(keys, values, full_k, full_v, meta, win_k, win_v, near_k, near_v, subpage_len):
    n, d = keys.shape
    if values.shape[0] != n or full_k.shape[0] != n or full_v.shape[0] != n or meta.shape[:2] != (n, 2 * d):
        raise ValueError(f"append_token: keys [n, D], values [n, Dv], full tiers [n, C, *], meta [n, 2D, E]; got "
                         f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(full_k.shape)}, {tuple(meta.shape)}")
    if full_k.shape[1] % subpage_len or meta.shape[2] != full_k.shape[1] // subpage_len:
        raise ValueError(f"append_token: {meta.shape[2]} MinMax entries of {subpage_len} tokens do not cover the "
                         f"capacity {full_k.shape[1]}")
    for name, t in (("win_k", win_k), ("win_v", win_v)):
        if t.shape[0] > 1 and t.shape[1] and t.stride(0) != t.shape[1] * t.stride(1):  # (no window: nothing written)
            raise ValueError(f"append_token: {name} must be flat-indexable over its first two dims (contiguous rows)")
    if (near_k.numel() == 0) != (near_v.numel() == 0):
        raise ValueError("append_token: near_k and near_v are both given or both empty")


def check_choose(logits, scores, cand, page, k, carry, pages_out, scores_out):
    n, g, c, p = logits.shape if logits.dim() == 4 else (None,) * 4
    if (logits.dim() != 4 or tuple(scores.shape) != (n, c) or tuple(cand.shape) != (n, c)
            or pages_out.shape != scores_out.shape or pages_out.dim() != 2 or pages_out.shape[0] != n):
        raise ValueError(f"choose: logits [n, G, C, P], scores and cand [n, C], pages_out and scores_out [n, W]; got "
                         f"{tuple(logits.shape)}, {tuple(scores.shape)}, {tuple(cand.shape)}, "
                         f"{tuple(pages_out.shape)}, {tuple(scores_out.shape)}")
    if not 0 < k <= c or not 0 <= carry <= c or pages_out.shape[1] < 2 * carry or page.numel() not in (1, n):
        raise ValueError(f"choose: K {k} and carry {carry} of {c} candidates, carried into {pages_out.shape[1]} "
                         f"places, page of {page.numel()} entries (one, or one per row)")


def check_candidates(scores, carried_pages, carried_scores, count):
    n, pages = scores.shape
    if carried_pages.shape != carried_scores.shape or carried_pages.dim() != 2 or carried_pages.shape[0] != n:
        raise ValueError(f"candidates: scores [n, pages], carried pages and scores [n, W]; got {tuple(scores.shape)}, "
                         f"{tuple(carried_pages.shape)}, {tuple(carried_scores.shape)}")
    if not 0 < count <= pages:
        raise ValueError(f"candidates: {count} candidates of {pages} pages")


def check_page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq):
    n, c = pages.shape
    p = tokens.shape[2] if tokens.dim() == 3 else 0
    if (query.dim() != 3 or query.shape[0] != n or tuple(rows.shape) != (n,) or full_k.dim() != 3 or near_k.dim() != 3
            or tokens.dim() != 3 or not p or full_k.shape[1] % p or near_k.shape[1:] != full_k.shape[1:]
            or full_k.shape[2] != query.shape[2] or (seq is not None and tuple(seq.shape) != (n,))):
        raise ValueError(f"page_logits: query [n, G, D], pages [n, C], rows and seq [n], near_k and full_k [*, T, D], "
                         f"tokens [B, T / P + 1, P]; got {tuple(query.shape)}, {tuple(pages.shape)}, "
                         f"{tuple(rows.shape)}, {None if seq is None else tuple(seq.shape)}, {tuple(near_k.shape)}, "
                         f"{tuple(full_k.shape)}, {tuple(tokens.shape)}")
    if not 0 <= near <= n:
        raise ValueError(f"page_logits: near ({near}) must be within the {n} rows")


def check_chosen_attention(logits, top, pages, starts, values):
    m, k = top.shape
    if (logits.dim() != 4 or logits.shape[0] < m or tuple(pages.shape) != (m, k) or tuple(starts.shape) != (m,)
            or values.dim() != 2):
        raise ValueError(f"chosen_attention: logits [n >= m, G, C, P], top and pages [m, K], starts [m], values "
                         f"[tokens, Dv]; got {tuple(logits.shape)}, {tuple(top.shape)}, {tuple(pages.shape)}, "
                         f"{tuple(starts.shape)}, {tuple(values.shape)}")


def check_move_windows(pages, page, local, rows, full_k, win_k, win_pages, num_pages, k):
    n = pages.shape[0]
    if local.shape != (n,) or rows.shape != (n,) or page.numel() not in (1, n) or pages.shape[1] > k:
        raise ValueError(f"move_windows: pages [n, <= K], local and rows [n], page one or [n]; got "
                         f"{tuple(pages.shape)}, {tuple(local.shape)}, {tuple(rows.shape)}, {tuple(page.shape)}")
    w = win_pages.shape[1]
    if w < k or win_k.shape[1] != w * (full_k.shape[1] // num_pages) or full_k.shape[1] % num_pages:
        raise ValueError(f"move_windows: windows of {w} pages ({win_k.shape[1]} tokens) for K = {k} and a full tier of "
                         f"{full_k.shape[1]} tokens in {num_pages} pages")


# Fake implementations (`torch.library.register_fake`) of both backends' ops: the checks, then outputs of the right
# shape and dtype with no data (nothing for the ops that only write), so a compiled step keeps each call as one node.

def fake_page_scores(query, meta, bias, subpages):
    check_page_scores(query, meta, bias, subpages)
    entries = (meta if isinstance(meta, torch.Tensor) else meta[0]).shape[2]  # one tensor (Triton) or row blocks (C++)
    return query.new_empty((query.shape[0], entries // subpages), dtype=torch.float32)


def fake_attention(query, keys, values, bias, scaling, softcap=None):
    check_attention(query, keys, values, bias)
    return values.new_empty((query.shape[0], query.shape[1], values.shape[2]))


def fake_append_token(keys, values, position, length, full_k, full_v, meta, meta_row, win_k, win_v, win_shift,
                      stable_local, near_k, near_v, near_place, subpage_len):
    check_append_token(keys, values, full_k, full_v, meta, win_k, win_v, near_k, near_v, subpage_len)


def fake_choose(logits, scores, cand, page, k, carry, score, pages_out, scores_out):
    check_choose(logits, scores, cand, page, k, carry, pages_out, scores_out)
    n, c = scores.shape
    return (scores.new_empty((n, c), dtype=torch.float32), scores.new_empty((n, k), dtype=torch.long),
            cand.new_empty((n, k)))


def fake_candidates(scores, carried_pages, carried_scores, count):
    check_candidates(scores, carried_pages, carried_scores, count)
    n = scores.shape[0]
    return scores.new_empty((n, count), dtype=torch.float32), scores.new_empty((n, count), dtype=torch.long)


def fake_page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq, scaling):
    check_page_logits(query, pages, rows, near, near_k, near_index, full_k, tokens, seq)
    return query.new_empty((pages.shape[0], query.shape[1], pages.shape[1], tokens.shape[2]), dtype=torch.float32)


def fake_chosen_attention(logits, top, pages, starts, values):
    check_chosen_attention(logits, top, pages, starts, values)
    return values.new_empty((top.shape[0], logits.shape[1], values.shape[1]))


def fake_move_windows(pages, page, local, rows, full_k, full_v, win_k, win_v, win_pages, win_shift, win_base,
                      win_bias_rows, stable_batch, promoted, num_pages, k, count):
    check_move_windows(pages, page, local, rows, full_k, win_k, win_pages, num_pages, k)


FAKES = {"page_scores": fake_page_scores, "attention": fake_attention, "append_token": fake_append_token,
         "choose": fake_choose, "candidates": fake_candidates, "page_logits": fake_page_logits,
         "chosen_attention": fake_chosen_attention, "move_windows": fake_move_windows}

"""Selection-quality probe: how much of the true attention each page-selection policy captures.

One dense teacher-forced forward pass over real text (prompt + continuation) records, for the last
`positions` query positions of every layer, the queries and every key/value before them. For each
(layer, KV head, position) and each policy it then compares, at the same token budget:

- **captured mass**: the share of the true attention (softmax over every key, per query head) that
  falls on the pages the policy selects; reported as the mean over the GQA group and the minimum
  over the group;
- **output error**: `|o_policy - o_dense| / |o_dense|`, where `o_policy` is attention over the selected
  pages only (what FlexiCache computes) — or, for `+tail` policies, plus an estimate of every
  unselected page from its mean key and mean value;
- the **oracle**: the K pages with the most true mass (mean over the group), forced pages included.

Scoring and combining are the production functions of `fc_hf.selection`, so the probe measures the
code the cache runs. Forcing follows the cache: the page being filled and `sink_pages` leading pages
are always selected. No generation: one forward per text, every policy on the same queries.

    flexicache eval selection --model smollm2-135m-instruct --prompt-tokens 4096 --positions 64
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fc_hf.selection import combine_group, head_bounds

POS_INF, NEG_INF = float("inf"), float("-inf")


@dataclass(frozen=True)
class Policy:
    """A page-selection policy as the probe runs it (each maps to `FlexiCacheConfig` options)."""

    name: str
    page_score: str = "quest"  # "quest" | "group_mean" | "oracle"
    subpages: int = 1
    recent_pages: int = 0
    tail: bool = False  # add mean-key/mean-value estimates of unselected pages to the softmax
    refine: int = 0  # candidate pages re-scored exactly (FlexiCacheConfig.refine_pages)
    mass: float | None = None  # FlexiCacheConfig.budget_mass: the fewest candidates reaching this mass

    def config_options(self) -> dict:
        return {"page_score": self.page_score, "score_subpages": self.subpages, "recent_pages": self.recent_pages,
                "tail_estimate": self.tail, "refine_pages": self.refine, "budget_mass": self.mass}


DEFAULT_POLICIES = (
    Policy("quest"),
    Policy("quest sub2", subpages=2),
    Policy("quest sub4", subpages=4),
    Policy("group_mean", page_score="group_mean"),
    Policy("group_mean sub2", page_score="group_mean", subpages=2),
    Policy("group_mean sub4", page_score="group_mean", subpages=4),
    Policy("quest recent4", recent_pages=4),
    Policy("quest refine 2K", refine=128),
    Policy("quest refine 4K", refine=256),
    Policy("quest sub2 refine 2K", subpages=2, refine=128),  # the default (FlexiCacheConfig()) at budget 1024
    Policy("group_mean sub2 refine 2K", page_score="group_mean", subpages=2, refine=128),  # GQA-fair proposer
    Policy("quest +tail", tail=True),
    Policy("group_mean sub2 +tail", page_score="group_mean", subpages=2, tail=True),
    Policy("oracle", page_score="oracle"),
    Policy("quest sub2 refine 2K mass 0.95", subpages=2, refine=128, mass=0.95),  # budget_mass=0.95
)


@dataclass
class ProbeTotals:
    """Sums over (KV head, position) per layer and policy; `table()` turns them into means."""

    layers: int
    policies: tuple
    sums: dict = field(default_factory=dict)  # (policy, layer, metric) -> [sum, count]
    worst: list = field(default_factory=list)  # (captured mean, policy, layer, kv_head)

    def add(self, policy: str, layer: int, metric: str, values: torch.Tensor) -> None:
        entry = self.sums.setdefault((policy, layer, metric), [0.0, 0])
        entry[0] += float(values.double().sum())
        entry[1] += values.numel()

    def mean(self, policy: str, metric: str, layer: int | None = None) -> float:
        keys = [k for k in self.sums if k[0] == policy and k[2] == metric and (layer is None or k[1] == layer)]
        total = sum(self.sums[k][0] for k in keys)
        count = sum(self.sums[k][1] for k in keys)
        return total / count if count else math.nan


def _page_view(x: torch.Tensor, pages: int, page_size: int) -> torch.Tensor:
    """`[..., L, *]` padded with zeros to `pages * page_size` and viewed as `[..., pages, page_size, *]`."""
    length = x.shape[-2]
    pad = pages * page_size - length
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-2], pad, x.shape[-1])], dim=-2)
    return x.view(*x.shape[:-2], pages, page_size, x.shape[-1])


def probe_layer(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    page_size: int,
    budget: int,
    sink_pages: int,
    policies,
):
    """Captured mass and output error of every policy for one layer.

    Args:
        query (`torch.Tensor` of shape `[H, G, T, D]`): queries of the probed positions (H KV heads, G per group).
        keys, values (`torch.Tensor` of shape `[H, L, D]`): every key/value of the text.
        positions (`torch.Tensor` of shape `[T]`): absolute position of each probed query (its own key included).
        scaling (`float`): the model's softmax scale.
        page_size, budget, sink_pages: as in `FlexiCacheConfig`.
        policies: `Policy` objects.

    Returns:
        `dict[str, dict[str, Tensor]]`: per policy, `mass_mean`/`mass_min` `[H, T]`, `out_err` `[H, T]`, `pages` `[H, T]`
        (pages selected: K, or under a `mass` policy the row's own count).
    """
    h, g, t, d = query.shape
    k_pages = budget // page_size
    q = query.float()
    k, v = keys.float(), values.float()
    length = int(positions.max()) + 1
    k, v = k[:, :length], v[:, :length]
    num_pages = math.ceil(length / page_size)
    # True attention of each probed query over its causal context.
    logits = torch.einsum("hgtd,hld->hgtl", q, k) * scaling
    causal = torch.arange(length)[None, :] <= positions[:, None]  # [T, L]
    logits = logits.masked_fill(~causal, NEG_INF)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - lse)  # [H, G, T, L]
    page_mass = _page_view(probs[..., None], num_pages, page_size).sum((-2, -1))  # [H, G, T, Np]
    page_out = torch.einsum("hgtpl,hpld->hgtpd", _page_view(probs[..., None], num_pages, page_size)[..., 0],
                            _page_view(v, num_pages, page_size))  # [H, G, T, Np, Dv]
    dense_out = page_out.sum(3)
    # Pages per probed position: pages < last are full (MinMax known), `last` is being filled (forced).
    last = positions // page_size  # [T]
    page_ids = torch.arange(num_pages)
    full = page_ids[None, :] < last[:, None]  # [T, Np]
    exists = page_ids[None, :] <= last[:, None]
    forced = page_ids[None, :] == last[:, None]
    forced |= (page_ids[None, :] < sink_pages) & exists
    # Per-page mean key / value (for the tail estimate) of full pages.
    kmean = _page_view(k, num_pages, page_size).mean(2)  # [H, Np, D]
    vmean = _page_view(v, num_pages, page_size).mean(2)
    meta_cache = {}
    out = {}
    for pol in policies:
        if sink_pages + pol.recent_pages >= k_pages:  # as FlexiCacheConfig refuses it
            raise ValueError(f"policy {pol.name!r}: sink_pages + recent_pages must be < {k_pages} pages of the budget")
        base_forced = forced.clone()
        if pol.recent_pages:
            base_forced |= (page_ids[None, :] >= (last[:, None] - pol.recent_pages)) & exists
        if pol.page_score == "oracle":
            scores = page_mass.mean(1)  # [H, T, Np]
        else:
            s = pol.subpages
            if s not in meta_cache:
                sub = _page_view(k, num_pages, page_size).view(h, num_pages * s, page_size // s, d)
                meta_cache[s] = torch.cat([sub.amax(2), sub.amin(2)], dim=-1)  # [H, Np*S, 2D]
            meta = meta_cache[s]
            # head_bounds works on rows [N, G, D]; probed positions become rows sharing their head's metadata.
            rows_q = q.permute(0, 2, 1, 3).reshape(h * t, g, d)
            rows_meta = meta[:, None].expand(h, t, *meta.shape[1:]).reshape(h * t, *meta.shape[1:])
            bounds = head_bounds(rows_q, rows_meta, num_pages * s)
            if s > 1:
                bounds = bounds.view(h * t, g, num_pages, s).amax(-1)
            valid_rows = full[None].expand(h, t, num_pages).reshape(h * t, num_pages)
            scores = combine_group(bounds, pol.page_score, scaling, valid_rows).view(h, t, num_pages)
        scores = scores.masked_fill(~full[None], NEG_INF).masked_fill(base_forced[None], POS_INF)
        scores = scores.masked_fill(~exists[None], NEG_INF)
        kk = min(k_pages, num_pages)
        if pol.mass is not None:
            if not pol.refine:
                raise ValueError(f"policy {pol.name!r}: a mass policy chooses among refinement's candidates (set refine)")
            sel = _mass_selection(scores, page_mass.mean(1), pol, k_pages, page_size) & exists[None]
        elif pol.refine and pol.refine > kk:
            # Candidates by score, then the K with the most true mass among them (forced pages kept).
            cand = torch.topk(scores, min(pol.refine, num_pages), dim=-1).indices
            exact = page_mass.mean(1).gather(-1, cand)
            exact = exact.masked_fill(torch.isposinf(scores.gather(-1, cand)), POS_INF)
            exact = exact.masked_fill(torch.isneginf(scores.gather(-1, cand)), NEG_INF)
            scores = torch.full_like(scores, NEG_INF).scatter_(-1, cand, exact)
        if pol.mass is None:
            top = torch.topk(scores, kk, dim=-1).indices  # [H, T, K]
            sel = torch.zeros(h, t, num_pages, dtype=torch.bool).scatter_(-1, top, True) & exists[None]
        sel_g = sel[:, None].expand(h, g, t, num_pages)
        captured = (page_mass * sel_g).sum(-1)  # [H, G, T]
        num = (page_out * sel_g[..., None]).sum(3)
        den = captured[..., None]
        if pol.tail:
            unsel = (~sel & full[None])[:, None]  # [H, 1, T, Np]
            est_logit = torch.einsum("hgtd,hpd->hgtp", q, kmean) * scaling + math.log(page_size) - lse
            est = torch.exp(est_logit).masked_fill(~unsel, 0.0)  # estimated probability mass per unselected page
            num = num + torch.einsum("hgtp,hpd->hgtd", est, vmean)
            den = den + est.sum(-1, keepdim=True)
        approx = num / den.clamp_min(1e-30)
        err = (approx - dense_out).norm(dim=-1) / dense_out.norm(dim=-1).clamp_min(1e-30)
        out[pol.name] = {"mass_mean": captured.mean(1), "mass_min": captured.amin(1), "out_err": err.mean(1),
                         "pages": sel.sum(-1).float()}
    return out


def _mass_selection(scores: torch.Tensor, true_mass: torch.Tensor, pol: Policy, k_pages: int,
                    page_size: int) -> torch.Tensor:
    """`budget_mass` as the cache runs it (`fc_hf.budget_mass.choose_by_mass`): the top-`refine` candidates by score,
    each one's exact mass among the candidates, the fewest reaching `pol.mass` (forced pages first), clamped to
    `FlexiCacheConfig`'s floor and ceiling (K/4 and 2K by default). `scores`, `true_mass` `[H, T, Np]` -> a boolean
    selection."""
    from fc_hf.budget_mass import choose_by_mass
    from fc_hf.config import FlexiCacheConfig

    cfg = FlexiCacheConfig(token_budget=k_pages * page_size, page_size=page_size, refine_pages=pol.refine,
                           budget_mass=pol.mass)
    h, t, num_pages = scores.shape
    cand_scores, cand = torch.topk(scores.reshape(h * t, num_pages), min(pol.refine, num_pages), dim=-1)
    mass = true_mass.reshape(h * t, num_pages).gather(1, cand)
    mass = mass / mass.sum(1, keepdim=True).clamp_min(1e-30)  # mass among the candidates, as refinement has it
    mass = mass.masked_fill(torch.isneginf(cand_scores), 0.0)
    key = torch.where(torch.isinf(cand_scores), cand_scores, mass)
    chosen, _, _ = choose_by_mass(cand, mass, key, pol.mass, cfg.mass_min_pages, cfg.mass_max_pages, trim=False)
    sel = torch.zeros(h * t, num_pages + 1, dtype=torch.bool)
    sel.scatter_(1, chosen.masked_fill(chosen < 0, num_pages), True)  # -1 entries land in a spare column
    return sel[:, :num_pages].view(h, t, num_pages)


def bytes_per_step(policy: Policy, context: int, page_size: int, budget: int, head_dim: int, itemsize: int) -> dict:
    """KV and metadata bytes one KV head reads per decode step under `policy` (counted from tensor sizes)."""
    pages = math.ceil(context / page_size)
    kv = min(budget, context) * 2 * head_dim * itemsize
    meta = 0 if policy.page_score == "oracle" else pages * policy.subpages * 2 * head_dim * itemsize
    tail = pages * 2 * head_dim * itemsize if policy.tail else 0
    refine = min(policy.refine, pages) * page_size * head_dim * itemsize if policy.refine else 0  # candidates' keys
    kv += refine
    return {"kv": kv, "metadata": meta + tail, "total": kv + meta + tail}


class _Recorder:
    """Attention function that runs sdpa and records each layer's queries (last positions) and K/V."""

    def __init__(self, positions: int):
        self.positions = positions
        self.layers: dict[int, tuple] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
        self.layers[module.layer_idx] = (
            query[0, :, -self.positions :].detach().clone(), key[0].detach().clone(), value[0].detach().clone(), scaling
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.inference_mode()
def probe_text(model, token_ids, positions: int, page_size: int, budget: int, sink_pages: int, policies, totals):
    """Run one dense forward over `token_ids` and add every layer's probe results into `totals`."""
    from transformers import AttentionInterface

    recorder = _Recorder(positions)
    AttentionInterface.register("fc_probe", recorder)
    previous = model.config._attn_implementation
    model.set_attn_implementation("fc_probe")
    try:
        ids = torch.tensor([list(token_ids)], device=next(model.parameters()).device)
        model(input_ids=ids, logits_to_keep=1, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    length = len(token_ids)
    pos = torch.arange(length - positions, length)
    for layer, (q, k, v, scaling) in sorted(recorder.layers.items()):
        hkv = k.shape[0]
        q = q.cpu().view(hkv, q.shape[0] // hkv, positions, q.shape[-1])
        res = probe_layer(q, k.cpu(), v.cpu(), pos, scaling, page_size, budget, sink_pages, policies)
        for name, metrics in res.items():
            for metric, values in metrics.items():
                totals.add(name, layer, metric, values)
            totals.worst.append((float(metrics["mass_mean"].mean()), name, layer))
        recorder.layers[layer] = None  # free as we go


def format_table(totals: ProbeTotals, policies, context: int, page_size: int, budget: int, head_dim: int,
                 itemsize: int, layer_rows=True) -> str:
    """Markdown: per policy the overall means and bytes per step; then captured mass per layer."""
    lines = ["| policy | mass (mean over group) | mass (min over group) | output rel. error | bytes/step/KV head at a ranking (KV + metadata) |",
             "|---|---|---|---|---|"]
    for pol in policies:
        b = bytes_per_step(pol, context, page_size, budget, head_dim, itemsize)
        mm = totals.mean(pol.name, "mass_mean")
        mass = "—" if pol.tail else f"{mm:.4f}"
        mn = "—" if pol.tail else f"{totals.mean(pol.name, 'mass_min'):.4f}"
        lines.append(f"| {pol.name} | {mass} | {mn} | {totals.mean(pol.name, 'out_err'):.4f} | "
                     f"{b['kv']} + {b['metadata']} |")
    if layer_rows:
        names = [p.name for p in policies if not p.tail]
        lines += ["", "| layer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for layer in range(totals.layers):
            lines.append(f"| {layer} | " + " | ".join(f"{totals.mean(n, 'mass_mean', layer):.3f}" for n in names) + " |")
        varied = [p.name for p in policies if p.mass is not None]
        if varied:  # where a mass policy spends its pages, next to the fixed budget's K
            lines += ["", f"Pages per KV head and position (fixed policies: {budget // page_size})", "",
                      "| layer | " + " | ".join(varied) + " |", "|---" * (len(varied) + 1) + "|"]
            for layer in range(totals.layers):
                lines.append(f"| {layer} | " + " | ".join(f"{totals.mean(n, 'pages', layer):.1f}" for n in varied) + " |")
            lines.append("| all | " + " | ".join(f"{totals.mean(n, 'pages'):.1f}" for n in varied) + " |")
    return "\n".join(lines)


# -- texts ------------------------------------------------------------------------------------------
def leval_text(tokenizer, path, record: int, question: int, prompt_tokens: int, answer_tokens: int) -> list[int]:
    """An L-Eval document (head and tail kept, middle cut) + one question + the reference answer's first tokens."""
    import json

    with open(path) as f:
        for i, line in enumerate(f):
            if i == record:
                rec = json.loads(line)
                break
        else:
            raise IndexError(f"{path} has no record {record}")
    q = tokenizer(f"\n\nQuestion: {rec['instructions'][question]}\nAnswer:", add_special_tokens=False)["input_ids"]
    a = tokenizer(" " + rec["outputs"][question], add_special_tokens=False)["input_ids"][:answer_tokens]
    doc = tokenizer(rec["input"], add_special_tokens=False)["input_ids"]
    room = prompt_tokens - len(q)
    if len(doc) > room:
        doc = doc[: room // 2] + doc[len(doc) - (room - room // 2):]
    return doc + q + a


def niah_text(tokenizer, sample: int, prompt_tokens: int) -> list[int]:
    """A needle haystack (`fc_hf.profiler.tasks` "ruler-niah": 8 key -> number needles in KJV text) + the answer."""
    from fc_hf.profiler.tasks import build_prompt

    prompt = build_prompt("ruler-niah", tokenizer, prompt_tokens, sample=sample)
    answer = tokenizer(" " + prompt.answer, add_special_tokens=False)["input_ids"]
    return prompt.input_ids[0].tolist() + answer


def kjv_text(tokenizer, offset: int, prompt_tokens: int, positions: int) -> list[int]:
    """A King James Bible passage of `prompt_tokens + positions` tokens starting near character `offset`."""
    from fc_hf.assets.text import text_tokens

    return list(text_tokens(tokenizer, prompt_tokens + positions, offset))


# -- command line -----------------------------------------------------------------------------------
def text_for(source: str, tokenizer, prompt_tokens: int, positions: int, leval_root) -> list[int]:
    """Token ids for one source spec: `kjv:OFFSET`, `niah:SAMPLE` or `leval:TASK:RECORD:QUESTION`."""
    from pathlib import Path

    kind, *rest = source.split(":")
    if kind == "kjv":
        return kjv_text(tokenizer, int(rest[0]) if rest else 0, prompt_tokens, positions)
    if kind == "niah":
        return niah_text(tokenizer, int(rest[0]) if rest else 0, prompt_tokens)
    if kind == "leval":
        task, record, question = rest[0], int(rest[1]), int(rest[2])
        root = Path(leval_root)
        path = next((p for p in (root / "open-ended" / f"{task}.jsonl", root / "closed-ended" / f"{task}.jsonl",
                                 root / f"{task}.jsonl") if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"no {task}.jsonl under {root} (give --leval-data, the L-Eval data folder)")
        return leval_text(tokenizer, path, record, question, prompt_tokens, positions)
    raise ValueError(f"unknown probe source {source!r}: use kjv:OFFSET, niah:SAMPLE or leval:TASK:RECORD:QUESTION")


def run_probe(model_name: str, sources, prompt_tokens: int = 4096, positions: int = 64, budget: int = 1024,
              page_size: int = 16, sink_pages: int = 1, policies=DEFAULT_POLICIES, leval_root=None, dtype="float32",
              out=None, log=print) -> str:
    """Probe every policy on every source text; returns (and writes to `out`) the Markdown tables."""
    import time
    from pathlib import Path

    from .loading import load_model

    model, tok, _ = load_model(model_name, dtype)
    totals = ProbeTotals(model.config.num_hidden_layers, tuple(policies))
    for source in sources:
        t0 = time.time()
        ids = text_for(source, tok, prompt_tokens, positions, leval_root)
        probe_text(model, ids, positions, page_size, budget, sink_pages, policies, totals)
        log(f"{source}: {len(ids)} tokens, {time.time() - t0:.0f} s")
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    header = (f"Selection probe — {model_name}, {len(sources)} texts of ~{prompt_tokens} tokens, last {positions} positions, "
              f"budget {budget}, page {page_size}, sink {sink_pages}; sources: {', '.join(sources)}\n\n")
    text = header + format_table(totals, policies, prompt_tokens, page_size, budget, head_dim, itemsize)
    worst = sorted((w for w in totals.worst if w[1] == policies[0].name))[:5]
    text += "\n\nWorst layers for " + policies[0].name + ": " + ", ".join(f"layer {l} ({m:.3f})" for m, _, l in worst)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text

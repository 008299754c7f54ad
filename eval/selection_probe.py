"""Selection-quality probe: how much of the true attention each page-selection policy captures.

One dense teacher-forced forward pass over real text (prompt + continuation) records, for the last
`positions` query positions of every layer, the queries and every key/value before them. For each
(layer, KV head, position) and each policy it then compares, at the same token budget:

- **captured mass**: the share of the true attention (softmax over every key, per query head) that
  falls on the pages the policy selects; reported as the mean over the GQA group and the minimum
  over the group;
- **output error**: `|o_policy - o_dense| / |o_dense|`, where `o_policy` is attention over the selected
  pages only (what FlexiCache computes);
- the **oracle**: the K pages with the most true mass (mean over the group), forced pages included.

The bound is `fc_hf.kernels`' own (`quest_bounds`), so the probe measures the code the cache runs. Forcing follows
the cache: the page being filled and `sink_pages` leading pages are always selected. A `carry` policy ranks the probed
positions in order, each one's candidates including the pages the previous position carried (as consecutive decode
steps of a head ranked every step do). No generation: one forward per text, every policy on the same queries.

    flexicache eval selection --model smollm2-135m-instruct --prompt-tokens 4096 --positions 64
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fc_hf.kernels.torch_backend import quest_bounds

POS_INF, NEG_INF = float("inf"), float("-inf")


@dataclass(frozen=True)
class Policy:
    """A page-selection policy as the probe runs it (each maps to `FlexiCacheConfig` options)."""

    name: str
    oracle: bool = False  # the K pages of most true mass
    subpages: int = 1
    refine: int = 0  # candidate pages re-scored exactly (FlexiCacheConfig.refine_pages)
    carry: int = 0  # pages of most mass carried, with their successors, into the next position's candidates

    def config_options(self) -> dict:
        return {"score_subpages": self.subpages, "refine_pages": self.refine, "carry_pages": self.carry}


DEFAULT_POLICIES = (
    Policy("quest"),  # the authors' selection
    Policy("quest sub2", subpages=2),
    Policy("quest sub4", subpages=4),
    Policy("quest refine 2K", refine=128),
    Policy("quest sub2 refine 2K", subpages=2, refine=128),
    Policy("quest sub2 refine 4K", subpages=2, refine=256),
    Policy("quest sub2 refine 2K carry", subpages=2, refine=128, carry=8),  # the default (FlexiCacheConfig()) at 1024
    Policy("oracle", oracle=True),
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
        `dict[str, dict[str, Tensor]]`: per policy, `mass_mean`/`mass_min` `[H, T]` and `out_err` `[H, T]`.
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
    meta_cache = {}
    out = {}
    for pol in policies:
        if pol.oracle:
            scores = page_mass.mean(1)  # [H, T, Np]
        else:
            s = pol.subpages
            if s not in meta_cache:
                sub = _page_view(k, num_pages, page_size).view(h, num_pages * s, page_size // s, d)
                meta_cache[s] = torch.cat([sub.amax(2), sub.amin(2)], dim=-1)  # [H, Np*S, 2D]
            bounds = quest_bounds(q.permute(0, 2, 1, 3).reshape(h, t * g, d), meta_cache[s].transpose(1, 2))
            scores = bounds.view(h, t, g, num_pages, s).amax(dim=(2, 4))  # [H, T, Np]: max over group, sub-pages
        scores = scores.masked_fill(~full[None], NEG_INF).masked_fill(forced[None], POS_INF)
        scores = scores.masked_fill(~exists[None], NEG_INF)
        kk = min(k_pages, num_pages)
        if pol.refine and pol.refine > kk:
            scores = _refined(scores, page_mass.mean(1), pol)
        top = torch.topk(scores, kk, dim=-1).indices  # [H, T, K]
        sel = torch.zeros(h, t, num_pages, dtype=torch.bool).scatter_(-1, top, True) & exists[None]
        sel_g = sel[:, None].expand(h, g, t, num_pages)
        captured = (page_mass * sel_g).sum(-1)  # [H, G, T]
        approx = (page_out * sel_g[..., None]).sum(3) / captured[..., None].clamp_min(1e-30)
        err = (approx - dense_out).norm(dim=-1) / dense_out.norm(dim=-1).clamp_min(1e-30)
        out[pol.name] = {"mass_mean": captured.mean(1), "mass_min": captured.amin(1), "out_err": err.mean(1)}
    return out


def _refined(scores: torch.Tensor, mass: torch.Tensor, pol: Policy) -> torch.Tensor:
    """Refinement's scores `[H, T, Np]`: the top `pol.refine` candidates by `scores` keep their true mass (forced ones
    +inf, all-padding ones -inf), every other page -inf. With `pol.carry` the positions rank in order, each one's
    candidates also holding the previous position's `carry` pages of most mass and the page after each."""
    h, t, num_pages = scores.shape
    out = torch.full_like(scores, NEG_INF)
    carried = None
    for j in range(t) if pol.carry else [slice(None)]:
        sc = scores[:, j].clone()
        if carried is not None:
            sc.scatter_(-1, carried, torch.where(torch.isinf(sc.gather(-1, carried)), sc.gather(-1, carried), 3e38))
        cand = torch.topk(sc, min(pol.refine, num_pages), dim=-1).indices
        exact = mass[:, j].gather(-1, cand)
        exact = torch.where(torch.isinf(sc.gather(-1, cand)), sc.gather(-1, cand), exact)
        out[:, j].scatter_(-1, cand, exact)
        if pol.carry:
            free = exact.nan_to_num(posinf=0.0, neginf=0.0)
            best = cand.gather(-1, free.topk(pol.carry, dim=-1).indices)
            carried = torch.cat([best, best + 1], -1).clamp(max=num_pages - 1)
    return out


def bytes_per_step(policy: Policy, context: int, page_size: int, budget: int, head_dim: int, itemsize: int) -> dict:
    """KV and metadata bytes one KV head reads per decode step under `policy` (counted from tensor sizes)."""
    pages = math.ceil(context / page_size)
    kv = min(budget, context) * 2 * head_dim * itemsize
    meta = 0 if policy.oracle else pages * policy.subpages * 2 * head_dim * itemsize
    refine = min(policy.refine, pages) * page_size * head_dim * itemsize if policy.refine else 0  # candidates' keys
    return {"kv": kv + refine, "metadata": meta, "total": kv + refine + meta}


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
        lines.append(f"| {pol.name} | {totals.mean(pol.name, 'mass_mean'):.4f} | {totals.mean(pol.name, 'mass_min'):.4f} | "
                     f"{totals.mean(pol.name, 'out_err'):.4f} | {b['kv']} + {b['metadata']} |")
    if layer_rows:
        names = [p.name for p in policies]
        lines += ["", "| layer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for layer in range(totals.layers):
            lines.append(f"| {layer} | " + " | ".join(f"{totals.mean(n, 'mass_mean', layer):.3f}" for n in names) + " |")
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

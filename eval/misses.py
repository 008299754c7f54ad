"""Confident misses: where FlexiCache's next token is not dense's although dense was sure, and why.

Teacher-forced on one token sequence per case (dense's own greedy answer, or real text), so that every step compares
like with like: dense and FlexiCache see the same prefix, and the first step where FlexiCache's top-1 differs is also
where its free-running answer would first part from dense's. A step is a **confident miss** when FlexiCache's top-1 is
not dense's and dense's top-1 leads its second by at least `CONFIDENT` nats.

At every such step the diagnosis asks two questions.

1. **Which head missed which page.** The FlexiCache run records, per decode step and layer, the query and the pages
   each KV head read. After the run the cache holds every token's K/V, so for the miss step each (layer, KV head) gets,
   with its own query over its own keys: the true attention mass (softmax over every key, mean over the GQA group) that
   its actual pages captured; what the oracle (the K pages of most true mass, the forced pages in) captures; what the
   cache's own ranking would choose *now* (`fresh`: `PageSelector.rank`, the production ranking, over a `PageStore` of
   the same keys with the step's forced pages and the layer's carried candidates of that step, `fresh_selection`) and
   its candidates. The lost mass `1 - actual` splits into causes:
   - **stale**: `fresh - actual` for a stable head that did not rank at this step (its set dates from its last ranking,
     `fc_hf/schedule.py`);
   - **bound miss** / **outranked**: `oracle - fresh`, split by where the oracle's missing pages were: not among the
     refinement's candidates (the bound did not propose them) or among them but beaten by K others;
   - **broad**: `1 - oracle`: no selection of K pages holds it.
2. **Which change would have given dense's token.** The step is re-run (one forward of its input token over the final
   K/V of every earlier token, in a `DynamicCache`) with every (layer, KV head) attending to the pages of a policy:
   `actual` (must reproduce FlexiCache's logits: a check of the whole diagnosis), `fresh` (every head re-ranked now: is
   the miss stale?), `oracle` (is it the selection?), `dense` (is it the budget, or does it lie in earlier tokens' K/V?),
   and `dense` for one (layer, KV head) at a time on top of `actual`: the heads whose exact attention moves the margin
   `logit(dense's token) - logit(FlexiCache's token)` most, and how many of them together flip the step.

    flexicache eval misses --model smollm2-135m-instruct --sources demo,ruler:niah_single_1:8192:0
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from fc_hf.compat import cache_kwargs
from fc_hf.config import FlexiCacheConfig

from .shared_prefill import load_prefill
from .sources import read_jsonl

__all__ = ["CONFIDENT", "Case", "StepRecorder", "step_margins", "dense_reference", "compare_case", "cases_for",
           "run_misses", "misses_markdown"]

CONFIDENT = 2.0  # nats between dense's top two tokens: above it dense is sure
CAUSES = ("stale", "bound miss", "outranked", "broad")
_RECORD, _SELECT = "fc_miss_record", "fc_miss_select"


@dataclass
class Case:
    """One teacher-forced sequence: `prompt_ids`, then `target` (None: dense's greedy answer of `new_tokens`, ended by
    `stop(tokens)`)."""

    name: str
    prompt_ids: list[int]
    target: list[int] | None = None
    new_tokens: int = 64
    stop: Callable[[list[int]], bool] | None = None
    meta: dict = field(default_factory=dict)


# -- the FlexiCache run: what each head read at each step ------------------------------------------------------------
class StepRecorder:
    """FlexiCache's attention function, recording per decode step and layer (batch 1: row `h` is KV head `h`) the query
    `[Hq, D]`, the pages each KV head read (`layer.pages_read()`), whether it ranked at that step
    (`layer.rows_ranked()`), its kind, and the layer's carried candidates before the step (`PageSelector.mark()`, for
    `fresh_selection`). The layers record their reads (`record_reads`, set by `flexicache_forced`)."""

    def __init__(self):
        self.steps: list[dict[int, dict]] = []

    def new_step(self) -> None:
        self.steps.append({})

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from fc_hf.attention import flexicache_attention_forward
        from fc_hf.layer import DecodePlaceholder

        layer = key.fc_layer if isinstance(key, DecodePlaceholder) else None
        carried = None if layer is None else tuple(t.cpu() for t in layer.selector.mark())
        out = flexicache_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if layer is not None:
            heads = range(layer.num_kv_heads)
            ranked = layer.rows_ranked()
            self.steps[-1][layer.layer_idx] = {
                "query": query[0, :, -1].detach().float().cpu(),
                "pages": [torch.tensor(p, dtype=torch.long) for p in layer.pages_read()],
                "ranked": [h in ranked for h in heads], "kinds": {h: layer.kinds.kind_of(h) for h in heads},
                "carried": carried}
        return out


def _register(name: str, fn) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)


@torch.inference_mode()
def flexicache_forced(model, prefill, cache, forced: Sequence[int]) -> tuple[torch.Tensor, StepRecorder]:
    """Feed `forced` one token at a time after the prompt into `cache`; `(log-probs [S, V], recorder)`."""
    recorder = StepRecorder()
    load_prefill(prefill, cache, model, "flexicache")
    for layer in cache.flexi_layers:
        layer.record_reads = True
    _register(_RECORD, recorder)
    model.set_attn_implementation(_RECORD)
    device = next(model.parameters()).device
    out = []
    try:
        for token in forced:
            recorder.new_step()
            logits = model(input_ids=torch.tensor([[int(token)]], device=device), use_cache=True,
                           **cache_kwargs(model, cache)).logits[0, -1]
            out.append(torch.log_softmax(logits.float(), dim=-1))
    finally:
        model.set_attn_implementation("flexicache")
    return torch.stack(out), recorder


def step_margins(logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Top-1 token and its lead over the second (nats) of each row of `[S, V]` log-probs."""
    top = logprobs.topk(2, dim=-1)
    return top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()


# -- re-running one step under a selection policy ---------------------------------------------------------------------
def _pages_mask(pages: list[torch.Tensor], length: int, page_size: int) -> torch.Tensor:
    """`[H, L]` token mask of each head's page list."""
    mask = torch.zeros(len(pages), -(-length // page_size) * page_size, dtype=torch.bool)
    for h, p in enumerate(pages):
        mask[h].view(-1, page_size)[p] = True
    return mask[:, :length]


def exact_logits(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled fp32 logits of every key: `q [H, G, D]`, `k [H, L, D]` -> `[H, G, L]`."""
    return torch.einsum("hgd,hld->hgl", q.float(), k.float()) * scaling


def page_mass(q: torch.Tensor, k: torch.Tensor, scaling: float, page_size: int,
              logits: torch.Tensor | None = None) -> torch.Tensor:
    """True attention mass of every page, mean over the GQA group: `q [H, G, D]`, `k [H, L, D]` -> `[H, Np]`
    (`logits`: their `exact_logits`, when the caller has them already)."""
    h, length = k.shape[0], k.shape[1]
    probs = torch.softmax(exact_logits(q, k, scaling) if logits is None else logits, dim=-1).mean(1)
    pages = -(-length // page_size)
    return torch.nn.functional.pad(probs, (0, pages * page_size - length)).view(h, pages, page_size).sum(-1)


def oracle_pages(mass: torch.Tensor, k_pages: int, sink_pages: int) -> list[torch.Tensor]:
    """The `k_pages` pages of most mass per head, the sink and the page being filled always in."""
    key = mass.clone()
    key[:, :sink_pages] = math.inf
    key[:, -1] = math.inf
    top = key.topk(min(k_pages, key.shape[1]), dim=-1).indices
    return list(top)


def fresh_selection(cfg: FlexiCacheConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                    carried: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`(chosen, candidates)` per head: what the cache's own ranking chooses now over exactly these keys, and the
    candidates its bound proposed (every page without refinement).

    The production path itself: a `PageStore` of the same keys (every head ranked), the step's `StepBias` (every token
    attendable, the page being filled and the sink forced) and `PageSelector.rank`, with `carried` (the layer's
    `PageSelector.mark()` before the step; None: nothing carried) as the selector's carried candidates. The candidates
    are the ranking's own (every page without refinement). Pages past the
    page being filled (a ranking's filler when fewer pages exist than it picks) are dropped."""
    from fc_hf.rows import HeadKinds
    from fc_hf.selection import PageSelector
    from fc_hf.step_bias import StepBias
    from fc_hf.store import PageStore

    h, length, d = k.shape
    store = PageStore(HeadKinds.split(h, set(range(h)), set()), cfg, 1, d, v.shape[-1], k.dtype, k.device, length,
                      host_tier=False)
    store.write_prompt(k[None], v[None])
    bias = StepBias(1, store.pages, cfg.page_size, cfg.subpages, cfg.sink_pages, k.device)
    bias.update(None, torch.tensor(length - 1, device=k.device))  # the step's own token is the last
    selector = PageSelector(cfg, store.n, k.device)
    if carried is not None:
        selector.restore(tuple(t.to(k.device) for t in carried))
    ranking = selector.rank(q.to(k.dtype), store.rows.unstable, store, bias, scaling)
    chosen = ranking.pages
    cand = ranking.candidates if ranking.candidates is not None else torch.arange(store.pages).expand(h, -1)
    last = (length - 1) // cfg.page_size
    return [c[c <= last].sort().values for c in chosen], [c[c <= last] for c in cand]


class SelectAttention:
    """An attention function for one decode step's forward: each (layer, KV head) attends to the tokens of the pages
    `choose(layer_idx, q [H, G, D], k [H, L, D], v, scaling)` gives (`[H, L]` mask; None: every token)."""

    def __init__(self):
        self.choose: Callable | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, hq, t, d = query.shape
        h = key.shape[1]
        scaling = scaling if scaling is not None else module.scaling
        q = query[0, :, -1].view(h, hq // h, d)
        mask = self.choose(module.layer_idx, q, key[0], value[0], scaling)
        logits = exact_logits(q, key[0], scaling)
        if mask is not None:
            logits = logits.masked_fill(~mask[:, None], -math.inf)
        out = torch.einsum("hgl,hld->hgd", torch.softmax(logits, -1), value[0].float()).to(query.dtype)
        return out.reshape(1, 1, hq, -1), None


@dataclass
class StepReplay:
    """Re-runs decode step `i` of a FlexiCache run over its final K/V under any selection policy."""

    model: object
    cache: object  # the FlexiCache after the run (every token's K/V)
    prompt_len: int
    forced: Sequence[int]
    recorder: StepRecorder

    def __post_init__(self):
        from fc_hf.cache import FlexiCache  # noqa: F401

        self.kv = {l.layer_idx: l.dense_kv() for l in self.cache.flexi_layers}
        self.cfg = self.cache.cache_config
        self.attention = SelectAttention()
        _register(_SELECT, self.attention)

    @torch.inference_mode()
    def logits(self, i: int, choose: Callable) -> torch.Tensor:
        """Step `i`'s next-token log-probs when every layer attends as `choose` says."""
        from transformers import DynamicCache

        length = self.prompt_len + i  # tokens before step i's input token
        cache = DynamicCache(config=self.model.config)
        for layer_idx in range(len(self.kv)):
            k, v = self.kv[layer_idx]
            cache.update(k[:, :, :length], v[:, :, :length], layer_idx)
        self.attention.choose = choose
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(_SELECT)
        try:
            device = next(self.model.parameters()).device
            out = self.model(input_ids=torch.tensor([[int(self.forced[i])]], device=device), use_cache=True,
                             **cache_kwargs(self.model, cache))
        finally:
            self.model.set_attn_implementation(previous)
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1)

    def layer_step(self, i: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """Step `i`'s recorded query `[H, G, D]` at `layer`, the K/V `[H, L, D]` it attended (its own token's
        included) and the layer's scaling."""
        length = self.prompt_len + i + 1
        k_all, v_all = self.kv[layer]
        k, v = k_all[0, :, :length], v_all[0, :, :length]
        q = self.recorder.steps[i][layer]["query"].view(k.shape[0], -1, k.shape[-1])
        return q, k, v, self.model.model.layers[layer].self_attn.scaling

    # policies: choose(layer, q, k, v, scaling) -> [H, L] mask or None
    def actual(self, i: int) -> Callable:
        rec = self.recorder.steps[i]
        return lambda layer, q, k, v, s: _pages_mask(rec[layer]["pages"], k.shape[1], self.cfg.page_size)

    def oracle(self, layer, q, k, v, s):
        return _pages_mask(oracle_pages(page_mass(q, k, s, self.cfg.page_size), self.cfg.pages_per_head,
                                        self.cfg.sink_pages), k.shape[1], self.cfg.page_size)

    def fresh(self, i: int) -> Callable:
        rec = self.recorder.steps[i]
        return lambda layer, q, k, v, s: _pages_mask(fresh_selection(self.cfg, q, k, v, s, rec[layer]["carried"])[0],
                                                     k.shape[1], self.cfg.page_size)

    @staticmethod
    def dense(layer, q, k, v, s):
        return None

    def override(self, base: Callable, heads: set, policy: Callable) -> Callable:
        """`base` everywhere but the (layer, KV head) pairs in `heads`, which attend as `policy`."""

        def choose(layer, q, k, v, s):
            mask = base(layer, q, k, v, s)
            mine = [h for l, h in heads if l == layer]
            if not mine:
                return mask
            other = policy(layer, q, k, v, s)
            mask = mask.clone()
            for h in mine:
                mask[h] = True if other is None else other[h]
            return mask
        return choose


def head_losses(replay: StepReplay, i: int) -> list[dict]:
    """Per (layer, KV head) at step `i`, with the step's own queries (recorded) over its keys: the mass its pages
    captured, the oracle's and a fresh ranking's, and the lost mass by cause (module docstring)."""
    cfg, rec = replay.cfg, replay.recorder.steps[i]
    rows = []
    for layer in replay.kv:
        q, k, v, scaling = replay.layer_step(i, layer)
        mass = page_mass(q, k, scaling, cfg.page_size)
        oracle = oracle_pages(mass, cfg.pages_per_head, cfg.sink_pages)
        fresh, cand = fresh_selection(cfg, q, k, v, scaling, rec[layer]["carried"])
        for h in range(k.shape[0]):
            m = mass[h]
            actual = rec[layer]["pages"][h]
            got, best, now = float(m[actual].sum()), float(m[oracle[h]].sum()), float(m[fresh[h]].sum())
            stable_between = rec[layer]["kinds"][h] == "stable" and not rec[layer]["ranked"][h]
            missing = torch.tensor(sorted(set(oracle[h].tolist()) - set(fresh[h].tolist())), dtype=torch.long)
            in_cand = torch.isin(missing, cand[h])
            bound, outranked = float(m[missing[~in_cand]].sum()), float(m[missing[in_cand]].sum())
            selection = max(0.0, best - now)
            share = bound / (bound + outranked) if bound + outranked > 0 else 0.0
            # Of the mass the head's own pages missed (the oracle's pages it did not read), the share on pages it had
            # read at the previous step: a page dropped from one step to the next (what carried candidates keep).
            unread = torch.tensor(sorted(set(oracle[h].tolist()) - set(actual.tolist())), dtype=torch.long)
            before = replay.recorder.steps[i - 1][layer]["pages"][h] if i > 0 else torch.empty(0, dtype=torch.long)
            lost = float(m[unread].sum())
            dropped = float(m[unread[torch.isin(unread, before)]].sum()) / lost if lost > 0 else 0.0
            rows.append({
                "layer": layer, "head": h, "kind": rec[layer]["kinds"][h], "ranked": rec[layer]["ranked"][h],
                "dropped_since_last_step": dropped,
                "actual": got, "oracle": best, "fresh": now,
                "loss": {"stale": max(0.0, now - got) if stable_between else 0.0, "bound miss": selection * share,
                         "outranked": selection * (1 - share), "broad": 1.0 - best},
                "missed_pages": [int(p) for p in missing[m[missing].argsort(descending=True)][:4]],
                "fresh_is_actual": (not stable_between and set(fresh[h].tolist()) == set(actual.tolist())),
            })
    return rows


def diagnose_step(replay: StepReplay, i: int, dense_token: int, miss_token: int, max_heads: int = 12) -> dict:
    """Counterfactual re-runs of step `i` (module docstring, question 2) and the per-head mass table."""
    actual = replay.actual(i)

    def margin(lp):  # logit lead of dense's token over FlexiCache's; > 0: dense's token wins that pair
        return float(lp[dense_token] - lp[miss_token])

    base = replay.logits(i, actual)
    res = {"replay_top1": int(base.argmax()), "replay_margin": margin(base)}
    for name, policy in (("fresh", replay.fresh(i)), ("oracle", replay.oracle), ("dense", replay.dense)):
        lp = replay.logits(i, policy)
        res[name] = {"top1_is_dense": int(lp.argmax()) == dense_token, "margin": margin(lp)}
    heads = [(l, h) for l in replay.kv for h in range(replay.kv[l][0].shape[1])]
    gains = []
    for lh in heads:
        lp = replay.logits(i, replay.override(actual, {lh}, replay.dense))
        gains.append((margin(lp) - res["replay_margin"], lh))
    gains.sort(reverse=True)
    res["head_gain"] = [{"layer": l, "head": h, "gain": g} for g, (l, h) in gains[:max_heads]]
    res["heads_to_flip"] = None
    chosen = set()
    for _, lh in gains[:max_heads]:
        chosen.add(lh)
        lp = replay.logits(i, replay.override(actual, chosen, replay.dense))
        if int(lp.argmax()) == dense_token:
            res["heads_to_flip"] = len(chosen)
            break
    res["heads"] = head_losses(replay, i)
    return res


def verdict(step: dict) -> str:
    """The miss's cause: "earlier tokens" when not even exact attention at every head gives dense's token (the K/V of
    the tokens before differ); else the cause that lost the most mass at the decisive heads (the fewest heads whose
    exact attention flips the step; the 3 of largest gain when 12 do not)."""
    if not step["dense"]["top1_is_dense"]:
        return "earlier tokens"
    decisive = {(g["layer"], g["head"]) for g in step["head_gain"][: step["heads_to_flip"] or 3]}
    rows = [r for r in step["heads"] if (r["layer"], r["head"]) in decisive]
    lost = {c: sum(r["loss"][c] for r in rows) for c in CAUSES}
    return max(lost, key=lost.get)


# -- cases -------------------------------------------------------------------------------------------------------------
def cases_for(sources: Sequence[str], tokenizer, model_folder, *, leval_data=None, prompt_tokens: int = 4096,
              new_tokens: int = 64, model=None) -> list[Case]:
    """Cases from source specs: `demo` (the demo's document and question, 24 tokens), `ruler:TASK:LENGTH:SAMPLE[:kjv]`
    (lm-eval's RULER prompt; `kjv`: an essay task on the King James Bible), `leval:TASK:INDEX` (the harness's L-Eval prompt cut to `prompt_tokens`, `new_tokens`),
    `kjv:OFFSET` (`prompt_tokens` of King James text teacher-forced on its next `new_tokens`). `model`: the model a
    `ruler:` source's harness wraps (needed by those)."""
    if model is not None:
        _ruler_case.model = model
    cases = []
    for source in sources:
        kind, *rest = source.split(":")
        if kind == "demo":
            from fc_hf.demo.question import build_prompt

            ids, _ = build_prompt(tokenizer, 7168)
            cases.append(Case(source, ids[0].tolist(), None, 24))
        elif kind == "ruler":
            cases.append(_ruler_case(source, rest, tokenizer, model_folder))
        elif kind == "leval":
            from .leval import load_leval, prompt_ids

            task, index = rest[0], int(rest[1])
            samples = load_leval(task, leval_data, index + 1, tokenizer, prompt_tokens)
            if not samples:
                raise FileNotFoundError(f"{source}: no L-Eval data for {task!r} (give --leval-data, the folder of "
                                        "<task>.jsonl files)")
            sample = samples[index]
            eos = tokenizer.eos_token_id
            cases.append(Case(source, prompt_ids(tokenizer, sample), None, new_tokens,
                              lambda toks, eos=eos: toks[-1] == eos, {"task": task}))
        elif kind == "kjv":
            from fc_hf.assets import text_tokens

            ids = list(text_tokens(tokenizer, prompt_tokens + new_tokens, int(rest[0]) if rest else 0))
            cases.append(Case(source, ids[:prompt_tokens], ids[prompt_tokens:], new_tokens, meta={"task": "fidelity"}))
        else:
            raise ValueError(f"unknown source {source!r}: use demo, ruler:TASK:LENGTH:SAMPLE, leval:TASK:INDEX or "
                             "kjv:OFFSET")
    return cases


def _ruler_case(source, rest, tokenizer, model_folder) -> Case:
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    from .lm_eval_model import FlexiCacheLM
    from .ruler import answer_stop, ruler_samples

    task, length, sample = rest[0], int(rest[1]), int(rest[2])
    haystack = rest[3] if len(rest) > 3 else "hub"  # ruler:TASK:LENGTH:SAMPLE:kjv (an essay task, offline)
    lm = FlexiCacheLM(pretrained=_ruler_case.model, tokenizer=tokenizer, method="dense", batch_size=1,
                      max_length=length + 512)
    _, samples = ruler_samples(task, length, sample + 1, model_folder, haystack)
    s = samples[sample]
    kwargs = normalize_gen_kwargs(dict(s.gen_kwargs), lm.max_gen_toks)
    eos = lm.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen = int(kwargs.pop("max_gen_toks"))
    ids, _ = lm.tok_batch_encode([s.context], left_truncate_len=lm.max_length - max_gen, truncation=lm.truncation)
    eos_ids = {tokenizer.eos_token_id}
    return Case(source, ids[0].tolist(), None, max_gen, answer_stop(lm, until, eos_ids),
                {"outputs": s.doc.get("outputs"), "task": task})


# -- one case ----------------------------------------------------------------------------------------------------------
def case_reference(model, reuse, model_name: str, case: Case, profile_arg: str | None = None):
    """`(prefill, target, dense log-probs, profile, note)` of one case: its prompt's dense prefill (`reuse`, a
    `PrefixReuse`: a document's questions share it), dense's answer (`dense_reference`) and the profile the case's own
    evaluation runs with (made without its task's material; the demo's: bundled)."""
    from .profile_choice import resolve_profile

    prefill = reuse(case.prompt_ids)
    target, dense = dense_reference(model, prefill, case)
    profile, note = resolve_profile(model_name, model.config, case.meta.get("task", case.name), profile_arg)
    return prefill, target, dense, profile, note


@torch.inference_mode()
def dense_reference(model, prefill, case: Case) -> tuple[list[int], torch.Tensor]:
    """`(target, log-probs [S, V])`: the case's forced tokens (dense's greedy answer when it has none) and dense's
    prediction of each from the tokens before it, the first from the prefill."""
    from .shared_prefill import forced_decode

    first = torch.log_softmax(prefill.logits.float(), -1)
    if case.target is not None:
        return case.target, torch.stack([first] + list(forced_decode(model, prefill, "dense", None, case.target[:-1])))
    cache = load_prefill(prefill, None, model, "dense")
    device = next(model.parameters()).device
    target, logprobs = [int(first.argmax())], [first]
    while len(target) < case.new_tokens and not (case.stop and case.stop(target)):
        out = model(input_ids=torch.tensor([[target[-1]]], device=device), use_cache=True, **cache_kwargs(model, cache))
        logprobs.append(torch.log_softmax(out.logits[0, -1].float(), -1))
        target.append(int(logprobs[-1].argmax()))
    return target, torch.stack(logprobs)


def compare_case(model, case: Case, prefill, target, dense, cfg, profile, log=print, versus=None) -> dict:
    """One method teacher-forced on `target` against dense's log-probs `dense [S, V]`: where its top-1 parts from
    dense's, and a diagnosis of every confident miss. `versus` (`(model, prefill)` in another dtype, e.g. bf16): that
    model's dense decoding takes FlexiCache's place, without a diagnosis (how a rounding-sized perturbation parts)."""
    from fc_hf.cache import FlexiCache

    from .shared_prefill import forced_decode

    cache = None
    if versus is None:
        cache = FlexiCache(model.config, cfg, profile)
        other, recorder = flexicache_forced(model, prefill, cache, target[:-1])
        first = int(dense[0].argmax())  # step 0 predicts from the prefill: dense for FlexiCache too (exact)
    else:
        other = torch.stack(list(forced_decode(versus[0], versus[1], "dense", None, target[:-1])))
        first = int(versus[1].logits.argmax())
    d_top, d_margin = step_margins(dense)
    o_top = [first] + step_margins(other)[0]
    parts = [s for s in range(len(target)) if o_top[s] != d_top[s]]
    row = {"case": case.name, "prompt_tokens": len(case.prompt_ids), "steps": len(target), "target": target,
           "dense_margin": d_margin, "method_top1": o_top, "dense_top1": d_top, "first_part": parts[0] if parts else None,
           "first_part_margin": d_margin[parts[0]] if parts else None,
           "confident_parts": [s for s in parts if d_margin[s] >= CONFIDENT], "misses": []}
    if cache is not None and row["confident_parts"]:
        replay = StepReplay(model, cache, len(case.prompt_ids), target[:-1], recorder)
        for s in row["confident_parts"]:
            i = s - 1  # prediction s comes from decode step i (fed target[i])
            step = diagnose_step(replay, i, d_top[s], o_top[s])
            step.update({"step": s, "dense_token": d_top[s], "flexicache_token": o_top[s], "margin": d_margin[s]})
            step["verdict"] = verdict(step)
            row["misses"].append(step)
            log(f"  {case.name} step {s}: margin {d_margin[s]:.2f}, {step['verdict']}; "
                f"replay top-1 {'ok' if step['replay_top1'] == o_top[s] else 'DIFFERS'}")
    if cache is not None:
        cache.release()
    return row


def variant_name(options: dict | str) -> str:
    """A variant's name in the results: "default", "carry_pages=0", "dense-bfloat16"."""
    if isinstance(options, str):
        return options
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "default"


def run_misses(model_name: str, sources: Sequence[str], out: str | Path, variants=({},), budget: int = 1024,
               profile_arg: str | None = None, dtype: str = "float32", leval_data=None, prompt_tokens: int = 4096,
               new_tokens: int = 64, log=print) -> list[dict]:
    """Every case of `sources` against every variant, one dense reference per case (resumable: one JSON line per
    case and variant in `out`); returns the rows. A variant is a dict of `FlexiCacheConfig` fields on top of the
    default, or "dense-<dtype>": dense decoding in that dtype (the noise floor's partings)."""
    from .loading import load_model
    from .methods import prepare_model
    from .shared_prefill import PrefixReuse

    model, tok, folder = load_model(model_name, dtype)
    prepare_model(model, "flexicache")
    others = {v: prepare_model(load_model(model_name, v.split("-", 1)[1])[0], "dense")
              for v in variants if isinstance(v, str)}
    reuse = {None: PrefixReuse(model), **{v: PrefixReuse(m) for v, m in others.items()}}
    log(f"misses: {model_name}, budget {budget}, variants {[variant_name(v) for v in variants]}")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = read_jsonl(path) if path.exists() else []
    done = {(r["case"], r["variant"]) for r in rows}
    todo = [s for s in sources if any((s, variant_name(v)) not in done for v in variants)]
    for case in cases_for(todo, tok, folder, leval_data=leval_data, prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                          model=model):
        prefill, target, dense, profile, note = case_reference(model, reuse[None], model_name, case, profile_arg)
        for variant in variants:
            name = variant_name(variant)
            if (case.name, name) in done:
                continue
            if isinstance(variant, str):
                row = compare_case(model, case, prefill, target, dense, None, None, log,
                                   versus=(others[variant], reuse[variant](case.prompt_ids)))
            else:
                cfg = FlexiCacheConfig(**{"token_budget": budget, **variant})
                row = compare_case(model, case, prefill, target, dense, cfg, profile, log)
            row.update({"variant": name, "profile_note": note})
            rows.append(row)
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


# -- report ------------------------------------------------------------------------------------------------------------
def misses_markdown(rows: Sequence[dict], title: str = "") -> str:
    """Per variant: per-case first parting and confident misses; over every confident miss, the lost mass by cause
    and layer."""
    variants = list(dict.fromkeys(r.get("variant", "default") for r in rows))
    return "\n\n".join(_variant_markdown([r for r in rows if r.get("variant", "default") == v], f"{title}: {v}")
                       for v in variants)


def _variant_markdown(rows: Sequence[dict], title: str) -> str:
    parted = [r for r in rows if r["first_part"] is not None]
    near = sum(r["first_part_margin"] < CONFIDENT for r in parted)
    steps = sum(r["steps"] for r in rows)
    sure = sum(m >= CONFIDENT for r in rows for m in r["dense_margin"])
    lines = [f"### {title}" if title else "", "",
             f"{len(rows)} cases, {len(parted)} part from dense; at the first parting dense's margin is below "
             f"{CONFIDENT:g} nats in {near} of {len(parted)}. Over all {steps} teacher-forced steps: top-1 = dense's at "
             f"{sum(a == b for r in rows for a, b in zip(r['method_top1'], r['dense_top1']))}; of the {sure} steps where "
             f"dense's margin is >= {CONFIDENT:g}, {sum(len(r['confident_parts']) for r in rows)} differ.", "",
             "| case | steps | first parting (step, dense margin) | confident misses: step, margin, verdict, heads to flip |",
             "|---|---|---|---|"]
    misses = []
    for r in rows:
        first = "-" if r["first_part"] is None else f"{r['first_part']}, {r['first_part_margin']:.2f}"
        ms = "; ".join(f"{m['step']}, {m['margin']:.1f}, {m['verdict']}, {m['heads_to_flip'] or '>12'}"
                       for m in r["misses"]) or "-"
        lines.append(f"| {r['case']} | {r['steps']} | {first} | {ms} |")
        misses.extend(r["misses"])
    if not misses:
        return "\n".join(lines)
    verdicts = {v: sum(m["verdict"] == v for m in misses) for v in (*CAUSES, "earlier tokens")}
    lines += ["", "Causes (the largest loss at the decisive heads, `verdict`): "
              + ", ".join(f"{v} {n}" for v, n in verdicts.items() if n), ""]
    # Lost mass by cause: over all heads, and over the heads whose exact attention moves the margin most (top 3).
    for label, pick in (("every head", lambda m: m["heads"]),
                        ("the 3 decisive heads", lambda m: [r for r in m["heads"] if (r["layer"], r["head"]) in
                                                            {(g["layer"], g["head"]) for g in m["head_gain"][:3]}])):
        totals = {c: sum(r["loss"][c] for m in misses for r in pick(m)) for c in CAUSES}
        whole = sum(totals.values()) or 1.0
        lines.append(f"- lost mass at {label}: " + ", ".join(f"{c} {totals[c] / whole:.0%}" for c in CAUSES))
    dec = [r for m in misses for r in m["heads"]
           if (r["layer"], r["head"]) in {(g["layer"], g["head"]) for g in m["head_gain"][: m["heads_to_flip"] or 3]}]
    lines.append("- of the mass the decisive heads missed (oracle pages they did not read), on pages they had read at "
                 f"the previous step: {sum(r['dropped_since_last_step'] for r in dec) / max(1, len(dec)):.0%} (mean over "
                 f"{len(dec)} heads)")
    lines.append("- a re-run with every head re-ranked now (fresh) / the oracle's pages / exact attention gives dense's "
                 f"token at {sum(m['fresh']['top1_is_dense'] for m in misses)} / "
                 f"{sum(m['oracle']['top1_is_dense'] for m in misses)} / {sum(m['dense']['top1_is_dense'] for m in misses)}"
                 f" of {len(misses)} misses")
    decisive: dict[tuple, list] = {}
    for m in misses:
        for g in m["head_gain"][:3]:
            r = next(r for r in m["heads"] if (r["layer"], r["head"]) == (g["layer"], g["head"]))
            decisive.setdefault((g["layer"], g["head"], r["kind"]), []).append((g["gain"], r))
    lines += ["", "| decisive (layer, KV head) | kind | misses | mean margin gain if exact | actual / fresh / oracle mass "
              "| main cause |", "|---|---|---|---|---|---|"]
    for (l, h, kind), items in sorted(decisive.items(), key=lambda kv: -len(kv[1])):
        n = len(items)
        mean = lambda key: sum(r[key] for _, r in items) / n  # noqa: E731
        causes = {c: sum(r["loss"][c] for _, r in items) for c in CAUSES}
        lines.append(f"| ({l}, {h}) | {kind} | {n} | {sum(g for g, _ in items) / n:.2f} | "
                     f"{mean('actual'):.3f} / {mean('fresh'):.3f} / {mean('oracle'):.3f} | {max(causes, key=causes.get)} |")
    return "\n".join(lines)

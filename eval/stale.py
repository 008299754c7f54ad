"""Stale stable heads: how much mass a stable head loses between its re-ranks, and whether a free signal predicts it.

Teacher-forced like `eval/misses.py` (same cases, dense's greedy answers), at every decode step and every stable
(layer, KV head) that did not rank at that step: the true mass its resident pages captured (`actual`) and what the
cache's own ranking would capture now (`fresh`); their difference is the stale loss. Beside it, signals a trigger could
read at no extra bytes (the step's query and the resident pages' logits are in hand):

- `cos`: the cosine between the query and the query at the head's last ranking (mean over the GQA group);
- `lse_drop`: how far the log-sum-exp of the resident logits fell since the last ranking (max over the group);
- `since`: steps since the last ranking (what `rerank_interval` acts on; each stable head ranks at its own phase of
  it, `fc_hf/schedule.py`).

    flexicache eval stale --model qwen2.5-coder-0.5b-instruct --sources leval:financial_qa:2 --out stale.jsonl

The report gives the stale loss by `since` and, per signal, the AUC for losses over 0.2 and the share of all stale loss
at the head-steps a trigger firing at 2 / 5 / 10% of them would re-rank (an upper bound: a re-rank also helps the steps
after it, which this does not count).
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch

from fc_hf.config import FlexiCacheConfig

from .misses import StepReplay, case_reference, cases_for, exact_logits, flexicache_forced, fresh_selection, page_mass
from .sources import read_jsonl

BIG = 0.2  # a stale loss this large is what a trigger must catch
SIGNALS = {"cos": -1, "lse_drop": 1, "since": 1}  # sign: larger = more likely stale


def stale_rows(model, cache, case_name: str, prompt_len: int, forced, recorder, cfg) -> list[dict]:
    """One row per (step, stable head between re-ranks) of a finished teacher-forced run (module docstring)."""
    replay = StepReplay(model, cache, prompt_len, forced, recorder)
    last, rows = {}, []
    for i, rec in enumerate(recorder.steps):
        for layer in replay.kv:
            r = rec[layer]
            heads = sorted(h for h, kind in r["kinds"].items() if kind == "stable")
            if not heads:
                continue
            q, k, v, scaling = replay.layer_step(i, layer)
            logits = exact_logits(q, k, scaling)
            mass = page_mass(q, k, scaling, cfg.page_size, logits)
            fresh = None if all(r["ranked"][h] for h in heads) else fresh_selection(cfg, q, k, v, scaling,
                                                                                     r["carried"])[0]
            for h in heads:
                pages = r["pages"][h]
                tokens = (pages[:, None] * cfg.page_size + torch.arange(cfg.page_size)).flatten()
                lse = torch.logsumexp(logits[h][:, tokens[tokens < k.shape[1]]], -1)
                if r["ranked"][h]:
                    last[(layer, h)] = (q[h].clone(), lse, i)
                    continue
                q0, lse0, i0 = last[(layer, h)]
                rows.append({"case": case_name, "step": i, "layer": layer, "head": h, "since": i - i0,
                             "actual": float(mass[h][pages].sum()), "fresh": float(mass[h][fresh[h]].sum()),
                             "cos": float(torch.nn.functional.cosine_similarity(q[h], q0, dim=-1).mean()),
                             "lse_drop": float((lse0 - lse).max())})
    return rows


def run_stale(model_name: str, sources: Sequence[str], out: str | Path, options: dict, budget: int = 1024,
              leval_data=None, log=print) -> list[dict]:
    """Every case of `sources` under FlexiCache's default (plus `options`); appends rows to `out` (resumed per case)."""
    from fc_hf.cache import FlexiCache

    from .loading import load_model
    from .methods import prepare_model
    from .shared_prefill import PrefixReuse

    model, tok, folder = load_model(model_name, "float32")
    prepare_model(model, "flexicache")
    reuse = PrefixReuse(model)
    cfg = FlexiCacheConfig(**{"token_budget": budget, **options})
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = read_jsonl(path) if path.exists() else []
    done = {r["case"] for r in rows}
    for case in cases_for([s for s in sources if s not in done], tok, folder, leval_data=leval_data, model=model):
        prefill, target, _, profile, _ = case_reference(model, reuse, model_name, case)
        cache = FlexiCache(model.config, cfg, profile)
        _, recorder = flexicache_forced(model, prefill, cache, target[:-1])
        new = stale_rows(model, cache, case.name, len(case.prompt_ids), target[:-1], recorder, cfg)
        cache.release()
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        rows += new
        log(f"  {case.name}: {len(new)} stable head-steps between re-ranks")
    return rows


def _auc(pos: list[float], neg: list[float]) -> float:
    ns = sorted(neg)
    wins = sum(bisect.bisect_left(ns, p) + 0.5 * (bisect.bisect_right(ns, p) - bisect.bisect_left(ns, p)) for p in pos)
    return wins / max(1, len(pos) * len(neg))


def stale_markdown(rows: Sequence[dict]) -> str:
    loss = [max(0.0, r["fresh"] - r["actual"]) for r in rows]
    total = sum(loss) or 1.0
    big = [x > BIG for x in loss]
    cases = len({r["case"] for r in rows})
    lines = [f"{len(rows)} stable head-steps between re-ranks ({cases} cases); mean stale loss "
             f"{sum(loss) / max(1, len(loss)):.3f}, over {BIG:g} at {sum(big)}.", "",
             "| steps since the last ranking | head-steps | mean stale loss | losses over 0.2 |", "|---|---|---|---|"]
    by_since = defaultdict(list)
    for r, x in zip(rows, loss):
        by_since[r["since"]].append(x)
    lines += [f"| {s} | {len(v)} | {sum(v) / len(v):.3f} | {sum(x > BIG for x in v)} |"
              for s, v in sorted(by_since.items())]
    lines += ["", "| signal | AUC (loss > 0.2) | stale loss at the top 2% / 5% / 10% of head-steps |", "|---|---|---|"]
    for name, sign in SIGNALS.items():
        vals = [sign * r[name] for r in rows]
        order = sorted(range(len(rows)), key=lambda i: -vals[i])
        caught = [sum(loss[i] for i in order[:int(rate * len(rows))]) / total for rate in (0.02, 0.05, 0.10)]
        auc = _auc([v for v, b in zip(vals, big) if b], [v for v, b in zip(vals, big) if not b])
        lines.append(f"| {name} | {auc:.2f} | " + " / ".join(f"{c:.0%}" for c in caught) + " |")
    return "\n".join(lines)

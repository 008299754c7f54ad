"""Speculative decoding with FlexiCache: `flexicache bench speculative` (speed) and `speculative-check` (tokens).

`speculative`: decode tokens/s of prompt-lookup decoding (`generate(..., prompt_lookup_num_tokens=k)`) against plain
greedy decoding, for dense (`DynamicCache` + sdpa) and FlexiCache, on real long-document answers: L-Eval open-ended
questions with the document cut (head and tail) to `--spec-length` tokens, answered by a bundled model. Per prompt
the four cases run one after another in one worker, in alternating order (ABCD, then DCBA), so load drift hits all
four; the ratios are read side by side. Decoding starts after the first forward (the prefill, which in assisted
decoding also verifies the first candidates): decode tokens/s = tokens after it / seconds after it, and tokens per
forward = those tokens / the forwards after it (accepted candidates + 1 per verification).

`speculative-verify`: what one verification forward of T tokens (a draft of T - 1 and the last token) costs against
one decode step, for dense and FlexiCache on one L-Eval prompt: median forward seconds over `--verify-repeats`
alternating runs, each followed by `crop(-T)`, so every run starts from the same state.

`speculative-check`: greedy generate with prompt lookup and with an assistant model gives exactly the tokens of
plain greedy decoding with the same cache configuration: at `--check-budget` FlexiCache's own, at a budget holding
every token dense's (`DynamicCache` + sdpa). The assistant is the model's own weights with dense attention, or
another bundled model (then transformers' universal assisted decoding, which translates between the tokenizers).

    flexicache bench speculative --out results/bench            # SmolLM2, L-Eval at 8k
    flexicache bench speculative-check --out results/bench      # SmolLM2 and Qwen2.5-0.5B, 20 prompts each
    flexicache bench speculative-verify --out results/bench     # SmolLM2 at 8k, T = 1, 4, 11
    flexicache bench speculative speculative-check --smoke --out /tmp/b
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .common import build_model, environment, log, model_config, parse_sizes, run_worker, write_json

__all__ = ["suite_speculative", "suite_check", "suite_verify", "speed_worker", "check_worker", "verify_worker"]

SMOKE_MODEL = "tiny"  # random weights, synthetic prompts: the suites' code paths in seconds


# -- prompts and models -----------------------------------------------------------------------------------------

def _load(name: str, impl: str):
    """`(model, tokenizer)`: a bundled model (real weights) or, for "tiny", a random-weight model and no tokenizer."""
    from fc_hf.eval.methods import prepare_model

    if name == SMOKE_MODEL:
        model, tok = build_model(model_config(SMOKE_MODEL, max_positions=4096)), None
    else:
        from fc_hf.assets import load_model

        model, tok = load_model(name)
    return prepare_model(model, impl), tok


def _profile(name: str, config):
    from fc_hf import HeadProfile

    from .common import spread_profile

    if name == SMOKE_MODEL:
        return spread_profile(config)
    from fc_hf.profile import PROFILE_DIR

    return HeadProfile.load(str(Path(PROFILE_DIR) / f"{name}.json"), config=config)


def _prompts(tok, spec: dict) -> list[dict]:
    """`[{"ids": [...], "task": ...}]`: the first question of each L-Eval document (tasks in turn) after the document,
    as a chat turn (or, with `spec["source"] == "kjv-recall"`, a King James passage that ends by asking to repeat an
    earlier part of it), at most `spec["length"] - spec["new"]` tokens (the document cut in the middle) and at least
    `spec["shortest"]` of that; synthetic ones (a span seen twice) for the smoke model."""
    n, limit = spec["prompts"], spec["length"] - spec["new"]
    if tok is None:
        g = torch.Generator().manual_seed(0)
        out = []
        for i in range(n):
            span = torch.randint(3, 90, (24,), generator=g).tolist()
            filler = torch.randint(3, 90, (limit - 60,), generator=g).tolist()
            out.append({"ids": (filler + span + span[:12])[:limit], "task": "synthetic"})
        return out
    if spec.get("source") == "kjv-recall":  # a passage that ends by asking to repeat an earlier part of it
        from fc_hf.profiler.tasks import build_prompt

        # built a little short (the builder lands within a few percent), never cut: the request is at the end
        prompts = [build_prompt("kjv-recall", tok, int(limit * 0.94), sample=i).input_ids[0].tolist() for i in range(n)]
        if max(map(len, prompts)) > limit:
            raise ValueError(f"a kjv-recall prompt of {max(map(len, prompts))} tokens exceeds {limit}")
        return [{"ids": ids, "task": "kjv-recall"} for ids in prompts]
    per_task = {}
    for task in spec["tasks"]:
        path = Path(spec["data"]) / f"{task}.jsonl"
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            prompts = (_leval_prompt(tok, r["input"], r["instructions"][0], limit) for r in records if r["instructions"])
            per_task[task] = [ids for ids in prompts if len(ids) >= spec.get("shortest", 0) * limit]
    out, depth = [], 0
    while len(out) < n and any(depth < len(v) for v in per_task.values()):
        for task, prompts in per_task.items():
            if depth < len(prompts) and len(out) < n:
                out.append({"ids": prompts[depth], "task": task})
        depth += 1
    if len(out) < n:
        raise ValueError(f"only {len(out)} L-Eval prompts found under {spec['data']} (asked for {n})")
    return out


def _leval_prompt(tok, document: str, instruction: str, limit: int) -> list[int]:
    """The document and the instruction as one chat turn, the document's middle cut to fit `limit` tokens."""
    def encode(doc_ids):
        text = (f"Read the document and follow the instruction.\n\nDocument:\n{tok.decode(doc_ids)}\n\n"
                f"Instruction: {instruction}\nAnswer:")
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    doc = tok(document, add_special_tokens=False)["input_ids"]
    ids = encode(doc)
    if len(ids) > limit:
        keep = max(0, len(doc) - (len(ids) - limit) - 8)  # decoding and encoding again may shift a few tokens
        doc = doc[: keep // 2] + doc[len(doc) - (keep - keep // 2):]
        ids = encode(doc)
    return list(ids)[:limit]


def _cache(kind: str, model, budget: int, profile):
    from transformers import DynamicCache

    from fc_hf import FlexiCache, FlexiCacheConfig

    if kind == "dense":
        return DynamicCache(config=model.config)
    return FlexiCache(model.config, FlexiCacheConfig(token_budget=budget), profile)


def _generate(model, ids: torch.Tensor, cache, new: int, **kw) -> dict:
    """One greedy generate, timed after its first forward; the generated ids and the counts of `_timed`'s docstring."""
    from fc_hf.compat import cache_kwargs
    from fc_hf.eval.methods import prepare_model

    prepare_model(model, "dense" if type(cache).__name__ == "DynamicCache" else "flexicache")
    held, ends = [], []
    hooks = [model.register_forward_pre_hook(lambda *_: held.append(cache.get_seq_length())),
             model.register_forward_hook(lambda *_: ends.append(time.perf_counter()))]
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0, **cache_kwargs(model, cache), **kw)
        done = time.perf_counter()
    finally:
        for h in hooks:
            h.remove()
    n = ids.shape[1]
    tokens = out[0, n:].tolist()
    first = held[1] - n + 1 if len(held) > 1 else len(tokens)  # what the first forward gave (accepted + 1)
    return {"tokens": tokens, "decode_tokens": len(tokens) - first, "decode_s": done - ends[0],
            "forwards": len(ends) - 1}


# -- speed --------------------------------------------------------------------------------------------------------

METHODS = ("dense", "flexicache")


def _cases(spec: dict) -> list[str]:
    """"dense/plain", "dense/lookup10", ...: each method plain and with each prompt-lookup length."""
    return [f"{m}/{mode}" for m in METHODS for mode in ["plain"] + [f"lookup{k}" for k in spec["lookup"]]]


def _start_worker(spec: dict):
    """A speed worker's start: its threads, its environment line, the model, tokenizer and head profile."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    print(json.dumps({"environment": environment()}), flush=True)
    model, tok = _load(spec["model"], "flexicache")
    return model, tok, _profile(spec["model"], model.config)


def _speed_spec(args) -> dict:
    """The spec of the speed suites (`speculative`, `speculative-verify`) from the command line."""
    return {"model": SMOKE_MODEL if args.smoke else args.spec_model, "length": parse_sizes(args.spec_length)[0],
            "prompts": args.spec_prompts, "new": args.spec_new, "budget": args.spec_budget, "data": args.spec_data,
            "lookup": [int(k) for k in str(args.spec_lookup).split(",")], "threads": args.threads,
            "tasks": [t for t in args.spec_tasks.split(",") if t], "shortest": args.spec_shortest,
            "repeats": args.verify_repeats, "source": args.spec_source}


def _worker_rows(entry: str, spec: dict, timeout: int) -> tuple[list[dict], dict, int | str]:
    """`run_worker`'s rows without the environment line, that environment, and the return code."""
    rows, rc = run_worker(entry, spec, timeout)
    env = next((r["environment"] for r in rows if "environment" in r), environment())
    return [r for r in rows if "environment" not in r], env, rc


def speed_worker(spec: dict) -> None:
    """Every prompt through every case, alternating; one JSON line per run."""
    model, tok, profile = _start_worker(spec)
    prompts = _prompts(tok, spec)
    cases = _cases(spec)
    warm = torch.tensor([prompts[0]["ids"][:128]])
    for case in cases:  # first calls allocate: untimed
        _run_case(model, warm, case, 4, spec, profile)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt["ids"]])
        outputs = {}
        for case in cases if i % 2 == 0 else cases[::-1]:
            row = _run_case(model, ids, case, spec["new"], spec, profile)
            outputs[case] = row.pop("tokens")
            print(json.dumps({"prompt": i, "task": prompt["task"], "prompt_tokens": ids.shape[1], "case": case,
                              **row, "new_tokens": len(outputs[case])}), flush=True)
        for case in cases:  # speculative decoding's tokens are plain greedy decoding's
            method, mode = case.split("/")
            if mode != "plain":
                same = outputs[case] == outputs[f"{method}/plain"]
                print(json.dumps({"prompt": i, "case": case, "same_as_plain": same}), flush=True)


def _run_case(model, ids, case: str, new: int, spec: dict, profile) -> dict:
    method, mode = case.split("/")
    kw = {"prompt_lookup_num_tokens": int(mode[len("lookup"):])} if mode != "plain" else {}
    return _generate(model, ids, _cache(method, model, spec["budget"], profile), new, **kw)


def suite_speculative(args, out: Path) -> None:
    """`flexicache bench speculative`: writes `<out>/speculative.json` and `.md`."""
    spec = _speed_spec(args)
    log(f"speculative: {spec['model']}, {spec['prompts']} prompts of <= {spec['length']} tokens, {spec['new']} new, "
        f"prompt lookup {spec['lookup']}, budget {spec['budget']}")
    rows, env, rc = _worker_rows("speculative_worker", spec, args.timeout)
    write_json(out / "speculative.json", {"environment": env, "environment_end": environment(), "spec": spec,
                                          "rc": rc, "rows": rows})
    (out / "speculative.md").write_text(speed_table(rows, spec, env) + "\n")
    log(f"speculative: wrote {out / 'speculative.md'}")


def speed_table(rows: list[dict], spec: dict, env: dict) -> str:
    """The Markdown table of `suite_speculative`: pooled decode tokens/s per case, the ratios side by side."""
    runs = [r for r in rows if "decode_s" in r]
    cases = _cases(spec)
    per_prompt: dict = {}
    for r in runs:
        per_prompt.setdefault(r["prompt"], {})[r["case"]] = r

    def tps(case: str) -> float:  # pooled over the prompts every case finished
        done = [p[case] for p in per_prompt.values() if len(p) == len(cases)]
        seconds = sum(r["decode_s"] for r in done)
        return sum(r["decode_tokens"] for r in done) / seconds if seconds else float("nan")

    def ratio(a: str, b: str) -> str:  # the pooled ratio, and the median of the per-prompt ratios
        vals = [p[a]["decode_tokens"] / p[a]["decode_s"] / (p[b]["decode_tokens"] / p[b]["decode_s"])
                for p in per_prompt.values() if a in p and b in p and p[a]["decode_s"] and p[b]["decode_s"]]
        return f"{tps(a) / tps(b):.2f} (median {statistics.median(vals):.2f})" if vals else "-"

    def per_forward(case: str) -> str:
        mine = [r for r in runs if r["case"] == case]
        forwards = sum(r["forwards"] for r in mine)
        return f"{sum(r['decode_tokens'] for r in mine) / forwards:.2f}" if forwards else "-"

    complete = [p for p in per_prompt.values() if len(p) == len(cases)]
    lengths = [r["prompt_tokens"] for p in complete for r in list(p.values())[:1]]
    tasks = sorted({r["task"] for p in complete for r in list(p.values())[:1]})
    lines = [
        f"{spec['model']}, {len(complete)} prompts ({', '.join(tasks)}; {min(lengths, default=0)}-"
        f"{max(lengths, default=0)} tokens), up to {spec['new']} new tokens, greedy; FlexiCache budget "
        f"{spec['budget']} with its head profile; {env.get('cpus')} CPUs, {env.get('torch_threads')} torch threads, "
        f"load {env.get('loadavg_1m', 0):.1f} at the start. Decode tokens/s pooled over the prompts (tokens after the "
        "first forward / seconds after it); ratios pooled (median of the per-prompt ratios).",
        "",
        "| method | decoding | tok/s | / plain | tokens per forward | same tokens as plain |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        method, mode = case.split("/")
        same = [r["same_as_plain"] for r in rows if r.get("case") == case and "same_as_plain" in r]
        label = "plain" if mode == "plain" else f"prompt lookup {mode[len('lookup'):]}"
        lines.append(f"| {method} | {label} | {tps(case):.2f} | "
                     f"{'-' if mode == 'plain' else ratio(case, f'{method}/plain')} | {per_forward(case)} | "
                     f"{'-' if mode == 'plain' else f'{sum(same)}/{len(same)}'} |")
    modes = ["plain"] + [f"lookup{k}" for k in spec["lookup"]]
    lines += ["", "FlexiCache / dense: " + ", ".join(
        f"{'plain' if m == 'plain' else 'prompt lookup ' + m[len('lookup'):]} {ratio(f'flexicache/{m}', f'dense/{m}')}"
        for m in modes) + "."]
    return "\n".join(lines)


# -- the cost of one verification ---------------------------------------------------------------------------------

def verify_worker(spec: dict) -> None:
    """Forward seconds of T tokens on a filled cache (then cropped back), per method and T, alternating."""
    from fc_hf.compat import cache_kwargs
    from fc_hf.eval.methods import prepare_model

    model, tok, profile = _start_worker(spec)
    ids = torch.tensor([_prompts(tok, {**spec, "prompts": 1})[0]["ids"]])
    n, sizes = ids.shape[1], [1] + [k + 1 for k in spec["lookup"]]
    caches = {}
    with torch.no_grad():
        for method in METHODS:
            prepare_model(model, method)
            cache = _cache(method, model, spec["budget"], profile)
            kw = cache_kwargs(model, cache)
            token = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw).logits[:, -1:].argmax(-1)
            for pos in range(n, n + 8):  # a few plain steps first: the first ranking and its promotions are done
                out = model(input_ids=token, use_cache=True, cache_position=torch.tensor([pos]), logits_to_keep=1, **kw)
                token = out.logits[:, -1:].argmax(-1)
            if method != "dense":
                cache.forward.loop_prompt_end = n  # what transformers' assisted loop tells the cache (fc_hf/speculative.py)
                cache.activate_past_recording()
            caches[method] = (cache, kw)
        for rep in range(spec["repeats"] + 1):  # the first round is a warm-up: not printed
            for method in METHODS if rep % 2 == 0 else METHODS[::-1]:
                prepare_model(model, method)
                cache, kw = caches[method]
                pos = cache.get_seq_length()
                for t in sizes:
                    start = time.perf_counter()
                    model(input_ids=ids[:, 100:100 + t], use_cache=True, cache_position=torch.arange(pos, pos + t),
                          logits_to_keep=t, **kw)
                    seconds = time.perf_counter() - start
                    cache.crop(-t)
                    if rep:
                        print(json.dumps({"method": method, "tokens": t, "seconds": seconds, "prompt_tokens": n}),
                              flush=True)


def suite_verify(args, out: Path) -> None:
    """`flexicache bench speculative-verify`: writes `<out>/speculative_verify.json` and `.md`."""
    spec = _speed_spec(args)
    log(f"speculative-verify: {spec['model']}, one prompt of <= {spec['length']} tokens, T = 1 and lookup + 1")
    rows, env, rc = _worker_rows("speculative_verify_worker", spec, args.timeout)
    write_json(out / "speculative_verify.json", {"environment": env, "spec": spec, "rc": rc, "rows": rows})

    def median(method, t):
        vals = [r["seconds"] for r in rows if r["method"] == method and r["tokens"] == t]
        return statistics.median(vals) if vals else float("nan")

    sizes = sorted({r["tokens"] for r in rows})
    length = rows[0]["prompt_tokens"] if rows else 0
    lines = [f"{spec['model']}, one forward of T tokens on a cache holding {length} tokens (then cropped back), median of "
             f"{spec['repeats']} alternating runs; FlexiCache budget {spec['budget']} with its head profile; "
             f"{env.get('cpus')} CPUs, {env.get('torch_threads')} torch threads. T = 1 is a plain decode step; T = k + 1 "
             "verifies k drafts.", "",
             "| T | dense ms | FlexiCache ms | dense: / step | FlexiCache: / step | FlexiCache / dense |", "|---|---|---|---|---|---|"]
    for t in sizes:
        d, f = median("dense", t), median("flexicache", t)
        lines.append(f"| {t} | {d * 1e3:.1f} | {f * 1e3:.1f} | {d / median('dense', 1):.2f} | "
                     f"{f / median('flexicache', 1):.2f} | {f / d:.2f} |")
    (out / "speculative_verify.md").write_text("\n".join(lines) + "\n")
    log(f"speculative-verify: wrote {out / 'speculative_verify.md'}")


# -- tokens -------------------------------------------------------------------------------------------------------

def check_worker(spec: dict) -> None:
    """For each prompt: plain greedy, prompt lookup and assisted decoding at the budget and at a full budget (against
    dense); one JSON line per prompt with the generated ids' agreement."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model, tok = _load(spec["model"], "flexicache")
    profile = _profile(spec["model"], model.config)
    if spec["assistant"] in ("self", spec["model"]):
        assistant, assist_kw = _load(spec["model"], "dense")[0], {}
    else:  # another tokenizer: transformers translates the drafts (universal assisted decoding)
        assistant, assistant_tok = _load(spec["assistant"], "dense")
        assist_kw = {"tokenizer": tok, "assistant_tokenizer": assistant_tok}
    full = 1 << (spec["length"] + spec["new"]).bit_length()
    for i, prompt in enumerate(_prompts(tok, spec)):
        ids, new = torch.tensor([prompt["ids"]]), spec["new"]
        modes = {"plain": {}, "lookup": {"prompt_lookup_num_tokens": spec["lookup"]},
                 "assisted": {"assistant_model": assistant, **assist_kw}}
        row = {"prompt": i, "task": prompt["task"], "prompt_tokens": ids.shape[1]}
        dense = _generate(model, ids, _cache("dense", model, 0, None), new)["tokens"]
        plain = _generate(model, ids, _cache("flexicache", model, spec["budget"], profile), new)["tokens"]
        row["budget/plain=dense"] = plain == dense  # how often the budget changes the answer (not a requirement)
        for label, budget, reference in (("budget", spec["budget"], plain), ("full", full, dense)):
            for mode, kw in modes.items():
                if label == "budget" and mode == "plain":
                    continue  # that is the reference
                got = _generate(model, ids, _cache("flexicache", model, budget, profile), new, **kw)
                row[f"{label}/{mode}"] = got["tokens"] == reference
                row[f"{label}/{mode}/per_forward"] = round(got["decode_tokens"] / max(1, got["forwards"]), 2)
        print(json.dumps(row), flush=True)
        differ = [k for k, v in row.items() if v is False]  # progress on stderr; the rows reach stdout at the end
        log(f"speculative-check: {spec['model']} prompt {i + 1}/{spec['prompts']}: {', '.join(differ) or 'all equal'}")


def suite_check(args, out: Path) -> None:
    """`flexicache bench speculative-check`: writes `<out>/speculative_check.json` and `.md`."""
    models = [SMOKE_MODEL] if args.smoke else [m for m in args.check_models.split(",") if m]
    lines = ["Greedy tokens of speculative decoding against plain decoding's with the same cache configuration "
             "(prompts that agree / prompts); at a full budget against dense (DynamicCache + sdpa). The last column "
             "is only how often the budget changes the answer.", "",
             "| model | prompts (mean tokens) | new tokens | budget: prompt lookup = plain | budget: assisted = plain | "
             "full: prompt lookup = dense | full: assisted = dense | full: plain = dense | budget: plain = dense |",
             "|---|---|---|---|---|---|---|---|---|"]
    results = {"environment": environment(), "models": {}}
    for name in models:
        spec = {"model": name, "length": parse_sizes(args.check_length)[0], "prompts": args.check_prompts,
                "new": args.check_new, "lookup": int(str(args.spec_lookup).split(",")[0]), "budget": args.check_budget,
                "data": args.spec_data, "threads": args.threads, "tasks": [t for t in args.spec_tasks.split(",") if t],
                "assistant": "self" if args.smoke else args.check_assistant}
        log(f"speculative-check: {name}, {spec['prompts']} prompts, assistant {spec['assistant']}")
        rows, rc = run_worker("speculative_check_worker", spec, args.timeout)
        results["models"][name] = {"spec": spec, "rc": rc, "rows": rows}

        def count(key):
            return f"{sum(r[key] for r in rows)}/{len(rows)}"

        mean = statistics.mean(r["prompt_tokens"] for r in rows) if rows else 0
        lines.append(f"| {name} (assistant: {spec['assistant']}) | {len(rows)} ({mean:.0f}) | {spec['new']} | "
                     f"{count('budget/lookup')} | {count('budget/assisted')} | {count('full/lookup')} | "
                     f"{count('full/assisted')} | {count('full/plain')} | {count('budget/plain=dense')} |")
    write_json(out / "speculative_check.json", results)
    (out / "speculative_check.md").write_text("\n".join(lines) + "\n")
    log(f"speculative-check: wrote {out / 'speculative_check.md'}")

"""Exploration driver (issue 32; not part of the harness): teacher-forced agreement with dense for `budget_mass`
settings vs the default, with the pages per head each used. Run as `python -m fc_hf.eval.budget_mass_tf STAGE ...`.

stage "dense": per task, one dense prefill + dense forced log-probs, saved to DIR/<task>.pt.
stage "run": one config over the saved tasks; appends a JSON line to DIR/results.jsonl.
"""
import argparse, json, sys, time
from pathlib import Path
import torch

from fc_hf.config import FlexiCacheConfig
from fc_hf.cache import FlexiCache
from fc_hf.eval.loading import load_model
from fc_hf.eval.fidelity import make_tasks, compare_steps
from fc_hf.eval.profile_choice import resolve_profile
from fc_hf.eval.shared_prefill import dense_prefill, forced_decode, DensePrefill

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("stage")
    ap.add_argument("--dir", default="results/budget-mass")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--forced", type=int, default=128)
    ap.add_argument("--offsets", default="0,400000")
    ap.add_argument("--distances", default="3584")
    ap.add_argument("--name", default="")
    ap.add_argument("--cfg", default="{}")
    ap.add_argument("--tasks", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    d = Path(a.dir); d.mkdir(parents=True, exist_ok=True)
    model, tok, _ = load_model("smollm2-135m-instruct", "float32")
    tasks = make_tasks(tok, ("continue", "recall"), a.prompt, a.forced, [int(x) for x in a.distances.split(",")],
                       [int(x) for x in a.offsets.split(",")])
    if a.tasks:
        tasks = [t for t in tasks if t.name in a.tasks.split(",")]
    t0 = time.time()
    if a.stage == "dense":
        for t in tasks:
            f = d / f"{t.name}.pt"
            if f.exists():
                continue
            pre = dense_prefill(model, t.prompt_ids)
            dense = torch.stack(list(forced_decode(model, pre, "dense", None, t.target_ids[:-1])))
            torch.save({"kv": pre.kv, "logits": pre.logits, "prompt_ids": pre.prompt_ids, "dense": dense,
                        "targets": t.target_ids[1:], "forced": t.target_ids[:-1], "kind": t.kind}, f)
            print(t.name, round(time.time() - t0, 1), flush=True)
        return
    profile, note = resolve_profile("smollm2-135m-instruct", model.config, "fidelity", None)
    cfg = FlexiCacheConfig(**json.loads(a.cfg))
    for t in tasks:
        s = torch.load(d / f"{t.name}.pt")
        pre = DensePrefill(s["prompt_ids"], s["kv"], s["logits"])
        cache = FlexiCache(model.config, cfg, profile)
        steps = compare_steps(s["dense"], forced_decode(model, pre, "flexicache", cache, s["forced"]), s["targets"])
        st = cache.stats()
        rec = {"name": a.name, "cfg": json.loads(a.cfg), "task": t.name, "kind": s["kind"], "n": len(s["targets"]),
               "pages_per_ranking": st["pages_per_ranking"], "pages_per_step": st["pages_per_step"],
               "seconds": round(time.time() - t0, 1), **{k: v for k, v in steps.items()}}
        with open(d / "results.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(a.name, t.name, rec["pages_per_step"], sum(steps["agree"]),
              rec["seconds"], flush=True)


if __name__ == "__main__":
    main()

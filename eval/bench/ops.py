"""`flexicache bench ops`: kernel-launching operations and host syncs per decode step and per layer.

A decode step is counted with a `TorchDispatchMode` that sees every aten op the step issues, plus a
counter around every Triton kernel launch. On a GPU in eager mode each counted op is (at least) one
kernel launch, so these counts are what the step costs in launches, whatever the device it ran on.

What counts as an op (the rule):
- an aten op counts unless it is a *view or metadata-only op*: every output of its schema aliases an
  input without writing to it (`view`, `_reshape_alias`, `expand`, `as_strided`, `slice`, `select`, `narrow`,
  `t`, `transpose`, `permute`, `unsqueeze`, `squeeze`, `detach`, `alias`, `split`, `unbind`, `lift_fresh`, ...;
  `reshape`/`contiguous`/`.float()` on a tensor that needs no copy reach the dispatcher as such a view or
  not at all), or one that only allocates or re-labels memory: `_unsafe_view`, `empty`, `empty_strided`,
  `new_empty`, `new_empty_strided`, `empty_like`, `resize_`, `set_`;
- everything else counts once per call: compute, copies (`clone`, `copy_`, `_to_copy`), fills (`zeros`,
  `fill_`, `arange`), in-place and `out=` ops (`index_copy_`, `index_select.out`), and the sync-causing ops below;
- a Triton kernel launch counts once (`kernel[grid](...)`); the aten ops the Triton interpreter issues
  to run it on a CPU are not counted.

Host syncs (a subset of the ops, counted apart per step): the aten ops that make the host wait for the
device - `_local_scalar_dense` (`.item()`, `int(t)`, `float(t)`, `bool(t)`, `if t.any():`), `nonzero`,
`masked_select`, `unique*`, `repeat_interleave` with tensor repeats and no `output_size`, `index`/`index_put`
with a bool or uint8 index (a mask: its nonzero is taken on the device), and copies from a CUDA tensor
to the CPU (`_to_copy`, `copy_`); plus `Tensor.tolist()` calls (patched for the count; `.tolist()` of a
CPU tensor issues no aten op). On a CPU run a device -> host copy cannot be told apart from any other
copy (both tensors are CPU tensors), so it is not counted there (tests/test_no_host_sync.py catches `.cpu()`).

Methods: dense (`DynamicCache` + sdpa), quest (FlexiCache, `profile=None`: every head ranked every step, one
tier) and flexicache (the shipped profile for SmolLM2's shape, else `common.spread_profile` with
`--unstable-fraction`), batch 1, fp32, budget 1024, pages of 16, R = 8. The models are random-weight
Llamas with the attention shape of SmolLM2-135M (30 layers, 9 query / 3 KV heads, head_dim 64: all its
layers, so the shipped profile fits) or Llama-3.1-8B (32 / 8 heads, head_dim 128, 2 layers), with a tiny
hidden size, MLP and vocabulary: op counts do not depend on those sizes. The prompt's K/V is written
straight into the cache (`common.ingest_random_kv`), 4100 tokens (more pages than the budget), into a cache
allocated for the prompt and the steps counted (`common.bench_cache`).

Steps 1 .. `--ops-steps` are counted. A FlexiCache decode step is one fixed sequence of tensor ops
(`fc_hf/decode.py`): every step ranks the layer's unstable rows and a fixed slice of its stable rows,
`ceil(n_stable / R)` places (the rows whose phase is due, padded; `fc_hf/schedule.py`), so steps 2 .. N are
alike, whatever page fills or opens. Step 1 after the prompt is apart (`first`): it ranks every stable row.
The summary (`steady`) is the mean of steps 2 .. N with their min and max (a spread between them would be a
step that is not static). Per layer-step = the ops inside the decoder layers divided by their number;
"cache + attention" is the part inside `cache.update` and the attention function (projections, norms, RoPE
and MLP excluded); the ops outside the decoder layers (embedding, masks, final norm, LM head, argmax) are
reported per step; `top_ops_per_layer` breaks the layer ops down by aten op.

Triton: `--ops-backends triton` runs the FlexiCache methods with `FlexiCacheConfig(backend="triton")` in a
worker under the Triton interpreter on a CPU (`TRITON_INTERPRET=1`) and counts each Triton launch as one op.
These are a GPU's eager launches: `flexicache::page_scores`, `flexicache::attention`, `flexicache::append_token` (a
decode token's writes), `flexicache::candidates`, `flexicache::page_logits`, `flexicache::choose` (refinement's
candidates, their logits, the mass, top K and carried candidates) and `flexicache::move_windows` (a re-rank's window
moves) run as Triton kernels, the rest
of the step as torch ops (`fc_hf.kernels.dispatch`). A row is kept only when a Triton kernel launched (else the
worker says so and writes no row, rather than torch's counts under the name "triton").

`--ops-baseline OLD/ops.json` puts an earlier run beside this one (`<out>/ops_compare.md`): both are summarized
by these rules from their per-step counts, so an older run's `steady` is the mean of its steps 2 .. N as they
came (before the static step a layer's stable heads re-ranked together on steps divisible by R, and page steps
differed: those steps enter that mean at their share of steps 2 .. N).

    flexicache bench ops --out results/bench             # table in results/bench/ops.md, data in ops.json
    flexicache bench ops --smoke --out /tmp/b            # tiny model and context, seconds
    flexicache bench ops --ops-baseline old/ops.json ... # also <out>/ops_compare.md: before/after side by side
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fc_hf.compat import cache_kwarg

from ..methods import parse_cache_options, prepare_model
from .common import (bench_cache, bench_profile, build_model, decode_step, environment, ingest_random_kv, log,
                     model_config, run_worker, write_json)

__all__ = ["OpCounter", "count_case", "worker", "suite_ops", "markdown_table", "comparison_table", "is_counted",
           "sync_kind"]

# Ops that only allocate or re-label memory (no kernel), beyond those whose schema marks them as views.
_NOT_LAUNCHING = frozenset({
    "_unsafe_view", "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "resize_", "set_",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
})
_SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                       "unique_consecutive"})

# The shapes of the suite: attention exactly as the named model, tiny hidden/MLP/vocabulary.
OPS_SHAPES = {
    "smollm2": ("smollm2-tiny", None),  # 30 layers: all of SmolLM2-135M's, so the shipped profile fits
    "llama8b": ("llama8b-tiny", 2),
    "tiny": ("tiny", None),
}


def _packet(func) -> str:
    return func.overloadpacket.__name__


def is_counted(func) -> bool:
    """Whether an aten op launches work (see the module docstring's rule): not a view, not allocation-only."""
    name = _packet(func)
    if name in _NOT_LAUNCHING:
        return False
    rets = func._schema.returns
    if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
        return False  # a view: every output aliases an input, nothing written
    return True


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def sync_kind(func, args, kwargs) -> str | None:
    """The name under which this aten call is counted as a host sync, or None."""
    name = _packet(func)
    if name in _SYNC_OPS:
        return name
    if name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor) and (
            len(args) < 2 or isinstance(args[1], torch.Tensor)) and kwargs.get("output_size") is None:
        return "repeat_interleave(tensor)"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        if any(_is_mask(i) for i in (args[1] or ())):
            return f"{name}(bool mask)"
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst_device = kwargs.get("device") if name == "_to_copy" else args[0].device
        if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None and (
                torch.device(dst_device).type == "cpu"):
            return "device->host copy"
    return None


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops (and host syncs) by region while active.

    The region is `("layer", i, part)` inside decoder layer i (part: "cache" inside `cache.update`,
    "attn" inside the attention function, "rest" elsewhere in the layer) or `("outside",)`.
    """

    def __init__(self):
        super().__init__()
        self.layer: int | None = None
        self.part = "rest"
        self.paused = 0
        self.reset()

    def reset(self):
        self.ops: Counter = Counter()  # region -> ops
        self.by_op: Counter = Counter()  # op name -> count, inside decoder layers only
        self.syncs: Counter = Counter()  # sync kind -> count (whole step)
        self.triton: Counter = Counter()  # Triton kernel name -> launches, by region part
        self.triton_regions: Counter = Counter()

    def region(self):
        return ("outside",) if self.layer is None else ("layer", self.layer, self.part)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and is_counted(func):
            region = self.region()
            self.ops[region] += 1
            if self.layer is not None:
                self.by_op[_packet(func)] += 1
            kind = sync_kind(func, args, kwargs)
            if kind is not None:
                self.syncs[kind] += 1
        return func(*args, **kwargs)

    def count_tolist(self):
        if not self.paused:
            self.syncs["tolist"] += 1

    def count_triton(self, name: str):
        self.triton[name] += 1
        self.triton_regions[self.region()] += 1

    @contextlib.contextmanager
    def part_of_layer(self, part: str):
        old, self.part = self.part, part
        try:
            yield
        finally:
            self.part = old

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


@contextlib.contextmanager
def _instrumented(model, cache, counter: OpCounter):
    """Decoder-layer hooks, `cache.update` and the attention functions report their region to `counter`;
    `Tensor.tolist` and Triton launches are counted. Everything is restored on exit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    handles = []
    for i, layer in enumerate(model.model.layers):
        def enter(_mod, _args, i=i):
            counter.layer = i

        def leave(_mod, _args, _out):
            counter.layer = None

        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(leave))

    original_update = cache.update

    def update(*args, **kwargs):
        with counter.part_of_layer("cache"):
            return original_update(*args, **kwargs)

    cache.update = update
    impl = model.config._attn_implementation
    original_attn = ALL_ATTENTION_FUNCTIONS[impl]

    def attention(*args, **kwargs):
        with counter.part_of_layer("attn"):
            return original_attn(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(impl, attention)
    original_tolist = torch.Tensor.tolist

    def tolist(self, *a, **k):
        counter.count_tolist()
        return original_tolist(self, *a, **k)

    torch.Tensor.tolist = tolist
    restore_triton = _count_triton_launches(counter)
    try:
        yield
    finally:
        restore_triton()
        torch.Tensor.tolist = original_tolist
        ALL_ATTENTION_FUNCTIONS.register(impl, original_attn)
        del cache.update
        for h in handles:
            h.remove()


def _count_triton_launches(counter: OpCounter):
    """Count every Triton kernel launch (compiled or interpreted), pausing the aten count inside it."""
    if "triton" not in sys.modules:  # nothing can launch a Triton kernel without triton imported
        return lambda: None
    patched = []
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    for cls in classes:
        original = cls.run

        def run(self, *args, grid, warmup, _original=original, **kwargs):
            if warmup:
                return _original(self, *args, grid=grid, warmup=warmup, **kwargs)
            counter.count_triton(getattr(self, "__name__", "kernel"))
            with counter.pause():
                return _original(self, *args, grid=grid, warmup=warmup, **kwargs)

        cls.run = run
        patched.append((cls, original))

    def restore():
        for cls, original in patched:
            cls.run = original

    return restore


def padding_mask(batch: int, length: int, padding: int) -> torch.Tensor | None:
    """`[batch, length]` mask of a left-padded batch: row b starts with `round(b * padding / (batch - 1))` padding
    tokens (row 0 none, the last row `padding`); None without padding."""
    if not padding or batch < 2:
        return None
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        mask[b, : round(b * padding / (batch - 1))] = 0
    return mask


def count_case(model, config, method: str, budget: int, prompt: int, steps: int, profile, backend: str = "torch",
               options: dict | None = None, batch: int = 1, padding: int = 0) -> dict:
    """Count ops and syncs of decode steps 1..`steps` of `method` after a `prompt`-token random-K/V prefill.

    `options`: `FlexiCacheConfig` fields for the FlexiCache methods (the defaults otherwise). `batch` sequences;
    with `padding`, left-padded ones (`padding_mask`: the decode steps get the mask, as in a padded generation)."""
    from fc_hf.config import FlexiCacheConfig

    base = FlexiCacheConfig(backend=backend, **(options or {}))
    prepare_model(model, method)
    kwarg = cache_kwarg(model)
    layers = len(model.model.layers)
    per_step = []
    with torch.no_grad():
        cache = bench_cache(method, config, budget, profile, base=base, tokens=prompt + steps)
        ingest_random_kv(cache, config, batch, prompt)
        mask = padding_mask(batch, prompt + steps, padding)
        token = torch.randint(1, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
        counter = OpCounter()
        with _instrumented(model, cache, counter):
            for step in range(1, steps + 1):
                counter.reset()
                with counter:
                    token = decode_step(model, cache, kwarg, token, prompt + step - 1, mask)
                layer_ops = sum(n for r, n in counter.ops.items() if r[0] == "layer")
                part = Counter()
                for r, n in counter.ops.items():
                    if r[0] == "layer":
                        part[r[2]] += n
                tri_layer = sum(n for r, n in counter.triton_regions.items() if r[0] == "layer")
                per_step.append({
                    "step": step,
                    "layer_ops": layer_ops, "cache_ops": part["cache"], "attn_ops": part["attn"],
                    "outside_ops": counter.ops[("outside",)],
                    "triton_launches": sum(counter.triton.values()), "triton_layer_launches": tri_layer,
                    "triton": dict(counter.triton),
                    "syncs": dict(counter.syncs), "by_op": dict(counter.by_op),
                })
        del cache
    return {"method": method, "budget": budget if method != "dense" else None, "backend": backend if method != "dense"
            else "torch", "layers": layers, "prompt": prompt, "batch": batch, "padding": padding, "steps": per_step}


SUMMARY_KINDS = ("first", "steady")  # step 1 after the prompt (every stable row ranks), then steps 2 .. N


def summarize(case: dict) -> dict:
    """`first` (step 1) and `steady` (steps 2 .. N, see the module docstring): mean ops per layer-step (aten + Triton)
    with their min and max, the cache + attention part, ops outside the layers, syncs per step and the ops by name.

    Only the step numbers and counts are read, so a run of an earlier version (whose steps had other kinds) is
    summarized by the same rules."""
    layers = case["layers"]
    out = {}
    steps_of = {"first": [s for s in case["steps"] if s["step"] == 1],
                "steady": [s for s in case["steps"] if s["step"] >= 2]}
    for kind, steps in steps_of.items():
        n = len(steps)
        if not n:
            continue
        syncs = Counter()
        by_op = Counter()
        for s in steps:
            syncs.update(s["syncs"])
            by_op.update(s["by_op"])
        per_layer = [(s["layer_ops"] + s["triton_layer_launches"]) / layers for s in steps]
        out[kind] = {
            "steps": n,
            "ops_per_layer": sum(per_layer) / n,
            "min_ops_per_layer": min(per_layer),
            "max_ops_per_layer": max(per_layer),
            "aten_per_layer": sum(s["layer_ops"] for s in steps) / n / layers,
            "triton_per_layer": sum(s["triton_layer_launches"] for s in steps) / n / layers,
            "cache_attn_per_layer": sum(s["cache_ops"] + s["attn_ops"] + s["triton_layer_launches"] for s in steps) / n / layers,
            "outside_per_step": sum(s["outside_ops"] for s in steps) / n,
            "syncs_per_step": sum(syncs.values()) / n,
            "sync_kinds": {k: v / n for k, v in sorted(syncs.items())},
            "top_ops_per_layer": {k: round(v / n / layers, 2) for k, v in by_op.most_common(25)},
        }
    return out


def worker(spec: dict) -> int:
    """Count the cases of one (shape, backend) group; print one JSON line per case."""
    torch.set_num_threads(1)
    shape, layers = OPS_SHAPES[spec["shape"]]
    config = model_config(shape, max_positions=spec["prompt"] + spec["steps"] + 64, layers=layers)
    model = build_model(config)
    profile, label = bench_profile(config, spec["unstable_fraction"], prefer_shipped=spec["shape"] == "smollm2")
    for method in spec["methods"]:
        if spec["backend"] == "triton" and method == "dense":
            continue
        batch, padding = spec.get("batch", 1), spec.get("padding", 0)
        case = count_case(model, config, method, spec["budget"], spec["prompt"], spec["steps"],
                          profile if method == "flexicache" else None, spec["backend"],
                          spec.get("options"), batch, padding)
        if spec["backend"] == "triton" and not any(s["triton_launches"] for s in case["steps"]):
            log(f"bench ops: {spec['shape']} {method}: no Triton kernel launched with backend='triton' "
                "(fc_hf.kernels.dispatch ran every primitive on the PyTorch backend); no triton row written")
            continue
        shape = spec["shape"] + (f" b{batch} padded" if padding_mask(batch, 2, padding) is not None else "")
        case.update(shape=shape, profile=label if method == "flexicache" else None,
                    summary=summarize(case), env=environment())
        print(json.dumps(case), flush=True)
    return 0


def _run_worker(spec: dict, timeout: int) -> list[dict]:
    env = dict(os.environ)
    if spec["backend"] == "triton" and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # must be set before triton is imported: a fresh interpreter
    results, rc = run_worker("_ops_worker", spec, timeout, env)
    if rc != 0:
        log(f"bench ops: worker {spec['shape']} {spec['backend']} ended with {rc}; kept {len(results)} results")
    return results


def _fmt(x, digits=1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _step_label(case: dict, kind: str) -> str:
    """"1 (first)" or "2-N mean" for a summary kind of `case`."""
    last = max(s["step"] for s in case["steps"])
    return "1 (first)" if kind == "first" else f"2-{last} mean"


def markdown_table(results: list[dict], kinds=SUMMARY_KINDS) -> str:
    """One row per shape × method × backend × summary kind: ops per layer-step (min-max over the steps), ratios to
    dense, syncs per step."""
    dense = {(r["shape"]): r["summary"] for r in results if r["method"] == "dense"}
    head = ["shape", "method", "backend", "step", "ops / layer-step", "min-max", "× dense",
            "cache + attention ops / layer-step", "× dense", "of which Triton launches", "syncs / step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {"dense": 0, "quest": 1, "flexicache": 2}
    for r in sorted(results, key=lambda r: (r["shape"] != "smollm2", r["shape"], order.get(r["method"], 9),
                                            r["backend"] != "torch")):
        for kind in kinds:
            s = r["summary"].get(kind)
            if s is None:
                continue
            d = dense.get(r["shape"], {}).get(kind)
            ratio = s["ops_per_layer"] / d["ops_per_layer"] if d else None
            ratio_ca = s["cache_attn_per_layer"] / d["cache_attn_per_layer"] if d and d["cache_attn_per_layer"] else None
            backend = r["backend"] + (" (interpreter)" if r["backend"] == "triton" and r["env"].get("gpu") is None else "")
            spread = f"{_fmt(s['min_ops_per_layer'])}-{_fmt(s['max_ops_per_layer'])}" if kind != "first" else "–"
            syncs = _fmt(s["syncs_per_step"], 1)
            if s["sync_kinds"]:
                syncs += " (" + ", ".join(f"{k} {v:g}" for k, v in s["sync_kinds"].items()) + ")"
            lines.append("| " + " | ".join([
                r["shape"], r["method"], backend if r["method"] != "dense" else "torch (sdpa)", _step_label(r, kind),
                _fmt(s["ops_per_layer"]), spread, _fmt(ratio, 2) + "×" if ratio else "–", _fmt(s["cache_attn_per_layer"]),
                _fmt(ratio_ca, 2) + "×" if ratio_ca else "–",
                _fmt(s["triton_per_layer"]) if r["backend"] == "triton" else "–", syncs,
            ]) + " |")
    return "\n".join(lines)


def comparison_table(before: list[dict], after: list[dict], kinds=SUMMARY_KINDS) -> str:
    """Before/after side by side (e.g. two commits): ops per layer-step with their ratio to dense, the
    cache + attention part, and syncs per step, for every shape × method × backend × summary kind in `after`."""

    def index(results):  # summaries recomputed from the per-step counts: both sides by this version's rules
        return {(r["shape"], r["method"], r["backend"]): summarize(r) for r in results}

    b_idx, a_idx = index(before), index(after)
    head = ["shape", "method", "backend", "step", "ops / layer-step before", "after", "× dense before", "after",
            "cache + attention before", "after", "syncs / step before", "after"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {"dense": 0, "quest": 1, "flexicache": 2}
    for key in sorted(a_idx, key=lambda k: (k[0] != "smollm2", k[0], order.get(k[1], 9), k[2] != "torch")):
        shape, method, backend = key
        for kind in kinds:
            a = a_idx[key].get(kind)
            b = b_idx.get(key, {}).get(kind)
            if a is None:
                continue
            cells = [shape, method, backend if method != "dense" else "torch (sdpa)", kind]
            da = a_idx.get((shape, "dense", "torch"), {}).get(kind)
            db = b_idx.get((shape, "dense", "torch"), {}).get(kind)
            cells += [_fmt(b and b["ops_per_layer"]), _fmt(a["ops_per_layer"]),
                      (_fmt(b["ops_per_layer"] / db["ops_per_layer"], 2) + "×") if b and db else "–",
                      (_fmt(a["ops_per_layer"] / da["ops_per_layer"], 2) + "×") if da else "–",
                      _fmt(b and b["cache_attn_per_layer"]), _fmt(a["cache_attn_per_layer"]),
                      _fmt(b and b["syncs_per_step"]), _fmt(a["syncs_per_step"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def suite_ops(args, out: Path) -> list[dict]:
    shapes = [s for s in args.ops_shapes.split(",") if s]
    backends = [b for b in args.ops_backends.split(",") if b]
    methods = [m for m in args.methods.split(",") if m and m != "floor"]  # floor: a timing baseline only
    options = parse_cache_options(args.ops_cache_options)
    results = []
    for shape in shapes:
        for backend in backends:
            tri = backend == "triton"
            spec = {"shape": shape, "backend": backend, "methods": methods,
                    "budget": args.ops_triton_budget if tri else args.ops_budget,
                    "prompt": args.ops_triton_prompt if tri else args.ops_prompt,
                    "steps": args.ops_triton_steps if tri else args.ops_steps,
                    "unstable_fraction": args.unstable_fraction,
                    "options": options}
            log(f"bench ops: {shape} {backend} ({', '.join(methods)})")
            results.extend(_run_worker(spec, args.timeout))
            if args.ops_padded_batch > 1 and not tri:  # the same shape as a left-padded batch (PyTorch path only)
                padded = {**spec, "batch": args.ops_padded_batch, "padding": args.ops_padding}
                log(f"bench ops: {shape} {backend}, left-padded batch of {args.ops_padded_batch}")
                results.extend(_run_worker(padded, args.timeout))
    table = markdown_table(results)
    env = environment()
    header = (f"Decode-step ops (`flexicache bench ops`), batch 1, fp32, budget {args.ops_budget}, context "
              f"{args.ops_prompt} tokens, decode steps 1-{args.ops_steps} (step 1 apart: it ranks every stable row; "
              f"then the mean of the others, with their min-max); torch {env['torch']}, transformers "
              f"{env['transformers']}" + (f"; FlexiCacheConfig options {options}" if options else "") + ".")
    if any(r["backend"] == "triton" for r in results):
        header += (f" Triton rows (interpreted: slow) at budget {args.ops_triton_budget}, context {args.ops_triton_prompt}, "
                   f"steps 1-{args.ops_triton_steps}: the same structure (more pages than the budget).")
    elif "triton" in backends:
        header += " No Triton row: no Triton kernel launched with backend='triton' (the PyTorch backend ran throughout)."
    if args.ops_padded_batch > 1:
        header += (f" Rows \"b{args.ops_padded_batch} padded\": a batch of {args.ops_padded_batch} left-padded by 0 to "
                   f"{args.ops_padding} tokens (evenly spread), decoded with its mask; ops per layer-step of the whole batch.")
    write_json(out / "ops.json", {"suite": "ops", "env": env, "argv": sys.argv[1:], "results": results})
    (out / "ops.md").write_text(header + "\n\n" + table + "\n")
    print(header + "\n\n" + table)
    if getattr(args, "ops_baseline", None):
        before = json.loads(Path(args.ops_baseline).read_text())["results"]
        compare = comparison_table(before, results)
        (out / "ops_compare.md").write_text(compare + "\n")
        print("\nBefore (" + str(args.ops_baseline) + ") and after:\n\n" + compare)
    return results

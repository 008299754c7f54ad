"""FlexiCache's decode step compiles (issue 49, item 2): `generate` compiles it as it compiles a `StaticCache`.

The check of the issue, on a CPU (`compile_config._compile_all_devices`, the `aot_eager` backend): a 2-layer tiny
Llama with stable and unstable heads, budget 64, pages of 16, R = 4, a left-padded batch of 2, a 330-token prompt and
64 new tokens (stable rows ranking at their phases with promotions, unstable rankings, pages opening), compiled with
`fullgraph=True, dynamic=False`: no graph break, at most 2 graphs (the first step after a prompt ranks every stable row;
every later step is one graph), and eager FlexiCache's tokens. A `StaticCache` passes the same check with 1 graph.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from transformers import CompileConfig, StaticCache

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.compat import cache_kwargs

CFG = FlexiCacheConfig(page_size=16, token_budget=64, rerank_interval=4)


def _compile_config(dynamic: bool | None = False, fullgraph: bool = True, backend="aot_eager") -> CompileConfig:
    """The issue's check; `dynamic=None` and `fullgraph=False` are generate's own defaults."""
    config = CompileConfig(fullgraph=fullgraph, dynamic=dynamic, backend=backend)
    config._compile_all_devices = True  # generate compiles on a CPU too
    return config


def _skip_unless_built(backend: str) -> None:
    """Skip a case on the C++ kernels where they did not build."""
    from fc_hf.kernels import native_ops

    if backend == "native" and not native_ops.available():
        pytest.skip(f"the C++ kernels did not build: {native_ops.build_error()}")


def _generate(model, cache, ids, mask, max_new_tokens=64, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              **cache_kwargs(model, cache), **kw)


def _reset_per_call(model, cfg, profile, prompts, max_new_tokens, **kw) -> list[tuple[torch.Tensor, int]]:
    """One cache, `reset()` before each of `prompts` (`(ids, mask)` pairs): each call's tokens and the pages promoted
    so far (the count restarts at `reset()`)."""
    cache, seen = FlexiCache(model.config, cfg, profile), []
    for ids, mask in prompts:
        cache.reset()
        seen.append((_generate(model, cache, ids, mask, max_new_tokens=max_new_tokens, **kw),
                     cache.stats()["pages_promoted"]))
    return seen


def _graphs(run) -> tuple[torch.Tensor, int, dict]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = run()
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    torch._dynamo.reset()
    return out, graphs, breaks


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    ids, mask = left_padded_batch(2, 330, pad_lengths=[0, 21])
    profile = HeadProfile.from_unstable(model.config, {(0, 0), (1, 1)})  # each layer one unstable, one stable head
    return model, ids, mask, profile


@pytest.mark.parametrize("backend", ["torch", "native"], ids=["PyTorch backend", "C++ kernels"])
@pytest.mark.parametrize("split", [False, True], ids=["one full tier", "near rows apart (the GPU layout)"])
def test_generate_compiles_the_decode_step_in_two_graphs_with_eager_tokens(setup, split, backend, monkeypatch):
    """Also on the C++ kernels (`backend="native"`, the GPU step's ops: each op one node), whose eager tokens are the
    PyTorch backend's."""
    from fc_hf.store import PageStore

    _skip_unless_built(backend)
    monkeypatch.setattr(PageStore, "split_on_cpu", split)
    model, ids, mask, profile = setup
    cfg = dataclasses.replace(CFG, backend=backend)
    eager_cache = FlexiCache(model.config, cfg, profile)
    eager = _generate(model, eager_cache, ids, mask)
    assert eager_cache.stats()["pages_promoted"] > 0 and eager_cache.stats()["reranks_stable"] > 2 * 2
    if backend == "native":
        torch_cfg = dataclasses.replace(CFG, backend="torch")
        assert torch.equal(eager, _generate(model, FlexiCache(model.config, torch_cfg, profile), ids, mask))
    cache = FlexiCache(model.config, cfg, profile)
    out, graphs, breaks = _graphs(lambda: _generate(model, cache, ids, mask, compile_config=_compile_config()))
    assert breaks == {}
    assert graphs <= 2
    assert torch.equal(out, eager)
    assert cache.stats()["pages_promoted"] == eager_cache.stats()["pages_promoted"]  # counted on the device, the same
    assert all(layer.store.near_apart is split for layer in cache.layers)


def test_a_static_cache_passes_the_same_check_in_one_graph(setup):
    model, ids, mask, _ = setup
    eager = _generate(model, StaticCache(config=model.config, max_cache_len=400), ids, mask)
    model.set_attn_implementation("sdpa")
    try:
        out, graphs, breaks = _graphs(lambda: _generate(model, StaticCache(config=model.config, max_cache_len=400), ids,
                                                        mask, compile_config=_compile_config()))
    finally:
        model.set_attn_implementation("flexicache")
    assert breaks == {} and graphs == 1
    assert out.shape == eager.shape


def test_a_reset_cache_is_reused_without_recompiling(setup):
    """A pipeline passing one cache to every call: `reset()` keeps the tensors, the compiled step is reused."""
    model, ids, mask, profile = setup
    cache = FlexiCache(model.config, CFG, profile, max_cache_len=400)

    def twice():
        first = _generate(model, cache, ids, mask, compile_config=_compile_config())
        cache.reset()
        second = _generate(model, cache, ids, mask, compile_config=_compile_config())
        return torch.stack([first, second])

    both, graphs, breaks = _graphs(twice)
    assert breaks == {} and graphs <= 2
    assert torch.equal(both[0], both[1])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_reset_cache_takes_a_batch_of_another_size(setup, compiled):
    """After `reset()` a batch of another size is allocated afresh at its prompt: the tokens, capacity and device bytes
    of a fresh cache for that batch, eager and compiled (a new batch size compiles its own graphs), and back again."""
    model, _, _, profile = setup
    prompts = [left_padded_batch(2, 330, pad_lengths=[0, 21]), left_padded_batch(3, 250, pad_lengths=[0, 5, 40]),
               left_padded_batch(2, 200, pad_lengths=[3, 0])]
    kw = dict(compile_config=_compile_config()) if compiled else {}

    def run():
        cache, seen = FlexiCache(model.config, CFG, profile), []
        for i, (ids, mask) in enumerate(prompts):
            if i:
                cache.reset()
            seen.append((_generate(model, cache, ids, mask, **kw), cache.capacity,
                         cache.memory_report()["device_kv_bytes"]))
        return seen

    seen, _, breaks = _graphs(run)
    assert breaks == {}
    for (ids, mask), (out, capacity, device_bytes) in zip(prompts, seen):
        fresh = FlexiCache(model.config, CFG, profile)
        assert torch.equal(out, _generate(model, fresh, ids, mask))
        assert (capacity, device_bytes) == (fresh.capacity, fresh.memory_report()["device_kv_bytes"])


@pytest.mark.parametrize("later", ["reset", "turn", "one-token turn"],
                         ids=["a reset cache", "a new turn whose prompt fits", "a turn of one token"])
def test_a_later_call_that_generates_more_gets_room_for_its_compiled_steps(setup, later):
    """The capacity fits the first call (a 300-token prompt and 16 new tokens: 320). A later call whose prompt fits but
    whose new tokens do not (after `reset()`, 80 new tokens; a turn of 2 or 1 more tokens, 40 new) grows the cache at
    its prompt to what its generate call will hold, since its compiled steps cannot grow it; it raised that the
    compiled step had no room left. Tokens equal eager FlexiCache's."""
    model, _, _, profile = setup
    ids, mask = left_padded_batch(2, 300, pad_lengths=[0, 21])

    def run(**kw):
        cache = FlexiCache(model.config, CFG, profile)
        first = _generate(model, cache, ids, mask, max_new_tokens=16)
        assert cache.capacity == 320
        if later == "reset":
            cache.reset()
            return _generate(model, cache, ids, mask, max_new_tokens=80, **kw)
        turn = torch.cat([first, ids[:, 100 : 101 if later == "one-token turn" else 102]], 1)
        turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        return _generate(model, cache, turn, turn_mask, max_new_tokens=40, **kw)

    eager = run()
    out, _, breaks = _graphs(lambda: run(compile_config=_compile_config()))
    assert breaks == {} and torch.equal(out, eager)


@pytest.mark.parametrize("backend", ["torch", "native"], ids=["PyTorch backend", "C++ kernels"])
def test_generates_default_dynamic_compiles_a_grown_cache_once_without_graph_breaks(setup, backend):
    """generate's own `CompileConfig` has `dynamic=None`: once a reused cache's capacity changed (here a reset cache
    growing for longer calls, 320 -> 480 -> 720 tokens), Dynamo recompiles the step with the capacity symbolic. That
    graph takes every later capacity (at most 4 graphs for the three calls: the C++ `move_windows` once took the
    page count as an `int`, which specialised it, 6 graphs) and has no graph break (the room check's message once held
    the capacity and broke the graph there); the tokens are eager FlexiCache's."""
    _skip_unless_built(backend)
    model, _, _, profile = setup
    cfg = dataclasses.replace(CFG, backend=backend)
    ids, mask = left_padded_batch(2, 300, pad_lengths=[0, 21])
    config = _compile_config(dynamic=None)  # generate's default but for the backend

    def calls(**kw):
        cache, outs = FlexiCache(model.config, cfg, profile), []
        for new in (16, 80, 200):
            cache.reset()
            outs.append(_generate(model, cache, ids, mask, max_new_tokens=new, **kw))
        assert cache.capacity == 720
        return outs

    eager = calls()
    outs, graphs, breaks = _graphs(lambda: calls(compile_config=config))
    assert breaks == {} and graphs <= 4
    assert all(torch.equal(a, b) for a, b in zip(outs, eager))


@pytest.mark.parametrize("backend", ["torch", "native"], ids=["PyTorch backend", "C++ kernels"])
def test_generates_default_dynamic_compiles_batches_of_several_sizes_once(setup, backend):
    """Under `dynamic=None` a second batch size recompiles the step with the batch symbolic (as `StaticCache`'s), and
    that pair of graphs serves later sizes: batches of 2, 3, 5 and 4 on one reset cache compile at most 5 graphs (the
    fifth where the padded places of stable rows per step, 1 for 2 or 3 batches, became 2), with no graph break and
    eager FlexiCache's tokens. Before, the step's memo keys held the row count and the PyTorch path's first step
    looped over the stable rows, each fixing the batch again: 2 graphs per new size, so Dynamo's recompile limit (8)
    was reached at the fourth size and later sizes ran eager."""
    _skip_unless_built(backend)
    model, _, _, profile = setup
    cfg = dataclasses.replace(CFG, backend=backend)
    prompts = [left_padded_batch(b, 250, pad_lengths=[0, 21, 3, 7, 7][:b]) for b in (2, 3, 5, 4)]

    eager = _reset_per_call(model, cfg, profile, prompts, 24)
    outs, graphs, breaks = _graphs(lambda: _reset_per_call(model, cfg, profile, prompts, 24,
                                                           compile_config=_compile_config(dynamic=None)))
    assert breaks == {} and graphs <= 5
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(outs, eager))


def test_every_graph_of_the_step_has_no_node_cuda_graphs_refuse(setup):
    """What a CPU can check of CUDA graphs (reduce-overhead, generate's default on a GPU): inductor's own test of a
    graph before it records one (`get_first_incompatible_cudagraph_node`: a host read, an `_assert_scalar`, a boolean
    index, an unbacked size, an op tagged unsafe) finds nothing in any graph of the decode step, static or with the
    batch symbolic (generate's `dynamic=None`, a second batch size). Mutated inputs are the other
    refusal; `test_every_tensor_a_decode_step_writes_is_a_static_address` covers them. What only a GPU shows (whether
    mapped host memory and the device-side assert record) stays unmeasured. On the PyTorch backend, the step with the
    most aten ops (the fused ops' fake implementations are one node each). With fullgraph=True most of these already
    fail to trace; a planted op tagged `cudagraph_unsafe` traces, and fails here (checked by hand, then removed)."""
    from torch._dynamo.backends.common import aot_autograd

    inductor_utils = pytest.importorskip("torch._inductor.utils")
    first_incompatible = getattr(inductor_utils, "get_first_incompatible_cudagraph_node", None)
    if first_incompatible is None:
        pytest.skip("this torch has no get_first_incompatible_cudagraph_node")
    model, _, _, profile = setup
    cfg = dataclasses.replace(CFG, backend="torch")
    refused, graphs = [], []

    def check(gm, example_inputs):
        graphs.append(gm)
        node = first_incompatible(gm)
        if node is not None:
            refused.append(f"{node.format_node()}\n{node.meta.get('stack_trace', '')}")
        return gm.forward

    config = _compile_config(dynamic=None, backend=aot_autograd(fw_compiler=check))
    # The first batch size compiles static graphs, the second symbolic ones.
    prompts = [left_padded_batch(b, 250, pad_lengths=[0, 21, 3][:b]) for b in (2, 3)]
    _graphs(lambda: _reset_per_call(model, cfg, profile, prompts, 20, compile_config=config))
    assert len(graphs) == 4
    assert refused == []


@pytest.mark.parametrize("room", [500, None], ids=["room for both turns", "the turn grows the cache"])
def test_a_new_turn_after_compiled_steps_continues_where_they_ended(setup, room):
    """Compiled steps advance only the device's count of tokens; the next turn (a prompt on the filled cache) is
    written after them, not over them, and a cache grown for it copies them into every layer. Before the host count
    had one home, the turn was written at the last prompt's end, over the compiled steps' tokens; and while each layer
    read the device's count only when asked, growing for the first layer copied the other layers' tokens up to a
    stale count. Either way the answer parted from eager FlexiCache's."""
    model, ids, mask, profile = setup

    def two_turns(**kw):
        cache = FlexiCache(model.config, CFG, profile, max_cache_len=room)
        first = _generate(model, cache, ids, mask, **kw)
        capacity = cache.capacity
        turn = torch.cat([first, ids[:, 100:140]], dim=1)
        turn_mask = torch.cat([mask, mask.new_ones(2, turn.shape[1] - mask.shape[1])], dim=1)
        with torch.no_grad():
            second = model.generate(turn, attention_mask=turn_mask, max_new_tokens=16, do_sample=False,
                                    **cache_kwargs(model, cache), **kw)
        grown = cache.capacity > capacity
        return second, [layer.length for layer in cache.layers], [int(layer.store.length_t) for layer in cache.layers], grown

    eager, eager_lengths, _, grown = two_turns()
    assert grown is (room is None)
    (out, lengths, device_lengths, _), _, breaks = _graphs(lambda: two_turns(compile_config=_compile_config()))
    assert breaks == {}
    assert lengths == device_lengths == eager_lengths == [out.shape[1] - 1] * 2
    assert torch.equal(out, eager)


@pytest.mark.parametrize("limit", [1, 3], ids=["only the first step compiled", "a batch size past the limit"])
def test_steps_dynamo_gives_up_on_run_eager_from_the_compiled_steps_state(setup, limit):
    """Past Dynamo's recompile limit (8 by default; here 1 or 3, so it is reached at once) a call's further steps run
    the eager step without a graph, after steps that were compiled, in the same generation. Such eager steps take the
    compiled steps' state (tokens held, the step since the prompt) from the device, not from host counts that compiled
    steps do not advance: the tokens and promotions are eager FlexiCache's. Three calls on one reset cache, of batch 2,
    3 and 2 (generate's default `fullgraph=False`, which falls back rather than raising)."""
    model, _, _, profile = setup
    config = _compile_config(fullgraph=False)
    prompts = [left_padded_batch(2, 330, pad_lengths=[0, 21]), left_padded_batch(3, 250, pad_lengths=[0, 21, 3]),
               left_padded_batch(2, 200, pad_lengths=[0, 21])]

    with torch._dynamo.config.patch(recompile_limit=limit):
        seen, graphs, _ = _graphs(lambda: _reset_per_call(model, CFG, profile, prompts, 48, compile_config=config))
    assert graphs == limit  # every call after the limit ran some steps eagerly
    for (ids, mask), (out, promoted) in zip(prompts, seen):
        fresh = FlexiCache(model.config, CFG, profile)
        assert torch.equal(out, _generate(model, fresh, ids, mask, max_new_tokens=48))
        assert promoted == fresh.stats()["pages_promoted"]


@pytest.mark.parametrize("backend", ["torch", "native"], ids=["PyTorch backend", "C++ kernels"])
def test_a_compiled_step_with_no_room_left_raises_saying_what_to_do(setup, backend):
    """A compiled step cannot grow the cache: where `max_cache_len` is shorter than the generation, the first step
    past it raises naming the fix (a device-side assert, no host sync), before that step writes anything."""
    _skip_unless_built(backend)
    model, ids, mask, profile = setup
    cache = FlexiCache(model.config, dataclasses.replace(CFG, backend=backend), profile, max_cache_len=352)
    torch._dynamo.reset()
    try:
        with pytest.raises(RuntimeError, match="no room left .cache.capacity tokens per sequence.*Pass max_cache_len="):
            _generate(model, cache, ids, mask, compile_config=_compile_config())
    finally:
        torch._dynamo.reset()
    assert [layer.length for layer in cache.layers] == [352] * 2 and cache.capacity == 352


def test_a_compiled_forward_takes_prompts_eagerly(setup):
    """`torch.compile(model.forward)` without fullgraph: prompts break out of the graph (taken as an eager forward
    would), decode steps compile; the tokens are eager FlexiCache's. With fullgraph=True the prompt refuses, naming
    why."""
    model, ids, mask, profile = setup
    eager = _generate(model, FlexiCache(model.config, CFG, profile), ids[:, -40:], mask[:, -40:])
    compiled = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    compiled.forward = torch.compile(compiled.forward, backend="eager", fullgraph=False)
    out, _, _ = _graphs(lambda: _generate(compiled, FlexiCache(compiled.config, CFG, profile), ids[:, -40:],
                                          mask[:, -40:]))
    assert torch.equal(out, eager)
    strict = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    strict.forward = torch.compile(strict.forward, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="FlexiCache takes a prompt"):
        _generate(strict, FlexiCache(strict.config, CFG, profile), ids[:, -40:], mask[:, -40:])
    torch._dynamo.reset()


def test_what_is_compileable(setup):
    """generate compiles FlexiCache's decode steps only: not from its prompt stage, not while recording drafts, not
    during `profile="auto"`'s warm-up, not with sliding-window layers (transformers' own are not compileable)."""
    from transformers.generation import utils as generation_utils

    model, ids, mask, profile = setup
    cache = FlexiCache(model.config, CFG, profile)
    assert cache.is_compileable
    asked = []
    real = generation_utils.GenerationMixin._valid_auto_compile_criteria

    def spy(self, model_kwargs, generation_config):
        asked.append(model_kwargs["cache" if "cache" in model_kwargs else "past_key_values"].is_compileable)
        return real(self, model_kwargs, generation_config)

    generation_utils.GenerationMixin._valid_auto_compile_criteria = spy
    try:
        _generate(model, cache, ids[:, -40:], mask[:, -40:], prefill_chunk_size=16)
    finally:
        generation_utils.GenerationMixin._valid_auto_compile_criteria = real
    assert asked[0] is True and False in asked[1:]  # the decode loop's, then the prompt stage's (chunked prefill)
    cache.activate_past_recording()
    assert not cache.is_compileable
    cache.deactivate_past_recording()
    assert cache.is_compileable
    assert not FlexiCache(model.config, FlexiCacheConfig(page_size=16, token_budget=64, warmup_steps=8,
                                                         rerank_interval=4), "auto").is_compileable
    gemma = tiny_model("gemma3")
    assert not FlexiCache(gemma.config, CFG).is_compileable


def test_every_tensor_a_decode_step_writes_is_a_static_address(setup):
    """CUDA graphs (generate's reduce-overhead compile) skip a graph that writes an input not marked static, so each
    tensor of the cache that a decode step writes in place is marked (`fc_hf.store.mark_static`), as StaticLayer's
    K/V are."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, ids, mask, profile = setup
    cache = FlexiCache(model.config, CFG, profile)
    written = set()

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for arg, spec in zip(args, func._schema.arguments):
                if isinstance(arg, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write:
                    written.add(arg.untyped_storage().data_ptr())
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
        token, step_mask = out.logits[:, -1:].argmax(-1), mask
        held = {}  # storage -> the cache's tensors on it (near_k is full_k without a split), held through the steps
        for layer in cache.layers:
            for holder in (layer, layer.store, layer.store.rows, layer.selector, *cache.forward.biases.values()):
                for name, value in vars(holder).items():
                    if type(value) is torch.Tensor:
                        held.setdefault(value.untyped_storage().data_ptr(), []).append(
                            (type(holder).__name__, name, value))
        with Writes():
            for _ in range(6):  # the first step ranks every stable row, later ones a phase's
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
                out = model(input_ids=token, attention_mask=step_mask, **cache_kwargs(model, cache), use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
    persistent = [entry for ptr in written for entry in held.get(ptr, [])]
    names = {(owner, name) for owner, name, _ in persistent}
    assert {("PageStore", "full_k"), ("PageStore", "win_k"), ("PageSelector", "carried_pages")} <= names
    unmarked = sorted({(owner, name) for owner, name, t in persistent
                       if getattr(t, "_dynamo_static_input_type", None) is None})
    assert not unmarked, f"written by a decode step but not static: {unmarked}"


def test_the_first_ranking_of_a_process_compiled_is_one_graph(monkeypatch):
    """The bound's clamp constants are cached per device when eager; a compiled step that makes them first (a fresh
    process whose first ranking is compiled) must not write that cache while tracing, or the next call recompiles."""
    from fc_hf.kernels import torch_backend

    monkeypatch.setattr(torch_backend, "_HALVES", {})
    scores = torch.compile(lambda q, m, b: torch_backend.page_scores(q, m, b, 2), fullgraph=True, backend="aot_eager",
                           dynamic=False)
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.randn(4, 3, 8, generator=gen), torch.randn(4, 16, 20, generator=gen), torch.zeros(4, 20))
             for _ in range(3)]
    out, graphs, breaks = _graphs(lambda: [scores(*case) for case in cases])
    assert breaks == {} and graphs == 1
    for case, got in zip(cases, out):
        assert torch.equal(got, torch_backend.page_scores(*case, 2))


def test_a_fresh_process_whose_first_decode_step_is_compiled_loads_the_cpp_kernels_at_the_prompt():
    """The C++ kernels are built or loaded where a layer is first allocated (the prompt, eager), never while the decode
    step is traced: a process whose first decode step is compiled gets no graph break from loading them."""
    script = textwrap.dedent("""
        import test_compile as t
        from conftest import left_padded_batch, tiny_model
        from fc_hf import FlexiCache, HeadProfile
        from fc_hf.kernels import native_ops
        model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
        ids, mask = left_padded_batch(2, 120)
        profile = HeadProfile.from_unstable(model.config, {(0, 0), (1, 1)})
        assert native_ops._loaded is None
        cache = FlexiCache(model.config, t.CFG, profile)
        _, graphs, breaks = t._graphs(lambda: t._generate(model, cache, ids, mask, compile_config=t._compile_config()))
        print(native_ops.available(), graphs, breaks)
    """)
    env = {k: v for k, v in os.environ.items() if k != "FLEXICACHE_BACKEND"}
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    _, graphs, breaks = run.stdout.split()[-3:]
    assert breaks == "{}" and int(graphs) <= 2, run.stdout

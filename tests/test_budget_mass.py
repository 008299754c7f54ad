"""`FlexiCacheConfig.budget_mass` (issue 32): each ranked head keeps the smallest set of candidates reaching mass p.

- `choose_by_mass` against a brute force over every subset: the set is the smallest holding the forced pages whose
  mass among the candidates reaches p, clamped to the floor and the ceiling.
- The whole cache under the selection oracle (`selection_oracle.run_case`, with its `budget_mass` branch): at every
  step the ranking (smallest set, forced pages, floor/ceiling), what is read between rankings, the attention output
  (the PyTorch path honouring each row's count) and the metadata, with stable tiered heads, both promotion modes,
  padding and beam reorders.
- Stable heads' sets grow and shrink between re-ranks with every device slot accounted for (no leak, bounded by the
  ceiling).
- The decode kernels honour per-row counts: the PyTorch backend here, the Triton kernel under the interpreter in a
  fresh process (as `tests/test_kernels.py` does).
- p = 1.0 with a ceiling covering every page equals dense attention; `budget_mass=None` runs none of this code.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from selection_oracle import run_case

import fc_hf.budget_mass as budget_mass
from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.budget_mass import choose_by_mass, entry_counts, with_pages_since
from fc_hf.kernels import bruteforce, torch_backend

INF = float("inf")


# -- configuration ---------------------------------------------------------------------------------

def test_defaults_and_resolution():
    assert FlexiCacheConfig().budget_mass is None
    cfg = FlexiCacheConfig(token_budget=1024, budget_mass=0.9)
    assert (cfg.mass_min_pages, cfg.mass_max_pages) == (16, 128)  # K // 4 and 2K (K = 64)
    cfg = FlexiCacheConfig(token_budget=1024, budget_mass=1, refine_pages=96)
    assert cfg.budget_mass == 1.0 and cfg.mass_max_pages == 96  # the ceiling defaults to at most the candidates
    assert FlexiCacheConfig(page_size=4, token_budget=8, budget_mass=0.5).mass_min_pages == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_mass=0.0), "0 < p <= 1"),
    (dict(budget_mass=1.5), "0 < p <= 1"),
    (dict(budget_mass=True), "0 < p <= 1"),
    (dict(budget_mass="0.9"), "0 < p <= 1"),
    (dict(budget_mass=0.9, refine_pages=0), "refine_pages=None"),
    (dict(budget_mass=0.9, page_score="exact"), "page_score='exact'"),
    (dict(budget_mass=0.9, stable_page_score="exact"), "stable_page_score=None"),
    (dict(budget_mass=0.9, tail_estimate=True), "tail_estimate=False"),
    (dict(budget_mass=0.9, budget_mass_max_pages=129), "Raise refine_pages"),
    (dict(budget_mass=0.9, budget_mass_min_pages=40, budget_mass_max_pages=20), "must not exceed"),
    (dict(budget_mass=0.9, budget_mass_min_pages=0), "positive integer"),
    (dict(budget_mass=0.9, budget_mass_min_pages=1, budget_mass_max_pages=2, sink_pages=2), "budget_mass_max_pages >= 3"),
    (dict(budget_mass_min_pages=4), "applies only with budget_mass"),
    (dict(budget_mass_max_pages=4), "applies only with budget_mass"),
])
def test_bad_settings_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlexiCacheConfig(token_budget=1024, **kwargs)


def test_auto_profile_is_refused():
    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="budget_mass"):
        FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=16, warmup_steps=16, rerank_interval=16,
                                                  budget_mass=0.9), profile="auto")


# -- the choice against every subset ---------------------------------------------------------------

def _smallest_sets_bruteforce(mass: list[float], key: list[float], p: float, lo: int, hi: int) -> tuple[int, float]:
    """(size, best mass of that size) over every subset holding the forced candidates (key +inf) whose mass reaches
    p (every candidate for p = 1), the size clamped to [lo, hi] (and the candidates); float64, no shortcuts."""
    c = len(mass)
    forced = [i for i in range(c) if key[i] == INF]
    others = [i for i in range(c) if key[i] != INF]
    if p >= 1.0:
        size = c
    else:
        size = c
        for extra in range(len(others) + 1):
            if any(sum(mass[i] for i in forced + list(s)) >= p for s in itertools.combinations(others, extra)):
                size = len(forced) + extra
                break
    size = min(max(size, len(forced), min(lo, c)), min(hi, c))
    extra = size - len(forced)
    best = max(sum(mass[i] for i in forced + list(s)) for s in itertools.combinations(others, extra))
    return size, best


def test_choice_is_the_smallest_set_reaching_p():
    g = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(300):
        c = int(torch.randint(2, 9, (1,), generator=g))
        n = 3
        raw = torch.rand(n, c, generator=g) ** 3  # skewed, like attention
        mass = raw / raw.sum(1, keepdim=True)
        key = mass.clone()
        n_forced = int(torch.randint(0, min(3, c), (1,), generator=g))
        key[:, :n_forced] = INF  # forced (sink, page being filled)
        if trial % 5 == 0:  # an all-padding candidate: mass 0, ranked last
            mass[:, -1] = 0.0
            key[:, -1] = -INF
            if c - 1 < n_forced:
                continue
        cand = torch.randperm(50, generator=g)[:c].expand(n, c).clone()
        p = float(torch.rand((), generator=g)) if trial % 7 else 1.0
        lo = int(torch.randint(1, c + 2, (1,), generator=g))
        hi = max(int(torch.randint(lo, c + 3, (1,), generator=g)), n_forced)  # the config keeps forced <= ceiling
        sel, order, counts = choose_by_mass(cand, mass, key, p, lo, hi)
        for r in range(n):
            pages = budget_mass.entry_counts(sel[r : r + 1])
            row = sel[r].tolist()
            k = int(counts[r])
            assert int(pages) == k and row[:k] == [x for x in row if x >= 0] and all(x == -1 for x in row[k:])
            assert order[r, :k].tolist() == [cand[r].tolist().index(x) for x in row[:k]]
            chosen = [cand[r].tolist().index(x) for x in row[:k]]
            assert set(range(n_forced)) <= set(chosen), "forced candidates are always kept"
            size, best = _smallest_sets_bruteforce(mass[r].double().tolist(), key[r].tolist(), p, lo, hi)
            got = sum(mass[r, i].item() for i in chosen)
            assert k == size, f"p={p} lo={lo} hi={hi}: kept {k} candidates, the smallest set has {size}"
            assert got >= best - 1e-5, f"kept mass {got} < {best}, the best of {size} candidates"
            checked += 1
    assert checked > 500


def test_width_is_the_widest_row_or_the_ceiling():
    cand = torch.arange(8).expand(2, 8)
    mass = torch.tensor([[0.9, 0.05, 0.05, 0, 0, 0, 0, 0], [0.125] * 8])
    sel, _, counts = choose_by_mass(cand, mass, mass.clone(), 0.8, 1, 6)
    assert counts.tolist() == [1, 6] and sel.shape == (2, 6)
    sel, _, counts = choose_by_mass(cand, mass, mass.clone(), 0.5, 1, 6, trim=True)
    assert counts.tolist() == [1, 4] and sel.shape == (2, 4)
    sel, _, _ = choose_by_mass(cand, mass, mass.clone(), 0.5, 1, 6, trim=False)
    assert sel.shape == (2, 6)


def test_pages_since_follow_each_rows_pages():
    sel = torch.tensor([[3, 0, -1, -1], [5, 2, 0, 7]])
    out = with_pages_since(sel, 9, 11)
    assert out.tolist() == [[3, 0, 9, 10, -1, -1], [5, 2, 0, 7, 9, 10]]
    assert entry_counts(out).tolist() == [4, 6]
    assert with_pages_since(sel, 9, 9) is sel


# -- the whole cache, step by step, against brute force ---------------------------------------------

BASE = dict(
    layers=1, kv_heads=2, ratio=2, head_dim=8, prompt=45, decode=14, pads=[0, 5], holes=[None, None],
    unstable=[(0, 1)], scaling=8**-0.5, seed=7, reorders={5: [1, 0], 9: [1, 1]},
    cfg=dict(page_size=4, token_budget=16, rerank_interval=3, sink_pages=1, recent_pages=0),
)


@pytest.mark.parametrize("p", [0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_oracle_fixed_cases(p, promotion):
    """Stable (tiered) and unstable heads, left padding, beam reorders, re-ranks every 3 steps."""
    run_case({**BASE, "cfg": {**BASE["cfg"], "budget_mass": p, "promotion": promotion,
                              "budget_mass_min_pages": 2, "budget_mass_max_pages": 7}})


def test_oracle_default_floor_and_ceiling_and_recent_pages():
    run_case({**BASE, "deferred_copies": True,
              "cfg": {**BASE["cfg"], "budget_mass": 0.8, "recent_pages": 1, "refine_pages": 12, "score_subpages": 2}})


@st.composite
def mass_cases(draw):
    layers = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 3))
    page_size = draw(st.integers(1, 6))
    k = draw(st.integers(3, 6))
    sink = draw(st.integers(0, min(2, k - 1)))
    recent = draw(st.integers(0, min(1, k - 1 - sink)))
    refine = draw(st.sampled_from([None, k + draw(st.integers(0, 4))]))
    c = 2 * k if refine is None else refine
    lo = draw(st.sampled_from([None, 1, 2, k]))
    hi_min = max(sink + recent + 1, lo or max(1, k // 4))
    hi = draw(st.sampled_from([None, min(c, max(hi_min, k)), c]))
    if hi is not None and lo is not None and lo > hi:
        lo = None
    if hi is None and lo is not None and lo > min(2 * k, c):
        lo = None
    prompt = draw(st.integers(2, (2 * k + 3) * page_size + 8))
    batch = draw(st.integers(1, 3))
    decode = draw(st.integers(1, 16))
    pads = [0] + [draw(st.integers(0, prompt - 1)) for _ in range(batch - 1)]
    pairs = [(l, h) for l in range(layers) for h in range(kv_heads)]
    head_dim = draw(st.sampled_from([4, 8]))
    cfg = dict(
        page_size=page_size, token_budget=k * page_size, rerank_interval=draw(st.integers(1, 5)),
        unstable_rerank_interval=draw(st.integers(1, 2)), offload=draw(st.integers(0, 3)) > 0,
        promotion=draw(st.sampled_from(["sync", "deferred"])), page_score=draw(st.sampled_from(["quest", "group_mean"])),
        refine_pages=refine, sink_pages=sink, recent_pages=recent,
        budget_mass=draw(st.sampled_from([0.2, 0.5, 0.8, 0.95, 1.0])),
        budget_mass_min_pages=lo, budget_mass_max_pages=hi,
        streaming_heads=(draw(st.sampled_from(pairs)),) if draw(st.integers(0, 4)) == 0 else (),
    )
    reorder_steps = draw(st.sets(st.integers(1, decode), max_size=2))
    return dict(
        layers=layers, kv_heads=kv_heads, ratio=draw(st.sampled_from([1, 2, 3])), head_dim=head_dim, prompt=prompt,
        decode=decode, pads=pads, holes=[None] * batch, cfg=cfg,
        unstable=None if draw(st.integers(0, 3)) == 0 else draw(st.sets(st.sampled_from(pairs))),
        reorders={s: [draw(st.integers(0, batch - 1)) for _ in range(batch)] for s in sorted(reorder_steps)},
        scaling=draw(st.sampled_from([0.1, head_dim**-0.5, 1.0])), seed=draw(st.integers(0, 2**16)),
        deferred_copies=draw(st.booleans()),
    )


@settings(max_examples=int(os.environ.get("FLEXICACHE_HYPOTHESIS_EXAMPLES", "25")), deadline=None, derandomize=True,
          database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=mass_cases())
def test_oracle_drawn_cases(case):
    run_case(case)


# -- stable heads: sets that grow and shrink --------------------------------------------------------

def _step(model, cache, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_stable_sets_grow_and_shrink_with_every_slot_accounted_for(promotion):
    model = tiny_model("llama", layers=2)
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])  # layer 0 mixed, layer 1 all stable
    cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=2, budget_mass=0.6, promotion=promotion,
                           budget_mass_min_pages=1, budget_mass_max_pages=8)
    cache = FlexiCache(model.config, cfg, profile)
    ids, mask = left_padded_batch(2, 70, pad_lengths=[0, 6])
    out = _step(model, cache, ids, mask)
    history: dict[int, list[list[int]]] = {}
    since = math.ceil(cfg.rerank_interval / cfg.page_size) + 1
    for _ in range(30):
        tok = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        out = _step(model, cache, tok, mask)
        for layer in cache.flexi_layers:
            for group in layer.groups:
                if group.kind != "stable":
                    continue
                store = group.store
                resident = group._resident_pages()
                held = int(entry_counts(resident).sum())
                # Every resident page has a slot, every slot in use is a resident page (grown or shrunk): no leak.
                assert int((store.table[:, : store.num_pages] != 0).sum()) == held == store.slots_in_use()
                assert held <= store.rows * (cfg.mass_max_pages + since)  # bounded by the ceiling
                history.setdefault(id(group), []).append(entry_counts(group.sel).tolist())
    changes = [(a, b) for h in history.values() for prev, cur in zip(h, h[1:]) for a, b in zip(prev, cur) if a != b]
    assert any(b > a for a, b in changes) and any(b < a for a, b in changes), "no set grew and shrank"
    assert torch.isfinite(out.logits).all()
    stats = cache.stats()
    assert cfg.mass_min_pages <= stats["pages_per_ranking"] <= cfg.mass_max_pages
    assert stats["pages_promoted"] > 0


# -- the decode kernels honour per-row counts -----------------------------------------------------------

def _counts_case(seed=0, dtype=torch.float32):
    """Rows whose entries past their count are real pages (so a kernel that ignored the count would attend them)."""
    g = torch.Generator().manual_seed(seed)
    n, groups, d, p, pages, length = 6, 3, 16, 4, 12, 45
    keys = torch.randn(n, pages * p, d, generator=g)
    values = torch.randn(n, pages * p, d, generator=g)
    perm = torch.randperm(n * pages, generator=g) + 1
    k_pool = torch.zeros(n * pages + 1, p, d)
    v_pool = torch.zeros_like(k_pool)
    table = perm.view(n, pages)
    k_pool[table] = keys.view(n, pages, p, d)
    v_pool[table] = values.view(n, pages, p, d)
    page_idx = torch.stack([torch.randperm(pages, generator=g)[:7] for _ in range(n)])
    counts = torch.tensor([0, 1, 3, 7, 5, 2])
    slots = table.gather(1, page_idx)
    q = torch.randn(n, groups, d, generator=g)
    token_valid = torch.ones(2, length, dtype=torch.bool)
    token_valid[1, :6] = False
    allowed = torch.zeros(n, pages * p, dtype=torch.bool)
    for r in range(n):
        for pg in page_idx[r, : counts[r]].tolist():
            allowed[r, pg * p : (pg + 1) * p] = True
    allowed[:, length:] = False
    allowed &= torch.nn.functional.pad(token_valid, (0, pages * p - length)).repeat_interleave(3, 0)
    brute = bruteforce.dense_attention_bruteforce(q, keys, values, allowed, d**-0.5)
    args = (q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), slots, page_idx, length, d**-0.5, token_valid, 3)
    return args, counts, table, brute


def test_torch_decode_honours_counts():
    args, counts, table, brute = _counts_case()
    out = torch_backend.sparse_decode_attention(*args, counts=counts)
    torch.testing.assert_close(out, brute, rtol=1e-4, atol=1e-5)
    assert out[0].abs().max() == 0  # a row with no entries attends to nothing
    q, k_pool, v_pool, slots, page_idx, *rest = args
    by_table = torch_backend.sparse_decode_attention(q, k_pool, v_pool, None, page_idx, *rest, counts=counts, table=table)
    torch.testing.assert_close(by_table, brute, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="counts"):
        torch_backend.sparse_decode_attention(*args, counts=counts, in_range=True)


def _interpreted_triton_checks() -> None:
    """Run in a fresh process with TRITON_INTERPRET=1 (triton must be imported with the interpreter on)."""
    from fc_hf.kernels.decode import sparse_decode_attention_triton
    from fc_hf.kernels.refine import candidate_mass_triton

    args, counts, table, brute = _counts_case()
    q, k_pool, v_pool, slots, page_idx, *rest = args
    for splits in (1, 3):
        for kw in (dict(), dict(table=table)):
            s = None if kw else slots
            out = sparse_decode_attention_triton(q, k_pool, v_pool, s, page_idx, *rest, num_splits=splits, counts=counts,
                                                 **kw)
            torch.testing.assert_close(out, brute, rtol=1e-4, atol=1e-5)
    # The raw candidate masses budget_mass ranks by (no forcing: forced = 0) agree with the PyTorch backend.
    forced = torch.zeros(page_idx.shape, dtype=torch.float32)
    got = candidate_mass_triton(q, k_pool, slots, page_idx, rest[0], rest[1], forced, rest[2], rest[3])
    want = torch_backend.candidate_mass(q, k_pool, slots, page_idx, rest[0], rest[1], forced, rest[2], rest[3])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # End to end on the Triton backend (interpreted): the same logits as the PyTorch backend, stable heads included.
    model = tiny_model("llama", layers=1)
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])
    logits = {}
    for backend in ("torch", "triton"):
        cfg = FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=2, budget_mass=0.7, backend=backend)
        cache = FlexiCache(model.config, cfg, profile)
        ids, mask = left_padded_batch(2, 40, pad_lengths=[0, 5])
        out = _step(model, cache, ids, mask)
        steps = []
        for _ in range(3):
            tok = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            out = _step(model, cache, tok, mask)
            steps.append(out.logits[:, -1])
        logits[backend] = torch.stack(steps)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    print("TRITON-COUNTS-OK")


def test_triton_kernel_honours_counts_interpreted():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter run is the CPU stand-in; on CUDA the GPU checks cover the compiled kernel")
    root = Path(__file__).resolve().parents[1]
    code = ("import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.path.insert(0, 'tests'); "
            "import test_budget_mass as t; t._interpreted_triton_checks()")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "TRITON-COUNTS-OK" in run.stdout, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"


def _compile_counts_variants() -> None:
    """Run in a fresh process without the interpreter: the decode kernel with per-row counts compiles for sm_90 (no
    GPU needed), without spills in fp16/bf16 (`tests/test_kernel_compile.py`'s `_compile`)."""
    import test_kernel_compile as tkc
    from fc_hf.kernels import decode

    for dtype, splits, padded in ((torch.bfloat16, 4, True), (torch.float16, 1, False), (torch.float32, 2, False)):
        n, g, d, m = 32, 4, 128, 64
        query, pool = torch.empty(n, g, d, dtype=dtype), torch.empty(1025, 16, d, dtype=dtype)
        table, page_idx = torch.zeros(n, 300, dtype=torch.int64), torch.zeros(n, m, dtype=torch.int64)
        token_valid = torch.ones(4, 1024, dtype=torch.bool) if padded else None
        _, args, constexprs, options = decode._decode_plan(
            query, pool, pool, table, page_idx, 1000, d**-0.5, token_valid, 8, None, torch.empty(n, g, d, dtype=dtype),
            splits, by_page=True, counts=torch.zeros(n, dtype=torch.int32))
        assert constexprs["HAS_COUNTS"]
        constexprs["UPCAST"] = dtype == torch.float32
        tkc._compile(decode._sparse_decode_kernel, args, constexprs, options, f"counts split{splits}", dtype)
    print("COMPILE-COUNTS-OK")


def test_triton_kernel_with_counts_compiles_for_sm90():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import sys; sys.path.insert(0, 'tests'); import test_budget_mass as t; t._compile_counts_variants()"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "COMPILE-COUNTS-OK" in run.stdout, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"


# -- dense at p = 1 with a ceiling covering every page; the default path untouched ----------------------------

def _decode_logits(model, cache, ids, mask, steps):
    out = _step(model, cache, ids, mask)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        tok = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        out = _step(model, cache, tok, mask)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("stable", [False, True], ids=["unstable", "stable-tiered"])
def test_p1_with_a_ceiling_over_every_page_equals_dense(stable):
    from transformers import DynamicCache

    model = tiny_model("llama", layers=2)
    ids, mask = left_padded_batch(2, 50, pad_lengths=[0, 7])
    dense = _decode_logits(model, DynamicCache(config=model.config), ids, mask, 8)
    profile = HeadProfile.from_unstable(model.config, [(0, 0)]) if stable else None
    cfg = FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=3, refine_pages=32, budget_mass=1.0,
                           budget_mass_max_pages=32)  # 2 pages of budget, but 15-16 pages all kept
    sparse = _decode_logits(model, FlexiCache(model.config, cfg, profile), ids, mask, 8)
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)
    low = FlexiCacheConfig(page_size=4, token_budget=8, budget_mass=0.3, budget_mass_max_pages=4)
    assert (_decode_logits(model, FlexiCache(model.config, low, profile), ids, mask, 8) - dense).abs().max() > 1e-4


def test_default_path_runs_no_budget_mass_code(monkeypatch):
    """budget_mass=None: the selection, the page lists, the tier moves and the decode call are today's (none of the
    variable-count code runs), so outputs are bit for bit what they were."""
    import fc_hf.head_group as head_group
    import fc_hf.selection as selection

    def boom(*a, **k):
        raise AssertionError("budget_mass code ran with budget_mass=None")

    for mod, name in ((selection, "choose_by_mass"), (head_group, "with_pages_since"), (head_group, "entry_counts")):
        monkeypatch.setattr(mod, name, boom)
    real = torch_backend.sparse_decode_attention

    def no_counts(*a, **k):
        assert k.get("counts") is None and (len(a) < 18 or a[17] is None)
        return real(*a, **k)

    monkeypatch.setattr(torch_backend, "sparse_decode_attention", no_counts)
    model = tiny_model("llama", layers=2)
    profile = HeadProfile.from_unstable(model.config, [(0, 0)])
    cache = FlexiCache(model.config, FlexiCacheConfig(page_size=4, token_budget=8, rerank_interval=2), profile)
    ids, mask = left_padded_batch(2, 40, pad_lengths=[0, 5])
    _decode_logits(model, cache, ids, mask, 5)
    stats = cache.stats()
    assert stats["pages_per_ranking"] == 2.0  # K pages per ranked head, always


@pytest.mark.parametrize("bug", ["lower_p", "drop_forced", "ignore_floor"])
def test_oracle_catches_a_wrong_choice(monkeypatch, bug):
    """The oracle's budget_mass branch is not vacuous: a choice that stops early, drops a forced page or ignores the
    floor is caught as a wrong selection."""
    import fc_hf.selection as selection

    def wrong(cand, mass, key, p, lo, hi, trim=True):
        if bug == "lower_p":
            return choose_by_mass(cand, mass, key, p * 0.5, lo, hi, trim)
        if bug == "ignore_floor":
            return choose_by_mass(cand, mass, key, p, 1, hi, trim)
        sel, order, counts = choose_by_mass(cand, mass, torch.where(torch.isinf(key), mass, key), p, lo, hi, trim)
        return sel, order, counts

    monkeypatch.setattr(selection, "choose_by_mass", wrong)
    cfg = {**BASE["cfg"], "budget_mass": 0.7, "budget_mass_min_pages": 5 if bug == "ignore_floor" else 2,
           "budget_mass_max_pages": 7}
    with pytest.raises(AssertionError, match="selection"):
        run_case({**BASE, "cfg": cfg})

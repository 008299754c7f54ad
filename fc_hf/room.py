"""`Room`: how many tokens per sequence every FlexiCache layer of a cache has room for (its capacity).

Chosen when the first prompt arrives (`max_cache_len`, else what `generate` will need), and grown, outside decode steps,
when an eager step needs more; bounded by `max_device_pages` over all the cache's layers. A compiled decode step cannot
grow it (`FULL_WHEN_COMPILED`).
"""

from __future__ import annotations

import torch

from .errors import FlexiCacheError
from .speculative import generate_max_length

DEFAULT_DECODE_ROOM = 1024  # tokens past a prompt that a cache filled outside `generate` holds before it grows

# No number in it: a compiled step's capacity may be symbolic (generate's default `dynamic=None` makes it so once it
# changed), and a message is a constant of the graph.
FULL_WHEN_COMPILED = (
    "A compiled FlexiCache decode step has no room left (cache.capacity tokens per sequence): a compiled step cannot "
    "grow the cache. Pass max_cache_len= to FlexiCache (the prompt plus every token to generate), or let generate "
    "size it (it does from max_new_tokens)."
)


class Room:
    """The capacity of a cache's FlexiCache layers (`layers`, set by the cache once it built them), in tokens per
    sequence (0: nothing allocated yet)."""

    def __init__(self, cfg, max_cache_len: int | None):
        self.cfg = cfg
        self.max_cache_len = max_cache_len
        self.capacity = 0
        self.layers: list = []

    def capacity_for(self, tokens: int, batch: int) -> int:
        """The capacity to allocate when the first `tokens` arrive: `max_cache_len`, else what `generate` will need
        (its `max_length`), else `tokens` plus `DEFAULT_DECODE_ROOM`; under `max_device_pages`, at most what fits (and
        refused, before anything is written, if `tokens` do not)."""
        if not self.capacity:
            wanted = self.max_cache_len or generate_max_length() or tokens + DEFAULT_DECODE_ROOM
            floor = 2 * self.cfg.page_size  # a ranking's page being filled and one more
            self.capacity = self._bounded(max(wanted, tokens, floor), max(tokens, floor), batch)
        return self.capacity

    def choose_again(self) -> None:
        """The next prompt chooses the capacity anew (`capacity_for`): every layer dropped its tensors (an empty cache
        taking a batch of another size)."""
        self.capacity = 0

    def ensure(self, tokens: int, wanted: int = 0) -> None:
        """Room for `tokens` per sequence in every layer, grown (new tensors, outside a decode step) when short: to
        what `generate` will need if that holds them, else by half again, within `max_device_pages` (refused, before
        anything is written, where `tokens` do not fit). `wanted`: tokens a prompt's generate call will hold (its
        `max_length`), grown to as far as `max_device_pages` allows, since its compiled decode steps cannot grow."""
        if tokens <= self.capacity and wanted <= self.capacity:
            return
        if torch.compiler.is_compiling():
            raise FlexiCacheError(f"{FULL_WHEN_COMPILED} cache.capacity is {self.capacity}.")
        batch = next((layer.batch for layer in self.layers if layer.is_initialized), 1)
        # A prompt's `wanted` is already generate's max_length (read at its prompt stage): no second walk of the stack.
        grown = max(tokens, wanted or generate_max_length() or 0, self.capacity + self.capacity // 2)
        self.capacity = max(self.capacity, self._bounded(grown, tokens, batch))
        for layer in self.layers:
            layer.grow(self.capacity)

    def ensure_prompt(self, tokens: int) -> None:
        """Room for a prompt (`tokens` per sequence, held ones included) and, for a cache sized by `generate` (no
        `max_cache_len`), for what that `generate` call will hold: its decode steps may be compiled, and a compiled
        step cannot grow the cache (a reset cache, or a new turn, whose prompt fits but whose new tokens would not).
        A given `max_cache_len` stays the room a compiled step has, as `StaticCache`'s does."""
        self.ensure(tokens, 0 if self.max_cache_len else (generate_max_length(loop=False) or 0))

    def _bounded(self, wanted: int, needed: int, batch: int) -> int:
        """`wanted` tokens (page-rounded), or the most that fit `max_device_pages` over all layers if fewer, never
        fewer than `needed`: a capacity that does not fit is refused."""
        page = self.cfg.page_size
        wanted, needed = _round_up(wanted, page), _round_up(needed, page)
        bound = self.cfg.max_device_pages
        if bound is None:
            return wanted

        def fits(capacity):
            return sum(layer.device_pages(capacity, batch) for layer in self.layers) <= bound

        if not fits(needed):
            held = max((layer.length for layer in self.layers), default=0)
            state = "The cache is still empty." if held == 0 else (
                f"Nothing was written; the cache still holds all {held} tokens so far.")
            pages = sum(layer.device_pages(needed, batch) for layer in self.layers)
            raise FlexiCacheError(
                f"Holding {needed} tokens per sequence needs {pages} device pages but max_device_pages={bound}. "
                f"Raise max_device_pages, shorten the prompt or generation, or use a smaller batch. {state}"
            )
        low, high = needed // page, wanted // page  # the most pages per row that fit, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid * page) else (low, mid - 1)
        return low * page


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple

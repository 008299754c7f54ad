"""`ForwardState`: what one forward's FlexiCache layers share, handed to each layer by its cache.

A layer reads the forward from here, never from the cache: whether this forward is generate's prompt stage
(`prefilling`), where an assisted loop's prompt ends (`loop_prompt_end`), and, on each device, the decode step's
context (`DecodeContext`: position, step and masks, made by the device's first layer) and a verification block's masks.
The decode steps' mask buffers of each device outlive the forward (made by a prompt, so a compiled step finds them).
"""

from __future__ import annotations

import torch

from .decode import DecodeContext
from .room import FULL_WHEN_COMPILED
from .step_bias import StepBias
from .store import mark_static


class ForwardState:
    def __init__(self, cfg):
        self.cfg = cfg
        self.prefilling = False  # this forward runs in generate's prompt stage: its single token is a prompt token
        self.loop_prompt_end: int | None = None  # speculative decoding: where the assisted loop's prompt ends
        self.biases: dict[torch.device, StepBias] = {}  # each device's decode-step masks (`fc_hf/step_bias.py`)
        self._contexts: dict[torch.device, DecodeContext] = {}  # this forward's decode step, per device
        self._block_biases: dict[torch.device, StepBias] = {}  # this forward's verification block's masks, per device

    def begin(self, prefilling: bool) -> None:
        """A forward starts: nothing of the last one's steps is reused."""
        self._contexts, self._block_biases = {}, {}
        self.prefilling = prefilling

    def release(self) -> None:
        """Drop every buffer (`FlexiCache.release`)."""
        self.biases, self._contexts, self._block_biases = {}, {}, {}

    def context(self, layer) -> DecodeContext:
        """This forward's decode context on `layer`'s device (made by its first FlexiCache layer there)."""
        ctx = self._contexts.get(layer.device)
        if ctx is None:
            ctx = self._contexts[layer.device] = self.fresh_context(layer)
        return ctx

    def fresh_context(self, layer) -> DecodeContext:
        """A decode context for `layer`'s next token: its position and step now, its device's mask buffers."""
        store = layer.store
        position = store.length_t.clone()
        if torch.compiler.is_compiling():  # an eager step grew the cache first (`Room.ensure`); a compiled one cannot
            torch._assert_async(position < store.capacity, FULL_WHEN_COMPILED)
        return DecodeContext(position, position - layer.prompt_end_t + 1, self.step_bias(layer))

    def step_bias(self, layer) -> StepBias:
        """The mask buffers of decode steps on `layer`'s device, for its batch and capacity (made outside a decode step:
        by a prompt, so a compiled step finds them)."""
        store, device = layer.store, layer.device
        bias = self.biases.get(device)
        if torch.compiler.is_compiling():  # made by the prompt; comparing sizes would specialise a symbolic capacity
            return bias
        if bias is None or bias.batch != store.batch or bias.num_pages != store.pages:
            cfg = self.cfg
            bias = StepBias(store.batch, store.pages, cfg.page_size, cfg.subpages, cfg.sink_pages, device)
            mark_static(bias)
            self.biases[device] = bias
        return bias

    def block_bias(self, layer, mask, positions: torch.Tensor) -> StepBias:
        """The masks of this forward's verification block on `layer`'s device (made by its first layer there):
        `StepBias.for_block` of the mask's last rows at `positions`."""
        bias = self._block_biases.get(layer.device)
        if bias is None:
            bias = self._block_biases[layer.device] = StepBias.for_block(
                self.step_bias(layer), mask if isinstance(mask, torch.Tensor) else None, positions)
        return bias

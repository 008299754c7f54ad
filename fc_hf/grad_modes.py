"""How FlexiCache meets autograd and inference mode.

- The cache's own tensors (pages, tables, metadata, selections) never record autograd and are never inference tensors:
  `storage_mode()` runs the cache's work under `no_grad` with inference mode off. So a forward works the same, with the
  same results, under `torch.no_grad()`, plain autograd and `torch.inference_mode()`, and a cache filled in one mode is
  usable in another (a prefill under inference mode, then `generate`).
- Stored K/V carry no gradient. Attention that reads them (a decode step, tokens added to a filled cache) is wrapped by
  `stored_kv_output()`: backward through it raises `FlexiCacheError` instead of returning a gradient that silently
  misses the stored K/V's share. A prompt on an empty cache attends over the model's own K/V, so its gradient is exact.
"""

from __future__ import annotations

import contextlib

import torch

from .errors import FlexiCacheError

_NO_GRADIENT = (
    "Backward through a FlexiCache step: FlexiCache stores K/V without autograd history, so a gradient through attention "
    "over stored tokens (a decode step, or tokens added to a filled cache) would miss their share. Gradients are exact "
    "only for a prompt on an empty FlexiCache. Train or take gradients with DynamicCache (or no cache), or run FlexiCache "
    "under torch.no_grad()."
)


def storage_mode() -> contextlib.AbstractContextManager:
    """Where the cache writes its state: no autograd and no inference tensors; a no-op in plain `no_grad` (generate)."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() or torch.is_inference_mode_enabled()):
        return contextlib.nullcontext()  # a compiled step is generate's decode, under no_grad
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    if torch.is_inference_mode_enabled():
        stack.enter_context(torch.inference_mode(False))
    return stack


class _StoredKVGradient(torch.autograd.Function):
    """Identity on the attention output; its backward raises (see the module docstring)."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise FlexiCacheError(_NO_GRADIENT)


def stored_kv_output(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """`out`, computed from stored K/V and from `inputs` (the query, the new K/V) under `storage_mode()`: when autograd
    records and an input needs a gradient, tied to them so that backward raises `FlexiCacheError`."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _StoredKVGradient.apply(out, *inputs)
    return out

"""What differs between the transformers versions FlexiCache supports (5.17 - 5.x).

transformers 5.24 renamed the cache keyword of `model.forward` / `generate` from `past_key_values`
to `cache` (the old name still works there, with a `FutureWarning`). FlexiCache accepts a cache
under either name from users; its own calls ask `cache_kwarg` which name the installed version
prefers, so they never trigger the warning.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["cache_kwarg", "cache_kwargs", "call_with_accepted"]


def cache_kwarg(model) -> str:
    """The keyword `model.forward` / `generate` take a cache under: "cache" from transformers 5.24, else
    "past_key_values"."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict[str, Any]:
    """`{cache_kwarg(model): cache}`, ready to splat into a call; empty for `cache=None` (the model then
    makes its own `DynamicCache`)."""
    return {} if cache is None else {cache_kwarg(model): cache}


def call_with_accepted(fn, kwargs: dict[str, Any]):
    """`fn(**kwargs)` with only the keywords `fn` accepts: transformers' layer hooks take more keywords in newer versions
    (5.25's `activate_past_recording(recurrent_states_to_keep=...)`) than in older ones (none)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})

"""When each stable row ranks: all of them at the first decode step after a prompt, then each at its own phase.

A layer's `n` stable rows are spread over the `R = rerank_interval` phases of a decode step: row `j` belongs to phase
`ceil(φ n / R) <= j < ceil((φ + 1) n / R)`, and at decode step `s >= 2` (counted from the end of the last prompt) the
rows of phase `s % R` rank. Every step ranks the same number of rows, `ceil(n / R)` (places without a row are padded:
computed and thrown away), so no step carries a layer's whole re-rank; each row still ranks every R steps, and at most R
steps pass between two rankings of a row (its first after step 1 comes within R + 1). That padding is for a compiled
step (one graph for every step); an eager step knows its step on the host and ranks just its phase's rows.
"""

from __future__ import annotations

import math

import torch


def rows_per_step(n_stable: int, interval: int) -> int:
    """Places a staggered step ranks: `ceil(n / R)`."""
    return math.ceil(n_stable / interval) if n_stable else 0


def phase_range(phase: int, n_stable: int, interval: int) -> tuple[int, int]:
    """The stable rows `[start, end)` of `phase`."""
    return (phase * n_stable + interval - 1) // interval, ((phase + 1) * n_stable + interval - 1) // interval


def due_rows(step: torch.Tensor, n_stable: int, interval: int, places: torch.Tensor) -> torch.Tensor:
    """The stable rows (indices among the stable rows) that rank at decode step `step` (a device scalar, >= 2), padded
    with `n_stable` (the stable tensors' extra row). `places`: `arange(rows_per_step(n_stable, interval))`."""
    start, end = phase_range(step % interval, n_stable, interval)
    rows = start + places
    return torch.where(rows < end, rows, n_stable)


def ranked_rows(steps: int, n_stable: int, interval: int) -> int:
    """Stable rows ranked over decode steps 1..`steps` after a prompt (all at step 1, each phase's after)."""
    if steps <= 0 or not n_stable:
        return 0
    total = n_stable
    for phase in range(min(interval, steps + 1)):  # a phase past `steps` never comes (a long interval)
        start, end = phase_range(phase, n_stable, interval)
        # steps s in [2, steps] with s % R == phase
        first = phase if phase >= 2 else phase + interval * -(-(2 - phase) // interval)
        occurrences = 0 if first > steps else (steps - first) // interval + 1
        total += (end - start) * occurrences
    return total


def phase_of(row: int, n_stable: int, interval: int) -> int:
    """The phase of stable row `row`: the φ with `ceil(φ n / R) <= row < ceil((φ + 1) n / R)`."""
    return (row * interval) // n_stable if n_stable else 0


def last_ranking_step(phase: int, steps: int, interval: int) -> int:
    """The last decode step `<= steps` at which a row of `phase` ranked (step 1 ranks every row)."""
    last = steps - ((steps - phase) % interval)  # the largest s <= steps with s % R == phase
    return last if last >= 2 else 1

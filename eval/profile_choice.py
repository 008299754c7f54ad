"""Which head profile an evaluated task runs with: one made on *other* tasks (no leakage).

The default is the bundled `profiles/<model>.json`. When it records per-task results, the profiler
tasks built from the evaluated task's material (`excluded_tasks`) are removed: exactly, with the
profiler's `profile_excluding`, when its per-task tallies are there; else by re-voting the remaining
per-task sets. With no profile at all a seeded random 25% of heads stands in (`FALLBACK_NOTE`).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from fc_hf.errors import ProfileError
from fc_hf.profile import PROFILE_DIR, HeadProfile, attention_shape

__all__ = ["FALLBACK_NOTE", "excluded_tasks", "resolve_profile"]

FALLBACK_NOTE = (
    "FALLBACK: no stability profile found for this model; 25% of KV heads chosen at random (seed 0) "
    "stand in for the unstable set. This is not a stability profile."
)


def _per_task_sets(extra: dict[str, Any]) -> dict[str, list] | None:
    """The profiler's per-task unstable sets (`extra["per_task_unstable"]`), if the profile recorded them."""
    for key in ("per_task_unstable", "per_task"):
        value = extra.get(key)
        if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
            return value
    tasks = extra.get("tasks")  # the profiler's per-task tallies, each with its own "unstable" list
    if isinstance(tasks, dict) and tasks and all(isinstance(v, dict) and "unstable" in v for v in tasks.values()):
        return {name: entry["unstable"] for name, entry in tasks.items()}
    return None


# Evaluated task -> the profiler tasks (fc_hf.profiler.tasks) built from the same material, which must be
# left out of its profile. Fidelity is teacher-forced continue/recall on the KJV text, exactly what the
# profiler's kjv-continue and kjv-recall decode. Free-running continuation of KJV passages (freerun) is
# kjv-continue's.
_SAME_MATERIAL = {
    "fidelity": ("kjv-continue", "kjv-recall"),
    "freerun": ("kjv-continue",),
    "niah_single_1": ("ruler-niah",), "niah_multikey_2": ("ruler-niah",), "niah_multikey_3": ("ruler-niah",),
    "ruler_vt": ("ruler-vt",),
}


def excluded_tasks(eval_task: str, profile_tasks: Sequence[str]) -> list[str]:
    """Profile tasks that share the evaluated task's material (same name up to `_`/`-`, or `_SAME_MATERIAL`)."""
    norm = lambda t: t.lower().replace("_", "-")  # noqa: E731
    same = set(_SAME_MATERIAL.get(eval_task, ()))
    return [t for t in profile_tasks if t in same or norm(t) == norm(eval_task)]


def resolve_profile(model_name: str, model_config, eval_task: str, profile_arg: str | None = None):
    """The head profile to evaluate `eval_task` with, made on other tasks; and a note saying how.

    Order: `profile_arg` (a file or bundled name), else the bundled `profiles/<model>.json`, else
    the random fallback (`FALLBACK_NOTE`). When the profile records per-task results, the tasks that
    share `eval_task`'s material (`excluded_tasks`) are removed: exactly with the profiler's
    `profile_excluding` when its per-task tallies are there, else by re-voting the per-task sets (a
    head counts once per remaining task that marks it; the most-voted heads fill a set as large as
    the profile's).
    """
    bundled = f"{Path(model_name).name}.json"
    source = profile_arg or str(PROFILE_DIR / bundled)
    try:
        profile = HeadProfile.load(source, config=model_config)
    except ProfileError:
        if profile_arg:
            raise
        layers, kv_heads, _ = attention_shape(model_config)
        pairs = [(l, h) for l in range(layers) for h in range(kv_heads)]
        chosen = random.Random(0).sample(pairs, max(1, round(0.25 * len(pairs))))
        return HeadProfile.from_unstable(model_config, chosen, extra={"note": FALLBACK_NOTE}), FALLBACK_NOTE

    source = profile_arg or f"profiles/{bundled}"  # as notes show it: no path of this machine
    per_task = _per_task_sets(profile.extra)
    if not per_task:
        tasks = profile.extra.get("tasks")
        names = sorted(tasks) if isinstance(tasks, (dict, list)) else tasks
        return profile, f"profile {source} (tasks {names}); no per-task sets recorded, so {eval_task!r} could not be excluded"
    drop = excluded_tasks(eval_task, list(per_task))
    if not drop:
        return profile, f"profile {source} (tasks {sorted(per_task)}; none shares {eval_task!r}'s material)"
    if len(drop) == len(per_task):
        raise ProfileError(f"Profile {source} was made only on {sorted(per_task)}: no task other than {eval_task!r} to use.")
    tallies = profile.extra.get("tasks")
    if isinstance(tallies, dict) and all(isinstance(v, dict) for v in tallies.values()):
        from fc_hf.profiler.build import profile_excluding

        derived = profile_excluding(profile, drop)
        return derived, f"profile {source} rebuilt without {drop} (from {sorted(set(per_task) - set(drop))})"
    others = {t: v for t, v in per_task.items() if t not in drop}
    votes = Counter((int(l), int(h)) for sets in others.values() for l, h in sets)
    chosen = [p for p, _ in sorted(votes.items(), key=lambda kv: (-kv[1], kv[0]))[:len(profile.unstable)]]
    note = f"profile {source}, re-voted over tasks {sorted(others)} (excluded {drop})"
    return HeadProfile.from_unstable(model_config, chosen, extra={"note": note, "source": source}), note

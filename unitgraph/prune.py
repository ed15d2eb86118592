"""Optional units: drop the units that do nothing for the data a run provides (spec v1 `requires`).

A unit that declares `requires` is a no-op unless each of those params is available: provided by
the dataset or written by an earlier active unit. The split and its checks C1-C3 then apply to the
active pipeline alone; an inactive unit neither reads nor writes, so no active unit's versions
change (tests/test_prune.py checks this by simulation).
"""

from __future__ import annotations

from typing import Iterable

from .spec import Pipeline


def active_units(pipeline: Pipeline, provided: Iterable[str] | None) -> list[bool]:
    """Which units run, given the dataset params a run provides (None: assume every unit runs)."""
    if provided is None:
        return [True] * len(pipeline.units)
    available = set(provided)
    active = []
    for unit in pipeline.units:
        runs = all(p in available for p in unit.requires)
        active.append(runs)
        if runs:
            available.update(unit.outputs)
    return active


def prune(pipeline: Pipeline, provided: Iterable[str] | None) -> tuple[Pipeline, list[str]]:
    """The active pipeline and the names of the units dropped from it."""
    flags = active_units(pipeline, provided)
    if all(flags):
        return pipeline, []
    kept = tuple(u for u, on in zip(pipeline.units, flags) if on)
    dropped = [u.name for u, on in zip(pipeline.units, flags) if not on]
    return Pipeline(pipeline.name, kept, pipeline.sink, source=pipeline.source), dropped

"""Making a plan: the function `split` and what is derived from it (docs/semantics.md, 'The rules' and
'What the stages do'; docs/plan-format.md, 'Plan').

The record a plan is written down as, and its file format, live in planfile.py; they are
re-exported here, where callers have always found them, so `from unitgraph.plan import Plan,
read_plan_file, split` keeps working.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterable

from .closure import CACHE_MODES, LATEST, VERSIONED, Reason, backward_models, train_set
from .entries import cache_entries
from .errors import SpecError
from .graph import VersionGraph
from .planfile import FORMAT, Plan, active_pipeline, fingerprint, read_plan_file
from .prune import prune
from .spec import Pipeline
from .soundness import checks_from, find_violations

__all__ = [
    "FORMAT",
    "Plan",
    "active_pipeline",
    "fingerprint",
    "models_versioned_keeps_out",
    "plan_from_train_set",
    "read_plan_file",
    "split",
    "stage_configs",
    "versioned_savings_line",
]


def split(
    pipeline: Pipeline,
    trainable_models: Iterable[str] = (),
    lora_base_model: str | None = None,
    cache_mode: str = LATEST,
    provided: Iterable[str] | None = None,
) -> Plan:
    """Plan `pipeline` for the given models: TRAIN, cache entries, models per stage, verified checks.

    `provided` names the dataset params a run has; units whose `requires` are not met are dropped
    first (see prune.py) and listed in the plan as `inactive_units`. None keeps every unit.
    """
    if cache_mode not in CACHE_MODES:
        raise SpecError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {cache_mode!r}")
    if isinstance(trainable_models, str):
        trainable_models = trainable_models.split(",")
    backward = backward_models(trainable_models, lora_base_model)
    _check_models_exist(pipeline, backward)
    with gc_paused():
        return _split(pipeline, backward, cache_mode, provided)


def _split(pipeline: Pipeline, backward: frozenset[str], cache_mode: str, provided: Iterable[str] | None) -> Plan:
    active, inactive = prune(pipeline, provided)
    vg = VersionGraph.of(active)
    reasons = train_set(vg, backward, cache_mode)
    plan = plan_from_train_set(vg, backward, set(reasons), cache_mode, reasons)
    if provided is not None:
        plan.extra["provided"] = sorted(set(provided))
        plan.extra["inactive_units"] = inactive
    found = find_violations(pipeline, plan)
    plan.checks = checks_from(found, cache_mode)
    plan.violations = [str(v) for v in found]
    return plan


@contextmanager
def gc_paused():
    """Planning allocates millions of small acyclic containers on big pipelines; CPython's cyclic
    collector would traverse them again and again (half the time at 100k units) and find nothing.

    Pausing the collector does not stop the containers from being enrolled in its youngest
    generation: the first allocation after it is re-enabled would collect every one still alive
    (the plan, the version graph kept with the pipeline), a traversal that cost 0.2 s at 100k units
    and finds nothing either. So before re-enabling, everything tracked is moved to the oldest
    generation, where long-lived objects end up anyway (gc.freeze() moves all of it to the permanent
    generation, gc.unfreeze() moves that to the oldest; two list splices, no traversal). A host that
    froze objects itself (gc.get_freeze_count() > 0, say a pre-fork server) is left as it was: its
    frozen objects must stay frozen, and unfreeze would thaw them.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def plan_from_train_set(
    vg: VersionGraph,
    backward: frozenset[str],
    train: set[int],
    cache_mode: str,
    reasons: dict[int, Reason] | None = None,
) -> Plan:
    """Write down any split of `vg` (sound or not): the verifier and the U-only reference use this.

    A stage's configs are the configs its units read minus the models the stage loads anyway: a
    loaded model brings its config with it, so only the others need their config.json alone.
    """
    units = vg.pipeline.units
    names = vg.names
    dp = [i for i in range(vg.n) if i not in train]
    tr = sorted(train)
    described, details = reason_tables(reasons or {}, names)
    dp_models = {m for i in dp for m in units[i].models}
    train_models = {m for i in tr for m in units[i].models} | set(backward) | set(vg.sink_models(backward))
    entries = [(p, None if w is None else names[w]) for p, w in cache_entries(vg, train, cache_mode)]
    return Plan(
        pipeline=vg.pipeline.name,
        models_require_backward=sorted(backward),
        cache_mode=cache_mode,
        data_process_units=[names[i] for i in dp],
        data_process_models=sorted(dp_models),
        train_units=[names[i] for i in tr],
        train_models=sorted(train_models),
        cache_entries=entries,
        fingerprint=fingerprint(vg.pipeline, backward, cache_mode),
        data_process_configs=stage_configs(units, dp, dp_models),
        train_configs=stage_configs(units, tr, train_models),
        reasons=described,
        reason_details=details,
    )


def reason_tables(reasons: dict[int, Reason], names: list[str]) -> tuple[dict[str, str], dict[str, dict]]:
    """The plan's `reasons` and `reason_details`: Reason.describe and Reason.to_dict of every unit.

    On big pipelines nearly every TRAIN unit is there for rule F; its sentence and dict are written
    out here directly (the same text and keys as those methods give), the other rules call them.
    """
    described: dict[str, str] = {}
    details: dict[str, dict] = {}
    for i, r in reasons.items():
        name = names[i]
        if r.rule == "F" and r.via is not None and r.param is not None and not r.models and r.access is None:
            via = names[r.via]
            described[name] = f"reads {r.param} written by {via} (F)"
            details[name] = {"rule": "F", "unit": via, "param": r.param}
        else:
            described[name] = r.describe(names)
            details[name] = r.to_dict(names)
    return described, details


def stage_configs(units, positions: Iterable[int], loaded: Iterable[str]) -> list[str]:
    """The models whose config the units at `positions` read and that their stage does not load, sorted."""
    return sorted({m for i in positions for m in units[i].configs} - set(loaded))


def _check_models_exist(pipeline: Pipeline, backward: frozenset[str]) -> None:
    """A model name that nothing calls is almost always a typo; with a declared sink, say so."""
    if pipeline.sink is None:
        return
    known = set(pipeline.models)
    unknown = sorted(m for m in backward if m not in known)
    if unknown:
        raise SpecError(
            f"model {unknown[0]!r} needs backward but no unit or the sink calls it (models: {', '.join(sorted(known)) or 'none'})",
            source=pipeline.source,
        )


def models_versioned_keeps_out(pipeline: Pipeline, plan: Plan) -> list[str]:
    """Models a `latest` plan loads in stage 2 that the `versioned` plan of the same split would not."""
    if plan.cache_mode != LATEST:
        return []
    backward = frozenset(plan.models_require_backward)
    vg = VersionGraph.of(active_pipeline(pipeline, plan))
    versioned = plan_from_train_set(vg, backward, set(train_set(vg, backward, VERSIONED)), VERSIONED)
    return sorted(set(plan.train_models) - set(versioned.train_models))


def versioned_savings_line(pipeline: Pipeline, plan: Plan) -> str | None:
    """The one line `plan` and `inspect` print when versioned caching would keep models out of stage 2
    (docs/semantics.md, 'Why `versioned` is minimal')."""
    saved = models_versioned_keeps_out(pipeline, plan)
    if not saved:
        return None
    names = ", ".join(saved)
    return f"note: --cache-mode versioned would keep {names} out of training (stage 2 would not load {'it' if len(saved) == 1 else 'them'})"

"""Why a unit is in its stage, in words (`unitgraph explain`).

A train unit is explained by the chain of reasons that put it there, followed back to the seed set
X0: each link names the rule (F, W or U) and the unit it came through, and the chain ends at a unit
that calls a model needing backward or is non-deterministic.

A data_process unit is explained by the conditions that keep every rule from pulling it in: it
calls no model that needs backward, it is deterministic, it reads no version a train unit wrote
(F), and, in `latest` mode, it writes no param after a train unit first read or wrote it (W, which
contains U). Each condition is stated with the facts that make it true.

A unit that reads the config of a model without calling it (`configs`) is told so: the config is
fixed for the run, so the read seeds nothing (even when the model needs backward) and is no data
dependency, and the stage loads the model's config, not its weights.

An inactive unit (its `requires` are not met by the params a run provides, `--with`) is explained
by the params it lacks: it is dropped before the split, and C1-C3 apply to the active pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .closure import LATEST, Reason, train_set
from .graph import VersionGraph
from .plan import split
from .planfile import Plan, active_pipeline
from .spec import Pipeline, Unit

TRAIN = "train"
DATA_PROCESS = "data_process"
INACTIVE = "inactive"


@dataclass(frozen=True)
class Explanation:
    """Why `unit` is in `stage`.

    `chain` (train units): (unit name, reason) from the unit back to a seed of X0.
    `conditions` (data_process units): the facts that keep each rule from pulling the unit in.
    `text`: the whole explanation as printed by `unitgraph explain`.
    """

    unit: str
    stage: str
    cache_mode: str
    text: str
    chain: tuple[tuple[str, Reason], ...] = ()
    conditions: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return self.text


def explain(
    pipeline: Pipeline,
    unit: str,
    trainable_models: Iterable[str] | str = (),
    lora_base_model: str | None = None,
    cache_mode: str = LATEST,
    provided: Iterable[str] | None = None,
) -> Explanation:
    """Explain `unit` for the split `unitgraph.split` makes with the same arguments.

    An unknown unit, model or cache mode is a SpecError (exit 2 on the command line).
    """
    position = pipeline.index(unit)  # SpecError naming the unknown unit
    plan = split(pipeline, trainable_models, lora_base_model, cache_mode, provided)
    return explain_in_plan(pipeline, plan, position)


def missing_requirements(pipeline: Pipeline, provided: Iterable[str]) -> dict[str, list[str]]:
    """For each unit the provided params leave inactive: its `requires` that are not available.

    The same forward pass as `prune.active_units`: a param is available when the dataset provides
    it or an earlier active unit writes it.
    """
    available = set(provided)
    missing: dict[str, list[str]] = {}
    for unit in pipeline.units:
        lacking = [p for p in unit.requires if p not in available]
        if lacking:
            missing[unit.name] = lacking
        else:
            available.update(unit.outputs)
    return missing


def explain_in_plan(pipeline: Pipeline, plan: Plan, position: int) -> Explanation:
    """Explain the unit at `position` of `pipeline` in a plan made by `split` (reasons are recomputed, exactly).

    A plan made with provided params splits the active pipeline; a unit outside it is explained as inactive.
    """
    name = pipeline.units[position].name
    active = active_pipeline(pipeline, plan)
    if name not in {u.name for u in active.units}:
        return _explain_inactive(pipeline, plan, position)
    position = active.index(name)
    vg = VersionGraph.of(active)
    backward = frozenset(plan.models_require_backward)
    reasons = train_set(vg, backward, plan.cache_mode)
    if position in reasons:
        return _explain_train(vg, reasons, position, plan.cache_mode, backward)
    return _explain_data_process(vg, backward, set(reasons), position, plan)


def _explain_inactive(pipeline: Pipeline, plan: Plan, position: int) -> Explanation:
    unit = pipeline.units[position]
    provided = plan.extra.get("provided") or []
    missing = missing_requirements(pipeline, provided).get(unit.name, list(unit.requires))
    shown = ", ".join(provided) or "nothing"
    lacking = ", ".join(missing)
    verb = "is" if len(missing) == 1 else "are"
    text = (f"{unit.name} is inactive: it requires {lacking}, which {verb} neither provided by the dataset "
            f"(it provides {shown}) nor written by an earlier active unit. It is a no-op for this run and is "
            f"dropped before the split; C1-C3 and the cache apply to the active units only.")
    return Explanation(unit=unit.name, stage=INACTIVE, cache_mode=plan.cache_mode, text=text,
                       conditions=tuple(f"requires {p}" for p in missing))


def chain_of(reasons: dict[int, Reason], position: int) -> list[tuple[int, Reason]]:
    """(unit, reason) from `position` back to a seed; each step follows `Reason.via`."""
    chain: list[tuple[int, Reason]] = []
    seen: set[int] = set()
    current: int | None = position
    while current is not None and current in reasons and current not in seen:
        seen.add(current)
        reason = reasons[current]
        chain.append((current, reason))
        if reason.is_seed:
            break
        current = reason.via
    return chain


def config_reads(unit: Unit, backward: frozenset[str]) -> tuple[list[str], list[str]]:
    """The models whose config `unit` only reads: (those that need backward, the others)."""
    configs = list(dict.fromkeys(unit.configs))
    return [m for m in configs if m in backward], [m for m in configs if m not in backward]


def _explain_train(
    vg: VersionGraph, reasons: dict[int, Reason], position: int, cache_mode: str, backward: frozenset[str]
) -> Explanation:
    names = vg.names
    chain = chain_of(reasons, position)
    parts = []
    for k, (_, reason) in enumerate(chain):
        subject = f"{names[position]} is in train because it" if k == 0 else "which is in train because it"
        parts.append(f"{subject} {reason.describe(names)}")
    text = ", ".join(parts) + "."
    needing, _ = config_reads(vg.pipeline.units[position], backward)
    if needing:  # so the reader does not take the config read for the cause
        verb = "needs" if len(needing) == 1 else "need"
        text += (f" It also reads the config of {', '.join(needing)}, which {verb} backward, without calling it; "
                 f"that alone does not seed a unit (a config is fixed for the run).")
    return Explanation(
        unit=names[position],
        stage=TRAIN,
        cache_mode=cache_mode,
        text=text,
        chain=tuple((names[i], r) for i, r in chain),
    )


def _explain_data_process(
    vg: VersionGraph, backward: frozenset[str], train: set[int], position: int, plan: Plan
) -> Explanation:
    names = vg.names
    unit = vg.pipeline.units[position]
    needing = ", ".join(sorted(backward)) or "none"
    conditions: list[str] = []

    if unit.models:
        conditions.append(f"it calls no model that needs backward (it calls {', '.join(unit.models)}; "
                          f"models that need backward: {needing})")
    else:
        conditions.append(f"it calls no model that needs backward (it calls none; models that need backward: {needing})")

    if unit.configs:
        needing_configs, other_configs = config_reads(unit, backward)
        read = ", ".join((*needing_configs, *other_configs))
        which = ""
        if needing_configs:
            verb = "needs" if len(needing_configs) == 1 else "need"
            which = f" ({', '.join(needing_configs)} {verb} backward)"
        conditions.append(f"it only reads the config of {read}{which}, without calling it: a config is fixed for "
                          f"the run, like a setting, so the read does not seed it (X0) and is no data dependency")

    conditions.append("it is deterministic, so its output is the same in every epoch")

    sources = []
    for p, w in vg.reaching[position].items():
        sources.append(f"{p} from the dataset" if w is None else f"{p} from {names[w]}")
    if sources:
        conditions.append(f"it reads no version written by a train unit (F): it reads {', '.join(sources)}, "
                          f"all in data_process")
    else:
        conditions.append("it reads no version written by a train unit (F): it reads nothing")

    if plan.cache_mode == LATEST:
        first_train_access = _first_train_access(vg, train)
        facts = []
        for p in dict.fromkeys(unit.outputs):
            a = first_train_access.get(p)
            if a is None:
                facts.append(f"no train unit reads or writes {p}")
            else:
                facts.append(f"{p} is first touched in train by {names[a]}, after it")
        if facts:
            conditions.append("it writes no param after a train unit first read or wrote it (W, which contains U): "
                              + "; ".join(facts))
        else:
            conditions.append("it writes no param after a train unit first read or wrote it (W, which contains U): "
                              "it writes nothing")
    else:
        conditions.append("write hazards (W, U) do not apply in versioned mode: stage 2 reads the exact cached "
                          "version of every input")

    cached = [p for p, w in plan.cache_entries if w == unit.name]
    if cached:
        footer = f"Its output reaches train through the cache: {', '.join(cached)}."
    else:
        footer = "None of its outputs is cached: only data_process units use them."

    config_only = [m for m in dict.fromkeys(unit.configs) if m in plan.data_process_configs]
    if config_only:
        footer += f" Stage 1 loads the config of {', '.join(config_only)} for it, not the weights."

    lines = [f"{unit.name} is in data_process because nothing pulls it into train:"]
    lines += [f"  - {c}" for c in conditions]
    lines.append(footer)
    return Explanation(
        unit=unit.name,
        stage=DATA_PROCESS,
        cache_mode=plan.cache_mode,
        text="\n".join(lines),
        conditions=tuple(conditions),
    )


def _first_train_access(vg: VersionGraph, train: set[int]) -> dict[str, int]:
    """For each param, the first train unit (in pipeline order) that reads or writes it."""
    first: dict[str, int] = {}
    for i in sorted(train):
        unit = vg.pipeline.units[i]
        for p in (*unit.inputs, *unit.outputs):
            first.setdefault(p, i)
    return first


__all__ = ["Explanation", "chain_of", "config_reads", "explain", "explain_in_plan", "missing_requirements"]

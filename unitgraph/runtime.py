"""What a backend needs to execute a plan, in unit names rather than positions.

The planner decides; a backend only follows these tables:
- `stage1_schedule`: the data_process units in order, and which cache entries to store after each
  (in `latest` mode all entries are stored from the final stage-1 state);
- `stage2_bindings`: for every input of every train unit and of the sink, whether it comes from a
  live train output or from a cache entry (and which one). The verifier simulates exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass

from .closure import LATEST
from .entries import bind_inputs
from .graph import VersionGraph
from .planfile import Plan, active_pipeline
from .spec import Pipeline

SINK = "<sink>"
DATASET_WRITER = "dataset"


def entry_key(param: str, writer: str | None, cache_mode: str) -> str:
    """The name a cache entry is stored under: the param in `latest` mode, `param@writer` in `versioned`."""
    if cache_mode == LATEST:
        return param
    return f"{param}@{writer if writer is not None else DATASET_WRITER}"


@dataclass(frozen=True)
class Binding:
    """Where a stage-2 reader takes one input: source "live" (output of train unit `writer`) or "cache" (entry `key`)."""

    source: str
    writer: str | None
    key: str | None = None


@dataclass(frozen=True)
class Stage1Schedule:
    units: list[str]
    # entry keys stored right after a unit ran (versioned), keyed by unit name; None = before the first unit
    snapshots_after: dict[str | None, list[tuple[str, str]]]
    # latest mode: (param, key) pairs read from the final stage-1 state
    final: list[tuple[str, str]]


def stage1_schedule(plan: Plan) -> Stage1Schedule:
    snapshots: dict[str | None, list[tuple[str, str]]] = {}
    final: list[tuple[str, str]] = []
    for param, writer in plan.cache_entries:
        key = entry_key(param, writer, plan.cache_mode)
        if plan.cache_mode == LATEST:
            final.append((param, key))
        else:
            snapshots.setdefault(writer, []).append((param, key))
    return Stage1Schedule(units=list(plan.data_process_units), snapshots_after=snapshots, final=final)


def stage2_bindings(pipeline: Pipeline, plan: Plan) -> dict[tuple[str, str], Binding]:
    """{(reader unit name or SINK, param): Binding} for stage 2 of `plan`."""
    vg = VersionGraph.of(active_pipeline(pipeline, plan))
    train = [vg.position[name] for name in plan.train_units]
    entries = [(p, None if w is None else vg.position[w]) for p, w in plan.cache_entries]
    result: dict[tuple[str, str], Binding] = {}
    for (reader, param), (source, writer) in bind_inputs(vg, train, entries, plan.cache_mode).items():
        reader_name = SINK if reader == vg.n else vg.names[reader]
        writer_name = None if writer is None else vg.names[writer]
        if source == "missing":
            raise ValueError(f"plan gives {reader_name} no version of {param}; run `unitgraph verify`")
        key = entry_key(param, writer_name, plan.cache_mode) if source == "cache" else None
        result[(reader_name, param)] = Binding(source, writer_name, key)
    return result


def cache_keys(plan: Plan) -> list[str]:
    """Every key a complete cache entry of one sample holds."""
    return [entry_key(p, w, plan.cache_mode) for p, w in plan.cache_entries]


@dataclass(frozen=True)
class Stage1Dependencies:
    """What the values stage 1 stores depend on, read off a plan (for precise cache keys).

    - `dataset_params`: dataset values that stage 1 reads (a data_process unit's input with no
      earlier writer) or stores as they are (a cache entry written by the dataset);
    - `models`: the models the data_process units call;
    - `units`: the data_process units' declarations, in order;
    - `entries`: the entry keys stored per sample.
    Nothing else a stage-1 value can depend on, apart from the settings the units read from their
    context, which only the backend knows.
    """

    dataset_params: list[str]
    models: list[str]
    units: list[dict]
    entries: list[str]


def stage1_dependencies(pipeline: Pipeline, plan: Plan) -> Stage1Dependencies:
    active = active_pipeline(pipeline, plan)
    vg = VersionGraph.of(active)
    found: dict[str, None] = {}
    for name in plan.data_process_units:
        for param, writer in vg.reaching[vg.position[name]].items():
            if writer is None:
                found.setdefault(param, None)
    for param, writer in plan.cache_entries:
        if writer is None:
            found.setdefault(param, None)
    units = [active.units[vg.position[name]] for name in plan.data_process_units]
    return Stage1Dependencies(
        dataset_params=sorted(found),
        models=sorted({m for u in units for m in u.models}),
        units=[u.to_dict() for u in units],
        entries=cache_keys(plan),
    )

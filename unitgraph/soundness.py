"""Check a plan against its pipeline: is the split sound, and is the file what `plan` would write?

Soundness is checked two ways: the invariants C1-C3 of DESIGN §3, and a simulation of both stages
with version tags, which must make every unit and the sink read exactly the versions they read in
the unsplit run. The simulation executes the plan as written (its unit lists and cache entries),
not as recomputed, so a hand-edited plan is caught.

Exactness also covers what each stage lists: its models and its configs. A config read changes no
version (a config is not a param), so configs have no part in soundness and none in the simulation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .closure import LATEST, backward_models, seeds, train_set, update_chain_closure, write_hazard_closure
from .entries import bind_inputs, cache_entries
from .graph import VersionGraph
from .planfile import Plan, active_pipeline, fingerprint
from .spec import Pipeline

MISSING = "missing"


@dataclass(frozen=True)
class Violation:
    check: str
    message: str

    def __str__(self) -> str:
        return f"{self.check}: {self.message}"


def verify(pipeline: Pipeline, plan: Plan) -> list[str]:
    """Every violation of `plan` for `pipeline`, one line each; empty when the plan is sound and exact."""
    return [str(v) for v in find_violations(pipeline, plan)]


def check_results(pipeline: Pipeline, plan: Plan) -> dict[str, bool | None]:
    """The `checks` block of a plan file. C2 and C3 are None (not required) in versioned mode."""
    return checks_from(find_violations(pipeline, plan), plan.cache_mode)


def checks_from(violations: list[Violation], cache_mode: str) -> dict[str, bool | None]:
    failed = {v.check for v in violations}
    latest = cache_mode == LATEST
    return {
        "C1": "C1" not in failed,
        "C2": ("C2" not in failed) if latest else None,
        "C3": ("C3" not in failed) if latest else None,
        "equivalence": "equivalence" not in failed,
    }


def find_violations(pipeline: Pipeline, plan: Plan) -> list[Violation]:
    pipeline = active_pipeline(pipeline, plan)
    vg = VersionGraph.of(pipeline)
    out: list[Violation] = []
    out += _check_header(pipeline, plan)
    partition = _check_partition(vg, plan)
    out += partition
    if partition:  # the remaining checks need every unit placed exactly once
        return out
    train = {vg.position[name] for name in plan.train_units}
    backward = frozenset(plan.models_require_backward)
    out += _check_seeds(vg, train, backward)
    out += _check_c1(vg, train)
    if plan.cache_mode == LATEST:
        out += _check_c2(vg, train)
        out += _check_c3(vg, train)
    entries, entry_problems = _plan_entries(vg, plan)
    out += entry_problems
    out += _check_cache(vg, plan, train, entries)
    out += _check_models(vg, plan, train, backward)
    out += _check_equivalence(vg, plan, train, entries)
    return out


def minimality_note(pipeline: Pipeline, plan: Plan) -> str | None:
    """A sound plan may keep more units in TRAIN than needed; say which could move to stage 1."""
    vg = VersionGraph.of(active_pipeline(pipeline, plan))
    least = train_set(vg, frozenset(plan.models_require_backward), plan.cache_mode)
    extra = [u for u in plan.train_units if u in vg.position and vg.position[u] not in least]
    if not extra:
        return None
    return f"note: sound, but not minimal: {', '.join(extra)} could run in data_process"


# --- individual checks ------------------------------------------------------------------------------


def _check_header(pipeline: Pipeline, plan: Plan) -> list[Violation]:
    out = []
    if plan.pipeline != pipeline.name:
        out.append(Violation("pipeline", f"plan is for pipeline {plan.pipeline!r}, the spec is {pipeline.name!r}"))
    backward = backward_models(plan.models_require_backward)
    if list(plan.models_require_backward) != sorted(backward):
        out.append(Violation("format", "models_require_backward must be sorted and without duplicates"))
    expected = fingerprint(pipeline, backward, plan.cache_mode)
    if plan.fingerprint != expected:
        out.append(Violation("fingerprint", f"plan fingerprint {plan.fingerprint} does not match the spec ({expected})"))
    return out


def _check_partition(vg: VersionGraph, plan: Plan) -> list[Violation]:
    out = []
    placed = plan.data_process_units + plan.train_units
    for name in sorted(set(placed) - set(vg.names)):
        out.append(Violation("partition", f"unit {name!r} is not in the pipeline"))
    counts = Counter(placed)
    for name in sorted(n for n, c in counts.items() if c > 1):
        out.append(Violation("partition", f"unit {name!r} is placed more than once"))
    for name in vg.names:
        if name not in counts:
            out.append(Violation("partition", f"unit {name!r} is in neither stage"))
    for stage, names in (("data_process", plan.data_process_units), ("train", plan.train_units)):
        positions = [vg.position[n] for n in names if n in vg.position]
        if positions != sorted(positions):
            out.append(Violation("partition", f"{stage} units are not in pipeline order"))
    return out


def _check_seeds(vg: VersionGraph, train: set[int], backward: frozenset[str]) -> list[Violation]:
    out = []
    for i, reason in seeds(vg, backward).items():
        if i not in train:
            out.append(Violation("seeds", f"{vg.names[i]} {reason.describe(vg.names)} but is in data_process"))
    return out


def _check_c1(vg: VersionGraph, train: set[int]) -> list[Violation]:
    out = []
    for i in range(vg.n):
        if i in train:
            continue
        for p, writer in vg.reaching[i].items():
            if writer is not None and writer in train:
                out.append(Violation("C1", f"data_process unit {vg.names[i]} reads {p} written by train unit {vg.names[writer]}"))
    return out


def _check_c2(vg: VersionGraph, train: set[int]) -> list[Violation]:
    missing = sorted(update_chain_closure(vg, train) - train)
    return [Violation("C2", f"{vg.names[i]} continues an update chain begun in train but is in data_process") for i in missing]


def _check_c3(vg: VersionGraph, train: set[int]) -> list[Violation]:
    out = []
    first_access: dict[str, int] = {}
    for t in sorted(train):
        unit = vg.pipeline.units[t]
        for p in (*unit.inputs, *unit.outputs):
            first_access.setdefault(p, t)
    for w in sorted(write_hazard_closure(vg, train) - train):
        unit = vg.pipeline.units[w]
        for p in unit.outputs:
            a = first_access.get(p)
            if a is not None and a < w:
                out.append(Violation("C3", f"data_process unit {vg.names[w]} writes {p} after train unit {vg.names[a]} accessed it"))
                break
    return out


def _plan_entries(vg: VersionGraph, plan: Plan) -> tuple[list[tuple[str, int | None]], list[Violation]]:
    """The plan's entries with writer positions; entries naming unknown or TRAIN writers are reported."""
    entries, out = [], []
    train = set(plan.train_units)
    for p, writer in plan.cache_entries:
        if writer is None:
            entries.append((p, None))
            continue
        if writer not in vg.position:
            out.append(Violation("cache", f"entry ({p}, {writer}) names a unit that is not in the pipeline"))
        elif writer in train:
            out.append(Violation("cache", f"entry ({p}, {writer}) names a train unit; stage 1 never runs it"))
        elif p not in vg.pipeline.units[vg.position[writer]].outputs:
            out.append(Violation("cache", f"entry ({p}, {writer}): {writer} does not write {p}"))
        else:
            entries.append((p, vg.position[writer]))
    return entries, out


def _check_cache(vg: VersionGraph, plan: Plan, train: set[int], entries: list) -> list[Violation]:
    out = []

    def show(entry: tuple[str, int | None]) -> str:
        p, w = entry
        return f"({p}, {'dataset' if w is None else vg.names[w]})"

    expected = set(cache_entries(vg, train, plan.cache_mode))
    declared = set(entries)
    if len(declared) != len(plan.cache_entries):
        out.append(Violation("cache", "an entry is listed twice"))
    for entry in sorted(expected - declared, key=lambda e: (e[0], -1 if e[1] is None else e[1])):
        out.append(Violation("cache", f"incomplete: stage 2 needs entry {show(entry)}, which the plan does not store"))
    for entry in sorted(declared - expected, key=lambda e: (e[0], -1 if e[1] is None else e[1])):
        out.append(Violation("cache", f"not minimal: entry {show(entry)} is stored but never read in stage 2"))
    if plan.cache_mode == LATEST:
        per_param = Counter(p for p, _ in plan.cache_entries)
        for p in sorted(p for p, c in per_param.items() if c > 1):
            out.append(Violation("cache", f"latest mode stores one entry per param, {p} has several"))
    if plan.declared_cache_params is not None and sorted(set(plan.declared_cache_params)) != plan.cache_params:
        out.append(Violation("cache", "cache.params is not the set of params named by cache.entries"))
    return out


def _check_models(vg: VersionGraph, plan: Plan, train: set[int], backward: frozenset[str]) -> list[Violation]:
    units = vg.pipeline.units
    dp_models = sorted({m for i in range(vg.n) if i not in train for m in units[i].models})
    train_models = sorted({m for i in train for m in units[i].models} | backward | set(vg.sink_models(backward)))
    out = []
    for stage, declared, expected in (
        ("data_process", plan.data_process_models, dp_models),
        ("train", plan.train_models, train_models),
    ):
        for m in sorted(set(expected) - set(declared)):
            out.append(Violation("models", f"{stage} must load {m} but the plan does not list it"))
        for m in sorted(set(declared) - set(expected)):
            out.append(Violation("models", f"{stage} lists {m}, which no unit of that stage calls"))
        if list(declared) != sorted(set(declared)):
            out.append(Violation("format", f"{stage}.models must be sorted and without duplicates"))
    out += _check_configs(vg, plan, train, dp_models, train_models)
    return out


def _check_configs(
    vg: VersionGraph, plan: Plan, train: set[int], dp_models: list[str], train_models: list[str]
) -> list[Violation]:
    """A stage's configs are exactly the configs its units read minus the models it must load.

    Measured against the models a stage must load (not those the plan lists, which _check_models
    judges), so one wrong model is reported once, as a model. Configs change no version, so the
    simulation below needs nothing of them.
    """
    units = vg.pipeline.units
    out = []
    for stage, declared, positions, loaded in (
        ("data_process", plan.data_process_configs, [i for i in range(vg.n) if i not in train], dp_models),
        ("train", plan.train_configs, sorted(train), train_models),
    ):
        expected = {m for i in positions for m in units[i].configs} - set(loaded)
        for m in sorted(expected - set(declared)):
            out.append(Violation("configs", f"{stage} units read the config of {m}, which the plan does not list"))
        for m in sorted(set(declared) - expected):
            reason = "it loads that model" if m in loaded else "no unit of that stage reads it"
            out.append(Violation("configs", f"{stage} lists the config of {m}, but {reason}"))
        if list(declared) != sorted(set(declared)):
            out.append(Violation("format", f"{stage}.configs must be sorted and without duplicates"))
    return out


# --- the version simulation ------------------------------------------------------------------------


def unsplit_reads(vg: VersionGraph) -> dict[tuple[int, str], int | None]:
    """Run the pipeline once with version tags: (reader, param) -> writer position (None: dataset)."""
    state: dict[str, int] = {}
    reads: dict[tuple[int, str], int | None] = {}
    for i, unit in enumerate(vg.pipeline.units):
        for p in unit.inputs:
            reads[(i, p)] = state.get(p)
        for p in unit.outputs:
            state[p] = i
    for p in vg.sink_inputs():
        reads[(vg.n, p)] = state.get(p)
    return reads


def split_reads(vg: VersionGraph, train: set[int], entries: list[tuple[str, int | None]], cache_mode: str):
    """Run stage 1 then stage 2 as the backend does; (reader, param) -> version tag read."""
    reads: dict[tuple[int, str], object] = {}
    state: dict[str, int] = {}
    snapshots_after: dict[int | None, list[str]] = {}
    for p, w in entries:
        snapshots_after.setdefault(w, []).append(p)
    stored: dict[tuple[str, int | None], object] = {(p, None): None for p in snapshots_after.get(None, [])}
    for i, unit in enumerate(vg.pipeline.units):
        if i in train:
            continue
        for p in unit.inputs:
            reads[(i, p)] = state.get(p)
        for p in unit.outputs:
            state[p] = i
        for p in snapshots_after.get(i, []):
            stored[(p, i)] = state.get(p)
    if cache_mode == LATEST:  # stage 1 keeps the final value, whatever the entry claims
        stored = {(p, w): state.get(p) for p, w in entries}
    for (reader, p), (source, writer) in bind_inputs(vg, train, entries, cache_mode).items():
        if source == "live":
            reads[(reader, p)] = writer
        elif source == "cache":
            reads[(reader, p)] = stored.get((p, writer), MISSING)
        else:
            reads[(reader, p)] = MISSING
    return reads


def _check_equivalence(vg: VersionGraph, plan: Plan, train: set[int], entries: list) -> list[Violation]:
    expected = unsplit_reads(vg)
    actual = split_reads(vg, train, entries, plan.cache_mode)

    def show(reader: int) -> str:
        return "the sink" if reader == vg.n else vg.names[reader]

    def version(tag) -> str:
        if tag == MISSING:
            return "nothing (neither cached nor computed in its stage)"
        return "the dataset value" if tag is None else f"the version written by {vg.names[tag]}"

    out = []
    for key, want in expected.items():
        got = actual.get(key, MISSING)
        if got != want:
            reader, p = key
            out.append(Violation("equivalence", f"{show(reader)} reads {p} as {version(got)}; unsplit it reads {version(want)}"))
    return out


__all__ = ["verify", "find_violations", "check_results", "checks_from", "minimality_note", "unsplit_reads", "split_reads", "Violation"]

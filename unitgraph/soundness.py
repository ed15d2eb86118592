"""Check a plan against its pipeline: is the split sound, and is the file what `plan` would write?

Soundness is checked two ways: the invariants C1-C3 (docs/semantics.md, 'The invariants'), and a
simulation of both stages with version tags, which must make every unit and the sink read exactly
the versions they read in the unsplit run. The simulation executes the plan as written (its unit
lists and cache entries), not as recomputed, so a hand-edited plan is caught.

Exactness also covers what each stage lists: its models and its configs. A config read changes no
version (a config is not a param), so configs have no part in soundness and none in the simulation.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass

from .closure import LATEST, backward_models, seeds, train_set, update_chain_closure, write_hazard_closure
from .entries import bind_inputs, cache_entry_set, latest_entries
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
        out += _check_c2_c3(vg, train)
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
    """Every unit placed exactly once, each stage in pipeline order.

    A sound plan passes the quick test below, which allocates nothing per unit; only a plan that
    fails it is examined by `_check_partition_reference`, which words the violations.
    """
    n, position = vg.n, vg.position
    if len(plan.data_process_units) + len(plan.train_units) == n:
        placed = bytearray(n)
        ok = True
        for names in (plan.data_process_units, plan.train_units):
            previous = -1
            for name in names:
                i = position.get(name)
                if i is None or placed[i] or i < previous:
                    ok = False
                    break
                placed[i] = 1
                previous = i
            if not ok:
                break
        if ok:  # n names, all known, none twice: every unit once; each stage strictly increasing: in order
            return []
    return _check_partition_reference(vg, plan)


def _check_partition_reference(vg: VersionGraph, plan: Plan) -> list[Violation]:
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


def _check_c2_c3(vg: VersionGraph, train: set[int]) -> list[Violation]:
    """C2, then C3, as `_check_c2_reference` and `_check_c3_reference` give them, from the writes of
    the data_process units instead of the closures U(TRAIN) and W(TRAIN).

    A data_process unit w violates C2 when it writes a param p after the first TRAIN unit reading
    p, and that unit writes p too (so w is in U(TRAIN)); it violates C3 when it writes p after the
    first TRAIN unit reading or writing p (w is in W(TRAIN)). Only the params data_process units
    write need their first TRAIN access: when TRAIN is most of the pipeline, those are few, and the
    closures, which list every later writer of every param TRAIN touches, are large.
    """
    units = vg.pipeline.units
    train_order: list[int] = []
    data_process: list[int] = []
    for i in range(vg.n):
        (train_order if i in train else data_process).append(i)
    written: set[str] = set()
    for w in data_process:
        written.update(units[w].outputs)
    first_reader: dict[str, int] = {}
    first_access: dict[str, int] = {}
    if written:
        for t in train_order:
            unit = units[t]
            for p in unit.inputs:
                if p in written and p not in first_reader:
                    first_reader[p] = t
                    if p not in first_access:
                        first_access[p] = t
            for p in unit.outputs:
                if p in written and p not in first_access:
                    first_access[p] = t
    c2: list[int] = []
    hazards: list[int] = []
    for w in data_process:
        outputs = units[w].outputs
        for p in outputs:
            a = first_reader.get(p)
            if a is not None and a < w and p in units[a].outputs:
                c2.append(w)
                break
        for p in outputs:
            a = first_access.get(p)
            if a is not None and a < w:
                hazards.append(w)
                break
    out = [Violation("C2", f"{vg.names[i]} continues an update chain begun in train but is in data_process") for i in c2]
    return out + _c3_violations(vg, first_access, hazards)


def _c3_violations(vg: VersionGraph, first_access: dict[str, int], hazards: list[int]) -> list[Violation]:
    out = []
    for w in hazards:
        unit = vg.pipeline.units[w]
        for p in unit.outputs:
            a = first_access.get(p)
            if a is not None and a < w:
                out.append(Violation("C3", f"data_process unit {vg.names[w]} writes {p} after train unit {vg.names[a]} accessed it"))
                break
    return out


def _check_c2_reference(vg: VersionGraph, train: set[int]) -> list[Violation]:
    """C2 with the set operator U as docs/semantics.md, 'The rules', writes it (closure.update_chain_closure),
    for the tests."""
    missing = sorted(update_chain_closure(vg, train) - train)
    return [Violation("C2", f"{vg.names[i]} continues an update chain begun in train but is in data_process") for i in missing]


def _check_c3_reference(vg: VersionGraph, train: set[int]) -> list[Violation]:
    """C3 with the set operator W as docs/semantics.md, 'The rules', writes it (closure.write_hazard_closure),
    for the tests."""
    first_access: dict[str, int] = {}
    for t in sorted(train):
        unit = vg.pipeline.units[t]
        for p in (*unit.inputs, *unit.outputs):
            first_access.setdefault(p, t)
    return _c3_violations(vg, first_access, sorted(write_hazard_closure(vg, train) - train))


def _plan_entries(vg: VersionGraph, plan: Plan) -> tuple[list[tuple[str, int | None]], list[Violation]]:
    """The plan's entries with writer positions; entries naming unknown or TRAIN writers are reported."""
    entries, out = [], []
    append = entries.append
    train = set(plan.train_units)
    position = vg.position
    units = vg.pipeline.units
    for p, writer in plan.cache_entries:
        if writer is None:
            append((p, None))
            continue
        i = position.get(writer)
        if i is None:
            out.append(Violation("cache", f"entry ({p}, {writer}) names a unit that is not in the pipeline"))
        elif writer in train:
            out.append(Violation("cache", f"entry ({p}, {writer}) names a train unit; stage 1 never runs it"))
        elif p not in units[i].outputs:
            out.append(Violation("cache", f"entry ({p}, {writer}): {writer} does not write {p}"))
        else:
            append((p, i))
    return entries, out


def _check_cache(vg: VersionGraph, plan: Plan, train: set[int], entries: list) -> list[Violation]:
    """The entries are exactly those stage 2 reads (and, in latest mode, one per param).

    In latest mode the expected entries are a map param -> writer, and a plan whose entries are that
    map, each param once, passes without building a set of pairs; any other plan is examined by the
    comparison of sets below, which words the violations.
    """
    if plan.cache_mode == LATEST:
        expected_map = latest_entries(vg, train)
        # the same map, each param once (a repeated param would make the dict shorter than the list)
        if len(entries) == len(plan.cache_entries) == len(expected_map) and dict(entries) == expected_map:
            return _check_cache_params(plan)
        expected = set(expected_map.items())
    else:
        expected = cache_entry_set(vg, train, plan.cache_mode)
    out = []

    def show(entry: tuple[str, int | None]) -> str:
        p, w = entry
        return f"({p}, {'dataset' if w is None else vg.names[w]})"

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
    return out + _check_cache_params(plan)


def _check_cache_params(plan: Plan) -> list[Violation]:
    """A plan read from a file lists `cache.params`: it must be the set of params its entries name."""
    if plan.declared_cache_params is not None and set(plan.declared_cache_params) != {p for p, _ in plan.cache_entries}:
        return [Violation("cache", "cache.params is not the set of params named by cache.entries")]
    return []


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
    """Every read of the split run sees the version it sees unsplit; `_check_equivalence_reference`
    compares the two runs of `unsplit_reads` and `split_reads`, this streams them (`equivalence_errors`)."""
    return _equivalence_violations(vg, equivalence_errors(vg, train, entries, plan.cache_mode))


def _check_equivalence_reference(vg: VersionGraph, plan: Plan, train: set[int], entries: list) -> list[Violation]:
    """The equivalence check over the full tables of both runs, as first written; kept for the tests."""
    expected = unsplit_reads(vg)
    actual = split_reads(vg, train, entries, plan.cache_mode)
    wrong = []
    for key, want in expected.items():
        got = actual.get(key, MISSING)
        if got != want:
            reader, p = key
            wrong.append((reader, p, got, want))
    return _equivalence_violations(vg, wrong)


def equivalence_errors(vg: VersionGraph, train: set[int], entries: list[tuple[str, int | None]], cache_mode: str):
    """The reads on which `split_reads` and `unsplit_reads` differ, as (reader, param, got, want) in
    the order of `unsplit_reads`, computed without building either table.

    The unsplit run is not simulated again: the version it makes a unit read is the unit's reaching
    write, `vg.reaching` (graph.py computes it by that very walk: the latest earlier write, None for
    the dataset), and the sink reads each param's last write (`vg._sink_writers`). Stage 1 and stage 2
    are simulated as in `split_reads`: one walk over the data_process units carries stage 1's state
    (with the versioned snapshots), then stage 2 binds each TRAIN input and each sink input by the
    rule of `entries.iter_bindings` (the stream behind `bind_inputs`, which the backend executes),
    written out here. Reads that cannot differ are skipped, each for a reason stated where it is.
    Tests check the result against `_check_equivalence_reference` on arbitrary splits and entries.
    """
    units = vg.pipeline.units
    reaching = vg.reaching
    latest = cache_mode == LATEST
    stage1: dict[str, int] = {}
    stage1_get = stage1.get
    # versioned: each param's cached writer positions, sorted (-1: the dataset value), and beside
    # them the value stage 1 stored for each: split_reads' `stored[(p, writer)]`, kept by index in
    # the param's list so a stage-2 read finds it by the index bisect gives, without a pair key.
    # None for the dataset value, stage 1's state right after a data_process writer runs, and
    # MISSING for an entry no stage-1 unit writes (split_reads never stores those).
    by_param: dict[str, list[int]] = {}
    stored: dict[str, list[object]] = {}
    snapshots_after: dict[int, list[tuple[str, int]]] = {}
    if not latest:
        for p, w in entries:
            if p in by_param:
                by_param[p].append(-1 if w is None else w)
            else:
                by_param[p] = [-1 if w is None else w]
        for p, positions in by_param.items():
            positions.sort()
            stored[p] = [None if w == -1 else MISSING for w in positions]
            for k, w in enumerate(positions):
                if w >= 0:
                    snapshots_after.setdefault(w, []).append((p, k))
    isdisjoint = train.isdisjoint
    wrong: list[tuple[int, str, object, int | None]] = []
    train_order: list[int] = []
    for i, unit in enumerate(units):
        if i in train:
            train_order.append(i)
            continue
        table = reaching[i]
        # A data_process read of version w (the latest write before i) gets stage 1's latest write
        # before i. When w is a data_process unit, no write of the param lies between w and i, so
        # that is w; when w is None nothing wrote it, in neither run. Only a w in TRAIN differs.
        if table and not isdisjoint(table.values()):
            for p, want in table.items():
                if want is not None and want in train:
                    wrong.append((i, p, stage1_get(p), want))
        for p in unit.outputs:
            stage1[p] = i
        if snapshots_after:
            for p, k in snapshots_after.get(i, ()):
                stored[p][k] = stage1_get(p)
    stage2_wrong: list[tuple[int, str, object, int | None]] = []
    append = stage2_wrong.append
    live: dict[str, int] = {}
    live_get = live.get
    sink = vg.n
    sink_inputs, sink_wants = vg._sink_inputs, vg._sink_writers
    if latest:
        cached = {p for p, _ in entries}
        for t in train_order:
            for p, want in reaching[t].items():
                # want in TRAIN: it is the latest write before t, so the latest TRAIN write, `live`'s
                if want is None or want not in train:
                    got = live_get(p)
                    if got is None:  # a cached read gets stage 1's final value (split_reads stores so)
                        got = stage1_get(p) if p in cached else MISSING
                    if got != want:
                        append((t, p, got, want))
            for p in units[t].outputs:
                live[p] = t
        # The sink reads each param's last write. One in TRAIN is live. One outside TRAIN (or none)
        # is read right iff no TRAIN unit wrote the param (else live shadows it) and it is cached:
        # stage 1's final value is then that last write, as no write follows it. Checked as sets.
        outside = [p for p, want in zip(sink_inputs, sink_wants) if want is None or want not in train]
        if not (live.keys().isdisjoint(outside) and cached.issuperset(outside)):
            for p, want in zip(sink_inputs, sink_wants):
                got = live_get(p)
                if got is None:
                    got = stage1_get(p) if p in cached else MISSING
                if got != want:
                    append((sink, p, got, want))
    else:
        cached_get = by_param.get
        # iter_bindings' rule: a read takes the newest version before its reader, live or cached
        for t in train_order:
            for p, want in reaching[t].items():
                live_writer = live_get(p)
                cached = cached_get(p)
                if cached is None:  # no entry for p: only a live version can be read
                    got = MISSING if live_writer is None else live_writer
                else:
                    k = bisect_left(cached, t) - 1  # the newest entry before t, if any
                    if live_writer is not None and (k < 0 or live_writer > cached[k]):
                        got = live_writer
                    elif k >= 0:
                        got = stored[p][k]
                    else:
                        got = MISSING
                if got != want:
                    append((t, p, got, want))
            for p in units[t].outputs:
                live[p] = t
        for p, want in zip(sink_inputs, sink_wants):  # every entry stands before the sink: the newest is the last
            live_writer = live_get(p)
            cached = cached_get(p)
            if cached is None:
                got = MISSING if live_writer is None else live_writer
            elif live_writer is not None and live_writer > cached[-1]:
                got = live_writer
            else:
                got = stored[p][-1]
            if got != want:
                append((sink, p, got, want))
    if stage2_wrong:  # merge the two runs' reads back into pipeline order (a unit is in one stage)
        wrong = sorted(wrong + stage2_wrong, key=lambda read: read[0])
    return wrong


def _equivalence_violations(vg: VersionGraph, wrong) -> list[Violation]:
    def show(reader: int) -> str:
        return "the sink" if reader == vg.n else vg.names[reader]

    def version(tag) -> str:
        if tag == MISSING:
            return "nothing (neither cached nor computed in its stage)"
        return "the dataset value" if tag is None else f"the version written by {vg.names[tag]}"

    return [Violation("equivalence", f"{show(reader)} reads {p} as {version(got)}; unsplit it reads {version(want)}")
            for reader, p, got, want in wrong]


__all__ = ["verify", "find_violations", "check_results", "checks_from", "minimality_note", "unsplit_reads", "split_reads", "Violation"]

"""The planner's fast paths agree with the code they replaced (docs/benchmarks.md, 'Planner scaling').

Planning a 100k-unit pipeline whose sink reads every param made the core keep to few passes and
few objects: the verifier streams its version simulation, checks C2/C3 from the data_process
writes, takes quick exits for sound plans, the canonical spec is printed unit by unit. Each such
path is checked here against its reference, the code as first written, on random small pipelines
and on arbitrary (mostly unsound) splits and cache entries, so every answer, every violation and
its wording and order, is the same.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_left

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unitgraph as ug
from unitgraph import soundness
from unitgraph.closure import LATEST, VERSIONED, Reason, seeds, train_set
from unitgraph.entries import (
    bind_inputs,
    cache_entries,
    cache_entries_reference,
    entry_sort_key,
    latest_entries,
    needed_params,
    needed_versions,
    needed_versions_ordered,
    sort_entries,
    train_flags,
)
from unitgraph.graph import VersionGraph
from unitgraph.plan import plan_from_train_set, reason_tables
from unitgraph.planfile import Plan
from unitgraph.synthetic import chain_pipeline, random_pipeline, replicate_pipeline

PARAMS = ["a", "b", "c", "d", "e", "é", 'q"uote']
MODELS = ["enc", "vae", "te", "dit"]
MODES = [LATEST, VERSIONED]
# 150 examples a property in the suite (UNITGRAPH_CORE_EXAMPLES=2000 for a deeper local search)
common = settings(max_examples=int(os.environ.get("UNITGRAPH_CORE_EXAMPLES", "150")), deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pipelines(draw, max_units: int = 9):
    n = draw(st.integers(min_value=0, max_value=max_units))
    names = st.sampled_from(PARAMS)
    units = []
    for i in range(n):
        inputs = tuple(draw(st.lists(names, max_size=4)))  # repeats allowed: a param listed twice
        units.append(ug.Unit(
            name=f"U{i}",
            inputs=inputs,
            outputs=tuple(draw(st.lists(names, max_size=3))),
            models=tuple(draw(st.lists(st.sampled_from(MODELS[:3]), max_size=2))),
            deterministic=draw(st.booleans()) or draw(st.booleans()),
            requires=tuple(draw(st.lists(st.sampled_from(inputs), max_size=1))) if inputs else (),
            configs=tuple(draw(st.lists(st.sampled_from(["dit", "vae_cfg"]), max_size=1, unique=True))),
        ))
    units = [u if not set(u.configs) & set(u.models) else ug.Unit(u.name, u.inputs, u.outputs, u.models, u.deterministic, u.requires)
             for u in units]
    sink = None
    if draw(st.booleans()):
        sink = ug.Sink(inputs=tuple(draw(st.lists(names, min_size=1, max_size=5))), models=("dit",))
    return ug.Pipeline("random", tuple(units), sink)


@st.composite
def splits(draw):
    """A pipeline, any TRAIN set (sound or not) and any cache entries (valid writers or not)."""
    pipeline = draw(pipelines())
    n = len(pipeline.units)
    train = set(draw(st.lists(st.integers(0, max(0, n - 1)), max_size=n))) if n else set()
    writers = st.one_of(st.none(), st.integers(0, max(0, n - 1))) if n else st.none()
    entries = draw(st.lists(st.tuples(st.sampled_from(PARAMS), writers), max_size=8))
    return pipeline, train, entries, draw(st.sampled_from(MODES))


# --- references: the code as first written ------------------------------------------------------


def reference_tables(pipeline):
    """VersionGraph's tables, built in the two passes of the original constructor."""
    writers, reaching, latest = {}, [], {}
    for i, unit in enumerate(pipeline.units):
        reaching.append({p: latest.get(p) for p in unit.inputs})
        for p in unit.outputs:
            if latest.get(p) != i:
                writers.setdefault(p, []).append(i)
                latest[p] = i
    readers_of = [{} for _ in pipeline.units]
    for i, table in enumerate(reaching):
        for p, j in table.items():
            if j is not None:
                readers_of[j].setdefault(i, []).append(p)
    return writers, reaching, latest, readers_of


def reference_train_set(vg, backward, cache_mode):
    reasons = [None] * vg.n
    for i, reason in seeds(vg, backward).items():
        reasons[i] = reason
    first_access = set()
    for u in range(vg.n):
        if reasons[u] is None:
            continue
        for reader, params in vg.readers_of[u].items():
            if reasons[reader] is None:
                reasons[reader] = Reason("F", via=u, param=params[0])
        if cache_mode != LATEST:
            continue
        unit = vg.pipeline.units[u]
        for p in (*unit.inputs, *unit.outputs):
            if p in first_access:
                continue
            first_access.add(p)
            reads, writes = p in unit.inputs, p in unit.outputs
            access = "reads and writes" if reads and writes else ("reads" if reads else "writes")
            rule = "U" if reads and writes else "W"
            for w in vg.writers_after(p, u):
                if reasons[w] is None:
                    reasons[w] = Reason(rule, via=u, param=p, access=access)
    return {i: r for i, r in enumerate(reasons) if r is not None}


def reference_bind_inputs(vg, train, entries, cache_mode):
    by_param, latest_cache = {}, {}
    for p, w in entries:
        if cache_mode == LATEST:
            latest_cache[p] = w
        else:
            by_param.setdefault(p, []).append(-1 if w is None else w)
    for positions in by_param.values():
        positions.sort()
    bindings, live = {}, {}

    def lookup(reader, p):
        live_writer = live.get(p)
        if cache_mode == LATEST:
            if live_writer is not None:
                return ("live", live_writer)
            if p in latest_cache:
                return ("cache", latest_cache[p])
            return ("missing", None)
        cached = by_param.get(p, [])
        k = bisect_left(cached, reader) - 1
        cached_writer = cached[k] if k >= 0 else None
        if live_writer is not None and (cached_writer is None or live_writer > cached_writer):
            return ("live", live_writer)
        if cached_writer is not None:
            return ("cache", None if cached_writer == -1 else cached_writer)
        return ("missing", None)

    for t in sorted(set(train)):
        unit = vg.pipeline.units[t]
        for p in dict.fromkeys(unit.inputs):
            bindings[(t, p)] = lookup(t, p)
        for p in unit.outputs:
            live[p] = t
    sink_inputs = list(dict.fromkeys(vg.pipeline.sink.inputs)) if vg.pipeline.sink is not None else vg.pipeline.params
    for p in sink_inputs:
        bindings[(vg.n, p)] = lookup(vg.n, p)
    return bindings


def reference_check_cache(vg, plan, train, entries):
    """soundness._check_cache before its quick exit."""
    from collections import Counter

    from unitgraph.soundness import Violation

    out = []

    def show(entry):
        p, w = entry
        return f"({p}, {'dataset' if w is None else vg.names[w]})"

    expected = set(cache_entries_reference(vg, train, plan.cache_mode))
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


def some_plan(pipeline, train, mode):
    vg = VersionGraph(pipeline)
    return vg, plan_from_train_set(vg, frozenset({"dit"}), set(train), mode)


# --- the version graph, the fixed point, cache entries and bindings -------------------------------


@common
@given(pipelines())
def test_version_graph_tables_are_the_two_pass_ones(pipeline):
    vg = VersionGraph(pipeline)
    writers, reaching, latest, readers_of = reference_tables(pipeline)
    assert vg.writers == writers and list(vg.writers) == list(writers)
    assert [list(t.items()) for t in vg.reaching] == [list(t.items()) for t in reaching]
    assert vg.last_writer == latest
    assert [list(r.items()) for r in vg.readers_of] == [list(r.items()) for r in readers_of]
    sink = list(dict.fromkeys(pipeline.sink.inputs)) if pipeline.sink is not None else pipeline.params
    assert vg.sink_inputs() == sink
    assert [(r.reader, r.param, r.writer) for r in vg.sink_reads()] == [(vg.n, p, latest.get(p)) for p in sink]


@common
@given(pipelines(), st.sets(st.sampled_from(MODELS), max_size=2), st.sampled_from(MODES))
def test_train_set_gives_the_reasons_of_the_original_sweep(pipeline, backward, mode):
    vg = VersionGraph(pipeline)
    backward = frozenset(backward)
    fast = train_set(vg, backward, mode)
    assert list(fast.items()) == list(reference_train_set(VersionGraph(pipeline), backward, mode).items())
    described, details = reason_tables(fast, vg.names)
    assert described == {vg.names[i]: r.describe(vg.names) for i, r in fast.items()}
    assert details == {vg.names[i]: r.to_dict(vg.names) for i, r in fast.items()}
    assert list(described) == [vg.names[i] for i in fast]


@common
@given(splits())
def test_cache_entries_and_bindings_agree_with_the_references(case):
    pipeline, train, entries, mode = case
    vg = VersionGraph(pipeline)
    for m in MODES:
        assert cache_entries(vg, train, m) == cache_entries_reference(vg, train, m)
    assert sort_entries(set(entries)) == sorted(set(entries), key=entry_sort_key)
    assert list(bind_inputs(vg, train, entries, mode).items()) == list(reference_bind_inputs(vg, train, entries, mode).items())
    # the ordered forms are the set of the reference, in pipeline order: TRAIN units, then the sink
    reads = [(p, w) for t in sorted(train) for p, w in vg.reaching[t].items()] + list(zip(vg._sink_inputs, vg._sink_writers))
    outside = [(p, w) for p, w in reads if w is None or w not in train]
    assert list(needed_versions_ordered(vg, train)) == list(dict.fromkeys(outside))
    assert set(needed_versions_ordered(vg, train)) == needed_versions(vg, train)  # again: from the memo
    assert list(needed_params(vg, train)) == list(dict.fromkeys(p for p, _ in outside))
    assert [i for i, flag in enumerate(train_flags(vg, train)) if flag] == sorted(train)


def test_memos_hand_out_copies_and_follow_their_arguments():
    pipeline = random_pipeline(200, seed=3)
    vg = VersionGraph(pipeline)
    backward = frozenset({"m1", "dit"})
    first = seeds(vg, backward)
    first.clear()
    assert seeds(vg, backward) == seeds(VersionGraph(pipeline), backward) != {}
    assert seeds(vg, {"m2"}) == seeds(VersionGraph(pipeline), frozenset({"m2"}))
    train = set(train_set(vg, backward))
    got = latest_entries(vg, train)
    got.clear()
    assert latest_entries(vg, train) == latest_entries(VersionGraph(pipeline), train) != {}
    smaller = set(sorted(train)[: len(train) // 2])
    assert latest_entries(vg, smaller) == latest_entries(VersionGraph(pipeline), smaller)
    assert cache_entries(vg, train, LATEST) == cache_entries_reference(vg, train, LATEST)
    versions = needed_versions_ordered(vg, train)
    versions.clear()
    assert set(needed_versions_ordered(vg, train)) == needed_versions(VersionGraph(pipeline), train) != set()
    assert set(needed_versions_ordered(vg, smaller)) == needed_versions(VersionGraph(pipeline), smaller)


def test_gc_paused_moves_survivors_to_the_oldest_generation_and_respects_a_frozen_host():
    import gc

    from unitgraph.plan import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        kept = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.is_tracked(kept[0]) and gc.get_count()[0] < 1000  # not left in the youngest generation
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a collector the caller had off stays off
    finally:
        gc.enable()
    host_object = [object()]  # a container the host froze
    gc.freeze()
    try:
        assert not any(o is host_object for o in gc.get_objects())  # frozen: out of every generation
        with gc_paused():
            more = [[i] for i in range(10)]
        # the host's frozen objects stay frozen (the count itself may drop: a frozen object can still
        # die by reference counting, e.g. in pytest-xdist's messaging thread)
        assert gc.get_freeze_count() > 0 and gc.isenabled() and more
        assert not any(o is host_object for o in gc.get_objects())
    finally:
        gc.unfreeze()


# --- the verifier ------------------------------------------------------------------------------------


@common
@given(splits())
def test_streamed_equivalence_check_matches_the_tables_of_both_runs(case):
    pipeline, train, entries, mode = case
    vg, plan = some_plan(pipeline, train, mode)
    # the plan's own entries (as the verifier gets them) and arbitrary ones
    for chosen in (cache_entries(vg, train, mode), entries):
        fast = soundness._check_equivalence(vg, plan, train, chosen)
        assert [str(v) for v in fast] == [str(v) for v in soundness._check_equivalence_reference(vg, plan, train, chosen)]


@common
@given(splits())
def test_c2_c3_from_data_process_writes_match_the_closures(case):
    pipeline, train, _, _ = case
    vg = VersionGraph(pipeline)
    fast = soundness._check_c2_c3(vg, train)
    reference = soundness._check_c2_reference(vg, train) + soundness._check_c3_reference(vg, train)
    assert [str(v) for v in fast] == [str(v) for v in reference]


@common
@given(splits(), st.data())
def test_partition_and_cache_checks_match_on_edited_plans(case, data):
    pipeline, train, entries, mode = case
    vg, plan = some_plan(pipeline, train, mode)
    names = [u.name for u in pipeline.units] + ["Stranger"]
    edit = data.draw(st.sampled_from(["none", "drop", "repeat", "stranger", "swap", "entries", "params"]))
    if edit == "drop" and plan.train_units:
        plan.train_units.pop(data.draw(st.integers(0, len(plan.train_units) - 1)))
    elif edit == "repeat" and plan.data_process_units:
        plan.train_units.append(data.draw(st.sampled_from(plan.data_process_units)))
    elif edit == "stranger":
        plan.data_process_units.append("Stranger")
    elif edit == "swap" and len(plan.data_process_units) > 1:
        plan.data_process_units.reverse()
    elif edit == "entries":
        plan.cache_entries = [(p, None if w is None else names[w % len(names)]) for p, w in entries]
    elif edit == "params":
        plan.declared_cache_params = data.draw(st.lists(st.sampled_from(PARAMS), max_size=4))
    assert [str(v) for v in soundness._check_partition(vg, plan)] == [str(v) for v in soundness._check_partition_reference(vg, plan)]
    if not soundness._check_partition(vg, plan):
        placed = {vg.position[n] for n in plan.train_units}
        plan_entries, _ = soundness._plan_entries(vg, plan)
        got = soundness._check_cache(vg, plan, placed, plan_entries)
        assert [str(v) for v in got] == [str(v) for v in reference_check_cache(vg, plan, placed, plan_entries)]


@common
@given(pipelines(), st.sets(st.sampled_from(MODELS), max_size=2), st.sampled_from(MODES))
def test_split_verifies_as_before(pipeline, backward, mode):
    if pipeline.sink is not None:
        backward &= set(pipeline.models)
    plan = ug.split(pipeline, sorted(backward), cache_mode=mode)
    assert plan.violations == [] and plan.checks_pass
    broken = Plan.from_dict(json.loads(plan.to_json()))
    if broken.train_units:  # a unit moved to data_process: every check sees it as before
        moved = broken.train_units.pop(0)
        broken.data_process_units = [u.name for u in pipeline.units if u.name in broken.data_process_units or u.name == moved]
        vg = VersionGraph(pipeline)
        train = {vg.position[n] for n in broken.train_units}
        entries, _ = soundness._plan_entries(vg, broken)
        assert [str(v) for v in soundness._check_equivalence(vg, broken, train, entries)] == \
            [str(v) for v in soundness._check_equivalence_reference(vg, broken, train, entries)]


# --- the canonical spec --------------------------------------------------------------------------------


@common
@given(pipelines(), st.sampled_from(["random", "ü name", "x\"y\\z", "tab\tnew\nline"]))
def test_canonical_json_is_json_dumps_of_the_canonical_dict(pipeline, name):
    renamed = ug.Pipeline(name, pipeline.units, pipeline.sink)
    assert renamed.canonical_json == renamed.canonical_json_reference()
    assert json.loads(renamed.canonical_json) == renamed.canonical_dict()


def test_canonical_json_of_the_example_and_synthetic_pipelines():
    from unitgraph.examples import PIPELINES

    for pipeline in [make() for make in PIPELINES.values()] + [random_pipeline(300), chain_pipeline(300)]:
        assert pipeline.canonical_json == pipeline.canonical_json_reference()


# --- the generators ----------------------------------------------------------------------------------


def test_random_pipeline_without_a_sink_has_the_same_units():
    with_sink, without = random_pipeline(500, seed=4), random_pipeline(500, seed=4, declare_sink=False)
    assert with_sink.units == without.units and without.sink is None and with_sink.sink is not None
    assert random_pipeline(500, seed=4, declare_sink=False) == without  # deterministic
    assert VersionGraph(without).sink_inputs() == without.params


def test_replicated_pipelines_copy_their_templates_side_by_side():
    from unitgraph.examples import PIPELINES

    templates = [make() for make in PIPELINES.values()]
    size = sum(len(t) for t in templates)
    n = 5 * size + 3
    replicated = replicate_pipeline(templates, n)
    assert len(replicated) == n and replicated == replicate_pipeline(templates, n)
    assert len({u.name for u in replicated.units}) == n
    first = replicated.units[: len(templates[0])]
    assert [u.name for u in first] == [f"{u.name}#0" for u in templates[0].units]
    assert [u.inputs for u in first] == [tuple(f"{p}#0" for p in u.inputs) for u in templates[0].units]
    assert [u.models for u in first] == [u.models for u in templates[0].units]
    # copies share no param: each copy plans as its template does
    plan = ug.split(replicated, ["dit", "text_encoder"])
    assert plan.checks_pass
    single = ug.split(templates[0], ["dit", "text_encoder"])
    assert [n for n in plan.train_units if n.endswith("#0")] == [f"{n}#0" for n in single.train_units]
    assert set(replicated.sink.inputs) >= {f"{p}#1" for p in templates[1].sink.inputs}
    # a template without a declared sink counts as a sink reading all its params
    bare = ug.Pipeline("bare", templates[0].units, None)
    assert set(replicate_pipeline([bare], len(bare)).sink.inputs) == {f"{p}#0" for p in bare.params}

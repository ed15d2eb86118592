"""Property tests of the split on random small pipelines (docs/semantics.md, 'The rules' and 'The invariants')."""

from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unitgraph as ug
from unitgraph.entries import cache_entries
from unitgraph.graph import VersionGraph
from unitgraph.plan import plan_from_train_set
from unitgraph.closure import (
    LATEST,
    VERSIONED,
    iterate_to_fixed_point,
    seeds,
    step,
    train_set,
    update_chain_closure,
    write_hazard_closure,
)
from unitgraph.soundness import find_violations

PARAMS = ["a", "b", "c", "d", "e"]
MODELS = ["enc", "vae", "te", "dit"]
MODES = [LATEST, VERSIONED]


@st.composite
def pipelines(draw, max_units: int = 8):
    n = draw(st.integers(min_value=0, max_value=max_units))
    units = []
    for i in range(n):
        units.append(
            ug.Unit(
                name=f"U{i}",
                inputs=tuple(draw(st.lists(st.sampled_from(PARAMS), max_size=3, unique=True))),
                outputs=tuple(draw(st.lists(st.sampled_from(PARAMS), max_size=2, unique=True))),
                models=tuple(draw(st.lists(st.sampled_from(MODELS[:3]), max_size=1))),
                deterministic=draw(st.booleans()) or draw(st.booleans()),
            )
        )
    sink = None
    if draw(st.booleans()):
        sink = ug.Sink(
            inputs=tuple(draw(st.lists(st.sampled_from(PARAMS), min_size=1, max_size=4, unique=True))),
            models=("dit",),
        )
    return ug.Pipeline("random", tuple(units), sink)


backward_sets = st.lists(st.sampled_from(MODELS), max_size=2, unique=True).map(frozenset)
# 150 examples a property in the suite (UNITGRAPH_CORE_EXAMPLES=2000 for a deeper local search)
common = settings(max_examples=int(os.environ.get("UNITGRAPH_CORE_EXAMPLES", "150")), deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])


def usable(pipeline, backward):
    """With a declared sink, split() rejects models nothing calls (a typo guard); keep the called ones."""
    return backward & set(pipeline.models) if pipeline.sink is not None else backward


def subsets(n: int):
    for size in range(n + 1):
        yield from (set(c) for c in itertools.combinations(range(n), size))


@common
@given(pipelines(), backward_sets, st.sampled_from(MODES), st.data())
def test_step_is_monotone(pipeline, backward, mode, data):
    vg = VersionGraph(pipeline)
    n = len(pipeline.units)
    small = set(data.draw(st.sets(st.integers(0, max(0, n - 1)), max_size=n))) if n else set()
    extra = set(data.draw(st.sets(st.integers(0, max(0, n - 1)), max_size=n))) if n else set()
    assert step(vg, small, mode) <= step(vg, small | extra, mode)


@common
@given(pipelines(), backward_sets, st.sampled_from(MODES))
def test_train_set_is_the_least_fixed_point_above_the_seeds(pipeline, backward, mode):
    vg = VersionGraph(pipeline)
    x0 = set(seeds(vg, backward))
    train = set(train_set(vg, backward, mode))
    assert x0 <= train
    assert step(vg, train, mode) == train, "not a fixed point"
    # brute force: every closed superset of X0 contains TRAIN
    for candidate in subsets(vg.n):
        if x0 <= candidate and step(vg, candidate, mode) == candidate:
            assert train <= candidate
    # and the plain iteration of docs/semantics.md, 'The rules', reaches the same set
    assert iterate_to_fixed_point(vg, x0, lambda x: step(vg, x, mode)) == train


@common
@given(pipelines(), backward_sets, st.sampled_from(MODES))
def test_every_plan_verifies_and_satisfies_its_invariants(pipeline, backward, mode):
    plan = ug.split(pipeline, sorted(usable(pipeline, backward)), cache_mode=mode)
    assert ug.verify(pipeline, plan) == []
    assert plan.checks["C1"] and plan.checks["equivalence"]
    if mode == LATEST:
        assert plan.checks["C2"] and plan.checks["C3"]
        vg = VersionGraph(pipeline)
        train = {vg.position[u] for u in plan.train_units}
        assert update_chain_closure(vg, train) <= train
        assert write_hazard_closure(vg, train) <= train
        params = [p for p, _ in plan.cache_entries]
        assert len(params) == len(set(params)), "latest stores one entry per param"


@common
@given(pipelines(), backward_sets)
def test_versioned_train_is_a_subset_of_latest_train(pipeline, backward):
    backward = usable(pipeline, backward)
    latest = ug.split(pipeline, sorted(backward), cache_mode=LATEST)
    versioned = ug.split(pipeline, sorted(backward), cache_mode=VERSIONED)
    assert set(versioned.train_units) <= set(latest.train_units)
    assert set(versioned.train_models) <= set(latest.train_models)


@common
@given(pipelines(), backward_sets, st.sampled_from(MODES))
def test_cache_entries_are_exactly_the_needed_ones(pipeline, backward, mode):
    """Dropping any entry breaks equivalence (minimal); the full set makes it hold (complete)."""
    vg = VersionGraph(pipeline)
    train = set(train_set(vg, backward, mode))
    plan = plan_from_train_set(vg, backward, train, mode)
    assert not [v for v in find_violations(pipeline, plan) if v.check == "equivalence"]
    for k in range(len(plan.cache_entries)):
        plan_without = plan_from_train_set(vg, backward, train, mode)
        del plan_without.cache_entries[k]
        checks = {v.check for v in find_violations(pipeline, plan_without)}
        assert "equivalence" in checks, f"entry {plan.cache_entries[k]} was not needed"


@common
@given(pipelines(), backward_sets, st.sampled_from(MODES))
def test_moving_any_train_unit_to_data_process_is_caught(pipeline, backward, mode):
    vg = VersionGraph(pipeline)
    train = set(train_set(vg, backward, mode))
    for unit in train:
        smaller = train - {unit}
        plan = plan_from_train_set(vg, backward, smaller, mode)
        checks = {v.check for v in find_violations(pipeline, plan)}
        assert checks & {"seeds", "C1", "C2", "C3", "equivalence"}, f"moving {vg.names[unit]} went unnoticed"


@common
@given(pipelines(), backward_sets, st.sampled_from(MODES))
def test_reasons_chain_back_to_a_seed(pipeline, backward, mode):
    vg = VersionGraph(pipeline)
    reasons = train_set(vg, backward, mode)
    for unit, reason in reasons.items():
        seen = {unit}
        while not reason.is_seed:
            assert reason.via in reasons and reason.via < unit
            assert reason.via not in seen
            seen.add(reason.via)
            reason = reasons[reason.via]


@common
@given(pipelines(), backward_sets)
def test_latest_entries_are_last_stage1_writers(pipeline, backward):
    vg = VersionGraph(pipeline)
    train = set(train_set(vg, backward, LATEST))
    latest = dict(cache_entries(vg, train, LATEST))
    for p, writer in cache_entries(vg, train, VERSIONED):
        assert latest[p] == writer, "a sound latest split needs exactly the version its last stage-1 writer leaves"

"""Optional units (`requires`): pruning by the params a run provides."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

import unitgraph as ug
from unitgraph.graph import VersionGraph
from unitgraph.prune import active_units, prune
from unitgraph.soundness import unsplit_reads

PARAMS = ["image", "edit_image", "prompt", "a", "b"]


def qwen_like():
    return ug.pipeline_from_dict({
        "name": "edit",
        "units": [
            {"name": "ImageEncoder", "inputs": ["image"], "outputs": ["latents"], "models": ["vae"], "requires": ["image"]},
            {"name": "EditResize", "inputs": ["edit_image"], "outputs": ["edit_image"], "requires": ["edit_image"]},
            {"name": "EditEncoder", "inputs": ["edit_image"], "outputs": ["edit_latents"], "models": ["vae"], "requires": ["edit_image"]},
            {"name": "PromptEmbedder", "inputs": ["prompt", "edit_image"], "outputs": ["prompt_emb"], "models": ["text_encoder"], "requires": ["prompt"]},
        ],
        "sink": {"inputs": ["latents", "edit_latents", "prompt_emb"], "models": ["dit"]},
    }, source="edit.json")


def test_units_without_their_required_inputs_are_dropped():
    p = qwen_like()
    active, dropped = prune(p, ["image", "prompt"])
    assert dropped == ["EditResize", "EditEncoder"]
    assert [u.name for u in active.units] == ["ImageEncoder", "PromptEmbedder"]
    assert prune(p, None) == (p, [])


def test_plan_records_the_provided_params_and_verify_uses_them(tmp_path):
    p = qwen_like()
    plan = ug.split(p, trainable_models=["text_encoder"], lora_base_model="dit", provided=["image", "prompt"])
    data = plan.to_dict()
    assert data["provided"] == ["image", "prompt"]
    assert data["inactive_units"] == ["EditResize", "EditEncoder"]
    assert data["data_process"]["units"] == ["ImageEncoder"]
    assert data["train"]["units"] == ["PromptEmbedder"]
    again = ug.Plan.from_dict(json.loads(json.dumps(data)))
    assert ug.verify(p, again) == []
    # the same plan without its `provided` record no longer matches the full pipeline
    del again.extra["provided"]
    assert ug.verify(p, again)


def test_requires_must_name_an_input(tmp_path):
    bad = {"name": "x", "units": [{"name": "A", "inputs": ["a"], "requires": ["b"]}]}
    try:
        ug.pipeline_from_dict(bad, source="x.json")
    except ug.SpecError as exc:
        assert str(exc) == "x.json: unit 'A': 'requires' names 'b', which is not one of the unit's inputs"
    else:
        raise AssertionError("expected a SpecError")


def test_fingerprints_of_specs_without_requires_are_unchanged_by_the_extension():
    p = ug.pipeline_from_dict({"name": "x", "units": [{"name": "A", "inputs": ["a"], "outputs": ["b"]}]})
    assert '"requires"' not in p.canonical_json


@st.composite
def optional_pipelines(draw):
    units = []
    for i in range(draw(st.integers(0, 7))):
        inputs = draw(st.lists(st.sampled_from(PARAMS), max_size=3, unique=True))
        requires = draw(st.lists(st.sampled_from(inputs), max_size=len(inputs), unique=True)) if inputs else []
        outputs = draw(st.lists(st.sampled_from(PARAMS), max_size=2, unique=True))
        units.append(ug.Unit(f"U{i}", tuple(inputs), tuple(outputs), requires=tuple(requires)))
    return ug.Pipeline("p", tuple(units))


@settings(max_examples=300, deadline=None)
@given(optional_pipelines(), st.sets(st.sampled_from(PARAMS)))
def test_pruning_never_changes_the_versions_an_active_unit_reads(pipeline, provided):
    """Run the full pipeline with inactive units as no-ops; active units read what the pruned one says."""
    flags = active_units(pipeline, provided)
    state: dict[str, str] = {}
    full_reads = {}
    for unit, on in zip(pipeline.units, flags):
        if not on:
            continue
        for p in unit.inputs:
            full_reads[(unit.name, p)] = state.get(p)
        for p in unit.outputs:
            state[p] = unit.name
    active, _ = prune(pipeline, provided)
    names = [u.name for u in active.units]
    pruned_reads = {
        (names[reader] if reader < len(names) else "<sink>", p): (None if w is None else names[w])
        for (reader, p), w in unsplit_reads(VersionGraph.of(active)).items()
        if reader < len(names)
    }
    assert pruned_reads == full_reads

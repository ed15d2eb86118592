"""A unit may read a model's configuration without calling it (`configs`; docs/semantics.md, 'Config reads').

Config reads seed nothing and carry no data, so TRAIN, the cache and the models per stage are those
of the same pipeline without them; a stage records the configs it reads but does not load, and
pipelines without configs keep their plan files and fingerprints byte for byte.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import unitgraph as ug
from clitools import cli, one_error_line
from test_core_properties import MODELS, MODES, backward_sets, common, pipelines, usable
from unitgraph.errors import PlanFileError, SpecError
from unitgraph.explain import explain
from unitgraph.render import render_text, to_mermaid
from unitgraph.spec import pipeline_from_dict, read_spec_file

WAN = {
    "name": "wan_like",
    "units": [
        {"name": "ShapeChecker", "inputs": ["height", "width"], "outputs": ["height", "width"]},
        {"name": "NoiseShape", "inputs": ["height", "width"], "outputs": ["latent_shape"], "configs": ["dit"]},
        {"name": "PromptEmbedder", "inputs": ["prompt"], "outputs": ["prompt_emb"], "models": ["text_encoder"]},
        {"name": "InputVideoEmbedder", "inputs": ["video", "latent_shape"], "outputs": ["input_latents"],
         "models": ["vae"]},
        {"name": "NoiseInitializer", "inputs": ["latent_shape", "seed"], "outputs": ["noise"],
         "deterministic": False},
    ],
    "sink": {"inputs": ["input_latents", "noise", "prompt_emb"], "models": ["dit"]},
}
WAN_YAML = """\
name: wan_like
units:
  - {name: ShapeChecker, inputs: [height, width], outputs: [height, width]}
  - {name: NoiseShape, inputs: [height, width], outputs: [latent_shape], configs: [dit]}
  - {name: PromptEmbedder, inputs: [prompt], outputs: [prompt_emb], models: [text_encoder]}
  - {name: InputVideoEmbedder, inputs: [video, latent_shape], outputs: [input_latents], models: [vae]}
  - {name: NoiseInitializer, inputs: [latent_shape, seed], outputs: [noise], deterministic: false}
sink: {inputs: [input_latents, noise, prompt_emb], models: [dit]}
"""
# The plan fingerprints of WAN without its `configs` key, as unitgraph wrote them before configs
# existed (existing caches are tied to them; they must never change).
FINGERPRINTS_WITHOUT_CONFIGS = {
    "latest": "sha256:34df532d56dcc6ca035c1adbc02e51aae3a317f048715353d31f68af1c30d05e",
    "versioned": "sha256:c802e23b167e11f8b5cff8f60b1285fff1334db08e5b76fb65fbeefe33ac412a",
}


def wan(**changes) -> ug.Pipeline:
    data = json.loads(json.dumps(WAN))
    for name, unit_changes in changes.items():
        unit = next(u for u in data["units"] if u["name"] == name)
        unit.update(unit_changes)
        for key in [k for k, v in unit.items() if v is None]:  # None drops the key
            del unit[key]
    return pipeline_from_dict(data)


def wan_without_configs() -> ug.Pipeline:
    return wan(NoiseShape={"configs": None})


def keys_anywhere(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys_anywhere(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys_anywhere(v)}
    return set()


# --- the spec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_spec_files_accept_configs(tmp_path, suffix):
    path = tmp_path / f"wan{suffix}"
    path.write_text(json.dumps(WAN) if suffix == ".json" else WAN_YAML, encoding="utf-8")
    pipeline = read_spec_file(path)
    units = {u.name: u for u in pipeline.units}
    assert units["NoiseShape"].configs == ("dit",) and units["NoiseShape"].models == ()
    assert units["ShapeChecker"].configs == ()
    assert pipeline.configs == ["dit"]
    assert "dit" in pipeline.models  # the sink calls it; NoiseShape only reads its config
    assert pipeline.to_dict()["units"][1]["configs"] == ["dit"]
    assert "configs" not in pipeline.to_dict()["units"][0], "written only when non-empty"
    assert pipeline_from_dict(pipeline.to_dict()) == pipeline


def test_unit_takes_configs_by_keyword_and_pipeline_lists_them():
    unit = ug.Unit("NoiseShape", inputs=["h"], outputs=["shape"], models=(), deterministic=True, configs=["dit", "vae"])
    assert unit.configs == ("dit", "vae") and unit.requires == ()
    other = ug.Unit("Encode", ("x",), ("y",), ("vae",))  # positional use of the older fields is unchanged
    pipeline = ug.Pipeline("p", (unit, other))
    assert pipeline.configs == ["dit", "vae"]
    assert pipeline.models == ["vae"], "a config read is not a call"
    assert other.to_dict() == {"name": "Encode", "inputs": ["x"], "outputs": ["y"], "models": ["vae"],
                               "deterministic": True}


def test_a_unit_listing_a_model_in_models_and_configs_is_a_spec_error():
    with pytest.raises(SpecError) as exc:
        wan(PromptEmbedder={"configs": ["text_encoder"]})
    message = str(exc.value)
    assert "\n" not in message and "'text_encoder'" in message and "unit 'PromptEmbedder'" in message
    assert "'models'" in message and "'configs'" in message
    with pytest.raises(SpecError):
        ug.Pipeline("p", (ug.Unit("A", models=("vae",), configs=("vae",)),))


def test_the_same_model_may_be_called_by_one_unit_and_read_by_another():
    pipeline = wan(NoiseShape={"configs": ["vae"]})  # InputVideoEmbedder calls vae
    plan = ug.split(pipeline, lora_base_model="dit")
    assert plan.data_process_configs == [] and "vae" in plan.data_process_models
    assert ug.verify(pipeline, plan) == []


@pytest.mark.parametrize("value,fragment", [
    ("dit", "'configs' must be a list of strings"),
    ([""], "'configs' must hold non-empty strings"),
    ([3], "'configs' must hold non-empty strings"),
])
def test_configs_are_validated_like_models(value, fragment):
    with pytest.raises(SpecError, match=fragment):
        wan(NoiseShape={"configs": value})


def test_bad_configs_in_a_spec_file_is_one_line_and_exit_2(tmp_path, capsys):
    data = json.loads(json.dumps(WAN))
    data["units"][2]["configs"] = ["text_encoder"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    code, out, err = cli(capsys, "plan", str(path), "--lora-base-model", "dit")
    one_error_line(code, err, "bad.json", "PromptEmbedder", "'configs'")
    assert out == ""


# --- the split ---------------------------------------------------------------------------------------


def test_a_config_read_of_the_lora_base_does_not_seed_the_unit():
    pipeline = wan()
    plan = ug.split(pipeline, lora_base_model="dit")
    assert plan.data_process_units == ["ShapeChecker", "NoiseShape", "PromptEmbedder", "InputVideoEmbedder"]
    assert plan.train_units == ["NoiseInitializer"]
    assert plan.data_process_models == ["text_encoder", "vae"], "stage 1 never loads dit's weights"
    assert plan.data_process_configs == ["dit"]
    assert plan.train_models == ["dit"] and plan.train_configs == []
    assert ("latent_shape", "NoiseShape") in plan.cache_entries
    assert ug.verify(pipeline, plan) == [] and plan.checks_pass
    data = plan.to_dict()
    assert data["data_process"] == {"units": plan.data_process_units, "models": ["text_encoder", "vae"],
                                    "configs": ["dit"]}
    assert data["train"] == {"units": ["NoiseInitializer"], "models": ["dit"]}, "configs only when non-empty"
    # the split is the one of the same pipeline without the config read
    bare = ug.split(wan_without_configs(), lora_base_model="dit")
    assert (bare.train_units, bare.data_process_models, bare.train_models, bare.cache_entries) == (
        plan.train_units, plan.data_process_models, plan.train_models, plan.cache_entries)


def test_stage_configs_leave_out_the_models_the_stage_loads():
    # NoiseInitializer (train, non-deterministic) reads the configs of dit, loaded in train, and vae, not loaded
    pipeline = wan(NoiseInitializer={"configs": ["dit", "vae"]})
    plan = ug.split(pipeline, lora_base_model="dit")
    assert plan.train_models == ["dit"] and plan.train_configs == ["vae"]
    # training the text encoder too: NoiseShape's config read of dit still seeds nothing
    plan = ug.split(pipeline, trainable_models=["text_encoder"], lora_base_model="dit", cache_mode="versioned")
    assert "NoiseShape" in plan.data_process_units and plan.data_process_configs == ["dit"]
    assert plan.train_units == ["PromptEmbedder", "NoiseInitializer"]
    assert ug.verify(pipeline, plan) == []


def test_plan_file_round_trip(tmp_path):
    pipeline = wan(NoiseInitializer={"configs": ["vae"]})
    plan = ug.split(pipeline, lora_base_model="dit")
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json(), encoding="utf-8")
    back = ug.read_plan_file(path)
    assert back.data_process_configs == ["dit"] and back.train_configs == ["vae"]
    assert back.to_json() == plan.to_json()
    assert ug.verify(pipeline, back) == []


@pytest.mark.parametrize("bad", ["dit", [1], {"dit": True}])
def test_plan_file_configs_must_be_a_list_of_strings(tmp_path, bad):
    data = ug.split(wan(), lora_base_model="dit").to_dict()
    data["data_process"]["configs"] = bad
    with pytest.raises(PlanFileError, match="data_process.configs"):
        ug.Plan.from_dict(data)


def test_pipelines_without_configs_keep_plans_and_fingerprints():
    bare = wan_without_configs()
    assert "configs" not in keys_anywhere(bare.to_dict()) and "configs" not in keys_anywhere(bare.canonical_dict())
    for mode, expected in FINGERPRINTS_WITHOUT_CONFIGS.items():
        plan = ug.split(bare, lora_base_model="dit", cache_mode=mode)
        assert plan.fingerprint == expected
        assert "configs" not in keys_anywhere(plan.to_dict())
        assert '"configs"' not in plan.to_json()
        # an explicit empty `configs` is the same as none at all
        explicit = wan(NoiseShape={"configs": []})
        assert ug.split(explicit, lora_base_model="dit", cache_mode=mode).to_json() == plan.to_json()
    with_configs = ug.split(wan(), lora_base_model="dit")
    assert with_configs.fingerprint != FINGERPRINTS_WITHOUT_CONFIGS["latest"], "a config read is part of the spec"


def test_verify_catches_wrong_configs():
    pipeline = wan(NoiseInitializer={"configs": ["vae"]})
    good = ug.split(pipeline, lora_base_model="dit")

    def tampered(**changes):
        plan = ug.Plan.from_dict(good.to_dict())
        for key, value in changes.items():
            setattr(plan, key, value)
        return ug.verify(pipeline, plan)

    assert tampered() == []
    assert tampered(data_process_configs=[]) == [
        "configs: data_process units read the config of dit, which the plan does not list"]
    assert tampered(train_configs=["dit", "vae"]) == ["configs: train lists the config of dit, but it loads that model"]
    assert tampered(train_configs=["text_encoder", "vae"]) == [
        "configs: train lists the config of text_encoder, but no unit of that stage reads it"]
    assert tampered(data_process_configs=["dit", "dit"]) == ["format: data_process.configs must be sorted and without duplicates"]
    # the same through a hand-edited plan file
    data = good.to_dict()
    del data["train"]["configs"]
    assert [line.split(":")[0] for line in ug.verify(pipeline, ug.Plan.from_dict(data))] == ["configs"]


# --- property: configs never change the split ------------------------------------------------------------


@st.composite
def with_configs(draw, pipeline):
    """The pipeline with random `configs` on random units (never a model the unit calls)."""
    units = []
    for unit in pipeline.units:
        choices = [m for m in MODELS if m not in unit.models]
        configs = draw(st.lists(st.sampled_from(choices), max_size=2, unique=True))
        units.append(dataclasses.replace(unit, configs=tuple(configs)))
    return ug.Pipeline(pipeline.name, tuple(units), pipeline.sink)


@common
@given(pipelines(), backward_sets, st.sampled_from(MODES), st.data())
def test_configs_never_change_the_train_set_or_the_models_per_stage(pipeline, backward, mode, data):
    configured = data.draw(with_configs(pipeline))
    models = sorted(usable(pipeline, backward))
    plain = ug.split(pipeline, models, cache_mode=mode)
    plan = ug.split(configured, models, cache_mode=mode)
    assert plan.train_units == plain.train_units and plan.data_process_units == plain.data_process_units
    assert plan.data_process_models == plain.data_process_models and plan.train_models == plain.train_models
    assert plan.cache_entries == plain.cache_entries
    assert plan.reasons == plain.reasons
    assert ug.verify(configured, plan) == []
    units = {u.name: u for u in configured.units}
    for stage_units, loaded, configs in ((plan.data_process_units, plan.data_process_models, plan.data_process_configs),
                                         (plan.train_units, plan.train_models, plan.train_configs)):
        assert configs == sorted({m for n in stage_units for m in units[n].configs} - set(loaded))
    assert plain.data_process_configs == plain.train_configs == []
    assert "configs" not in keys_anywhere(plain.to_dict())
    assert (plan.fingerprint == plain.fingerprint) == (not configured.configs)


# --- what the commands print ------------------------------------------------------------------------------


def test_explain_says_a_config_read_seeds_nothing():
    text = explain(wan(), "NoiseShape", lora_base_model="dit").text
    assert text.startswith("NoiseShape is in data_process because nothing pulls it into train:")
    assert "it only reads the config of dit (dit needs backward), without calling it" in text
    assert "does not seed it (X0)" in text
    assert "Stage 1 loads the config of dit for it, not the weights." in text
    train = explain(wan(NoiseInitializer={"configs": ["dit"]}), "NoiseInitializer", lora_base_model="dit").text
    assert train.startswith("NoiseInitializer is in train because it is non-deterministic")
    assert "It also reads the config of dit, which needs backward, without calling it" in train
    # no word of configs for units without them
    assert "config" not in explain(wan(), "ShapeChecker", lora_base_model="dit").text


def test_inspect_and_explain_commands_show_configs(tmp_path, capsys):
    path = tmp_path / "wan.json"
    path.write_text(json.dumps(WAN), encoding="utf-8")
    code, out, err = cli(capsys, "inspect", str(path), "--lora-base-model", "dit")
    assert code == 0, err
    assert "  stage 1 (data_process): text_encoder, vae  (config only: dit)" in out
    assert "  stage 2 (train):        dit\n" in out
    assert "config: dit" in out  # NoiseShape's row
    code, out, err = cli(capsys, "explain", str(path), "NoiseShape", "--lora-base-model", "dit")
    assert code == 0, err
    assert "only reads the config of dit" in out
    code, out, err = cli(capsys, "plan", str(path), "--lora-base-model", "dit")
    assert code == 0, err
    assert json.loads(out)["data_process"]["configs"] == ["dit"]


def test_drawings_show_config_reads():
    pipeline = wan()
    plan = ug.split(pipeline, lora_base_model="dit")
    mermaid = to_mermaid(pipeline, plan)
    assert "stage 1 · data_process: loads text_encoder, vae  (config only: dit)" in mermaid
    assert "<b>NoiseShape</b><br/>config: dit" in mermaid
    assert "config only" not in to_mermaid(wan_without_configs(), ug.split(wan_without_configs(), lora_base_model="dit"))
    text = render_text(pipeline, plan)
    assert "(config only: dit)" in text
    pytest.importorskip("graphviz")
    from unitgraph.render import dot_source

    dot = dot_source(pipeline, plan)
    assert "stage 1 (data_process) loads: text_encoder, vae  (config only: dit)" in dot
    assert "config: dit" in dot

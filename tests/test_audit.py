"""`unitgraph audit`: the hazards the update-chain rule misses, per trainable model."""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from unitgraph.audit import audit, denoiser_of, render_text
from unitgraph.graph import VersionGraph
from unitgraph.spec import Pipeline, Sink, Unit
from unitgraph.closure import backward_models, train_set, update_chain_train_set


def hazard_pipeline() -> Pipeline:
    """Both hazard kinds when the text encoder is trained; none when the VAE is."""
    return Pipeline(
        "hazards",
        (
            Unit("PromptEmbedder", ("prompt", "edit_image"), ("prompt_emb", "prompt_mask"), ("text_encoder",)),
            Unit("MaskPadding", ("prompt",), ("prompt_mask",)),  # rewrites what the embedder wrote: WAW
            Unit("EditAutoResize", ("edit_image",), ("edit_image",)),  # rewrites what the embedder read: WAR
            Unit("EditEncoder", ("edit_image",), ("edit_latents",), ("vae",)),
            Unit("Noise", ("seed",), ("noise",), deterministic=False),
        ),
        Sink(("prompt_emb", "prompt_mask", "edit_latents", "noise"), ("dit",)),
    )


def test_hazards_wrong_reads_and_models_per_mode():
    result = audit(hazard_pipeline())
    assert result.lora_base_model == "dit"
    assert [c.trainable_models for c in result.cases] == [[], ["text_encoder"], ["vae"]]
    base, text, vae = result.cases
    assert base.hazards == [] and vae.hazards == [] and base.update_chain.sound
    assert [h.describe() for h in text.hazards] == [
        "MaskPadding writes prompt_mask after PromptEmbedder wrote it (write-after-write)",
        "EditAutoResize writes edit_image after PromptEmbedder read it (write-after-read)",
    ]
    assert text.pulled_along == [("EditEncoder", "reads edit_image written by EditAutoResize (F)")]
    assert [r.describe() for r in text.wrong_reads] == [
        "PromptEmbedder reads edit_image as the version written by EditAutoResize; unsplit it reads the dataset value",
        "sink reads prompt_mask as the version written by PromptEmbedder; unsplit it reads the version written by MaskPadding",
    ]
    assert text.update_chain.train_units == ["PromptEmbedder", "Noise"]
    assert not text.update_chain.sound
    assert text.latest.train_models == ["dit", "text_encoder", "vae"]
    assert text.versioned.train_models == ["dit", "text_encoder"]
    assert ("edit_image", None) in text.versioned.cache_entries
    assert ("edit_latents", "EditEncoder") in text.versioned.cache_entries  # the encoder stays in stage 1
    assert ("prompt_mask", "MaskPadding") in text.versioned.cache_entries  # newer than the live write
    assert text.latest.sound and text.versioned.sound


def test_text_report_and_json():
    result = audit(hazard_pipeline())
    text = render_text(result)
    assert "3 configurations · 1 with hazards the update-chain rule misses" in text
    assert "── train text_encoder, LoRA on dit ──" in text
    assert "update-chain ✗ unsound" in text
    assert "versioned keeps vae out of stage 2" in text
    data = result.to_dict()
    assert data["format"] == "unitgraph.audit/v1"
    case = data["cases"][1]
    assert case["missed_hazards"][1] == {"unit": "EditAutoResize", "param": "edit_image",
                                         "conflicts_with": "PromptEmbedder", "kind": "write-after-read"}
    assert case["wrong_reads_update_chain"][0] == {"reader": "PromptEmbedder", "param": "edit_image",
                                                    "reads": "EditAutoResize", "should_read": None}
    assert case["latest"]["cache_entries"][0] == {"param": "edit_image", "writer": None}
    json.dumps(data)


def test_provided_params_prune_first_and_base_and_models_can_be_chosen():
    pipeline = Pipeline(
        "opt",
        (
            Unit("PromptEmbedder", ("prompt", "edit_image"), ("prompt_emb",), ("text_encoder",)),
            Unit("EditAutoResize", ("edit_image",), ("edit_image",), requires=("edit_image",)),
        ),
        Sink(("prompt_emb", "edit_image"), ("dit", "controlnet")),
    )
    assert denoiser_of(pipeline) == "dit"
    with_edit = audit(pipeline, provided=["prompt", "edit_image"], models=["text_encoder"])
    without = audit(pipeline, provided=["prompt"], models=["text_encoder"])
    assert with_edit.cases[1].hazards and not without.cases[1].hazards
    assert without.inactive_units == ["EditAutoResize"]
    other = audit(pipeline, lora_base_model="text_encoder")
    assert other.lora_base_model == "text_encoder"
    assert [c.trainable_models for c in other.cases] == [[], ["controlnet"], ["dit"]]


def test_no_sink_no_base_every_model_alone():
    pipeline = Pipeline("bare", (Unit("A", ("x",), ("y",), ("enc",)), Unit("B", ("y",), ("z",), ("dec",))))
    result = audit(pipeline)
    assert result.lora_base_model is None
    assert [c.trainable_models for c in result.cases] == [["dec"], ["enc"]]


@st.composite
def pipelines(draw):
    params = ["a", "b", "c", "d"]
    units = []
    for i in range(draw(st.integers(1, 7))):
        units.append(Unit(
            f"U{i}",
            tuple(draw(st.lists(st.sampled_from(params), max_size=2, unique=True))),
            tuple(draw(st.lists(st.sampled_from(params), min_size=1, max_size=2, unique=True))),
            tuple(draw(st.lists(st.sampled_from(["m1", "m2"]), max_size=1))),
            deterministic=draw(st.booleans()) or i % 3 != 0,
        ))
    sink = Sink(tuple(draw(st.lists(st.sampled_from(params), max_size=3, unique=True))), ("dit",))
    return Pipeline("p", tuple(units), sink)


@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_hazards_are_exactly_what_w_adds_beyond_u(pipeline):
    vg = VersionGraph.of(pipeline)
    for case in audit(pipeline).cases:
        backward = backward_models(case.trainable_models, case.lora_base_model)
        extra = set(train_set(vg, backward)) - update_chain_train_set(vg, backward)
        moved = {h.unit for h in case.hazards} | {u for u, _ in case.pulled_along}
        assert moved == {vg.names[i] for i in extra}
        assert case.latest.sound and case.versioned.sound
        if not case.hazards:
            assert case.update_chain.sound and not case.wrong_reads
        # a wrong read is always a consequence of a missed hazard
        if case.wrong_reads:
            assert case.hazards


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unitgraph.cli.app", *args], capture_output=True, text=True, timeout=120)


def test_cli_audit_example_and_errors(tmp_path):
    result = run("audit", "examples:z_image")
    assert result.returncode == 0, result.stderr
    assert "EditImageAutoResize writes edit_image after PromptEmbedder read it (write-after-read)" in result.stdout
    out = tmp_path / "audit.json"
    result = run("audit", "examples:z_image", "--models", "text_encoder", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stderr
    data = json.loads(out.read_text())
    assert data["cases_with_missed_hazards"] == 1 and len(data["cases"]) == 2
    result = run("audit", "examples:z_image", "--format", "yaml")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    result = run("audit", "examples:z_image", "--lora-base-model", "nosuch")
    assert result.returncode == 2 and "nosuch" in result.stderr


def test_cli_with_metadata_columns(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(hazard_pipeline().to_dict() | {
        "units": [u | ({"requires": ["edit_image"]} if u["name"] == "EditAutoResize" else {})
                  for u in hazard_pipeline().to_dict()["units"]]}))
    csv_meta = tmp_path / "metadata.csv"
    csv_meta.write_text("prompt,edit_image,seed\nhello,,1\n")
    jsonl_meta = tmp_path / "metadata.jsonl"
    jsonl_meta.write_text('{"prompt": "a", "edit_image": "e.png", "seed": 1}\n')
    result = run("audit", str(spec), "--with-metadata", str(csv_meta), "-f", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["provided"] == ["prompt", "seed"] and data["inactive_units"] == ["EditAutoResize"]
    result = run("audit", str(spec), "--with-metadata", str(jsonl_meta), "-f", "json")
    assert json.loads(result.stdout)["provided"] == ["edit_image", "prompt", "seed"]
    bad = tmp_path / "metadata.txt"
    bad.write_text("x")
    result = run("plan", str(spec), "--with-metadata", str(bad))
    assert result.returncode == 2 and "use .csv, .json or .jsonl" in result.stderr

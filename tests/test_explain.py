"""`unitgraph explain`: the chain back to X0 for train units, the conditions for data_process units."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from unitgraph import SpecError, split
from unitgraph.explain import chain_of, explain
from unitgraph.graph import VersionGraph
from unitgraph.spec import Pipeline, Sink, Unit, read_spec_file
from unitgraph.closure import backward_models, train_set

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "unitgraph" / "examples"


def edit_pipeline() -> Pipeline:
    """The example of docs/semantics.md, 'Write-after-read': the prompt embedder reads edit_image before it is
    auto-resized."""
    return Pipeline(
        "edit",
        (
            Unit("PromptEmbedder", ("prompt", "edit_image"), ("prompt_emb",), ("text_encoder",)),
            Unit("EditAutoResize", ("edit_image",), ("edit_image",)),
            Unit("EditImageEmbedder", ("edit_image",), ("edit_latents",), ("vae",)),
        ),
        Sink(("prompt_emb", "edit_latents"), ("dit",)),
    )


def test_train_chain_is_exact():
    text = explain(edit_pipeline(), "EditImageEmbedder", lora_base_model="text_encoder").text
    assert text == (
        "EditImageEmbedder is in train because it reads edit_image written by EditAutoResize (F), "
        "which is in train because it writes edit_image after PromptEmbedder read it: write-after-read (W), "
        "which is in train because it calls text_encoder, which needs backward (X0)."
    )


def test_chain_structure():
    result = explain(edit_pipeline(), "EditImageEmbedder", lora_base_model="text_encoder")
    assert result.stage == "train"
    assert [(name, reason.rule) for name, reason in result.chain] == [
        ("EditImageEmbedder", "F"),
        ("EditAutoResize", "W"),
        ("PromptEmbedder", "model"),
    ]
    assert str(result) == result.text


def test_seed_explanations():
    pipeline = Pipeline(
        "seeds",
        (Unit("Noise", ("seed",), ("noise",), deterministic=False), Unit("Enc", ("x",), ("y",), ("te", "vae"))),
        Sink(("noise", "y"), ("dit",)),
    )
    assert explain(pipeline, "Noise").text == (
        "Noise is in train because it is non-deterministic, so it must run fresh every epoch (X0)."
    )
    assert explain(pipeline, "Enc", trainable_models=["te", "vae"]).text == (
        "Enc is in train because it calls te, vae, which need backward (X0)."
    )


def test_update_chain_and_write_after_write():
    pipeline = Pipeline(
        "chains",
        (
            Unit("Resize", ("img",), ("img",), ("te",)),  # reads and writes img in place: U for later writers
            Unit("Crop", ("img",), ("img",)),
            Unit("Init", ("h",), ("lat",), ("te",)),  # writes lat without reading it
            Unit("Overwrite", ("w",), ("lat",)),
        ),
        Sink(("img", "lat"), ("dit",)),
    )
    assert explain(pipeline, "Crop", lora_base_model="te").text == (
        "Crop is in train because it reads img written by Resize (F), "
        "which is in train because it calls te, which needs backward (X0)."
    )
    assert explain(pipeline, "Overwrite", lora_base_model="te").text == (
        "Overwrite is in train because it writes lat after Init wrote it: write-after-write (W), "
        "which is in train because it calls te, which needs backward (X0)."
    )
    blind = Pipeline(
        "blind",
        (Unit("Resize", ("img",), ("img",), ("te",)), Unit("Load", ("path",), ("img",))),
        Sink(("img",), ("dit",)),
    )
    assert explain(blind, "Load", lora_base_model="te").text == (
        "Load is in train because it writes img later in the update chain that Resize reads and writes in place (U), "
        "which is in train because it calls te, which needs backward (X0)."
    )


def test_data_process_latest_is_exact():
    text = explain(edit_pipeline(), "EditAutoResize", lora_base_model="dit", trainable_models=["vae"]).text
    assert text == "\n".join([
        "EditAutoResize is in data_process because nothing pulls it into train:",
        "  - it calls no model that needs backward (it calls none; models that need backward: dit, vae)",
        "  - it is deterministic, so its output is the same in every epoch",
        "  - it reads no version written by a train unit (F): it reads edit_image from the dataset, all in data_process",
        "  - it writes no param after a train unit first read or wrote it (W, which contains U): "
        "edit_image is first touched in train by EditImageEmbedder, after it",
        "Its output reaches train through the cache: edit_image.",
    ])


def test_data_process_versioned_is_exact():
    result = explain(edit_pipeline(), "EditImageEmbedder", lora_base_model="text_encoder", cache_mode="versioned")
    assert result.stage == "data_process"
    assert result.text == "\n".join([
        "EditImageEmbedder is in data_process because nothing pulls it into train:",
        "  - it calls no model that needs backward (it calls vae; models that need backward: text_encoder)",
        "  - it is deterministic, so its output is the same in every epoch",
        "  - it reads no version written by a train unit (F): it reads edit_image from EditAutoResize, "
        "all in data_process",
        "  - write hazards (W, U) do not apply in versioned mode: stage 2 reads the exact cached version of every input",
        "Its output reaches train through the cache: edit_latents.",
    ])
    assert len(result.conditions) == 4


def test_data_process_unit_whose_output_is_not_cached():
    text = explain(edit_pipeline(), "EditAutoResize", lora_base_model="dit").text
    assert "no train unit reads or writes edit_image" in text
    assert text.endswith("None of its outputs is cached: only data_process units use them.")


def test_unknown_unit_and_model_are_spec_errors():
    with pytest.raises(SpecError, match="no unit named 'Nope'"):
        explain(edit_pipeline(), "Nope")
    with pytest.raises(SpecError, match="'unet'"):
        explain(edit_pipeline(), "PromptEmbedder", lora_base_model="unet")


@pytest.mark.parametrize("cache_mode", ["latest", "versioned"])
def test_every_chain_ends_in_a_seed_and_agrees_with_the_plan(cache_mode):
    rng = random.Random(7)
    for trial in range(40):
        params = [f"p{k}" for k in range(6)]
        units = []
        for i in range(rng.randint(2, 9)):
            units.append(Unit(
                f"U{i}",
                tuple(rng.sample(params, rng.randint(0, 3))),
                tuple(rng.sample(params, rng.randint(0, 2))),
                tuple(m for m in ("te", "vae") if rng.random() < 0.25),
                deterministic=rng.random() > 0.1,
            ))
        pipeline = Pipeline(f"random{trial}", tuple(units))
        plan = split(pipeline, lora_base_model="te", cache_mode=cache_mode)
        vg = VersionGraph(pipeline)
        reasons = train_set(vg, backward_models((), "te"), cache_mode)
        for unit in pipeline.units:
            result = explain(pipeline, unit.name, lora_base_model="te", cache_mode=cache_mode)
            assert result.stage == plan.stage_of(unit.name)
            if result.stage == "train":
                assert result.text.startswith(f"{unit.name} is in train because it {plan.reasons[unit.name]}")
                chain = chain_of(reasons, vg.position[unit.name])
                assert chain[-1][1].is_seed
                positions = [i for i, _ in chain]
                assert positions == sorted(positions, reverse=True)
                assert all(i in reasons for i in positions)
            else:
                assert result.text.startswith(f"{unit.name} is in data_process because nothing pulls it into train:")


def test_z_image_example_matches_the_design():
    pipeline = read_spec_file(EXAMPLES / "z_image.json")
    latest = explain(pipeline, "EditImageSiglipEmbedder", lora_base_model="text_encoder")
    assert [rule.rule for _, rule in latest.chain] == ["F", "W", "model"]
    versioned = explain(pipeline, "EditImageSiglipEmbedder", lora_base_model="text_encoder", cache_mode="versioned")
    assert versioned.stage == "data_process"


# --- the command ---------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from unitgraph.cli.app import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_prints_the_chain():
    result = run_cli("explain", str(EXAMPLES / "z_image.json"), "EditImageEmbedder", "--lora-base-model", "text_encoder")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "EditImageEmbedder is in train because it reads edit_image written by EditImageAutoResize (F), "
        "which is in train because it writes edit_image after PromptEmbedder read it: write-after-read (W), "
        "which is in train because it calls text_encoder, which needs backward (X0).\n"
    )


def test_cli_versioned_and_underscore_spelling():
    result = run_cli("explain", str(EXAMPLES / "z_image.json"), "EditImageEmbedder", "--lora_base_model",
                     "text_encoder", "--cache_mode", "versioned")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("EditImageEmbedder is in data_process because nothing pulls it into train:")


def test_cli_unknown_unit_is_exit_2_one_line():
    result = run_cli("explain", str(EXAMPLES / "z_image.json"), "NoSuchUnit")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "NoSuchUnit" in lines[0] and "z_image.json" in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_bad_cache_mode_is_exit_2():
    result = run_cli("explain", str(EXAMPLES / "z_image.json"), "ShapeChecker", "--cache-mode", "newest")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1

"""`diffusers:` references: Modular Pipelines blocks flattened into units (blocks written by the
test, plus the real Qwen-Image blocks diffusers ships), conditional blocks resolved by `--with` or
taken as the union of their branches, the denoiser block as the sink."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

pytest.importorskip("diffusers.modular_pipelines")

import unitgraph as ug  # noqa: E402
from unitgraph.adapters import AdapterNote  # noqa: E402
from unitgraph.adapters.diffusers_modular import blocks_to_pipeline, load_blocks  # noqa: E402
from unitgraph.cli.app import main  # noqa: E402

# Blocks in the style of diffusers' Qwen-Image blocks: an auto text encoder, an auto VAE encoder with
# inpaint and img2img branches, latents set-up that draws noise (and rewrites height/width without
# declaring them), a denoise loop (the sink) and a decoder after it (inference only).
BLOCKS = '''
import torch
from diffusers.modular_pipelines import (
    AutoPipelineBlocks, ComponentSpec, InputParam, LoopSequentialPipelineBlocks, ModularPipelineBlocks,
    OutputParam, SequentialPipelineBlocks,
)
from diffusers.utils.torch_utils import randn_tensor


class Tokenizer:  # configuration, not a model
    pass


class Scheduler:
    pass


class TextEncoderStep(ModularPipelineBlocks):
    expected_components = [ComponentSpec("text_encoder", torch.nn.Module), ComponentSpec("tokenizer", Tokenizer)]
    inputs = [InputParam("prompt", required=True), InputParam("negative_prompt")]
    intermediate_outputs = [OutputParam("prompt_embeds", kwargs_type="denoiser_input_fields"),
                            OutputParam("negative_prompt_embeds", kwargs_type="denoiser_input_fields")]

    def __call__(self, components, state):
        block_state = self.get_block_state(state)
        block_state.prompt_embeds = components.text_encoder(block_state.prompt)
        self.set_block_state(state, block_state)
        return components, state


class ProcessImageStep(ModularPipelineBlocks):
    expected_components = [ComponentSpec("image_processor", Tokenizer, default_creation_method="from_config")]
    inputs = [InputParam("image", required=True), InputParam("height"), InputParam("width")]
    intermediate_outputs = [OutputParam("processed_image")]

    def __call__(self, components, state):
        return components, state


class ProcessMaskStep(ModularPipelineBlocks):
    expected_components = [ComponentSpec("mask_processor", default_creation_method="from_config")]
    inputs = [InputParam("mask_image", required=True), InputParam("image", required=True)]
    intermediate_outputs = [OutputParam("processed_image"), OutputParam("processed_mask_image")]

    def __call__(self, components, state):
        return components, state


class VaeEncodeStep(ModularPipelineBlocks):
    expected_components = [ComponentSpec("vae")]  # no type hint, created from_pretrained: a model
    inputs = [InputParam("processed_image", required=True), InputParam("generator")]
    intermediate_outputs = [OutputParam("image_latents")]

    def __call__(self, components, state):
        return components, state


class InpaintVaeStep(SequentialPipelineBlocks):
    block_classes = [ProcessMaskStep, VaeEncodeStep]
    block_names = ["preprocess", "encode"]


class Img2ImgVaeStep(SequentialPipelineBlocks):
    block_classes = [ProcessImageStep, VaeEncodeStep]
    block_names = ["preprocess", "encode"]


class AutoTextEncoderStep(AutoPipelineBlocks):
    block_classes = [TextEncoderStep]
    block_names = ["text_encoder"]
    block_trigger_inputs = ["prompt"]


class AutoVaeEncoderStep(AutoPipelineBlocks):
    block_classes = [InpaintVaeStep, Img2ImgVaeStep]
    block_names = ["inpaint", "img2img"]
    block_trigger_inputs = ["mask_image", "image"]


class PrepareLatentsStep(ModularPipelineBlocks):
    inputs = [InputParam("latents"), InputParam("height"), InputParam("width"), InputParam("generator")]
    intermediate_outputs = [OutputParam("latents")]

    def __call__(self, components, state):
        block_state = self.get_block_state(state)
        block_state.height = block_state.height or 64
        block_state.latents = randn_tensor((1, 4, 8, 8), generator=block_state.generator)
        self.set_block_state(state, block_state)
        return components, state


class SetTimestepsStep(ModularPipelineBlocks):
    expected_components = [ComponentSpec("scheduler", Scheduler)]
    inputs = [InputParam("num_inference_steps"), InputParam("latents", required=True)]
    intermediate_outputs = [OutputParam("timesteps")]

    def __call__(self, components, state):
        return components, state


class LoopDenoiser(ModularPipelineBlocks):
    expected_components = [ComponentSpec("transformer", torch.nn.Module),
                           ComponentSpec("guider", Scheduler, default_creation_method="from_config")]
    inputs = [InputParam(kwargs_type="denoiser_input_fields")]

    def __call__(self, components, block_state, i, t):
        block_state.noise_pred = components.transformer(block_state.latents)
        return components, block_state


class LoopAfterDenoiser(ModularPipelineBlocks):
    expected_components = [ComponentSpec("scheduler", Scheduler)]
    intermediate_outputs = [OutputParam("latents")]

    def __call__(self, components, block_state, i, t):
        block_state.latents = components.scheduler.step(block_state.noise_pred, t, block_state.latents)
        return components, block_state


class DenoiseStep(LoopSequentialPipelineBlocks):
    block_classes = [LoopDenoiser, LoopAfterDenoiser]
    block_names = ["denoiser", "after_denoiser"]
    loop_inputs = [InputParam("timesteps", required=True), InputParam("latents", required=True)]

    @property
    def description(self):
        return "denoise loop"


class DecodeStep(ModularPipelineBlocks):
    expected_components = [ComponentSpec("vae", torch.nn.Module)]
    inputs = [InputParam("latents", required=True)]
    intermediate_outputs = [OutputParam("images")]

    def __call__(self, components, state):
        return components, state


class ToyBlocks(SequentialPipelineBlocks):
    block_classes = [AutoTextEncoderStep, AutoVaeEncoderStep, PrepareLatentsStep, SetTimestepsStep, DenoiseStep,
                     DecodeStep]
    block_names = ["text_encoder", "vae_encoder", "prepare_latents", "set_timesteps", "denoise", "decode"]
'''


@pytest.fixture(scope="module")
def blocks_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("blocks")
    (folder / "toy_blocks.py").write_text(textwrap.dedent(BLOCKS))
    (folder / "modular_config.json").write_text(json.dumps({"auto_map": {"ModularPipelineBlocks": "toy_blocks.ToyBlocks"}}))
    return folder


@pytest.fixture(scope="module")
def toy(blocks_dir):
    sys.path.insert(0, str(blocks_dir))
    try:
        yield importlib.import_module("toy_blocks")
    finally:
        sys.path.remove(str(blocks_dir))
        sys.modules.pop("toy_blocks", None)


def flatten(blocks, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline = blocks_to_pipeline(blocks, **options)
    return pipeline, [str(w.message) for w in caught if issubclass(w.category, AdapterNote)]


def units(pipeline):
    return {u.name: u for u in pipeline.units}


def test_without_with_the_union_of_branches_is_taken_and_said(toy):
    pipeline, notes = flatten(toy.ToyBlocks())
    assert [u.name for u in pipeline.units] == [
        "text_encoder.text_encoder",
        "vae_encoder.inpaint.preprocess", "vae_encoder.inpaint.encode",
        "vae_encoder.img2img.preprocess", "vae_encoder.img2img.encode",
        "prepare_latents", "set_timesteps",
    ]
    by = units(pipeline)
    # a branch that may not run keeps the earlier version of what it writes: it reads it too
    assert by["text_encoder.text_encoder"].inputs == ("prompt", "negative_prompt", "prompt_embeds", "negative_prompt_embeds")
    assert "image_latents" in by["vae_encoder.img2img.encode"].inputs
    assert by["prepare_latents"].inputs == ("latents", "height", "width", "generator")  # not in a conditional
    union = next(n for n in notes if "union" in n)
    assert "2 conditional blocks (text_encoder, vae_encoder)" in union
    assert "trigger inputs: image, mask_image, prompt" in union


def test_with_resolves_the_branches_like_diffusers(toy):
    pipeline, notes = flatten(toy.ToyBlocks(), provided=["prompt", "image"])
    assert [u.name for u in pipeline.units] == [
        "text_encoder.text_encoder", "vae_encoder.img2img.preprocess", "vae_encoder.img2img.encode",
        "prepare_latents", "set_timesteps",
    ]
    assert units(pipeline)["text_encoder.text_encoder"].inputs == ("prompt", "negative_prompt")
    assert not any("union" in n for n in notes)
    inpaint, _ = flatten(toy.ToyBlocks(), provided=["prompt", "image", "mask_image"])
    assert "vae_encoder.inpaint.encode" in units(inpaint)
    text_only, notes = flatten(toy.ToyBlocks(), provided=["prompt"])
    assert not any(n.startswith("vae_encoder") for n in units(text_only))
    assert any("these conditional blocks do not run: vae_encoder" in n for n in notes)


def test_components_models_determinism_and_undeclared_writes(toy):
    pipeline, notes = flatten(toy.ToyBlocks(), provided=["prompt", "image"])
    by = units(pipeline)
    assert by["text_encoder.text_encoder"].models == ("text_encoder",)  # the tokenizer is configuration
    assert by["vae_encoder.img2img.encode"].models == ("vae",)  # no type hint, from_pretrained
    assert by["vae_encoder.img2img.preprocess"].models == ()
    assert by["set_timesteps"].models == ()  # schedulers are not models
    assert not by["prepare_latents"].deterministic  # calls randn_tensor
    assert by["vae_encoder.img2img.encode"].deterministic  # takes a generator but draws nothing
    # block_state.height is assigned: diffusers writes the changed input back
    assert by["prepare_latents"].outputs == ("latents", "height")
    assert any("prepare_latents (height)" in n for n in notes)
    forced, _ = flatten(toy.ToyBlocks(), provided=["prompt", "image"], nondeterministic=["VaeEncodeStep"],
                        deterministic=["prepare_latents"])
    assert not units(forced)["vae_encoder.img2img.encode"].deterministic
    assert units(forced)["prepare_latents"].deterministic


def test_the_denoise_loop_is_the_sink_and_decode_is_left_out(toy):
    pipeline, notes = flatten(toy.ToyBlocks(), provided=["prompt", "image"])
    assert "decode" not in units(pipeline) and "denoise" not in units(pipeline)
    assert pipeline.sink.models == ("transformer",)  # guider and scheduler are configuration
    # the loop's inputs, the kwargs group expanded, and the clean latents the loss needs
    assert set(pipeline.sink.inputs) == {"timesteps", "latents", "prompt_embeds", "negative_prompt_embeds", "image_latents"}
    sink_note = next(n for n in notes if "the sink" in n)
    assert "denoiser block denoise (models transformer)" in sink_note and "left out: decode" in sink_note


def test_plans_are_sound_and_the_text_encoder_hazard_is_visible(toy):
    pipeline, _ = flatten(toy.ToyBlocks(), provided=["prompt", "image"])
    plan = ug.split(pipeline, ["text_encoder"], "transformer", provided=["prompt", "image"])
    assert ug.verify(pipeline, plan) == []
    assert plan.train_units == ["text_encoder.text_encoder", "prepare_latents", "set_timesteps"]
    assert plan.data_process_models == ["vae"]
    assert plan.train_models == ["text_encoder", "transformer"]
    union, _ = flatten(toy.ToyBlocks())
    assert ug.verify(union, ug.split(union, lora_base_model="transformer")) == []


def test_references_class_module_and_saved_folders(toy, blocks_dir, tmp_path):
    # both run code that is not installed: only with trust_remote_code (tests/test_trust.py refuses them)
    by_module = load_blocks("toy_blocks:ToyBlocks", source=str(blocks_dir), trust_remote_code=True)
    by_folder = load_blocks(str(blocks_dir), trust_remote_code=True)
    for blocks in (by_module, by_folder):
        assert type(blocks).__name__ == "ToyBlocks"
    index = tmp_path / "saved"
    index.mkdir()
    (index / "modular_model_index.json").write_text(json.dumps({"_blocks_class_name": "QwenImageAutoBlocks"}))
    assert type(load_blocks(str(index))).__name__ == "QwenImageAutoBlocks"  # names a diffusers class: no trust needed


def test_real_qwen_image_blocks_give_the_img2img_training_path():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        pipeline = ug.load_pipeline("diffusers:QwenImageAutoBlocks", provided=["prompt", "image"])
    assert [u.name for u in pipeline.units] == [
        "text_encoder.text_encoder",
        "vae_encoder.img2img.preprocess",
        "vae_encoder.img2img.encode",
        "denoise.img2img.input.text_inputs",
        "denoise.img2img.input.additional_inputs",
        "denoise.img2img.prepare_latents",
        "denoise.img2img.set_timesteps",
        "denoise.img2img.prepare_img2img_latents",
        "denoise.img2img.prepare_rope_inputs",
    ]
    assert pipeline.sink.models == ("transformer",)
    assert {"prompt_embeds", "img_shapes", "timesteps", "latents", "image_latents"} <= set(pipeline.sink.inputs)
    by = units(pipeline)
    assert by["text_encoder.text_encoder"].models == ("text_encoder",)
    assert not by["denoise.img2img.prepare_latents"].deterministic
    assert by["vae_encoder.img2img.encode"].deterministic  # Qwen-Image encodes the posterior mode (argmax)
    plan = ug.split(pipeline, ["text_encoder"], "transformer", provided=["prompt", "image"])
    assert ug.verify(pipeline, plan) == []
    assert plan.data_process_models == ["vae"]


def run_main(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_cli_plan_inspect_verify_and_notes(blocks_dir, tmp_path, capsys):
    ref = "diffusers:toy_blocks:ToyBlocks"
    plan_file = tmp_path / "plan.json"
    code, out, err = run_main(capsys, "plan", ref, "--source", str(blocks_dir), "--with", "prompt,image",
                              "--lora-base-model", "transformer", "-o", str(plan_file), "--trust-remote-code")
    assert code == 0, err
    assert "note: diffusers: the sink (the loss) is the denoiser block denoise" in err
    assert json.loads(plan_file.read_text())["provided"] == ["image", "prompt"]
    # verify resolves the blocks with the plan's provided params, as plan did
    code, out, err = run_main(capsys, "verify", ref, str(plan_file), "--source", str(blocks_dir), "--trust-remote-code")
    assert code == 0, out + err
    code, out, err = run_main(capsys, "inspect", f"diffusers:{blocks_dir}", "--lora-base-model", "transformer", "-f", "mermaid",
                              "--trust_remote_code")
    assert code == 0, err
    assert "vae_encoder.inpaint.encode" in out and "note: diffusers: no --with given" in err


def test_cli_errors_are_one_line(capsys, tmp_path):
    code, _, err = run_main(capsys, "plan", "diffusers:QwenImageAutoBlock")
    assert code == 2
    assert "has no modular blocks class 'QwenImageAutoBlock'; did you mean QwenImageAutoBlocks" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_main(capsys, "plan", f"diffusers:{tmp_path}/nothing")
    assert code == 2 and "no such folder" in err
    code, _, err = run_main(capsys, "plan", "diffusers:no_such_module_xyz:Blocks")
    assert code == 2 and "cannot import 'no_such_module_xyz'" in err


def test_adapters_import_neither_torch_nor_diffusers():
    code = ("import sys, unitgraph.adapters.diffusers_modular, unitgraph.adapters.diffsynth, unitgraph.audit; "
            "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

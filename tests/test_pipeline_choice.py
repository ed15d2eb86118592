"""Which pipeline a run trains when --pipeline is not given (backends/diffusion/choice.py), and the line saying why.

The signals: the model ids a family declares (DiffSynth's commands name them), the class of a --model_paths
folder's model_index.json or of a component's config.json, and the dataset's columns and --extra_inputs (a
tie-breaker between a family's pipelines, or the only signal). Two families named is one error line. The model
ids below are those DiffSynth-Studio's training examples pass (examples/*/model_training/lora/*.sh).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clitools import cli, one_error_line
from unitgraph.backends.diffusion.args import make_args
from unitgraph.backends.diffusion.choice import choose
from unitgraph.backends.diffusion.errors import BackendError
from unitgraph.backends.diffusion.registry import default_family

FLUX_DEV = ("black-forest-labs/FLUX.1-dev:flux1-dev.safetensors,black-forest-labs/FLUX.1-dev:text_encoder/model.safetensors,"
            "black-forest-labs/FLUX.1-dev:text_encoder_2/*.safetensors,black-forest-labs/FLUX.1-dev:ae.safetensors")
FLUX_KONTEXT = ("black-forest-labs/FLUX.1-Kontext-dev:flux1-kontext-dev.safetensors,"
                "black-forest-labs/FLUX.1-dev:text_encoder/model.safetensors,"
                "black-forest-labs/FLUX.1-dev:text_encoder_2/*.safetensors,black-forest-labs/FLUX.1-dev:ae.safetensors")
WAN_T2V = ("Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth,"
           "Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth")
WAN_I2V = ("Wan-AI/Wan2.1-I2V-14B-480P:diffusion_pytorch_model*.safetensors,"
           "Wan-AI/Wan2.1-I2V-14B-480P:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-I2V-14B-480P:Wan2.1_VAE.pth,"
           "Wan-AI/Wan2.1-I2V-14B-480P:models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
WAN_DIFFUSERS = ",".join(f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers:{sub}/*.safetensors" for sub in ("transformer", "text_encoder", "vae"))
QWEN = "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,Qwen/Qwen-Image:text_encoder/model*.safetensors"
QWEN_EDIT = ("Qwen/Qwen-Image-Edit:transformer/diffusion_pytorch_model*.safetensors,"
             "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors")
QWEN_EDIT_2509 = QWEN_EDIT.replace("Qwen-Image-Edit:", "Qwen-Image-Edit-2509:")


def metadata(folder: Path, *columns: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "metadata.csv"
    path.write_text(",".join(columns) + "\n" + ",".join("x" for _ in columns) + "\n")
    return str(path)


def component(folder: Path, **config) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("ids, task, expected, because", [
    (FLUX_DEV, "sft", "flux", "the model id black-forest-labs/FLUX.1-dev"),
    # the DiT's repository names the pipeline; the text encoders' and the VAE's (FLUX.1-dev) only the family
    (FLUX_KONTEXT, "sft", "flux_kontext", "the model id black-forest-labs/FLUX.1-Kontext-dev"),
    (WAN_T2V, "sft", "wan", "the model id Wan-AI/Wan2.1-T2V-1.3B"),
    (WAN_I2V, "sft", "wan_i2v", "the model id Wan-AI/Wan2.1-I2V-14B-480P"),
    (WAN_DIFFUSERS, "sft", "wan", "the model id Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    (QWEN, "sft", "qwen_image", "the model id Qwen/Qwen-Image"),
    (QWEN_EDIT, "sft", "qwen_image_edit", "the model id Qwen/Qwen-Image-Edit"),
    (QWEN_EDIT_2509, "sft", "qwen_image_edit_plus", "the model id Qwen/Qwen-Image-Edit-2509"),
    (QWEN, "direct_distill", "qwen_image_distill", "the model id Qwen/Qwen-Image"),  # the family's pipeline of the task
])
def test_the_model_ids_choose_the_pipeline(ids, task, expected, because):
    chosen = choose(make_args(model_id_with_origin_paths=ids, task=task, lora_base_model="dit"))
    assert chosen.pipeline.name == expected
    assert chosen.line == f"pipeline: {expected} ({because})"


def test_a_component_folders_class_chooses_the_family(tmp_path):
    # no model_index.json: the class a component's config.json names, the denoiser's or another model's
    dit = component(tmp_path / "transformer", _class_name="FluxTransformer2DModel")
    assert choose(make_args(model_paths=dit, lora_base_model="dit")).line == (
        f"pipeline: flux (the class FluxTransformer2DModel in {tmp_path / 'transformer' / 'config.json'}; "
        "flux's first pipeline for --task sft)")
    vae = component(tmp_path / "vae", _class_name="AutoencoderKLWan")
    assert choose(make_args(model_paths=vae, lora_base_model="dit")).pipeline.name == "wan"
    t5 = component(tmp_path / "umt5", architectures=["UMT5EncoderModel"], model_type="umt5")
    chosen = choose(make_args(model_paths=json.dumps([t5]), lora_base_model="dit"))
    assert chosen.pipeline.name == "wan" and "the class UMT5EncoderModel" in chosen.reason
    # a class of no family's says nothing: the first registered family
    other = component(tmp_path / "unet", _class_name="UNet2DConditionModel")
    chosen = choose(make_args(model_paths=other, lora_base_model="dit"))
    assert chosen.family is default_family() and "nothing in the command names a model family" in chosen.reason


def test_the_datasets_columns_break_a_tie_or_decide_alone(tmp_path):
    qwen_dit = component(tmp_path / "qwen" / "transformer", _class_name="QwenImageTransformer2DModel")
    edit = metadata(tmp_path / "edit", "image", "edit_image", "prompt")
    # a column counts when the command hands it to the pipeline, as DiffSynth's edit commands do
    chosen = choose(make_args(model_paths=qwen_dit, dataset_metadata_path=edit, lora_base_model="dit"))
    assert chosen.pipeline.name == "qwen_image"
    chosen = choose(make_args(model_paths=qwen_dit, dataset_metadata_path=edit, extra_inputs="edit_image",
                              lora_base_model="dit"))
    assert chosen.pipeline.name == "qwen_image_edit"
    assert chosen.reason == (f"the class QwenImageTransformer2DModel in {tmp_path / 'qwen' / 'transformer' / 'config.json'}; "
                             "the metadata column edit_image")
    # a model id naming a pipeline outweighs the columns
    chosen = choose(make_args(model_id_with_origin_paths=QWEN, dataset_metadata_path=edit, lora_base_model="dit"))
    assert chosen.pipeline.name == "qwen_image"
    # --extra_inputs naming a pipeline's derived input (DiffSynth's input_image): Wan's image-to-video
    wan_dit = component(tmp_path / "wan" / "transformer", _class_name="WanTransformer3DModel")
    videos = metadata(tmp_path / "videos", "video", "prompt")
    chosen = choose(make_args(model_paths=wan_dit, dataset_metadata_path=videos, extra_inputs="input_image",
                              lora_base_model="dit"))
    assert chosen.pipeline.name == "wan_i2v" and chosen.reason.endswith("; --extra_inputs input_image")
    # nothing names a model: a video column fits the video families' pipelines only, the first registered of them
    chosen = choose(make_args(dataset_metadata_path=videos, lora_base_model="dit"))
    assert chosen.pipeline.name == "wan" and chosen.line.startswith("pipeline: wan (the metadata column video: no model "
                                                                    "names a family; the first registered of wan, ")
    assert chosen.line.endswith("whose pipelines fit the data; --pipeline NAME chooses another)")
    kontext = metadata(tmp_path / "kontext", "image", "kontext_images", "prompt")
    assert choose(make_args(dataset_metadata_path=kontext, lora_base_model="dit")).family is default_family()
    chosen = choose(make_args(dataset_metadata_path=kontext, extra_inputs="kontext_images", lora_base_model="dit"))
    assert chosen.line == ("pipeline: flux_kontext (the metadata column kontext_images: no model names a family, and "
                           "only flux's pipelines read it)")
    # image and prompt fit several families: the first registered
    plain = metadata(tmp_path / "plain", "image", "prompt")
    assert choose(make_args(dataset_metadata_path=plain, lora_base_model="dit")).family is default_family()
    # a cache (stage 2) has no metadata: the models alone
    assert choose(make_args(model_paths=wan_dit, task="sft:train", lora_base_model="dit")).pipeline.name == "wan"


def test_pipeline_overrides_every_signal(tmp_path):
    chosen = choose(make_args(pipeline="wan", model_id_with_origin_paths=FLUX_DEV, lora_base_model="dit"))
    assert chosen.line == "pipeline: wan (--pipeline wan)"


def test_two_families_named_is_one_line_naming_both(tmp_path, capsys):
    with pytest.raises(BackendError) as exc:
        choose(make_args(model_id_with_origin_paths=f"{FLUX_DEV},{WAN_DIFFUSERS}", lora_base_model="dit"))
    line = exc.value.one_line()
    assert "\n" not in line and "--pipeline" in line
    assert "the model id black-forest-labs/FLUX.1-dev names flux" in line
    assert "the model id Wan-AI/Wan2.1-T2V-1.3B-Diffusers names wan" in line
    # a component's class against a model id
    vae = component(tmp_path / "vae", _class_name="AutoencoderKLWan")
    with pytest.raises(BackendError, match=r"the class AutoencoderKLWan in .* names wan, the model id "
                                           r"Qwen/Qwen-Image names qwen_image\); pass --pipeline"):
        choose(make_args(model_paths=vae, model_id_with_origin_paths=QWEN, lora_base_model="dit"))
    # the models name one family, the dataset fits only another's pipelines
    videos = metadata(tmp_path / "videos", "video", "prompt")
    with pytest.raises(BackendError, match=r"the model id black-forest-labs/FLUX.1-dev names flux, but the metadata's "
                                           r"columns \(prompt, video\) fit only wan, wan_i2v, wan_ti2v\b[^;]*; pass --pipeline"):
        choose(make_args(model_id_with_origin_paths=FLUX_DEV, dataset_metadata_path=videos, lora_base_model="dit"))
    # through the command: exit code 2, one line, nothing written
    code, _, err = cli(capsys, "train", "--model_id_with_origin_paths", f"{FLUX_DEV},{WAN_DIFFUSERS}",
                       "--lora_base_model", "dit", "--dataset_base_path", str(tmp_path),
                       "--output_path", str(tmp_path / "out"))
    one_error_line(code, err, "names flux", "names wan", "--pipeline")
    assert not (tmp_path / "out").exists()


def test_the_run_config_holds_the_line_and_notes_it_first(tmp_path):
    from unitgraph.backends.diffusion.config import RunConfig

    cfg = RunConfig.from_args(make_args(model_id_with_origin_paths=FLUX_DEV, lora_base_model="dit",
                                        dataset_base_path=str(tmp_path)))
    assert cfg.pipeline.name == "flux" and cfg.choice == "pipeline: flux (the model id black-forest-labs/FLUX.1-dev)"
    assert cfg.notes[0] == cfg.choice

"""A command of a DiffSynth family unitgraph does not train is named as such in one line, before any download is
tried (backends/diffusion/untrained.py and choice.py)."""

from __future__ import annotations

import json
import shlex

import pytest

from clitools import cli, one_error_line
from unitgraph.backends.diffusion.registry import families
from unitgraph.backends.diffusion.untrained import UNTRAINED, untrained_by_model_id

# DiffSynth's examples/hidream_o1_image/model_training/lora/HiDream-O1-Image-Dev.sh, the program name swapped
HIDREAM_LORA = """unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/hidream_o1_image/HiDream-O1-Image-Dev \
  --dataset_metadata_path data/diffsynth_example_dataset/hidream_o1_image/HiDream-O1-Image-Dev/metadata.csv \
  --max_pixels 4194304 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "HiDream-ai/HiDream-O1-Image-Dev:model-*.safetensors" \
  --processor_config "HiDream-ai/HiDream-O1-Image-Dev:./" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --lora_rank 32 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/HiDream-O1-Image-Dev_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,attn.qkv,attn.proj,mlp.linear_fc1,mlp.linear_fc2" \
  --use_gradient_checkpointing \
  --noise_scale 7.5"""


@pytest.fixture
def no_download(monkeypatch):
    """modelscope's download, replaced by a record of its calls: none may happen."""
    import modelscope

    calls = []
    monkeypatch.setattr(modelscope, "snapshot_download", lambda *a, **k: calls.append((a, k)) or "/nowhere")
    return calls


def test_diffsynths_hidream_command_is_named_as_untrained_before_any_download(tmp_path, monkeypatch, capsys,
                                                                             no_download):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data" / "diffsynth_example_dataset" / "hidream_o1_image" / "HiDream-O1-Image-Dev"
    data.mkdir(parents=True)
    (data / "metadata.csv").write_text("image,prompt\n0.jpg,a cat\n")
    argv = shlex.split(HIDREAM_LORA)[1:]
    code, _, err = cli(capsys, *argv)  # as it is: its flags of HiDream's alone say it first
    one_error_line(code, err, "--noise_scale: a flag of DiffSynth's HiDream-O1-Image, which unitgraph does not train")
    for flag in ("--processor_config", "--noise_scale"):  # without them, its model id does
        at = argv.index(flag)
        del argv[at:at + 2]
    for extra in ([], ["--dry_run"]):
        code, _, err = cli(capsys, *argv, *extra)
        line = one_error_line(code, err, "HiDream-ai/HiDream-O1-Image-Dev",
                              "HiDream-O1-Image (DiffSynth's examples/hidream_o1_image)",
                              "a family unitgraph does not train", "Qwen-Image")
        assert "unitgraph pipelines" in line
    assert no_download == [] and not (tmp_path / "models").exists()


def test_a_folder_of_a_class_no_family_loads_is_one_line_naming_the_class(tmp_path, capsys, no_download):
    folder = tmp_path / "ERNIE-Image"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ErnieImagePipeline",
                                                         "transformer": ["diffusers", "ErnieImageTransformer2DModel"]}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": "ErnieImageTransformer2DModel"}))
    for given in (folder, folder / "transformer"):
        code, _, err = cli(capsys, "train", "--model_paths", str(given), "--dataset_base_path", str(tmp_path),
                           "--lora_base_model", "dit", "--output_path", str(tmp_path / "out"))
        class_name = "ErnieImagePipeline" if given == folder else "ErnieImageTransformer2DModel"
        one_error_line(code, err, f"names the diffusers class {class_name}", "no family of unitgraph loads",
                       "--pipeline NAME")
    assert not (tmp_path / "out").exists() and no_download == []


def test_no_untrained_model_id_is_a_trained_familys():
    for untrained in UNTRAINED:
        for known in untrained.model_ids:
            model_id = known + "x" if known.endswith(("/", "-")) else known
            assert untrained_by_model_id(model_id) is untrained
            assert all(family.repo(model_id) is None for family in families()), model_id
    assert len({u.folder for u in UNTRAINED}) == len(UNTRAINED)
    assert untrained_by_model_id("ACE-Step/acestep-v15-xl-sft").name == "ACE-Step"  # an organisation's prefix
    assert untrained_by_model_id("krea/krea-realtime-video") is None  # a Wan model: krea's prefix is Krea-2 only
    assert untrained_by_model_id("Qwen/Qwen-Image") is None


IDEOGRAM4_IDS = ("DiffSynth-Studio/ideogram-4-bf16-repackage:transformer/diffusion_pytorch_model.safetensors,"
                 "DiffSynth-Studio/ideogram-4-bf16-repackage:text_encoder/model.safetensors")


def test_a_family_trained_through_diffsynth_names_the_extra_where_diffsynth_is_missing(tmp_path, capsys, no_download):
    """Ideogram 4, ERNIE-Image, Boogu-Image, JoyAI-Image and Krea 2 train through DiffSynth's own pipeline (docs/diffsynth.md); in an
    environment without the `diffsynth` package their model ids, or --pipeline diffsynth:ideogram4, are one line
    saying what to install."""
    import importlib.util

    if importlib.util.find_spec("diffsynth") is not None:
        pytest.skip("DiffSynth-Studio is installed here (tests/test_diffsynth_source.py runs these pipelines)")
    base = ["train", "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--output_path",
            str(tmp_path / "out")]
    code, _, err = cli(capsys, *base, "--model_id_with_origin_paths", IDEOGRAM4_IDS)
    one_error_line(code, err, "is Ideogram 4, which unitgraph trains through DiffSynth's own pipeline",
                   "--pipeline diffsynth:ideogram4", "scripts/setup_diffsynth.sh")
    for ids, name, module in (("PaddlePaddle/ERNIE-Image:text_encoder/model.safetensors", "ERNIE-Image", "ernie_image"),
                              ("Boogu/Boogu-Image-0.1-Base:mllm/*.safetensors", "Boogu-Image", "boogu_image"),
                              ("jd-opensource/JoyAI-Image-Edit:transformer/transformer.pth", "JoyAI-Image",
                               "joyai_image"),
                              ("krea/Krea-2-Raw:raw.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors",
                               "Krea 2", "krea2")):
        code, _, err = cli(capsys, *base, "--model_id_with_origin_paths", ids)
        one_error_line(code, err, f"is {name}, which unitgraph trains through DiffSynth's own pipeline",
                       f"--pipeline diffsynth:{module}", "scripts/setup_diffsynth.sh")
    code, _, err = cli(capsys, *base, "--pipeline", "diffsynth:ideogram4")
    one_error_line(code, err, "--pipeline diffsynth:ideogram4 runs DiffSynth-Studio's own pipeline",
                   "DiffSynth-Studio is not installed here")
    assert no_download == [] and not (tmp_path / "out").exists()

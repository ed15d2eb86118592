"""A command of a DiffSynth family unitgraph does not train is named as such in one line, before any download is
tried (backends/diffusion/untrained.py and choice.py)."""

from __future__ import annotations

import json
import shlex

import pytest

from clitools import cli, one_error_line
from unitgraph.backends.diffusion.registry import families
from unitgraph.backends.diffusion.untrained import UNTRAINED, untrained_by_model_id

# DiffSynth's examples/minimax_h3/model_training/lora/MiniMax-H3-FL2VA.sh, its first command (T2VA, stage 1), the
# program name swapped
MINIMAX_STAGE_1 = """unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/minimax_h3/MiniMax-H3-FL2VA \
  --dataset_metadata_path data/diffsynth_example_dataset/minimax_h3/MiniMax-H3-FL2VA/metadata.csv \
  --data_file_keys "video,input_audio" \
  --extra_inputs "input_audio" \
  --height 480 \
  --width 832 \
  --num_frames 124 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "MiniMax/MiniMax-H3:FL2VA/text_encoder/model*.safetensors,MiniMax/MiniMax-H3:FL2VA/video_vae/source/model.safetensors,MiniMax/MiniMax-H3:FL2VA/audio_vae/model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 1 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/MiniMax-H3-T2VA-split-cache" \
  --lora_base_model "dit" \
  --lora_target_modules "attn.qkv_proj,attn.out_proj,mlp.fc1,mlp.fc2" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --task sft:data_process"""


@pytest.fixture
def no_download(monkeypatch):
    """modelscope's download, replaced by a record of its calls: none may happen."""
    import modelscope

    calls = []
    monkeypatch.setattr(modelscope, "snapshot_download", lambda *a, **k: calls.append((a, k)) or "/nowhere")
    return calls


def test_diffsynths_minimax_h3_command_is_named_as_untrained_before_any_download(tmp_path, monkeypatch, capsys,
                                                                                no_download):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data" / "diffsynth_example_dataset" / "minimax_h3" / "MiniMax-H3-FL2VA"
    data.mkdir(parents=True)
    (data / "metadata.csv").write_text("video,input_audio,prompt\n0.mp4,0.wav,a cat\n")
    argv = shlex.split(MINIMAX_STAGE_1)[1:]
    for extra in ([], ["--dry_run"]):  # as it is: its model id says it
        code, _, err = cli(capsys, *argv, *extra)
        line = one_error_line(code, err, "MiniMax/MiniMax-H3", "MiniMax-H3 (DiffSynth's examples/minimax_h3)",
                              "a family unitgraph does not train", "Qwen-Image")
        assert "unitgraph pipelines" in line
    at = argv.index("--model_id_with_origin_paths")  # its model id says it before its flags; without it, a flag of
    del argv[at:at + 2]                                # MiniMax-H3's alone does
    code, _, err = cli(capsys, *argv, "--silent_on_missing_audio")
    one_error_line(code, err, "--silent_on_missing_audio: a flag of DiffSynth's MiniMax-H3, which unitgraph does not "
                              "train")
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
    """Ideogram 4, ERNIE-Image, Boogu-Image, JoyAI-Image, HiDream-O1-Image and Krea 2 train through DiffSynth's own pipeline (docs/diffsynth.md); in an
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
                              ("HiDream-ai/HiDream-O1-Image-Dev:model-*.safetensors", "HiDream-O1-Image",
                               "hidream_o1_image"),
                              ("krea/Krea-2-Raw:raw.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors",
                               "Krea 2", "krea2")):
        code, _, err = cli(capsys, *base, "--model_id_with_origin_paths", ids)
        one_error_line(code, err, f"is {name}, which unitgraph trains through DiffSynth's own pipeline",
                       f"--pipeline diffsynth:{module}", "scripts/setup_diffsynth.sh")
    code, _, err = cli(capsys, *base, "--pipeline", "diffsynth:ideogram4")
    one_error_line(code, err, "--pipeline diffsynth:ideogram4 runs DiffSynth-Studio's own pipeline",
                   "DiffSynth-Studio is not installed here")
    assert no_download == [] and not (tmp_path / "out").exists()

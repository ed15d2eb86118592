"""Inputs that would allocate without limit are refused in one line before anything is allocated (docs/safety.md):
a model config past any model's size, video frames past the pixel limit images have, a LoRA rank no layer can use."""

from __future__ import annotations

import json
import re
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("av")

from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import DiffusionDataset, SampleError, write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.data.video import VideoProblem, read_clip  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.models.folders import (MAX_LAYERS, ModelLoadError, check_config_sizes,  # noqa: E402
                                                         config_size_problem)
from unitgraph.backends.diffusion.stages import run  # noqa: E402


def quiet(_text: str) -> None:
    pass


@pytest.mark.parametrize("config, fragment", [
    ({"num_layers": 100000}, "num_layers 100000 is more layers"),
    ({"text_config": {"num_hidden_layers": 5000}}, "text_config.num_hidden_layers 5000"),
    ({"hidden_size": 10**7}, "hidden_size 10000000 is wider"),
    ({"block_out_channels": [128, 10**6]}, "block_out_channels 1000000 is wider"),
    ({"vocab_size": 10**9}, "vocab_size 1000000000 is a larger vocabulary"),
])
def test_a_config_past_any_models_size_is_named(config, fragment):
    assert fragment in config_size_problem(config)


def test_released_sizes_pass():
    assert config_size_problem({"num_layers": 60, "attention_head_dim": 128, "num_attention_heads": 24,
                                "joint_attention_dim": 3584, "vocab_size": 256384, "d_ff": 10240,
                                "block_out_channels": [128, 256, 512, 512], "use_bias": True}) is None


def test_a_huge_config_is_refused_before_a_layer_is_built(tiny, tmp_path, capsys):
    from clitools import cli, one_error_line

    models = tmp_path / "models"
    shutil.copytree(tiny, models)
    config = json.loads((models / "transformer" / "config.json").read_text())
    config["num_layers"] = 100000
    (models / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"at most {MAX_LAYERS}"):
        check_config_sizes(models / "transformer")
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=0)
    code, _, err = cli(capsys, "train", "--task", "sft", "--model_paths", str(models), "--dataset_base_path", str(data),
                       "--dataset_metadata_path", str(data / "metadata.csv"), "--lora_base_model", "dit",
                       "--max_pixels", "1024", "--output_path", str(tmp_path / "out"), "--no-progress")
    one_error_line(code, err, "transformer/config.json", "num_layers 100000")
    assert not (tmp_path / "out").exists()


def test_video_frames_past_the_pixel_limit_are_refused_before_decoding(tmp_path, monkeypatch):
    from PIL import Image

    folder = tmp_path / "clips"
    write_synthetic_dataset(folder, count=2, size=64, seed=0, videos=["video"], frames=5)
    clip = next((folder).rglob("*.mp4"))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64 - 1)  # the same check as a 9600 x 9600 frame at the default
    with pytest.raises(VideoProblem, match="64x64 px frames .* more than the 4095 pixels"):
        read_clip(clip, 5)
    dataset = DiffusionDataset(folder, folder / "metadata.csv", ["video", "prompt"], data_file_keys=["video"],
                               required=("video", "prompt"), video_params=("video",), num_frames=5)
    with pytest.raises(SampleError, match="Image.MAX_IMAGE_PIXELS"):
        dataset.check(0)


def test_a_lora_rank_no_targeted_layer_can_use_is_one_line(tiny, tmp_path):
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=0)
    args = make_args(task="sft", model_paths=str(tiny), dataset_base_path=str(data),
                     dataset_metadata_path=str(data / "metadata.csv"), lora_base_model="dit", lora_rank=100000,
                     max_pixels=1024, output_path=str(tmp_path / "out"), progress=False, plot=False)
    with pytest.raises(BackendError, match=r"--lora_rank 100000 is larger than any layer it targets in dit "
                                           r"\(at most \d+"):
        run(args, echo=quiet)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", [-1, 1 << 63, 10**30])
def test_a_seed_out_of_range_is_refused_up_front(seed):
    with pytest.raises(BackendError, match="--seed must be between 0 and"):
        make_args(task="sft", lora_base_model="dit", seed=seed).validate()


def test_a_folder_fifo_or_symlink_loop_is_named_as_what_it_is(tmp_path):
    import os

    folder = tmp_path / "data"
    write_synthetic_dataset(folder, count=4, size=32, seed=0)
    rows = (folder / "metadata.csv").read_text().splitlines()
    (folder / "a_folder").mkdir()
    os.mkfifo(folder / "a_fifo")
    os.symlink(folder / "loop_b", folder / "loop_a")
    os.symlink(folder / "loop_a", folder / "loop_b")
    os.symlink(folder / "nowhere.png", folder / "dangling")
    names = ["a_folder", "a_fifo", "loop_a", "dangling"]
    body = [f"{name},{row.split(',', 1)[1]}" for name, row in zip(names, rows[1:])]
    (folder / "metadata.csv").write_text("\n".join([rows[0], *body]) + "\n")
    dataset = DiffusionDataset(folder, folder / "metadata.csv", ["image", "prompt"])
    expected = ["is a folder, not a file", "is a FIFO (a named pipe), not a file", "cannot be opened",
                "is a symlink to a file that does not exist"]
    for index, fragment in enumerate(expected):
        with pytest.raises(SampleError, match=re.escape(fragment)):
            dataset.check(index)


def test_stage1_refuses_non_finite_outputs_naming_the_unit_and_model(tiny, tmp_path, monkeypatch):
    from diffusers import AutoencoderKLQwenImage

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=0)
    real = AutoencoderKLQwenImage.encode

    def overflowing(self, *a, **k):
        out = real(self, *a, **k)
        out.latent_dist.mean.fill_(float("nan"))
        return out

    monkeypatch.setattr(AutoencoderKLQwenImage, "encode", overflowing)
    args = make_args(task="sft:data_process", model_paths=str(tiny), dataset_base_path=str(data),
                     dataset_metadata_path=str(data / "metadata.csv"), lora_base_model="dit", max_pixels=1024,
                     output_path=str(tmp_path / "cache"), progress=False, plot=False)
    with pytest.raises(BackendError, match=r"unit \w+ \(model: vae\) gave non-finite values in 'latent_mean'"):
        run(args, echo=quiet)


def test_ctrl_c_ends_with_one_line_and_exit_130(capsys, monkeypatch):
    from clitools import cli

    from unitgraph.backends.diffusion import stages

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "run", interrupted)
    code, _, err = cli(capsys, "train", "--task", "sft", "--lora_base_model", "dit")
    assert code == 130 and err.count("\n") == 1 and err.startswith("unitgraph: interrupted;"), err

"""Wan direct distillation (`wan_distill`, DiffSynth's special/direct_distill/Wan2.1-T2V-1.3B.sh): the sampler
schedule is DiffSynth's own, the noise its generate_noise's, and split training is the unsplit run."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("av")

from clitools import cli  # noqa: E402
from diffsynth_wheel import needs_wheel, wheel_modules  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.config import choose_pipeline  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families.wan import units  # noqa: E402


@needs_wheel
@pytest.mark.parametrize("steps", [1, 4, 8])
def test_the_sampler_runs_diffsynths_wan_schedule(steps):
    from dataclasses import replace

    with wheel_modules("_diffsynth_wan_distill", "flow_match") as (flow_match,):
        theirs, _ = flow_match.FlowMatchScheduler.set_timesteps_wan(steps)
    ours = replace(units.TRAINING_SCHEDULE, steps=steps).sigmas()
    assert torch.equal(ours, theirs.to(ours.dtype))


def test_the_noise_is_diffsynths_generate_noise():
    latents = torch.zeros(1, 16, 3, 4, 6, dtype=torch.bfloat16)
    ours = units.seeded_noise.fn(None, latents, 7, "cpu")["noise"]
    theirs = torch.randn((1, 16, 3, 4, 6), generator=torch.Generator("cpu").manual_seed(7), dtype=torch.float32)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs.to(torch.bfloat16))


def test_a_wan_model_id_with_the_distill_task_trains_wan_distill():
    args = make_args(task="direct_distill", model_id_with_origin_paths="Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors",
                     trainable_models="dit")
    assert choose_pipeline(args)[1].name == "wan_distill"


def with_distill_columns(data: Path) -> Path:
    metadata = data / "metadata.csv"
    rows = list(csv.DictReader(metadata.open()))
    for i, row in enumerate(rows):
        row.update(seed=str(10 + i), rand_device="cpu", num_inference_steps="2", cfg_scale="5")
    with metadata.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return metadata


def losses(folder: Path) -> list[str]:
    return [row["loss"] for row in csv.DictReader((folder / "loss.csv").open())]


@pytest.mark.slow
def test_diffsynths_wan_distillation_command_trains_wan_distill(tmp_path, capsys):
    """DiffSynth's command, models given as a diffusers folder (its script names Wan's .pth release files, which are
    pickles): the columns it hands over with --extra_inputs are read, and the run is the direct_distill pipeline.
    Split == unsplit and stage 2 without the encoders are the conformance suite's (tests/test_conformance.py)."""
    from unitgraph.backends.diffusion.families.wan import tiny

    models = tiny.write_tiny_models(tmp_path / "wan", size="test", seed=0, pipeline="wan")
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=5, videos=["video"], frames=5)
    metadata = with_distill_columns(data)
    code, out, err = cli(capsys, "train", "--model_paths", str(models), "--dataset_base_path", str(data),
                         "--dataset_metadata_path", str(metadata), "--extra_inputs",
                         "seed,rand_device,num_inference_steps,cfg_scale", "--trainable_models", "dit", "--task",
                         "direct_distill", "--remove_prefix_in_ckpt", "pipe.dit.", "--num_frames", "5", "--height", "32",
                         "--width", "32", "--learning_rate", "1e-5", "--no-progress", "--no-plot", "--output_path",
                         str(tmp_path / "out"))
    assert code == 0, err
    assert out.startswith("pipeline: wan_distill") or "pipeline: wan_distill" in out.splitlines()[0]
    assert len(losses(tmp_path / "out")) == 2 and all(float(x) > 0 for x in losses(tmp_path / "out"))

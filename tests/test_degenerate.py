"""Degenerate settings are refused in one line rather than trained silently (docs/safety.md): a boundary ratio that
leaves an expert one timestep or none, a resume with fewer epochs than the run it continues made, a resume with other
clips (--num_frames). The zero-sample WAV and the fp16 LoRA overflowing when folded: tests/test_audio_reader.py and
tests/test_bounds.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clitools import cli, one_error_line

torch = pytest.importorskip("torch")

from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.config import RunConfig  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.experts import choose_expert  # noqa: E402
from unitgraph.backends.diffusion.families import wan  # noqa: E402
from unitgraph.backends.diffusion.session import plan_for  # noqa: E402
from unitgraph.backends.diffusion.train.resume import _check_match, must_match  # noqa: E402


def experts_index(folder: Path, ratio: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": ratio, "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"]}))
    return folder


@pytest.mark.parametrize("ratio, starved", [(0.99999, "high_noise"), (1e-6, "low_noise")])
@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_a_ratio_that_leaves_an_expert_one_timestep_or_none_is_refused(tmp_path, ratio, starved, expert):
    folder = experts_index(tmp_path / "a14b", ratio)
    args = make_args(task="sft", pipeline="wan", model_paths=str(folder), lora_base_model="dit", expert=expert)
    with pytest.raises(BackendError, match=rf"boundary_ratio {ratio:g} leaves the {starved} expert [01] of the "
                                           r"schedule's 1000 timesteps"):
        choose_expert(args, wan.FAMILY)
    fine = make_args(task="sft", pipeline="wan", model_paths=str(experts_index(tmp_path / "ok", 0.875)),
                     lora_base_model="dit", expert=expert)
    assert choose_expert(fine, wan.FAMILY).expert == expert


def test_the_clips_length_must_match_where_the_run_reads_clips(tmp_path):
    def match(task: str, pipeline: str, frames: int):
        cfg = RunConfig.from_args(make_args(task=task, pipeline=pipeline, lora_base_model="dit", num_frames=frames,
                                            dataset_base_path=str(tmp_path)))
        return must_match(cfg, plan_for(cfg), 1)

    assert match("sft", "wan", 5)["num_frames"] == 5
    assert match("sft:train", "wan", 5)["num_frames"] is None  # the cache pins the clips (`data`)
    assert match("sft", "qwen_image", 5)["num_frames"] is None  # no clips: old states still match
    old = {**match("sft", "wan", 5), "num_frames": 5}
    with pytest.raises(BackendError, match=r"another num_frames \(5, now 9\).*--num_frames"):
        _check_match(tmp_path, {"match": old}, match("sft", "wan", 9))
    legacy = {k: v for k, v in match("sft", "qwen_image", 5).items() if k != "num_frames"}  # a state made before
    _check_match(tmp_path, {"match": legacy}, match("sft", "qwen_image", 5))


def test_a_resume_with_fewer_epochs_than_the_run_made_is_refused(tiny, tmp_path, capsys):
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=0)
    out = tmp_path / "out"
    flags = ["train", "--task", "sft", "--model_paths", str(tiny), "--dataset_base_path", str(data),
             "--dataset_metadata_path", str(data / "metadata.csv"), "--lora_base_model", "dit", "--lora_rank", "4",
             "--max_pixels", "1024", "--output_path", str(out), "--no-progress", "--no-plot"]
    assert cli(capsys, *flags, "--num_epochs", "2", "--save_total_limit", "0")[0] == 0
    states = sorted((out / "state").iterdir())
    assert [p.name for p in states] == ["step-00000002", "step-00000004"]
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    code, _, err = cli(capsys, *flags, "--num_epochs", "1", "--resume", str(states[0]))
    one_error_line(code, err, "--num_epochs 1", "epoch-1.safetensors", "state/step-00000004")
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before
    assert cli(capsys, *flags, "--num_epochs", "2", "--resume", str(states[0]))[0] == 0  # its own length: continues

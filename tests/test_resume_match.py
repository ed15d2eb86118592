"""A resume that is not the same training is refused, and a refusal changes nothing on disk (docs/safety.md).

A state matches only the training it came from: the data (the dataset's samples, or the cache's entries and the
settings they were made with), the steps an epoch has, the preset LoRA, the validation prompts, and a place in the
run that adds up. A folder whose run saved checkpoints but lost its states is not restarted over them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402

SIZE = 32


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A finished split run (2 epochs, a state at every checkpoint) and its data."""
    root = tmp_path_factory.mktemp("resume-match")
    data = root / "data"
    write_synthetic_dataset(data, count=3, size=SIZE, seed=2)
    return root, data


def argv(tiny: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--task", "sft:split", "--model_paths", str(tiny), "--dataset_base_path", str(data),
            "--dataset_metadata_path", str(data / "metadata.csv"), "--lora_base_model", "dit", "--lora_rank", "4",
            "--max_pixels", str(SIZE * SIZE), "--num_epochs", "2", "--output_path", str(out), "--no-progress",
            "--no-plot", *extra]


def snapshot(folder: Path) -> dict[str, bytes]:
    """The run's files (its cache/ is stage 1's: a :split run may add encoded prompts to it before it trains)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).parts[0] != "cache"}


def fresh_run(tiny, trained, name: str, capsys, *extra: str) -> Path:
    root, data = trained
    out = root / name
    code, _, err = cli(capsys, *argv(tiny, data, out, *extra))
    assert code == 0, err
    return out


@pytest.mark.slow
def test_other_data_another_preset_or_other_prompts_are_refused_and_nothing_changes(tiny, trained, capsys, tmp_path):
    root, data = trained
    out = fresh_run(tiny, trained, "run", capsys)
    before = snapshot(out)
    other = tmp_path / "other-data"
    shutil.copytree(data, other)
    first = sorted((other / "images").iterdir())[0]
    first.write_bytes((other / "images" / sorted(p.name for p in (other / "images").iterdir())[1]).read_bytes())
    code, _, err = cli(capsys, *argv(tiny, other, out, "--resume", "--cache_path", str(tmp_path / "other-cache")))
    one_error_line(code, err, "another data", "state.json")
    assert snapshot(out) == before  # nothing rewritten: not training_args.json, not the marker
    code, _, err = cli(capsys, *argv(tiny, data, out, "--resume", "--validation_prompt", "a red circle"))
    one_error_line(code, err, "another validation_prompts")
    assert snapshot(out) == before
    preset = fresh_run(tiny, trained, "preset-source", capsys, "--num_epochs", "1") / "epoch-0.safetensors"
    code, _, err = cli(capsys, *argv(tiny, data, out, "--resume", "--preset_lora_path", str(preset)))
    one_error_line(code, err, "another preset_lora")
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_state_whose_place_does_not_add_up_or_a_lost_state_folder_is_refused(tiny, trained, capsys):
    out = fresh_run(tiny, trained, "run-progress", capsys)
    state = sorted((out / "state").iterdir())[-1] / "state.json"
    record = json.loads(state.read_text())
    record["epoch"] = 7  # claims epoch 7: the run would "finish" at once
    state.write_text(json.dumps(record))
    before = snapshot(out)
    root, data = trained
    code, _, err = cli(capsys, *argv(tiny, data, out, "--resume", "--num_epochs", "12"))
    one_error_line(code, err, "does not add up", "state.json")
    assert snapshot(out) == before
    shutil.rmtree(out / "state")
    before = snapshot(out)
    code, _, err = cli(capsys, *argv(tiny, data, out, "--resume"))
    one_error_line(code, err, "no training state is left", "--overwrite")
    assert snapshot(out) == before


@pytest.mark.slow
def test_the_same_training_still_resumes(tiny, trained, capsys):
    out = fresh_run(tiny, trained, "run-again", capsys, "--num_epochs", "1")
    root, data = trained
    code, stdout, err = cli(capsys, *argv(tiny, data, out, "--resume"))  # 2 epochs now: the second is trained
    assert code == 0, err
    assert "resuming from" in stdout
    rows = (out / "loss.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 3

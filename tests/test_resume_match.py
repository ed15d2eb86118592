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


def test_another_number_of_processes_continues_only_from_an_epochs_end_and_never_under_deepspeed(tmp_path):
    """A state two processes made continues on one when every tensor in it is whole (data parallel, FSDP2) and
    its epoch is finished; within an epoch, or under DeepSpeed (a partition of AdamW's state per process), it is
    one line saying how to go on. The steps then add up with the new count (`reshard_offset`)."""
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.train.resume import (ResumePoint, _check_match, check_progress,
                                                             reshard_offset)

    match = {"processes": 1, "steps_per_epoch": 4, "engine": None, "seed": 3}
    record = {"match": {**match, "processes": 2, "steps_per_epoch": 2}, "position": 2, "epoch": 0}
    _check_match(tmp_path, record, match)  # data parallel, at the epoch's end
    _check_match(tmp_path, {**record, "match": {**record["match"], "engine": "FSDP2"}}, {**match, "engine": "FSDP2"})
    with pytest.raises(BackendError) as err:
        _check_match(tmp_path, {**record, "position": 1}, match)
    assert "only from the end of an epoch" in str(err.value) and "1 of 2 steps into epoch 0" in str(err.value)
    deepspeed = {**match, "engine": "DeepSpeed ZeRO-3"}
    with pytest.raises(BackendError) as err:
        _check_match(tmp_path, {**record, "match": {**record["match"], "engine": "DeepSpeed ZeRO-3"}}, deepspeed)
    assert "resumes on 2 processes only" in str(err.value)
    with pytest.raises(BackendError) as err:  # another engine as well: that is what is named
        _check_match(tmp_path, record, {**match, "engine": "FSDP2"})
    assert "another processes (2, now 1)" in str(err.value)
    with pytest.raises(BackendError) as err:  # everything else must still match
        _check_match(tmp_path, record, {**match, "seed": 4})
    assert "another seed" in str(err.value)
    rows = [[1, 0, 1.0, 0.1, 500.0], [2, 0, 1.0, 0.2, 500.0]]
    point = ResumePoint(path=tmp_path, step=2, epoch=0, position=2, elapsed=0.2, rows=rows, per_epoch=2, processes=2,
                        epoch_done=True)
    offset = check_progress(tmp_path, point, 4, 2).offset
    assert offset == reshard_offset(point, 4) == -2  # 2 steps made, where one process would have made 4 for epoch 0
    rows = [[n + 1, 0 if n < 2 else 1, 1.0, 0.1, 500.0] for n in range(6)]
    later = ResumePoint(path=tmp_path, step=6, epoch=1, position=4, elapsed=1.0, rows=rows, offset=offset, per_epoch=4,
                        processes=1, epoch_done=True)
    assert check_progress(tmp_path, later, 4, 3) == later  # the state the continued run saves: -2 + 1 x 4 + 4 = 6

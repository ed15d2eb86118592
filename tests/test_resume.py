"""Stage 2 (and unsplit training) survive SIGKILL: `--resume` continues to the same losses and weights.

Each case runs the real `unitgraph train` command: once uninterrupted, then killed (SIGKILL) at random
moments after it has saved a state and restarted with `--resume` until it finishes. The resumed run's
loss.csv rows and final checkpoint must equal the uninterrupted run's (within 1e-6).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models  # noqa: E402
from unitgraph.backends.diffusion.train.resume import STATE_DIR, states  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

VENV_BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
SIZE = 32
LAUNCH2 = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    models = write_tiny_models(root / "models", size="test", seed=0)
    data = root / "data"
    write_synthetic_dataset(data, count=4, size=SIZE, seed=7)
    return models, data, root


def argv(models: Path, data: Path, out: Path, task: str, **extra) -> list[str]:
    base = ["train", "--task", task, "--model_paths", str(models), "--lora_base_model", "dit", "--lora_rank", "4",
            "--max_pixels", str(SIZE * SIZE), "--num_epochs", "2", "--save_steps", "1", "--learning_rate", "1e-3",
            "--output_path", str(out), "--no-progress", "--no-plot", "--seed", "3"]
    if task.endswith(":train"):
        base += ["--dataset_base_path", extra.pop("cache")]
    else:
        base += ["--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv")]
    for key, value in extra.items():
        base += [f"--{key}", str(value)]
    return base


def command(processes: int) -> list[str]:
    return [*(LAUNCH2 if processes == 2 else []), str(VENV_BIN / "unitgraph")]


def killed_and_resumed(cmd: list[str], out: Path, kills: int, rng: random.Random) -> tuple[int, str]:
    """Run `cmd`, SIGKILL it at random moments once it has saved a state, each time restart with --resume;
    (how many times it was killed, what the last process printed)."""
    done = 0
    for attempt in range(kills + 1):
        full = cmd + (["--resume"] if attempt else [])
        process = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                                   start_new_session=True)
        if attempt < kills:
            before = len(states(out))
            deadline = time.time() + 120
            while time.time() < deadline and process.poll() is None and len(states(out)) <= before:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.6))  # anywhere: mid-step, mid-write of a checkpoint or a state
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                done += 1
                continue
        out_text, err = process.communicate(timeout=300)
        assert process.returncode == 0, err.decode(errors="replace")[-3000:]
        return done, out_text.decode(errors="replace")
    return done, ""


def assert_same(a: Path, b: Path) -> None:
    ra, rb = read_loss_csv(a / "loss.csv"), read_loss_csv(b / "loss.csv")
    assert [(r["step"], r["epoch"]) for r in ra] == [(r["step"], r["epoch"]) for r in rb] and ra
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], abs=1e-6, rel=0)
    wa, wb = load_file(str(a / "epoch-1.safetensors")), load_file(str(b / "epoch-1.safetensors"))
    assert set(wa) == set(wb)
    for key in wa:
        assert torch.allclose(wa[key], wb[key], atol=1e-6, rtol=0), key
    assert not [p for p in b.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp-")]


# Every task at 1 process; at 2 processes the split task, whose run is both stages (the kills land in either)
# and which renders validation samples: the resume code that differs with processes (the barrier before a
# state is kept, each rank's place in its shard of the epoch) is the same for every task.
CASES = [("sft", 1), ("sft:train", 1), ("sft:split", 1), ("sft:split", 2)]
# the 2-process split run also renders validation samples, so resuming is tested with them too
VALIDATION = {"validation_prompt": "a red square", "validation_steps": 2, "validation_inference_steps": 2}


@pytest.fixture(scope="module")
def references(setup, tmp_path_factory):
    """The uninterrupted unsplit run at 1 and at 2 processes, made once: split training equals unsplit
    training, so it is the reference for every task at that process count."""
    models, data, _ = setup
    made: dict[int, Path] = {}

    def reference(processes: int) -> Path:
        if processes not in made:
            out = tmp_path_factory.mktemp(f"whole-{processes}proc") / "whole"
            if processes == 1:  # in this process
                from unitgraph.cli.app import main

                with pytest.raises(SystemExit) as exc:
                    main(argv(models, data, out, "sft"))
                assert not exc.value.code
            else:
                done = subprocess.run(command(processes) + argv(models, data, out, "sft"), capture_output=True,
                                      text=True, env=ENV, timeout=400)
                assert done.returncode == 0, done.stderr[-3000:]
            made[processes] = out
        return made[processes]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize("task, processes", CASES, ids=[f"{t}-{n}proc" for t, n in CASES])
def test_sigkill_and_resume_gives_the_uninterrupted_training(setup, references, tmp_path, task, processes, capsys):
    models, data, root = setup
    extra: dict[str, object] = {}
    if task == "sft:train":
        cache = root / "cache"
        if not (cache / "manifest.json").is_file():
            code, _, err = cli(capsys, "train", "--task", "sft:data_process", "--model_paths", str(models),
                               "--lora_base_model", "dit", "--max_pixels", str(SIZE * SIZE), "--dataset_base_path",
                               str(data), "--dataset_metadata_path", str(data / "metadata.csv"), "--output_path",
                               str(cache), "--no-progress", "--seed", "3")
            assert code == 0, err
        extra["cache"] = str(cache)
    validating = (task, processes) == ("sft:split", 2)
    if validating:
        extra.update(VALIDATION)
    whole, resumed = references(processes), tmp_path / "resumed"
    rng = random.Random(f"{task}-{processes}")
    kills, printed = killed_and_resumed(command(processes) + argv(models, data, resumed, task, save_total_limit=2,
                                                                  **extra),
                                        resumed, kills=2 if (task, processes) == ("sft:split", 1) else 1, rng=rng)
    assert kills >= 1, "the run finished before it could be killed"
    assert "resuming from" in printed and "step 0" not in printed, printed  # it continued, it did not start over
    assert_same(whole, resumed)
    assert len(states(resumed)) <= 2  # --save_total_limit 2
    if validating:  # every validation point has its sample and contact sheet, across the kills, on the page
        steps = [r["step"] for r in read_loss_csv(resumed / "loss.csv") if r["step"] % 2 == 0]
        page = (resumed / "samples.html").read_text()
        for step in steps:
            assert [p.name for p in (resumed / "samples" / f"step-{step}").iterdir()] == ["0.png"]
            assert (resumed / "samples" / f"step-{step}.png").is_file()  # the contact sheet
            assert f"samples/step-{step}/0.png" in page


def test_a_state_of_another_training_is_refused_in_one_line(setup, tmp_path, capsys):
    models, data, _ = setup
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(models, data, out, "sft"), "--num_epochs", "1")
    assert code == 0, err
    state = states(out)[-1]
    record = json.loads((state / "state.json").read_text())
    assert record["step"] == 4 and record["epoch"] == 0
    # another learning rate: the continuation would be another training
    code, _, err = cli(capsys, *argv(models, data, out, "sft"), "--learning_rate", "5e-4", "--resume", str(state))
    one_error_line(code, err, "learning_rate", "resuming would be another training")
    # a damaged state is refused, naming the file
    (state / "trained.safetensors").write_bytes(b"broken")
    code, _, err = cli(capsys, *argv(models, data, out, "sft"), "--resume", str(state))
    one_error_line(code, err, "trained.safetensors", "damaged")
    assert (out / STATE_DIR).is_dir()


def test_resuming_from_the_newest_state_prunes_what_a_kill_left_beyond_the_limit(setup, tmp_path, capsys):
    """A kill between a new state and the pruning of the oldest leaves one state too many; a run resumed from the
    newest may save no further state (it was the last step), so it prunes on resuming (the SIGKILL test above met it:
    three states under --save_total_limit 2). Here the run's 4 states stand for such leftovers."""
    models, data, _ = setup
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(models, data, out, "sft"), "--num_epochs", "1", "--save_total_limit", "0")
    assert code == 0, err
    every = states(out)
    assert len(every) == 4
    code, _, err = cli(capsys, *argv(models, data, out, "sft"), "--num_epochs", "1", "--save_total_limit", "2",
                       "--resume", "latest")
    assert code == 0, err
    assert states(out) == every[-2:]

"""A DiffSynth pipeline under `accelerate launch` with several processes (diffsynth_source/world.py): data parallel.

Two CPU processes over gloo, on Stable Diffusion 1.5's test-size models in fp32 (DiffSynth's example dtype):
- two processes train exactly what one process accumulating two samples a step trains (the loss rows and the LoRA
  bit for bit), where before each process trained the whole run alone into the same folder;
- stage 1 over two processes computes each entry once and writes the manifest one process writes; stage 2 over two
  processes equals the two-process unsplit run;
- `--gradient_accumulation_steps` resumes exactly from a state written mid-epoch;
- an accelerate config with a DeepSpeed section is refused in one line.

Run in .venv-diffsynth (scripts/test_diffsynth.sh); skipped without the `diffsynth` package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffsynth", reason="DiffSynth-Studio is not installed (scripts/test_diffsynth.sh)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source import run as ds_run  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source.run import run  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source.tiny import write_tiny_models  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402

pytestmark = pytest.mark.diffsynth

MODULE = "stable_diffusion"
CLI = Path(sys.executable).parent / "unitgraph"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffsynth_world")
    flags = write_tiny_models(root / "models", MODULE)
    write_synthetic_dataset(root / "data", count=5, size=32)
    env = {"DIFFSYNTH_MODEL_BASE_PATH": str(root / "models"), "DIFFSYNTH_SKIP_DOWNLOAD": "True"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield root, flags
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _flags(root: Path, flags: dict, **over) -> dict:
    base = {"pipeline": f"diffsynth:{MODULE}", "dataset_base_path": str(root / "data"),
            "dataset_metadata_path": str(root / "data" / "metadata.csv"), "height": 32, "width": 32,
            "model_id_with_origin_paths": flags["model_id_with_origin_paths"], "lora_base_model": "unet",
            "lora_target_modules": "to_q,to_k,to_v,to_out.0", "lora_rank": 4, "num_epochs": 2, "seed": 3}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def launch(root: Path, flags: dict, **over) -> str:
    """`unitgraph train` with these flags under `accelerate launch` with 2 CPU processes; its output."""
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
            str(CLI), "train"]
    for name, value in _flags(root, flags, **over).items():
        argv += [f"--{name}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def rows(folder: Path) -> list[str]:
    return (folder / "loss.csv").read_text().splitlines()


def same_lora(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return set(x) == set(y) and len(x) > 0 and all(torch.equal(x[k], y[k]) for k in x)


def test_two_processes_train_what_one_process_accumulating_two_trains(world, tmp_path):
    root, flags = world
    one = run(make_args(**_flags(root, flags, gradient_accumulation_steps=2, output_path=str(tmp_path / "one"))))
    assert one.steps == 6 and len(one.losses) == 10  # 5 samples a epoch: steps of 2, 2 and 1
    out = launch(root, flags, output_path=str(tmp_path / "two"))
    assert "training: 6 steps" in out and out.count("pipeline: diffsynth:") == 1  # the main process reports
    assert rows(tmp_path / "two") == rows(tmp_path / "one")
    assert same_lora(tmp_path / "two" / "epoch-1.safetensors", tmp_path / "one" / "epoch-1.safetensors")
    # not one sample a step: that trains other weights
    alone = run(make_args(**_flags(root, flags, output_path=str(tmp_path / "alone"))))
    assert alone.steps == 10 and not same_lora(tmp_path / "alone" / "epoch-1.safetensors",
                                               tmp_path / "one" / "epoch-1.safetensors")


def test_split_over_two_processes_equals_the_unsplit_run_over_two(world, tmp_path):
    root, flags = world
    launch(root, flags, output_path=str(tmp_path / "sft"))
    out = launch(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache"))
    assert "5 samples, 5 entries computed, 0 reused" in out, out  # the sum over both processes
    alone = run(make_args(**_flags(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache1"))))
    assert alone.entries_computed == 5
    manifest = ds_run.MANIFEST
    assert (tmp_path / "cache" / manifest).read_bytes() == (tmp_path / "cache1" / manifest).read_bytes()
    for entry in (tmp_path / "cache1" / "entries").iterdir():
        assert (tmp_path / "cache" / "entries" / entry.name).read_bytes() == entry.read_bytes(), entry.name
    launch(root, flags, task="sft:train", dataset_base_path=str(tmp_path / "cache"), dataset_metadata_path=None,
           output_path=str(tmp_path / "split"))
    assert rows(tmp_path / "split") == rows(tmp_path / "sft")
    assert same_lora(tmp_path / "split" / "epoch-1.safetensors", tmp_path / "sft" / "epoch-1.safetensors")


def test_accumulation_resumes_exactly_from_a_state_mid_epoch(world, tmp_path):
    root, flags = world
    whole = run(make_args(**_flags(root, flags, gradient_accumulation_steps=2, save_steps=1,
                                   output_path=str(tmp_path / "whole"))))
    cut = tmp_path / "cut"
    run(make_args(**_flags(root, flags, gradient_accumulation_steps=2, save_steps=1, num_epochs=1, save_total_limit=3,
                           output_path=str(cut))))
    state = cut / "state" / "step-2"  # after 4 of the first epoch's 5 samples
    assert state.is_dir(), sorted(p.name for p in (cut / "state").iterdir())
    resumed = run(make_args(**_flags(root, flags, gradient_accumulation_steps=2, save_steps=1, output_path=str(cut),
                                     resume=str(state))))
    assert resumed.losses == whole.losses[4:]
    assert same_lora(cut / "epoch-1.safetensors", tmp_path / "whole" / "epoch-1.safetensors")
    with pytest.raises(BackendError, match=r"samples a step .* 2, this run has 1"):  # not the same run
        newest = max((cut / "state").iterdir(), key=lambda p: int(p.name.split("-")[1]))
        run(make_args(**_flags(root, flags, num_epochs=3, save_steps=1, output_path=str(cut), resume=str(newest))))


def test_a_deepspeed_launch_is_refused_in_one_line(world, tmp_path, monkeypatch):
    root, flags = world
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(BackendError) as caught:
        run(make_args(**_flags(root, flags, output_path=str(tmp_path / "ds"))))
    line = caught.value.one_line()
    assert "DeepSpeed ZeRO-2" in line and "data parallel" in line and "\n" not in line
    assert not (tmp_path / "ds").exists()

"""A DiffSynth pipeline under `accelerate launch` with several processes (diffsynth_source/world.py): data parallel.

Two CPU processes over gloo, on Stable Diffusion 1.5's test-size models in fp32 (DiffSynth's example dtype):
- two processes train exactly what one process accumulating two samples a step trains (the loss rows and the LoRA
  bit for bit), where before each process trained the whole run alone into the same folder;
- stage 1 over two processes computes each entry once and writes the manifest one process writes; stage 2 over two
  processes equals the two-process unsplit run;
- `--gradient_accumulation_steps` resumes exactly from a state written mid-epoch;
- an accelerate config with a DeepSpeed section is refused in one line;
- DiffSynth's full fine-tuning of FLUX.2 [klein] 4B on edits (examples/flux2/model_training/full/FLUX.2-klein-4B.sh,
  its edit command) runs as it is under a two-process launch and writes the whole DiT once.

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

from diffsynth_env import diffsynth_models  # noqa: E402

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
    with diffsynth_models(root / "models"):
        yield root, flags


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


@pytest.fixture(scope="module")
def two(world):
    """The unsplit run over two processes: (its folder, its output)."""
    root, flags = world
    return root / "two", launch(root, flags, output_path=str(root / "two"))


def test_two_processes_train_what_one_process_accumulating_two_trains(world, two, tmp_path):
    root, flags = world
    one = run(make_args(**_flags(root, flags, gradient_accumulation_steps=2, output_path=str(tmp_path / "one"))))
    assert one.steps == 6 and len(one.losses) == 10  # 5 samples a epoch: steps of 2, 2 and 1
    folder, out = two
    assert "training: 6 steps" in out and out.count("pipeline: diffsynth:") == 1  # the main process reports
    assert rows(folder) == rows(tmp_path / "one")
    assert same_lora(folder / "epoch-1.safetensors", tmp_path / "one" / "epoch-1.safetensors")
    # not one sample a step: that trains other weights
    alone = run(make_args(**_flags(root, flags, output_path=str(tmp_path / "alone"))))
    assert alone.steps == 10 and not same_lora(tmp_path / "alone" / "epoch-1.safetensors",
                                               tmp_path / "one" / "epoch-1.safetensors")


def test_split_over_two_processes_equals_the_unsplit_run_over_two(world, two, tmp_path):
    root, flags = world
    unsplit, _out = two
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
    assert rows(tmp_path / "split") == rows(unsplit)
    assert same_lora(tmp_path / "split" / "epoch-1.safetensors", unsplit / "epoch-1.safetensors")


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


def test_resuming_from_the_newest_state_prunes_beyond_the_limit(world, tmp_path):
    """A kill between a new state and the pruning of the oldest leaves one too many, and a run resumed from the newest
    may save no further state: it prunes on resuming (here the run's own states stand for such leftovers)."""
    root, flags = world
    out = tmp_path / "out"
    run(make_args(**_flags(root, flags, num_epochs=1, save_steps=1, save_total_limit=0, output_path=str(out))))
    every = sorted((out / "state").iterdir(), key=lambda p: int(p.name.split("-")[1]))
    assert len(every) == 5
    run(make_args(**_flags(root, flags, num_epochs=1, save_steps=1, save_total_limit=2, output_path=str(out),
                           resume="latest")))
    assert sorted((out / "state").iterdir(), key=lambda p: int(p.name.split("-")[1])) == every[-2:]


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


# examples/flux2/model_training/full/FLUX.2-klein-4B.sh, its edit command (commented out in the script, as DiffSynth
# ships it), as it is
FLUX2_FULL_EDIT = r"""
accelerate launch examples/flux2/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/qwen_image/Qwen-Image-Edit-2511 \
  --dataset_metadata_path data/diffsynth_example_dataset/qwen_image/Qwen-Image-Edit-2511/metadata.json \
  --data_file_keys "image,edit_image" \
  --extra_inputs "edit_image" \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-klein-4B:text_encoder/*.safetensors,black-forest-labs/FLUX.2-klein-4B:transformer/*.safetensors,black-forest-labs/FLUX.2-klein-4B:vae/diffusion_pytorch_model.safetensors" \
  --tokenizer_path "black-forest-labs/FLUX.2-klein-4B:tokenizer/" \
  --learning_rate 1e-5 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-klein-4B_full" \
  --trainable_models "dit" \
  --use_gradient_checkpointing
"""


def test_diffsynths_flux2_full_edit_command_runs_over_two_processes(tmp_path):
    """The command with `unitgraph train` for `accelerate launch .../train.py`, `--pipeline diffsynth:flux2_image`
    (the model ids alone choose unitgraph's own FLUX.2 family) and lowered sizes (--num_epochs 1, --dataset_repeat
    1), under a launch of 2 processes; 2 rows of a target, a prompt and two references each."""
    import json
    import shlex

    argv = shlex.split(FLUX2_FULL_EDIT.replace("\\\n", " "))
    argv = argv[argv.index("examples/flux2/model_training/train.py") + 1:]
    for flag, value in (("--num_epochs", "1"), ("--dataset_repeat", "1")):
        argv[argv.index(flag) + 1] = value
    argv += ["--pipeline", "diffsynth:flux2_image"]
    write_tiny_models(tmp_path / "models", "flux2_image")
    data = tmp_path / "data" / "diffsynth_example_dataset" / "qwen_image" / "Qwen-Image-Edit-2511"
    write_synthetic_dataset(data, count=2, size=40)
    images = [line.split(",", 1)[0] for line in (data / "metadata.csv").read_text().splitlines()[1:]]
    meta = [{"image": image, "prompt": f"make it like the references {i}", "edit_image": [images[1 - i], image]}
            for i, image in enumerate(images)]
    (data / "metadata.json").write_text(json.dumps(meta), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD")}
    env.update(OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no"]
    done = subprocess.run([*launch, str(CLI), "train", *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "EditImageEmbedder" in done.stdout and "training: 1 step in" in done.stdout, done.stdout
    out = tmp_path / "models" / "train" / "FLUX.2-klein-4B_full"
    full = load_file(str(out / "epoch-0.safetensors"))
    dit = {k for k in load_file(str(next((tmp_path / "models" / "black-forest-labs" / "FLUX.2-klein-4B" /
                                          "transformer").glob("*.safetensors"))))}
    assert len(full) == len(dit) and not any(k.startswith("pipe.") or "lora" in k for k in full)  # the whole DiT
    assert [r.split(",")[:2] for r in rows(out)[1:]] == [["1", "0"], ["1", "0"]]  # a step of 2 samples

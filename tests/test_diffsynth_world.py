"""A DiffSynth pipeline under `accelerate launch` with several processes (diffsynth_source/world.py): data parallel.

Two CPU processes over gloo, on Stable Diffusion 1.5's test-size models in fp32 (DiffSynth's example dtype):
- two processes train exactly what one process accumulating two samples a step trains (the loss rows and the LoRA
  bit for bit), where before each process trained the whole run alone into the same folder;
- stage 1 over two processes computes each entry once and writes the manifest one process writes; stage 2 over two
  processes equals the two-process unsplit run;
- `--gradient_accumulation_steps` resumes exactly from a state written mid-epoch;
- FSDP2 (an accelerate config with fsdp_version 2; diffsynth_source/sharding.py): SD 1.5's LoRA over its sharded
  UNet trains data parallel's numbers to a rounding and resumes exactly; Z-Image's DiT trained whole in bf16 trains
  data parallel's numbers bit for bit, split == unsplit; FSDP1 is refused in one line;
- DiffSynth's DeepSpeed configs as shipped (diffsynth_source/sharding.py): ZeRO-2 (and ZeRO-2 with offload) trains SD
  1.5's LoRA as data parallel does; under ZeRO-3, Z-Image's DiT trained whole in bf16 trains split == unsplit and
  resumes exactly; DiffSynth's full Z-Image command runs under its ZeRO-2 config;
- --max_grad_norm and --ema_decay under ZeRO-2 and FSDP2, and --optimizer schedulefree under FSDP2, train data
  parallel's numbers (SD 1.5's LoRA in fp32) and resume exactly; under ZeRO-2 an fp8 LoRA base (Z-Image's DiT) and fp8 text encoder train split == unsplit;
- DiffSynth's Wan 2.1 commands under their accelerate_config_14B.yaml (ZeRO-2, offloaded): the 14B full fine-tune
  and the 1.3B direct distillation run as they are;
- DiffSynth's full fine-tuning of FLUX.2 [klein] 4B on edits (examples/flux2/model_training/full/FLUX.2-klein-4B.sh,
  its edit command) runs as it is under a two-process launch and writes the whole DiT once.

Run in .venv-diffsynth (scripts/test_diffsynth.sh); skipped without the `diffsynth` package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip("diffsynth", reason="DiffSynth-Studio is not installed (scripts/test_diffsynth.sh)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from diffsynth_env import add_distill_columns, diffsynth_models  # noqa: E402

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


def _flags(root: Path, flags: dict, module: str = MODULE, **over) -> dict:
    base = {"pipeline": f"diffsynth:{module}", "dataset_base_path": str(root / "data"),
            "dataset_metadata_path": str(root / "data" / "metadata.csv"), "height": 32, "width": 32,
            "model_id_with_origin_paths": flags["model_id_with_origin_paths"], "num_epochs": 2, "seed": 3}
    base.update({k: v for k, v in flags.items() if k.startswith("tokenizer")})
    if module == MODULE:
        base.update(lora_base_model="unet", lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4)
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def launch(root: Path, flags: dict, config: Optional[Path] = None, module: str = MODULE, **over) -> str:
    """`unitgraph train` with these flags under `accelerate launch` with 2 CPU processes (with `config`: its
    accelerate config, the processes' count overridden as DiffSynth's configs name 8); its output."""
    done = launched(root, flags, config, module, **over)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def launched(root: Path, flags: dict, config: Optional[Path] = None, module: str = MODULE,
             **over) -> subprocess.CompletedProcess:
    """`launch`, its process whatever its exit code."""
    argv = [sys.executable, "-m", "accelerate.commands.launch"]
    if config is None:
        argv += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    else:
        argv += ["--config_file", str(config)]
    argv += ["--num_processes", "2", "--num_machines", "1", "--main_process_port", "0", str(CLI), "train"]
    for name, value in _flags(root, flags, module, **over).items():
        argv += [f"--{name}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if config is None:
        env["ACCELERATE_USE_CPU"] = "true"  # (DeepSpeed runs on CPU processes without it: shared/ENGINE_NOTES.md)
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


def rows(folder: Path) -> list[str]:
    return (folder / "loss.csv").read_text().splitlines()


def _close(a: Path, b: Path, atol: float) -> bool:
    """Both safetensors files hold the same tensors (and some) within `atol`."""
    x, y = load_file(str(a)), load_file(str(b))
    return set(x) == set(y) and len(x) > 0 and all(torch.allclose(x[k], y[k], rtol=0, atol=atol) for k in x)


def close_and_trained(a: Path, b: Path) -> None:
    """Both checkpoints hold the same tensors within 1e-6, and a LoRA's B matrices moved off zero (it trained)."""
    assert _close(a, b, 1e-6)
    x = load_file(str(a))
    assert any(not torch.equal(x[k], torch.zeros_like(x[k])) for k in x if "lora_B" in k)


# a training state of two processes: each process's optimizer share in a file of its own
RANKED_STATE = {"state.json", "trained.safetensors", "optimizer.safetensors", "optimizer-rank1.safetensors"}


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


def test_an_fsdp1_launch_is_refused_in_one_line(world, tmp_path, monkeypatch):
    root, flags = world
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(BackendError) as caught:
        run(make_args(**_flags(root, flags, output_path=str(tmp_path / "fsdp"))))
    line = caught.value.one_line()
    assert "FSDP version 1" in line and "fsdp_version: 2" in line and "\n" not in line
    assert not (tmp_path / "fsdp").exists()


# DiffSynth's accelerate configs for full training, as shipped: examples/z_image/model_training/full/
# accelerate_config.yaml (ZeRO-2; FLUX.2's and Ideogram 4's are the same text), examples/qwen_image/model_training/
# full/accelerate_config_zero2offload.yaml (ZERO2_OFFLOAD_CONFIG below) and z_image's accelerate_config_zero3.yaml
ZERO2_CONFIG = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
ZERO3_CONFIG = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
ZERO2_OFFLOAD_CONFIG = ZERO2_CONFIG.replace("offload_optimizer_device: none\n  offload_param_device: none",
                                            "offload_optimizer_device: 'cpu'\n  offload_param_device: 'cpu'")
assert ZERO2_OFFLOAD_CONFIG != ZERO2_CONFIG
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (the deepspeed extra)")


def _config(folder: Path, text: str, name: str = "accelerate_config.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


@needs_deepspeed
def test_zero2_over_two_processes_trains_what_data_parallel_trains(world, two, tmp_path):
    """DiffSynth's ZeRO-2 config, SD 1.5's LoRA in fp32: the loss rows of the data-parallel run over two processes,
    the LoRA to within the order of a sum (here equal); each process keeps its own optimizer partition in a state.
    Its ZeRO-2 config with the optimizer offloaded to CPU memory trains the same numbers (the client AdamW steps
    there too)."""
    root, flags = world
    folder, _out = two
    out = launch(root, flags, _config(tmp_path, ZERO2_CONFIG), output_path=str(tmp_path / "zero2"))
    assert "engine:     DeepSpeed ZeRO-2 over 2 processes" in out, out
    assert rows(tmp_path / "zero2") == rows(folder)
    close_and_trained(folder / "epoch-1.safetensors", tmp_path / "zero2" / "epoch-1.safetensors")
    assert {p.name for p in (tmp_path / "zero2" / "state" / "step-6").iterdir()} == RANKED_STATE
    offload = _config(tmp_path, ZERO2_OFFLOAD_CONFIG, "offload.yaml")
    out = launch(root, flags, offload, output_path=str(tmp_path / "off"))
    assert "engine:     DeepSpeed ZeRO-2 (optimizer offloaded to CPU) over 2 processes" in out, out
    assert rows(tmp_path / "off") == rows(folder)
    assert same_lora(tmp_path / "off" / "epoch-1.safetensors", tmp_path / "zero2" / "epoch-1.safetensors")


@pytest.fixture(scope="module")
def z_image(tmp_path_factory):
    """Z-Image's test-size models (DiffSynth loads them in bf16) and 5 rows."""
    root = tmp_path_factory.mktemp("diffsynth_zero")
    flags = write_tiny_models(root / "models", "z_image")
    write_synthetic_dataset(root / "data", count=5, size=32)
    return root, flags


# an FSDP2 config as `accelerate config` writes it (DiffSynth ships none)
FSDP2_CONFIG = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_fsdp2_lora_trains_what_data_parallel_trains_and_resumes_exactly(world, two, tmp_path):
    """FSDP2 over two processes, SD 1.5's LoRA in fp32: the UNet's blocks and the rest sharded, frozen base and
    adapters, each process holding half; the loss rows and the LoRA of the data-parallel run to a rounding (the
    gathered weights are other buffers, and a matrix product may round otherwise in the last bit); each process
    keeps its own shard of AdamW's moments in a state; a run resumed from a state mid-epoch ends on the same LoRA,
    bit for bit."""
    root, flags = world
    folder, _out = two
    config = _config(tmp_path, FSDP2_CONFIG)
    common = dict(save_steps=2, save_total_limit=0)
    out = launch(root, flags, config, output_path=str(tmp_path / "fsdp"), **common)
    assert "engine:     FSDP2 over 2 processes: unet in 5 shard groups (4 blocks and the rest), this process holds " \
           "50.0% of their weights" in out, out
    losses = [[float(v) for v in line.split(",")[2:]] for line in rows(tmp_path / "fsdp")[1:]]
    expected = [[float(v) for v in line.split(",")[2:]] for line in rows(folder)[1:]]
    assert torch.allclose(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
    close_and_trained(folder / "epoch-1.safetensors", tmp_path / "fsdp" / "epoch-1.safetensors")
    state = tmp_path / "fsdp" / "state" / "step-2"
    assert {p.name for p in state.iterdir()} == RANKED_STATE
    mine, theirs = (load_file(str(state / name)) for name in ("optimizer.safetensors", "optimizer-rank1.safetensors"))
    assert set(mine) == set(theirs) and not all(torch.equal(mine[k], theirs[k]) for k in mine)  # two halves
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "fsdp", cut, ignore=shutil.ignore_patterns("step-4", "step-6", "epoch-*"))
    launch(root, flags, config, output_path=str(cut), resume="latest", **common)
    assert rows(cut) == rows(tmp_path / "fsdp")
    assert same_lora(cut / "epoch-1.safetensors", tmp_path / "fsdp" / "epoch-1.safetensors")


@needs_deepspeed
def test_clipping_and_the_moving_average_under_zero2_and_fsdp2_train_data_parallels_numbers(world, two, tmp_path):
    """--max_grad_norm and --ema_decay under DiffSynth's ZeRO-2 config and under FSDP2, SD 1.5's LoRA in fp32: the loss
    rows, the LoRA and its moving average of the data-parallel run (one process accumulating two samples a step:
    the two-process run's numbers, test above) to a rounding (DeepSpeed scales by the inverse of norm / max, torch by
    max / norm; FSDP2's sums run over shards); clipping bites (the rows differ from the run without it after the
    first step). Under FSDP2 each process averages its shards; a run resumed from a state mid-epoch ends on the same
    LoRA and average, bit for bit. Under ZeRO-3 the average is refused in one line."""
    root, flags = world
    folder, _out = two
    recipe = dict(max_grad_norm=0.05, ema_decay=0.9)
    dp = tmp_path / "dp"
    run(make_args(**_flags(root, flags, gradient_accumulation_steps=2, output_path=str(dp), **recipe)))
    assert rows(dp)[:2] == rows(folder)[:2] and rows(dp) != rows(folder)  # the first step's losses, then clipped
    zero2 = tmp_path / "zero2"
    out = launch(root, flags, _config(tmp_path, ZERO2_CONFIG), output_path=str(zero2), **recipe)
    assert "engine:     DeepSpeed ZeRO-2 over 2 processes" in out, out
    fsdp = tmp_path / "fsdp"
    config = _config(tmp_path, FSDP2_CONFIG, "fsdp2.yaml")
    common = dict(save_steps=2, save_total_limit=0, **recipe)
    launch(root, flags, config, output_path=str(fsdp), **common)
    expected = torch.tensor([[float(v) for v in line.split(",")[2:]] for line in rows(dp)[1:]])
    for got in (zero2, fsdp):
        losses = torch.tensor([[float(v) for v in line.split(",")[2:]] for line in rows(got)[1:]])
        assert torch.allclose(losses, expected, rtol=1e-6, atol=0), got.name
        for name in ("epoch-1.safetensors", "epoch-1-ema.safetensors"):
            assert _close(dp / name, got / name, 1e-6), (got.name, name)
    assert not _close(dp / "epoch-1.safetensors", dp / "epoch-1-ema.safetensors", 1e-6)  # the average lags
    cut = tmp_path / "cut"
    shutil.copytree(fsdp, cut, ignore=shutil.ignore_patterns("step-4*", "step-6", "epoch-*"))
    launch(root, flags, config, output_path=str(cut), resume="latest", **common)
    assert rows(cut) == rows(fsdp)
    for name in ("epoch-1.safetensors", "epoch-1-ema.safetensors"):
        assert same_lora(cut / name, fsdp / name), name
    with pytest.raises(BackendError, match="z3.yaml: --ema_decay with DeepSpeed ZeRO-3: ZeRO-3 partitions"):
        run(make_args(**_flags(root, flags, dry_run=True, config_file=str(_config(tmp_path, ZERO3_CONFIG, "z3.yaml")),
                               num_processes=2, **recipe)))


def test_fsdp2_full_training_in_bf16_split_is_data_parallels_unsplit_run_bit_for_bit(z_image, tmp_path):
    """FSDP2 over two processes, Z-Image's DiT trained whole in bf16 (an epoch: steps of 2, 2 and 1 samples, the
    last with a pass weighted 0): AdamW steps each process's shard in bf16, elementwise as data parallel steps the
    whole weights, and the gradients' average over two is exact, so stage 1 then stage 2 under FSDP2 train the
    loss rows and the DiT of the unsplit data-parallel run bit for bit (split == unsplit, and FSDP2 == data
    parallel, in one comparison). The validation sample, drawn under FSDP2 by both processes inside the engine's
    forward (the DiT's shards gathered) with the text encoder loaded for the while, is the data-parallel run's,
    byte for byte. The held-out loss of two cached samples, computed by both processes inside the engine's forward,
    is logged at the epoch's end and changes no step."""
    from unitgraph.backends.diffusion.train.held_out import read_held_out_csv

    root, flags = z_image
    config = _config(tmp_path, FSDP2_CONFIG)
    common = dict(module="z_image", trainable_models="dit", learning_rate=1e-3, num_epochs=1)
    drawn = dict(validation_prompt="a red square", validation_inference_steps=2)
    write_synthetic_dataset(tmp_path / "held", count=2, size=32, seed=7)
    with diffsynth_models(root / "models"):
        launch(root, flags, None, output_path=str(tmp_path / "dp"), **common, **drawn)
        launch(root, flags, config, task="sft:data_process", output_path=str(tmp_path / "cache"),
               validation_dataset=str(tmp_path / "held" / "metadata.csv"), **common)
        out = launch(root, flags, config, task="sft:train", dataset_base_path=str(tmp_path / "cache"),
                     dataset_metadata_path=None, output_path=str(tmp_path / "split"), **common, **drawn)
        assert "FSDP2 over 2 processes: dit in " in out and ": 3 steps in" in out, out
        assert "samples:    text_encoder, vae_decoder, vae_encoder loaded while the samples render" in out, out
        unsplit = tmp_path / "dp"
        assert rows(tmp_path / "split") == rows(unsplit)
        assert same_lora(tmp_path / "split" / "epoch-0.safetensors", unsplit / "epoch-0.safetensors")
        assert {v.dtype for v in load_file(str(unsplit / "epoch-0.safetensors")).values()} == {torch.bfloat16}
        sample = Path("samples") / "epoch-0" / "0.png"
        assert (tmp_path / "split" / sample).read_bytes() == (unsplit / sample).read_bytes()
        held = read_held_out_csv(tmp_path / "split" / "validation_loss.csv")
        assert [(r["step"], r["samples"]) for r in held] == [(3, 2)] and 0 < held[0]["loss"] < 100


@needs_deepspeed
def test_zero3_full_training_split_equals_unsplit_and_resumes_exactly(z_image, tmp_path):
    """DiffSynth's ZeRO-3 config, Z-Image's DiT trained whole in bf16: each process holds half its weights; stage 1
    then stage 2 under the same launch train the unsplit run's numbers bit for bit; a run resumed from a state
    mid-run ends on the same weights (each process's fp32 masters come back from its own file: their bf16
    roundings would not do); a data-parallel run does not continue it. Validation samples, drawn by both processes
    inside the engine's forward, are the same split and unsplit."""
    root, flags = z_image
    config = _config(tmp_path, ZERO3_CONFIG)
    common = dict(module="z_image", trainable_models="dit", learning_rate=1e-3, save_steps=2, save_total_limit=0)
    drawn = dict(validation_prompt="a red square", validation_inference_steps=2)
    with diffsynth_models(root / "models"):
        out = launch(root, flags, config, output_path=str(tmp_path / "unsplit"), **common, **drawn)
        assert "DeepSpeed ZeRO-3 over 2 processes: the weights of dit partitioned, this process holds 50.0%" in out, out
        launch(root, flags, config, task="sft:data_process", output_path=str(tmp_path / "cache"), **common)
        launch(root, flags, config, task="sft:train", dataset_base_path=str(tmp_path / "cache"),
               dataset_metadata_path=None, output_path=str(tmp_path / "split"), **common, **drawn)
        unsplit = tmp_path / "unsplit"
        assert rows(tmp_path / "split") == rows(unsplit)
        assert same_lora(tmp_path / "split" / "epoch-1.safetensors", unsplit / "epoch-1.safetensors")
        samples = sorted(p.relative_to(unsplit) for p in (unsplit / "samples").rglob("*.png"))
        assert len(samples) == 4, samples  # step-2, epoch-0, step-4, epoch-1
        assert all((tmp_path / "split" / p).read_bytes() == (unsplit / p).read_bytes() for p in samples)
        assert {v.dtype for v in load_file(str(unsplit / "epoch-1.safetensors")).values()} == {torch.bfloat16}
        cut = tmp_path / "cut"
        shutil.copytree(unsplit / "state" / "step-2", cut / "state" / "step-2")
        refused = launched(root, flags, config, output_path=str(cut), resume="latest", **common)
        assert refused.returncode != 0 and "[rank1]: Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert "the main process refused the output folder" in refused.stderr, refused.stderr[-3000:]
        shutil.rmtree(cut)
        shutil.copytree(unsplit, cut, ignore=shutil.ignore_patterns("step-4", "step-6", "epoch-*"))
        launch(root, flags, config, output_path=str(cut), resume="latest", **common)
        assert rows(cut) == rows(unsplit)
        assert same_lora(cut / "epoch-1.safetensors", unsplit / "epoch-1.safetensors")
        with pytest.raises(BackendError, match=r"the engine 'DeepSpeed ZeRO-3 over 2 processes', this run has "
                                               r"'data parallel'"):
            run(make_args(**_flags(root, flags, output_path=str(cut), resume=str(cut / "state" / "step-2"),
                                   gradient_accumulation_steps=2, **common)))  # the same samples a step


def test_schedule_free_under_fsdp2_trains_data_parallels_numbers_and_resumes_exactly(world, tmp_path):
    """--optimizer schedulefree under FSDP2, SD 1.5's LoRA in fp32: each process steps its shards elementwise and
    takes the averaged weights of its shards for a checkpoint (a gather); the loss rows and the checkpoints (averaged
    LoRA) of the data-parallel run (one process accumulating two samples a step) within 1e-6; a run resumed from a
    state mid-epoch ends on the same checkpoint, bit for bit."""
    root, flags = world
    # at DiffSynth's rate, 1e-4 (at 1e-2 the order of the sums moved some weights by 2e-5 within two steps: Adam's
    # division by the root of the second moment magnifies a rounding of a small gradient)
    recipe = dict(optimizer="schedulefree")
    dp = tmp_path / "dp"
    run(make_args(**_flags(root, flags, gradient_accumulation_steps=2, output_path=str(dp), **recipe)))
    fsdp = tmp_path / "fsdp"
    config = _config(tmp_path, FSDP2_CONFIG)
    common = dict(save_steps=2, save_total_limit=0, **recipe)
    launch(root, flags, config, output_path=str(fsdp), **common)
    expected = torch.tensor([[float(v) for v in line.split(",")[2:]] for line in rows(dp)[1:]])
    losses = torch.tensor([[float(v) for v in line.split(",")[2:]] for line in rows(fsdp)[1:]])
    assert torch.allclose(losses, expected, rtol=1e-6, atol=0)
    for name in ("epoch-0.safetensors", "epoch-1.safetensors"):
        assert _close(dp / name, fsdp / name, 1e-6), name
    cut = tmp_path / "cut"
    shutil.copytree(fsdp, cut, ignore=shutil.ignore_patterns("step-4*", "step-6", "epoch-*"))
    launch(root, flags, config, output_path=str(cut), resume="latest", **common)
    assert rows(cut) == rows(fsdp)
    assert same_lora(cut / "epoch-1.safetensors", fsdp / "epoch-1.safetensors")


@needs_deepspeed
def test_fp8_models_train_under_zero2_split_as_unsplit(z_image, tmp_path):
    """--fp8_models under an engine, Z-Image's LoRA on its DiT: under DiffSynth's ZeRO-2 config (which leaves frozen
    weights as they are) the fp8 DiT base and the fp8 text encoder (outside the engine, as under any) train split ==
    unsplit, bit for bit. An fp8 base under an engine that shards frozen weights (ZeRO-3, FSDP2) is refused in one
    line."""
    root, flags = z_image
    both = dict(module="z_image", lora_base_model="dit", lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4,
                num_epochs=1, fp8_models="dit,text_encoder")
    with diffsynth_models(root / "models"):
        zero2 = _config(tmp_path, ZERO2_CONFIG)
        out = launch(root, flags, zero2, output_path=str(tmp_path / "unsplit"), **both)
        assert "engine:     DeepSpeed ZeRO-2 over 2 processes" in out, out
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # stage 1 in this process, with the launched processes' arithmetic (one thread each)
        try:
            run(make_args(**_flags(root, flags, "z_image", task="sft:data_process", output_path=str(tmp_path / "cache"),
                                   **{k: v for k, v in both.items() if k != "module"})))
        finally:
            torch.set_num_threads(threads)
        launch(root, flags, zero2, task="sft:train", dataset_base_path=str(tmp_path / "cache"),
               dataset_metadata_path=None, output_path=str(tmp_path / "split"), **both)
        assert rows(tmp_path / "split") == rows(tmp_path / "unsplit")
        assert same_lora(tmp_path / "split" / "epoch-0.safetensors", tmp_path / "unsplit" / "epoch-0.safetensors")
        with pytest.raises(BackendError, match="--fp8_models with DeepSpeed ZeRO-3: dit trains under the engine"):
            run(make_args(**_flags(root, flags, "z_image", dry_run=True, num_processes=2,
                                   config_file=str(_config(tmp_path, ZERO3_CONFIG, "z3.yaml")),
                                   **{k: v for k, v in both.items() if k != "module"})))


# examples/z_image/model_training/full/Z-Image.sh, as it is
Z_IMAGE_FULL = r"""
accelerate launch --config_file examples/z_image/model_training/full/accelerate_config.yaml examples/z_image/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/z_image/Z-Image \
  --dataset_metadata_path data/diffsynth_example_dataset/z_image/Z-Image/metadata.csv \
  --max_pixels 1048576 \
  --dataset_repeat 400 \
  --model_id_with_origin_paths "Tongyi-MAI/Z-Image:transformer/*.safetensors,Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-5 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Z-Image_full" \
  --trainable_models "dit" \
  --use_gradient_checkpointing \
  --dataset_num_workers 8
"""


@needs_deepspeed
def test_diffsynths_z_image_full_command_runs_under_its_zero2_config(tmp_path):
    """The command with `unitgraph train` for DiffSynth's train.py, `--pipeline diffsynth:z_image` (the model ids
    alone choose unitgraph's own Z-Image family), lowered sizes (--num_epochs 1, --dataset_repeat 1) and the
    launch's `--num_processes 2` (its config names 8), from a folder holding DiffSynth's config at its path and
    `./models` as DiffSynth's loader lays it out; 3 rows."""
    import shlex

    words = shlex.split(Z_IMAGE_FULL.replace("\\\n", " "))
    launch_args = words[2:words.index("examples/z_image/model_training/train.py")]
    argv = words[words.index("examples/z_image/model_training/train.py") + 1:]
    for flag, value in (("--num_epochs", "1"), ("--dataset_repeat", "1")):
        argv[argv.index(flag) + 1] = value
    argv += ["--pipeline", "diffsynth:z_image"]
    config = tmp_path / launch_args[launch_args.index("--config_file") + 1]
    config.parent.mkdir(parents=True)
    config.write_text(ZERO2_CONFIG, encoding="utf-8")
    write_tiny_models(tmp_path / "models", "z_image")
    write_synthetic_dataset(tmp_path / "data" / "diffsynth_example_dataset" / "z_image" / "Z-Image", count=3, size=32)
    env = {k: v for k, v in os.environ.items() if k not in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD")}
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launch_args, "--num_processes", "2",
                           "--main_process_port", "0", str(CLI), "train", *argv], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "engine:     DeepSpeed ZeRO-2 over 2 processes" in done.stdout and "training: 2 steps in" in done.stdout
    out = tmp_path / "models" / "train" / "Z-Image_full"
    full = load_file(str(out / "epoch-0.safetensors"))
    dit = load_file(str(next((tmp_path / "models" / "Tongyi-MAI" / "Z-Image" / "transformer").glob("*.safetensors"))))
    assert set(full) == set(dit) and any(not torch.equal(full[k], dit[k]) for k in full)  # the whole DiT, trained
    assert [r.split(",")[0] for r in rows(out)[1:]] == ["1", "1", "2"]  # steps of 2 samples, then 1


# examples/wanvideo/model_training/full/Wan2.1-T2V-14B.sh, as it is; its accelerate_config_14B.yaml (ZeRO-2, the
# optimizer and parameters offloaded to CPU memory; 48 of DiffSynth's Wan commands launch with it) is ZERO2_CONFIG
# with both offload devices `cpu`, unquoted
WAN_14B_FULL = r"""
accelerate launch --config_file examples/wanvideo/model_training/full/accelerate_config_14B.yaml examples/wanvideo/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-14B \
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-14B/metadata.csv \
  --height 480 \
  --width 832 \
  --dataset_repeat 100 \
  --model_id_with_origin_paths "Wan-AI/Wan2.1-T2V-14B:diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.1-T2V-14B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-T2V-14B:Wan2.1_VAE.pth" \
  --learning_rate 1e-5 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Wan2.1-T2V-14B_full" \
  --trainable_models "dit"
"""
WAN_14B_CONFIG = ZERO2_CONFIG.replace("offload_optimizer_device: none\n  offload_param_device: none",
                                      "offload_optimizer_device: cpu\n  offload_param_device: cpu")


def run_wan_port(tmp_path: Path, command: str, repository: str, distill: bool = False) -> tuple[str, Path]:
    """DiffSynth's Wan `command` with `unitgraph train` for its train.py, `--pipeline diffsynth:wan_video` and
    `--data_file_keys video` (as the Wan LoRA port), lowered sizes (--height/--width 32, --num_epochs 1,
    --dataset_repeat 1, two 5-frame clips; with `distill` the direct-distill dataset's columns) and the launch's
    `--num_processes 2`, from `tmp_path`. `repository` (Wan-AI/...) holds a test-size DiT of the class; the umt5
    tokenizer comes from the 1.3B folder, as DiffSynth's train.py defaults it, and the .pth files are read from
    DiffSynth's converted copies. Returns the run's output and the DiT's folder."""
    import shlex

    words = shlex.split(command.replace("\\\n", " "))
    script = "examples/wanvideo/model_training/train.py"
    launch_args, argv = words[2:words.index(script)], words[words.index(script) + 1:]
    for flag, value in (("--num_epochs", "1"), ("--dataset_repeat", "1"), ("--height", "32"), ("--width", "32")):
        argv[argv.index(flag) + 1] = value
    argv += ["--pipeline", "diffsynth:wan_video", "--data_file_keys", "video"]
    config = tmp_path / launch_args[launch_args.index("--config_file") + 1]
    config.parent.mkdir(parents=True)
    config.write_text(WAN_14B_CONFIG, encoding="utf-8")
    write_tiny_models(tmp_path / "models", "wan_video")
    small, dit = tmp_path / "models" / "Wan-AI" / "Wan2.1-T2V-1.3B", tmp_path / "models" / repository
    if dit != small:
        dit.mkdir()
        for name in ("diffusion_pytorch_model.safetensors", "config.json"):
            shutil.copy(small / name, dit / name)
    data = tmp_path / argv[argv.index("--dataset_base_path") + 1]
    write_synthetic_dataset(data, count=2, size=40, videos=("video",), frames=5)
    if distill:
        add_distill_columns(data)
    env = {k: v for k, v in os.environ.items() if k not in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD")}
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launch_args, "--num_processes", "2",
                           "--main_process_port", "0", str(CLI), "train", *argv], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout, dit


def assert_whole_dit_trained(checkpoint: Path, dit: Path) -> None:
    full = load_file(str(checkpoint))
    original = load_file(str(dit / "diffusion_pytorch_model.safetensors"))
    assert set(full) == set(original) and any(not torch.equal(full[k], original[k]) for k in full)


@needs_deepspeed
def test_diffsynths_wan_14b_full_command_runs_under_its_offloading_config(tmp_path):
    """examples/wanvideo/model_training/full/Wan2.1-T2V-14B.sh through `run_wan_port`: the whole DiT trained under
    ZeRO-2 with the optimizer offloaded, each process's optimizer partition in the state."""
    stdout, dit = run_wan_port(tmp_path, WAN_14B_FULL, "Wan-AI/Wan2.1-T2V-14B")
    assert "engine:     DeepSpeed ZeRO-2 (optimizer offloaded to CPU) over 2 processes" in stdout, stdout
    assert "training: 1 step in" in stdout, stdout
    out = tmp_path / "models" / "train" / "Wan2.1-T2V-14B_full"
    assert_whole_dit_trained(out / "epoch-0.safetensors", dit)
    assert {p.name for p in (out / "state" / "step-1").iterdir()} >= {"optimizer.safetensors",
                                                                     "optimizer-rank1.safetensors"}


# examples/wanvideo/model_training/special/direct_distill/Wan2.1-T2V-1.3B.sh, as it is (its dataset's metadata adds
# seed, rand_device, num_inference_steps and cfg_scale columns, which --extra_inputs passes)
WAN_DISTILL = r"""
accelerate launch --config_file examples/wanvideo/model_training/full/accelerate_config_14B.yaml examples/wanvideo/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B_direct_distill \
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B_direct_distill/metadata.csv \
  --height 480 \
  --width 832 \
  --dataset_repeat 160 \
  --model_id_with_origin_paths "Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth" \
  --learning_rate 1e-5 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Wan2.1-T2V-1.3B_full_distill" \
  --trainable_models "dit" \
  --task "direct_distill" \
  --extra_inputs "seed,rand_device,num_inference_steps,cfg_scale"
"""


@needs_deepspeed
def test_diffsynths_wan_direct_distill_command_runs_under_its_offloading_config(tmp_path):
    """DiffSynth's Wan 2.1 1.3B direct distillation through `run_wan_port`: the whole DiT trained on
    DirectDistillLoss under ZeRO-2 with the optimizer offloaded; the noise made from each row's seed in the plan's
    stage 1 with the VAE (the run's plan line), so only the DiT computes in training."""
    stdout, dit = run_wan_port(tmp_path, WAN_DISTILL, "Wan-AI/Wan2.1-T2V-1.3B", distill=True)
    assert "engine:     DeepSpeed ZeRO-2 (optimizer offloaded to CPU) over 2 processes" in stdout, stdout
    assert "training: 1 step in" in stdout, stdout
    plan = next(line for line in stdout.splitlines() if line.startswith("plan:"))
    assert "NoiseInitializer" in plan.split("stage 2 runs")[0] and plan.endswith("(dit)"), plan
    out = tmp_path / "models" / "train" / "Wan2.1-T2V-1.3B_full_distill"
    assert_whole_dit_trained(out / "epoch-0.safetensors", dit)
    losses = [float(r.split(",")[3]) for r in rows(out)[1:]]
    assert len(losses) == 2 and all(0 < value < 100 for value in losses), losses


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

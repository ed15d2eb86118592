"""Stage 2 and the unsplit run under accelerate's engines, on 2 CPU processes: DiffSynth's own accelerate configs
launched as shipped (their num_processes overridden on accelerate's command line), an FSDP2 config, and a ZeRO-3
config that partitions even the tiny models' weights.

What a user relies on: split equals unsplit under each engine (losses and weights, the same engine and process
count on both sides); the engines really shard (each process holds about half of the weights, as the run's note
measures); FSDP2 and ZeRO-3 resume exactly; --max_grad_norm clips the same in both runs. Every launch runs several runs
(tests/two_process_stage1.py), paying the interpreters' start once.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402

from pasted import commands  # noqa: E402

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
HELD_OUT = ("--validation_dataset", "data/held/metadata.csv", "--validation_steps", "1")
# a LoRA that stays the base model (AdamW's first steps move its zero B matrices by about 1e-30: below fp32's
# resolution of the DiT's activations), so its sample is the folder's own pipeline's
SAMPLES = ("--validation_prompt", "a red circle", "--validation_inference_steps", "2", "--learning_rate", "1e-30")
JOBS = HERE / "two_process_stage1.py"

# DiffSynth-Studio's accelerate configs, as its repository ships them (examples/.../model_training/...)
ZERO2_OFFLOAD = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: 'cpu'
  offload_param_device: 'cpu'
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
LOW_VRAM_YAML = """compute_environment: LOCAL_MACHINE
debug: true
deepspeed_config:
  deepspeed_config_file: examples/qwen_image/model_training/special/low_vram_training/ds_z3_cpuoffload.json
  zero3_init_flag: true
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
LOW_VRAM_JSON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": False, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e8,
        "stage3_max_reuse_distance": 1e8, "stage3_gather_16bit_weights_on_model_save": True},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                 "contiguous_memory_optimization": False},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# an FSDP2 config as `accelerate config` writes it
FSDP2_YAML = """compute_environment: LOCAL_MACHINE
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
mixed_precision: 'no'  # the run's default, as under zero3.yaml: the clipped norms compare
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
use_cpu: false
"""
# ZeRO-3 whose weights are all partitioned: DeepSpeed keeps parameters under 1e5 elements whole by default, which is
# every weight of the tiny models
ZERO3_YAML = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: ds_z3_all.json
  zero3_init_flag: true
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
use_cpu: false
"""
ZERO3_JSON = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
              "train_micro_batch_size_per_gpu": "auto"}

# DiffSynth's examples/qwen_image/model_training/full/Qwen-Image.sh, but for the program name and --dataset_repeat
# (50 -> 1)
QWEN_FULL = """
unitgraph train \\
  --dataset_base_path data/diffsynth_example_dataset/qwen_image/Qwen-Image \\
  --dataset_metadata_path data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv \\
  --max_pixels 1048576 \\
  --dataset_repeat 1 \\
  --model_id_with_origin_paths "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors" \\
  --learning_rate 1e-5 \\
  --num_epochs 2 \\
  --remove_prefix_in_ckpt "pipe.dit." \\
  --output_path "./models/train/Qwen-Image_full" \\
  --trainable_models "dit" \\
  --use_gradient_checkpointing \\
  --find_unused_parameters
"""
# examples/wanvideo/model_training/full/Wan2.1-T2V-14B.sh with its accelerate_config_14B.yaml (ZeRO-2 with parameter
# and optimizer offload), the release files replaced by the -Diffusers paths unitgraph's one line names for them
# (tests/test_diffsynth_ports.py), the sizes lowered: 480x832 -> 32x32, --dataset_repeat 100 -> 1, 81 -> 5 frames
WAN_14B_CONFIG = ZERO2_OFFLOAD.replace("offload_optimizer_device: 'cpu'", "offload_optimizer_device: cpu").replace(
    "offload_param_device: 'cpu'", "offload_param_device: cpu")
WAN_FULL = """
unitgraph train \\
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-14B \\
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-14B/metadata.csv \\
  --height 32 \\
  --width 32 \\
  --num_frames 5 \\
  --dataset_repeat 1 \\
  --model_id_with_origin_paths "Wan-AI/Wan2.1-T2V-14B-Diffusers:transformer/*.safetensors,Wan-AI/Wan2.1-T2V-14B-Diffusers:text_encoder/*.safetensors,Wan-AI/Wan2.1-T2V-14B-Diffusers:vae/*.safetensors" \\
  --learning_rate 1e-5 \\
  --num_epochs 2 \\
  --remove_prefix_in_ckpt "pipe.dit." \\
  --output_path "./models/train/Wan2.1-T2V-14B_full" \\
  --trainable_models "dit"
"""
LORA_TARGETS = "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1"
# examples/qwen_image/model_training/special/low_vram_training/Qwen-Image-LoRA.sh: both commands, --dataset_repeat
# 50 -> 2 and --num_epochs 5 -> 2 in the second
LOW_VRAM_STAGE1 = f"""
unitgraph train \\
  --dataset_base_path data/diffsynth_example_dataset/qwen_image/Qwen-Image \\
  --dataset_metadata_path data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv \\
  --max_pixels 1048576 \\
  --dataset_repeat 1 \\
  --model_id_with_origin_paths "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors" \\
  --learning_rate 1e-4 \\
  --num_epochs 5 \\
  --remove_prefix_in_ckpt "pipe.dit." \\
  --output_path "./models/train/Qwen-Image_lora-splited-cache" \\
  --lora_base_model "dit" \\
  --lora_target_modules "{LORA_TARGETS}" \\
  --lora_rank 32 \\
  --task "sft:data_process" \\
  --use_gradient_checkpointing \\
  --dataset_num_workers 8 \\
  --find_unused_parameters
"""
LOW_VRAM_STAGE2 = f"""
unitgraph train \\
  --dataset_base_path "./models/train/Qwen-Image_lora-splited-cache" \\
  --max_pixels 1048576 \\
  --dataset_repeat 2 \\
  --model_id_with_origin_paths "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors" \\
  --learning_rate 1e-4 \\
  --num_epochs 2 \\
  --remove_prefix_in_ckpt "pipe.dit." \\
  --output_path "./models/train/Qwen-Image_lora" \\
  --lora_base_model "dit" \\
  --lora_target_modules "{LORA_TARGETS}" \\
  --lora_rank 32 \\
  --task "sft:train" \\
  --use_gradient_checkpointing \\
  --dataset_num_workers 8 \\
  --find_unused_parameters \\
  --initialize_model_on_cpu
"""


def argv_of(script: str) -> list[str]:
    """The arguments of a ported script's one `unitgraph train` command, as bash gives them."""
    (words,) = commands(script)
    assert words[:2] == ["unitgraph", "train"]
    return words[1:]


def unsplit_of(stage2: list[str]) -> list[str]:
    """The unsplit run of a stage-2 command: the dataset and every model id instead of the cache."""
    out, skip = [], False
    for word in stage2:
        if skip:
            skip = False
            continue
        if word in ("--dataset_base_path", "--model_id_with_origin_paths", "--task"):
            skip = True
            continue
        out.append(word)
    return [*out, "--dataset_base_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image",
            "--dataset_metadata_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv",
            "--model_id_with_origin_paths", "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,"
            "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors",
            "--task", "sft"]


@pytest.fixture(scope="module")
def workdir(tiny, tmp_path_factory) -> Path:
    """A DiffSynth user's folder: its ./models, its example dataset, its accelerate configs at their paths."""
    root = tmp_path_factory.mktemp("engines")
    shutil.copytree(tiny, root / "models" / "Qwen" / "Qwen-Image")
    write_synthetic_dataset(root / "data" / "diffsynth_example_dataset" / "qwen_image" / "Qwen-Image", count=4,
                            size=32, seed=8)
    write_synthetic_dataset(root / "data" / "held", count=2, size=32, seed=9)  # --validation_dataset's samples
    full = root / "examples" / "qwen_image" / "model_training" / "full"
    low = root / "examples" / "qwen_image" / "model_training" / "special" / "low_vram_training"
    full.mkdir(parents=True)
    low.mkdir(parents=True)
    (full / "accelerate_config_zero2offload.yaml").write_text(ZERO2_OFFLOAD)
    (low / "deepspeed_zero3_cpuoffload.yaml").write_text(LOW_VRAM_YAML)
    (low / "ds_z3_cpuoffload.json").write_text(json.dumps(LOW_VRAM_JSON, indent=4))
    (root / "fsdp2.yaml").write_text(FSDP2_YAML)
    (root / "zero3.yaml").write_text(ZERO3_YAML)
    (root / "ds_z3_all.json").write_text(json.dumps(ZERO3_JSON))
    return root


def launch(workdir: Path, config: str, jobs: list[tuple], processes: int = 2) -> dict[str, str]:
    """`accelerate launch --config_file CONFIG --num_processes N` running each (argv, output[, env]) in turn, in
    `workdir`; each run's main-process output by its output folder."""
    spec = workdir / f"jobs-{Path(config).stem}.json"
    spec.write_text(json.dumps([{"argv": job[0], "output": str(workdir / job[1]), "env": job[2] if len(job) > 2 else {}}
                                for job in jobs]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "UNITGRAPH_", "FSDP_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                           "--num_processes", str(processes), "--main_process_port", "0", str(JOBS), str(spec)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    logs = {}
    for job in jobs:
        out = job[1]
        path = workdir / out
        log = path.parent / f"{path.name}.rank0.out"
        logs[out] = log.read_text() if log.exists() else ""
        code = path.parent / f"{path.name}.rank0.code"
        assert code.exists() and code.read_text() == "0", (out, logs[out][-3000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-3000:]
    return logs


def losses(folder: Path) -> list[float]:
    with (folder / "loss.csv").open() as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


def same_training(a: Path, b: Path, name: str) -> None:
    """Exactly the same losses and trained weights."""
    assert losses(a) == losses(b)
    left, right = load_file(str(a / name)), load_file(str(b / name))
    assert left.keys() == right.keys() and left
    for key in left:
        assert torch.equal(left[key], right[key]), key


def test_diffsynths_zero2_offload_full_training_runs_as_shipped_and_split_equals_unsplit(workdir):
    config = "examples/qwen_image/model_training/full/accelerate_config_zero2offload.yaml"
    full = argv_of(QWEN_FULL)
    logs = launch(workdir, config, [(full, "models/train/Qwen-Image_full"),
                                    ([*full, "--task", "sft:split"], "models/train/Qwen-Image_full-split")])
    lines = logs["models/train/Qwen-Image_full"].splitlines()
    first = lines[[n for n, line in enumerate(lines) if line.startswith("pipeline: ")][0]:]
    assert first[1] == (f"engine: DeepSpeed ZeRO-2 (optimizer offloaded to CPU) from accelerate launch, unsplit "
                        f"training, 2 processes"), first[:3]
    out = workdir / "models" / "train"
    same_training(out / "Qwen-Image_full", out / "Qwen-Image_full-split", "epoch-1.safetensors")
    weights = load_file(str(out / "Qwen-Image_full" / "epoch-1.safetensors"))
    assert any(k.startswith("transformer_blocks.0.") for k in weights)  # the whole DiT, trained, "pipe.dit." removed
    assert not any("lora" in k for k in weights)


def test_a_wan_full_training_script_runs_with_its_14b_config_and_split_equals_unsplit(workdir):
    pytest.importorskip("av")
    from unitgraph.backends.diffusion.families.wan import tiny as wan_tiny

    wan_tiny.write_tiny_models(workdir / "models" / "Wan-AI" / "Wan2.1-T2V-14B-Diffusers", size="test", seed=0,
                               pipeline="wan")
    write_synthetic_dataset(workdir / "data" / "diffsynth_example_dataset" / "wanvideo" / "Wan2.1-T2V-14B", count=2,
                            size=32, seed=2, videos=["video"], frames=9)
    config = workdir / "examples" / "wanvideo" / "model_training" / "full" / "accelerate_config_14B.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(WAN_14B_CONFIG)
    full = argv_of(WAN_FULL)
    logs = launch(workdir, str(config.relative_to(workdir)), [
        (full, "models/train/Wan2.1-T2V-14B_full"), ([*full, "--task", "sft:split"], "models/train/Wan2.1-T2V-14B_split")])
    assert "engine: DeepSpeed ZeRO-2 (optimizer offloaded to CPU) from accelerate launch, unsplit training, 2 processes" \
        in logs["models/train/Wan2.1-T2V-14B_full"]
    out = workdir / "models" / "train"
    same_training(out / "Wan2.1-T2V-14B_full", out / "Wan2.1-T2V-14B_split", "epoch-1.safetensors")


def test_diffsynths_low_vram_zero3_split_training_runs_as_shipped(workdir, user_shell):
    done = user_shell.script(LOW_VRAM_STAGE1, workdir)  # DiffSynth runs stage 1 without the engine config
    assert done.returncode == 0, done.stderr[-2000:]
    config = "examples/qwen_image/model_training/special/low_vram_training/deepspeed_zero3_cpuoffload.yaml"
    stage2 = argv_of(LOW_VRAM_STAGE2)
    logs = launch(workdir, config, [(stage2, "models/train/Qwen-Image_lora"),
                                    (unsplit_of(stage2), "models/train/Qwen-Image_lora-unsplit")])
    text = logs["models/train/Qwen-Image_lora"]
    assert ("engine: DeepSpeed ZeRO-3 (optimizer and parameters offloaded to CPU) from accelerate launch, "
            "stage 2 (train), 2 processes") in text
    assert "note: --initialize_model_on_cpu is how unitgraph always loads" in text
    out = workdir / "models" / "train"
    same_training(out / "Qwen-Image_lora", out / "Qwen-Image_lora-unsplit", "epoch-1.safetensors")
    assert len(losses(out / "Qwen-Image_lora")) == 8  # 4 samples x 2 repeats over 2 processes: 4 steps, 2 epochs


def test_zero3_partitions_the_weights_split_equals_unsplit_and_resumes_exactly(workdir):
    # at fp32 on every machine (the default is bf16 on a CPU with bf16 kernels): there the two ways of loading
    # (zero3_init_flag on and off) give the same partitions; at bf16 on such a CPU their first losses are 4e-4
    # apart (split == unsplit and the resume stay exact there too)
    base = ["train", "--model_paths", "models/Qwen/Qwen-Image", "--max_pixels", "1024", "--num_epochs", "1",
            "--learning_rate", "1e-3", "--no-progress", "--no-plot", "--seed", "3", "--mixed_precision", "no",
            "--dataset_base_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image",
            "--dataset_metadata_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv"]
    lora = [*base, "--lora_base_model", "dit", "--lora_rank", "4", "--max_grad_norm", "0.005"]
    full = [*base, "--trainable_models", "dit", "--num_epochs", "2", "--save_steps", "1"]
    whole = {"ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}  # the config's zero3_init_flag off for one run
    logs = launch(workdir, "zero3.yaml", [(lora, "z3/lora"), ([*lora, "--task", "sft:split"], "z3/lora-split"),
                                          ([*lora, "--task", "sft:split", *HELD_OUT], "z3/lora-held"),
                                          ([*lora, "--task", "sft:split", *SAMPLES], "z3/lora-samples"),
                                          (lora, "z3/lora-whole", whole),
                                          (full, "z3/full"), ([*full, "--task", "sft:split"], "z3/full-split"),
                                          ([*full, "--num_epochs", "1"], "z3/resumed"), ([*full, "--resume"], "z3/resumed")])
    held = [line for line in logs["z3/full"].splitlines() if "partitioned over 2 processes" in line]
    assert held, logs["z3/full"][-2000:]
    share = float(held[0].split("holds ")[1].split("%")[0])
    assert 45 < share < 55, held  # about half of the weights: the other process holds the rest
    # zero3_init_flag: built without weights and read into the partitions (models/shards.py), the LoRA's base too
    assert "read into the partitions one tensor at a time" in held[0]
    assert "its optimizer steps the fp32 weights' own partition (no master copy" in held[0]  # share_fp32_master
    assert "dit's weights partitioned over 2 processes" in logs["z3/lora"] and \
        "read into the partitions one tensor at a time" in logs["z3/lora"]
    # ... into the very partitions DeepSpeed cuts from a model loaded whole (the flag off): the same training
    assert "loaded whole first: zero3_init_flag is off" in logs["z3/lora-whole"]
    same_training(workdir / "z3" / "lora", workdir / "z3" / "lora-whole", "epoch-0.safetensors")
    same_training(workdir / "z3" / "lora", workdir / "z3" / "lora-split", "epoch-0.safetensors")
    same_training(workdir / "z3" / "full", workdir / "z3" / "full-split", "epoch-1.safetensors")
    # a killed ZeRO-3 run continues exactly: each process's partition of AdamW's state is in the training state
    state = sorted((workdir / "z3" / "resumed" / "state").iterdir())[-1]
    assert sorted(p.name for p in state.iterdir()) == ["optimizer-rank1.safetensors", "optimizer.safetensors",
                                                       "state.json", "trained.safetensors"]
    assert "resuming from" in logs["z3/resumed"]
    same_training(workdir / "z3" / "full", workdir / "z3" / "resumed", "epoch-1.safetensors")
    norms = [float(r["grad_norm"]) for r in csv.DictReader((workdir / "z3" / "lora" / "loss.csv").open())]
    assert norms and all(n > 0.005 for n in norms)


def test_fsdp2_shards_trains_split_equal_to_unsplit_and_resumes_exactly(workdir):
    base = ["train", "--model_paths", "models/Qwen/Qwen-Image", "--max_pixels", "1024", "--learning_rate", "1e-3",
            "--no-progress", "--no-plot", "--seed", "3", "--save_steps", "1", "--mixed_precision", "no",  # as ZeRO-3's
            "--dataset_base_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image",
            "--dataset_metadata_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv"]
    lora = [*base, "--lora_base_model", "dit", "--lora_rank", "4", "--num_epochs", "1", "--max_grad_norm", "0.005"]
    full = [*base, "--trainable_models", "dit"]
    logs = launch(workdir, "fsdp2.yaml", [
        (lora, "fsdp/lora"), ([*lora, "--task", "sft:split"], "fsdp/lora-split"),
        ([*lora, "--task", "sft:split", *HELD_OUT], "fsdp/lora-held"),
        ([*lora, "--task", "sft:split", *SAMPLES], "fsdp/lora-samples"),
        ([*full, "--num_epochs", "2"], "fsdp/full"), ([*full, "--num_epochs", "2", "--task", "sft:split"], "fsdp/full-split"),
        ([*full, "--num_epochs", "1"], "fsdp/resumed"), ([*full, "--num_epochs", "2", "--resume"], "fsdp/resumed"),
        ([*full, "--num_epochs", "1"], "fsdp/by-two")])
    text = logs["fsdp/full"]
    assert "engine: FSDP2 from accelerate launch, unsplit training, 2 processes" in text
    # built without weights, then each process read only its shard's rows from the files (models/shards.py)
    assert re.search(r"FSDP2: dit in 3 shard groups \(2 blocks and the rest; this process holds 50\.0% of its "
                     r"weights, read (4[5-9]|5[0-5])\.\d% of them from the files\)", text), text[-2000:]
    assert re.search(r"read (4[5-9]|5[0-5])\.\d% of them from the files", logs["fsdp/lora"])  # the LoRA's base too
    same_training(workdir / "fsdp" / "lora", workdir / "fsdp" / "lora-split", "epoch-0.safetensors")
    same_training(workdir / "fsdp" / "full", workdir / "fsdp" / "full-split", "epoch-1.safetensors")
    assert "resuming from" in logs["fsdp/resumed"]
    same_training(workdir / "fsdp" / "full", workdir / "fsdp" / "resumed", "epoch-1.safetensors")
    norms = [float(r["grad_norm"]) for r in csv.DictReader((workdir / "fsdp" / "lora" / "loss.csv").open())]
    assert norms and all(n > 0.005 for n in norms)  # clipped: the norm before clipping is logged


def test_an_fsdp2_state_continues_on_another_number_of_processes_from_an_epochs_end(workdir, monkeypatch, capsys):
    """The state two processes made at the end of an epoch (fsdp/by-two, in the launch above) continues on one
    under FSDP2, the whole tensors laid out in one process's shards. The reference is the same state continued on
    one process without an engine (its record relabelled: a state names the engine it was made under, and another
    engine is refused), whose restore is the plain one: both deal the next epoch to one process from the same
    weights and AdamW state, so they train the same numbers. The first epoch's rows are the two processes'."""
    made = workdir / "fsdp" / "by-two"
    if not (made / "loss.csv").exists():
        pytest.skip("made by the launch of the test above")
    for name in ("by-one-fsdp2", "by-one"):
        shutil.copytree(made, workdir / "fsdp" / name)
    for record in (workdir / "fsdp" / "by-one" / "state").glob("step-*/state.json"):
        data = json.loads(record.read_text())
        data["match"]["engine"] = None  # data parallel's label
        record.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    base = ["train", "--model_paths", "models/Qwen/Qwen-Image", "--max_pixels", "1024", "--learning_rate", "1e-3",
            "--no-progress", "--no-plot", "--seed", "3", "--trainable_models", "dit", "--num_epochs", "2",
            "--save_steps", "1", "--resume", "--mixed_precision", "no",
            "--dataset_base_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image",
            "--dataset_metadata_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv"]
    logs = launch(workdir, "fsdp2.yaml", [(base, "fsdp/by-one-fsdp2")], processes=1)
    assert "note: --resume: the state was made by 2 processes, this run has 1: its weights and AdamW's state are " \
           "restored whole into this run's shards, and from epoch 1 on each epoch's samples are dealt to 1 " \
           "processes (4 steps an epoch, 2 before)" in logs["fsdp/by-one-fsdp2"], logs["fsdp/by-one-fsdp2"][-2000:]
    monkeypatch.chdir(workdir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched process (OMP_NUM_THREADS=1): the same kernels' summation order
    try:
        code, out, err = cli(capsys, *base, "--output_path", "fsdp/by-one")
    finally:
        torch.set_num_threads(threads)
    assert code == 0 and "the state was made by 2 processes, this run has 1" in out, err[-2000:]
    one, two = losses(workdir / "fsdp" / "by-one"), losses(workdir / "fsdp" / "by-one-fsdp2")
    assert one[:2] == two[:2] == losses(made) and len(one) == len(two) == 6  # 2 steps on two processes, 4 on one
    # the first step on one process starts from the same restored weights: the same loss to the bit; after it the
    # two optimizers' steps (on a DTensor shard, on a plain tensor) agree to rounding, and so do the later losses
    assert one[2] == two[2]
    assert one[3:] == pytest.approx(two[3:], rel=1e-5)
    left, right = (load_file(str(workdir / "fsdp" / n / "epoch-1.safetensors")) for n in ("by-one", "by-one-fsdp2"))
    assert left.keys() == right.keys() and all(torch.allclose(left[k], right[k], rtol=1e-5, atol=1e-7) for k in left)


SMALL_LORA = ["train", "--model_paths", "models/Qwen/Qwen-Image", "--max_pixels", "1024", "--learning_rate", "1e-3",
              "--no-progress", "--no-plot", "--seed", "3", "--mixed_precision", "no", "--num_epochs", "1",
              "--dataset_base_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image",
              "--dataset_metadata_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv",
              "--lora_base_model", "dit", "--lora_rank", "4"]
VARIANTS = ("dora", "lokr", "loha")
EMA = [*SMALL_LORA, "--ema_decay", "0.5"]
EMA_TWO = [*EMA, "--num_epochs", "2"]
# torchrun's data parallel over gloo on a CPU: the reference the sharded engines' runs compare with
DDP_YAML = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\nnum_machines: 1\n" \
           "num_processes: 2\n"


def ema_runs(prefix: str) -> list[tuple]:
    """The EMA cases of an engine: unsplit, split, two epochs whole, and one epoch then resumed to two."""
    return [(EMA, f"{prefix}/unsplit"), ([*EMA, "--task", "sft:split"], f"{prefix}/split"), (EMA_TWO, f"{prefix}/whole"),
            (EMA, f"{prefix}/resumed"), ([*EMA_TWO, "--resume"], f"{prefix}/resumed")]


@pytest.fixture(scope="module")
def data_parallel(workdir) -> Path:
    """The 2-process data-parallel runs of the LoRA variants and of EMA, in one launch."""
    (workdir / "ddp.yaml").write_text(DDP_YAML)
    launch(workdir, "ddp.yaml", [*[([*SMALL_LORA, "--lora_type", k], f"ddp/{k}") for k in VARIANTS], (EMA, "ddp/ema")])
    return workdir / "ddp"


@pytest.fixture(scope="module")
def fsdp2_runs(workdir) -> dict[str, str]:
    """FSDP2's runs of the LoRA variants (unsplit and split) and of EMA, in one launch; their logs."""
    jobs = []
    for kind in VARIANTS:
        flags = [*SMALL_LORA, "--lora_type", kind]
        jobs += [(flags, f"fsdp-variants/{kind}"), ([*flags, "--task", "sft:split"], f"fsdp-variants/{kind}-split")]
    return launch(workdir, "fsdp2.yaml", [*jobs, *ema_runs("fsdp-ema")])


def test_dora_lokr_and_loha_train_under_fsdp2_as_under_data_parallel(workdir, fsdp2_runs, data_parallel):
    """FSDP2 gathers a block's weights whole before its forward, so peft's DoRA, LoKr and LoHa layers see them as
    without an engine (DoRA's magnitudes taken again from the rows read into the shards: models/shards.py
    dora_magnitudes): each trains under FSDP2, split exactly the unsplit run, and as data parallel on 2 processes
    does (to rounding; the first loss, the base model's, exactly)."""
    for kind in VARIANTS:
        assert "FSDP2: dit in" in fsdp2_runs[f"fsdp-variants/{kind}"], fsdp2_runs[f"fsdp-variants/{kind}"][-2000:]
        same_training(workdir / "fsdp-variants" / kind, workdir / "fsdp-variants" / f"{kind}-split",
                      "epoch-0.safetensors")
        ours, theirs = losses(workdir / "fsdp-variants" / kind), losses(data_parallel / kind)
        # the same training as data parallel's, to rounding (the engines reduce in other orders)
        assert len(ours) == 2 and ours[0] == theirs[0] and ours == pytest.approx(theirs, rel=1e-5)
        ours, theirs = (load_file(str(d / kind / "epoch-0.safetensors")) for d in (workdir / "fsdp-variants",
                                                                                   data_parallel))
        assert ours.keys() == theirs.keys() and all(torch.allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6)
                                                    for k in ours)


def check_ema(workdir: Path, prefix: str, reference: Path) -> None:
    """An engine's EMA runs: split equals unsplit with the EMA files, the average is data parallel's to rounding (and
    not the last weights), and the run resumed after its first epoch ends with the whole run's average."""
    same_training(workdir / prefix / "unsplit", workdir / prefix / "split", "epoch-0-ema.safetensors")
    ours, theirs = (load_file(str(p / "epoch-0-ema.safetensors")) for p in (workdir / prefix / "unsplit", reference))
    trained = load_file(str(workdir / prefix / "unsplit" / "epoch-0.safetensors"))
    assert ours.keys() == theirs.keys() == trained.keys() and ours
    assert all(torch.allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6) for k in ours)
    assert any(not torch.equal(ours[k], trained[k]) for k in ours)  # an average, not the last weights
    same_training(workdir / prefix / "whole", workdir / prefix / "resumed", "epoch-1-ema.safetensors")


def test_ema_under_zero2_is_data_parallels(workdir, data_parallel):
    """--ema_decay under ZeRO-2 (DiffSynth's offload config): every process holds the trained weights whole after
    DeepSpeed's step, so the moving average is kept as under data parallel."""
    logs = launch(workdir, "examples/qwen_image/model_training/full/accelerate_config_zero2offload.yaml",
                  ema_runs("z2-ema"))
    assert "resuming from" in logs["z2-ema/resumed"]
    check_ema(workdir, "z2-ema", data_parallel / "ema")


def test_ema_under_fsdp2_is_data_parallels(workdir, fsdp2_runs, data_parallel):
    """--ema_decay under FSDP2: each process averages its shards, a checkpoint and a training state gather the average
    whole, and a resume puts each process's rows back."""
    assert "FSDP2: dit in" in fsdp2_runs["fsdp-ema/unsplit"] and "resuming from" in fsdp2_runs["fsdp-ema/resumed"]
    check_ema(workdir, "fsdp-ema", data_parallel / "ema")


def test_the_held_out_loss_is_the_whole_models_under_both_sharded_engines(workdir):
    """--validation_dataset under ZeRO-3 and FSDP2: every process computes the held-out forward together (each
    gathers the layers it does not hold, as in training), the training is exactly the one without it, and the two
    engines' held-out losses agree as their trainings do (to rounding): no process evaluated its shard alone."""
    from unitgraph.backends.diffusion.train.held_out import read_held_out_csv

    held = {}
    for engine in ("z3", "fsdp"):
        if not (workdir / engine / "lora-held" / "loss.csv").exists():
            pytest.skip("runs with the tests above")
        same_training(workdir / engine / "lora-split", workdir / engine / "lora-held", "epoch-0.safetensors")
        held[engine] = read_held_out_csv(workdir / engine / "lora-held" / "validation_loss.csv")
        assert [(r["step"], r["samples"]) for r in held[engine]] == [(1, 2), (2, 2)], held[engine]
    assert [r["loss"] for r in held["z3"]] == pytest.approx([r["loss"] for r in held["fsdp"]], rel=1e-4)


def test_validation_samples_render_under_both_sharded_engines_as_the_pipeline_draws(workdir):
    """--validation_prompt under ZeRO-3 and FSDP2: every process renders, gathering the layers it does not hold, and
    the main process writes the sample, which is QwenImagePipeline's own drawing from the folder (the LoRA at 1e-30
    leaves the DiT as it was; one thread, as the launched processes)."""
    import diffusers
    from PIL import Image

    for engine in ("z3", "fsdp"):
        if not (workdir / engine / "lora-samples" / "samples.html").exists():
            pytest.skip("runs with the tests above")
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(workdir / "models" / "Qwen" / "Qwen-Image"))
    pipe.set_progress_bar_config(disable=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = pipe(prompt="a red circle", negative_prompt="", width=32, height=32, num_inference_steps=2,
                        true_cfg_scale=4.0, generator=torch.Generator().manual_seed(3 * 1000)).images[0]
    finally:
        torch.set_num_threads(threads)
    for engine in ("z3", "fsdp"):
        with Image.open(workdir / engine / "lora-samples" / "samples" / "epoch-0" / "0.png") as sample:
            assert sample.convert("RGB").tobytes() == expected.tobytes(), engine


def test_the_clipped_norm_is_the_global_one_under_both_sharded_engines(workdir):
    """ZeRO-3 and FSDP2 each reduce the norm over their own shards: the first step's norm (the same weights and
    gradients under both) agrees, so neither clips with a per-process norm."""
    first = []
    for run in ("z3/lora", "fsdp/lora"):
        path = workdir / run / "loss.csv"
        if not path.exists():
            pytest.skip("runs with the test above")
        first.append(float(next(csv.DictReader(path.open()))["grad_norm"]))
    assert first[0] == pytest.approx(first[1], rel=1e-4)

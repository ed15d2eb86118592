"""The memory plan per process under an engine (`unitgraph train --dry_run --config_file X --num_processes N`).

What matters, on the test-size Qwen-Image models and accelerate config files as `accelerate config` writes them:
- ZeRO-3 and FSDP2 split the LoRA base's weights over the processes (about 1/N each); ZeRO-2 keeps the weights
  whole and splits the gradients and AdamW's state; offload moves bytes from the device to `host_bytes`;
- stage 1 trains nothing and is the same under every engine; the frozen encoders of the unsplit run stay whole;
- the issue's target: at 2 processes, weights plus trainable state of a DiT trained in full are at most 0.55x
  data parallel's under ZeRO-3 and FSDP2;
- the JSON names the engine and the processes, the text says them in its first lines; a missing or malformed
  --config_file is one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.config import RunConfig  # noqa: E402
from unitgraph.backends.diffusion.memory_plan import memory_plan  # noqa: E402
from unitgraph.backends.diffusion.session import plan_for  # noqa: E402

TARGETS = "to_q,to_k,to_v,to_out.0"

# accelerate configs as `accelerate config` writes them (DiffSynth-Studio ships the DeepSpeed one)
DEEPSPEED_YAML = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: {offload}
  offload_param_device: {offload}
  zero3_init_flag: false
  zero_stage: {stage}
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
use_cpu: false
"""
# ZeRO-3 through a DeepSpeed config file that partitions every weight: by default DeepSpeed keeps each parameter of
# at most 1e5 elements whole on every process, which is every parameter of the test-size models
DEEPSPEED_FILE_YAML = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: {json}
  zero3_init_flag: false
distributed_type: DEEPSPEED
mixed_precision: bf16
num_machines: 1
num_processes: 8
"""
ZERO3_ALL = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                   "offload_optimizer": {"device": "{offload}"},
                                   "offload_param": {"device": "{offload}"}},
             "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
FSDP2_YAML = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_offload_params: {offload}
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
use_cpu: false
"""
DDP_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: bf16
num_machines: 1
num_processes: 8
"""


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("accelerate")
    texts = {"ddp": DDP_YAML,
             "fsdp2": FSDP2_YAML.format(offload="false"), "fsdp2_offload": FSDP2_YAML.format(offload="true"),
             "zero2": DEEPSPEED_YAML.format(stage=2, offload="none"),
             "zero2_offload": DEEPSPEED_YAML.format(stage=2, offload="cpu"),
             "zero3_default": DEEPSPEED_YAML.format(stage=3, offload="none")}
    for name, offload in (("zero3", "none"), ("zero3_offload", "cpu")):
        ds = folder / f"ds_{name}.json"
        ds.write_text(json.dumps(ZERO3_ALL).replace("{offload}", offload))
        texts[name] = DEEPSPEED_FILE_YAML.format(json=ds)
    paths = {}
    for name, text in texts.items():
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(text)
    return paths


def plan_of(folder: Path, config: Path | None = None, processes: int | None = None, full: bool = False) -> dict:
    flags = dict(model_paths=str(folder), dataset_base_path=str(folder), max_pixels=64 * 64, progress=False,
                 dry_run=True, mixed_precision="bf16")  # as the configs ask, whatever this machine's default is
    if full:
        flags["trainable_models"] = "dit"
    else:
        flags.update(lora_base_model="dit", lora_target_modules=TARGETS, lora_rank=4)
    if config is not None:
        flags["config_file"] = str(config)
    if processes is not None:
        flags["num_processes"] = processes
    cfg = RunConfig.from_args(make_args(**flags))
    return memory_plan(cfg, plan_for(cfg))


@pytest.fixture(scope="module")
def lora(tiny, configs) -> dict[str, dict]:
    """LoRA on the DiT over 4 processes under each engine (data parallel on one process: the plan as it was)."""
    plans = {"one": plan_of(tiny)}
    for name in ("ddp", "zero3", "zero3_offload", "zero3_default", "fsdp2", "fsdp2_offload"):
        plans[name] = plan_of(tiny, configs[name], 4)
    return plans


def dit(plan: dict, stage: str = "train") -> dict:
    return plan["stages"][stage]["models"]["dit"]


def frozen_params(plan: dict) -> int:
    """Elements of the DiT's frozen weights (bf16: 2 bytes each)."""
    return dit(plan)["bytes_by_dtype"]["bfloat16"] // 2


def test_zero3_and_fsdp2_split_the_lora_base_over_the_processes(lora):
    whole = dit(lora["one"])["weight_bytes"]
    assert whole == dit(lora["ddp"])["weight_bytes"] == 2 * frozen_params(lora["one"])
    for name in ("zero3", "fsdp2"):
        mine = dit(lora[name])["weight_bytes"]
        # a quarter, rounded up per parameter (the last shard of an odd dimension is padded)
        assert whole / 4 <= mine <= whole / 4 * 1.05, (name, mine, whole)
        assert dit(lora[name])["engine"]["whole_weight_bytes"] == whole and dit(lora[name])["engine"]["sharded_weights"]
        assert lora[name]["stages"]["train"]["gathered_bytes"] > 0  # whole weights in flight while a layer computes
    # DeepSpeed's default keeps every parameter of at most 1e5 elements whole: all of the test-size DiT
    assert dit(lora["zero3_default"])["weight_bytes"] >= whole


def test_stage1_and_the_frozen_encoders_are_the_same_under_every_engine(lora):
    first = lora["one"]["stages"]["data_process"]
    for name, plan in lora.items():
        assert plan["stages"]["data_process"] == first, name
        unsplit = plan["stages"]["unsplit"]["models"]
        for slot in ("text_encoder", "vae"):
            assert unsplit[slot] == lora["one"]["stages"]["unsplit"]["models"][slot], (name, slot)
            assert "engine" not in unsplit[slot]
    assert lora["ddp"]["stages"] == lora["one"]["stages"]  # data parallel: every process holds all of it


def test_offload_moves_the_shards_to_host_memory(lora):
    for name in ("zero3", "fsdp2"):
        on, off = lora[f"{name}_offload"]["stages"]["train"], lora[name]["stages"]["train"]
        assert on["host_bytes"] > 0 == off["host_bytes"], name
        assert on["weight_bytes"] + on["trainable_bytes"] < off["weight_bytes"] + off["trainable_bytes"], name
        assert on["host"]["weights"] > 0 and on["host"]["trainable"] > 0, name
        assert on["activation_bytes"] == off["activation_bytes"], name  # one process's batch, as without an engine
    fsdp = lora["fsdp2_offload"]["stages"]["train"]
    assert fsdp["weight_bytes"] == fsdp["trainable_bytes"] == 0  # the device holds only what is gathered
    shards = lora["fsdp2"]["stages"]["train"]
    assert fsdp["host_bytes"] == shards["weight_bytes"] + shards["trainable_bytes"]


@pytest.fixture(scope="module")
def full(tiny, configs) -> dict[str, dict]:
    """The DiT trained in full: data parallel and ZeRO-3 / FSDP2 over 2 processes, ZeRO-2 over 4."""
    plans = {name: plan_of(tiny, configs[name], 2, full=True) for name in ("ddp", "zero3", "fsdp2")}
    plans.update({name: plan_of(tiny, configs[name], 4, full=True) for name in ("zero2", "zero2_offload")})
    return plans


def test_zero2_splits_gradients_and_optimizer_state_but_not_the_weights(full):
    ddp = full["ddp"]["stages"]["train"]  # data parallel: per process as on one
    params = ddp["models"]["dit"]["trainable_params"]
    assert ddp["trainable_bytes"] == 16 * params and ddp["weight_bytes"] == 0  # all of the DiT trains
    zero2 = full["zero2"]["stages"]["train"]
    part = -(-params // 4)
    # the fp32 weights whole; the partition's gradient and AdamW's moments: 1/4 (the optimizer steps the weights'
    # own partition, no fp32 copy of it: train/engines.share_fp32_master)
    assert zero2["trainable_bytes"] == 4 * params + (4 + 8) * part
    assert zero2["host_bytes"] == 0 and zero2["engine_buffer_bytes"] == 4 * 500_000_000  # reduce_bucket_size
    offload = full["zero2_offload"]["stages"]["train"]
    assert offload["trainable_bytes"] == 4 * params  # only the weights stay on the device
    assert offload["host_bytes"] == offload["host"]["trainable"] == (4 + 4 + 8) * part


def test_zero3_and_fsdp2_hold_at_most_055x_of_data_parallel_at_two_processes(full):
    """The issue's target: a DiT trained in full over 2 processes, weights plus trainable state per process."""
    def held(plan: dict) -> int:
        stage = plan["stages"]["train"]
        return stage["weight_bytes"] + stage["trainable_bytes"]

    assert full["ddp"]["processes"] == 2 and full["ddp"]["engine"]["kind"] == "ddp"
    for name in ("zero3", "fsdp2"):
        plan = full[name]
        assert plan["processes"] == 2 and plan["engine"]["shards_frozen"], name
        assert held(plan) <= 0.55 * held(full["ddp"]), (name, held(plan), held(full["ddp"]))


def test_the_cli_names_the_engine_and_processes(capsys, tiny, configs):
    argv = ["train", "--model_paths", str(tiny), "--dataset_base_path", str(tiny), "--lora_base_model", "dit",
            "--lora_target_modules", TARGETS, "--lora_rank", "4", "--max_pixels", "4096", "--dry_run",
            "--config_file", str(configs["fsdp2"]), "--num_processes", "2"]
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["processes"] == 2 and plan["engine"]["kind"] == "fsdp2" and plan["engine"]["name"] == "FSDP2"
    for stage in plan["stages"].values():
        assert isinstance(stage["peak_bytes"], int) and isinstance(stage["host_bytes"], int)
        parts = sum(m["weight_bytes"] for m in stage["models"].values()) + stage["trainable_bytes"] + \
            stage["activation_bytes"] + stage["gathered_bytes"] + stage["engine_buffer_bytes"]
        assert stage["peak_bytes"] == parts
    code, out, err = cli(capsys, *argv)
    assert code == 0, err
    head = "\n".join(out.splitlines()[:3])
    assert "engine: FSDP2" in head and "2 processes" in head and "per process" in head


@pytest.mark.parametrize("text", [None, "distributed_type: [DEEPSPEED\n  zero_stage: 3\n"],
                         ids=["missing", "malformed"])
def test_a_missing_or_malformed_config_file_is_one_line(capsys, tiny, tmp_path, text):
    path = tmp_path / "accelerate.yaml"
    if text is not None:
        path.write_text(text)
    code, _, err = cli(capsys, "train", "--model_paths", str(tiny), "--dataset_base_path", str(tiny),
                       "--lora_base_model", "dit", "--dry_run", "--config_file", str(path))
    one_error_line(code, err, str(path))

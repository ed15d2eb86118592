"""Reading a run's engine (backends/diffusion/engine.py) and refusing what it cannot honour, in one process.

The engine comes from accelerate launch's environment, or for the dry run from an accelerate config file mapped to
that environment first: both readers are checked to agree, every malformed input is one line (exit 2) and leaves
the output folder as it was, and a property test feeds the config reader arbitrary YAML.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unitgraph.backends.diffusion import engine as engines
from unitgraph.backends.diffusion.engine import (Engine, check_batches, deepspeed_config, engine_from_config_file,
                                                 engine_from_env, launch_environment)
from unitgraph.backends.diffusion.errors import BackendError

from clitools import cli, one_error_line

ZERO2_OFFLOAD = """distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: 'cpu'
  offload_param_device: 'cpu'
  zero3_init_flag: false
  zero_stage: 2
mixed_precision: bf16
num_processes: 8
"""


def test_a_config_file_and_the_launch_environment_give_one_engine(tmp_path):
    path = tmp_path / "zero2offload.yaml"
    path.write_text(ZERO2_OFFLOAD)
    env = launch_environment(str(path), 2)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["WORLD_SIZE"] == "2"
    from_file = engine_from_config_file(str(path), 2)
    from_env = engine_from_env(env)
    assert from_file.to_json() == from_env.to_json()
    # ZeRO-2 keeps every weight on each process: the parameter offload DiffSynth's config asks for does nothing there
    assert (from_file.kind, from_file.zero_stage, from_file.offload_optimizer, from_file.offload_params) == \
        ("deepspeed", 2, True, False)
    assert from_file.shards_trained and not from_file.shards_frozen
    assert engine_from_config_file(str(path)).processes == 8  # the config's own count without the launch's
    # `mixed_precision: no` unquoted is YAML's false: read as the "no" it means
    path.write_text(ZERO2_OFFLOAD.replace("mixed_precision: bf16", "mixed_precision: no"))
    assert launch_environment(str(path), 2)["ACCELERATE_MIXED_PRECISION"] == "no"


def test_fsdp2_and_zero3_shard_the_frozen_base_and_data_parallel_nothing(tmp_path):
    fsdp = engine_from_env({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "4",
                            "FSDP_OFFLOAD_PARAMS": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "A,B"})
    assert (fsdp.kind, fsdp.processes, fsdp.offload_params, fsdp.layer_classes) == ("fsdp2", 4, True, ("A", "B"))
    assert fsdp.shards_frozen and fsdp.shards_trained
    assert fsdp.line("train") == "engine: FSDP2 (optimizer and parameters offloaded to CPU) from accelerate launch, " \
                                 "stage 2 (train), 4 processes"
    zero3 = engine_from_env({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    assert zero3.shards_frozen and zero3.name == "DeepSpeed ZeRO-3"
    assert "stage 1 trains nothing" in zero3.line("data_process")
    ddp = engine_from_env({})
    assert ddp.kind == "ddp" and not ddp.shards_trained and not ddp.shards_frozen


def test_the_deepspeed_config_decides_every_auto_and_leaves_precision_to_unitgraph(tmp_path):
    config = {"bf16": {"enabled": "auto"}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": 3, "sub_group_size": 1e9, "offload_param": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    engine = engine_from_env({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
                              "WORLD_SIZE": "2"})
    assert engine.zero_stage == 3 and engine.offload_params and not engine.offload_optimizer
    given = deepspeed_config(engine, batch_size=2, max_grad_norm=1.5)
    assert given["train_micro_batch_size_per_gpu"] == 2 and given["train_batch_size"] == 4
    assert given["gradient_accumulation_steps"] == 1  # the loop accumulates, the engine's boundary set by hand
    assert given["gradient_clipping"] == 1.5 and given["bf16"] == {"enabled": False}
    assert given["zero_optimization"]["sub_group_size"] == 10 ** 9 and isinstance(
        given["zero_optimization"]["sub_group_size"], int)
    assert deepspeed_config(engine, 1, None)["gradient_clipping"] == 0.0  # "auto" without --max_grad_norm: off


@pytest.mark.parametrize("config,fragment", [
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu is 4 but --batch_size is 1"),
    ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps is 8 in the engine's config"),
    ({"train_batch_size": 3}, "train_batch_size is 3 but --batch_size 1 x --gradient_accumulation_steps 1 x 2"),
])
def test_batch_settings_that_disagree_are_one_line(tmp_path, config, fragment):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **config}))
    engine = engine_from_env({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
                              "WORLD_SIZE": "2"})
    with pytest.raises(BackendError, match="make them agree") as exc:
        check_batches(engine, 1, 1)
    assert fragment in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize("env,fragment", [
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "/nonexistent/ds.json"}, "ds.json"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp_version: 2"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
     "--use_gradient_checkpointing"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "4"}, "ZeRO stage must be"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme"}, "nvme"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_FSDP": "true"}, "both DeepSpeed and FSDP"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
])
def test_an_engine_that_cannot_be_read_is_one_line(env, fragment):
    with pytest.raises(BackendError) as exc:
        engine_from_env(env)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("text,fragment", [
    ("{", "ds.json"),
    ("[1, 2]", "JSON object"),
    ('{"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}', "offload_optimizer must be a JSON object"),
    ('{"zero_optimization": {"stage": 2}, "gradient_clipping": "lots"}', "gradient_clipping must be a number"),
    ('{"zero_optimization": {"stage": 2}, "train_batch_size": -1}', "train_batch_size must be"),
])
def test_a_malformed_deepspeed_config_file_is_one_line_naming_it(tmp_path, text, fragment):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(BackendError) as exc:
        engine_from_env({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)})
    assert fragment in str(exc.value) and str(path) in str(exc.value)


def test_deepspeed_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setattr(engines, "deepspeed_available", lambda: False)
    with pytest.raises(BackendError, match=r"pip install 'unitgraph\[deepspeed\]'"):
        engine_from_env({"ACCELERATE_USE_DEEPSPEED": "true"})


yaml_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 10) | st.floats(allow_nan=True)
                           | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
config_keys = st.sampled_from(["distributed_type", "num_processes", "num_machines", "mixed_precision",
                               "deepspeed_config", "fsdp_config", "zero_stage", "fsdp_version"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(config_keys, yaml_values | st.sampled_from(["DEEPSPEED", "FSDP", "NO", "MULTI_GPU"]),
                            max_size=5),
       section=st.dictionaries(st.sampled_from(["zero_stage", "offload_optimizer_device", "offload_param_device",
                                                "fsdp_version", "fsdp_offload_params", "gradient_clipping",
                                                "gradient_accumulation_steps", "deepspeed_config_file"]),
                               yaml_values, max_size=4))
def test_the_config_reader_gives_an_engine_or_one_line_for_any_yaml(tmp_path, data, section):
    import yaml

    if data.get("distributed_type") in ("DEEPSPEED", "FSDP"):
        data["deepspeed_config" if data["distributed_type"] == "DEEPSPEED" else "fsdp_config"] = section
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        engine = engine_from_config_file(str(path))
    except BackendError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(engine, Engine) and engine.kind in engines.ENGINES and engine.processes >= 1


# --- through the command: one line, exit 2, the output folder untouched --------------------------------------

def _train(tiny: Path, tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "data"
    if not data.exists():
        from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

        write_synthetic_dataset(data, count=2, size=32, seed=1)
    return ["train", "--model_paths", str(tiny), "--dataset_base_path", str(data), "--dataset_metadata_path",
            str(data / "metadata.csv"), "--output_path", str(tmp_path / "out"), "--max_pixels", "1024", *extra]


@pytest.mark.parametrize("env,extra,fragment", [
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     ("--lora_base_model", "dit", "--blocks_to_swap", "1"), "--blocks_to_swap with DeepSpeed ZeRO-3"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
     ("--lora_base_model", "dit", "--fp8_models", "dit"), "--fp8_models with FSDP2"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
     ("--lora_base_model", "dit", "--trainable_models", "text_encoder"), "trains one model per engine"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     ("--lora_base_model", "dit", "--ema_decay", "0.9"), "--ema_decay with DeepSpeed ZeRO-3"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
     ("--lora_base_model", "dit", "--optimizer", "came"), "--optimizer came with FSDP2"),
    ({}, ("--lora_base_model", "dit", "--config_file", "x.yaml"), "--config_file and --num_processes go with --dry_run"),
    ({}, ("--enable_model_cpu_offload", "--lora_base_model", "dit"), "--blocks_to_swap N"),
    ({}, ("--enable_optimizer_cpu_offload", "--lora_base_model", "dit"), "offload_optimizer_device is cpu"),
    ({}, ("--max_grad_norm", "0", "--lora_base_model", "dit"), "--max_grad_norm must be a positive number"),
])
def test_what_an_engine_cannot_honour_is_one_line_before_anything_is_written(tiny, tmp_path, capsys, monkeypatch, env,
                                                                            extra, fragment):
    """Refused before the accelerator is made: an in-process DeepSpeed state would outlive the test (accelerate keeps
    one per process), so the test also checks none was made."""
    for name in [n for n in __import__("os").environ if n.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from accelerate.state import AcceleratorState

    code, _, err = cli(capsys, *_train(tiny, tmp_path, *extra))
    one_error_line(code, err, fragment)
    assert not (tmp_path / "out").exists()
    assert AcceleratorState._shared_state.get("distributed_type") != "DEEPSPEED"


def test_a_dry_run_config_file_that_is_missing_or_malformed_is_one_line(tiny, tmp_path, capsys):
    code, _, err = cli(capsys, *_train(tiny, tmp_path, "--lora_base_model", "dit", "--dry_run", "--config_file",
                                       str(tmp_path / "missing.yaml")))
    one_error_line(code, err, "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\ndeepspeed_config: [1, 2]\n")
    code, _, err = cli(capsys, *_train(tiny, tmp_path, "--lora_base_model", "dit", "--dry_run", "--config_file",
                                       str(bad)))
    one_error_line(code, err, "deepspeed_config must be a mapping", "bad.yaml")
    other = tmp_path / "tpu.yaml"
    other.write_text("distributed_type: XLA\n")
    code, _, err = cli(capsys, *_train(tiny, tmp_path, "--lora_base_model", "dit", "--dry_run", "--config_file",
                                       str(other)))
    one_error_line(code, err, "distributed_type XLA")


def test_held_bytes_counts_each_weight_and_each_moment_once():
    """What a run prints as the memory it holds: the weights' bytes, and AdamW's two moments of each (its step
    counters are scalars, left out); a tensor met twice (tied, or a view handed out anew at every call, as a DTensor's
    local part is) counts once."""
    import torch

    from unitgraph.backends.diffusion.train.engines import held_bytes

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    weights, state = held_bytes({"m": model, "same": model}, optimizer)
    assert weights == (12 + 3) * 4 and state == 2 * (12 + 3) * 4

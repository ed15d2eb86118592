"""Which distributed engine a run trains under, read from accelerate's launch (or, for the dry run, its config file).

`accelerate launch --config_file X` turns a config's `distributed_type` and its `deepspeed_config` / `fsdp_config`
sections into environment variables (`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_ZERO_STAGE`,
`ACCELERATE_USE_FSDP`, `FSDP_VERSION`, ...) before it starts the processes. `engine_from_env` reads exactly those,
so a run is configured the way every accelerate script is; `engine_from_config_file` maps a config file to the
same variables first, so `unitgraph train ... --dry_run --config_file X --num_processes N` plans the run that
`accelerate launch --config_file X --num_processes N unitgraph train ...` would make, through one reader.

Three engines:

* **ddp** (data parallel, accelerate's default): every process holds every weight.
* **deepspeed**: ZeRO stage 1 (optimizer state sharded), 2 (and gradients), 3 (and the weights, the frozen base
  under a LoRA included), with optimizer and parameter offload; the engine is made by `accelerator.prepare`.
* **fsdp2**: torch's `fully_shard` on each transformer block, then on the model: weights, gradients and optimizer
  state are sharded. accelerate's FSDP plugin falls back to DDP on a CPU (shared/ENGINE_NOTES.md), so unitgraph
  applies `fully_shard` itself, the call accelerate's FSDP2 plugin makes, on every device: the code path the
  tests run on CPU processes is the one a GPU run takes.

Precision stays unitgraph's under every engine (DESIGN section 9): frozen weights in the compute dtype, trained
parameters in fp32 under autocast. A DeepSpeed config's `fp16` / `bf16` sections ("auto" in DiffSynth's) are
therefore turned off for DeepSpeed itself, which would otherwise cast the LoRA to bf16, and autocast does the rest.
No torch here.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .errors import BackendError

__all__ = ["Engine", "ENGINES", "engine_from_env", "engine_from_config_file", "launch_environment",
           "deepspeed_config"]

ENGINES = ("ddp", "deepspeed", "fsdp2")
DEEPSPEED_EXTRA = "pip install 'unitgraph[deepspeed]'"
_TRUE = ("true", "1", "yes")


@dataclass(frozen=True)
class Engine:
    """A run's engine, as the launch configured it."""

    kind: str = "ddp"
    processes: int = 1
    zero_stage: int = 0  # DeepSpeed's ZeRO stage (0: not DeepSpeed)
    offload_optimizer: bool = False  # optimizer state (and its step) in CPU memory
    offload_params: bool = False  # ZeRO-3's / FSDP2's weights in CPU memory between uses
    zero3_init: bool = False  # DeepSpeed's zero3_init_flag
    reshard_after_forward: bool = True  # FSDP2: free the gathered weights after each block's forward
    layer_classes: tuple[str, ...] = ()  # FSDP2: the classes to shard one by one (default: the transformer blocks)
    config_file: Optional[str] = None  # DeepSpeed's deepspeed_config_file
    config: Mapping[str, Any] = field(default_factory=dict)  # its contents (a JSON object)
    gradient_clipping: Optional[float] = None  # the launch's or the DeepSpeed config's, when a number
    accumulation: Optional[int] = None  # the launch's or the DeepSpeed config's gradient_accumulation_steps
    micro_batch: Optional[int] = None  # the DeepSpeed config's train_micro_batch_size_per_gpu, when a number
    train_batch: Optional[int] = None  # the DeepSpeed config's train_batch_size, when a number
    source: str = ""  # where it came from, for messages

    @property
    def shards_frozen(self) -> bool:
        """Whether the frozen weights (a LoRA's base) are sharded over the processes."""
        return self.kind == "fsdp2" or (self.kind == "deepspeed" and self.zero_stage == 3)

    @property
    def shards_trained(self) -> bool:
        """Whether the trained weights' gradients or optimizer state are sharded."""
        return self.kind == "fsdp2" or (self.kind == "deepspeed" and self.zero_stage >= 1)

    @property
    def name(self) -> str:
        if self.kind == "deepspeed":
            return f"DeepSpeed ZeRO-{self.zero_stage}"
        return {"fsdp2": "FSDP2", "ddp": "data parallel"}[self.kind]

    def describe(self) -> str:
        """The engine in a few words: 'DeepSpeed ZeRO-2 (optimizer and parameters offloaded to CPU)'."""
        offloaded = [what for what, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_params))
                     if on]
        text = self.name
        if offloaded:
            text += f" ({' and '.join(offloaded)} offloaded to CPU)"
        if self.kind == "fsdp2" and not self.reshard_after_forward:
            text += " (weights kept gathered from forward to backward)"
        return text

    def line(self, stage: str) -> str:
        """The run's first line about its engine: 'engine: FSDP2, stage 2 (train), 2 processes'."""
        n = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        if stage == "data_process" and self.kind != "ddp":
            return (f"engine: {self.describe()} from {self.source}, stage 1 (data_process), {n}: stage 1 trains "
                    "nothing, so it computes each entry once over the processes as without an engine")
        what = {"": "unsplit training", "train": "stage 2 (train)", "split": "stage 1 then stage 2 (split)",
                "data_process": "stage 1 (data_process)"}[stage]
        source = f" from {self.source}" if self.source else ""
        return f"engine: {self.describe()}{source}, {what}, {n}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.describe(), "zero_stage": self.zero_stage,
                "offload_optimizer": self.offload_optimizer, "offload_params": self.offload_params,
                "shards_frozen": self.shards_frozen, "shards_trained": self.shards_trained}


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    value = env.get(name)
    return default if value is None or value == "" else value.strip().lower() in _TRUE


def _number(value: Any, what: str, source: str, integer: bool = False) -> Optional[float]:
    """A config value that is a number, None for "auto" or absent; anything else is one line."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "none", "")):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BackendError(f"{what} must be a number or \"auto\", got {value!r}", source=source) from None
    if not math.isfinite(number) or number < 0 or (integer and (number != int(number) or number < 1)):
        raise BackendError(f"{what} must be {'a positive whole number' if integer else 'a finite number >= 0'} "
                           f"or \"auto\", got {value!r}", source=source)
    return int(number) if integer else number


def _processes(env: Mapping[str, str]) -> int:
    try:
        return max(1, int(env.get("WORLD_SIZE") or 1))
    except ValueError:
        raise BackendError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r} (from the launch) is not a whole number") from None


def engine_from_env(environ: Optional[Mapping[str, str]] = None, source: str = "accelerate launch") -> Engine:
    """The engine `accelerate launch` configured (its environment variables), checked: DeepSpeed installed, its
    config file readable and sound, FSDP at version 2. Without either variable: data parallel."""
    env = os.environ if environ is None else environ
    processes = _processes(env)
    deepspeed = _flag(env, "ACCELERATE_USE_DEEPSPEED")
    fsdp = _flag(env, "ACCELERATE_USE_FSDP")
    if deepspeed and fsdp:
        raise BackendError("the launch asks for both DeepSpeed and FSDP; an accelerate config has one distributed_type",
                           source=source)
    if fsdp:
        return _fsdp(env, processes, source)
    if deepspeed:
        return _deepspeed(env, processes, source)
    return Engine(kind="ddp", processes=processes)


def _fsdp(env: Mapping[str, str], processes: int, source: str) -> Engine:
    version = (env.get("FSDP_VERSION") or "1").strip()
    if version != "2":
        raise BackendError(f"FSDP version {version}: unitgraph shards with FSDP2 (torch's fully_shard); set "
                           "fsdp_version: 2 in the accelerate config (or --fsdp_version 2)", source=source)
    if _flag(env, "FSDP_ACTIVATION_CHECKPOINTING"):
        raise BackendError("fsdp_activation_checkpointing: give --use_gradient_checkpointing instead (unitgraph "
                           "checkpoints the trained models' blocks itself, under every engine)", source=source)
    classes = tuple(c.strip() for c in (env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or "").split(",") if c.strip())
    reshard = (env.get("FSDP_RESHARD_AFTER_FORWARD") or "true").strip().lower()
    if reshard not in ("true", "false", "full_shard", "shard_grad_op", "1", "0", "yes", "no"):
        raise BackendError(f"fsdp_reshard_after_forward must be true or false, got {reshard!r}", source=source)
    return Engine(kind="fsdp2", processes=processes, offload_params=_flag(env, "FSDP_OFFLOAD_PARAMS"),
                  offload_optimizer=_flag(env, "FSDP_OFFLOAD_PARAMS"),
                  reshard_after_forward=reshard in ("true", "full_shard", "1", "yes"), layer_classes=classes,
                  source=source)


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _deepspeed(env: Mapping[str, str], processes: int, source: str) -> Engine:
    if not deepspeed_available():
        raise BackendError(f"the launch asks for DeepSpeed, which is not installed: {DEEPSPEED_EXTRA}", source=source)
    config_file = (env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "").strip()
    config: dict[str, Any] = {}
    if config_file and config_file.lower() != "none":
        from unitgraph.userfiles import read_user_json

        config = read_user_json(config_file, BackendError, "a DeepSpeed config (JSON)")
        if not isinstance(config, dict):
            raise BackendError("a DeepSpeed config must be a JSON object", source=config_file)
    else:
        config_file = ""
    where = config_file or source
    zero = config.get("zero_optimization", {}) if config else {}
    if not isinstance(zero, dict):
        raise BackendError("zero_optimization must be a JSON object", source=where)
    stage = zero.get("stage") if config_file else env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    stage = _number(stage if stage is not None else 0, "zero_optimization.stage", where)
    if stage is None or stage not in (0, 1, 2, 3):
        raise BackendError(f"the ZeRO stage must be 0, 1, 2 or 3, got {stage!r}", source=where)

    def offload(key: str, env_name: str) -> bool:
        if config_file:
            section = zero.get(key) or {}
            if not isinstance(section, dict):
                raise BackendError(f"zero_optimization.{key} must be a JSON object", source=where)
            device = str(section.get("device") or "none").lower()
        else:
            device = (env.get(env_name) or "none").strip().lower()
        if device not in ("none", "cpu", "nvme"):
            raise BackendError(f"{key} device must be none, cpu or nvme, got {device!r}", source=where)
        if device == "nvme":
            raise BackendError(f"{key} to nvme is not supported by unitgraph; offload to cpu", source=where)
        return device == "cpu"

    clipping = config.get("gradient_clipping") if config_file else env.get("ACCELERATE_GRADIENT_CLIPPING")
    accumulation = config.get("gradient_accumulation_steps") if config_file else \
        env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    engine = Engine(kind="deepspeed", processes=processes, zero_stage=int(stage),
                    offload_optimizer=offload("offload_optimizer", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                    offload_params=offload("offload_param", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
                    zero3_init=_flag(env, "ACCELERATE_DEEPSPEED_ZERO3_INIT"), config_file=config_file or None,
                    config=config, gradient_clipping=_number(clipping, "gradient_clipping", where),
                    accumulation=_number(accumulation, "gradient_accumulation_steps", where, integer=True),
                    micro_batch=_number(config.get("train_micro_batch_size_per_gpu"),
                                        "train_micro_batch_size_per_gpu", where, integer=True),
                    train_batch=_number(config.get("train_batch_size"), "train_batch_size", where, integer=True),
                    source=source)
    if engine.offload_params and engine.zero_stage != 3:
        # ZeRO-2 keeps every weight on each process; DeepSpeed ignores the parameter offload there
        engine = Engine(**{**engine.__dict__, "offload_params": False})
    return engine


def check_batches(engine: Engine, batch_size: int, accumulation: int) -> None:
    """A DeepSpeed config's batch numbers, when it gives numbers, agree with the run's flags (one line otherwise)."""
    if engine.kind != "deepspeed":
        return
    where = engine.config_file or engine.source
    if engine.micro_batch is not None and engine.micro_batch != batch_size:
        raise BackendError(f"train_micro_batch_size_per_gpu is {engine.micro_batch} but --batch_size is {batch_size}; "
                           "make them agree (or set it to \"auto\")", source=where)
    if engine.accumulation is not None and engine.accumulation != accumulation:
        raise BackendError(f"gradient_accumulation_steps is {engine.accumulation} in the engine's config but "
                           f"--gradient_accumulation_steps is {accumulation}; make them agree (or set it to \"auto\")",
                           source=where)
    total = batch_size * accumulation * engine.processes
    if engine.train_batch is not None and engine.train_batch != total:
        raise BackendError(f"train_batch_size is {engine.train_batch} but --batch_size {batch_size} x "
                           f"--gradient_accumulation_steps {accumulation} x {engine.processes} processes is {total}; "
                           "make them agree (or set it to \"auto\")", source=where)


def deepspeed_config(engine: Engine, batch_size: int, max_grad_norm: Optional[float]) -> dict[str, Any]:
    """What DeepSpeed is given: the config's own sections with every "auto" decided by the run.

    unitgraph steps the optimizer itself at the end of each optimizer step (the engine's accumulation boundary
    set by hand), so DeepSpeed sees one micro-batch a step and never rescales a loss; clipping is --max_grad_norm
    (else the config's number); the precision sections are off (the module docstring says why); a client AdamW
    is allowed with optimizer offload (DeepSpeed's CPU Adam would round differently from the unsplit run's); ZeRO-3's
    memory-efficient linear is off (see below).
    """
    config = {key: value for key, value in engine.config.items() if key not in ("fp16", "bf16", "optimizer",
                                                                                 "scheduler")}
    config["train_micro_batch_size_per_gpu"] = batch_size
    config["gradient_accumulation_steps"] = 1
    config["train_batch_size"] = batch_size * engine.processes
    clip = max_grad_norm if max_grad_norm is not None else engine.gradient_clipping
    config["gradient_clipping"] = float(clip or 0.0)
    config["fp16"], config["bf16"] = {"enabled": False}, {"enabled": False}
    config["zero_force_ds_cpu_optimizer"] = False
    config["zero_allow_untested_optimizer"] = True
    config.setdefault("steps_per_print", 2 ** 62)
    config.setdefault("wall_clock_breakdown", False)
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = engine.zero_stage
    zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}),
                                 "device": "cpu" if engine.offload_optimizer else "none"}
    zero["offload_param"] = {**(zero.get("offload_param") or {}), "device": "cpu" if engine.offload_params else "none"}
    # ZeRO-3's memory-efficient linear: the engine's conversion of the model to partitions replaces
    # torch.nn.functional.linear for the rest of the process (deepspeed's zero.Init(module=...)), so the frozen
    # models outside the engine (an unsplit run's encoders) would round otherwise than stage 1 did without an
    # engine: off, so split equals unsplit under ZeRO-3
    zero["memory_efficient_linear"] = False
    for key in ("offload_optimizer", "offload_param"):
        zero[key].pop("nvme_path", None)
        if zero[key]["device"] == "none":
            zero[key] = {"device": "none"}
    for key, value in list(zero.items()):  # DiffSynth's json gives sizes as floats (5e7); DeepSpeed wants ints
        if isinstance(value, float) and value.is_integer() and key != "stage":
            zero[key] = int(value)
    config["zero_optimization"] = zero
    return config


# --- accelerate's config file, as the launch would turn it into the environment ------------------------------

_DEEPSPEED_KEYS = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
}
_FSDP_KEYS = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
}


def launch_environment(path: str, num_processes: Optional[int] = None) -> dict[str, str]:
    """The environment variables `accelerate launch --config_file PATH [--num_processes N]` sets for the engine
    (and the precision and process count), read from the config file as the launch reads it."""
    from unitgraph.userfiles import read_user_yaml

    data = read_user_yaml(path, BackendError, "an accelerate config (YAML or JSON)")
    if not isinstance(data, dict):
        raise BackendError("an accelerate config is a mapping of settings (as `accelerate config` writes it)",
                           source=path)
    kind = str(data.get("distributed_type") or "NO").upper()
    known = ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP")
    if kind not in known:
        raise BackendError(f"distributed_type {kind} is not an engine unitgraph trains with (one of "
                           f"{', '.join(known)})", source=path)
    processes = num_processes if num_processes is not None else data.get("num_processes", 1)
    machines = data.get("num_machines", 1)
    try:
        processes, machines = int(processes), int(machines)
    except (TypeError, ValueError):
        raise BackendError("num_processes and num_machines must be whole numbers", source=path) from None
    if processes < 1:
        raise BackendError(f"num_processes must be at least 1, got {processes}", source=path)
    env = {"WORLD_SIZE": str(processes)}
    if data.get("mixed_precision") is not None:  # an unquoted `no` is YAML's false
        value = data["mixed_precision"]
        env["ACCELERATE_MIXED_PRECISION"] = "no" if value is False else str(value).lower()
    sections = {"DEEPSPEED": ("deepspeed_config", _DEEPSPEED_KEYS, "ACCELERATE_USE_DEEPSPEED"),
                "FSDP": ("fsdp_config", _FSDP_KEYS, "ACCELERATE_USE_FSDP")}
    if kind in sections:
        name, keys, flag = sections[kind]
        section = data.get(name) or {}
        if not isinstance(section, dict):
            raise BackendError(f"{name} must be a mapping of settings", source=path)
        env[flag] = "true"
        for key, variable in keys.items():
            if section.get(key) is not None:
                value = section[key]
                env[variable] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def engine_from_config_file(path: str, num_processes: Optional[int] = None) -> Engine:
    """The engine an accelerate config file (with the launch's --num_processes) gives: `launch_environment` read
    by `engine_from_env`, the one reader of an engine."""
    return engine_from_env(launch_environment(path, num_processes), source=path)

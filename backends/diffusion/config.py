"""The flags, turned once into small typed configs that each part of the backend reads.

`TrainArgs` (args.py) is the command line as DiffSynth-Studio spells it; `RunConfig.from_args`
checks it against the chosen family and splits it into what each part needs: the dataset
(`DataConfig`), where models come from (`ModelConfig`, offline mode included), the unit settings
that cache keys record (`context.UnitSettings`), the optimisation (`OptimConfig`), the LoRA
(`LoraSpec`) and the outputs (`OutputConfig`). No torch here.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .args import MIXED_PRECISION, TrainArgs, split_list
from .context import CACHE_DTYPES, DTYPE, ImageSize, UnitSettings
from .engine import Engine, check_batches, engine_from_config_file, engine_from_env
from .errors import BackendError
from .models.precision import COMPUTE_DTYPES
from .family import Family, PipelineDef
from .flowmatch import with_vae_latents
from .models.hub import Hub
from .models.sources import ModelSources
from .choice import choose
from .experts import choose_expert


def offline_from_env(environ: Any = None) -> bool:
    """Whether model ids resolve from local files only (hub.OFFLINE_VARIABLES; read once, where flags are parsed)."""
    return Hub.from_env(environ=environ).offline


@dataclass(frozen=True)
class DataConfig:
    base_path: str
    metadata_path: Optional[str]
    file_keys: tuple[str, ...]
    extra_inputs: tuple[str, ...]
    repeat: int = 1
    num_workers: int = 0
    num_frames: int = 81  # frames per video clip


@dataclass(frozen=True)
class ModelConfig:
    """Where the models come from (DiffSynth's flags) and whether the network may be used."""

    model_paths: Optional[str] = None
    model_id_with_origin_paths: Optional[str] = None
    tokenizer_path: Optional[str] = None
    cache_dir: Optional[str] = None
    offline: bool = False
    hub: Hub = field(default_factory=Hub)  # where model ids are found (DiffSynth's ./models, the modelscope cache)
    processor_path: Optional[str] = None  # DiffSynth's --processor_path (a multimodal processor folder or model id)
    tokenizer_2_path: Optional[str] = None  # the second text encoder's tokenizer (DiffSynth's --tokenizer_2_path in two-encoder families)
    expert: Optional[str] = None  # the expert of a two-expert denoiser the run loads in its slot (experts.py)
    boundary_ratio: Optional[float] = None  # between the experts, when known: a validation sample renders with both

    def sources(self, family: Family, offline: Optional[bool] = None) -> ModelSources:
        """The family's slots resolved from these arguments (`offline` overrides the setting); the expert slot
        from the chosen expert's subfolder. Made once per run and family (this config object), so a run reads its
        folders' configs and headers once however many of its parts ask."""
        hub = self.hub if offline is None or offline == self.hub.offline else \
            replace(self.hub, offline=offline, offline_reason=self.hub.offline_reason or "comparing stage-1 models")
        memo = _SOURCES.get(id(self))
        if memo is None:
            memo = _SOURCES[id(self)] = {}
            weakref.finalize(self, _SOURCES.pop, id(self), None)
        key = (family.name, hub)
        if key not in memo:
            memo[key] = ModelSources(family.with_expert(self.expert), self.model_paths, self.model_id_with_origin_paths,
                                     self.tokenizer_path, self.cache_dir, offline=hub.offline, hub=hub,
                                     processor_path=self.processor_path, tokenizer_2_path=self.tokenizer_2_path)
        return memo[key]


_SOURCES: dict[int, dict[Any, ModelSources]] = {}  # id(ModelConfig) -> its sources by (family, hub)


@dataclass(frozen=True)
class LoraSpec:
    base_model: Optional[str] = None
    targets: tuple[str, ...] = ()
    rank: int = 32
    alpha: Optional[float] = None
    checkpoint: Optional[str] = None
    preset_path: Optional[str] = None
    preset_model: Optional[str] = None


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    num_epochs: int = 1
    accumulation: int = 1
    batch_size: int = 1
    trainable: tuple[str, ...] = ()
    gradient_checkpointing: bool = False
    find_unused_parameters: bool = False
    lr_scheduler: str = "diffsynth"  # train/lr.py
    lr_warmup_steps: int = 0
    max_grad_norm: Optional[float] = None  # clip the trained gradients' global norm (None: no clipping)


@dataclass(frozen=True)
class PrecisionConfig:
    """How the models are held and computed (models/precision.py has the rules)."""

    mixed: str = "no"  # accelerate's name: no, fp16, bf16
    compute_dtype: str = DTYPE  # torch dtype name of frozen weights and autocast
    fp8: tuple[str, ...] = ()  # frozen slots stored in float8_e4m3fn
    checkpoint_offload: bool = False  # activations checkpointing keeps held in CPU memory
    blocks_to_swap: int = 0  # transformer blocks of the LoRA base model kept in CPU memory


ACCELERATE_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"  # set by `accelerate launch --mixed_precision` and its config


# The variables accelerate parses as truth values (accelerate.utils.environment.str_to_bool raises a ValueError on any
# other word, deep inside the Accelerator) and as integers: each checked once where the flags are, in one line.
ACCELERATE_TRUE = ("1", "y", "yes", "t", "true", "on")
ACCELERATE_FALSE = ("0", "n", "no", "f", "false", "off")
ACCELERATE_FLAGS = ("ACCELERATE_DEBUG_MODE", "ACCELERATE_INIT_INCLUDE_BUFFERS", "ACCELERATE_ENABLE_RICH",
                    "ACCELERATE_CPU_AFFINITY", "FORK_LAUNCHED", "USE_TORCH_XLA")
ACCELERATE_FLAG_PREFIXES = ("ACCELERATE_USE_", "ACCELERATE_DYNAMO_USE_")
ACCELERATE_FSDP_FLAGS = ("FSDP_OFFLOAD_PARAMS", "FSDP_USE_ORIG_PARAMS", "FSDP_SYNC_MODULE_STATES",
                         "FSDP_FORWARD_PREFETCH", "FSDP_ACTIVATION_CHECKPOINTING", "FSDP_CPU_RAM_EFFICIENT_LOADING")
ACCELERATE_INTEGERS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "PMI_SIZE",
                       "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def check_environment(environ: Any = None) -> None:
    """Refuse, naming the variable, an environment accelerate would fail on with a traceback after the models load
    (`ACCELERATE_USE_CPU=maybe`): its truth-valued variables must be one of its words, its counts integers."""
    environ = os.environ if environ is None else environ
    for name in sorted(environ):
        value = str(environ[name])  # accelerate lowers the case, nothing else
        flag = name in ACCELERATE_FLAGS or name in ACCELERATE_FSDP_FLAGS or name.startswith(ACCELERATE_FLAG_PREFIXES)
        if flag and value.lower() not in (*ACCELERATE_TRUE, *ACCELERATE_FALSE):
            raise BackendError(f"environment variable {name}={value!r} is not a truth value accelerate reads: use one "
                               f"of {', '.join(ACCELERATE_TRUE)} or {', '.join(ACCELERATE_FALSE)}")
        number = value.strip().removeprefix("-")
        if name in ACCELERATE_INTEGERS and value.strip() and not (number.isascii() and number.isdigit()):
            raise BackendError(f"environment variable {name}={value!r} is not an integer (accelerate and torch read it "
                               "as one)")


def mixed_precision(args: TrainArgs, environ: Any = None) -> str:
    """--mixed_precision, else accelerate's launch flag or config (its environment variable) when it asks for fp16
    or bf16, else `default_precision()`: bf16 as DiffSynth trains, or fp32 on a CPU without bf16 kernels.

    `accelerate launch` sets the variable to "no" whenever neither its flag nor a config names a precision, so "no"
    there cannot tell fp32 from nothing asked: training in fp32 is `--mixed_precision no` on unitgraph's own flags.
    """
    if args.mixed_precision:
        return args.mixed_precision
    env = (os.environ if environ is None else environ).get(ACCELERATE_PRECISION_ENV, "").strip().lower()
    if env in ("fp16", "bf16"):
        return env
    if env and env != "no":
        raise BackendError(f"{ACCELERATE_PRECISION_ENV}={env!r} (from accelerate launch or its config): expected one of "
                           f"{', '.join(MIXED_PRECISION)}")
    return default_precision()


def default_precision() -> str:
    """bf16 (DiffSynth's precision) on a CUDA device and on a CPU with bf16 kernels (oneDNN's: AVX-512 BF16 or
    AMX), else fp32 ("no"). Without them torch emulates bf16 with plain loops: measured on a 2-core AVX2 CPU, a
    test-size Qwen-Image VAE encode of a 128x128 image took 12.4 s in bf16 and 0.21 s in fp32, 60 times longer.
    The run says which it chose (`precision_note`); --mixed_precision bf16 asks for bf16 anyway."""
    import torch

    if torch.cuda.is_available() or cpu_has_bf16():
        return "bf16"
    return "no"


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bf16 with oneDNN's kernels (torch's own check of it)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch build without oneDNN
        return False


def precision_note(args: TrainArgs, mixed: str) -> Optional[str]:
    """The line a run prints when the default precision is fp32 because the CPU has no bf16 kernels: "no" without
    the flag is the default's (accelerate's launch variable asks only for fp16 or bf16, `mixed_precision`)."""
    if args.mixed_precision or mixed != "no":
        return None
    return ("note: computing in fp32: this CPU has no bf16 kernels (torch would emulate bf16 about 60 times slower); "
            "--mixed_precision bf16 asks for it anyway")


def check_device_precision(mixed: str) -> None:
    """fp16 needs an accelerator: on a CPU torch has no fp16 training path (no loss scaling) worth using."""
    if mixed != "fp16":
        return
    import torch

    if not torch.cuda.is_available():
        raise BackendError("--mixed_precision fp16 needs a CUDA device (none here); use bf16 or no")


def fp8_slots(args: TrainArgs, family: Family, pipeline: PipelineDef, sources: Any) -> tuple[str, ...]:
    """The slots --fp8_models names: slot names, or (DiffSynth's form) the same model paths or ids the command gives
    in --model_paths / --model_id_with_origin_paths. A trained model, or a name that loads nothing, is refused."""
    items = split_list(args.fp8_models)
    if not items:
        return ()
    models = pipeline.spec().models
    slots: list[str] = []
    for item in items:
        slot = item if item in models else sources.slot_of(item) if sources is not None else None
        if slot is None or slot not in models:
            raise BackendError(f"--fp8_models {item!r} names no model this run loads (models of {pipeline.name}: "
                               f"{', '.join(models)}; or a path or id given in --model_paths / --model_id_with_origin_paths)")
        if slot in args.trainable():
            raise BackendError(f"--fp8_models {item!r}: {slot} is in --trainable_models; a model whose weights train "
                               "cannot be stored in fp8 (its LoRA base may be)")
        slots.append(slot)
    return tuple(dict.fromkeys(slots))


@dataclass(frozen=True)
class OutputConfig:
    path: str
    remove_prefix: Optional[str] = None
    save_steps: Optional[int] = None
    plot: bool = True
    progress: bool = True
    overwrite: bool = False
    lora_format: str = "diffusers"
    resume: Optional[str] = None  # "latest" (the newest state in the output folder) or a state folder
    save_total_limit: Optional[int] = 1  # the newest state only (--save_total_limit; 0 keeps them all)
    report_to: str = "none"  # accelerate's trackers: tensorboard, wandb


@dataclass(frozen=True)
class ValidationConfig:
    prompts: tuple[str, ...] = ()
    steps: Optional[int] = None  # every N optimizer steps; None: at each checkpoint
    inference_steps: int = 20


@dataclass(frozen=True)
class RunConfig:
    """One run, fully decided: the family and pipeline, the task's stage, and every part's settings."""

    args: TrainArgs
    family: Family
    pipeline: PipelineDef
    task: str  # the task family: sft, direct_distill
    stage: str  # "" (unsplit), data_process, train, split
    cache_mode: str
    cache_path: Optional[str]
    seed: int
    units: UnitSettings
    data: DataConfig
    models: ModelConfig
    optim: OptimConfig
    lora: LoraSpec
    output: OutputConfig
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    notes: tuple[str, ...] = field(default=())
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    choice: str = ""  # "pipeline: NAME (why)", the line a run and a dry run print first (choice.py)
    engine: Engine = field(default_factory=Engine)  # the distributed engine (engine.py): data parallel by default

    @classmethod
    def from_args(cls, args: TrainArgs, environ: Any = None) -> "RunConfig":
        args.validate()
        check_environment(environ)
        chosen = choose(args)
        family, pipeline = chosen.family, chosen.pipeline
        pipeline = with_vae_latents(pipeline, args.vae_latents)
        models = pipeline.spec().models
        if args.lora_base_model and args.lora_base_model not in models:
            raise BackendError(f"--lora_base_model {args.lora_base_model!r} is not a model of pipeline {pipeline.name} "
                               f"(models: {', '.join(models)})")
        for name in args.trainable():
            if name not in models:
                raise BackendError(f"--trainable_models: {name!r} is not a model of pipeline {pipeline.name} "
                                   f"(models: {', '.join(models)})")
        preset_model = args.preset_lora_model or args.lora_base_model
        if args.preset_lora_path and preset_model not in models:
            raise BackendError("--preset_lora_path needs --preset_lora_model (or --lora_base_model) naming a model of the pipeline")
        targets = tuple(args.lora_targets())
        if args.lora_base_model and targets:
            targets = family.slot(args.lora_base_model).lora_modules(targets)
        if args.lora_base_model and not targets:
            targets = family.slot(args.lora_base_model).lora_targets
            if not targets:
                raise BackendError(f"--lora_base_model {args.lora_base_model}: this family has no default LoRA targets "
                                   "for it; pass --lora_target_modules")
        mixed = mixed_precision(args, environ)
        if not args.dry_run:  # the memory plan of an fp16 run can be made on a machine without CUDA
            check_device_precision(mixed)
        compute = COMPUTE_DTYPES[mixed]
        cache_dtype = CACHE_DTYPES[args.cache_dtype] if args.cache_dtype else compute
        hub = Hub.from_env(args.modelscope_cache_dir, environ)
        expert = choose_expert(args, family)
        model_config = ModelConfig(args.model_paths, args.model_id_with_origin_paths, args.first_tokenizer_path(),
                                   args.modelscope_cache_dir, offline=hub.offline, hub=hub,
                                   processor_path=args.processor_path, tokenizer_2_path=args.tokenizer_2_path,
                                   expert=expert.expert, boundary_ratio=expert.ratio)
        fp8 = fp8_slots(args, family, pipeline, _sources_for_names(model_config, family, args))
        if args.blocks_to_swap and not args.lora_base_model:
            raise BackendError("--blocks_to_swap moves blocks of a frozen LoRA base model; give --lora_base_model")
        engine = run_engine(args, environ)
        check_engine(args, engine, fp8)
        notes = [chosen.line, *([expert.line] if expert.line else [])]
        if args.align_to_opensource_format:
            notes.append("note: --align_to_opensource_format: LoRA files are written in the diffusers format "
                         "(--lora_format), which diffusers' load_lora_weights and ComfyUI read; DiffSynth's own "
                         "kohya-style renaming is not done")
        workers = args.dataset_num_workers
        cores = usable_cores()
        if workers > cores:
            notes.append(f"note: --dataset_num_workers {workers} capped at {cores}, the cores this process may use")
            workers = cores
        return cls(
            args=args, family=family, pipeline=pipeline, task=args.family, stage=args.stage, cache_mode=args.cache_mode,
            cache_path=args.cache_path, seed=args.seed,
            units=UnitSettings(image_size=ImageSize(args.height, args.width, args.max_pixels), seed=args.seed,
                               timestep_bounds=expert.bounds,
                               dtype=compute, cache_dtype=cache_dtype, loss_weighting=args.loss_weighting,
                               derived_inputs=tuple(n for n in args.extra_input_names() if n in pipeline.derived_inputs)),
            data=DataConfig(args.dataset_base_path, args.dataset_metadata_path, tuple(args.file_keys()),
                            tuple(n for n in args.extra_input_names() if n not in pipeline.derived_inputs),
                            args.dataset_repeat, workers, args.num_frames),
            models=model_config,
            optim=OptimConfig(args.learning_rate, args.weight_decay, args.num_epochs, args.gradient_accumulation_steps,
                              args.batch_size, tuple(args.trainable()),
                              args.use_gradient_checkpointing or args.use_gradient_checkpointing_offload,
                              args.find_unused_parameters, args.lr_scheduler, args.lr_warmup_steps,
                              args.max_grad_norm),
            lora=LoraSpec(args.lora_base_model, targets, args.lora_rank, args.lora_alpha, args.lora_checkpoint,
                          args.preset_lora_path, preset_model if args.preset_lora_path else None),
            output=OutputConfig(args.output_path, args.remove_prefix_in_ckpt, args.save_steps, args.plot, args.progress,
                                args.overwrite, args.lora_format, args.resume, args.save_total_limit, args.report_to),
            precision=PrecisionConfig(mixed, compute, fp8, args.use_gradient_checkpointing_offload, args.blocks_to_swap),
            notes=tuple(notes),
            choice=chosen.line,
            engine=engine,
            validation=ValidationConfig(tuple(args.validation_prompt or ()), args.validation_steps,
                                        args.validation_inference_steps),
        )

    @property
    def prefixes(self) -> dict[str, str]:
        """Checkpoint key prefix of each model slot (its diffusers pipeline attribute)."""
        return {s.name: s.lora_prefix or s.name for s in self.family.slots if s.kind == "model"}


def run_engine(args: TrainArgs, environ: Any = None) -> Engine:
    """The run's engine: a dry run's --config_file / --num_processes, else what accelerate launch set up."""
    if args.config_file is not None:
        return engine_from_config_file(args.config_file, args.num_processes)
    engine = engine_from_env(environ)
    if args.num_processes is not None:
        engine = replace(engine, processes=args.num_processes)
    return engine


def check_engine(args: TrainArgs, engine: Engine, fp8: tuple[str, ...]) -> None:
    """What an engine cannot honour with the run's other flags, refused in one line before anything is written."""
    if engine.kind == "ddp" or args.stage == "data_process":
        return
    check_batches(engine, args.batch_size, args.gradient_accumulation_steps)
    if args.blocks_to_swap:
        raise BackendError(f"--blocks_to_swap with {engine.name}: the engine places the model's weights itself; "
                           + ("its parameter offload keeps them in CPU memory instead (offload_param_device: cpu / "
                              "fsdp_offload_params: true)" if engine.kind != "deepspeed" or engine.zero_stage == 3
                              else "use ZeRO-3 with offload_param_device: cpu to keep weights in CPU memory"),
                           source=engine.source)
    if fp8 and engine.shards_frozen:
        raise BackendError(f"--fp8_models with {engine.name}: float8 weights are not sharded here (the processes "
                           "gather weights in their storage dtype); drop --fp8_models or use ZeRO-1/2 or data parallel",
                           source=engine.source)
    if args.validation_prompt and (engine.kind == "fsdp2" or engine.shards_frozen):
        raise BackendError(f"--validation_prompt with {engine.name}: validation samples are rendered by one process, "
                           "which holds only its shard of the weights here; render from a checkpoint after training, "
                           "or train under ZeRO-1/2 or data parallel", source=engine.source)
    trained = [*args.trainable(), *([args.lora_base_model] if args.lora_base_model else [])]
    if engine.kind == "deepspeed" and len(set(trained)) > 1:
        raise BackendError(f"{engine.name} trains one model per engine and this run trains {len(set(trained))} "
                           f"({', '.join(dict.fromkeys(trained))}); train them under FSDP2 or data parallel, or one "
                           "at a time", source=engine.source)


def _sources_for_names(models: ModelConfig, family: Family, args: TrainArgs) -> Any:
    """The model sources, only when --fp8_models names something other than slots (DiffSynth's path/id form)."""
    names = split_list(args.fp8_models)
    if not names or all(name in {s.name for s in family.slots} for name in names):
        return None
    from .models.folders import ModelLoadError

    try:
        return models.sources(family)
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def choose_pipeline(args: TrainArgs) -> tuple[Family, PipelineDef]:
    """(family, pipeline) the run trains: --pipeline NAME, else what the command's models and dataset name
    (choice.py, which also says why)."""
    chosen = choose(args)
    return chosen.family, chosen.pipeline


__all__ = ["DataConfig", "LoraSpec", "ModelConfig", "OptimConfig", "OutputConfig", "RunConfig", "choose_pipeline",
           "offline_from_env"]

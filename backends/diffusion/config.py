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

from .args import DIFFSYNTH_PIPELINE_FLAGS, MIXED_PRECISION, TrainArgs, split_list
from .caption_dropout import with_caption_dropout
from .data.masks import with_masked_loss
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
from .train.optimizers import OPTIMIZERS, parse_optimizer_args


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
    # --dataset_config: the datasets (data/dataset_config.DatasetSpec) in place of base_path/metadata_path/repeat
    datasets: tuple[Any, ...] = ()
    config_path: Optional[str] = None
    # --validation_dataset: the held-out samples stage 1 caches apart (a DatasetSpec), whose loss stage 2 logs
    held_out: Any = None


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
    kind: str = "lora"  # --lora_type: lora, dora, lokr or loha (models/lora.add_lora)
    rslora: bool = False  # --use_rslora


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
    optimizer: str = "adamw"  # --optimizer (train/optimizers.py)
    optimizer_args: dict[str, Any] = field(default_factory=dict)  # --optimizer_args, parsed
    ema_decay: Optional[float] = None  # --ema_decay: a moving average of the trained weights (train/ema.py)
    ema_device: Optional[str] = None  # where it is kept (None: the training device)


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
    use_ema: bool = False  # --validation_use_ema: rendered with the moving average of the weights
    guidance: Optional[float] = None  # --validation_guidance; None: the pipeline's own default (its render module's)
    negative_prompts: tuple[str, ...] = ()  # --validation_negative_prompt: one for all prompts, or one per prompt
    seed: Optional[int] = None  # --validation_seed; None: --seed
    images: tuple[str, ...] = ()  # --validation_image: one per prompt (edit image, first frame)


def check_objective_flags(args: TrainArgs, pipeline: Any) -> None:
    """Refuse, in one line, an objective flag the pipeline's units do not read: Min-SNR (--snr_gamma) is the DDPM
    families' weight, diffusers' SD3 weights (--weighting_scheme sigma_sqrt|cosmap) the flow-matching families';
    a setting no unit declares would otherwise change nothing, silently."""
    from .flowmatch import SD3_WEIGHTINGS

    read = {name for unit in pipeline.units for name in unit.settings}
    if args.snr_gamma is not None and "snr_gamma" not in read:
        raise BackendError(f"--snr_gamma: pipeline {pipeline.name} does not train with a DDPM objective (Min-SNR "
                           "weighs the UNet families' loss); weigh a flow-matching loss with --weighting_scheme")
    if args.loss_weighting in SD3_WEIGHTINGS and "loss_weighting" not in read:
        raise BackendError(f"--weighting_scheme {args.loss_weighting}: pipeline {pipeline.name} draws no flow-matching "
                           "sigma to weigh by (a DDPM family: use --snr_gamma)")
    if args.timestep_sampling != "diffsynth" and "timestep_sampling" not in read:
        raise BackendError(f"--timestep_sampling {args.timestep_sampling}: pipeline {pipeline.name} draws no training "
                           "timestep (its loss does not sample one)")


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
        for name, (family, pipeline) in DIFFSYNTH_PIPELINE_FLAGS.items():
            if getattr(args, name) is not None:
                raise BackendError(f"--{name}: a flag of DiffSynth's {family}, which unitgraph trains through "
                                   f"DiffSynth's own pipeline only (--pipeline {pipeline}, docs/diffsynth.md)")
        check_environment(environ)
        datasets = dataset_specs(args)
        held_out = held_out_spec(args)
        chosen = choose(args)
        family, pipeline = chosen.family, chosen.pipeline
        pipeline = with_vae_latents(pipeline, args.vae_latents)
        pipeline = with_caption_dropout(pipeline, args.caption_dropout, [*args.trainable(), args.lora_base_model])
        pipeline = with_masked_loss(pipeline, args.masked_loss)
        check_objective_flags(args, pipeline)
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
        if args.lora_type == "dora" and args.stage != "data_process":
            if args.lora_base_model in fp8:
                raise BackendError(f"--lora_type dora with --fp8_models {args.lora_base_model}: DoRA normalises the "
                                   "base weight with the adapter at every step, which float8 storage does not keep; "
                                   "train a plain LoRA on an fp8 base, or DoRA without --fp8_models")
            if engine.kind == "deepspeed" and engine.zero_stage == 3:
                raise BackendError(f"--lora_type dora with {engine.name}: DoRA reads each base weight whole at every "
                                   "step, and ZeRO-3 partitions the frozen base outside its forward hooks; train "
                                   "--lora_type lora here, or DoRA under FSDP2, ZeRO-1/2 or data parallel",
                                   source=engine.source)
        if args.lora_type in ("lokr", "loha") and args.stage != "data_process":
            name = {"lokr": "LoKr", "loha": "LoHa"}[args.lora_type]
            if args.lora_base_model in fp8:
                raise BackendError(f"--lora_type {args.lora_type} with --fp8_models {args.lora_base_model}: unitgraph's "
                                   "float8 storage tells a LoRA's tensors (lora_A/lora_B) from the model's own, not "
                                   f"{name}'s factors; train {name} without --fp8_models, or a LoRA on the fp8 base")
            if engine.kind == "deepspeed" and engine.zero_stage == 3:
                raise BackendError(f"--lora_type {args.lora_type} with {engine.name}: peft's {name} layer reads its "
                                   "base weight's shape at every step, which ZeRO-3 partitions away; train it under "
                                   "FSDP2, ZeRO-1/2 or data parallel", source=engine.source)
        notes = [chosen.line, *([expert.line] if expert.line else [])]
        lycoris = args.lora_type in ("lokr", "loha")
        if args.align_to_opensource_format and lycoris:
            notes.append("note: --align_to_opensource_format: a LoKr or LoHa is written in LyCORIS' layout, which "
                         "ComfyUI reads")
        elif args.align_to_opensource_format:
            notes.append("note: --align_to_opensource_format: LoRA files are written in ComfyUI's layout "
                         "(--lora_format comfyui: the release checkpoint's module names under diffusion_model., "
                         "where DiffSynth writes kohya's lora_unet_ spelling of the same names)")
        if args.output_format() == "comfyui" and args.lora_base_model and args.stage != "data_process" \
                and family.slot(args.lora_base_model).comfyui is None:
            raise BackendError(f"--lora_format comfyui holds the denoiser's LoRA in its release names, and "
                               f"--lora_base_model {args.lora_base_model} has none here; write --lora_format diffusers")
        if lycoris and args.remove_prefix_in_ckpt and args.stage != "data_process":
            notes.append(f"note: --remove_prefix_in_ckpt {args.remove_prefix_in_ckpt}: the {args.lora_type} adapter's "
                         "keys are LyCORIS' own (lycoris_<module>, lora_unet_<module>) and keep their prefix; it strips "
                         "only the keys of models trained in full")
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
                               timestep_sampling=args.sampling(), snr_gamma=args.snr_gamma,
                               caption_dropout=float(args.caption_dropout),
                               masked_loss=float(args.masked_loss_unmasked_weight) if args.masked_loss else None,
                               derived_inputs=tuple(n for n in args.extra_input_names() if n in pipeline.derived_inputs)),
            data=DataConfig(args.dataset_base_path, args.dataset_metadata_path, tuple(args.file_keys()),
                            tuple(n for n in args.extra_input_names() if n not in pipeline.derived_inputs),
                            args.dataset_repeat, workers, args.num_frames, datasets, args.dataset_config,
                            held_out),
            models=model_config,
            optim=OptimConfig(args.learning_rate, args.weight_decay, args.num_epochs, args.gradient_accumulation_steps,
                              args.batch_size, tuple(args.trainable()),
                              args.use_gradient_checkpointing or args.use_gradient_checkpointing_offload,
                              args.find_unused_parameters, args.lr_scheduler, args.lr_warmup_steps,
                              args.max_grad_norm, args.optimizer, parse_optimizer_args(args.optimizer_args),
                              args.ema_decay, args.ema_device),
            lora=LoraSpec(args.lora_base_model, targets, args.lora_rank, args.lora_alpha, args.lora_checkpoint,
                          args.preset_lora_path, preset_model if args.preset_lora_path else None,
                          args.lora_type, bool(args.use_rslora)),
            output=OutputConfig(args.output_path, args.remove_prefix_in_ckpt, args.save_steps, args.plot, args.progress,
                                args.overwrite, args.output_format(), args.resume, args.save_total_limit, args.report_to),
            precision=PrecisionConfig(mixed, compute, fp8, args.use_gradient_checkpointing_offload, args.blocks_to_swap),
            notes=tuple(notes),
            choice=chosen.line,
            engine=engine,
            validation=ValidationConfig(tuple(args.validation_prompt or ()), args.validation_steps,
                                        args.validation_inference_steps, args.validation_use_ema,
                                        args.validation_guidance, tuple(args.validation_negative_prompt or ()),
                                        args.validation_seed, tuple(args.validation_image or ())),
        )

    @property
    def prefixes(self) -> dict[str, str]:
        """Checkpoint key prefix of each model slot (its diffusers pipeline attribute)."""
        return self.family.lora_prefixes()


def dataset_specs(args: TrainArgs) -> tuple[Any, ...]:
    """The datasets of --dataset_config (none without it); stage 2 reads only their shares and settings, so their
    folders need not be there."""
    if not args.dataset_config:
        return ()
    from .data.dataset_config import read_dataset_config

    return read_dataset_config(args.dataset_config, check_files=args.stage != "train")


def held_out_spec(args: TrainArgs) -> Any:
    """The held-out samples as a dataset: --validation_dataset (files relative to the metadata file's folder), or the
    `validation = true` table of --dataset_config; checked to be there where stage 1 reads them; None without."""
    from .data.dataset_config import config_held_out, held_out_dataset

    check = args.stage != "train"
    table = config_held_out(args.dataset_config, check_files=check) if args.dataset_config else None
    if table is not None and args.validation_dataset:
        raise BackendError(f"--validation_dataset and the `validation = true` dataset {table.name!r} of "
                           "--dataset_config both name held-out samples: give one of them", source=args.dataset_config)
    if table is not None and args.stage == "":
        raise BackendError(f"dataset {table.name!r} (`validation = true`): the held-out loss is computed from stage "
                           f"1's cache entries; train with --task {args.family}:split (or :data_process, then :train)",
                           source=args.dataset_config)
    if table is not None:
        return table
    if not args.validation_dataset:
        return None
    return held_out_dataset(args.validation_dataset, check_files=check)


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
    if args.ema_decay is not None and engine.kind == "deepspeed" and engine.zero_stage == 3:
        raise BackendError(f"--ema_decay with {engine.name}: ZeRO-3 partitions the trained weights outside the steps "
                           "(their data is empty between forwards), so no average can be taken of them; train under "
                           "FSDP2, ZeRO-1/2 or data parallel, or without --ema_decay", source=engine.source)
    spec = OPTIMIZERS.get(args.optimizer)
    if args.optimizer != "adamw" and (engine.kind != "fsdp2" or spec is None or spec.not_sharded):
        why = ("DeepSpeed steps its own partitions with AdamW here (a training state keeps AdamW's state per "
               "partition)" if engine.kind == "deepspeed" else f"{spec.label if spec else args.optimizer}: "
               f"{spec.not_sharded if spec else 'unknown'}")
        raise BackendError(f"--optimizer {args.optimizer} with {engine.name}: {why}; under an engine train with adamw"
                           f"{' or schedulefree' if engine.kind == 'fsdp2' else ''}, or under data parallel",
                           source=engine.source)
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

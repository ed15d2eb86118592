"""`unitgraph train --pipeline diffsynth:MODULE`: DiffSynth's pipeline trained unsplit, or split through a cache.

One step, in every task, is `train_step` on a state: torch's global stream seeded from (--seed, epoch, sample), the
plan's training units run in the pipeline's order through DiffSynth's `unit_runner`, then the task's own DiffSynth
loss (`FlowMatchSFTLoss` for `sft`, `DirectDistillLoss` for `direct_distill`). The state comes from running the
plan's data_process units (`sft`, `direct_distill`) or from the sample's cache entry (`...:train`), which
`...:data_process` wrote after running the same units on the same inputs: that is the whole argument for split ==
unsplit (see the package docstring for the draws).

The parts around the step are DiffSynth's runner's by default: AdamW with --learning_rate and --weight_decay,
torch's ConstantLR with its defaults (unitgraph's --optimizer, --lr_scheduler, --ema_decay and --max_grad_norm
change them as for its own families; --caption_dropout, --timestep_sampling, --weighting_scheme and --masked_loss
change the step: captions.py, objective.py), one sample per micro-step (--gradient_accumulation_steps of them a step, on each
process of a launch: world.py; sharded under DeepSpeed ZeRO or FSDP2: sharding.py), the LoRA injected by DiffSynth's
`add_lora_to_model` (peft) and written each epoch as `epoch-N.safetensors` by DiffSynth's
`export_trainable_state_dict` (keys without --remove_prefix_in_ckpt, DiffSynth's default `pipe.dit.`), which its
`pipe.load_lora` reads. The epoch's order is unitgraph's seeded permutation, not the DataLoader's draw from the
global stream.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import json
import math
import re
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

from unitgraph.atomic import write_bytes_atomic
from unitgraph.plan import split
from unitgraph.prune import prune

from ..args import TrainArgs
from ..caption_dropout import check_caption_dropout
from ..cache.entries import read_entry, write_entry
from ..cache.keys import HASHES, HashMemo, canonical_hash
from ..cache.store import LocalStore
from ..data.dataset import DiffusionDataset
from ..context import ImageSize
from ..errors import BackendError
from ..masked_loss import MASK
from ..models.hub import Hub
from ..randomness import derive_seed, permutation, seeded_global_stream
from ..result import RunResult
from . import EXTRA_HINT, available
from .captions import EMPTY_CAPTION, applied, difference, dropped, emptied
from .glue import Glue, call_types, glue_for, glues, inputs, provided
from .objective import LOSS_MASK, check_objective, mask_pixels, sft_loss
from .world import World, launched
from .lora import DIFFSYNTH_REMOVE_PREFIX, helper, target_modules
from .hazards import UnitHazard, check_unit, install_skeletons, state_identities
from .planning import live_projection, loss_overwrites, seeded_units
from .samples import SAMPLES_DIR, Renderer
from .state import (load_optimizer, load_state, newest_state, optimizer_tensors, prune_states, save_rank_file,
                    save_state, settings_of, staging_folder)
from .sharding import ShardedTraining
from ..train.ema import TrainedEMA, ema_name, optional_swap
from ..train.held_out import FILE as HELD_OUT_FILE, HeldOutLog
from ..train.lr import make_lr_schedule, step as lr_step
from ..train.optimizers import build_optimizer, check_optimizer, eval_weights
from .models import (ModelFile, find_models, load_pipeline, load_tensor, named_models, pipeline_class_of,
                     planned_models, skeleton, tensor_file, tokenizer_folder, with_fp8)

__all__ = ["run", "wanted", "MANIFEST"]

MANIFEST = "unitgraph-diffsynth-cache.json"
HELD_OUT = "held_out"  # the held-out samples' part of the cache (--validation_dataset)
FORMAT = "unitgraph.diffsynth-cache/v1"
TASKS = ("sft", "sft:data_process", "sft:train", "direct_distill", "direct_distill:data_process",
         "direct_distill:train")
# the flags this source reads; any other flag set away from its default is refused in one line
READ = {"dataset_base_path", "dataset_metadata_path", "dataset_repeat", "data_file_keys", "extra_inputs", "pipeline",
        "model_paths", "model_id_with_origin_paths", "tokenizer_path", "tokenizer_2_path", "modelscope_cache_dir",
        "learning_rate", "weight_decay", "num_epochs", "trainable_models", "use_gradient_checkpointing",
        "use_gradient_checkpointing_offload", "task", "output_path", "remove_prefix_in_ckpt", "lora_base_model",
        "lora_target_modules", "lora_rank", "lora_alpha", "height", "width", "max_pixels", "seed", "cache_path",
        "overwrite", "resume", "save_steps", "save_total_limit", "progress", "plot", "json", "dataset_num_workers",
        "find_unused_parameters", "enable_csv_log", "dry_run", "align_to_opensource_format", "lr_scheduler",
        "optimizer", "loss_weighting", "timestep_sampling", "lora_format", "max_timestep_boundary",
        "min_timestep_boundary", "validation_prompt", "validation_inference_steps", "validation_seed",
        "validation_guidance", "validation_negative_prompt", "num_frames", "gradient_accumulation_steps",
        "config_file", "num_processes", "fp8_models", "offload_models", "tokenizer_t5xxl_path", "optimizer_args",
        "lr_warmup_steps", "ema_decay", "ema_device", "validation_use_ema", "max_grad_norm", "validation_dataset",
        "validation_steps", "caption_dropout", "weighting_scheme", "logit_mean", "logit_std", "mode_scale",
        "masked_loss", "masked_loss_unmasked_weight", "processor_path", "frame_rate", "validation_image",
        "max_audio_duration", "silence_latent_path", "noise_scale", "processor_config"}
# the longest song an audio pipeline reads without --max_audio_duration (ACE-Step 1.5 makes songs of up to 10 minutes)
SONG_SECONDS = 600
# the flags naming a tokenizer (or processor) folder: each only for a pipeline that takes one by it
TOKENIZER_FLAGS = ("tokenizer_path", "tokenizer_2_path", "tokenizer_t5xxl_path", "processor_path", "processor_config")


def wanted(args: TrainArgs) -> bool:
    """Whether this run goes through DiffSynth's own pipeline: `--pipeline diffsynth:MODULE`."""
    return bool(args.pipeline) and str(args.pipeline).startswith("diffsynth:")


def route(args: TrainArgs) -> tuple[TrainArgs, Optional[str]]:
    """(args, the line saying why) for a command without --pipeline whose model ids name a DiffSynth family unitgraph
    trains only through DiffSynth's own pipeline (untrained.py's table, glue.py's list): its `--pipeline
    diffsynth:MODULE`, so DiffSynth's command runs as it is. Unchanged otherwise; one line naming the extra when the
    family is listed but DiffSynth is not installed, before anything is downloaded; one line naming a family unitgraph
    trains in no way (choice.untrained_family). `args` need not be validated yet: a command of such a family is told
    what it is first, not that a setting of its own (MiniMax-H3's --num_frames 124) is not unitgraph's."""
    from dataclasses import replace

    from ..choice import untrained_family
    from ..untrained import untrained_by_model_id

    if args.pipeline or not args.model_id_with_origin_paths:
        return args, None
    for item in str(args.model_id_with_origin_paths).split(","):
        model_id, _, pattern = item.strip().rpartition(":")
        family = untrained_by_model_id(model_id)
        glue = next((g for g in glues() if family is not None and g.example == family.folder), None)
        if glue is None:
            if family is not None:
                untrained_family([(model_id, pattern)])
            continue
        if not available():
            raise BackendError(f"the model id {model_id} is {family.name}, which unitgraph trains "
                               f"through DiffSynth's own pipeline (--pipeline {glue.name}); {EXTRA_HINT}")
        return replace(args, pipeline=glue.name), f"the model id names {family.name}"
    return args, None


def check_attention(glue: Glue, device: Any, dtype: Any) -> None:
    """One line when the pipeline's DiT computes attention with kernels this device lacks (`glue.attention`: Krea 2's
    asks torch for cuDNN's alone, so on a CPU its first step would end in torch's "No viable backend" traceback):
    the function runs once on a tiny query here, before anything is loaded."""
    if not glue.attention:
        return
    import torch

    module, _, name = glue.attention.partition(":")
    attention = getattr(importlib.import_module(module), name)
    query = torch.zeros(1, 1, 2, 8, device=device, dtype=dtype)
    try:
        attention(query, query, query)
    except RuntimeError as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0].rstrip(".")
        raise BackendError(f"{glue.name}: DiffSynth's {module.rsplit('.', 1)[-1]}.{name} allows torch only attention "
                           f"kernels this device ({device}) does not have ({said}); it trains on a CUDA GPU") from None


def check_flags(args: TrainArgs) -> None:
    """One line for the first flag this source does not read that the command sets."""
    for f in fields(TrainArgs):
        if f.name in READ:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        value = getattr(args, f.name)
        if value != default and not (value in (None, False, 0, "", []) and default in (None, False, 0, "", [])):
            raise BackendError(f"--{f.name} is not available yet for a pipeline trained through DiffSynth's own code "
                               f"({args.pipeline}); it works with unitgraph's own families (see 'unitgraph pipelines')")
    if args.task not in TASKS:
        raise BackendError(f"--task {args.task}: a DiffSynth pipeline trains {', '.join(TASKS)} so far")
    glue = glue_for(str(args.pipeline))
    for flag in TOKENIZER_FLAGS:
        if getattr(args, flag) and flag not in {t.flag for t in glue.tokenizers}:
            raise BackendError(f"--{flag}: {glue.name} takes no such tokenizer (it takes "
                               f"{', '.join('--' + t.flag for t in glue.tokenizers) or 'none'})")
    if task_kind(args.task) == "direct_distill" and not glue.distill:
        raise BackendError(f"--task {args.task}: {glue.name}'s example trains no direct_distill task (its train.py "
                           "offers sft only)")
    chosen = [f"--{flag} {value}" for flag, value in (("timestep_sampling", args.timestep_sampling),
                                                        ("weighting_scheme", args.loss_weighting)) if value != "diffsynth"]
    if args.masked_loss:
        chosen.insert(0, "--masked_loss")
        if glue.media != "image":
            raise BackendError(f"--masked_loss: {glue.name} trains on {'clips' if glue.media == 'video' else 'songs'}; "
                               "a mask weighs an image's latent cells (image pipelines only)")
    if args.max_audio_duration is not None:
        if glue.media != "audio":
            raise BackendError(f"--max_audio_duration: {glue.name} trains no song (an audio pipeline's flag: "
                               "diffsynth:ace_step)")
        if not 1 <= args.max_audio_duration <= SONG_SECONDS:  # its inputs count a song's whole seconds
            raise BackendError(f"--max_audio_duration {args.max_audio_duration:g}: the seconds of a song trained, "
                               f"at least 1 and at most {SONG_SECONDS}")
    owned = {name for g in glues() for name, _default in g.options}  # flags of one pipeline's own train.py
    for name in sorted(owned - {name for name, _default in glue.options}):
        if getattr(args, name) is not None:
            whose = ", ".join(g.name for g in glues() if name in dict(g.options))
            raise BackendError(f"--{name}: {glue.name}'s example has no such flag (a flag of {whose})")
    if args.noise_scale is not None and not (math.isfinite(args.noise_scale) and args.noise_scale > 0):
        raise BackendError(f"--noise_scale {args.noise_scale:g}: the scale of the noise the loss draws (its example's "
                           "default 8.0), a positive number")
    if args.silence_latent_path and "silence_latent_path" not in {t.flag for t in glue.tensors}:
        raise BackendError(f"--silence_latent_path: {glue.name} reads no such file (a flag of diffsynth:ace_step)")
    if glue.media == "audio" and (args.height or args.width or args.max_pixels != TrainArgs.max_pixels):
        raise BackendError(f"--height, --width and --max_pixels size pictures; {glue.name} trains on songs")
    if chosen and glue.loss:
        raise BackendError(f"{chosen[0]}: {glue.name} trains DiffSynth's own {glue.loss.rpartition(':')[2]} (its train.py's "
                           "sft loss); the samplings, weightings and masked loss apply to FlowMatchSFTLoss")
    if glue.edits and not args.task.endswith(":train") and (  # (stage 2 reads what stage 1 made of the picture)
            "edit_image" not in _extra_inputs(args) or "edit_image" not in (args.data_file_keys or "image").split(",")):
        raise BackendError(f"{glue.name} trains edits only (its prompt unit encodes an instruction only beside the "
                           "picture it edits): pass --extra_inputs edit_image and name the column in --data_file_keys "
                           "(its example: --data_file_keys \"image,edit_image\" --extra_inputs \"edit_image\")")
    if args.validation_image and not (glue.first_frame or glue.edits):
        raise BackendError(f"--validation_image: {glue.name} draws its validation samples from the prompt alone (a "
                           "pipeline that starts from a first frame or edits a picture takes one)")
    if args.validation_prompt and glue.first_frame and not args.validation_image:
        raise BackendError(f"--validation_prompt: {glue.name} draws a clip from its first frame; give each prompt its "
                           "frame with --validation_image")
    if args.validation_prompt and glue.edits and not args.validation_image:
        raise BackendError(f"--validation_prompt: {glue.name} draws an edit of a picture; give each prompt the picture "
                           "it edits with --validation_image")
    if args.frame_rate is not None and not glue.frame_rate:
        raise BackendError(f"--frame_rate: {glue.name}'s example reads no clip at a frame rate (its train.py has no such "
                           "flag)")
    if chosen and task_kind(args.task) != "sft":
        raise BackendError(f"{chosen[0]}: --task {args.task} trains DiffSynth's own {task_kind(args.task)} loss (a "
                           "denoising loop, no drawn timestep); the samplings, weightings and masked loss apply to sft")
    check_optimizer(args.optimizer, args.optimizer_args)  # the name and its arguments (the library where it trains)
    check_caption_dropout(args.caption_dropout)
    if args.lora_format not in ("diffusers", "diffsynth"):
        raise BackendError(f"--lora_format {args.lora_format}: a DiffSynth pipeline writes DiffSynth's layout")
    if args.align_to_opensource_format and not glue_for(str(args.pipeline)).opensource_lora:
        raise BackendError(f"--align_to_opensource_format: {args.pipeline}'s example converts no LoRA to an open-source "
                           "layout")
    if not args.lora_base_model and not args.trainable_models and task_stage(args.task) != "data_process":
        raise BackendError("name what to train: --lora_base_model MODEL or --trainable_models MODELS")


def task_kind(task: str) -> str:
    """The loss a --task trains: `sft` or `direct_distill`."""
    return task.split(":", 1)[0]


def task_stage(task: str) -> str:
    """The stage a --task runs: `data_process` (stage 1), `train` (stage 2) or "" (both, unsplit)."""
    return task.split(":", 1)[1] if ":" in task else ""


def step_loss(args: TrainArgs) -> Callable[..., Any]:
    """The loss a step trains: the task's own (`loss_function`), `sft`'s with --timestep_sampling, --weighting_scheme
    and --masked_loss (objective.py: DiffSynth's FlowMatchSFTLoss itself at their defaults; a pipeline whose example
    maps sft to a loss of its own trains that one, at the defaults only: check_flags)."""
    glue = glue_for(str(args.pipeline))
    if task_kind(args.task) == "sft" and not glue.loss:
        return sft_loss(args.sampling(), args.loss_weighting,
                        args.masked_loss_unmasked_weight if args.masked_loss else None)
    return loss_function(args.task, glue)


def loss_function(task: str, glue: Optional[Glue] = None) -> Callable[..., Any]:
    """DiffSynth's own loss of the task, as its examples' train.py map them: FlowMatchSFTLoss for `sft` (a drawn
    timestep and noise, one prediction; the glue's own where its example maps sft to another, e.g. MOVA's
    FlowMatchSFTAudioVideoLoss), DirectDistillLoss for `direct_distill` (the denoising loop of the sample's
    num_inference_steps from its initial latents, the last latents against the target's)."""
    from diffsynth.diffusion.loss import DirectDistillLoss, FlowMatchSFTLoss

    if task_kind(task) == "direct_distill":
        return DirectDistillLoss
    if glue is not None and glue.loss:
        module, _, name = glue.loss.partition(":")
        return getattr(importlib.import_module(module), name)
    return FlowMatchSFTLoss


# ------------------------------------------------------------------------------------------------
# the set-up every task shares


@dataclass
class Setup:
    glue: Glue
    args: TrainArgs
    dtype: Any
    pipe_class: type
    units: list[Any]  # the pipeline's unit objects, in order
    spec: Any  # unitgraph.spec.Pipeline of those units, each narrowed to the outputs needed (planning.py)
    plan: Any
    hub: Hub
    models: list[ModelFile]
    declared: dict[str, tuple[str, ...]]  # each unit's outputs as the adapter reads it, before narrowing
    notes: dict[str, str]  # a line per narrowed unit
    world: World = World()  # the processes of the launch (world.py)
    seeded: tuple[str, ...] = ()  # units drawing only the sample's seeded noise (planning.seeded_units)

    @property
    def given(self) -> set[str]:
        """The pipeline attributes the command's model files fill."""
        return {a for m in self.models for a in m.attributes}

    def stage_units(self, stage: str) -> list[tuple[str, Any, tuple[str, ...]]]:
        """(name, DiffSynth's unit object, the outputs it may write) of the plan's units of `stage`, in order."""
        names = set(self.plan.data_process_units if stage == "data_process" else self.plan.train_units)
        return [(decl.name, obj, self.declared[decl.name]) for decl, obj in zip(self.spec.units, self.units)
                if decl.name in names]

    def tokenizers_for(self, models: list[str], units: bool = True) -> dict[str, str]:
        """The tokenizer folders of the text encoders among `models` (keyword of from_pretrained -> folder), and with
        `units` (a pipeline that runs stage 1's units or draws) those of units that load no model."""
        return {tok.keyword: tokenizer_folder(tok, getattr(self.args, tok.flag, None), self.hub)
                for tok in self.glue.tokenizers if tok.encoder in models or (units and not tok.encoder)}

    @property
    def options(self) -> dict[str, Any]:
        """The values of the pipeline's own flags (`Glue.options`): the command's, else its train.py's defaults."""
        return {name: default if getattr(self.args, name) is None else getattr(self.args, name)
                for name, default in self.glue.options}

    def load_plain(self, models: list[str]) -> Any:
        """A pipeline holding only `models` (and their tokenizers), as DiffSynth loads them: what a render borrows."""
        return self.with_tensors(load_pipeline(self.glue, self.models, models, self.tokenizers_for(models), self.dtype,
                                               self.world.device), models)

    def with_tensors(self, pipe: Any, models: list[str]) -> Any:
        """`pipe` with the tensors its `from_pretrained` would unpickle, read from their safetensors twins, where
        `models` include one whose units read them."""
        for tensor in self.glue.tensors:
            if set(tensor.models) & set(models):
                path = tensor_file(tensor, getattr(self.args, tensor.flag, None), self.hub)
                setattr(pipe, tensor.attribute, load_tensor(tensor, path, self.dtype, self.world.device))
        return pipe

    def load(self, stage_models: list[str], stage: str, recorded: Optional[dict[str, dict]] = None,
             units: bool = True) -> Any:
        """The pipeline with `stage_models` loaded, the others' attributes standing in (hazards.py): from the
        command's files, else from `recorded` (stage 1's record of every model in the cache's manifest). `units`:
        whether it runs stage 1's units (stage 2 from a cache does not: it needs no tokenizer of a model-free unit)."""
        pipe = self.with_tensors(load_pipeline(self.glue, self.models, stage_models,
                                               self.tokenizers_for(stage_models, units), self.dtype, self.world.device),
                                 stage_models)
        needed = set(stage_models) & (self.given | set(self.plan.models_require_backward))  # an optional one may be absent
        missing = sorted(needed - {a for a in self.given if getattr(pipe, a, None) is not None})
        if missing:
            raise BackendError(f"{stage} needs the model{'s' if len(missing) > 1 else ''} {', '.join(missing)} of "
                               f"{self.glue.class_name}, which the command's --model_paths / --model_id_with_origin_paths "
                               "do not give")
        others = {a: built for m in self.models for a, built in m.skeletons().items() if a not in stage_models}
        read = {c for u in self.spec.units if u.name in self.plan.train_units for c in u.configs}
        for attribute, record in (recorded or {}).items():  # only what stage 2's units read the configuration of
            if (attribute in read and attribute not in others and attribute not in stage_models
                    and getattr(pipe, attribute, None) is None):
                try:
                    others[attribute] = skeleton(record)
                except BackendError:
                    raise
                except Exception as exc:  # a damaged or edited record: a class these sizes do not build
                    raise BackendError(f"the cache's record of the model {attribute} does not build "
                                       f"({type(exc).__name__}: {str(exc)[:200]})") from None
        install_skeletons(pipe, others, stage)
        pipe.scheduler.set_timesteps(1000, training=True)  # switch_pipe_to_training_mode's first step
        pipe.freeze_except([])
        return pipe


def _dtype(glue: Glue) -> Any:
    import torch

    return getattr(torch, glue.dtype)


def setup(args: TrainArgs) -> Setup:
    import warnings

    from unitgraph.adapters.diffsynth import declarations, from_object

    glue = glue_for(str(args.pipeline))
    dtype = _dtype(glue)
    pipe_class = pipeline_class_of(glue)
    bare = pipe_class(device="cpu", torch_dtype=dtype)
    given = provided(glue, _extra_inputs(args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # declaration notes belong to 'unitgraph audit', not to every run
        seeded = tuple(seeded_units(bare.units, given))
        quiet = tuple(unit for unit, param in glue.quiet_without if param not in given)
        whole = from_object(bare, where=glue.name, deterministic=seeded + quiet)
        decls = declarations(bare)
    if len(whole.units) != len(bare.units):
        raise BackendError(f"{glue.name}: the adapter read {len(whole.units)} units of {len(bare.units)}")
    active, _dropped = prune(whole, given)  # units that would do nothing for these inputs are left out first
    kept = {u.name for u in active.units}
    on = [u.name in kept for u in whole.units]
    overwritten = loss_overwrites(loss_function(args.task, glue), present=_sound_present(glue, args))
    spec, notes = live_projection(active, [d for d, keep in zip(decls, on) if keep], overwritten)
    backward = [m for m in (args.trainable_models or "").split(",") if m]
    try:
        plan = split(spec, trainable_models=backward, lora_base_model=args.lora_base_model or None, provided=given)
    except Exception as exc:  # SpecError: a model the pipeline does not have
        raise BackendError(f"{glue.name}: {exc}") from None
    hub = Hub.from_env(args.modelscope_cache_dir)
    if args.dry_run:
        models = planned_models(glue, args.model_paths, args.model_id_with_origin_paths, hub)
    else:
        models = find_models(glue, args.model_paths, args.model_id_with_origin_paths, hub)
    models = with_fp8(models, args.fp8_models, backward)
    if any(m.fp8 for m in models) and glue.dtype != "bfloat16":
        raise BackendError(f"--fp8_models: {glue.name} trains in {glue.dtype}, and DiffSynth's fp8 storage computes "
                           "each layer in bfloat16 (its example's inputs would not match); train it without --fp8_models")
    world = World() if args.dry_run else launched()
    _refuse_under(world.engine, models, args)
    if not args.dry_run and task_stage(args.task) != "data_process":
        check_attention(glue, world.device, dtype)
    units = [u for u, keep in zip(bare.units, on) if keep]
    return Setup(glue, args, dtype, pipe_class, units, spec, plan, hub, models,
                 {u.name: u.outputs for u in whole.units}, notes, world, seeded)


def offload_notes(setup: Setup) -> list[str]:
    """A line per --offload_models model this stage computes with. DiffSynth's split-training commands name there
    the models a stage does not compute with, so that its loader keeps them on disk; unitgraph does not load those
    at all (a stage reads only its models' files), and loads one it computes with whole."""
    stage = task_stage(setup.args.task)
    plan = setup.plan
    loaded = set(plan.data_process_models if stage == "data_process" else plan.train_models if stage == "train"
                 else {*plan.data_process_models, *plan.train_models})
    notes = []
    for i in named_models(setup.models, setup.args.offload_models, "--offload_models"):
        used = sorted(set(setup.models[i].attributes) & loaded)
        if used:
            notes.append(f"--offload_models: {', '.join(used)} computes in this stage and is loaded whole (the stage "
                         "does not load the models it does not compute with, offloaded or not)")
    return notes


def _refuse_under(engine: Any, models: list[ModelFile], args: TrainArgs) -> None:
    """One line for what a training stage under DeepSpeed or FSDP2 (`engine`: engine.Engine or None) does not do for
    a DiffSynth pipeline: an fp8 model inside an engine that shards frozen weights (the LoRA's base under ZeRO-3 or
    FSDP2, which would gather its fp8 weights in their storage dtype; ZeRO-1/2 leaves frozen weights as they are, and
    fp8 models outside the engine, the frozen encoders, stay as DiffSynth loads them under any), an optimizer
    other than AdamW (the engines' states keep AdamW's moments per shard; schedulefree's state is elementwise and
    trains under FSDP2), a moving average under ZeRO-3 (its weights are empty between forwards). Clipping and the
    average elsewhere: sharding.py."""
    if engine is None or engine.kind == "ddp" or task_stage(args.task) == "data_process":
        return
    inside = {args.lora_base_model, *args.trainable()} - {None, ""}
    fp8 = sorted(a for m in models if m.fp8 for a in m.attributes if a in inside)
    if fp8 and engine.shards_frozen:
        raise BackendError(f"--fp8_models with {engine.name}: {fp8[0]} trains under the engine, which shards its "
                           "frozen weights too (in their storage dtype); keep it in bf16 (fp8 for the models outside "
                           "the engine is fine), or train under ZeRO-1/2 or data parallel", source=engine.source)
    if args.optimizer != "adamw" and not (args.optimizer == "schedulefree" and engine.kind == "fsdp2"):
        raise BackendError(f"--optimizer {args.optimizer} with {engine.name}: the engine's training states keep "
                           "AdamW's moments per shard; train with adamw (or under FSDP2 schedulefree, whose state is "
                           "elementwise), or under data parallel", source=engine.source)
    if args.ema_decay is not None and engine.kind == "deepspeed" and engine.zero_stage == 3:
        raise BackendError(f"--ema_decay with {engine.name}: ZeRO-3 partitions the trained weights outside the steps "
                           "(their data is empty between forwards), so no average can be taken of them; train under "
                           "FSDP2, ZeRO-1/2 or data parallel, or without --ema_decay", source=engine.source)


# ------------------------------------------------------------------------------------------------
# the step


def _transfer(state: tuple[dict, dict, dict], pipe: Any) -> tuple[dict, dict, dict]:
    """DiffSynth's `transfer_data_to_device`: float tensors to the pipeline's device and dtype."""
    return helper().transfer_data_to_device(state, pipe.device, pipe.torch_dtype)


def run_units(pipe: Any, units: list[tuple[str, Any, Any]], state: tuple[dict, dict, dict],
              watch: bool = False) -> tuple[dict, dict, dict]:
    """Run `units` in order on `state` through DiffSynth's runner; with `watch`, check each (hazards.py)."""
    import torch

    if not getattr(pipe.scheduler, "training", False):  # the units were analysed as they run in training
        raise BackendError(f"{type(pipe).__name__}'s scheduler is not in training mode")
    for name, unit, outputs in units:
        before = state_identities(state) if watch else {}
        rng = torch.get_rng_state() if watch else None
        try:
            state = pipe.unit_runner(unit, pipe, *state)
        except UnitHazard as exc:
            raise UnitHazard(f"unit {name} {exc}") from None
        except BackendError:
            raise
        except Exception as exc:  # DiffSynth's unit code: its error as one line naming the unit
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise BackendError(f"unit {name} of {type(pipe).__name__} failed: {type(exc).__name__}: {detail[:300]}") from None
        if watch:
            check_unit(name, outputs, before, rng, state)
    return state


def step_seed(seed: int, epoch: int, sample_id: str) -> int:
    return derive_seed(seed, "diffsynth-step", epoch, sample_id)


def train_step(pipe: Any, units: list[tuple[str, Any, Any]], state: tuple[dict, dict, dict], seed: int,
               task: str = "sft", loss: Optional[Callable[..., Any]] = None) -> Any:
    """The loss of one step on `state` (the state after the data_process units): seed the stream, run the
    training units, then `loss` (`step_loss`; else the task's DiffSynth loss, `loss_function`).

    DirectDistillLoss sets the scheduler to the sample's inference steps; the training schedule (1000 steps, in
    training mode, as the pipeline is loaded) is set again after it, so the next sample's units run on the schedule
    stage 1 ran every unit on."""
    import torch

    torch.manual_seed(seed)
    shared, posi, nega = run_units(pipe, units, _transfer(state, pipe))
    value = (loss or loss_function(task))(pipe, **shared, **posi)
    if task_kind(task) == "direct_distill":
        pipe.scheduler.set_timesteps(1000, training=True)
    return value


def held_out_loss(pipe: Any, units: list[tuple[str, Any, Any]], held_out: list[tuple[str, Callable[[], Any]]],
                  seed: int, task: str, loss: Optional[Callable[..., Any]] = None) -> float:
    """The mean loss over the held-out samples with the weights as they are: each sample's step as a training step
    runs it, without gradients, its draws seeded from (--seed, "held-out", sample), the same at every evaluation and
    in every run of the seed; torch's stream as it was afterwards, so training draws what it draws without it."""
    import torch

    total = 0.0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for sample_id, state in held_out:
            total += float(train_step(pipe, units, state(), derive_seed(seed, "diffsynth-held-out", sample_id), task,
                                      loss))
    return total / max(1, len(held_out))


# ------------------------------------------------------------------------------------------------
# samples


def _extra_inputs(args: TrainArgs) -> tuple[str, ...]:
    return tuple(n for n in (args.extra_inputs or "").split(",") if n)


def dataset_of(setup: Setup, base: Optional[str] = None, metadata: Optional[str] = None) -> DiffusionDataset:
    """The command's dataset (or the one of `base` and `metadata`: the held-out samples); the glue's picture column
    (`image` or `video`) is always a file column."""
    args = setup.args
    extra = _extra_inputs(args)
    media = setup.glue.media
    mask = (MASK,) if args.masked_loss else ()  # --masked_loss: a required image column, of its image's size
    keys = tuple(dict.fromkeys([*(k for k in (args.data_file_keys or "image").split(",") if k), media, *mask]))
    derived = ("input_image", "end_image") if media == "video" else ()  # taken from the clip, not from a column
    columns = tuple(n for n in extra if n not in derived)
    rate = ("frame_rate",) if setup.glue.frame_rate else ()  # a clip's own frame_rate column, when the metadata has one
    optional = (*rate, *(name for name, _ in setup.glue.defaults))  # read where the metadata has the column
    required = setup.glue.columns
    song = media == "audio"
    if song:  # the lyrics column must be there, but may be empty (an instrumental: "" to the pipeline)
        required = tuple(c for c in required if c != "lyrics")
        columns = tuple(dict.fromkeys(["lyrics", *columns]))
    params = ("prompt", *columns, *optional) if media == "video" else (media, "prompt", *columns, *optional, *mask)
    types = {**call_types(setup.pipe_class), **{name: float for name in rate}}
    dataset = DiffusionDataset(base or args.dataset_base_path, metadata or args.dataset_metadata_path, params,
                               data_file_keys=keys, extra_inputs=columns, required=(*required, *mask),
                               optional=optional, param_types=types, image_params=() if song else (media, *mask),
                               strict=mask, audio_params=(media,) if song else setup.glue.audio,
                               num_frames=args.num_frames or 81,
                               audio_seconds=(args.max_audio_duration or SONG_SECONDS) if song else None)
    for index in range(len(dataset) if mask else 0):  # every mask, before any work: present, an image, its image's size
        dataset.check(index)
    return dataset


def sample_state(setup: Setup, dataset: DiffusionDataset, index: int, device: Any) -> tuple[dict, dict, dict]:
    """The inputs of sample `index`: its images (every file column's: an edit's references too) resized by
    DiffSynth's own ImageCropAndResize (--height/--width, else --max_pixels, sides multiples of the pipeline's
    factor), or its video's frames read by DiffSynth's own video operator (--num_frames at most, cut to the
    pipeline's time division; each frame resized the same way; a still image is a one-frame clip), then the
    pipeline's inputs (glue.inputs)."""
    from diffsynth.core.data.operators import ImageCropAndResize

    args, glue = setup.args, setup.glue
    sample = dataset.sample(index)
    if setup.seeded and sample.get("seed") is None:
        raise BackendError(f"row {index + 1}: the seed column is empty, and {', '.join(setup.seeded)} draw"
                           f"{'s' if len(setup.seeded) == 1 else ''} the sample's noise from it (a row of this dataset "
                           "needs a seed, or none of them one)", source=str(dataset.metadata_path))
    if glue.media == "video":
        from diffsynth.core import UnifiedDataset

        path = dataset.files(index)["video"][0]
        at_rate = {"frame_rate": args.frame_rate or 24, "fix_frame_rate": True} if glue.frame_rate else {}
        read = UnifiedDataset.default_video_operator(
            base_path=str(dataset.base_path), max_pixels=args.max_pixels, height=args.height, width=args.width,
            height_division_factor=glue.division, width_division_factor=glue.division, num_frames=args.num_frames,
            time_division_factor=glue.frames[0], time_division_remainder=glue.frames[1], **at_rate)
        try:
            sample["video"] = read(str(Path(path).resolve()))
        except Exception as exc:  # imageio's and PIL's decoders raise many types for a damaged file
            raise BackendError(f"row {index + 1}: cannot read the video {path.name!r} with DiffSynth's video operator "
                               f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})",
                               source=str(dataset.metadata_path)) from None
        if not sample["video"]:
            raise BackendError(f"row {index + 1}: the video {path.name!r} has no frame", source=str(dataset.metadata_path))
        for column in set(glue.audio) & set(_extra_inputs(args)):
            if sample.get(column) is None:  # DiffSynth would train this clip without sound, unlike the rest
                raise BackendError(f"row {index + 1}: {dataset.files(index)[column][0].name!r} (column {column!r}) has "
                                   f"no sound track; {glue.name} trains a clip with its sound (every row needs one, "
                                   f"or leave {column} out of --extra_inputs to train none with sound)",
                                   source=str(dataset.metadata_path))
            sample[column] = _sound(setup, dataset, index, column, sample[column])
    elif glue.media == "audio":
        sample["audio"] = _song(setup, dataset, index, sample.get("audio"))
    else:
        from PIL import Image

        resize = ImageCropAndResize(args.height, args.width, args.max_pixels, glue.division, glue.division)
        for key in dataset.file_keys:  # DiffSynth's image operator sizes every file column (an edit's references
            value = sample.get(key)    # too), each image of a list alike
            if isinstance(value, Image.Image):
                sample[key] = resize(value)
            elif isinstance(value, list) and value and all(isinstance(v, Image.Image) for v in value):
                sample[key] = [resize(v) for v in value]
        width, height = sample[glue.media].size
        if (width // glue.division) * (height // glue.division) < glue.min_cells:
            raise BackendError(f"row {index + 1}: the picture is {width}x{height} as trained, {glue.name} needs at "
                               f"least {glue.min_cells} patches of {glue.division} px (a larger --height/--width or "
                               "--max_pixels)", source=str(dataset.metadata_path))
    state = inputs(glue, sample, device, bool(args.use_gradient_checkpointing),
                   bool(args.use_gradient_checkpointing_offload), _extra_inputs(args),
                   (args.max_timestep_boundary, args.min_timestep_boundary), setup.options)
    if args.masked_loss:  # the resized mask's pixels, which the loss reads (objective.py); no unit reads them
        state[0][LOSS_MASK] = mask_pixels(sample[MASK])
    return state


def _song(setup: Setup, dataset: DiffusionDataset, index: int, track: Any) -> Any:
    """What DiffSynth's LoadPureAudioWithTorchaudio makes of row `index`'s song: (float32 (2, samples) tensor, rate),
    resampled to the pipeline's rate by DiffSynth's own resampler, cut to --max_audio_duration, a mono track made
    stereo. DiffSynth's operator reads the file through torchcodec, which needs a system FFmpeg; here it is handed the
    track the dataset read with PyAV's bundled decoder (data/audio.py: the song's first --max_audio_duration seconds
    and one more, so the resampler sees past the cut as on the whole track; without the flag, SONG_SECONDS, a longer
    track stopping the run). Where DiffSynth's operator would print and hand None (a file without a sound track), the
    run stops in one line."""
    import torch
    from diffsynth.core.data.operators import LoadPureAudioWithTorchaudio
    from diffsynth.utils.data.audio import resample_waveform

    args, glue = setup.args, setup.glue
    path = dataset.files(index)["audio"][0]
    where = f"row {index + 1}: {path.name!r} (column 'audio')"
    if track is None:
        raise BackendError(f"{where} has no sound track; {glue.name} trains on a song", source=str(dataset.metadata_path))
    samples, rate = track
    if args.max_audio_duration is None and samples.shape[1] > SONG_SECONDS * rate:
        raise BackendError(f"{where} is longer than {SONG_SECONDS} s ({glue.name}'s longest song); pass "
                           "--max_audio_duration SECONDS to train its beginning", source=str(dataset.metadata_path))

    def load(_path: str, resample: bool = False, resample_rate: int = 48000) -> tuple:
        waveform = torch.from_numpy(samples)
        return (resample_waveform(waveform, rate, resample_rate), resample_rate) if resample else (waveform, rate)

    operator = LoadPureAudioWithTorchaudio(target_sample_rate=glue.sample_rate,
                                           max_audio_duration=args.max_audio_duration)
    operator.audio_loader = load
    made = operator(str(Path(path).resolve()))
    if made is None:
        raise BackendError(f"{where}: DiffSynth's audio operator cannot read it", source=str(dataset.metadata_path))
    if made[0].shape[1] < made[1]:  # a `duration` of 0 s: no latent frame to train
        raise BackendError(f"{where} is shorter than a second ({made[0].shape[1] / made[1]:.2f} s); {glue.name}'s "
                           "inputs count a song's whole seconds", source=str(dataset.metadata_path))
    return made


def _sound_present(glue: Glue, args: TrainArgs) -> frozenset[str]:
    """The sound latents every sample's state holds: the glue's, when the command hands the pipeline a sound column
    (each row then needs a track: `_sound`)."""
    named = set(_extra_inputs(args)) & set(glue.audio)
    return frozenset({glue.audio_latents}) if named and glue.audio_latents else frozenset()


def _sound(setup: Setup, dataset: DiffusionDataset, index: int, column: str, track: Any) -> Any:
    """What DiffSynth's LoadAudioWithTorchaudio makes of row `index`'s sound file: (float32 (channels, samples) tensor,
    rate), the track cut or padded to the clip's length at --frame_rate (the frame count its video reader finds in
    the file). DiffSynth's operator reads the track with torchaudio.load, which needs a system FFmpeg (torchcodec);
    here it is handed the track the dataset already read with PyAV's bundled decoder (`track`: data/audio.py), so its
    own cutting runs on the same samples. Where DiffSynth's operator would warn and train the clip without sound
    (its video reader cannot open the file), the run stops in one line instead."""
    import warnings

    import torch
    from diffsynth.core.data.operators import LoadAudioWithTorchaudio

    args, glue = setup.args, setup.glue
    path = dataset.files(index)[column][0]
    samples, rate = track
    operator = LoadAudioWithTorchaudio(num_frames=args.num_frames, time_division_factor=glue.frames[0],
                                       time_division_remainder=glue.frames[1], frame_rate=args.frame_rate or 24)
    operator.audio_loader = lambda _path: (torch.from_numpy(samples), rate)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        made = operator(str(Path(path).resolve()))
    if made is None:
        why = str(said[-1].message).split(" due to ", 1)[-1].strip().splitlines()[0][:200] if said else "no reason given"
        raise BackendError(f"row {index + 1}: DiffSynth's audio operator cannot cut the sound of {path.name!r} (column "
                           f"{column!r}) to its clip ({why}); it reads a video file's sound track",
                           source=str(dataset.metadata_path))
    return made


# ------------------------------------------------------------------------------------------------
# stage 1


def _key_inputs(setup: Setup, memo: HashMemo) -> dict[str, Any]:
    """What every entry key shares: the pipeline, the data_process units, the files of their models (sha256,
    remembered in the cache's hashes.json so a later stage 1 only stats them), the settings."""
    import diffsynth

    files = {}
    for model in setup.models:
        if set(model.attributes) & set(setup.plan.data_process_models):
            for path in [model.path] if isinstance(model.path, str) else model.path:
                key = Path(path).name + ":" + ",".join(model.attributes) + (":fp8" if model.fp8 else "")
                files[key] = memo.digest(Path(path))
    args = setup.args
    return {"pipeline": setup.glue.name, "diffsynth": getattr(diffsynth, "__version__", "?"),
            "units": setup.plan.data_process_units, "models": files, "dtype": setup.glue.dtype,
            "skeletons": {",".join(m.attributes): m.identity() for m in setup.models
                          if not set(m.attributes) & set(setup.plan.data_process_models)},
            "size": ImageSize(args.height, args.width, args.max_pixels).key(),
            "frames": args.num_frames if setup.glue.media == "video" else None,
            **({"options": setup.options} if setup.options else {}),  # each entry holds them (glue.inputs)
            "gradient_checkpointing": [bool(args.use_gradient_checkpointing),
                                       bool(args.use_gradient_checkpointing_offload)],
            # each entry also holds what the empty caption changes (captions.py): asked for by --caption_dropout
            **({EMPTY_CAPTION: True} if args.caption_dropout else {}),
            **({"masked_loss": True} if args.masked_loss else {})}  # each entry holds its mask


def data_process(setup: Setup, cache_dir: Path, report: Callable[[str], None]) -> RunResult:
    import torch

    if cache_dir.is_dir() and not (cache_dir / MANIFEST).is_file():
        # an interrupted stage 1's folder (a row it could not read: its entries so far and hashes.json) is its own,
        # and the next one reuses those entries; anything else there is someone else's
        foreign = sorted(p.name for p in cache_dir.iterdir() if p.name not in ("entries", HASHES))
        entries = cache_dir / "entries"
        if foreign or (entries.exists() and not entries.is_dir()) or any(
                not re.fullmatch(r"[0-9a-f]{64}\.safetensors", p.name) for p in entries.glob("*")):
            raise BackendError(f"is not empty and not a stage-1 cache of unitgraph's (it holds "
                               f"{', '.join(foreign[:3]) or 'entries/'}); stage 1 writes only into a new, empty or own "
                               "folder: choose another --output_path", source=str(cache_dir))
    world = setup.world
    dataset = dataset_of(setup)
    pipe = setup.load(setup.plan.data_process_models, "stage 1")
    units = setup.stage_units("data_process")
    if world.main:
        cache_dir.mkdir(parents=True, exist_ok=True)
        (cache_dir / "entries").mkdir(exist_ok=True)
    memo = HashMemo(LocalStore(cache_dir))
    key_inputs = _key_inputs(setup, memo)
    if world.main:
        memo.save()
    static = canonical_hash(key_inputs)
    result = RunResult(task=setup.args.task, output_path=cache_dir, plan=setup.plan, cache_path=cache_dir)
    start = time.perf_counter()
    world.barrier()  # the folders exist
    entries = _cache_entries(setup, pipe, units, dataset, cache_dir, static, result)
    held_out = None
    if setup.args.validation_dataset:  # the held-out samples: entries of their own, never trained
        from ..data.dataset_config import held_out_dataset

        spec = held_out_dataset(setup.args.validation_dataset)
        held_out = _cache_entries(setup, pipe, units, dataset_of(setup, spec.base_path, spec.metadata), cache_dir,
                                  static, result, HELD_OUT)
    counts = world.sum_(torch.tensor([result.entries_computed, result.entries_reused]))
    result.entries_computed, result.entries_reused = (int(c) for c in counts.tolist())
    world.barrier()  # every process's entries are in place
    records = {a: r for m in setup.models for a, r in m.records().items()}
    manifest = {"format": FORMAT, "pipeline": setup.glue.name, "plan": setup.plan.to_dict(),
                "key": key_inputs, "entries": entries, "models": records,
                **({HELD_OUT: held_out} if held_out is not None else {})}
    if world.main:
        write_bytes_atomic(cache_dir / MANIFEST,
                           (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    world.barrier()
    result.samples = len(dataset)
    result.cache_reused = result.entries_computed == 0
    result.stage_times["data_process"] = time.perf_counter() - start
    return result


def _cache_entries(setup: Setup, pipe: Any, units: list[tuple[str, Any, Any]], dataset: DiffusionDataset,
                   cache_dir: Path, static: str, result: RunResult, part: str = "sample") -> list[dict[str, Any]]:
    """Run stage 1's units on each sample of `dataset` this process owns (entry i on process i mod N) and write its
    entry, unless the cache has it; the manifest's list of every entry. `part` keeps the held-out samples' keys
    apart from the training samples'."""
    import torch

    world = setup.world
    entries = []
    with torch.no_grad():
        for index in range(len(dataset)):
            sample_id = dataset.sample_id(index)
            key = canonical_hash({"static": static, part: sample_id})
            path = cache_dir / "entries" / f"{key}.safetensors"
            entries.append({"row": index, "sample": sample_id, "file": f"entries/{key}.safetensors"})
            if index % world.size != world.rank:  # another process's entry (world.py)
                continue
            if path.is_file():
                result.entries_reused += 1
            else:
                given = sample_state(setup, dataset, index, pipe.device)
                blank = emptied(given) if setup.args.caption_dropout and part == "sample" else None
                state = run_units(pipe, units, _transfer(given, pipe), watch=True)
                changes = None
                if blank is not None:  # what a dropped step's state changes (captions.py)
                    empty = run_units(pipe, units, _transfer(blank, pipe), watch=True)
                    changes = difference(state, empty, ", ".join(n for n, _u, _o in units) or "none")
                values = {"inputs_shared": state[0], "inputs_posi": state[1], "inputs_nega": state[2],
                          **({EMPTY_CAPTION: changes} if changes is not None else {})}
                try:
                    write_entry(path, values, {"sample": sample_id, "row": index}, keep_layout=True)
                except TypeError as exc:
                    raise BackendError(f"stage 1 cannot store a value of {setup.glue.name}'s state ({exc})") from None
                result.entries_computed += 1
                if part == "sample":
                    result.computed_indices.append(index)
    return entries


def read_manifest(folder: Path, setup: Setup) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BackendError(f"no cache of stage 1 here ({MANIFEST} is missing); run --task "
                           f"{task_kind(setup.args.task)}:data_process with "
                           "--output_path this folder first", source=str(folder)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BackendError(f"unreadable cache manifest ({exc})", source=str(path)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BackendError("not a cache of a DiffSynth pipeline's stage 1", source=str(path))
    if manifest.get("pipeline") != setup.glue.name:
        raise BackendError(f"the cache was made for {manifest.get('pipeline')}, not {setup.glue.name}", source=str(path))
    recorded = manifest.get("models", {})
    if not isinstance(recorded, dict) or not all(isinstance(v, dict) and "model_class" in v for v in recorded.values()):
        raise BackendError("the cache's manifest has a damaged models record", source=str(path))
    for part in ("entries", HELD_OUT):
        listed = manifest.get(part, [])
        if not isinstance(listed, list) or not all(isinstance(e, dict) and isinstance(e.get("file"), str)
                                                   and isinstance(e.get("sample"), str) for e in listed):
            raise BackendError(f"the cache's manifest has a damaged list of {part.replace('_', '-')} entries",
                               source=str(path))
    planned = manifest.get("plan", {}).get("fingerprint")
    if planned != setup.plan.fingerprint:
        raise BackendError("the cache was made for another plan (other models to train); run stage 1 again",
                           source=str(path))
    return manifest


def check_options(setup: Setup, manifest: dict[str, Any], folder: Path) -> None:
    """One line when stage 2's command sets one of the pipeline's own flags to another value than stage 1 stored in
    the cache's entries (DiffSynth's stage 2 trains on the stored one whatever its command says); stage 2 without the
    flag trains on the stored one."""
    stored = manifest.get("key", {}).get("options", {})
    for name, _default in setup.glue.options:
        given = getattr(setup.args, name)
        if given is not None and isinstance(stored, dict) and name in stored and stored[name] != given:
            raise BackendError(f"--{name} {given:g}: this cache's entries hold {name} {stored[name]} (stage 1's); "
                               f"make the cache again with --{name} {given:g}, or leave the flag out of stage 2",
                               source=str(folder / MANIFEST))


# ------------------------------------------------------------------------------------------------
# training


def _lora(setup: Setup, pipe: Any) -> None:
    args = setup.args
    if args.trainable_models:
        pipe.freeze_except([m for m in args.trainable_models.split(",") if m])
    if not args.lora_base_model:
        return
    model = getattr(pipe, args.lora_base_model, None)
    if model is None or not hasattr(model, "named_modules"):
        raise BackendError(f"--lora_base_model {args.lora_base_model}: {setup.glue.class_name} has no such model loaded")
    target_list = target_modules(model, args.lora_target_modules)
    try:
        with seeded_global_stream(args.seed, "diffsynth-lora-init"):
            model = helper().add_lora_to_model(model, target_modules=target_list, lora_rank=args.lora_rank,
                                               lora_alpha=args.lora_alpha, upcast_dtype=pipe.torch_dtype)
    except ValueError as exc:
        raise BackendError(f"--lora_target_modules {','.join(target_list)!r}: {str(exc).splitlines()[0]}") from None
    setattr(pipe, args.lora_base_model, model)


def train(setup: Setup, states: Callable[[int, bool], tuple[dict, dict, dict]], sample_ids: list[str], pipe: Any,
          report: Callable[[str], None], result: RunResult, stage_models: list[str],
          stage_1: tuple[str, ...] = (), held_out: list[tuple[str, Callable[[], Any]]] = ()) -> RunResult:
    """The loop (DiffSynth's runner: a step of `processes x --gradient_accumulation_steps` samples, world.py):
    `states(i, empty)` gives sample i's state after stage 1's units, with the empty caption when `empty`
    (--caption_dropout draws it per sample and epoch: captions.py).

    The output folder is claimed as unitgraph's own first (train/outputs.RunFolder: a folder holding someone else's
    files is refused, an earlier run is moved aside only with --overwrite); a checkpoint and a training state
    (state.py) are written at each epoch's end and every --save_steps; --resume continues from the newest state.
    `stage_1`: the models stage 1 loaded (its cache's record), which a validation render borrows. `held_out`: (sample,
    its state) of the cache's held-out samples, whose mean loss (`held_out_loss`) is logged every --validation_steps
    optimizer steps, else at each epoch's end, to OUTPUT/validation_loss.csv."""
    import torch
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    args = setup.args
    objective = step_loss(args)
    check_objective(pipe, args.loss_weighting)
    _lora(setup, pipe)
    holder = DiffusionTrainingModule()
    holder.pipe = pipe  # parameter names "pipe.<model>.<module>...", as DiffSynth's training module has them
    named = [(n, p) for n, p in holder.named_parameters() if p.requires_grad]
    if not named:
        raise BackendError("nothing to train: the LoRA and --trainable_models left no parameter needing gradients")
    world = setup.world

    optimizer_args = check_optimizer(args.optimizer, args.optimizer_args, cuda=torch.cuda.is_available)

    def make_optimizer(params: list[Any]) -> Any:
        return build_optimizer(args.optimizer, optimizer_args, params, args.learning_rate, args.weight_decay)

    sharded = ShardedTraining(world, pipe, named, make_optimizer, max(1, args.gradient_accumulation_steps),
                              args.max_grad_norm) if world.sharded else None
    followed = sharded.named() if sharded is not None else dict(named)  # what the moving average follows
    optimizer = sharded.base if sharded is not None else make_optimizer([p for _, p in named])
    units = setup.stage_units("train")
    output = Path(args.output_path)
    prefix = DIFFSYNTH_REMOVE_PREFIX if args.remove_prefix_in_ckpt is None else args.remove_prefix_in_ckpt
    per = world.size * max(1, args.gradient_accumulation_steps)  # the samples of one optimizer step (world.py)
    n = len(sample_ids)
    total = args.num_epochs * -(-n * max(1, args.dataset_repeat) // per)  # the run's optimizer steps
    scheduler = make_lr_schedule(args.lr_scheduler, optimizer, args.lr_warmup_steps, total)
    ema = TrainedEMA(followed, args.ema_decay, args.ema_device or world.device) \
        if args.ema_decay is not None else None
    settings = settings_of(args, sample_ids, per, world.describe(),
                           sorted(a for m in setup.models if m.fp8 for a in m.attributes if a in stage_models))
    record = {"task": args.task, "pipeline": setup.glue.name, "plan_fingerprint": setup.plan.fingerprint}
    renderer = Renderer(setup, pipe, stage_models, setup.load_plain)
    lacking = [m for m in setup.plan.data_process_models if m in stage_1 and m not in setup.given]
    if renderer and lacking:
        raise BackendError(f"--validation_prompt draws through the whole pipeline, and the command names no file of "
                           f"{', '.join(lacking)} (stage 1's); name it too: stage 2 loads it only while the samples "
                           "render")
    if renderer and renderer.missing:
        report(f"samples:    {', '.join(renderer.missing)} loaded while the samples render (this stage trains without "
               "them)")
    if sharded is not None:
        report(f"engine:     {sharded.note()}")
    with _claimed(output, world, args.overwrite, record, args.resume is not None) as folder:
        result.replaced = folder.replaced if folder is not None else None
        step, position, rows = 0, (0, 0), []
        if args.resume is not None:
            found = newest_state(output, args.resume)
            loaded = load_state(found, [name for name, _ in named], settings, world.rank)
            if sharded is not None:
                sharded.restore(loaded.trained, loaded.optimizer, loaded.groups, str(found))
            else:
                with torch.no_grad():
                    for name, param in named:
                        param.copy_(loaded.trained[name])
                load_optimizer(optimizer, loaded.optimizer, loaded.groups, str(found))
            scheduler.load_state_dict(loaded.scheduler)
            if ema is not None and loaded.ema is not None:
                ema.restore(*loaded.ema)
            step, position, rows = loaded.step, loaded.position, loaded.rows
            result.resumed_from = found
            report(f"resumed:    {found} (epoch {position[0]}, step {step})")
            if world.main:
                prune_states(output, args.save_total_limit, resumed=found)
        start = time.perf_counter()
        log = HeldOutLog(output / HELD_OUT_FILE, world.main, step if args.resume is not None else None) \
            if held_out else None

        def evaluate(epoch: int) -> None:  # every process computes it (inside the engine's forward when sharded)
            def mean() -> float:
                return held_out_loss(pipe, units, held_out, args.seed, args.task, objective)

            value = sharded.within(mean) if sharded is not None and world.engine.shards_frozen else mean()
            log.add(step, epoch, value, len(held_out))

        convert = _opensource(setup.glue) if args.align_to_opensource_format else None

        def render(name: str) -> None:  # the validation samples as OUTPUT/samples/<name>/, and samples.html
            if not renderer:
                return
            folder = output / SAMPLES_DIR / name
            with eval_weights(optimizer), optional_swap(ema, followed, args.validation_use_ema):
                if sharded is not None and world.engine.shards_frozen:  # every process draws (samples.py)
                    result.sample_images += sharded.within(lambda: renderer.render(folder, write=world.main))
                elif world.main:
                    result.sample_images += renderer.render(folder)
            if world.main:
                renderer.page(output)

        def checkpoint(name: str, next_position: tuple[int, int]) -> None:
            path = output / name
            result.checkpoints.append(path)
            # every process: under ZeRO-3 and FSDP2 the weights are gathered, and each keeps its own optimizer share
            trained = sharded.whole() if sharded is not None else dict(named)
            shown = trained  # what the checkpoint holds: a schedule-free optimizer's averaged weights, switched to
            if args.optimizer == "schedulefree":  # by every process (the same switches keep the replicas equal)
                with eval_weights(optimizer):
                    if sharded is not None:  # a gather, every process
                        shown = sharded.whole()
                    elif world.main:  # the writer's copy
                        shown = {n: p.detach().clone() for n, p in named}
            # each process's optimizer share under an engine; else the main process's, which writes the state
            state = sharded.optimizer_state() if sharded is not None else \
                (optimizer_tensors(optimizer) if world.main else None)
            full = sharded.full() if sharded is not None else None  # FSDP2's gather of the average's shards
            averaged = ema.tensors(full) if ema is not None and (world.main or full is not None) else None
            ranks = staging_folder(output, step) if sharded is not None and world.size > 1 else None
            if ranks is not None:
                if not world.main:
                    save_rank_file(ranks, world.rank, state[0])
                world.barrier()
            if world.main:  # every process holds the same weights: the main one writes them
                _save(holder, shown, prefix, path, convert)
                if averaged is not None:  # the average beside it, in the checkpoint's own layout
                    _save(holder, averaged, prefix, output / ema_name(name), convert)
                _write_rows(output / "loss.csv", rows)
                save_state(output, step, next_position, trained, state, scheduler, rows, settings,
                           args.save_total_limit, ranks, (averaged, ema.step) if ema is not None else None)
            if not args.validation_steps:
                render(Path(name).stem)

        params = [p for _, p in named]
        for epoch in range(position[0], args.num_epochs):
            order = [i for _ in range(max(1, args.dataset_repeat)) for i in range(n)]
            order = [order[k] for k in permutation(len(order), args.seed, "diffsynth-shuffle", epoch)]
            first = position[1] if epoch == position[0] else 0
            for begin in range(first, len(order), per):
                chunk = order[begin:begin + per]
                began = time.perf_counter()
                losses = torch.zeros(len(chunk), dtype=torch.float64)

                def loss_of(index: int) -> Any:
                    empty = dropped(args.seed, epoch, sample_ids[index], args.caption_dropout)
                    return train_step(pipe, units, states(index, empty),
                                      step_seed(args.seed, epoch, sample_ids[index]), args.task, objective)

                if sharded is not None:  # the engine's backward passes, then its optimizer step
                    for at, value in sharded.step(chunk, loss_of):
                        losses[at] = value
                    if ema is not None:
                        ema.update(followed)
                else:
                    for at in range(world.rank, len(chunk), world.size):  # this process's share of the step
                        loss = loss_of(chunk[at])
                        (loss / len(chunk)).backward()  # the step's mean gradient, summed over its samples
                        losses[at] = float(loss.detach())
                    world.sum_gradients(params)
                    if args.max_grad_norm is not None:  # the step's mean gradient, clipped as a whole
                        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                    if ema is not None:
                        ema.update(followed)
                world.sum_(losses)
                lr_step(scheduler)
                step += 1
                result.steps += 1
                result.step_times.append(time.perf_counter() - began)
                for index, value in zip(chunk, losses.tolist()):
                    result.losses.append(value)
                    rows.append({"step": step, "epoch": epoch, "row": index, "loss": repr(value)})
                if args.validation_steps and step % args.validation_steps == 0:
                    if log is not None:
                        evaluate(epoch)
                    render(f"step-{step}")
                if args.save_steps and step % args.save_steps == 0 and begin + per < len(order):
                    checkpoint(f"step-{step}.safetensors", (epoch, begin + per))
            if log is not None and not args.validation_steps:
                evaluate(epoch)
            checkpoint(f"epoch-{epoch}.safetensors", (epoch + 1, 0))
        if log is not None:
            log.close()
        result.stage_times["train"] = time.perf_counter() - start
        result.loss_csv = output / "loss.csv"  # written with every checkpoint
    return result


@contextlib.contextmanager
def _claimed(output: Path, world: World, overwrite: bool, record: dict[str, Any], resume: bool):
    """The output folder claimed as unitgraph's (train/outputs.RunFolder) by the main process, the others waiting
    until it is; each ends once all have finished. Yields the main process's claim, None in the others. When the
    main process refuses the folder (its one line), the others stop with a line of their own, not a broken
    connection's traceback."""
    from ..train.outputs import RunFolder

    if world.main:
        with contextlib.ExitStack() as stack:
            try:
                folder = stack.enter_context(RunFolder(output).claimed(overwrite, record, resume=resume))
            except BaseException:
                world.agree(False)
                raise
            world.agree(True)
            yield folder
            world.barrier()
    else:
        if not world.agree(True):
            raise BackendError("the main process refused the output folder (its line says why)", source=str(output))
        yield None
        world.barrier()


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    import io

    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["step", "epoch", "row", "loss"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_bytes_atomic(path, text.getvalue().encode("utf-8"))


def _opensource(glue: Glue) -> Callable[[dict], dict]:
    """DiffSynth's converter of a LoRA file to the open-source layout its example applies (--align_to_opensource_format)."""
    import importlib

    module, _, path = glue.opensource_lora.partition(":")
    if not module.startswith("diffsynth."):
        raise BackendError(f"refusing to import {module}: only DiffSynth's own converters are used")
    target: Any = importlib.import_module(module)
    for part in path.split("."):
        target = getattr(target, part)
    return target


def _save(holder: Any, trained: dict[str, Any], prefix: str, path: Path,
          convert: Optional[Callable[[dict], dict]] = None) -> None:
    """The `trained` tensors (by their names in DiffSynth's training module) as its ModelLogger saves them: its
    export, then the example's converter."""
    from safetensors.torch import save

    state = holder.export_trainable_state_dict(trained, remove_prefix=prefix or None)
    if convert is not None:
        try:
            state = convert(state)
        except KeyError as exc:
            raise BackendError(f"--align_to_opensource_format: DiffSynth's converter has no open-source name for "
                               f"{exc.args[0]} (train modules of its table, as its example's --lora_target_modules "
                               "lists them)") from None
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    write_bytes_atomic(path, save(tensors))


# ------------------------------------------------------------------------------------------------
# the command


def run(args: TrainArgs, echo: Optional[Callable[[str], None]] = None, why: Optional[str] = None) -> RunResult:
    """Execute args.task through DiffSynth's pipeline (see the module docstring); `why` the pipeline was chosen."""
    report = echo or (lambda line: None)
    if not available():
        raise BackendError(f"--pipeline {args.pipeline} runs DiffSynth-Studio's own pipeline; {EXTRA_HINT}")
    glue_for(str(args.pipeline))
    check_flags(args)
    import warnings

    with warnings.catch_warnings():  # the deprecation notes transformers gives DiffSynth's code, once a step
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|diffsynth)\.")
        return _run(args, report, why)


def _run(args: TrainArgs, report: Callable[[str], None], why: Optional[str]) -> RunResult:
    s = setup(args)
    if args.dry_run:  # DiffSynth's model configs on the meta device: nothing loaded, downloaded or written
        from ..engine import Engine, engine_from_config_file
        from .memory import memory_plan

        engine = engine_from_config_file(args.config_file, args.num_processes) if args.config_file else \
            Engine(processes=args.num_processes or 1)
        _refuse_under(engine, s.models, args)
        return RunResult(task=args.task, output_path=Path(args.output_path), plan=s.plan,
                         memory_plan=memory_plan(s, engine))
    report(f"pipeline: {s.glue.name} (DiffSynth's {s.glue.class_name}; {why or '--pipeline'})")
    def named(models: list[str]) -> str:  # the plan's models the command gives (an optional one may be absent)
        return ", ".join(m for m in models if m in s.given) or "no model"

    report(f"plan: stage 1 runs {', '.join(s.plan.data_process_units) or 'nothing'} "
           f"({named(s.plan.data_process_models)}); stage 2 runs "
           f"{', '.join(s.plan.train_units) or 'only the loss'} ({named(s.plan.train_models)})")
    for line in s.notes.values():
        report(f"      {line}")
    for line in offload_notes(s):
        report(line)
    if task_stage(args.task) == "data_process":
        where = Path(args.cache_path or args.output_path)
        return data_process(s, where, report)
    if task_stage(args.task) == "train":
        folder = Path(args.cache_path or args.dataset_base_path)
        manifest = read_manifest(folder, s)
        entries = manifest["entries"]
        recorded = manifest.get("models", {})
        check_options(s, manifest, folder)
        # (the tokenizer of a model-free stage-1 unit only where validation samples are drawn through every unit)
        pipe = s.load(s.plan.train_models, "stage 2", recorded, units=bool(args.validation_prompt))
        result = RunResult(task=args.task, output_path=Path(args.output_path), plan=s.plan, cache_path=folder)
        result.samples = len(entries)

        if args.masked_loss and not manifest.get("key", {}).get("masked_loss"):
            raise BackendError("--masked_loss: this cache holds no loss masks; make it with --masked_loss too (--task "
                               f"{task_kind(args.task)}:data_process)", source=str(folder / MANIFEST))
        if args.caption_dropout and not manifest.get("key", {}).get(EMPTY_CAPTION):
            raise BackendError("--caption_dropout: this cache holds no empty-caption states; make it with "
                               f"--caption_dropout too (--task {task_kind(args.task)}:data_process)",
                               source=str(folder / MANIFEST))

        def cached(entry: dict[str, Any], empty: bool = False) -> tuple[dict, dict, dict]:
            values, _meta = read_entry(folder / entry["file"])
            state = values["inputs_shared"], values["inputs_posi"], values["inputs_nega"]
            if empty and not isinstance(values.get(EMPTY_CAPTION), dict):
                raise BackendError("the entry holds no empty-caption state (a damaged cache: run stage 1 again)",
                                   source=str(folder / entry["file"]))
            return applied(state, values[EMPTY_CAPTION]) if empty else state

        held = manifest.get(HELD_OUT) or []
        if args.validation_dataset and not held:
            raise BackendError("--validation_dataset: this cache holds no held-out samples; make it with "
                               f"--validation_dataset (--task {task_kind(args.task)}:data_process)",
                               source=str(folder / MANIFEST))
        return train(s, lambda index, empty: cached(entries[index], empty), [e["sample"] for e in entries], pipe,
                     report, result, s.plan.train_models,
                     tuple(recorded) if recorded else tuple(s.plan.data_process_models),
                     [(str(e["sample"]), lambda e=e: cached(e)) for e in held])
    # sft: the data_process units run fresh in every step, on every model
    import torch

    dataset = dataset_of(s)
    everything = sorted(set(s.plan.data_process_models) | set(s.plan.train_models))
    pipe = s.load(everything, "the run")
    first = s.stage_units("data_process")
    result = RunResult(task=args.task, output_path=Path(args.output_path), plan=s.plan)
    result.samples = len(dataset)

    def fresh(index: int, empty: bool) -> tuple[dict, dict, dict]:
        given = sample_state(s, dataset, index, pipe.device)
        with torch.no_grad():
            return run_units(pipe, first, _transfer(emptied(given) if empty else given, pipe))

    return train(s, fresh, [dataset.sample_id(i) for i in range(len(dataset))], pipe, report, result, everything)

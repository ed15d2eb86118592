"""What every stage sets up the same way: the plan, the accelerator, the dataset, and the gradient rule for
running a unit. Family-agnostic: the family comes in the config. (A stage's models: `models/stage.py`;
messages and progress bars: `report.py`; what a run did: `result.py`.)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from unitgraph.graph import VersionGraph
from unitgraph.plan import Plan, split

from .config import RunConfig
from .context import ImageSize
from .data.dataset import DiffusionDataset
from .data.mixture import DatasetMixture
from .errors import BackendError


def plan_for(cfg: RunConfig) -> Plan:
    """The run's split, proved by the planner (a plan that fails verification is a bug, never input)."""
    plan = split(cfg.pipeline.spec_pipeline, trainable_models=list(cfg.optim.trainable),
                 lora_base_model=cfg.lora.base_model, cache_mode=cfg.cache_mode)
    if plan.violations:  # pragma: no cover - the planner proves its plans
        raise RuntimeError(f"planner produced a plan failing verification: {plan.violations[0]}")
    return plan


def make_accelerator(cfg: RunConfig):
    """The run's Accelerator, under its engine (engine.py).

    Data parallel: accelerate's own DDP (CPU processes over gloo without CUDA). DeepSpeed: accelerate makes the
    engine at `prepare`; on a CPU DeepSpeed needs its CPU accelerator (DS_ACCELERATOR=cpu) and accelerate a gloo
    process group, or it would count one process. The precision is unitgraph's under every engine (the trained
    models' forward autocast, train/engines.py), so DeepSpeed's own is left off. FSDP2: accelerate sets up the
    processes as for data parallel, and the trained models are sharded with torch's fully_shard (train/engines.py).
    """
    import torch
    from accelerate import Accelerator, DistributedDataParallelKwargs

    engine = cfg.engine
    # A LoRA on modules whose outputs nobody reads (the text stream of a DiT's last block, say) leaves
    # parameters without gradients; DDP then needs find_unused_parameters. Multi-process runs turn it on.
    multi = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    handlers: list[Any] = [DistributedDataParallelKwargs(find_unused_parameters=cfg.optim.find_unused_parameters or multi)]
    trackers = {} if cfg.output.report_to == "none" else {
        "log_with": cfg.output.report_to, "project_dir": str(Path(cfg.output.path) / "logs")}
    if engine.kind == "deepspeed":
        return deepspeed_accelerator(engine, handlers, trackers, multi)
    cuda = torch.cuda.is_available()
    # the run's precision (--mixed_precision, else accelerate's launch flag or config, else bf16: config.py);
    # accelerate autocasts the trained models it prepares and scales fp16 losses
    _forget_other_precision(cfg.precision.mixed, multi)
    with _without_fsdp_plugin(engine.kind == "fsdp2"):
        return Accelerator(cpu=not cuda, mixed_precision=cfg.precision.mixed, kwargs_handlers=handlers, **trackers)


def deepspeed_accelerator(engine: Any, handlers: list[Any], trackers: dict[str, Any], multi: bool) -> Any:
    """The Accelerator of a DeepSpeed launch: accelerate makes the engine at `prepare`. On a CPU DeepSpeed needs its
    CPU accelerator (DS_ACCELERATOR=cpu) and accelerate a gloo process group, or it would count one process. The
    precision is the caller's (autocast, or the models' own dtype), so DeepSpeed's own is left off."""
    import torch
    from accelerate import Accelerator, InitProcessGroupKwargs

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        handlers = [*handlers, InitProcessGroupKwargs(backend="gloo")]
    _forget_other_precision("no", multi)
    try:
        accelerator = Accelerator(mixed_precision="no", kwargs_handlers=handlers, **trackers)
    except ValueError as exc:  # accelerate's checks of a DeepSpeed config against the launch's settings
        first = " ".join(str(exc).split("\n")[:2]).strip()
        raise BackendError(f"accelerate refuses the DeepSpeed settings: {first}",
                           source=engine.config_file or engine.source) from None
    # transformers' from_pretrained would build every model inside deepspeed.zero.Init under ZeRO-3, the frozen
    # encoders too, which then could not run outside an engine: models load whole, and the engine shards the
    # trained one when it is made (its weights are partitioned there, before the first step)
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return accelerator


@contextlib.contextmanager
def _without_fsdp_plugin(active: bool):
    """accelerate's FSDP plugin hidden while the Accelerator is made: under FSDP2 unitgraph shards the trained
    models itself (on a CPU the plugin would silently train data-parallel, on a GPU wrap them a second time)."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None) if active else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def _forget_other_precision(mixed: str, multi: bool) -> None:
    """accelerate keeps one process-wide state whose precision cannot change; a single-process caller (a notebook,
    the tests, `unitgraph demo`) that runs again at another precision starts that state anew. Processes of one
    distributed run all share the run's precision, so theirs is never touched."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if not multi and state.get("_mixed_precision") not in (None, mixed):
        AcceleratorState._reset_state()


def make_dataset(cfg: RunConfig, held_out: bool = False) -> "DiffusionDataset | DatasetMixture":
    """The run's dataset: the one of --dataset_base_path, or the datasets of --dataset_config as one; with
    `held_out` (stage 1) and --validation_dataset, its samples follow the training samples'
    (`DatasetMixture.held_out_from`)."""
    extra = cfg.data.held_out if held_out else None
    if not cfg.data.datasets and extra is None:
        return _one_dataset(cfg)
    parts: list[tuple[Any, Any, dict[str, Any]]] = []
    for spec in cfg.data.datasets:
        own = dataset_config(cfg, spec)
        parts.append((spec.name, _one_dataset(own), own_shaping(cfg, own)))
    if not parts:
        parts.append((None, _one_dataset(cfg), {}))  # the run's one dataset, its records as they always were
    if extra is not None:
        parts.append((extra.name, _one_dataset(dataset_config(cfg, extra)), {}))
    return DatasetMixture(parts, str(cfg.data.config_path or cfg.data.metadata_path),
                          held_out=extra is not None)


def _one_dataset(cfg: RunConfig) -> DiffusionDataset:
    spec = cfg.pipeline.spec_pipeline
    return DiffusionDataset(cfg.data.base_path, cfg.data.metadata_path, VersionGraph.of(spec).dataset_params,
                            data_file_keys=cfg.data.file_keys, extra_inputs=cfg.data.extra_inputs,
                            required=cfg.pipeline.required, optional=cfg.pipeline.optional,
                            image_params=cfg.pipeline.image_params, param_types=cfg.pipeline.param_types,
                            video_params=cfg.pipeline.video_params, num_frames=cfg.data.num_frames,
                            audio_params=cfg.pipeline.audio_params,
                            strict=("mask",) if cfg.units.masked_loss is not None else ())


def dataset_config(cfg: RunConfig, spec: Any) -> RunConfig:
    """The run as one dataset of its --dataset_config sees it: its folder and metadata, and its own size, file
    columns and clip length where it gives them (a size given replaces the run's --height/--width/--max_pixels
    whole). A dataset that gives nothing of its own is the run itself: its entries' keys are the run's."""
    size = cfg.units.image_size
    if spec.height is not None:
        size = ImageSize(spec.height, spec.width, spec.max_pixels or size.max_pixels)
    elif spec.max_pixels is not None:
        size = ImageSize(None, None, spec.max_pixels)
    data = replace(cfg.data, base_path=spec.base_path, metadata_path=spec.metadata, repeat=1,
                   file_keys=tuple(spec.data_file_keys) if spec.data_file_keys is not None else cfg.data.file_keys,
                   num_frames=spec.num_frames if spec.num_frames is not None else cfg.data.num_frames)
    return replace(cfg, units=replace(cfg.units, image_size=size), data=data)


def own_shaping(cfg: RunConfig, own: RunConfig) -> dict[str, Any]:
    """What one dataset's config changes of the run's settings that shape entries ({} when nothing): the image size
    as a cache key records it, the file columns, the clip length."""
    out: dict[str, Any] = {}
    if own.units.image_size.key() != cfg.units.image_size.key():
        out["image_size"] = own.units.image_size.key()
    if own.data.file_keys != cfg.data.file_keys:
        out["data_file_keys"] = list(own.data.file_keys)
    if own.data.num_frames != cfg.data.num_frames and (cfg.pipeline.video_params or cfg.pipeline.audio_params):
        out["num_frames"] = own.data.num_frames
    return out


def unit_grad(unit: Any, backward: set[str], inputs: dict[str, Any]) -> Any:
    """no_grad for a unit whose models are all frozen and whose inputs carry no gradient (same numbers, less memory)."""
    import torch

    needs = bool(set(unit.models) & backward) or any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values())
    return contextlib.nullcontext() if needs else torch.no_grad()



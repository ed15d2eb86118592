"""A stage's models: which slots it loads for its plan's models, loading them frozen, and the units' context.

Each stage (stage 1, stage 2, the unsplit run) loads only the models its plan lists, plus the
tokenizers, processors and schedulers those need; `make_context` is the only way a unit reaches them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Iterable

from ..context import UnitContext
from ..errors import BackendError

if TYPE_CHECKING:  # annotations only: the run's configuration sits above the rooms
    from ..config import RunConfig


def declared_absent(cfg: RunConfig, slots: Iterable[str]) -> set[str]:
    """The slots the run goes without (`ModelSources.declared_absent`: a pipeline folder's model_index.json says
    it has none, or an optional model no path provides; an image-to-video release without an image encoder, say):
    a stage loads none of them, nor their tokenizers and companions, and a unit that would call one says so."""
    from .sources import ModelLoadError

    try:
        sources = cfg.models.sources(cfg.family)
        return {slot for slot in slots if sources.declared_absent(slot)}
    except ModelLoadError:  # the loading that follows says what is wrong with the paths
        return set()


def stage_slots(cfg: RunConfig, models: Iterable[str], training: bool) -> list[str]:
    """The slots a stage loads for its plan models: each model, the tokenizer paired with a text
    encoder, the pipeline's companions of the model (a processor beside a text encoder, say), and in
    training the family's schedulers (timesteps and losses read them); never a slot the run goes without
    (`declared_absent`)."""
    models = list(models)
    absent = declared_absent(cfg, models)
    slots: list[str] = []
    for name in models:
        if name in absent:
            continue
        slots.append(name)
        tokenizer = cfg.family.slot(name).tokenizer
        if tokenizer is not None:
            slots.append(tokenizer)
        slots.extend(cfg.pipeline.companions.get(name, ()))
    if training:
        slots += [s.name for s in cfg.family.slots if s.kind == "scheduler"]
    slots = list(dict.fromkeys(slots))
    absent = declared_absent(cfg, slots)
    return [s for s in slots if s not in absent]


def _library_progress_bars(enabled: bool) -> None:
    """--no-progress also silences the loading bars of transformers and diffusers."""
    for module in ("transformers.utils.logging", "diffusers.utils.logging"):
        try:
            logging = importlib.import_module(module)
        except ImportError:  # pragma: no cover - both are backend dependencies
            continue
        (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()


def into_shards(cfg: RunConfig, training: bool) -> set[str]:
    """The slots a training stage builds without weights, to read them straight into their FSDP2 shards or ZeRO-3
    partitions (models/shards.py; ZeRO-3 when the config's zero3_init_flag asks for it, as accelerate's does): the
    models it trains (--trainable_models and a LoRA's base), unless the run first changes the whole weights of one
    (a preset LoRA merged in, a LoRA checkpoint read into the adapters: those load whole)."""
    engine = getattr(cfg, "engine", None)
    sharded = engine is not None and (engine.kind == "fsdp2" or (engine.kind == "deepspeed" and engine.zero_stage == 3
                                                                 and engine.zero3_init))
    if not training or not sharded:
        return set()
    slots = set(cfg.optim.trainable)
    if cfg.lora.base_model and not cfg.lora.checkpoint:
        slots.add(cfg.lora.base_model)
    if cfg.lora.preset_path:
        slots.discard(cfg.lora.preset_model)
    return slots


def load_models(cfg: RunConfig, models: Iterable[str], training: bool, device: Any) -> dict[str, Any]:
    """The stage's models (frozen, eval mode, on `device`) and their tokenizers and schedulers.

    Frozen models load directly in the compute dtype, models trained in full (training stages) in fp32;
    --fp8_models are then stored in fp8, except a LoRA base model in training, which gets that after its
    adapters are added (train/loop.py), so that they are never fp8 (models/precision.py). Under FSDP2 the trained
    models (and under ZeRO-3 with zero3_init_flag) are built without weights (`into_shards`) and stay on the meta
    device until sharded."""
    import torch

    from .precision import store_fp8
    from .shards import deferred
    from .sources import ModelLoadError

    _library_progress_bars(cfg.output.progress)
    slots = stage_slots(cfg, models, training)
    full = [s for s in slots if training and s in cfg.optim.trainable]
    skeletons = into_shards(cfg, training)
    try:
        sources = cfg.models.sources(cfg.family)
        sources.resolve_many(slots)  # every slot found before the (slow) loading starts
        loaded = sources.load([s for s in slots if s not in full], torch_dtype=getattr(torch, cfg.precision.compute_dtype),
                              skeletons=skeletons)
        if full:
            loaded.update(sources.load(full, torch_dtype=torch.float32, skeletons=skeletons))
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None
    loaded = {slot: loaded[slot] for slot in slots}
    # a LoRA base that becomes fp8 or swaps blocks stays in CPU memory until then (train/loop.py places it):
    # on the device it would need its whole compute-dtype size first
    later = {cfg.lora.base_model} if training and (cfg.lora.base_model in cfg.precision.fp8
                                                   or cfg.precision.blocks_to_swap) else set()
    for slot, value in loaded.items():
        if isinstance(value, torch.nn.Module):
            value.requires_grad_(False)
            value.eval()
            if slot in cfg.precision.fp8 and slot not in later and not (training and slot == cfg.lora.base_model):
                store_fp8(value, slot, cfg.precision.compute_dtype)  # in CPU memory, then to the device
            if slot not in later and deferred(value) is None:
                value.to(device)
    return loaded


def make_context(cfg: RunConfig, models: dict[str, Any], device: Any) -> UnitContext:
    """The stage's unit context; the configs the pipeline's units declare are read on demand (config.json only)."""
    return UnitContext(models=models, settings=cfg.units, device=device, config_loader=config_loader(cfg))


def config_loader(cfg: RunConfig) -> Any:
    """slot -> its configuration from its config.json (no weights), for the slots the pipeline's units declare
    in `configs`; a BackendError (one line) when it cannot be found."""
    from .sources import ModelLoadError

    declared = set(getattr(cfg.pipeline.spec_pipeline, "configs", ()))

    def load(slot: str) -> Any:
        if slot not in declared:
            raise RuntimeError(f"no unit of {cfg.pipeline.name} declares it reads the configuration of {slot!r}")
        try:
            return cfg.models.sources(cfg.family).load_config(slot)
        except ModelLoadError as exc:
            raise BackendError(str(exc)) from None

    return load

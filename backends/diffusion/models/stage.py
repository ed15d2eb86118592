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


def stage_slots(cfg: RunConfig, models: Iterable[str], training: bool) -> list[str]:
    """The slots a stage loads for its plan models: each model, the tokenizer paired with a text
    encoder, the pipeline's companions of the model (a processor beside a text encoder, say), and in
    training the family's schedulers (timesteps and losses read them)."""
    slots: list[str] = []
    for name in models:
        slots.append(name)
        tokenizer = cfg.family.slot(name).tokenizer
        if tokenizer is not None:
            slots.append(tokenizer)
        slots.extend(cfg.pipeline.companions.get(name, ()))
    if training:
        slots += [s.name for s in cfg.family.slots if s.kind == "scheduler"]
    return list(dict.fromkeys(slots))


def _library_progress_bars(enabled: bool) -> None:
    """--no-progress also silences the loading bars of transformers and diffusers."""
    for module in ("transformers.utils.logging", "diffusers.utils.logging"):
        try:
            logging = importlib.import_module(module)
        except ImportError:  # pragma: no cover - both are backend dependencies
            continue
        (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()


def load_models(cfg: RunConfig, models: Iterable[str], training: bool, device: Any) -> dict[str, Any]:
    """The stage's models (frozen, eval mode, on `device`) and their tokenizers and schedulers."""
    import torch

    from .sources import ModelLoadError

    _library_progress_bars(cfg.output.progress)
    try:
        loaded = cfg.models.sources(cfg.family).load(stage_slots(cfg, models, training), torch_dtype=torch.float32)
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None
    for value in loaded.values():
        if isinstance(value, torch.nn.Module):
            value.requires_grad_(False)
            value.eval()
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

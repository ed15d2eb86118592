"""What every stage sets up the same way: the plan, the accelerator, messages, progress bars, the
dataset, a stage's models and the units' context. Family-agnostic: the family comes in the config.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from unitgraph.graph import VersionGraph
from unitgraph.plan import Plan, split

from .args import BackendError
from .config import RunConfig
from .context import UnitContext
from .data import DiffusionDataset


@dataclass
class RunResult:
    task: str
    output_path: Path
    plan: Plan
    plan_path: Optional[Path] = None
    cache_path: Optional[Path] = None
    cache_reused: bool = False
    entries_computed: int = 0
    entries_reused: int = 0
    computed_indices: list[int] = field(default_factory=list)  # samples whose entry stage 1 computed
    skipped: list[dict[str, Any]] = field(default_factory=list)  # samples left out: {"index", "reason"}
    stage1_reason: str = ""
    loss_csv: Optional[Path] = None
    loss_plot: Optional[Path] = None
    checkpoints: list[Path] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    steps: int = 0
    step_times: list[float] = field(default_factory=list)
    replaced: Optional[Path] = None  # where --overwrite moved an earlier run's files
    resumed_from: Optional[Path] = None  # the training state --resume continued from
    sample_images: list[Path] = field(default_factory=list)  # validation samples written
    losses: list[float] = field(default_factory=list)

    @property
    def median_step_s(self) -> Optional[float]:
        times = self.step_times[1:] or self.step_times  # the first step pays one-off set-up costs
        return statistics.median(times) if times else None

    @property
    def last_checkpoint(self) -> Optional[Path]:
        return self.checkpoints[-1] if self.checkpoints else None


class Reporter:
    """Prints on the main process only: progress lines and notes on stdout, warnings on stderr
    (unless `echo` takes every line).

    Notes about the flags (`note(text)`) are held until the run has passed its whole-run checks (the
    first progress line, or `flush()`): a run refused for bad input prints its one error line only.
    """

    def __init__(self, accelerator: Any, echo: Optional[Callable[[str], None]] = None):
        self.main = accelerator.is_main_process
        self.echo = echo
        self._held: list[str] = []

    def note(self, text: str) -> None:
        self._held.append(text)

    def flush(self) -> None:
        held, self._held = self._held, []
        for text in held:
            self._print(text)

    def __call__(self, text: str) -> None:
        self.flush()
        self._print(text)

    def _print(self, text: str) -> None:
        if not self.main:
            return
        if self.echo is not None:
            self.echo(text)
        else:
            print(text, file=sys.stderr if text.startswith("warning:") else sys.stdout, flush=True)


def plan_for(cfg: RunConfig) -> Plan:
    """The run's split, proved by the planner (a plan that fails verification is a bug, never input)."""
    plan = split(cfg.pipeline.spec_pipeline, trainable_models=list(cfg.optim.trainable),
                 lora_base_model=cfg.lora.base_model, cache_mode=cfg.cache_mode)
    if plan.violations:  # pragma: no cover - the planner proves its plans
        raise RuntimeError(f"planner produced a plan failing verification: {plan.violations[0]}")
    return plan


def make_accelerator(cfg: RunConfig):
    import torch
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # A LoRA on modules whose outputs nobody reads (the text stream of a DiT's last block, say) leaves
    # parameters without gradients; DDP then needs find_unused_parameters. Multi-process runs turn it on.
    multi = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=cfg.optim.find_unused_parameters or multi)]
    trackers = {} if cfg.output.report_to == "none" else {
        "log_with": cfg.output.report_to, "project_dir": str(Path(cfg.output.path) / "logs")}
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no", kwargs_handlers=handlers, **trackers)


def make_dataset(cfg: RunConfig) -> DiffusionDataset:
    spec = cfg.pipeline.spec_pipeline
    return DiffusionDataset(cfg.data.base_path, cfg.data.metadata_path, VersionGraph.of(spec).dataset_params,
                            data_file_keys=cfg.data.file_keys, extra_inputs=cfg.data.extra_inputs,
                            required=cfg.pipeline.required, optional=cfg.pipeline.optional,
                            image_params=cfg.pipeline.image_params, param_types=cfg.pipeline.param_types,
                            video_params=cfg.pipeline.video_params, num_frames=cfg.data.num_frames)


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

    from .models import ModelLoadError

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
    from .models import ModelLoadError

    declared = set(getattr(cfg.pipeline.spec_pipeline, "configs", ()))

    def load(slot: str) -> Any:
        if slot not in declared:
            raise RuntimeError(f"no unit of {cfg.pipeline.name} declares it reads the configuration of {slot!r}")
        try:
            return cfg.models.sources(cfg.family).load_config(slot)
        except ModelLoadError as exc:
            raise BackendError(str(exc)) from None

    return load


def unit_grad(unit: Any, backward: set[str], inputs: dict[str, Any]) -> Any:
    """no_grad for a unit whose models are all frozen and whose inputs carry no gradient (same numbers, less memory)."""
    import torch

    needs = bool(set(unit.models) & backward) or any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values())
    return contextlib.nullcontext() if needs else torch.no_grad()


def progress(iterable: Any, total: int, desc: str, enabled: bool):
    """A progress bar on stderr; redrawn at most every 15 s when stderr is a log file, not a terminal."""
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True,
                mininterval=0.1 if interactive else 15.0)


def count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"

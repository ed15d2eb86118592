"""Which expert of a two-expert denoiser a run trains, and the timesteps it trains it on (`family.Experts`).

A video family ships its largest DiT as two experts of one architecture: `transformer` denoises the timesteps at or above
`boundary_ratio` x 1000 (model_index.json: 0.875 for T2V, 0.9 for I2V) and `transformer_2` the others. A LoRA
trains one expert, on that expert's timesteps only. DiffSynth-Studio's commands say which by the files they name
(`high_noise_model/...`) and by --min/max_timestep_boundary, fractions of the training schedule's positions from
the noisiest: its T2V high-noise command keeps 0..0.417, the 417 noisiest positions of the shift-5 schedule, whose
timesteps are >= 875. The rules, in order:

1. **Named.** --expert names the expert, and so does a model argument in an expert's subfolder or release folder
   (`<org>/<model>-Diffusers:transformer_2/*.safetensors`, `<org>/<model>:high_noise_model/...`, a --model_paths
   folder `.../transformer_2`). Two different names are an error.
2. **Chosen by the boundaries.** Otherwise, when a --model_paths pipeline folder holds the experts, the expert is
   the one whose positions hold every position the boundaries leave. Boundaries that leave positions of both (the
   whole schedule, the default, among them) are an error line asking for --expert and giving each one's range.
3. **Its range.** A command that leaves the whole schedule trains the expert's own positions; one that narrows
   them keeps its range, which must lie within the expert's.

Stage 1 (`:data_process`) runs no expert (the DiT's loss is stage 2's; an I2V unit reads the DiT's config, the same
for both experts), so it needs no choice: left open, its cache serves either expert's stage 2.

The expert's boundary ratio comes from the pipeline folder's model_index.json (or the one above a component
folder), else from the release's published value (`Experts.published`). No stage-1 unit reads the expert or the
boundaries, so one stage-1 cache serves both experts' runs. No torch at import time beyond the schedule's table.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .args import TrainArgs
from .errors import BackendError
from .family import Experts, Family
from .flowmatch import position_range
from .models.hub import origin_subfolder
from .models.sources import parse_model_id_with_origin_paths, parse_model_paths

WHOLE = (0.0, 1.0)

__all__ = ["ExpertChoice", "choose_expert"]


@dataclass(frozen=True)
class ExpertChoice:
    """The expert a run trains (None: the family's denoiser is a single model) and the timestep bounds it draws in."""

    expert: Optional[str]
    bounds: tuple[float, float]
    line: str = ""  # "expert: NAME (why; its range)", printed with the run's first lines
    ratio: Optional[float] = None  # the boundary ratio between the experts, when known (validation renders with it)


@dataclass(frozen=True)
class _Named:
    expert: str
    what: str  # the argument that names it, in words


def choose_expert(args: TrainArgs, family: Family) -> ExpertChoice:
    """The expert `args` train and its timestep bounds, by the rules of this module; a BackendError (one line)
    when the command names two, names one the models do not hold, or leaves the choice open."""
    bounds = (float(args.min_timestep_boundary), float(args.max_timestep_boundary))
    experts = family.experts
    given = getattr(args, "expert", None)
    if experts is None:
        if given:
            raise BackendError(f"--expert {given}: the {family.title} family's denoiser is a single model, not experts")
        return ExpertChoice(None, bounds)
    if given and given not in experts.names:
        raise BackendError(f"--expert {given!r} is not an expert of {family.title} (experts: {', '.join(experts.names)})")
    named = _named(args, experts)
    if given:
        named.append(_Named(given, "--expert"))
    if len({n.expert for n in named}) > 1:
        first, other = named[0], next(n for n in named if n.expert != named[0].expert)
        raise BackendError(f"the command names two experts: {first.expert} ({first.what}) and {other.expert} "
                           f"({other.what}); a run trains one")
    folder = _experts_folder(args, experts)
    if given and folder is None:
        single = _single_dit_folder(args, experts)
        if single is not None:
            raise BackendError(f"--expert {given}: {single} holds one DiT, not experts")
    ratio = _ratio(args, experts, folder)
    if not named and folder is None:
        return ExpertChoice(None, bounds)  # a single DiT: no experts involved
    ranges = _ranges(experts, ratio) if ratio is not None else None
    _check_ranges(experts, ranges, ratio, folder)
    if named:
        expert, why = named[0].expert, named[0].what
    elif args.stage == "data_process" and _open(experts, ranges, bounds):
        return ExpertChoice(None, bounds)  # stage 1 runs no expert: its cache serves the runs of either
    else:
        expert, why = _by_bounds(experts, ranges, bounds, folder)
    if ranges is None:
        if bounds == WHOLE:
            raise BackendError(f"the {expert} expert's timesteps need its boundary ratio ({experts.boundary_key} of a "
                               "pipeline folder's model_index.json), which this command's models do not give; narrow "
                               "--min_timestep_boundary / --max_timestep_boundary to its range")
        return ExpertChoice(expert, bounds, f"expert: {expert} ({why}; --min_timestep_boundary {bounds[0]:g} "
                                            f"--max_timestep_boundary {bounds[1]:g})")
    own = ranges[expert]
    steps = experts.schedule.steps
    if bounds == WHOLE:
        bounds = _fractions(own, steps)
    elif not _within(position_range(bounds, steps), own):
        raise BackendError(f"--min_timestep_boundary {bounds[0]:g} --max_timestep_boundary {bounds[1]:g} leave timesteps "
                           f"outside the {expert} expert's ({_describe(experts, expert, ratio, own, steps)})")
    return ExpertChoice(expert, bounds, f"expert: {expert} ({why}; {_describe(experts, expert, ratio, own, steps)})",
                        ratio)


def _named(args: TrainArgs, experts: Experts) -> list[_Named]:
    """The experts the model arguments name by their subfolder or release folder. The first expert's subfolder is
    every single-DiT pipeline's too (`transformer`): it names that expert only in a known two-expert release (a
    published ratio) or beside the other experts (a model_index.json above that lists them)."""
    out = []
    shared = experts.subfolders[0][1]
    for model_id, pattern in parse_model_id_with_origin_paths(args.model_id_with_origin_paths):
        sub = origin_subfolder(pattern)
        expert = experts.of_subfolder(sub)
        if expert is not None and (sub != shared or _published(experts, model_id) is not None):
            out.append(_Named(expert, f"{model_id}:{pattern}"))
    for given in parse_model_paths(args.model_paths):
        path = Path(given).expanduser()
        folder = path.parent if path.is_file() else path
        expert = experts.of_subfolder(folder.name)
        if expert is not None and (folder.name != shared or _holds_experts(_read_index(folder.parent), experts)):
            out.append(_Named(expert, given))
    return out


def _published(experts: Experts, model_id: str) -> Optional[float]:
    return next((float(v) for pattern, v in experts.published if fnmatch.fnmatchcase(model_id, pattern)), None)


def _read_index(path: Path) -> Optional[dict]:
    try:
        value = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _holds_experts(index: Optional[dict], experts: Experts) -> bool:
    """Whether a model_index.json lists every expert's subfolder as a component (not null) and a boundary ratio."""
    if index is None or index.get(experts.boundary_key) is None:
        return False
    return all(isinstance(index.get(sub), list) and index[sub][0] is not None for _, sub in experts.subfolders)


def _experts_folder(args: TrainArgs, experts: Experts) -> Optional[Path]:
    """The --model_paths pipeline folder holding the experts (or the one above an expert's component folder)."""
    for given in parse_model_paths(args.model_paths):
        path = Path(given).expanduser()
        folder = path.parent if path.is_file() else path
        for candidate in (folder, folder.parent):
            if _holds_experts(_read_index(candidate), experts):
                return candidate
    return None


def _single_dit_folder(args: TrainArgs, experts: Experts) -> Optional[Path]:
    """A --model_paths pipeline folder whose model_index.json lists the expert slot's first subfolder alone."""
    first, others = experts.subfolders[0][1], [sub for _, sub in experts.subfolders[1:]]
    for given in parse_model_paths(args.model_paths):
        path = Path(given).expanduser()
        index = _read_index(path) if path.is_dir() else None
        if index is not None and isinstance(index.get(first), list) and not _holds_experts(index, experts) and \
                not any(isinstance(index.get(sub), list) and index[sub][0] is not None for sub in others):
            return path
    return None


def _ratio(args: TrainArgs, experts: Experts, folder: Optional[Path]) -> Optional[float]:
    """The boundary ratio: the experts folder's model_index.json, else the published one of a model id named."""
    if folder is not None:
        value = _read_index(folder)[experts.boundary_key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < float(value) < 1.0:
            raise BackendError(f"{experts.boundary_key} is {value!r}, not a fraction between 0 and 1",
                               source=str(folder / "model_index.json"))
        return float(value)
    for model_id, _ in parse_model_id_with_origin_paths(args.model_id_with_origin_paths):
        if _published(experts, model_id) is not None:
            return _published(experts, model_id)
    return None


def _ranges(experts: Experts, ratio: float) -> dict[str, tuple[int, int]]:
    """Each expert's [first, last) schedule positions: the noisiest expert's timesteps >= ratio x 1000."""
    cut = experts.positions(ratio)
    first, second = experts.names
    return {first: (0, cut), second: (cut, experts.schedule.steps)}


MIN_EXPERT_POSITIONS = 2  # an expert of fewer schedule positions trains on one timestep or none (a loss of exactly 0)


def _check_ranges(experts: Experts, ranges: Optional[dict[str, tuple[int, int]]], ratio: Optional[float],
                  folder: Optional[Path]) -> None:
    """Refuse a boundary ratio that leaves an expert fewer than MIN_EXPERT_POSITIONS of the schedule's positions,
    whichever expert the run trains: such a folder's other expert could not be trained either."""
    for name, (first, last) in (ranges or {}).items():
        if last - first < MIN_EXPERT_POSITIONS:
            where = str(folder / "model_index.json") if folder is not None else None
            raise BackendError(f"{experts.boundary_key} {ratio:g} leaves the {name} expert {max(0, last - first)} of the "
                               f"schedule's {experts.schedule.steps} timesteps; each expert needs at least "
                               f"{MIN_EXPERT_POSITIONS} to train (the releases' ratios are 0.875 and 0.9)", source=where)


def _within(span: tuple[int, int], own: tuple[int, int]) -> bool:
    return own[0] <= span[0] and span[1] <= own[1]


def _open(experts: Experts, ranges: Optional[dict[str, tuple[int, int]]], bounds: tuple[float, float]) -> bool:
    """Whether the bounds leave positions of more than one expert (the choice is then the command's to make)."""
    span = position_range(bounds, experts.schedule.steps)
    return sum(_within(span, own) for own in (ranges or {}).values()) != 1


def _by_bounds(experts: Experts, ranges: Optional[dict[str, tuple[int, int]]], bounds: tuple[float, float],
               folder: Optional[Path]) -> tuple[str, str]:
    """The expert whose positions hold every position the bounds leave, with why; else the one-line question."""
    span = position_range(bounds, experts.schedule.steps)
    fits = [name for name, own in (ranges or {}).items() if _within(span, own)]
    if len(fits) == 1:
        return fits[0], (f"--min_timestep_boundary {bounds[0]:g} --max_timestep_boundary {bounds[1]:g} lie within "
                         "its timesteps")
    ratio = _read_index(folder)[experts.boundary_key] if folder is not None else None
    each = "; ".join(f"{name} ({experts.subfolder(name)}/, {_describe(experts, name, ratio, own, experts.schedule.steps)})"
                     for name, own in (ranges or {}).items())
    raise BackendError(f"{folder} holds {len(experts.names)} experts and a run trains one: choose it with "
                       f"--expert {'|'.join(experts.names)} ({each})")


def _fractions(own: tuple[int, int], steps: int) -> tuple[float, float]:
    """Boundary fractions whose positions (`position_range`) are exactly `own`."""
    def fraction(position: int) -> float:
        value = position / steps
        while int(value * steps) < position:  # a fraction a hair under the position rounds down: step up to it
            value = math.nextafter(value, 2.0)
        return value

    return fraction(own[0]), fraction(own[1])


def _describe(experts: Experts, expert: str, ratio: Any, own: tuple[int, int], steps: int) -> str:
    """'timesteps >= 875: --min_timestep_boundary 0 --max_timestep_boundary 0.417' for an expert's range."""
    lo, hi = _fractions(own, steps)
    side = ">=" if expert == experts.names[0] else "<"
    where = f"timesteps {side} {float(ratio) * 1000:g}: " if ratio is not None else ""
    return f"{where}--min_timestep_boundary {lo:g} --max_timestep_boundary {hi:g}"

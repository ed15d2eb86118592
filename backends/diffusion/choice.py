"""Which pipeline a run trains, decided from what its command names, and the one line that says why.

`--pipeline NAME` decides when it is given. Otherwise two kinds of signal do:

* **the models**: a model id of `--model_id_with_origin_paths` that a family declares (`Family.repos`: its
  patterns name a pipeline, or only the family), the diffusers class of a `--model_paths` folder's
  model_index.json (a pipeline's own class names it, its `index_marks` among pipelines of one class, another of
  the family's classes the family), the class
  of a component folder's config.json (a class only one family loads: its denoiser, its VAE, its text
  encoders) and the layout of a release single file (the family whose single-file format its header matches);
* **the dataset**: the metadata's columns and `--extra_inputs` (a `video` column fits only the video
  pipelines, an `edit_image` column the edit pipelines, `--extra_inputs` naming a pipeline's derived input
  that pipeline); in stage 2, the pipeline the cache it reads was made for (its manifest, a local folder's).

The models name the family: two families named is an error, one line naming both and suggesting
--pipeline. Between the family's pipelines of the run's --task, the signals that give the denoiser outweigh
those that give an encoder (a command naming one repository's DiT and another's text encoders trains the
DiT's pipeline), and the dataset breaks a tie; with no model signal the dataset alone decides when it fits
one family's pipelines only, else the first registered family does. The choice is printed as one line,
`pipeline: NAME (why)`, at the start of a run and in a dry run's output, so a wrong guess cannot go unseen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Optional

from .args import TrainArgs
from .cache.cache import MANIFEST
from .data.dataset import metadata_columns
from .data.dataset_config import config_columns
from .errors import BackendError
from .family import Family, PipelineDef
from .models.folders import ModelLoadError
from .models.hub import origin_subfolder
from .models.release import formats, header, shapes_of
from .models.sources import parse_model_id_with_origin_paths, parse_model_paths
from .registry import default_family, families, pipeline_for_task
from .untrained import untrained_by_model_id


@dataclass(frozen=True)
class Choice:
    """The pipeline a run trains, its family, and why (words that follow "pipeline: NAME (")."""

    family: Family
    pipeline: PipelineDef
    reason: str

    @property
    def line(self) -> str:
        return f"pipeline: {self.pipeline.name} ({self.reason})"


@dataclass(frozen=True)
class Signal:
    """What one model argument says: the family, the pipelines it names (none: the family only; several: one
    checkpoint trained with or without reference images, which the dataset decides), in words."""

    family: Family
    pipelines: tuple[str, ...]
    what: str
    denoiser: bool  # it gives the family's denoiser (its word on the pipeline outweighs an encoder's)


# --------------------------------------------------------------------------------------------
# signals of the models


def _gives_denoiser(family: Family, subfolder: str) -> bool:
    """Whether a pipeline subfolder (or an expert's release folder) holds the family's denoiser (declared first)."""
    slot = family.slot_of_subfolder(subfolder)
    if slot is not None:
        return slot.name == family.model_slots[0]
    return family.experts is not None and family.experts.of_subfolder(subfolder) is not None


def model_id_signals(items: Iterable[tuple[str, str]], task: str) -> list[Signal]:
    """A signal for each item of --model_id_with_origin_paths whose model id a family declares."""
    out = []
    for model_id, pattern in items:
        for family in families():
            repo = family.repo(model_id)
            if repo is None:
                continue
            sub = origin_subfolder(pattern)
            if not sub:  # a release file at the repository's top stands for the component it holds
                target = repo.diffusers_path(model_id, pattern)
                sub = origin_subfolder(target.partition(":")[2]) if target else ""
            out.append(Signal(family, _of_task(family, repo.pipelines, task), f"the model id {model_id}",
                              _gives_denoiser(family, sub)))
    return out


def _of_task(family: Family, pipelines: tuple[str, ...], task: str) -> tuple[str, ...]:
    """The named pipelines that train the run's task (another task's pipeline names only its family)."""
    return tuple(p for p in pipelines if family.pipeline(p).task == task)


def _read_json(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def folder_signals(paths: Iterable[str], task: str) -> list[Signal]:
    """A signal for each --model_paths entry a family's class or single-file layout recognises."""
    out = []
    for given in paths:
        path = Path(given).expanduser()
        index = _read_json(path / "model_index.json") if path.is_dir() else None
        if index is not None:
            out += _index_signals(index, given, task)
            continue
        folder = path.parent if path.is_file() else path
        config = _read_json(folder / "config.json")
        if config is not None:
            out += _config_signals(config, folder, given)
        elif path.is_file() and path.suffix == ".safetensors":
            out += _single_file_signals(path, given)
    return out


def _index_signals(index: dict, given: str, task: str) -> list[Signal]:
    class_name = index.get("_class_name")
    out = []
    for family in families():
        own = [p for p in family.pipelines if family.diffusers_class(p) == class_name]
        marked = [p for p in own if p.index_marks and all(index.get(k) == v for k, v in p.index_marks.items())]
        own = marked or [p for p in own if not p.index_marks]
        if own or class_name in family.diffusers_pipelines:
            named = tuple(p.name for p in own if p.task == task)
            out.append(Signal(family, named, f"the class {class_name} in {Path(given) / 'model_index.json'}", True))
    return out


def _config_signals(config: dict, folder: Path, given: str) -> list[Signal]:
    """The family whose model slot loads the class a component's config.json names, when only one does."""
    names = [str(config["_class_name"])] if config.get("_class_name") else [str(a) for a in config.get("architectures") or []]
    model_type = config.get("model_type")
    found: dict[str, tuple[Family, str, bool]] = {}
    for family in families():
        for slot in family.slots:
            if slot.kind != "model":
                continue
            hit = next((n for n in names if n in slot.class_names), None)
            if hit is None and model_type and model_type in slot.model_types:
                hit = str(model_type)
            if hit is not None and family.name not in found:
                found[family.name] = (family, hit, slot.name == family.model_slots[0])
    if len(found) != 1:
        return []
    family, hit, denoiser = next(iter(found.values()))
    return [Signal(family, (), f"the class {hit} in {folder / 'config.json'}", denoiser)]


def _single_file_signals(path: Path, given: str) -> list[Signal]:
    try:
        shapes = shapes_of(header(path, given))
    except ModelLoadError:
        return []  # said when the models are resolved
    out = []
    for family in families():
        for slot, fmt in formats(family):
            if fmt.matches(shapes):
                out.append(Signal(family, (), f"the layout of {given} ({fmt.description})",
                                  slot == family.model_slots[0]))
                break
    return out


# --------------------------------------------------------------------------------------------
# what the dataset fits


@dataclass(frozen=True)
class Data:
    """What the dataset offers: its metadata's columns (None: unknown, e.g. stage 2 reading a cache), the
    --extra_inputs names, and the columns the command hands to the pipeline (--extra_inputs, --data_file_keys).

    A pipeline fits the data when the metadata has every column it requires. Between pipelines that fit, a
    column they do not all require counts only when the command names it, as DiffSynth's commands name their
    conditioning columns (`--extra_inputs kontext_images`, `--extra_inputs edit_image`): a metadata file may hold
    columns a run does not use.
    """

    columns: Optional[frozenset[str]]
    extra: frozenset[str]
    named: frozenset[str]
    cached: Optional[str] = None  # stage 2: the pipeline the cache was made for

    def fits(self, pipeline: PipelineDef) -> bool:
        return self.columns is None or set(pipeline.required) <= self.columns

    def key(self, pipeline: PipelineDef) -> tuple[bool, bool, int, int]:
        """How well the data fits a pipeline: it has its required columns; the cache was made for it; how many of
        its columns the command names; how many of its derived inputs --extra_inputs names (DiffSynth's
        `input_image`)."""
        present = self.named if self.columns is None else self.named & self.columns
        return (self.fits(pipeline), pipeline.name == self.cached, len(set(pipeline.required) & present),
                len(self.extra & set(pipeline.derived_inputs)))

    def why(self, chosen: PipelineDef, among: list[PipelineDef], named_only: bool = True) -> list[str]:
        """The columns (those the command names, unless `named_only` is false) and --extra_inputs that set
        `chosen` apart from the rest of `among`."""
        others = [p for p in among if p is not chosen]
        offered = self.named if self.columns is None else (self.named if named_only else self.columns) & self.columns
        apart = [c for c in chosen.required if c in offered and not all(c in p.required for p in others)]
        words = [f"the metadata column{'s' if len(apart) > 1 else ''} {', '.join(apart)}"] if apart else []
        if chosen.name == self.cached:
            words = ["the cache was made for it"]
        derived = sorted(self.extra & set(chosen.derived_inputs))
        if derived:
            words.append(f"--extra_inputs {','.join(derived)}")
        return words


def _best(pool: list[PipelineDef], data: Data) -> PipelineDef:
    """The pipeline of `pool` the data fits best (the first of equals)."""
    return max(pool, key=lambda p: (data.key(p), -pool.index(p)))


# --------------------------------------------------------------------------------------------
# the choice


def choose(args: TrainArgs) -> Choice:
    """The run's pipeline and why (see the module docstring); a BackendError line when two families are named."""
    task = args.family
    if args.pipeline:
        family, pipeline = pipeline_for_task(args.pipeline, task)
        return Choice(family, pipeline, f"--pipeline {args.pipeline}")
    try:
        paths = parse_model_paths(args.model_paths)
    except ModelLoadError:
        paths = []  # reported when the models are resolved
    try:
        items = parse_model_id_with_origin_paths(args.model_id_with_origin_paths)
    except ModelLoadError:
        items = []
    untrained_family(items)
    signals = folder_signals(paths, task) + model_id_signals(items, task)
    if not signals:
        unknown_class(paths)
    columns = config_columns(args.dataset_config) if args.dataset_config else metadata_columns(args.dataset_metadata_path)
    extra = frozenset(args.extra_input_names())
    data = Data(None if columns is None else frozenset(columns), extra, extra | frozenset(args.file_keys()))
    cached = partial(_cached_pipeline, args)  # read only when the choice is open: a cache's manifest can be large
    named = list(dict.fromkeys(s.family.name for s in signals))
    if len(named) > 1:
        first = {name: next(s for s in signals if s.family.name == name) for name in named}
        said = ", ".join(f"{s.what} names {name}" for name, s in first.items())
        raise BackendError(f"the models of this command name different families ({said}); pass --pipeline with "
                           "the pipeline to train (see 'unitgraph pipelines')")
    if named:
        return _within(signals[0].family, signals, data, task, cached)
    return _from_data(replace(data, cached=cached()), task)


def _trained_families() -> str:
    return ", ".join(family.title for family in families())


def untrained_family(items: Iterable[tuple[str, str]]) -> None:
    """One line when a model id of --model_id_with_origin_paths is one of DiffSynth's families unitgraph does not
    train (untrained.py), before anything is looked for or downloaded."""
    for model_id, _pattern in items:
        other = untrained_by_model_id(model_id)
        if other is not None:
            raise BackendError(f"the model id {model_id} is {other.name} (DiffSynth's examples/{other.folder}), a family "
                               f"unitgraph does not train; it trains {_trained_families()} (see 'unitgraph pipelines')")


def unknown_class(paths: Iterable[str]) -> None:
    """One line when a --model_paths folder names a diffusers class no family loads (its model_index.json's
    pipeline or its config.json's model) and nothing else in the command names a family: the run would otherwise
    fall back to the first family and fail on a class mismatch that names that family's classes."""
    known = {name for family in families() for slot in family.slots for name in slot.class_names}
    known |= {name for family in families() for name in family.diffusers_pipelines}
    known |= {family.diffusers_class(p) for family in families() for p in family.pipelines}
    for given in paths:
        path = Path(given).expanduser()
        folder = path.parent if path.is_file() else path
        for name in ("model_index.json", "config.json"):
            config = _read_json(folder / name)
            if config is None:
                continue
            class_name = config.get("_class_name")
            if isinstance(class_name, str) and class_name and class_name not in known:
                raise BackendError(f"{folder / name} names the diffusers class {class_name}, which no family of "
                                   f"unitgraph loads; it trains {_trained_families()} (see 'unitgraph pipelines'; "
                                   "--pipeline NAME if this is a variant of one of them)")
            break


def _cached_pipeline(args: TrainArgs) -> Optional[str]:
    """Stage 2 reading a local cache folder: the pipeline its manifest says it was made for (None otherwise; an
    unreadable manifest is reported when the cache is opened)."""
    if args.stage != "train" or args.dataset_metadata_path or not args.dataset_base_path:
        return None
    path = Path(args.dataset_base_path).expanduser() / MANIFEST
    manifest = _read_json(path) if path.is_file() else None
    name = manifest.get("pipeline") if manifest is not None else None
    return name if isinstance(name, str) else None


def _task_pipelines(family: Family, task: str) -> list[PipelineDef]:
    pool = [p for p in family.pipelines if p.task == task]
    if not pool:
        pipeline_for_task(family.name, task)  # the one-line error naming the family's tasks
    return pool


def _within(family: Family, signals: list[Signal], data: Data, task: str,
            cached: Callable[[], Optional[str]] = lambda: None) -> Choice:
    """The family's pipeline the models name (the denoiser's word first), the dataset (and `cached()`, the pipeline a
    stage-2 cache was made for) deciding between equals."""
    pool = _task_pipelines(family, task)
    naming = [s for s in signals if s.pipelines]
    strong = [s for s in naming if s.denoiser] or naming
    named = [p for p in pool if any(p.name in s.pipelines for s in strong)]
    candidates = named or pool
    if data.columns is not None and not any(data.fits(p) for p in pool):
        others = [p for fam in families() if fam is not family for p in fam.pipelines if p.task == task and data.fits(p)]
        if others:
            raise BackendError(
                f"{signals[0].what} names {family.name}, but the metadata's columns ({', '.join(sorted(data.columns))}) "
                f"fit only {', '.join(dict.fromkeys(p.name for p in others))}; pass --pipeline with the pipeline to "
                "train, or fix the metadata")
    told, chosen = data, _best(candidates, data)
    if len(candidates) > 1:
        with_cache = replace(data, cached=cached())
        by_cache = _best(candidates, with_cache)
        if by_cache is not chosen:  # the cache is named as the reason only when it decided
            told, chosen = with_cache, by_cache
    because = [s for s in strong if chosen.name in s.pipelines] or [s for s in signals if s.denoiser] or signals
    words = [because[0].what]
    if len(candidates) > 1:
        # several pipelines a model names (one checkpoint, with or without edit images): the first is its own
        words += told.why(chosen, candidates) or ([] if named else [f"{family.name}'s first pipeline for --task {task}"])
    return Choice(family, chosen, "; ".join(words))


def _from_data(data: Data, task: str) -> Choice:
    """No model names a family: the dataset decides when the pipelines it fits are one family's (a video column),
    or the columns the command names single one out (`--extra_inputs kontext_images`); else the first family."""
    pool = [p for family in families() for p in family.pipelines if p.task == task]
    fitting = [p for p in pool if data.fits(p)] if data.columns is not None else pool
    owners = {_family_of(p).name for p in fitting}
    chosen, words, only = None, [], "fit the data"
    if data.columns is not None and len(owners) == 1:
        chosen = _best(fitting, data)
        words = data.why(chosen, pool, named_only=False) + data.why(chosen, fitting)
    elif fitting:
        top = data.key(_best(fitting, data))
        best = [p for p in fitting if data.key(p) == top]
        if len({_family_of(p).name for p in best}) == 1 and any(top[1:]):
            chosen, only = best[0], "read it"
            words = data.why(chosen, fitting)
    if chosen is not None and words:
        family = _family_of(chosen)
        return Choice(family, chosen, f"{'; '.join(dict.fromkeys(words))}: no model names a family, and only "
                                      f"{family.name}'s pipelines {only}")
    family, pipeline = pipeline_for_task(default_family().name, task)
    within = [p for p in family.pipelines if p.task == task and data.fits(p)]
    if within:
        pipeline = _best(within, data)
    elif data.columns is not None and fitting:  # the data fits several families, not the default: the first of them
        names = list(dict.fromkeys(_family_of(p).name for p in fitting))
        chosen = _best([p for p in fitting if _family_of(p).name == names[0]], data)
        words = data.why(chosen, pool, named_only=False) or ["the metadata's columns"]
        return Choice(_family_of(chosen), chosen, f"{'; '.join(dict.fromkeys(words))}: no model names a family; the "
                                                  f"first registered of {', '.join(names)}, whose pipelines fit the "
                                                  "data; --pipeline NAME chooses another")
    return Choice(family, pipeline, "nothing in the command names a model family: the first registered; "
                                    "--pipeline NAME chooses another")


def _family_of(pipeline: PipelineDef) -> Family:
    return next(f for f in families() if pipeline in f.pipelines)


__all__ = ["Choice", "Signal", "choose", "folder_signals", "model_id_signals"]

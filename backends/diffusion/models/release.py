"""Files of a model's original release layout, as DiffSynth-Studio's commands name them: the single files a family
reads through its declared formats, and one message for every file it cannot read.

DiffSynth's commands name the files a model was released as (`org/name:model.safetensors` at a repository's
top, pickled `.pth` encoders), where unitgraph reads diffusers' per-component folders. Two things help a
command port anyway, both declared by the family and read here generically:

* **Single-file formats.** A `ModelSlot.single_file` names an object that recognises a release file from its
  safetensors header alone (`matches(shapes)`), derives the diffusers config.json content from the shapes
  (`config(shapes, beside)`, `beside` being the diffusers config of the same component found in the same
  snapshot) and converts the tensors into the diffusers state dict (`convert(tensors)`, models/loading.py).
  A `.safetensors` file with no config.json beside it is classified by `recognise`.
* **Release-file hints.** A family's `ModelRepo.release_files` say where the diffusers layout keeps what a
  release file holds (`models_t5_*.pth` -> `text_encoder/*.safetensors` of the `-Diffusers` repository), so
  `unusable_message` can name, in one line, every file of the command it cannot use and the flag to give
  instead. Pickles (`.pth`, `.bin`, ...) are never opened: safetensors only.

Nothing here names a family; no torch at import time.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import BackendError
from ..family import Family, ModelSlot
from ..tensorfile import Header, read_header
from .folders import ModelLoadError, read_json_file, config_size_problem
from .hub import origin_subfolder

# Files torch writes with pickle (and checkpoints of other tools that do): never opened.
PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".pkl", ".pickle")
PICKLE_PROBLEM = "a pickle, which unitgraph never loads"
NO_LAYOUT = "a single-file checkpoint (no config.json beside it) in no layout unitgraph reads"


def no_layout(family: Optional[Family]) -> str:
    """Why a single file no format recognises cannot be read, naming the layouts that were tried."""
    tried = [fmt.description for _, fmt in formats(family)]
    return NO_LAYOUT + (f" (it is not {' nor '.join(tried)})" if tried else "")


def is_pickle(name: str) -> bool:
    return Path(name).suffix.lower() in PICKLE_SUFFIXES


# --------------------------------------------------------------------------------------------
# Single files


def header(path: Path, source: str) -> Header:
    """The checked safetensors header of a single file (one ModelLoadError line when it is not one)."""
    try:
        return read_header(path, source)
    except BackendError as exc:
        raise ModelLoadError(source, exc.message) from None


def shapes_of(head: Header) -> dict[str, tuple[int, ...]]:
    return {name: info.shape for name, info in head.tensors.items()}


def formats(family: Optional[Family]) -> list[tuple[str, Any]]:
    """(slot, format object) of each slot of `family` that declares a single-file layout, the denoiser first."""
    if family is None:
        return []
    return [(s.name, family.single_file_format(s.name)) for s in family.slots if s.single_file]


def recognise(path: Path, family: Optional[Family], source: str) -> Optional[tuple[str, Any]]:
    """(slot, format) of the first of the family's single-file layouts the file's header matches, else None;
    only the header is read."""
    declared = formats(family)
    if not declared:
        return None
    shapes = shapes_of(header(path, source))
    return next(((slot, fmt) for slot, fmt in declared if fmt.matches(shapes)), None)


def beside_config(path: Path, slot: ModelSlot) -> Optional[Path]:
    """The diffusers config.json of the same component in the same snapshot (`<top>/<subfolder>/config.json`),
    when it is there already; it is never downloaded."""
    candidate = path.parent / slot.subfolder / "config.json"
    return candidate if candidate.is_file() else None


def single_file_config(path: Path, fmt: Any, beside: Optional[Path], source: str) -> dict[str, Any]:
    """The diffusers config.json content of a single file: the format's `config` of the header's shapes and the
    config beside it; checked for sizes no model has before anything is built from it."""
    extra = read_json_file(beside) if beside is not None else None
    try:
        config = dict(fmt.config(shapes_of(header(path, source)), extra))
    except ValueError as exc:
        raise ModelLoadError(source, f"cannot read it as {fmt.description}: {exc}") from None
    problem = config_size_problem(config)
    if problem:
        raise ModelLoadError(source, f"{problem}; refusing to build it")
    return config


# --------------------------------------------------------------------------------------------
# Files a command names that cannot be used


@dataclass(frozen=True)
class Unusable:
    """One item of --model_paths or --model_id_with_origin_paths that cannot be read, and why."""

    given: str  # as the command gives it: a path, or "org/name:pattern"
    problem: str
    model_id: Optional[str] = None
    pattern: Optional[str] = None


def release_problem(family: Optional[Family], model_id: str, pattern: str) -> Optional[str]:
    """Why an item of --model_id_with_origin_paths cannot be used, known before anything is fetched: a pickle, or
    a release file of a component the family reads only in the diffusers layout. None: fetch it and see."""
    if is_pickle(pattern):
        return PICKLE_PROBLEM
    repo = family.repo(model_id) if family is not None else None
    target = None if repo is None else repo.diffusers_path(model_id, pattern)
    if target is None:  # a diffusers path, or nothing the family's hints know: fetch it and see
        return None
    slot = family.slot_of_subfolder(origin_subfolder(target.partition(":")[2]))
    if slot is None or slot.single_file:
        return None  # read through the family's single-file format, if the header matches
    return f"the {slot.name} in its release layout, which unitgraph does not read"


def diffusers_path(family: Optional[Family], model_id: str, pattern: str) -> Optional[str]:
    """'org/name:sub/pattern' of the diffusers layout holding what a release file holds (the family's hints)."""
    repo = family.repo(model_id) if family is not None else None
    return None if repo is None else repo.diffusers_path(model_id, pattern)


def _folder_hint(family: Optional[Family], given: str) -> Optional[str]:
    """The diffusers component folder a local release file stands for, from its name (the family's hints)."""
    if family is None:
        return None
    name = Path(given).name
    for repo in family.repos:
        for release, target in repo.release_files.items():
            if fnmatch.fnmatchcase(name, release):
                return origin_subfolder(target) + "/"
    return None


def unusable_message(items: Sequence[Unusable], family: Optional[Family], remote: Sequence[tuple[str, str]]) -> str:
    """One line: every file the command names that cannot be read, why, and what to name instead: the whole
    --model_id_with_origin_paths with each such item replaced by the diffusers path of the same component (the
    items it can read kept), and for a local file the diffusers folder to give instead."""
    listed = ", ".join(f"{item.given} ({item.problem.removeprefix('is ')})" for item in items)
    head = (f"{items[0].given}: {items[0].problem.removeprefix('is ')}" if len(items) == 1 else
            f"{len(items)} model files this command names cannot be read: {listed}")
    advice = []
    bad = {(i.model_id, i.pattern) for i in items if i.model_id is not None}
    if bad:
        replaced, unknown = [], []
        for model_id, pattern in remote:
            if (model_id, pattern) not in bad:
                replaced.append(f"{model_id}:{pattern}")
                continue
            target = diffusers_path(family, model_id, pattern)
            if target is None:
                unknown.append(f"{model_id}:{pattern}")
            else:
                replaced.append(target)
        if any((m, p) in bad and diffusers_path(family, m, p) for m, p in remote):
            advice.append(f'name the diffusers layout instead: --model_id_with_origin_paths '
                          f'"{",".join(dict.fromkeys(replaced))}"')
        if unknown:
            advice.append(f"for {', '.join(unknown)} give the component's diffusers folder (config.json and "
                          "safetensors weights) with --model_paths")
    for item in items:
        if item.model_id is None:
            folder = _folder_hint(family, item.given)
            where = f"its diffusers {folder} folder" if folder else "the component's diffusers folder"
            advice.append(f"for {item.given} give {where} (config.json and safetensors weights) instead")
    return head + ("; " + "; ".join(advice) if advice else "")

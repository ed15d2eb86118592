"""Finding a family's model components, slot by slot: the user's model arguments resolved to one folder per slot.

A family declares its slots (`family.ModelSlot`: DiffSynth's model name, the diffusers or
transformers class, the pipeline subfolder, ...); this module turns the user's model arguments into
one folder per slot and loads it with that class. Nothing here names a family.

Models come from ``model_paths`` (DiffSynth's ``--model_paths``: a JSON list, a single path,
or a Python list; each entry a whole diffusers pipeline folder or one component folder) and
from ``model_id_with_origin_paths`` (DiffSynth's ``"org/name:sub/pattern,..."``, resolved
through the modelscope cache; with ``offline=True`` the local cache only). Only the requested
slots are loaded: a pipeline folder's other subfolders are never opened, and component folders
are only classified by their small config files. A release single file (a `.safetensors` file with no
config.json beside it) is classified by its header against the family's single-file formats, and every
file of the arguments that cannot be read is named in one message (models/release.py).

One pass, in four steps (`ModelSources`): the arguments are **parsed** (`parse_model_paths`,
`parse_model_id_with_origin_paths`); each becomes a **candidate** (`Candidate`: a local path or a model id with
its pattern, the slots its subfolder hints at); each candidate is **classified** once, by `_classify`, into what it
provides (a component folder of a slot, a release single file, a folder of weights completed from the released
configs, a whole pipeline folder); and `resolve` **chooses** each slot's source among the classified candidates,
then a pipeline folder's subfolder, then the companion rules (a tokenizer beside its text encoder, ...). A
candidate is classified when the sources are made if it must be (a local path; a model id whose slot is unknown, or
whose local copy lacks its configs: every unreadable one is named in one message), else when a slot it may
provide is asked for (a stage never downloads the encoders it does not load).

Every problem is raised as :class:`ModelLoadError`, whose message is one line naming the path
and the problem. Weights are read from safetensors only (never pickle).

torch, diffusers and transformers are imported inside the functions, so importing this module
is cheap.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from unitgraph.errors import path_missing

from ..family import Family, ModelSlot
from .folders import (OFFLINE_ENV, ComponentSource, FolderEntry, ModelLoadError, SlotTable, UnreadableLayout,
                      check_config_sizes, classify_folder, component_files, is_processor_folder, is_tokenizer_folder,
                      processor_class_of, shorten, slot_config_file, tokenizer_class_of)
from .configless import complete, mismatch_problem, weights_without_config
from .hub import Hub, origin_subfolder
from .loading import load_component, slot_class
from .release import (PICKLE_PROBLEM, Unusable, beside_config, is_pickle, no_layout, recognise, release_problem,
                      single_file_config, unusable_message)

# --------------------------------------------------------------------------------------------
# Parsing the user's arguments


def parse_model_paths(model_paths: Any) -> list[str]:
    """Normalise --model_paths to a flat list of path strings.

    Accepts None, a JSON list string (nested lists are flattened, as DiffSynth groups shards),
    a single path string, a path, or a Python list/tuple of those.
    """
    if model_paths is None:
        return []
    if isinstance(model_paths, os.PathLike):
        return [os.fspath(model_paths)]
    if isinstance(model_paths, str):
        text = model_paths.strip()
        if not text:
            return []
        if text[0] in "[{\"":
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ModelLoadError(shorten(text), f"--model_paths is not valid JSON ({exc.msg} at char {exc.pos})") from None
            if isinstance(value, str):
                return [value]
            if not isinstance(value, list):
                raise ModelLoadError(shorten(text), "--model_paths must be a JSON list of paths")
            return _flatten_paths(value, text)
        return [text]
    if isinstance(model_paths, (list, tuple)):
        return _flatten_paths(list(model_paths), repr(model_paths))
    raise ModelLoadError(shorten(repr(model_paths)), "--model_paths must be a path, a list of paths or a JSON list")


def _flatten_paths(value: list, where: str) -> list[str]:
    out: list[str] = []
    for item in value:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten_paths(list(item), where))
        elif isinstance(item, (str, os.PathLike)) and os.fspath(item).strip():
            out.append(os.fspath(item).strip())
        else:
            raise ModelLoadError(shorten(where), f"--model_paths entries must be path strings, got {item!r}")
    return out


def parse_model_id_with_origin_paths(spec: Any) -> list[tuple[str, str]]:
    """'org/name:sub/pattern,org/name:pattern' -> [(model_id, origin_pattern), ...]."""
    if spec is None:
        return []
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out = []
    for raw in items:
        item = str(raw).strip()
        if not item:
            continue
        model_id, sep, pattern = item.partition(":")
        model_id, pattern = model_id.strip(), pattern.strip()
        if not sep or not model_id or not pattern or model_id.count("/") != 1:
            raise ModelLoadError(item, "--model_id_with_origin_paths entries must look like 'org/name:sub/pattern'")
        out.append((model_id, pattern))
    return out


# --------------------------------------------------------------------------------------------
# Resolving slots


@dataclass(frozen=True)
class Candidate:
    """One model the command names: a --model_paths entry (`path`) or a --model_id_with_origin_paths item
    (`model_id`, `pattern`). `origin` is how the user wrote it, which every message quotes."""

    origin: str
    path: Optional[Path] = None
    model_id: Optional[str] = None
    pattern: Optional[str] = None

    @property
    def remote(self) -> bool:
        return self.model_id is not None

    @property
    def subfolder(self) -> str:
        """The pipeline subfolder a model id's pattern names ('transformer/...' -> 'transformer'), else ''."""
        return origin_subfolder(self.pattern) if self.pattern else ""


def candidates(model_paths: Any, model_id_with_origin_paths: Any) -> list[Candidate]:
    """The command's model arguments, parsed, as candidates: the local paths first, then the model ids."""
    local = [Candidate(given, path=Path(given).expanduser()) for given in parse_model_paths(model_paths)]
    remote = [Candidate(f"{model_id}:{pattern}", model_id=model_id, pattern=pattern)
              for model_id, pattern in parse_model_id_with_origin_paths(model_id_with_origin_paths)]
    return local + remote


class ModelSources:
    """The user's model arguments, resolved lazily slot by slot for one family's slots.

    Component folders from model_paths are classified eagerly (config files only); modelscope
    entries whose origin subfolder names a slot (transformer/, vae/, ...) are resolved only
    when that slot is asked for. A pipeline folder's subfolders are only looked at on demand.
    `tokenizer_path` (DiffSynth's --tokenizer_path, or --tokenizer_1_path) is the tokenizer of the
    first text encoder, `tokenizer_2_path` (--tokenizer_2_path) that of the second;
    `processor_path` (DiffSynth's --processor_path) the family's first processor.

    Given a whole `Family` (not only its slots), release single files are read through its declared formats
    and a file the command names that cannot be read is reported with the family's hints (models/release.py):
    every such file of the arguments in one ModelLoadError line, when the sources are made.
    """

    def __init__(self, slots: Family | Sequence[ModelSlot] | SlotTable, model_paths: Any = None,
                 model_id_with_origin_paths: Any = None, tokenizer_path: Any = None, cache_dir: Any = None,
                 offline: bool = False, hub: Optional[Hub] = None, processor_path: Any = None,
                 tokenizer_2_path: Any = None):
        self.family = slots if isinstance(slots, Family) else None
        if self.family is not None:
            slots = self.family.slots
        self.table = slots if isinstance(slots, SlotTable) else SlotTable(slots)
        self.cache_dir = cache_dir
        self.offline = bool(offline)
        self.hub = hub or Hub(cache_dir=None if cache_dir is None else str(cache_dir), offline=self.offline,
                              offline_reason=OFFLINE_ENV if self.offline else "")
        self.tokenizer_path = None if tokenizer_path in (None, "") else str(tokenizer_path)
        # the tokenizer slots of the text encoders, in order, and the flag naming each
        pairs = [s.tokenizer for s in self.table.slots.values() if s.kind == "model" and s.tokenizer]
        given = [self.tokenizer_path, None if tokenizer_2_path in (None, "") else str(tokenizer_2_path)]
        self._tokenizers_given = {slot: path for slot, path in zip(pairs, given) if path is not None}
        self.processor_path = None if processor_path in (None, "") else str(processor_path)
        self.candidates = candidates(model_paths, model_id_with_origin_paths)
        self.entries: list[FolderEntry] = []  # what the candidates classified so far provide, in order
        self.completed: list[Any] = []  # configless.Completion of each folder of weights without a config
        self._seen: set[Path] = set()
        self._classified: set[int] = set()  # candidates classified (or found unusable) already
        unusable: list[Unusable] = []
        other: Optional[ModelLoadError] = None
        for i, candidate in enumerate(self.candidates):
            known = release_problem(self.family, candidate.model_id, candidate.pattern) if candidate.remote else None
            if known is not None:  # a pickle or a release file a model id names: never fetched
                self._classified.add(i)
                unusable.append(Unusable(candidate.origin, known, candidate.model_id, candidate.pattern))
                continue
            if not self._classify_now(candidate):
                continue  # classified when a slot it may provide is asked for
            try:
                self._classify(i)
            except UnreadableLayout as exc:
                unusable.append(Unusable(candidate.origin, exc.problem, candidate.model_id, candidate.pattern)
                                if candidate.remote and self.table.by_subfolder.get(candidate.subfolder) is None
                                else Unusable(candidate.origin, exc.problem))
            except ModelLoadError as exc:
                if not candidate.remote:
                    raise
                other = other or exc  # not found: said after the files that cannot be read, which say more
        if unusable:
            raise ModelLoadError(None, unusable_message(unusable, self.family, self._model_ids()))
        if other is not None:
            raise other

    def _model_ids(self) -> list[tuple[str, str]]:
        return [(c.model_id, c.pattern) for c in self.candidates if c.remote]

    def _classify_now(self, candidate: Candidate) -> bool:
        """Whether a candidate is classified when the sources are made: a local path always; a model id whose
        pattern names no slot (only its files say what it is); a model id of a slot whose local copy holds weights
        without their configs (DiffSynth's download: completed now, so every misfit is named in one message)."""
        if not candidate.remote:
            return True
        if self.table.by_subfolder.get(candidate.subfolder) is None:
            return True
        local = self.hub.local(candidate.model_id, candidate.pattern)
        return local is not None and bool(weights_without_config(local))

    def _classify(self, i: int) -> None:
        """Classify candidate `i` once (see the module docstring) and record what it provides."""
        if i in self._classified:
            return
        self._classified.add(i)
        candidate = self.candidates[i]
        if not candidate.remote:
            self._add(self._classify_given(candidate.origin))
            return
        entry = self._classify_remote(candidate)
        entry.model_id = candidate.model_id
        self._add(entry)

    def _classify_for(self, slot: str) -> None:
        """Classify every model id whose subfolder may hold `slot`."""
        for i, candidate in enumerate(self.candidates):
            if candidate.remote and slot in self.table.shared_subfolder.get(candidate.subfolder, ()):
                self._classify(i)

    def _classify_given(self, given: str) -> FolderEntry:
        """What a --model_paths entry is: a release single file (read in a family's format), a component folder
        without its config.json (DiffSynth's download: completed, models/configless.py), else a folder."""
        path = Path(given).expanduser()
        if path.is_file() and is_pickle(path.name):
            raise UnreadableLayout(path, PICKLE_PROBLEM)
        if path.is_file() and path.suffix == ".safetensors" and not (path.parent / "config.json").is_file():
            if recognise(path, self.family, given) is None and self._completable(path.parent):
                return self._completed(path.parent, weights_without_config(path.parent), given)
            return self._single_file(path, given)
        if path.is_dir() and self._completable(path):
            return self._completed(path, weights_without_config(path), given)
        return classify_folder(given, self.table)

    def _completable(self, folder: Path) -> bool:
        """Whether a folder holds weights without a config.json and the family has released configs for a model
        of its name (DiffSynth's download of `<org>/<name>:<subfolder>/...`)."""
        return self.family is not None and self.family.slot_of_subfolder(folder.name) is not None \
            and bool(weights_without_config(folder))

    def _completed(self, folder: Path, files: list[Path], origin: str) -> FolderEntry:
        """A folder of weights without config.json, completed with the family's released config they fit."""
        done = complete(folder, files, self.family, folder.name, origin)
        if done is None:
            raise UnreadableLayout(origin, mismatch_problem(self.family, folder.name, _tensor_count(files, origin)))
        if done not in self.completed:  # each shard file of a folder names it
            self.completed.append(done)
        return classify_folder(done.completed, self.table, origin=origin)

    def _single_file(self, path: Path, origin: str) -> FolderEntry:
        """A .safetensors file with no config.json beside it, classified by its header against the family's
        single-file formats (only the header is read)."""
        found = recognise(path, self.family, origin)
        if found is None:
            raise UnreadableLayout(origin, no_layout(self.family))
        slot, fmt = found
        return FolderEntry(origin=origin, path=path, kind=slot, class_name=fmt.class_name, single_file=fmt,
                      beside=beside_config(path, self.table[slot]))

    def _add(self, entry: FolderEntry) -> None:
        key = entry.path.resolve()
        if key not in self._seen:  # several shard files of one folder name that folder once
            self._seen.add(key)
            self.entries.append(entry)

    @property
    def has_sources(self) -> bool:
        return bool(self.candidates)

    def _snapshot(self, model_id: str, pattern: str) -> Path:
        return self.hub.snapshot(model_id, pattern, ModelLoadError)

    def _classify_remote(self, candidate: Candidate) -> FolderEntry:
        """What a model id's files are, found locally first (models/hub.py): a release file at the repository's
        top, a folder of weights completed from the released configs, or a folder classified by its configs."""
        label, pattern = candidate.origin, candidate.pattern
        if is_pickle(pattern):
            raise UnreadableLayout(label, PICKLE_PROBLEM)
        folder = self._snapshot(candidate.model_id, pattern)
        if not candidate.subfolder and pattern.endswith(".safetensors") and not (folder / "config.json").is_file():
            # DiffSynth reads release files at a repository's top (a DiT in its original layout, say): one file,
            # read through the family's single-file formats, or named in the one message
            files = sorted(f for f in folder.iterdir() if f.is_file() and fnmatch.fnmatchcase(f.name, pattern))
            if len(files) != 1:
                raise UnreadableLayout(label, no_layout(self.family) if files else f"no file in {folder} matches {pattern}")
            return self._single_file(files[0], label)
        if self._completable(folder):
            name_pattern = pattern.rpartition("/")[2] or "*"  # the files the pattern names (a folder's: all)
            files = [f for f in weights_without_config(folder) if fnmatch.fnmatchcase(f.name, name_pattern)]
            return self._completed(folder, files or weights_without_config(folder), label)
        return classify_folder(folder, self.table, origin=label)

    def slot_of(self, given: str) -> Optional[str]:
        """The slot a --model_paths entry or a --model_id_with_origin_paths item provides (DiffSynth names models
        by these in --fp8_models), or None when it names none of them or a whole pipeline folder."""
        for entry in self.entries:
            if entry.origin == given and entry.kind != "pipeline":
                return entry.kind
        for i, candidate in enumerate(self.candidates):
            if candidate.remote and candidate.origin == given:
                slots = self.table.shared_subfolder.get(candidate.subfolder, ())
                if len(slots) == 1:
                    return slots[0]
                self._classify(i)
                return next((e.kind for e in self.entries if e.origin == given and e.kind != "pipeline"), None)
        return None

    def _unique(self, entries: list[FolderEntry], slot: str) -> FolderEntry | None:
        if len(entries) > 1:
            names = ", ".join(str(e.path) for e in entries)
            raise ModelLoadError(entries[1].path, f"more than one path provides {slot}: {names}")
        return entries[0] if entries else None

    def _component(self, slot: str) -> FolderEntry | None:
        return self._unique([e for e in self.entries if e.kind == slot], slot)

    def _pipeline_source(self, slot: str) -> ComponentSource | None:
        pipelines = [e for e in self.entries if e.kind == "pipeline" and slot in e.subfolders]
        entry = self._unique(pipelines, slot)
        if entry is None:
            return None
        folder = entry.path / entry.subfolders[slot]
        if not folder.is_dir():
            raise ModelLoadError(folder, f"pipeline folder lacks its {entry.subfolders[slot]}/ subfolder (needed for {slot})")
        sub = classify_folder(folder, self.table, origin=entry.origin)
        # the pipeline's subfolder names the slot; its files only have to fit it (two tokenizers of one class, say,
        # classify as the first of them)
        fits = sub.kind in self.table and self.table[sub.kind].kind == self.table[slot].kind \
            and sub.class_name in self.table[slot].class_names
        if sub.kind != slot and not fits:
            raise ModelLoadError(folder, f"holds a {sub.kind} ({sub.class_name}), but {slot} needs {self.table.expected(slot)}")
        return ComponentSource(slot, folder, sub.class_name, entry.origin)

    def declared_absent(self, slot: str) -> bool:
        """Whether the run goes without `slot`: a pipeline folder declares it has none (model_index.json's [null, null],
        diffusers' record of an optional component a release goes without) and no other path provides one; or the
        slot is optional (`ModelSlot.optional`) and no path provides it at all."""
        pipelines = [e for e in self.entries if e.kind == "pipeline"]
        if any(slot in e.subfolders for e in pipelines):
            return False
        if self.table[slot].optional:
            self._classify_for(slot)
        if self._component(slot) is not None:
            return False
        return any(slot in e.absent for e in pipelines) or self.table[slot].optional

    def resolve(self, slot: str) -> ComponentSource:
        """Find the folder of one slot; raise ModelLoadError if no source provides it."""
        self.table.check([slot])
        kind = self.table[slot].kind
        if kind in ("tokenizer", "processor"):
            return self._resolve_companion(slot)
        self._classify_for(slot)
        entry = self._component(slot)
        if entry is not None:
            return ComponentSource(slot, entry.path, entry.class_name, entry.origin, entry.single_file, entry.beside)
        source = self._pipeline_source(slot)
        if source is not None:
            return source
        if kind == "scheduler":
            return self._resolve_scheduler(slot)
        raise self._missing(slot)

    def _resolve_scheduler(self, slot: str) -> ComponentSource:
        """A scheduler folder beside the denoiser's component folder, else the family's published config."""
        subfolder = self.table[slot].subfolder
        denoiser = self._component(self.table.denoiser)
        if denoiser is not None and (denoiser.path.parent / subfolder / "scheduler_config.json").is_file():
            folder = denoiser.path.parent / subfolder
            sub = classify_folder(folder, self.table, origin=denoiser.origin)
            return ComponentSource(slot, folder, sub.class_name, denoiser.origin)
        if self.table[slot].default_config is None:
            raise self._missing(slot)
        return ComponentSource(slot, None, self.table.expected(slot), "the family's published scheduler config")

    def _resolve_companion(self, slot: str) -> ComponentSource:
        """A tokenizer or processor: the flag that names it (--tokenizer_path for the first text encoder's
        tokenizer, --processor_path for the first processor); a folder given in --model_paths; a pipeline
        folder's subfolder; the same subfolder beside a text encoder's folder; else, when model ids are
        given, the slot's origin folder under them (as DiffSynth defaults its tokenizer and processor)."""
        kind = self.table[slot].kind
        if kind == "tokenizer":
            given, is_folder, make = self._tokenizers_given.get(slot), is_tokenizer_folder, self._tokenizer_source
        else:
            given = self.processor_path if slot == self.table.processors[0] else None
            is_folder, make = is_processor_folder, self._processor_source
        if given is not None:
            local = Path(given).expanduser()
            if local.exists() or ":" not in given:
                if not local.exists():
                    raise ModelLoadError(local, f"{kind} path {path_missing(local)}")
                return make(slot, local, given)
            model_id, pattern = parse_model_id_with_origin_paths(given)[0]
            return make(slot, self._snapshot(model_id, pattern), given)
        self._classify_for(slot)
        entry = self._component(slot)
        if entry is not None:
            return ComponentSource(slot, entry.path, entry.class_name, entry.origin)
        pipeline_error = None
        try:
            source = self._pipeline_source(slot)
        except ModelLoadError as exc:  # e.g. the pipeline's tokenizer/ or processor/ folder is missing
            source, pipeline_error = None, exc
        if source is not None:
            return source
        encoders = [self.table.encoder_of(slot)] if kind == "tokenizer" else list(self.table.text_encoders)
        subfolder = self.table[slot].subfolder
        encoder = None
        for encoder_slot in (e for e in encoders if e is not None):
            self._classify_for(encoder_slot)
            found = self._component(encoder_slot)
            encoder = encoder or found
            if found is not None and is_folder(found.path.parent / subfolder):
                return make(slot, found.path.parent / subfolder, found.origin)
        source = self._from_origins(slot, encoder, make, pipeline_error)
        if source is not None:
            return source
        if pipeline_error is not None:
            raise pipeline_error
        raise self._missing(slot)

    def _from_origins(self, slot: str, encoder: FolderEntry | None, make: Any,
                      pipeline_error: ModelLoadError | None) -> ComponentSource | None:
        """The slot's origin folder (ModelSlot.origin's pattern) under the model ids given, the text encoder's
        first, then the family's default model id; None when no model id is given or the slot has no origin."""
        origin = self.table[slot].origin
        if not self._model_ids() or origin is None:
            return None
        ids = [encoder.model_id] if encoder is not None and encoder.model_id else []
        ids += [model_id for model_id, _ in self._model_ids()]
        ids.append(origin[0])
        ids = list(dict.fromkeys(ids))
        for model_id in ids:  # local files first: DiffSynth's ./models, then the modelscope cache, no network
            try:
                folder = self.hub.found_locally(model_id, origin[1])
            except ModelLoadError:
                folder = None
            if folder is not None:
                return make(slot, folder, f"{model_id}:{origin[1]}")
        last_error = None
        for model_id in ids:
            try:
                folder = self._snapshot(model_id, origin[1])
            except ModelLoadError as exc:
                last_error = exc
                continue
            return make(slot, folder, f"{model_id}:{origin[1]}")
        if last_error is not None and pipeline_error is None:
            raise last_error
        return None

    def _tokenizer_source(self, slot: str, folder: Path, origin: str) -> ComponentSource:
        if not is_tokenizer_folder(folder):
            raise ModelLoadError(folder, "not a tokenizer folder (no tokenizer.json or tokenizer_config.json)")
        return ComponentSource(slot, folder, tokenizer_class_of(folder) or self.table.expected(slot), origin)

    def _processor_source(self, slot: str, folder: Path, origin: str) -> ComponentSource:
        if not is_processor_folder(folder):
            raise ModelLoadError(folder, "not a processor folder (no preprocessor_config.json)")
        return ComponentSource(slot, folder, processor_class_of(folder) or self.table.expected(slot), origin)

    def _missing(self, slot: str) -> ModelLoadError:
        if not self.has_sources:
            return ModelLoadError(None, f"no model given for {slot}: pass --model_paths or --model_id_with_origin_paths")
        if self.table[slot].kind == "tokenizer":
            flag = "--tokenizer_2_path" if list(self._tokenizer_order()).index(slot) == 1 else "--tokenizer_path"
            return ModelLoadError(None, f"no {slot} found beside the text encoder or in a pipeline folder; pass {flag}")
        if self.table[slot].kind == "processor":
            return ModelLoadError(None, f"no {slot} found beside the text encoder or in a pipeline folder; pass --processor_path")
        for i, candidate in enumerate(self.candidates):  # describe everything that was given
            if candidate.remote:
                self._classify(i)
        expected = self.table.expected(slot)
        if len(self.entries) == 1:
            e = self.entries[0]
            what = f"a {e.kind} folder" + (f" ({e.class_name})" if e.class_name else "")
            if e.kind == "pipeline":
                what = f"a pipeline folder without a {self.table[slot].subfolder} component"
            return ModelLoadError(e.path, f"is {what}, but {slot} needs {expected} and no other path provides it")
        kinds = "; ".join(f"{e.path} ({e.kind})" for e in self.entries)
        return ModelLoadError(None, f"no given path provides {slot} ({expected}); given: {kinds}")

    def _tokenizer_order(self) -> list[str]:
        """Tokenizer slots: those paired with the text encoders first, in order, then the others."""
        paired = [s.tokenizer for s in self.table.slots.values() if s.kind == "model" and s.tokenizer]
        return list(dict.fromkeys([*paired, *self.table.tokenizers]))

    def resolve_many(self, slots: Iterable[str] | str) -> dict[str, ComponentSource]:
        return {slot: self.resolve(slot) for slot in self.table.check(slots)}

    # -- files and loading -----------------------------------------------------------------------

    def files(self, slot: str, include_config: bool = True) -> list[Path]:
        """The files the given slot would read (safetensors weights, plus configs by default), for hashing: a
        release single file is itself and the config.json read beside it.

        The family's default scheduler config yields [].
        """
        return component_files(self.resolve(slot), self.table[slot].kind, include_config=include_config)

    def config_files(self, slot: str) -> list[Path]:
        """The files a configuration-only read of a model slot opens: its config.json (a release single file: the
        file, whose header it reads, and the config.json beside it)."""
        source = self.resolve(slot)
        if source.single_file is not None:
            return component_files(source, "model")
        return [slot_config_file(source)]

    def load_config(self, slot: str) -> Any:
        """A model slot's configuration, from its config.json alone (its weights are never opened; a release single
        file's from its header): a diffusers FrozenDict or a transformers PretrainedConfig, as `model.config` would be."""
        source = self.resolve(slot)
        spec = self.table[slot]
        if source.single_file is not None:
            config = single_file_config(source.path, source.single_file, source.beside, source.origin)
            if spec.library == "diffusers":
                from diffusers.configuration_utils import FrozenDict

                return FrozenDict(config)
            return slot_class(spec).config_class.from_dict({k: v for k, v in config.items() if not k.startswith("_")})
        folder = slot_config_file(source).parent
        check_config_sizes(folder)  # a unit or the memory plan may build from it
        try:
            if spec.library == "diffusers":
                from diffusers.configuration_utils import FrozenDict

                return FrozenDict(slot_class(spec).load_config(str(folder), local_files_only=True))
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(source.path, f"cannot read the configuration of {slot}: {detail}") from None

    def load(self, slots: Iterable[str] | str, torch_dtype: Any = None, skeletons: Iterable[str] = ()) -> dict[str, Any]:
        """Load only the requested slots: {slot: model / tokenizer / scheduler}; models in eval mode on the CPU,
        those of `skeletons` without their weights where they can be read into shards later (models/shards.py).

        Every slot is resolved before the (slow) loading starts.
        """
        resolved = self.resolve_many(slots)
        skeletons = set(skeletons)
        return {slot: load_component(source, self.table[slot], torch_dtype, skeleton=slot in skeletons)
                for slot, source in resolved.items()}


def _tensor_count(files: list[Path], origin: str) -> int:
    from .release import header

    return sum(len(header(path, origin).tensors) for path in files)

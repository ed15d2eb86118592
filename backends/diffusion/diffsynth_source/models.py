"""A DiffSynth pipeline's models, found as DiffSynth finds them and loaded by DiffSynth's own loader.

`--model_paths` (a JSON list whose entries are a file or a list of a model's shard files) and
`--model_id_with_origin_paths` (`org/name:pattern,...`, looked for in DiffSynth's `./models/<org>/<name>/` first,
then the modelscope cache, and downloaded only when neither holds them: `models.hub.Hub`) become DiffSynth
`ModelConfig`s, and the pipeline class's own `from_pretrained` loads them: DiffSynth's `ModelPool` recognises each
file by the md5 of its sorted `key:shape` list against its model-config table (`diffsynth.configs.MODEL_CONFIGS`).

Two things are unitgraph's:

- **A stage loads only its models.** Each file is recognised before loading (the same hash, the same table), so a
  stage passes `from_pretrained` only the files of the models its units call: stage 2 never opens the encoders'
  files, and does not need them on disk. Which pipeline attribute a table entry fills is read from the pipeline's
  `from_pretrained` source (`pipe.text_encoder = model_pool.fetch_model("stable_diffusion_text_encoder")`).
- **A file the table does not know** (a resized, pruned or test-sized model: its hash names no entry) is recognised
  by its `config.json`, as a diffusers or transformers folder keeps one beside its weights: each table entry of a
  model the pipeline loads is built on the meta device with the config's values its constructor takes, its
  state-dict converter applied to the file's names and shapes, and the entry whose model has exactly the file's
  weights is registered for this process under the file's hash, with those values as its `extra_kwargs` (how
  DiffSynth's own table gives a class its sizes). Nothing is imported from outside the `diffsynth` package, and a
  file no entry fits is one line naming it.

Weights are read from safetensors only: DiffSynth would read another file with torch.load (pickle), so unitgraph
reads a pickled release file (JoyAI-Image's `transformer/transformer.pth`) from its safetensors twin beside it, and
without one names `unitgraph twin FILE`, which writes it once (models/twin.py). A release file the pipeline's
`from_pretrained` redirects to DiffSynth's own safetensors copy (a video family's `.pth` text encoder and VAE) is
looked for where DiffSynth looks: at the copy (`redirects`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import json
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from ..errors import BackendError
from ..models.hub import Hub, origin_subfolder
from ..models.twin import is_pickled, twin_command, twin_path
from .glue import Glue

__all__ = ["ModelFile", "examples", "find_models", "fp8_storage", "load_pipeline", "load_tensor", "model_attributes",
           "named_models", "planned_models", "recognise", "redirects", "skeleton", "tensor_file", "with_fp8"]

Files = Union[str, list[str]]
# torchaudio's newest build requires its own torch; without its dependencies it imports beside the diffsynth
# environment's (its resampler is what DiffSynth's audio pipelines call; its file reading is not used)
TORCHAUDIO_HINT = "pip install --no-deps torchaudio==2.11.0"


@dataclass(frozen=True)
class ModelFile:
    """One model of the command: its file(s), the table entries that recognise it, and the pipeline attributes it
    fills, each with the entry it is loaded as (a VAE file may fill an encoder and a decoder)."""

    path: Files
    loads: tuple[tuple[str, dict], ...]  # (pipeline attribute, its table entry), one per model the pipeline loads
    entries: tuple[dict, ...] = ()  # every table entry of the file (class, converter, sizes), for the cache key
    given: str = ""  # how the command names it: its --model_paths entry, or MODEL_ID:PATTERN (what --fp8_models matches)
    fp8: bool = False  # loaded with DiffSynth's fp8 storage (--fp8_models)

    @property
    def attributes(self) -> tuple[str, ...]:
        return tuple(attribute for attribute, _ in self.loads)

    def identity(self) -> list[Any]:
        """What the file loads as (name, class, sizes): part of the cache key of a stage that reads its skeleton."""
        return [[e["model_name"], e["model_class"], e.get("extra_kwargs", {})] for e in self.entries]

    def skeletons(self) -> dict[str, Any]:
        """{pipeline attribute: its model built on the meta device (attributes and config, no weights)}."""
        return {attribute: skeleton(entry) for attribute, entry in self.loads}

    def records(self) -> dict[str, dict[str, Any]]:
        """{pipeline attribute: what its skeleton is built from (class and sizes)}, as JSON: stage 1 writes it into
        the cache, so stage 2 rebuilds the skeleton of a model its units only read the configuration of (a video noise
        unit reads the VAE's latent channels) without that model's file."""
        return {attribute: {"model_name": entry["model_name"], "model_class": entry["model_class"],
                            "extra_kwargs": json.loads(json.dumps(entry.get("extra_kwargs", {})))}
                for attribute, entry in self.loads}

    @property
    def label(self) -> str:
        return self.path if isinstance(self.path, str) else f"{self.path[0]} (+{len(self.path) - 1} more)"


def skeleton(entry: dict[str, Any]) -> Any:
    """The model of a table entry (or a cache's record of one) built on the meta device: only `diffsynth.*` classes."""
    import torch

    kwargs = entry.get("extra_kwargs", {})
    if not isinstance(kwargs, dict):
        raise BackendError(f"a model record's sizes are not a mapping ({type(kwargs).__name__})")
    return _empty(_import(str(entry["model_class"])), kwargs)


def _empty(cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)` without weights: on the meta device, or, for a class that reads a value of a tensor it builds
    (ACE-Step's audio tokenizer checks its quantizer's levels), with only its parameters there (accelerate's
    init_empty_weights: its buffers are built, small)."""
    import torch

    try:
        with torch.device("meta"):
            return cls(**kwargs)
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc):
            raise
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return cls(**kwargs)


def _import(dotted: str) -> Any:
    if not dotted.startswith("diffsynth."):
        raise BackendError(f"refusing to import {dotted}: only DiffSynth's own classes are loaded")
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def model_attributes(pipeline_class: type) -> dict[str, str]:
    """{DiffSynth model name: the pipeline attribute it fills}, read from `from_pretrained`'s source.

    >>> class P:
    ...     @staticmethod
    ...     def from_pretrained(model_pool=None, pipe=None):
    ...         pipe.unet = model_pool.fetch_model("stable_diffusion_unet")
    >>> model_attributes(P)
    {'stable_diffusion_unet': 'unet'}
    """
    source = textwrap.dedent(inspect.getsource(pipeline_class.from_pretrained))
    found: dict[str, str] = {}
    fetched: dict[str, str] = {}  # local variable -> model name (`dits = model_pool.fetch_model("x", index=2)`)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        name = _fetched_name(value)
        if name is not None and isinstance(target, ast.Name):
            fetched[target.id] = name
        elif isinstance(target, ast.Attribute):
            if name is None:
                base = value.value if isinstance(value, ast.Subscript) else value
                name = fetched.get(base.id) if isinstance(base, ast.Name) else None
            if name is not None:
                found.setdefault(name, target.attr)
    return found


def redirects(pipeline_class: type) -> dict[str, tuple[str, str]]:
    """{file pattern: (model id, pattern)} of the release files `from_pretrained` fetches from DiffSynth's own copies
    instead (its `redirect_dict`, on by default: a video family's `.pth` text encoder and VAE are
    read from DiffSynth's converted safetensors copies), read from its source; {} for a pipeline without one.

    >>> class P:
    ...     @staticmethod
    ...     def from_pretrained(model_configs=(), redirect_common_files=True):
    ...         redirect_dict = {"a.pth": ("Org/Copies", "a.safetensors")}
    >>> redirects(P)
    {'a.pth': ('Org/Copies', 'a.safetensors')}
    """
    source = textwrap.dedent(inspect.getsource(pipeline_class.from_pretrained))
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "redirect_dict"):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {k: (v[0], v[1]) for k, v in table.items()
                    if isinstance(k, str) and isinstance(v, tuple) and len(v) == 2}
    return {}


def _fetched_name(value: ast.expr) -> Optional[str]:
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "fetch_model"
            and value.args and isinstance(value.args[0], ast.Constant) and isinstance(value.args[0].value, str)):
        return value.args[0].value
    return None


# ------------------------------------------------------------------------------------------------
# the command's model arguments -> files


def _parse_model_paths(value: Optional[str]) -> list[Files]:
    if not value:
        return []
    text = value.strip()
    if not text.startswith("["):
        return [text]
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BackendError(f"--model_paths is not a JSON list ({exc.msg} at character {exc.pos})") from None
    out: list[Files] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and all(isinstance(p, str) for p in item):
            out.append(list(item))
        else:
            raise BackendError(f"--model_paths: each entry is a path or a list of a model's files, got {item!r:.60}")
    return out


def _parse_ids(value: Optional[str]) -> list[tuple[str, str]]:
    if not value:
        return []
    pairs = []
    for item in value.split(","):
        item = item.strip()
        model_id, sep, pattern = item.rpartition(":")
        if not sep or not model_id or not pattern:
            raise BackendError(f"--model_id_with_origin_paths: {item!r} is not MODEL_ID:PATTERN")
        pairs.append((model_id, pattern))
    return pairs


def _id_files(hub: Hub, model_id: str, pattern: str) -> Files:
    folder = hub.snapshot(model_id, pattern, lambda where, problem: BackendError(problem, source=str(where)))
    root = folder.parent if origin_subfolder(pattern) else folder
    files = sorted(str(p) for p in root.glob(pattern) if p.is_file())
    if not files:
        raise BackendError(f"no file matches {pattern}", source=str(root))
    return files[0] if len(files) == 1 else files


def _readable_files(files: Files) -> Files:
    """`files` as unitgraph reads them: each a .safetensors file, a pickled one (`.pth`) by its safetensors twin
    beside it (models/twin.py); a pickle without its twin is one line naming the command that writes it."""
    out = []
    for path in [files] if isinstance(files, str) else files:
        p = Path(path)
        if not p.is_file():
            raise BackendError("model file not found" if not p.exists() else "a model is a .safetensors file or a list "
                               "of them, not a folder (DiffSynth's --model_paths names files)", source=str(p))
        if is_pickled(p) and twin_path(p).is_file():
            p = twin_path(p)
        elif is_pickled(p):
            raise BackendError(f"a pickle (torch.save), which unitgraph does not unpickle while it runs (DiffSynth "
                               f"would read it with torch.load); write its safetensors twin beside it once: "
                               f"{twin_command(p)}", source=str(p))
        elif p.suffix != ".safetensors":
            raise BackendError("only .safetensors model files are read (DiffSynth would read this one with torch.load, "
                               "which unpickles it)", source=str(p))
        out.append(str(p))
    return out[0] if isinstance(files, str) else out


def _release_files(hub: Hub, model_id: str, pattern: str) -> Files:
    """The files of `model_id:pattern`; of a pickled pattern (`transformer/transformer.pth`), its twins where they are
    kept without the pickle (a user who converted it may have removed it)."""
    if is_pickled(Path(pattern)):
        twins = str(twin_path(Path(pattern)))
        if hub.found_locally(model_id, twins) is not None:
            return _id_files(hub, model_id, twins)
    return _id_files(hub, model_id, pattern)


def find_models(glue: Glue, model_paths: Optional[str], model_id_with_origin_paths: Optional[str],
                hub: Hub) -> list[ModelFile]:
    """Every model the command names, recognised (see the module docstring)."""
    pipeline_class = pipeline_class_of(glue)
    attributes = model_attributes(pipeline_class)
    found: list[ModelFile] = []
    redirected = redirects(pipeline_class)  # a release file DiffSynth fetches from its own copy is looked for there
    named = [(files, _named(files)) for files in _parse_model_paths(model_paths)]
    for asked in _parse_ids(model_id_with_origin_paths):
        model_id, pattern = redirected.get(asked[1], asked)
        named.append((_release_files(hub, model_id, pattern), f"{asked[0]}:{asked[1]}"))
    for files, as_given in named:
        files = _readable_files(files)
        found.append(_model_file(files, recognise(files, attributes), attributes, as_given))
    return found


def _named(files: Files) -> str:
    """A --model_paths entry as the command writes it (a list of shards as its JSON)."""
    return files if isinstance(files, str) else json.dumps(files)


def examples() -> dict[tuple[str, str], str]:
    """{(model id, file pattern): model hash} from the `# Example: ModelConfig(model_id=..., origin_file_pattern=...)`
    comments of DiffSynth's model-config table: which entry a release file is, known without the file (the dry run
    plans a command whose models are not downloaded). Read from the table's source; nothing is imported for it."""
    import re

    from diffsynth import configs

    source = Path(inspect.getsourcefile(configs.model_configs) or "").read_text(encoding="utf-8")
    found: dict[tuple[str, str], str] = {}
    pending: list[tuple[str, str]] = []
    example = re.compile(r'#\s*Example:\s*ModelConfig\(model_id="([^"]+)",\s*origin_file_pattern="([^"]+)"')
    for line in source.splitlines():
        match = example.search(line)
        if match:
            pending.append((match.group(1), match.group(2)))
            continue
        hashed = re.search(r'"model_hash":\s*"([0-9a-f]{32})"', line)
        if hashed:
            for key in pending:
                found.setdefault(key, hashed.group(1))
            pending = []
        elif line.strip().startswith("},"):
            pending = []
    return found


def planned_models(glue: Glue, model_paths: Optional[str], model_id_with_origin_paths: Optional[str],
                   hub: Hub) -> list[ModelFile]:
    """The command's models for the dry run: a file that is here is recognised as a run does; a model id whose files
    are not is taken from the table's examples (its entry, without reading or downloading anything)."""
    from diffsynth.configs import MODEL_CONFIGS

    pipeline_class = pipeline_class_of(glue)
    attributes = model_attributes(pipeline_class)
    found: list[ModelFile] = []
    known = examples()
    aliases = dict(glue.sized_as)
    for files in _parse_model_paths(model_paths):
        files = _readable_files(files)
        entries = recognise(files, attributes)
        found.append(_model_file(files, entries, attributes, _named(files)))
    redirected = redirects(pipeline_class)
    for asked in _parse_ids(model_id_with_origin_paths):
        model_id, pattern = redirected.get(asked[1], asked)
        twins = str(twin_path(Path(pattern))) if is_pickled(Path(pattern)) else pattern
        if hub.found_locally(model_id, twins) is not None or hub.found_locally(model_id, pattern) is not None:
            files = _readable_files(_release_files(hub, model_id, pattern))
            found.append(_model_file(files, recognise(files, attributes), attributes, f"{asked[0]}:{asked[1]}"))
            continue
        model_hash = known.get((model_id, pattern)) or known.get(asked)  # a redirected file: the release's entry
        if model_hash is None and asked != (model_id, pattern):
            model_id, pattern = asked  # sized from the release file the command names
        label = f"{model_id}:{pattern}"
        twin = aliases.get(label)  # the glue names the example it is, or its entry's hash (over the table's comments)
        if twin is not None and twin.startswith("md5:"):
            model_hash, label = twin[4:], f"{label} (sized as DiffSynth's table entry {twin[4:12]})"
        elif twin is not None and known.get(tuple(twin.rsplit(":", 1))):
            model_hash, label = known[tuple(twin.rsplit(":", 1))], f"{label} (sized as {twin})"
        if model_hash is None:  # the same file in the same repository, else another release's file of the same
            by_hash = {c["model_hash"]: c for c in MODEL_CONFIGS}  # pattern, of a model this pipeline loads
            usable = [(key, h) for key, h in known.items() if h in by_hash and by_hash[h]["model_name"] in attributes]
            other = next(((key, h) for key, h in usable if key[0] == model_id and "*" not in pattern
                          and Path(key[1]).name == Path(pattern).name
                          and Path(key[1]).parts[0] == Path(pattern).parts[0]), None)
            # of those with the pattern, the repository whose name shares the longest start with the asked one, the
            # table's first of equals (a base model's DiT sized as its distilled sibling's, not as another size's)
            same = [(key, h) for key, h in usable if key[1] == pattern]
            other = other or max(same, key=lambda kh: len(os.path.commonprefix([kh[0][0], model_id])), default=None)
            if other is not None:
                model_hash, label = other[1], f"{label} (sized as {other[0][0]}:{other[0][1]})"
        entries = tuple(c for c in MODEL_CONFIGS if c["model_hash"] == model_hash)
        if not entries:
            raise BackendError(f"{model_id}:{pattern} is not downloaded and DiffSynth's model-config table names no "
                               "entry for it (its '# Example:' comments); download it or pass --model_paths")
        found.append(_model_file(label, entries, attributes, f"{asked[0]}:{asked[1]}"))
    return found


def _model_file(files: Files, entries: tuple[dict, ...], attributes: dict[str, str], given: str) -> ModelFile:
    """The file's models the pipeline loads: each attribute with the first entry of its model name."""
    loads: dict[str, dict] = {}
    for entry in entries:
        attribute = attributes.get(entry["model_name"])
        if attribute is not None:
            loads.setdefault(attribute, entry)
    return ModelFile(files, tuple(loads.items()), entries, given)


def named_models(models: list[ModelFile], value: Optional[str], flag: str) -> list[int]:
    """The indices of `models` a list flag (--fp8_models, --offload_models) names. A name is a model's entry as the
    command gives it (DiffSynth's own matching: the --model_paths entry or MODEL_ID:PATTERN, exactly), or, as
    unitgraph's families take it, a pipeline attribute it fills (dit, text_encoder); one that matches no model is one
    line.

    >>> m = ModelFile("models/dit.safetensors", (("dit", {}),), given="org/x:dit.safetensors")
    >>> named_models([m], "dit", "--fp8_models"), named_models([m], "org/x:dit.safetensors", "--fp8_models")
    ([0], [0])
    """
    found: list[int] = []
    for name in [n.strip() for n in (value or "").split(",") if n.strip()]:
        hits = [i for i, m in enumerate(models) if name == m.given or name in m.attributes]
        if not hits:
            raise BackendError(f"{flag} {name!r} names no model of the command (its models: "
                               f"{', '.join(a for m in models for a in m.attributes) or 'none'}; or an entry of "
                               "--model_paths / --model_id_with_origin_paths as written)")
        found += [i for i in hits if i not in found]
    return found


def with_fp8(models: list[ModelFile], value: Optional[str], trained: Iterable[str]) -> list[ModelFile]:
    """`models` with those --fp8_models names (`named_models`) marked for DiffSynth's fp8 storage. A model whose own
    weights train (--trainable_models) is one line; a LoRA base may be fp8."""
    from dataclasses import replace

    marked = list(models)
    for i in named_models(models, value, "--fp8_models"):
        busy = sorted(set(models[i].attributes) & set(trained))
        if busy:
            raise BackendError(f"--fp8_models: {busy[0]} is in --trainable_models; a model whose weights train "
                               "cannot be stored in fp8 (its LoRA base may be)")
        marked[i] = replace(marked[i], fp8=True)
    return marked


def pipeline_class_of(glue: Glue) -> type:
    """The pipeline class; one line when its module imports a package that is not installed (MOVA's imports
    torchaudio, which DiffSynth's wheel does not require)."""
    try:
        module = importlib.import_module(f"diffsynth.pipelines.{glue.module}")
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.split(".")[0] == "diffsynth":
            raise
        how = f" (scripts/setup_diffsynth.sh installs it: {TORCHAUDIO_HINT})" if exc.name == "torchaudio" else ""
        raise BackendError(f"{glue.name}: DiffSynth's pipeline module imports {exc.name}, which is not installed"
                           f"{how}") from None
    return getattr(module, glue.class_name)


# ------------------------------------------------------------------------------------------------
# recognising a file


def _file_shapes(files: Files) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in [files] if isinstance(files, str) else files:
        try:
            with safe_open(path, "pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own types for damaged files
            raise BackendError(f"unreadable safetensors file ({type(exc).__name__}: {exc})", source=str(path)) from None
    return shapes


# the key of a table entry unitgraph registered from a config.json: that file's path
REGISTERED_FROM = "unitgraph_config"


def recognise(files: Files, attributes: dict[str, str]) -> tuple[dict, ...]:
    """The table entries `files` loads as in this pipeline: those of its hash naming a model the pipeline loads, else
    (a file the table does not know for this pipeline) the entry its config.json builds, registered now beside any
    other entry of the same hash (DiffSynth loads each). One line when neither recognises it.

    Only this pipeline's entries count: the same weights may be several pipelines' models (two SD generations'
    VAEs; two test-size VAEs of one shape), and an entry another pipeline registered earlier in the process must not
    change what the file is here (it is part of a cache's key). Nor does an entry registered from another folder's
    config.json: the same weights beside another configuration (a class reading its configuration's folder itself,
    Ideogram 4's text encoder, would read that folder, even once it is gone); it is replaced."""
    from diffsynth.configs import MODEL_CONFIGS
    from diffsynth.core.loader.file import hash_model_file

    model_hash = hash_model_file(files)
    first = files if isinstance(files, str) else files[0]
    config = str(_config_beside(files))
    # an entry registered from a config.json stands for the files beside that one only
    known = tuple(c for c in MODEL_CONFIGS if c["model_hash"] == model_hash and c["model_name"] in attributes
                  and c.get(REGISTERED_FROM, config) == config)
    if known:
        return known
    entries = _from_config(files, attributes)
    if not entries:
        raise BackendError(f"DiffSynth does not recognise this model (its key hash {model_hash} is in no entry of "
                           "diffsynth.configs.MODEL_CONFIGS) and no config.json beside it builds one of "
                           f"{', '.join(sorted(attributes.values()))}", source=first)
    # DiffSynth's loader loads a file as every entry of its hash: one registered from another folder's config.json
    # (the same test-size weights elsewhere) would be loaded too, with that folder's configuration
    MODEL_CONFIGS[:] = [c for c in MODEL_CONFIGS
                        if not (c["model_hash"] == model_hash and c.get(REGISTERED_FROM, config) != config)]
    entries = [dict(entry, model_hash=model_hash, **{REGISTERED_FROM: config}) for entry in entries]
    MODEL_CONFIGS.extend(entries)
    return tuple(entries)


def _config_beside(files: Files) -> Path:
    """The config.json a file (a model in shards: its first) is recognised by: the one in its folder."""
    return Path(files if isinstance(files, str) else files[0]).parent / "config.json"


def _from_config(files: Files, attributes: dict[str, str]) -> list[dict[str, Any]]:
    """The table entries the config.json beside `files` builds. The first that fits, when it takes the whole file;
    else every entry (one per model name) that takes a part of it: a release file may hold several models, each entry's
    state-dict converter picking its own (ACE-Step's DiT, condition encoder and audio tokenizer, under `decoder.`,
    `encoder.` and `tokenizer.`), while weights a whole model has may fit another pipeline model's class too (a
    pipeline's two CLIP text encoders at test size), which the first decides, as before."""
    from diffsynth.configs import MODEL_CONFIGS

    config_file = _config_beside(files)
    if not config_file.is_file():
        return []
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BackendError(f"unreadable config.json ({exc})", source=str(config_file)) from None
    if not isinstance(config, dict):
        return []
    if "auto_map" in config:
        raise BackendError("config.json names code to import (auto_map); unitgraph runs no code a model's folder "
                           "brings", source=str(config_file))
    shapes = _file_shapes(files)
    whole = sum(math.prod(shape) for shape in shapes.values())
    seen: set[tuple[str, str, str]] = set()
    candidates = [e for e in MODEL_CONFIGS if e["model_name"] in attributes and not e.get("quant_config")]
    # a config's `_class_name` naming one of the candidates' classes chooses among weights that fit several (MOVA's
    # audio DiT subclasses a video DiT, one-dimensional: the parent built with a patch of (1,) has the same names and
    # shapes); a diffusers class name (an AutoencoderKL...) names none of DiffSynth's and chooses nothing
    named = [e for e in candidates if e["model_class"].rpartition(".")[2] == config.get("_class_name")]
    found: dict[str, dict[str, Any]] = {}
    for entry in named or candidates:  # (an entry of a prequantized release file is that file's alone)
        ident = (entry["model_name"], entry["model_class"], entry.get("state_dict_converter", ""))
        if ident in seen or entry["model_name"] in found:
            continue
        seen.add(ident)
        cls = _import(entry["model_class"])
        taken = inspect.signature(cls.__init__).parameters
        given = {k: v for k, v in config.items() if k in taken and k != "self"}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):  # a class handing **kwargs on (MOVA's
            given = {k: v for k, v in config.items() if not k.startswith("_")}  # audio DiT): every value it names
        if "config" in taken and "config" not in config:  # a class taking its whole configuration as one dict
            given["config"] = {k: v for k, v in config.items() if not k.startswith("_")}
        if "config_path" in taken:  # a class reading its configuration's folder itself
            given["config_path"] = str(config_file.parent)
        # a JSON list as a tuple (what most classes' defaults are), else as the list it is (a class that adds
        # lists to it: Qwen-Image's VAE, `[1] + dim_mult`)
        for kwargs in ({k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}, given):
            taken_numel = _fits(cls, entry, kwargs, shapes)
            if not taken_numel:
                continue
            built = {**{k: v for k, v in entry.items() if k != "model_hash"},
                     "extra_kwargs": {**entry.get("extra_kwargs", {}), **kwargs}}
            if not found and taken_numel >= whole:  # the whole file is this model
                return [built]
            if taken_numel < whole:
                found[entry["model_name"]] = built
            break
    return list(found.values())


def _fits(cls: type, entry: dict[str, Any], kwargs: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> int:
    """The number of the file's weights the table entry's class built with `kwargs` (on the meta device) takes, when
    it has exactly the weights `shapes` names read through the entry's state-dict converter (which may pick a part of
    the file); 0 when it does not."""
    import torch

    try:
        model = _empty(cls, {**entry.get("extra_kwargs", {}), **kwargs})
        state = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
        if entry.get("state_dict_converter"):
            state = _import(entry["state_dict_converter"])(state)
    except Exception:  # a class these values do not build, a converter these names do not fit: not this entry
        return 0
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if wanted != {k: tuple(v.shape) for k, v in state.items()}:
        return 0
    return sum(math.prod(shape) for shape in wanted.values()) or 1


# ------------------------------------------------------------------------------------------------
# loading


def tokenizer_folder(tokenizer: Any, given: Optional[str], hub: Hub) -> str:
    """The folder of one of the pipeline's tokenizers. `given` (its flag's value) is read as DiffSynth's training
    module reads it: an existing path, else `model_id:pattern` (split at the last colon, as in `org/name:tokenizer/`,
    which some examples pass), found as the model files are; no flag: the pipeline's default."""
    model_id, pattern = tokenizer.model_id, tokenizer.pattern
    if given:
        if Path(given).is_dir():
            return given
        if ":" not in given or Path(given).exists():
            raise BackendError("tokenizer folder not found (a folder, or model_id:pattern as DiffSynth's examples "
                               "give it)", source=given)
        model_id, pattern = given.rsplit(":", 1)
    folder = hub.snapshot(model_id, pattern,
                          lambda where, problem: BackendError(f"{problem} (or pass --{tokenizer.flag})", source=str(where)))
    if pattern.endswith("/") and origin_subfolder(pattern):  # a nested folder ("google/umt5-xxl/")
        return str(folder.parent / pattern.rstrip("/"))       # is the pattern's whole path
    return str(folder)


def tensor_file(tensor: Any, given: Optional[str], hub: Hub) -> Path:
    """The safetensors twin of a tensor file the pipeline's `from_pretrained` would unpickle (`DiffSynthTensor`):
    `given` (its flag's value: a file, or model_id:pattern) or the train.py's default, found as the model files are
    (the twin where it is kept beside the release file, else the release file as DiffSynth would fetch it); the twin
    is `NAME.safetensors` beside `NAME.pt`. A release file without its twin is one line saying how to convert it once:
    unitgraph unpickles nothing."""
    if given and (Path(given).exists() or ":" not in given):
        path = Path(given)
    else:
        model_id, pattern = given.rsplit(":", 1) if given else (tensor.model_id, tensor.pattern)
        folder = hub.local(model_id, str(Path(pattern).with_suffix(".safetensors")))
        if folder is None:
            folder = hub.snapshot(model_id, pattern, lambda where, problem: BackendError(
                f"{problem} (or pass --{tensor.flag})", source=str(where)))
        path = (folder.parent if origin_subfolder(pattern) else folder) / pattern
    twin = path if path.suffix == ".safetensors" else twin_path(path)
    if twin.is_file():
        return twin
    if path.is_file():
        raise BackendError(f"a pickle (torch.save), which unitgraph does not unpickle while it runs; write its "
                           f"safetensors twin {twin.name} beside it once: {twin_command(path)}", source=str(path))
    raise BackendError(f"file not found (--{tensor.flag})", source=str(path))


def load_tensor(tensor: Any, path: Path, dtype: Any, device: str) -> Any:
    """The tensor of a twin file (its one tensor), with the dimensions `from_pretrained` swaps swapped, in the
    pipeline's dtype on its device."""
    from safetensors.torch import load_file

    try:
        found = load_file(str(path))
    except Exception as exc:  # safetensors raises its own types for damaged files
        raise BackendError(f"unreadable safetensors file ({type(exc).__name__}: {exc})", source=str(path)) from None
    if len(found) != 1:
        raise BackendError(f"holds {len(found)} tensors; {tensor.attribute} is one tensor", source=str(path))
    value = next(iter(found.values()))
    if tensor.transpose:
        if value.dim() <= max(tensor.transpose):
            raise BackendError(f"a tensor of {value.dim()} dimensions, {tensor.attribute} has more", source=str(path))
        value = value.transpose(*tensor.transpose)
    return value.to(dtype=dtype, device=device)


def load_pipeline(glue: Glue, models: Iterable[ModelFile], attributes: Iterable[str], tokenizers: dict[str, str],
                  dtype: Any, device: str = "cpu") -> Any:
    """The pipeline with only the models filling `attributes` loaded (DiffSynth's `from_pretrained`), and the
    tokenizer folders given (keyword -> folder)."""
    from diffsynth.core import ModelConfig

    release_freed_memory()
    wanted = set(attributes)
    chosen = [m for m in models if wanted & set(m.attributes)]
    configs = [ModelConfig(path=m.path, **(fp8_storage(device) if m.fp8 else {})) for m in chosen]
    kwargs = {keyword: ModelConfig(path=folder) for keyword, folder in tokenizers.items()}
    for tokenizer in glue.tokenizers:
        kwargs.setdefault(tokenizer.keyword, None)
    for tensor in glue.tensors:  # read from its twin (load_tensor), never unpickled
        kwargs[tensor.keyword] = None
    cls = pipeline_class_of(glue)
    try:
        with _quiet(), _skipping_absent(cls, glue.on_loaded):
            return cls.from_pretrained(torch_dtype=dtype, device=device, model_configs=configs, **kwargs)
    except (RuntimeError, ValueError, OSError, KeyError, TypeError) as exc:  # its loader's own, as one line
        files = ", ".join(Path(c.path if isinstance(c.path, str) else c.path[0]).name for c in configs)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackendError(f"DiffSynth's {cls.__name__}.from_pretrained failed on {files or 'no model'}: "
                           f"{type(exc).__name__}: {detail[:300]}") from None


def release_freed_memory() -> None:
    """Memory a pipeline loaded before in this process left, given back before another is read beside it: the
    pipeline is often still held by reference cycles (a LoRA-wrapped model's modules refer to each other), which
    Python frees only when its collector runs, and glibc keeps freed blocks for reuse rather than returning them
    (measured on HiDream-O1's 17.6 GB DiT, three runs in one process: 1.9 to 3.3 GB still held after each run's
    pipeline was collected, and each run's peak 0.1 to 0.35 GB above the one before; given back here, every peak
    was 18.8 GB). Two such models do not fit in 24 GiB."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator's own policy
        pass


@contextlib.contextmanager
def _skipping_absent(cls: type, names: Iterable[str]) -> Iterator[None]:
    """While `from_pretrained` runs: each of `names`, a function of the pipeline's module that it applies to a list of
    its models, applied to the loaded ones only (a stage loads some; the others are None)."""
    module = importlib.import_module(cls.__module__)
    saved = {name: getattr(module, name) for name in names}

    def skipping(function: Any) -> Any:
        return lambda models, *a, **kw: function([m for m in models if m is not None], *a, **kw)

    try:
        for name, function in saved.items():
            setattr(module, name, skipping(function))
        yield
    finally:
        for name, function in saved.items():
            setattr(module, name, function)


def fp8_storage(device: str) -> dict[str, Any]:
    """The `ModelConfig` settings DiffSynth's train.py gives a model of --fp8_models (its training module's own
    `parse_vram_config`): every weight loaded in float8_e4m3fn and cast to bf16 layer by layer as it computes.

    DiffSynth's pipeline, holding such a model, calls `torch.<device>.empty_cache()` whenever a unit loads its models;
    torch has no `torch.cpu.empty_cache`, so on the CPU a no-op one is added (nothing else is changed)."""
    import torch
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    return DiffusionTrainingModule().parse_vram_config(fp8=True, device=device)


class _quiet:
    """DiffSynth's loader prints each file and model it loads as JSON; unitgraph says what a stage loads in one
    line instead."""

    def __enter__(self) -> None:
        import io

        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._redirect.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._redirect.__exit__(*exc)

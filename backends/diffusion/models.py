"""Finding and loading the Qwen-Image model components, slot by slot.

The diffusion pipeline has three model slots and two auxiliary ones:

  ============  =====================================  ==========================
  slot          class                                   pipeline subfolder
  ============  =====================================  ==========================
  dit           QwenImageTransformer2DModel (diffusers)  transformer/
  vae           AutoencoderKLQwenImage (diffusers)       vae/
  text_encoder  Qwen2_5_VLForConditionalGeneration       text_encoder/
  tokenizer     Qwen2Tokenizer (transformers)            tokenizer/
  scheduler     FlowMatchEulerDiscreteScheduler          scheduler/
  ============  =====================================  ==========================

Models come from ``model_paths`` (DiffSynth's ``--model_paths``: a JSON list, a single path,
or a Python list; each entry a whole diffusers pipeline folder or one component folder) and
from ``model_id_with_origin_paths`` (DiffSynth's ``"org/name:sub/pattern,..."``, resolved
through the modelscope cache). Only the requested slots are loaded: a pipeline folder's other
subfolders are never opened, and component folders are only classified by their small
config files.

Every problem is raised as :class:`ModelLoadError`, whose message is one line naming the path
and the problem. Weights are read from safetensors only (never pickle).

torch, diffusers and transformers are imported inside the functions, so importing this module
is cheap.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

MODEL_SLOTS = ("dit", "vae", "text_encoder")
AUX_SLOTS = ("tokenizer", "scheduler")
ALL_SLOTS = MODEL_SLOTS + AUX_SLOTS

# Subfolder of each slot inside a diffusers pipeline folder (keys of model_index.json).
PIPELINE_SUBFOLDERS = {
    "dit": "transformer",
    "vae": "vae",
    "text_encoder": "text_encoder",
    "tokenizer": "tokenizer",
    "scheduler": "scheduler",
}
_SUBFOLDER_SLOTS = {sub: slot for slot, sub in PIPELINE_SUBFOLDERS.items()}

# The class each slot expects (for messages) and the classes accepted for it.
SLOT_CLASSES = {
    "dit": "QwenImageTransformer2DModel",
    "vae": "AutoencoderKLQwenImage",
    "text_encoder": "Qwen2_5_VLForConditionalGeneration",
    "tokenizer": "Qwen2Tokenizer",
    "scheduler": "FlowMatchEulerDiscreteScheduler",
}
_DIFFUSERS_CLASS_SLOTS = {
    "QwenImageTransformer2DModel": "dit",
    "AutoencoderKLQwenImage": "vae",
    "FlowMatchEulerDiscreteScheduler": "scheduler",
}
_TEXT_ENCODER_MODEL_TYPES = {"qwen2_5_vl"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
_WEIGHT_INDEX_FILES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
_WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")

# Qwen-Image's published scheduler configuration (scheduler/scheduler_config.json); used when
# no scheduler folder is given (DiffSynth-style component lists have none).
QWEN_IMAGE_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "invert_sigmas": False,
    "shift_terminal": 0.02,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,
}

# DiffSynth's default tokenizer location when only model ids are given.
DEFAULT_TOKENIZER_ORIGIN = ("Qwen/Qwen-Image", "tokenizer/")
OFFLINE_ENV = "UNITGRAPH_OFFLINE"


class ModelLoadError(Exception):
    """A model could not be found or loaded. str() is one line: '<path>: <problem>'."""

    def __init__(self, path: Any, problem: str):
        self.path = None if path is None else str(path)
        self.problem = " ".join(str(problem).split())
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.path is None:
            return self.problem
        return f"{self.path}: {self.problem}"


@dataclass(frozen=True)
class ComponentSource:
    """Where one slot comes from.

    path is the component folder (None only for the built-in default scheduler); class_name
    is the class its config names; origin is the user-given entry it was found through.
    """

    slot: str
    path: Path | None
    class_name: str
    origin: str = ""

    @property
    def is_default(self) -> bool:
        return self.path is None


@dataclass
class _Entry:
    """One user-given location, classified."""

    origin: str
    path: Path
    kind: str  # "pipeline", a slot name
    class_name: str = ""
    model_id: str | None = None  # modelscope model id, when resolved through modelscope
    subfolders: dict[str, str] = field(default_factory=dict)  # pipeline: slot -> subfolder


# --------------------------------------------------------------------------------------------
# VAE geometry


@dataclass(frozen=True)
class VaeGeometry:
    """Latent geometry of a Qwen-Image VAE: pixels per latent cell and latent channels."""

    scale_factor: int
    latent_channels: int


def vae_geometry(vae: Any) -> VaeGeometry:
    """Spatial downsampling factor (2**len(temperal_downsample)) and z_dim of a VAE.

    Accepts a loaded AutoencoderKLQwenImage, its config (dict-like), or a vae folder path.
    """
    if isinstance(vae, (str, os.PathLike)):
        config = _read_json(Path(vae) / "config.json")
    elif isinstance(vae, Mapping):
        config = vae
    else:
        config = getattr(vae, "config", None)
        if config is None:
            raise TypeError(f"not a VAE or VAE config: {type(vae).__name__}")
    try:
        return VaeGeometry(scale_factor=2 ** len(config["temperal_downsample"]),
                           latent_channels=int(config["z_dim"]))
    except (KeyError, TypeError) as exc:
        raise TypeError(f"VAE config lacks temperal_downsample/z_dim: {exc}") from None


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
                raise ModelLoadError(_short(text), f"--model_paths is not valid JSON ({exc.msg} at char {exc.pos})") from None
            if isinstance(value, str):
                return [value]
            if not isinstance(value, list):
                raise ModelLoadError(_short(text), "--model_paths must be a JSON list of paths")
            return _flatten_paths(value, text)
        return [text]
    if isinstance(model_paths, (list, tuple)):
        return _flatten_paths(list(model_paths), repr(model_paths))
    raise ModelLoadError(_short(repr(model_paths)), "--model_paths must be a path, a list of paths or a JSON list")


def _flatten_paths(value: list, where: str) -> list[str]:
    out: list[str] = []
    for item in value:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten_paths(list(item), where))
        elif isinstance(item, (str, os.PathLike)) and os.fspath(item).strip():
            out.append(os.fspath(item).strip())
        else:
            raise ModelLoadError(_short(where), f"--model_paths entries must be path strings, got {item!r}")
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


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(path, "file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"cannot read JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(path, "is not a JSON object")
    return value


# --------------------------------------------------------------------------------------------
# Classifying folders


def classify_folder(path: Path | str, origin: str | None = None) -> _Entry:
    """Detect what a folder (or a weight file inside one) holds, from its config files only."""
    p = Path(path).expanduser()
    origin = origin or str(path)
    if not p.exists():
        raise ModelLoadError(p, "path does not exist")
    if p.is_file():
        if p.suffix in (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt"):
            entry = classify_folder(p.parent, origin)
            if entry.kind == "pipeline":
                raise ModelLoadError(p, "is a file at the top of a pipeline folder; give the folder itself")
            return entry
        raise ModelLoadError(p, "is a file, not a diffusers/transformers model folder")

    if (p / "model_index.json").is_file():
        index = _read_json(p / "model_index.json")
        subfolders = {}
        for key, value in index.items():
            if key.startswith("_") or not isinstance(value, list):
                continue
            slot = _SUBFOLDER_SLOTS.get(key)
            if slot is not None:
                subfolders[slot] = key
        return _Entry(origin=origin, path=p, kind="pipeline",
                      class_name=str(index.get("_class_name", "")), subfolders=subfolders)

    if (p / "config.json").is_file():
        config = _read_json(p / "config.json")
        class_name = config.get("_class_name")
        if class_name:
            slot = _DIFFUSERS_CLASS_SLOTS.get(class_name)
            if slot is None:
                raise ModelLoadError(p, f"unsupported diffusers model class {class_name} "
                                        f"(expected {SLOT_CLASSES['dit']} or {SLOT_CLASSES['vae']})")
            return _Entry(origin=origin, path=p, kind=slot, class_name=class_name)
        architectures = config.get("architectures") or []
        model_type = config.get("model_type")
        if architectures or model_type:
            names = [str(a) for a in architectures]
            if model_type in _TEXT_ENCODER_MODEL_TYPES or any(a.startswith("Qwen2_5_VL") for a in names):
                return _Entry(origin=origin, path=p, kind="text_encoder",
                              class_name=names[0] if names else SLOT_CLASSES["text_encoder"])
            raise ModelLoadError(p, f"unsupported transformers model {names[0] if names else model_type} "
                                    f"(expected {SLOT_CLASSES['text_encoder']})")
        raise ModelLoadError(p, "config.json names neither a diffusers _class_name nor transformers architectures/model_type")

    if (p / "scheduler_config.json").is_file():
        config = _read_json(p / "scheduler_config.json")
        class_name = str(config.get("_class_name", ""))
        if class_name != SLOT_CLASSES["scheduler"]:
            raise ModelLoadError(p, f"unsupported scheduler {class_name or '(no _class_name)'} "
                                    f"(expected {SLOT_CLASSES['scheduler']})")
        return _Entry(origin=origin, path=p, kind="scheduler", class_name=class_name)

    if (p / "tokenizer_config.json").is_file() or (p / "tokenizer.json").is_file():
        class_name = ""
        if (p / "tokenizer_config.json").is_file():
            class_name = str(_read_json(p / "tokenizer_config.json").get("tokenizer_class", ""))
        return _Entry(origin=origin, path=p, kind="tokenizer", class_name=class_name or SLOT_CLASSES["tokenizer"])

    raise ModelLoadError(p, "not a diffusers/transformers model folder (no model_index.json, config.json, "
                            "scheduler_config.json or tokenizer files)")


def _is_tokenizer_folder(p: Path) -> bool:
    return p.is_dir() and ((p / "tokenizer_config.json").is_file() or (p / "tokenizer.json").is_file())


# --------------------------------------------------------------------------------------------
# modelscope


def _offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _origin_subfolder(pattern: str) -> str:
    """'transformer/diffusion_pytorch_model*.safetensors' -> 'transformer'; 'x.safetensors' -> ''."""
    head, sep, _ = pattern.partition("/")
    return head if sep else ""


def _modelscope_snapshot(model_id: str, pattern: str, cache_dir: str | os.PathLike | None) -> Path:
    """Resolve model_id through modelscope (the local cache only when UNITGRAPH_OFFLINE=1)."""
    sub = _origin_subfolder(pattern)
    file_pattern = pattern + "*" if pattern.endswith("/") else pattern
    allow = [file_pattern, f"{sub}/*.json" if sub else "*.json"]
    label = f"modelscope:{model_id}:{pattern}"
    try:
        from modelscope import snapshot_download
    except ImportError as exc:  # pragma: no cover - modelscope is a backend dependency
        raise ModelLoadError(label, f"modelscope is not installed ({exc})") from None
    offline = _offline()
    try:
        root = snapshot_download(
            model_id,
            cache_dir=None if cache_dir is None else str(cache_dir),
            allow_patterns=allow,
            local_files_only=offline,
        )
    except Exception as exc:  # modelscope raises several unrelated types here
        where = f"cache {cache_dir}" if cache_dir is not None else "default modelscope cache"
        how = f"not found in the {where} ({OFFLINE_ENV}=1, no download)" if offline else "cannot be downloaded"
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelLoadError(label, f"model {how}: {type(exc).__name__}" + (f": {detail}" if detail else "")) from None
    root_path = Path(root)
    folder = root_path / sub if sub else root_path
    if not folder.is_dir():
        raise ModelLoadError(folder, f"{label} has no folder {sub or '.'} in its snapshot")
    if not any(fnmatch.fnmatch(str(f.relative_to(root_path)), file_pattern) for f in folder.rglob("*") if f.is_file()):
        raise ModelLoadError(folder, f"{label}: no file in the snapshot matches {file_pattern}")
    return folder


# --------------------------------------------------------------------------------------------
# Resolving slots


class ModelSources:
    """The user's model arguments, resolved lazily slot by slot.

    Component folders from model_paths are classified eagerly (config files only); modelscope
    entries whose origin subfolder names a slot (transformer/, vae/, ...) are resolved only
    when that slot is asked for. A pipeline folder's subfolders are only looked at on demand.
    """

    def __init__(self, model_paths: Any = None, model_id_with_origin_paths: Any = None,
                 tokenizer_path: Any = None, cache_dir: Any = None):
        self.cache_dir = cache_dir
        self.tokenizer_path = None if tokenizer_path in (None, "") else str(tokenizer_path)
        self._remote = parse_model_id_with_origin_paths(model_id_with_origin_paths)
        self.entries: list[_Entry] = []
        self._seen: set[Path] = set()
        for given in parse_model_paths(model_paths):
            self._add(classify_folder(given))
        self._remote_done: set[int] = set()
        # Entries with no slot hint must be fetched to know what they are.
        for i, (model_id, pattern) in enumerate(self._remote):
            if _SUBFOLDER_SLOTS.get(_origin_subfolder(pattern)) is None:
                self._fetch_remote(i)

    def _add(self, entry: _Entry) -> None:
        key = entry.path.resolve()
        if key not in self._seen:  # several shard files of one folder name that folder once
            self._seen.add(key)
            self.entries.append(entry)

    @property
    def has_sources(self) -> bool:
        return bool(self.entries or self._remote)

    def _fetch_remote(self, i: int) -> None:
        if i in self._remote_done:
            return
        self._remote_done.add(i)
        model_id, pattern = self._remote[i]
        folder = _modelscope_snapshot(model_id, pattern, self.cache_dir)
        entry = classify_folder(folder, origin=f"{model_id}:{pattern}")
        entry.model_id = model_id
        self._add(entry)

    def _fetch_remote_for(self, slot: str) -> None:
        for i, (_, pattern) in enumerate(self._remote):
            if _SUBFOLDER_SLOTS.get(_origin_subfolder(pattern)) == slot:
                self._fetch_remote(i)

    def _unique(self, entries: list[_Entry], slot: str) -> _Entry | None:
        if len(entries) > 1:
            names = ", ".join(str(e.path) for e in entries)
            raise ModelLoadError(entries[1].path, f"more than one path provides {slot}: {names}")
        return entries[0] if entries else None

    def _component(self, slot: str) -> _Entry | None:
        return self._unique([e for e in self.entries if e.kind == slot], slot)

    def _pipeline_source(self, slot: str) -> ComponentSource | None:
        pipelines = [e for e in self.entries if e.kind == "pipeline" and slot in e.subfolders]
        entry = self._unique(pipelines, slot)
        if entry is None:
            return None
        folder = entry.path / entry.subfolders[slot]
        if not folder.is_dir():
            raise ModelLoadError(folder, f"pipeline folder lacks its {entry.subfolders[slot]}/ subfolder (needed for {slot})")
        sub = classify_folder(folder, origin=entry.origin)
        if sub.kind != slot:
            raise ModelLoadError(folder, f"holds a {sub.kind} ({sub.class_name}), but {slot} needs {SLOT_CLASSES[slot]}")
        return ComponentSource(slot, folder, sub.class_name, entry.origin)

    def resolve(self, slot: str) -> ComponentSource:
        """Find the folder of one slot; raise ModelLoadError if no source provides it."""
        if slot not in ALL_SLOTS:
            raise ModelLoadError(slot, f"unknown model slot (expected one of {', '.join(ALL_SLOTS)})")
        if slot == "tokenizer":
            return self._resolve_tokenizer()
        self._fetch_remote_for(slot)
        entry = self._component(slot)
        if entry is not None:
            return ComponentSource(slot, entry.path, entry.class_name, entry.origin)
        source = self._pipeline_source(slot)
        if source is not None:
            return source
        if slot == "scheduler":
            dit = self._component("dit")
            if dit is not None and (dit.path.parent / "scheduler" / "scheduler_config.json").is_file():
                folder = dit.path.parent / "scheduler"
                sub = classify_folder(folder, origin=dit.origin)
                return ComponentSource(slot, folder, sub.class_name, dit.origin)
            return ComponentSource(slot, None, SLOT_CLASSES["scheduler"], "built-in Qwen-Image scheduler config")
        raise self._missing(slot)

    def _resolve_tokenizer(self) -> ComponentSource:
        slot = "tokenizer"
        if self.tokenizer_path is not None:
            local = Path(self.tokenizer_path).expanduser()
            if local.exists() or ":" not in self.tokenizer_path:
                if not local.exists():
                    raise ModelLoadError(local, "tokenizer path does not exist")
                if not _is_tokenizer_folder(local):
                    raise ModelLoadError(local, "not a tokenizer folder (no tokenizer.json or tokenizer_config.json)")
                return ComponentSource(slot, local, _tokenizer_class(local), self.tokenizer_path)
            model_id, pattern = parse_model_id_with_origin_paths(self.tokenizer_path)[0]
            folder = _modelscope_snapshot(model_id, pattern, self.cache_dir)
            return self._tokenizer_source(folder, self.tokenizer_path)
        self._fetch_remote_for(slot)
        entry = self._component(slot)
        if entry is not None:
            return ComponentSource(slot, entry.path, entry.class_name, entry.origin)
        pipeline_error = None
        try:
            source = self._pipeline_source(slot)
        except ModelLoadError as exc:  # e.g. the pipeline's tokenizer/ folder is missing
            source, pipeline_error = None, exc
        if source is not None:
            return source
        # A tokenizer/ folder beside the text encoder folder.
        self._fetch_remote_for("text_encoder")
        text_encoder = self._component("text_encoder")
        if text_encoder is not None:
            beside = text_encoder.path.parent / "tokenizer"
            if _is_tokenizer_folder(beside):
                return ComponentSource(slot, beside, _tokenizer_class(beside), text_encoder.origin)
        # Like DiffSynth: the tokenizer/ folder of the text encoder's model id, else Qwen/Qwen-Image.
        if self._remote:
            ids = []
            if text_encoder is not None and text_encoder.model_id:
                ids.append(text_encoder.model_id)
            ids += [model_id for model_id, _ in self._remote]
            ids.append(DEFAULT_TOKENIZER_ORIGIN[0])
            last_error = None
            for model_id in dict.fromkeys(ids):
                try:
                    folder = _modelscope_snapshot(model_id, DEFAULT_TOKENIZER_ORIGIN[1], self.cache_dir)
                except ModelLoadError as exc:
                    last_error = exc
                    continue
                return self._tokenizer_source(folder, f"{model_id}:{DEFAULT_TOKENIZER_ORIGIN[1]}")
            if last_error is not None and pipeline_error is None:
                raise last_error
        if pipeline_error is not None:
            raise pipeline_error
        raise self._missing(slot)

    def _tokenizer_source(self, folder: Path, origin: str) -> ComponentSource:
        if not _is_tokenizer_folder(folder):
            raise ModelLoadError(folder, "not a tokenizer folder (no tokenizer.json or tokenizer_config.json)")
        return ComponentSource("tokenizer", folder, _tokenizer_class(folder), origin)

    def _missing(self, slot: str) -> ModelLoadError:
        if not self.has_sources:
            return ModelLoadError(None, f"no model given for {slot}: pass --model_paths or --model_id_with_origin_paths")
        if slot == "tokenizer":
            return ModelLoadError(None, "no tokenizer found beside the text encoder or in a pipeline folder; pass --tokenizer_path")
        for i in range(len(self._remote)):  # describe everything that was given
            self._fetch_remote(i)
        described = [e for e in self.entries]
        if len(described) == 1:
            e = described[0]
            what = f"a {e.kind} folder" + (f" ({e.class_name})" if e.class_name else "")
            if e.kind == "pipeline":
                what = f"a pipeline folder without a {PIPELINE_SUBFOLDERS[slot]} component"
            return ModelLoadError(e.path, f"is {what}, but {slot} needs {SLOT_CLASSES[slot]} and no other path provides it")
        kinds = "; ".join(f"{e.path} ({e.kind})" for e in described)
        return ModelLoadError(None, f"no given path provides {slot} ({SLOT_CLASSES[slot]}); given: {kinds}")

    def resolve_many(self, slots: Iterable[str]) -> dict[str, ComponentSource]:
        return {slot: self.resolve(slot) for slot in _normalise_slots(slots)}


def _tokenizer_class(folder: Path) -> str:
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        return str(_read_json(cfg).get("tokenizer_class", "")) or SLOT_CLASSES["tokenizer"]
    return SLOT_CLASSES["tokenizer"]


def _normalise_slots(slots: Iterable[str] | str) -> list[str]:
    if isinstance(slots, str):
        slots = [s for s in slots.replace(",", " ").split() if s]
    out = []
    for slot in slots:
        if slot not in ALL_SLOTS:
            raise ModelLoadError(slot, f"unknown model slot (expected one of {', '.join(ALL_SLOTS)})")
        if slot not in out:
            out.append(slot)
    return out


def resolve_components(slots: Iterable[str] | str = ALL_SLOTS, model_paths: Any = None,
                       model_id_with_origin_paths: Any = None, tokenizer_path: Any = None,
                       cache_dir: Any = None) -> dict[str, ComponentSource]:
    """Find (without loading) where each requested slot comes from."""
    sources = ModelSources(model_paths, model_id_with_origin_paths, tokenizer_path, cache_dir)
    return sources.resolve_many(slots)


# --------------------------------------------------------------------------------------------
# Files of a slot (for hashing)


def component_files(source: ComponentSource, include_config: bool = True) -> list[Path]:
    """The files the loader of one component reads: weights (and configs), sorted.

    Raises ModelLoadError when a model folder has no safetensors weights.
    """
    if source.path is None:
        return []
    folder = source.path
    files: list[Path] = []
    if source.slot in MODEL_SLOTS:
        if include_config:
            files.append(folder / "config.json")
            if (folder / "generation_config.json").is_file():
                files.append(folder / "generation_config.json")
        weights: list[Path] = []
        for index_name in _WEIGHT_INDEX_FILES:
            index_file = folder / index_name
            if index_file.is_file():
                weight_map = _read_json(index_file).get("weight_map", {})
                if not isinstance(weight_map, dict) or not weight_map:
                    raise ModelLoadError(index_file, "weight index has no weight_map")
                weights += [folder / name for name in sorted(set(weight_map.values()))]
                if include_config:
                    files.append(index_file)
                break
        else:
            weights = [folder / name for name in _WEIGHT_FILES if (folder / name).is_file()]
        if not weights:
            raise ModelLoadError(folder, f"no safetensors weights for {source.slot} "
                                         f"(expected {' or '.join(_WEIGHT_FILES)} or a sharded index)")
        missing = [w for w in weights if not w.is_file()]
        if missing:
            raise ModelLoadError(missing[0], "weight shard listed in the index is missing")
        files += weights
    elif source.slot == "tokenizer":
        files = [folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()]
    elif source.slot == "scheduler":
        files = [folder / "scheduler_config.json"] if include_config else []
    return sorted(files)


def model_weight_files(slot: str, model_paths: Any = None, model_id_with_origin_paths: Any = None,
                       tokenizer_path: Any = None, cache_dir: Any = None,
                       include_config: bool = True) -> list[Path]:
    """The files the given slot would read (safetensors weights, plus configs by default).

    For hashing weights into cache fingerprints. The default scheduler yields [].
    """
    source = resolve_components([slot], model_paths, model_id_with_origin_paths, tokenizer_path, cache_dir)[slot]
    return component_files(source, include_config=include_config)


# --------------------------------------------------------------------------------------------
# Loading


def _dtype(torch_dtype: Any):
    import torch

    if torch_dtype is None:
        return torch.float32
    if isinstance(torch_dtype, str):
        value = getattr(torch, torch_dtype.replace("torch.", ""), None)
        if not isinstance(value, torch.dtype):
            raise ModelLoadError(torch_dtype, "unknown torch dtype")
        return value
    return torch_dtype


def default_scheduler():
    """A FlowMatchEulerDiscreteScheduler with Qwen-Image's published configuration."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)


def load_component(source: ComponentSource, torch_dtype: Any = None):
    """Load one resolved component. Model weights are read from safetensors only."""
    dtype = _dtype(torch_dtype)
    slot, folder = source.slot, source.path
    if folder is None:
        return default_scheduler()
    if slot in MODEL_SLOTS:
        component_files(source, include_config=False)  # clean error when weights are missing
    try:
        if slot == "dit":
            from diffusers import QwenImageTransformer2DModel

            model = QwenImageTransformer2DModel.from_pretrained(
                str(folder), torch_dtype=dtype, use_safetensors=True, local_files_only=True)
        elif slot == "vae":
            from diffusers import AutoencoderKLQwenImage

            model = AutoencoderKLQwenImage.from_pretrained(
                str(folder), torch_dtype=dtype, use_safetensors=True, local_files_only=True)
        elif slot == "text_encoder":
            from transformers import Qwen2_5_VLForConditionalGeneration

            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                str(folder), dtype=dtype, use_safetensors=True, local_files_only=True)
        elif slot == "tokenizer":
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        elif slot == "scheduler":
            from diffusers import FlowMatchEulerDiscreteScheduler

            return FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder), local_files_only=True)
        else:  # pragma: no cover - slots are validated earlier
            raise ModelLoadError(slot, "unknown model slot")
    except ModelLoadError:
        raise
    except Exception as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(folder, f"cannot load {slot} ({SLOT_CLASSES[slot]}): {type(exc).__name__}"
                                     + (f": {detail}" if detail else "")) from None
    model.eval()
    return model


def load_components(slots: Iterable[str] | str, model_paths: Any = None, model_id_with_origin_paths: Any = None,
                    tokenizer_path: Any = None, cache_dir: Any = None, torch_dtype: Any = None) -> dict[str, Any]:
    """Load only the requested slots; return {slot: model / tokenizer / scheduler}.

    slots: names from ALL_SLOTS ("dit", "vae", "text_encoder", "tokenizer", "scheduler"), as an
    iterable or a comma/space separated string. torch_dtype: a torch.dtype or its name
    (default float32). Models are returned in eval mode on the CPU.
    """
    sources = ModelSources(model_paths, model_id_with_origin_paths, tokenizer_path, cache_dir)
    resolved = sources.resolve_many(slots)  # resolve everything before the (slow) loading
    return {slot: load_component(source, torch_dtype) for slot, source in resolved.items()}

"""Recognising model folders: a family's slots as lookup tables, what a folder (or a file in one) holds, and
the files a component's loader reads.

Folders are classified from their small config files only (diffusers `_class_name`, transformers
`model_type` / `architectures`, tokenizer and processor configs); weights are never opened here.
Every problem is a :class:`ModelLoadError`, whose message is one line naming the path and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from unitgraph.errors import UnitgraphError, path_missing
from unitgraph.userfiles import parse_user_json

from ..family import ModelSlot

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "spiece.model")
_WEIGHT_INDEX_FILES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
_WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
# A processor folder: these configs beside its tokenizer files (preprocessor_config.json marks one)
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                    "chat_template.json")
SINGLE_FILE_PROBLEM = ("is a single-file checkpoint (the original release layout, no config.json beside it), which "
                       "unitgraph does not read; give the model's diffusers/transformers folder (its transformer/, vae/, "
                       "text_encoder/ ... subfolders)")
# Read once where the flags are parsed (config.ModelConfig); named in messages.
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


class UnreadableLayout(ModelLoadError):
    """A file or folder a command names that unitgraph cannot read in its layout (a single file of no known
    format, a pickle, a class it does not know): collected, and reported with every other such file in one line
    (models/release.py)."""


@dataclass(frozen=True)
class ComponentSource:
    """Where one slot comes from.

    path is the component folder (None only for the built-in default scheduler); class_name
    is the class its config names; origin is the user-given entry it was found through. A release single file
    (models/release.py) is `path` itself, read in the `single_file` layout (the family's format object), with the
    diffusers config.json of the same component found `beside` it, if any.
    """

    slot: str
    path: Path | None
    class_name: str
    origin: str = ""
    single_file: Any = field(default=None, compare=False)
    beside: Path | None = None

    @property
    def is_default(self) -> bool:
        return self.path is None


@dataclass
class FolderEntry:
    """One user-given location, classified."""

    origin: str
    path: Path
    kind: str  # "pipeline", a slot name
    class_name: str = ""
    model_id: str | None = None  # modelscope model id, when resolved through modelscope
    subfolders: dict[str, str] = field(default_factory=dict)  # pipeline: slot -> subfolder
    absent: frozenset = frozenset()  # pipeline: slots its model_index.json declares it has none of ([null, null])
    single_file: Any = None  # a release single file: the format it is read in (path is the file)
    beside: Path | None = None  # ... and the diffusers config.json of the same component beside it


def shorten(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _ConfigJSONError(UnitgraphError):
    """parse_user_json's refusal, turned into a ModelLoadError naming the file."""


def read_json_file(path: Path) -> dict:
    """A model folder's small JSON file (model_index.json, config.json, ...) as an object, parsed as every user file
    is (unitgraph/userfiles.py: strict JSON, at most MAX_DEPTH levels of nesting, no NaN or Infinity, no key given
    twice), so that a hostile file is one line, never a RecursionError or a NaN size."""
    try:
        value = parse_user_json(path.read_text(encoding="utf-8"), str(path), _ConfigJSONError)
    except FileNotFoundError:
        raise ModelLoadError(path, "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"cannot read JSON ({type(exc).__name__}: {exc})") from None
    except _ConfigJSONError as exc:
        raise ModelLoadError(path, f"cannot read JSON ({exc.message})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(path, "is not a JSON object")
    return value


# --------------------------------------------------------------------------------------------
# A family's slots, as lookup tables


class SlotTable:
    """The slots of one family, indexed the ways folders are recognised: pipeline subfolder,
    diffusers `_class_name`, transformers `model_type` / `architectures`, tokenizer class."""

    def __init__(self, slots: Sequence[ModelSlot]):
        self.slots: dict[str, ModelSlot] = {s.name: s for s in slots}
        # several slots may share a subfolder (two text-encoder classes a family's releases keep in text_encoder/):
        # by_subfolder names the first, shared_subfolder all of them; the folder's config tells them apart
        self.shared_subfolder: dict[str, tuple[str, ...]] = {}
        for s in slots:
            self.shared_subfolder[s.subfolder] = (*self.shared_subfolder.get(s.subfolder, ()), s.name)
        self.by_subfolder = {sub: names[0] for sub, names in self.shared_subfolder.items()}
        self.by_class = {c: s.name for s in slots if s.kind != "tokenizer" for c in s.class_names}
        self.by_model_type = {t: s.name for s in slots for t in s.model_types}
        self.tokenizers = [s.name for s in slots if s.kind == "tokenizer"]
        self.processors = [s.name for s in slots if s.kind == "processor"]
        self.text_encoders = [s.name for s in slots if s.kind == "model" and s.tokenizer is not None]
        self.denoiser = next(s.name for s in slots if s.kind == "model")  # a family declares its denoiser first

    def __getitem__(self, name: str) -> ModelSlot:
        return self.slots[name]

    def __contains__(self, name: object) -> bool:
        return name in self.slots

    def expected(self, slot: str) -> str:
        return self.slots[slot].class_name

    def of_config(self, config: Mapping[str, Any]) -> str | None:
        """The slot a component's config.json names: by its diffusers `_class_name`, else by its transformers
        `model_type` or `architectures`; None when it names none of the family's."""
        class_name = config.get("_class_name")
        if class_name:
            return self.by_class.get(class_name)
        architectures = [str(a) for a in config.get("architectures") or []]
        return self.by_model_type.get(config.get("model_type")) or next(
            (self.by_class[a] for a in architectures if a in self.by_class), None)

    def encoder_of(self, tokenizer: str) -> str | None:
        """The text encoder slot a tokenizer slot is paired with."""
        return next((s.name for s in self.slots.values() if s.tokenizer == tokenizer), None)

    def processor_slot(self, class_name: str) -> str:
        """The processor slot for a processor class (the only one, when the family has one)."""
        for name in self.processors:
            if class_name in self.slots[name].class_names:
                return name
        return self.processors[0]

    def tokenizer_slot(self, class_name: str) -> str:
        """The tokenizer slot for a tokenizer class (the only one, when the family has one)."""
        for name in self.tokenizers:
            if class_name in self.slots[name].class_names:
                return name
        return self.tokenizers[0] if self.tokenizers else "tokenizer"

    def check(self, slots: Iterable[str] | str) -> list[str]:
        if isinstance(slots, str):
            slots = [s for s in slots.replace(",", " ").split() if s]
        out = []
        for slot in slots:
            if slot not in self.slots:
                raise ModelLoadError(slot, f"unknown model slot (expected one of {', '.join(self.slots)})")
            if slot not in out:
                out.append(slot)
        return out


# --------------------------------------------------------------------------------------------
# Classifying folders


def classify_folder(path: Path | str, table: SlotTable, origin: str | None = None) -> FolderEntry:
    """Detect what a folder (or a weight file inside one) holds, from its config files only."""
    p = Path(path).expanduser()
    origin = origin or str(path)
    if not p.exists():
        raise ModelLoadError(p, f"path {path_missing(p)}")  # a symlink loop is said as one, not as missing
    if p.is_file():
        if p.suffix in (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt"):
            if not any((p.parent / name).is_file() for name in ("config.json", "model_index.json", "scheduler_config.json")):
                raise UnreadableLayout(p, SINGLE_FILE_PROBLEM)
            entry = classify_folder(p.parent, table, origin)
            if entry.kind == "pipeline":
                raise ModelLoadError(p, "is a file at the top of a pipeline folder; give the folder itself")
            return entry
        raise ModelLoadError(p, "is a file, not a diffusers/transformers model folder")

    if (p / "model_index.json").is_file():
        index = read_json_file(p / "model_index.json")
        subfolders, absent = {}, set()
        for key, value in index.items():
            if key.startswith("_") or not isinstance(value, list):
                continue
            for slot in table.shared_subfolder.get(key, ()):
                if value == [None, None]:  # diffusers' record of an optional component the pipeline goes without
                    absent.add(slot)
                else:
                    subfolders[slot] = key
        return FolderEntry(origin=origin, path=p, kind="pipeline",
                      class_name=str(index.get("_class_name", "")), subfolders=subfolders, absent=frozenset(absent))

    if (p / "config.json").is_file():
        config = read_json_file(p / "config.json")
        class_name = config.get("_class_name")
        models = [s for s in table.slots.values() if s.kind == "model"]
        slot = table.of_config(config)
        if class_name:
            if slot is None:
                expected = " or ".join(s.class_name for s in models if s.library == "diffusers")
                raise UnreadableLayout(p, f"unsupported diffusers model class {class_name} (expected {expected})")
            return FolderEntry(origin=origin, path=p, kind=slot, class_name=class_name)
        architectures = [str(a) for a in config.get("architectures") or []]
        model_type = config.get("model_type")
        if architectures or model_type:
            if slot is not None:
                return FolderEntry(origin=origin, path=p, kind=slot,
                              class_name=architectures[0] if architectures else table.expected(slot))
            expected = " or ".join(s.class_name for s in models if s.library == "transformers")
            raise UnreadableLayout(p, f"unsupported transformers model {architectures[0] if architectures else model_type} "
                                      f"(expected {expected})")
        raise ModelLoadError(p, "config.json names neither a diffusers _class_name nor transformers architectures/model_type")

    if (p / "scheduler_config.json").is_file():
        config = read_json_file(p / "scheduler_config.json")
        class_name = str(config.get("_class_name", ""))
        slot = table.by_class.get(class_name)
        if slot is None or table[slot].kind != "scheduler":
            expected = " or ".join(s.class_name for s in table.slots.values() if s.kind == "scheduler")
            raise ModelLoadError(p, f"unsupported scheduler {class_name or '(no _class_name)'} (expected {expected})")
        return FolderEntry(origin=origin, path=p, kind=slot, class_name=class_name)

    if table.processors and is_processor_folder(p):
        class_name = processor_class_of(p)
        slot = table.processor_slot(class_name)
        return FolderEntry(origin=origin, path=p, kind=slot, class_name=class_name or table.expected(slot))

    if is_tokenizer_folder(p):
        class_name = tokenizer_class_of(p)
        slot = table.tokenizer_slot(class_name)
        return FolderEntry(origin=origin, path=p, kind=slot, class_name=class_name or table.expected(slot))

    raise ModelLoadError(p, "not a diffusers/transformers model folder (no model_index.json, config.json, "
                            "scheduler_config.json or tokenizer files)")


def is_tokenizer_folder(p: Path) -> bool:
    return p.is_dir() and ((p / "tokenizer_config.json").is_file() or (p / "tokenizer.json").is_file())


def tokenizer_class_of(folder: Path) -> str:
    cfg = folder / "tokenizer_config.json"
    return str(read_json_file(cfg).get("tokenizer_class", "")) if cfg.is_file() else ""


def is_processor_folder(p: Path) -> bool:
    return p.is_dir() and (p / "preprocessor_config.json").is_file()


def processor_class_of(folder: Path) -> str:
    for name in ("processor_config.json", "preprocessor_config.json"):
        cfg = folder / name
        if cfg.is_file():
            value = read_json_file(cfg).get("processor_class")
            if value:
                return str(value)
    return ""


# --------------------------------------------------------------------------------------------
# Sizes a config.json may ask for (before anything is built from it)

# No released model comes near these: a config past one is refused before a layer is allocated (a config with
# num_layers 100000 would otherwise build layers until memory runs out).
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 16
MAX_VOCAB = 1 << 21
_LAYER_KEYS = ("num_layers", "num_hidden_layers", "num_single_layers", "n_layers", "depth", "num_blocks",
               "num_res_blocks", "encoder_layers", "decoder_layers", "num_decoder_layers", "num_encoder_layers")
_WIDTH_PARTS = ("hidden_size", "_dim", "d_model", "d_ff", "d_kv", "intermediate_size", "num_attention_heads",
                "num_heads", "channels", "embed_dim", "width")
# What a size's key ends with: its value must be a whole number (or a list of them; null where the library takes
# null for "none" or "derive it", as diffusers' UNets take num_attention_heads null). Keys that merely hold such a
# part (encoder_hid_dim_type, ffn_dim_multiplier) are other settings.
_SIZE_ENDINGS = ("hidden_size", "_dim", "d_model", "d_ff", "d_kv", "intermediate_size", "heads", "channels",
                 "embed_dim", "patch_size", "patch_size_t", "vocab_size")
_HEAD_KEYS = ("num_attention_heads", "num_heads", "n_heads", "num_key_value_heads")  # at least 1 each
_HEAD_DIM_KEYS = ("attention_head_dim", "head_dim", "d_kv")
_CHANNEL_KEYS = ("in_channels", "num_channels", "in_chans")


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    return shorten(json.dumps(value), 40)


def _size_type_problem(key: str, name: str, value: Any) -> str | None:
    """A size that is no size: a float, string, boolean, negative, or null where a count is needed."""
    layers = key in _LAYER_KEYS
    if not layers and not key.endswith(_SIZE_ENDINGS):
        return None
    least = 1 if key in _HEAD_KEYS or key in _HEAD_DIM_KEYS or "patch_size" in key else 0
    what = "a layer count" if layers else "a size"
    items = value if isinstance(value, list) else [value]
    if value is None and not layers:
        return None
    if items and all(_is_whole(v) and v >= least for v in items):
        return None
    return f"{name} {_shown(value)} is not {what} (a whole number of at least {least})"


def _biggest(value: Any) -> int | None:
    items = value if isinstance(value, list) else [value]
    return max(items) if items and all(_is_whole(v) for v in items) else None


def _product_problem(config: dict, where: str) -> str | None:
    """Sizes that pass each bound alone but not together: heads x head_dim (the attention's width), and a patch's
    elements (its sides, squared for one side given, times the input channels) past MAX_WIDTH."""
    prefix = f"{where}." if where else ""
    for heads in _HEAD_KEYS:
        for dim in _HEAD_DIM_KEYS:
            h, d = _biggest(config.get(heads)), _biggest(config.get(dim))
            if h is not None and d is not None and h * d > MAX_WIDTH:
                return (f"{prefix}{heads} {h} x {prefix}{dim} {d} = {h * d} is wider than any model is "
                        f"(at most {MAX_WIDTH})")
    channels = max([c for c in (_biggest(config.get(k)) for k in _CHANNEL_KEYS) if c is not None] or [1])
    for key, value in config.items():
        side = _biggest(value) if "patch_size" in key else None
        if side is None:
            continue
        sides = len(value) if isinstance(value, list) and len(value) > 1 else 2
        elements = side ** sides * max(channels, 1)
        if elements > MAX_WIDTH:
            return (f"{prefix}{key} {_shown(value)} makes patches of {elements} elements ({side}^{sides} x {channels} "
                    f"channels), more than any model has (at most {MAX_WIDTH})")
    return None


def config_size_problem(config: Any, where: str = "") -> str | None:
    """The first size in a config (nested configs too) that is no size or beyond what any model has, as words; None
    when all are whole numbers in bounds: layer counts up to MAX_LAYERS, widths up to MAX_WIDTH (heads x head_dim and a
    patch's elements too), vocabularies up to MAX_VOCAB, head counts, head dimensions and patch sizes at least 1."""
    if isinstance(config, dict):
        for key, value in config.items():
            name = f"{where}.{key}" if where else key
            if isinstance(value, dict):
                problem = config_size_problem(value, name)
                if problem:
                    return problem
                continue
            problem = _size_type_problem(key, name, value)
            if problem:
                return problem
            biggest = _biggest(value)
            if biggest is not None and not isinstance(value, bool):
                if key in _LAYER_KEYS and biggest > MAX_LAYERS:
                    return f"{name} {biggest} is more layers than any model has (at most {MAX_LAYERS})"
                if key == "vocab_size" and biggest > MAX_VOCAB:
                    return f"{name} {biggest} is a larger vocabulary than any model has (at most {MAX_VOCAB})"
                if any(part in key for part in _WIDTH_PARTS) and biggest > MAX_WIDTH:
                    return f"{name} {biggest} is wider than any model is (at most {MAX_WIDTH})"
        return _product_problem(config, where)
    return None


def check_config_sizes(folder: Path) -> None:
    """ModelLoadError naming config.json when the model it describes is beyond any model's size."""
    path = Path(folder) / "config.json"
    if path.is_file():
        problem = config_size_problem(read_json_file(path))
        if problem:
            raise ModelLoadError(path, f"{problem}; refusing to build it")


# --------------------------------------------------------------------------------------------
# Files of a slot (for hashing)


def slot_config_file(source: ComponentSource) -> Path:
    if source.path is None or not (source.path / "config.json").is_file():
        raise ModelLoadError(source.path, f"no config.json for {source.slot}")
    return source.path / "config.json"


def component_files(source: ComponentSource, kind: str, include_config: bool = True) -> list[Path]:
    """The files the loader of one component reads: weights (and configs), sorted.

    Raises ModelLoadError when a model folder has no safetensors weights.
    """
    if source.path is None:
        return []
    if source.single_file is not None:  # a release single file: the file, and the config read beside it
        return sorted([source.path, *([source.beside] if include_config and source.beside else [])])
    folder = source.path
    files: list[Path] = []
    if kind == "model":
        if include_config:
            files.append(folder / "config.json")
            if (folder / "generation_config.json").is_file():
                files.append(folder / "generation_config.json")
        weights: list[Path] = []
        for index_name in _WEIGHT_INDEX_FILES:
            index_file = folder / index_name
            if index_file.is_file():
                weight_map = read_json_file(index_file).get("weight_map", {})
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
    elif kind == "tokenizer":
        files = [folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()]
    elif kind == "processor":  # its configs and its tokenizer's files
        files = [folder / name for name in (*_PROCESSOR_FILES, *_TOKENIZER_FILES) if (folder / name).is_file()]
    elif include_config:
        files = [folder / name for name in ("scheduler_config.json", "preprocessor_config.json",
                                             "processor_config.json") if (folder / name).is_file()]
    return sorted(files)

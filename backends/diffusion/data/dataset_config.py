"""Several datasets in one run: the `--dataset_config` file (TOML or JSON) and what it says of each dataset.

The file holds a list `datasets` of tables (TOML `[[datasets]]`, JSON `{"datasets": [{...}, ...]}`), each:

* `name` (required, unique; letters, digits, `_`, `-` and `.`): what messages, the cache's manifest and the seeded
  draws call the dataset;
* `base_path` (required: a folder) and `metadata` (required: a csv, json or jsonl file, as DiffSynth reads them;
  DiffSynth has no default metadata name either): a relative path is taken from the config file's folder;
* `repeats` (an integer, at least 1; default 1: each sample that many times an epoch) or `weight` (a number above 0:
  round(weight x its samples) draws an epoch, at least one: floor(weight) whole passes and a subset drawn anew each
  epoch from the seeded stream). Not both;
* optionally its own `max_pixels`, `height`/`width` (together), `data_file_keys` (a list or a comma-separated
  string) and `num_frames` (4k+1), in place of the run's flags for this dataset only. A dataset that gives a size
  (max_pixels or height/width) trains at that size whatever the run's --height/--width say;
* `validation = true` (at most one table, without `repeats`, `weight` or settings of its own): the held-out samples
  of the held-out loss, as `--validation_dataset` names them, cached by stage 1 apart and never trained
  (`config_held_out`); the other tables are the training datasets (`read_dataset_config`), one at least.

Any problem is one `BackendError` naming the file and, where there is one, the dataset: an unknown key, a missing
folder or metadata file, repeats below 1, a weight of 0 or less, both repeats and weight, two datasets of one name.
The file is read with the limits of every user file (`unitgraph.userfiles`: size, nesting, duplicate keys). Stage 2
reads it with `check_files=False`: it trains from the cache, and the datasets' folders may be gone. No torch here.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from unitgraph.errors import path_missing
from unitgraph.userfiles import parse_user_json, read_user_text

from ..errors import BackendError

MAX_CONFIG_BYTES = 1024 * 1024  # a config lists datasets, never samples
MAX_DATASETS = 1000
MAX_DEPTH = 8  # datasets -> table -> data_file_keys: three levels are needed
MAX_REPEATS = 100_000  # an epoch is a list of (sample, repeat) draws: past this the list alone is gigabytes
MAX_FRAMES = 1025  # as --num_frames (args.MAX_FRAMES)
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
METADATA_SUFFIXES = (".csv", ".json", ".jsonl")
KEYS = ("name", "base_path", "metadata", "repeats", "weight", "max_pixels", "height", "width", "data_file_keys",
        "num_frames", "validation")
# the keys that change what stage 1 computes for a dataset's samples (its entries' keys), as against its share
SHAPING = ("max_pixels", "height", "width", "data_file_keys", "num_frames")


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset of a config: where its samples are, its share of an epoch, and the flags it gives its own value."""

    name: str
    base_path: str
    metadata: str
    repeats: int = 1
    weight: Optional[float] = None
    max_pixels: Optional[int] = None
    height: Optional[int] = None
    width: Optional[int] = None
    data_file_keys: Optional[tuple[str, ...]] = None
    num_frames: Optional[int] = None
    validation: bool = False  # the held-out samples (`validation = true`), never a training share

    def record(self) -> dict[str, Any]:
        """The spec as JSON (what a cache's manifest records), the values it does not give left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if (f.name == "repeats" and self.weight is not None) or (f.name == "validation" and not value):
                continue
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def shaping(self) -> dict[str, Any]:
        """The values of this dataset that shape its cache entries (SHAPING), the unset ones left out."""
        return {k: v for k, v in self.record().items() if k in SHAPING}

    def share(self) -> dict[str, Any]:
        """Its part of an epoch: {"repeats": r} or {"weight": w}."""
        return {"weight": self.weight} if self.weight is not None else {"repeats": self.repeats}


def read_dataset_config(path: str | Path, check_files: bool = True) -> tuple[DatasetSpec, ...]:
    """The training datasets of a --dataset_config file, checked; `check_files` also checks that every folder and
    metadata file is there (stage 2, which reads the cache, does not need them)."""
    return tuple(spec for spec in read_all_datasets(path, check_files) if not spec.validation)


def config_held_out(path: str | Path, check_files: bool = True) -> Optional[DatasetSpec]:
    """The table of a --dataset_config file marked `validation = true` (the held-out samples), or None."""
    return next((spec for spec in read_all_datasets(path, check_files) if spec.validation), None)


def read_all_datasets(path: str | Path, check_files: bool = True) -> tuple[DatasetSpec, ...]:
    """Every table of a --dataset_config file, the held-out one included, checked."""
    path = Path(path)
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise BackendError(f"a dataset config is a .toml or .json file, not {suffix or 'a file without a suffix'}",
                           source=source)
    text = read_user_text(path, BackendError, f"a {suffix[1:].upper()} dataset config", max_bytes=MAX_CONFIG_BYTES)
    data = parse_config_text(text, suffix, source)
    return parse_datasets(data, source, path.parent, check_files)


def parse_config_text(text: str, suffix: str, source: str) -> Any:
    """The parsed document: TOML by tomllib (a key given twice is its error), JSON by the user-file reader."""
    if suffix == ".json":
        return parse_user_json(text, source, BackendError, max_depth=MAX_DEPTH)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BackendError(f"malformed TOML: {exc}", source=source) from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise BackendError(f"TOML value out of range: {str(exc).split(';')[0]}", source=source) from None
    except RecursionError:
        raise BackendError(f"TOML nested deeper than {MAX_DEPTH} levels", source=source) from None
    if _depth(data, MAX_DEPTH + 1) > MAX_DEPTH:
        raise BackendError(f"TOML nested deeper than {MAX_DEPTH} levels", source=source)
    return data


def _depth(value: Any, stop: int) -> int:
    """Levels of nested lists and tables (0 for a scalar), counting no further than `stop`."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level and depth < stop:
        depth += 1
        level = [c for item in level for c in (item.values() if isinstance(item, dict) else item)
                 if isinstance(c, (dict, list))]
    return depth


def parse_datasets(data: Any, source: str, folder: Path, check_files: bool = True) -> tuple[DatasetSpec, ...]:
    """The datasets of a parsed config document (paths relative to `folder`)."""
    if not isinstance(data, dict):
        raise BackendError("a dataset config holds a list `datasets` of tables", source=source)
    unknown = sorted(set(data) - {"datasets"})
    if unknown:
        raise BackendError(f"unknown key {unknown[0]!r} at the top (a dataset config holds only `datasets`)",
                           source=source)
    tables = data.get("datasets")
    if not isinstance(tables, list) or not tables:
        raise BackendError("`datasets` must be a non-empty list of tables, one per dataset", source=source)
    if len(tables) > MAX_DATASETS:
        raise BackendError(f"{len(tables)} datasets, more than the {MAX_DATASETS} a config may list", source=source)
    specs: list[DatasetSpec] = []
    for n, table in enumerate(tables, start=1):
        spec = parse_dataset(table, n, source, folder, check_files)
        if any(s.name == spec.name for s in specs):
            raise BackendError(f"dataset {spec.name!r} is named twice (names must be unique)", source=source)
        specs.append(spec)
    held = [s.name for s in specs if s.validation]
    if len(held) > 1:
        raise BackendError(f"datasets {held[0]!r} and {held[1]!r} are both `validation = true`: one held-out dataset "
                           "at most", source=source)
    if len(held) == len(specs):
        raise BackendError("every dataset is `validation = true`: a config needs one training dataset at least",
                           source=source)
    return tuple(specs)


def parse_dataset(table: Any, n: int, source: str, folder: Path, check_files: bool = True) -> DatasetSpec:
    """One dataset's table, checked (`n`: its place in the list, for a table without a usable name)."""
    if not isinstance(table, dict):
        raise BackendError(f"datasets[{n}] must be a table (name, base_path, metadata, ...)", source=source)
    name = table.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 70 else repr(name)[:70] + "..."
        raise BackendError(f"datasets[{n}]: `name` must be 1 to 64 letters, digits, '_', '-' or '.', got {shown}",
                           source=source)
    where = f"dataset {name!r}"

    def fail(message: str) -> BackendError:
        return BackendError(f"{where}: {message}", source=source)

    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise fail(f"unknown key {unknown[0]!r} (keys: {', '.join(KEYS)})")
    base_path = _path(table, "base_path", folder, fail)
    metadata = _path(table, "metadata", folder, fail)
    if Path(metadata).suffix.lower() not in METADATA_SUFFIXES:
        raise fail(f"metadata {metadata!r} is not a csv, json or jsonl file")
    if check_files:
        for key, path, folder_wanted in (("base_path", base_path, True), ("metadata", metadata, False)):
            problem = _not_there(Path(path), folder_wanted)
            if problem:
                raise fail(f"{key} {path} {problem}")
    validation = table.get("validation", False)
    if not isinstance(validation, bool):
        raise fail(f"`validation` must be true or false, got {validation!r}")
    if validation and ("repeats" in table or "weight" in table):
        raise fail("a held-out dataset (`validation = true`) is never trained: it takes no `repeats` or `weight`")
    own = [key for key in SHAPING if key in table]
    if validation and own:  # as --validation_dataset: its samples are made as the run's own
        raise fail(f"a held-out dataset (`validation = true`) is made at the run's settings: it takes no `{own[0]}`")
    if "repeats" in table and "weight" in table:
        raise fail("give `repeats` or `weight`, not both")
    repeats = _integer(table, "repeats", 1, MAX_REPEATS, fail, default=1)
    weight = None
    if "weight" in table:
        weight = table["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 < weight <= MAX_REPEATS:
            raise fail(f"`weight` must be a number above 0 (at most {MAX_REPEATS}), got {weight!r}")
        weight = float(weight)
    max_pixels = _integer(table, "max_pixels", 1, None, fail)
    height, width = _integer(table, "height", 16, None, fail), _integer(table, "width", 16, None, fail)
    if (height is None) != (width is None):
        raise fail("`height` and `width` go together (or give `max_pixels`)")
    for key, value in (("height", height), ("width", width)):
        if value is not None and value % 16:
            raise fail(f"`{key}` must be a positive multiple of 16, got {value}")
    num_frames = _integer(table, "num_frames", 1, MAX_FRAMES, fail)
    if num_frames is not None and (num_frames - 1) % 4:
        raise fail(f"`num_frames` must be 4k+1 (1, 5, 9, ..., 81), got {num_frames}")
    return DatasetSpec(name=name, base_path=base_path, metadata=metadata, repeats=repeats, weight=weight,
                       max_pixels=max_pixels, height=height, width=width,
                       data_file_keys=_file_keys(table, fail), num_frames=num_frames, validation=validation)


def _path(table: dict[str, Any], key: str, folder: Path, fail: Any) -> str:
    value = table.get(key)
    if value is None:
        raise fail(f"`{key}` is required")
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise fail(f"`{key}` must be a path, got {value!r}")
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # ~user of no such user
        raise fail(f"`{key}` {value!r}: its home folder is unknown") from None
    return str(path if path.is_absolute() else folder / path)


def _not_there(path: Path, folder: bool) -> Optional[str]:
    """Why `path` is not the folder (or regular file) wanted, in words, or None."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path_missing(path)
    except (OSError, ValueError) as exc:  # a name too long, a loop, no permission, a NUL byte
        return f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    if folder and not stat.S_ISDIR(mode):
        return "is not a folder"
    if not folder and not stat.S_ISREG(mode):
        return "is not a file"
    return None


def _integer(table: dict[str, Any], key: str, low: int, high: Optional[int], fail: Any, default: Any = None) -> Any:
    if key not in table:
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise fail(f"`{key}` must be an integer {bound}, got {value!r}")
    return value


def _file_keys(table: dict[str, Any], fail: Any) -> Optional[tuple[str, ...]]:
    if "data_file_keys" not in table:
        return None
    value = table["data_file_keys"]
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(k, str) for k in items):
        raise fail(f"`data_file_keys` must be a list of column names or a comma-separated string, got {value!r}")
    keys = tuple(dict.fromkeys(k.strip() for k in items if k.strip()))
    if not keys:
        raise fail("`data_file_keys` names no column")
    return keys


HELD_OUT = "validation"  # the name the --validation_dataset samples go by (never a training share's)


def held_out_dataset(path: str | Path, check_files: bool = True) -> DatasetSpec:
    """--validation_dataset METADATA as a dataset: its file columns are relative to the metadata file's folder."""
    metadata = Path(path).expanduser()
    if metadata.suffix.lower() not in METADATA_SUFFIXES:
        raise BackendError("--validation_dataset is a metadata file (csv, json or jsonl)", source=str(path))
    if check_files:
        problem = _not_there(metadata, folder=False)
        if problem:
            raise BackendError(f"--validation_dataset: the metadata file {problem}", source=str(path))
    return DatasetSpec(name=HELD_OUT, base_path=str(metadata.parent), metadata=str(metadata))


def config_columns(path: Optional[str]) -> Optional[set[str]]:
    """The metadata columns every dataset of a config has (a pipeline must fit each), or None when the file cannot be
    read (the run's reading of it then says why, in one line)."""
    from .dataset import metadata_columns

    if not path:
        return None
    try:
        specs = read_dataset_config(path)
    except BackendError:
        return None
    columns = [metadata_columns(spec.metadata) for spec in specs]
    if any(c is None for c in columns):
        return None
    return set.intersection(*columns)

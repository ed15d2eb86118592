"""DiffSynth-style datasets: a metadata file (csv, json or jsonl) beside the files it names.

Each metadata row is one sample. Columns listed in `--data_file_keys` (default `image`) name files
relative to `--dataset_base_path`; images are loaded as RGB PIL images (the `ShapeChecker` unit
resizes them). The pipeline receives `image` and `prompt`, plus the columns named by
`--extra_inputs` (e.g. `edit_image`); dataset params the pipeline reads that the dataset does not
provide are None.

A sample's identity is its metadata row plus the bytes of its files: `sample_id(i)` hashes both,
so a random draw follows the sample, not its position. What a cache entry depends on is narrower:
`key_inputs(i, params)` describes only the values stage 1 reads (file bytes, typed fields).

Per-sample problems that a cheap look finds (a missing file, a file that is not an image, an image
smaller than 16 px) raise `SampleError`: the stages skip such a sample with a warning and count it.
Anything else stops the run (docs/cache.md).
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from .args import BackendError

REQUIRED_COLUMNS = ("image", "prompt")
IMAGE_PARAMS = ("image", "edit_image")
# Typed dataset params: metadata files (csv in particular) carry strings.
PARAM_TYPES = {"seed": int, "num_inference_steps": int, "cfg_scale": float}
MIN_IMAGE_SIDE = 16


class SampleError(BackendError):
    """One sample cannot be used (missing file, not an image, too small): skipped with a warning."""

    def __init__(self, message: str, *, index: int, source: str | None = None):
        self.index = index
        super().__init__(message, source=source)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a csv, json (a list of objects) or jsonl file; a BackendError naming the file otherwise."""
    path = Path(path)
    if not path.exists():
        raise BackendError("metadata file does not exist", source=str(path))
    if path.is_dir():
        raise BackendError("is a directory, expected a metadata file (csv, json or jsonl)", source=str(path))
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json", ".jsonl"):
        raise BackendError(f"unsupported metadata format {suffix or '(no suffix)'} (use csv, json or jsonl)", source=str(path))
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise BackendError(f"cannot read metadata: {exc}", source=str(path)) from None
    rows: Any
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None:
            raise BackendError("empty csv (no header row)", source=str(path))
        rows = [dict(r) for r in reader]
    elif suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BackendError(f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=str(path)) from None
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
    elif suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise BackendError(f"malformed JSON on line {n}: {exc.msg}", source=str(path)) from None
    else:
        raise BackendError(f"unsupported metadata format {suffix or '(no suffix)'} (use csv, json or jsonl)", source=str(path))
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise BackendError("metadata must be a list of objects, one per sample", source=str(path))
    if not rows:
        raise BackendError("metadata has no rows", source=str(path))
    return rows


class DiffusionDataset:
    """Samples of a DiffSynth-style dataset for one pipeline.

    `dataset_params` are the params the pipeline reads before any unit writes them; those the
    dataset does not provide are None in every sample.
    """

    def __init__(
        self,
        base_path: str | Path,
        metadata_path: str | Path | None,
        dataset_params: Iterable[str],
        data_file_keys: Iterable[str] = ("image",),
        extra_inputs: Iterable[str] = (),
        required: Iterable[str] = REQUIRED_COLUMNS,
        optional: Iterable[str] = (),
    ):
        self.base_path = Path(base_path or ".")
        if not self.base_path.is_dir():
            raise BackendError("dataset base path is not a folder", source=str(self.base_path))
        if not metadata_path:
            raise BackendError("--dataset_metadata_path is required to read a dataset (stage 2 reads a cache instead)",
                               source=str(self.base_path))
        self.metadata_path = Path(metadata_path)
        self.rows = read_metadata(self.metadata_path)
        self.dataset_params = list(dict.fromkeys(dataset_params))
        columns = set().union(*(r.keys() for r in self.rows))
        self.extra_inputs = list(dict.fromkeys(list(extra_inputs) + [c for c in optional if c in columns]))
        self.required = [c for c in required]
        for name in self.required + self.extra_inputs:
            if name not in columns:
                raise BackendError(f"missing column {name!r} (columns: {', '.join(sorted(columns))})", source=str(self.metadata_path))
        # Files: the declared keys plus every image param the pipeline receives.
        self.file_keys = [k for k in dict.fromkeys(list(data_file_keys)) if k in columns]
        self.inputs = [p for p in self.dataset_params if p in self.required or p in self.extra_inputs]
        for p in self.inputs:
            if p in IMAGE_PARAMS and p not in self.file_keys:
                self.file_keys.append(p)
        for n, row in enumerate(self.rows):
            for name in self.required:
                if row.get(name) in (None, ""):
                    raise BackendError(f"row {n + 1}: empty value in required column {name!r}", source=str(self.metadata_path))
        self._ids: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def _file(self, index: int, key: str, name: Any) -> Path:
        if not isinstance(name, str) or not name:
            raise SampleError(f"row {index + 1}: column {key!r} must name a file, got {name!r}", index=index,
                              source=str(self.metadata_path))
        path = self.base_path / name
        if not path.is_file():
            raise SampleError(f"row {index + 1}: missing file {name!r} (column {key!r}) under {self.base_path}",
                              index=index, source=str(self.metadata_path))
        return path

    def files(self, index: int) -> dict[str, list[Path]]:
        row = self.rows[index]
        out = {}
        for key in self.file_keys:
            value = row.get(key)
            if value in (None, "") and key not in self.required:
                continue
            names = value if isinstance(value, list) else [value]
            out[key] = [self._file(index, key, name) for name in names]
        return out

    def sample_id(self, index: int, file_digest: Optional[Callable[[Path], str]] = None) -> str:
        """sha256 of the metadata row and the bytes of its files (`file_digest`: a remembering sha256)."""
        if index not in self._ids:
            file_digest = file_digest or file_sha256
            digest = hashlib.sha256()
            digest.update(json.dumps(self.rows[index], sort_keys=True, default=str).encode("utf-8"))
            for key, paths in sorted(self.files(index).items()):
                for path in paths:
                    digest.update(f"\0{key}\0".encode("utf-8"))
                    digest.update(bytes.fromhex(file_digest(path)))
            self._ids[index] = digest.hexdigest()
        return self._ids[index]

    def key_inputs(self, index: int, params: Iterable[str], file_digest: Optional[Callable[[Path], str]] = None) -> dict[str, Any]:
        """What the given dataset params of one sample are made of: file digests or typed field values.

        Exactly the inputs stage 1 reads, so a cache key built on it changes when (and only when)
        one of them does: a column no stage-1 unit reads is not part of it.
        """
        file_digest = file_digest or file_sha256
        files = self.files(index)
        out: dict[str, Any] = {}
        for param in params:
            if param not in self.inputs:
                out[param] = None
            elif param in files:
                out[param] = {"files": [file_digest(path) for path in files[param]]}
            else:
                out[param] = {"value": self._value(index, param)}
        return out

    def check(self, index: int) -> None:
        """A cheap look at one sample's images: SampleError when one is missing, not an image or too small."""
        from PIL import Image, UnidentifiedImageError

        files = self.files(index)
        for param in self.inputs:
            for path in files.get(param, []):
                try:
                    with Image.open(path) as img:
                        size = img.size
                        img.verify()  # reads the file's structure (PNG chunk checksums) without decoding
                except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
                    raise SampleError(f"row {index + 1}: {path.name!r} (column {param!r}) is not a readable image "
                                      f"({type(exc).__name__}: {_first_line(exc)})", index=index,
                                      source=str(self.metadata_path)) from None
                if min(size) < MIN_IMAGE_SIDE:
                    raise SampleError(f"row {index + 1}: image {path.name!r} (column {param!r}) is {size[0]}x{size[1]} px, "
                                      f"smaller than {MIN_IMAGE_SIDE} px", index=index, source=str(self.metadata_path))

    def _value(self, index: int, param: str) -> Any:
        value = self.rows[index].get(param)
        if value == "":
            value = None
        if value is not None and param in PARAM_TYPES:
            try:
                value = PARAM_TYPES[param](value)
            except (TypeError, ValueError):
                raise BackendError(f"row {index + 1}: column {param!r} must be a {PARAM_TYPES[param].__name__}, got {value!r}",
                                   source=str(self.metadata_path)) from None
        return value

    def sample(self, index: int) -> dict[str, Any]:
        """The dataset params of one sample (None where the dataset provides nothing)."""
        from PIL import Image, UnidentifiedImageError

        files = self.files(index)
        state: dict[str, Any] = {}
        for param in self.dataset_params:
            if param not in self.inputs:
                state[param] = None
                continue
            if param in files:
                images = []
                for path in files[param]:
                    try:
                        with Image.open(path) as img:
                            images.append(img.convert("RGB"))
                    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
                        raise BackendError(f"row {index + 1}: cannot read image {path.name!r}: {_first_line(exc)}",
                                           source=str(self.metadata_path)) from None
                state[param] = images[0] if len(images) == 1 else images
                continue
            state[param] = self._value(index, param)
        return state


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def write_synthetic_dataset(folder: str | Path, count: int = 8, size: int = 64, seed: int = 0,
                            edit: bool = False, distill: bool = False) -> Path:
    """A small captioned image set (coloured shapes on a background) with metadata.csv; returns the csv path.

    For tests and the demo. `edit` adds an edit_image column; `distill` adds seed,
    num_inference_steps and cfg_scale columns.
    """
    import random

    from PIL import Image, ImageDraw

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    colours = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
               "white": (245, 245, 245), "black": (15, 15, 15), "orange": (240, 140, 30), "purple": (140, 60, 190)}
    shapes = ("circle", "square", "triangle")
    names = list(colours)
    rows = []
    for i in range(count):
        fg, bg = rng.sample(names, 2)
        shape = shapes[i % len(shapes)]
        img = Image.new("RGB", (size, size), colours[bg])
        draw = ImageDraw.Draw(img)
        r = rng.randint(size // 5, size // 3)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape == "circle":
            draw.ellipse(box, fill=colours[fg])
        elif shape == "square":
            draw.rectangle(box, fill=colours[fg])
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colours[fg])
        name = f"images/{i:03d}.png"
        img.save(folder / name)
        row = {"image": name, "prompt": f"a {fg} {shape} on a {bg} background"}
        if edit:
            edit_name = f"images/{i:03d}_edit.png"
            img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(folder / edit_name)
            row["edit_image"] = edit_name
        if distill:
            row.update({"seed": i, "num_inference_steps": 2, "cfg_scale": 1.0})
        rows.append(row)
    path = folder / "metadata.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path

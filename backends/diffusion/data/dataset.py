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
smaller than 16 px, an image of more pixels than PIL's `Image.MAX_IMAGE_PIXELS`, a decompression
bomb, or of a mode that has no RGB conversion) raise `SampleError`: the stages skip such a sample
with a warning and count it. Anything else stops the run (docs/cache.md); `sample()` raises
`SampleError` too, for what only decoding finds, and stage 1 stops on it naming the row.

Metadata files are read by the readers of `unitgraph.userfiles` (size, nesting, duplicate keys,
NaN and integer limits; one line naming the file, the row or the line). A csv row with more fields
than the header is an error (usually an unquoted comma), a row with fewer has its missing fields
None, which is as empty as "" and an error only in a required column; a jsonl line must hold an
object.

Images become 8-bit RGB by `image_to_rgb`: 16-bit grayscale (modes I;16, I;16B, I;16L, I;16N and
I, the 32-bit mode older PIL opens 16-bit PNGs in) is scaled from 0..65535 to 0..255 (mode I is
clipped to that range first); 32-bit float images (mode F, e.g. float TIFFs) are taken as 0..1,
scaled to 0..255 and clipped, and refused (SampleError) when a pixel is NaN or infinite; every other
mode (palette, L, LA, RGBA, CMYK, ...) goes through PIL's `convert("RGB")` (alpha is dropped).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from unitgraph.errors import path_missing
from unitgraph.userfiles import parse_user_csv, parse_user_json, parse_user_jsonl, read_user_text, too_many_rows

from ..errors import BackendError
from .video import STILL_SUFFIXES, VideoProblem, check_pixels, probe_clip, read_clip

REQUIRED_COLUMNS = ("image", "prompt")
# The defaults of a DiffusionDataset made without a pipeline's declarations (PipelineDef.image_params,
# PipelineDef.param_types): metadata files (csv in particular) carry strings.
IMAGE_PARAMS = ("image",)
PARAM_TYPES: dict[str, type] = {}
MIN_IMAGE_SIDE = 16
# a metadata file larger than this is refused (one line) rather than read into memory: about a
# million rows of long prompts; the limit of the other user files (specs, plans) is 64 MiB
MAX_METADATA_BYTES = 256 * 1024 * 1024
# rows a run reads: every row costs stage 1 a key (its files' digests, once per distinct file) and a manifest record;
# past this the bookkeeping alone takes minutes and gigabytes (a file of 10^6 rows naming 6 images), so it is
# refused before any sample is looked at: split a larger dataset into several metadata files, each its own cache
MAX_METADATA_ROWS = 200_000
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


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
    """Rows of a csv, json (a list of objects, or an object whose "data" is one) or jsonl file.

    Any problem is one BackendError naming the file and, where there is one, the row or line.
    """
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise BackendError(f"metadata file {path_missing(path)}", source=source)
    if path.is_dir():
        raise BackendError("is a directory, expected a metadata file (csv, json or jsonl)", source=source)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json", ".jsonl"):
        raise BackendError(f"unsupported metadata format {suffix or '(no suffix)'} (use csv, json or jsonl)", source=source)
    text = read_user_text(path, BackendError, f"a {suffix[1:]} metadata file", max_bytes=MAX_METADATA_BYTES)
    rows: Any
    if suffix == ".csv":
        _, rows = parse_user_csv(text, source, BackendError, max_rows=MAX_METADATA_ROWS)
    elif suffix == ".jsonl":
        rows = parse_user_jsonl(text, source, BackendError, max_rows=MAX_METADATA_ROWS)
    else:
        rows = parse_user_json(text, source, BackendError)
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
        if not isinstance(rows, list):
            raise BackendError("metadata must be a list of objects, one per sample", source=source)
        for n, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise BackendError(f"row {n}: expected an object (one per sample), got {type(row).__name__}", source=source)
    if not rows:
        raise BackendError("metadata has no rows", source=source)
    if len(rows) > MAX_METADATA_ROWS:  # a json list (csv and jsonl stop reading at the first row past it)
        raise BackendError(too_many_rows(MAX_METADATA_ROWS), source=source)
    return rows


def metadata_columns(path: "str | Path | None") -> Optional[set[str]]:
    """The columns of a metadata file, or None when there is no file or it cannot be read (the dataset says
    why when it is read): a csv's header line, a jsonl's first row, the keys of a json's rows. Only a csv's
    first line and a jsonl's first row are read, so a large file costs nothing here."""
    if not path:
        return None
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if not path.is_file():  # a FIFO or a device is never opened (read_metadata refuses it in one line)
            return None
        if suffix in (".csv", ".jsonl"):
            with path.open("r", encoding="utf-8-sig", newline="") as handle:
                while True:
                    line = handle.readline(1 << 20)
                    if not line or line.strip():
                        break
            if not line.strip():
                return None
            if suffix == ".csv":
                return {c.strip() for c in next(csv.reader([line])) if c.strip()}
            row = parse_user_json(line, str(path), BackendError)
            return set(row) if isinstance(row, dict) else None
        return set().union(*(row.keys() for row in read_metadata(path)))
    except (OSError, UnicodeDecodeError, ValueError, StopIteration, BackendError, csv.Error):
        return None


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
        image_params: Iterable[str] = IMAGE_PARAMS,
        param_types: Optional[dict[str, type]] = None,
        video_params: Iterable[str] = (),
        num_frames: int = 81,
        audio_params: Iterable[str] = (),
        strict: Iterable[str] = (),
        audio_seconds: Optional[float] = None,
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
        self.image_params = tuple(image_params)
        self.video_params = tuple(video_params)
        self.audio_params = tuple(audio_params)
        self.num_frames = int(num_frames)
        # a song's read (an audio pipeline's own column): its first `audio_seconds`, and one second more, which tells a
        # longer track (None: a clip's sound, `clip_seconds`)
        self.audio_seconds = None if audio_seconds is None else float(audio_seconds)
        self.param_types = dict(PARAM_TYPES if param_types is None else param_types)
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
            if (p in self.image_params or p in self.video_params or p in self.audio_params) and p not in self.file_keys:
                self.file_keys.append(p)
        for n, row in enumerate(self.rows):
            for name in self.required:
                if row.get(name) in (None, ""):
                    raise BackendError(f"row {n + 1}: empty value in required column {name!r}", source=str(self.metadata_path))
        # params whose file problems stop the run in one line rather than skip the sample (a --masked_loss mask:
        # a sample trained without its mask would train what the mask leaves out)
        self.strict = tuple(strict)
        self._ids: dict[int, str] = {}
        self._problems: dict[str, Optional[str]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        """The sample's place in words (its metadata row), for messages; `DatasetMixture.where` adds the dataset."""
        return f"metadata row {index + 1}"

    def _problem(self, index: int, key: str, message: str) -> Exception:
        """A sample's problem with its `key` column: a SampleError (the sample is skipped), or for a strict column
        a BackendError (the run stops in one line)."""
        if key in self.strict:
            return BackendError(message, source=str(self.metadata_path))
        return SampleError(message, index=index, source=str(self.metadata_path))

    def _file(self, index: int, key: str, name: Any) -> Path:
        if not isinstance(name, str) or not name:
            raise self._problem(index, key, f"row {index + 1}: column {key!r} must name a file, got {name!r}")
        path = self.base_path / name
        if name not in self._problems:  # a file many rows name is looked at once
            self._problems[name] = _not_a_file(path)
        problem = self._problems[name]
        if problem == "is missing":
            raise self._problem(index, key, f"row {index + 1}: missing file {name!r} (column {key!r}) under {self.base_path}")
        if problem:
            raise self._problem(index, key, f"row {index + 1}: {name!r} (column {key!r}) under {self.base_path} {problem}")
        return path

    def files(self, index: int) -> dict[str, list[Path]]:
        row = self.rows[index]
        out = {}
        for key in self.file_keys:
            value = row.get(key)
            if value in (None, "") and key not in self.required:
                continue
            names = value if isinstance(value, list) else [value]
            if not names:
                raise self._problem(index, key, f"row {index + 1}: column {key!r} names no file (an empty list)")
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
                if param in self.video_params:  # the clip is the file's first num_frames frames
                    out[param]["num_frames"] = self.num_frames
            else:
                out[param] = {"value": self._value(index, param)}
        return out

    def check(self, index: int) -> None:
        """A cheap look at one sample's images, without decoding them: SampleError when one is missing, not an
        image, too small, too large (a decompression bomb) or of a mode that has no RGB conversion; a BackendError
        for such a problem in a strict column, or a strict column's image of another size than the sample's image."""
        files = self.files(index)
        sizes: dict[str, tuple[int, int]] = {}
        for param in self.inputs:
            for path in files.get(param, []):
                where = f"row {index + 1}: {path.name!r} (column {param!r})"
                if param in self.audio_params:
                    self._check_audio(index, path, where)
                    continue
                if param in self.video_params and path.suffix.lower() not in STILL_SUFFIXES:
                    self._check_video(index, param, path, where)
                    continue
                try:
                    with open_image(path) as img:
                        size, mode = img.size, img.mode
                        img.verify()  # reads the file's structure (PNG chunk checksums) without decoding
                except ImageProblem as exc:
                    raise self._problem(index, param, f"{where} {exc}") from None
                except Exception as exc:  # PIL's plugins raise many types for damaged files (struct.error, EOFError, ...)
                    raise self._problem(index, param, f"{where} is not a readable image ({type(exc).__name__}: "
                                                      f"{_first_line(exc)})") from None
                if min(size) < MIN_IMAGE_SIDE:
                    raise self._problem(index, param, f"row {index + 1}: image {path.name!r} (column {param!r}) is "
                                                      f"{size[0]}x{size[1]} px, smaller than {MIN_IMAGE_SIDE} px")
                if not _converts_to_rgb(mode):
                    raise self._problem(index, param, f"{where} is an image of mode {mode}, which has no RGB conversion")
                sizes[param] = size
        for param in self.strict:  # a mask must cover its image pixel for pixel
            image, own = sizes.get("image"), sizes.get(param)
            if image is not None and own is not None and image != own:
                raise BackendError(f"row {index + 1}: the {param} {files[param][0].name!r} is {own[0]}x{own[1]} px, its "
                                   f"image {files['image'][0].name!r} {image[0]}x{image[1]} px: they must be the same size",
                                   source=str(self.metadata_path))

    def _check_video(self, index: int, param: str, path: Path, where: str) -> None:
        try:
            width, height = probe_clip(path)
        except VideoProblem as exc:
            raise SampleError(f"{where} {exc}", index=index, source=str(self.metadata_path)) from None
        if min(width, height) < MIN_IMAGE_SIDE:
            raise SampleError(f"row {index + 1}: video {path.name!r} (column {param!r}) is {width}x{height} px, "
                              f"smaller than {MIN_IMAGE_SIDE} px", index=index, source=str(self.metadata_path))
        try:
            check_pixels(width, height)  # the pixel limit of images, before a frame is decoded
        except VideoProblem as exc:
            raise SampleError(f"{where} {exc}", index=index, source=str(self.metadata_path)) from None

    def _check_audio(self, index: int, path: Path, where: str) -> None:
        from .audio import has_audio

        try:
            has_audio(path)  # a file without a sound track is a sample without audio, as DiffSynth reads it
        except VideoProblem as exc:
            raise SampleError(f"{where} {exc}", index=index, source=str(self.metadata_path)) from None

    def _audio(self, index: int, param: str, path: Path) -> Any:
        from .audio import clip_seconds, read_audio

        seconds = clip_seconds(self.num_frames) if self.audio_seconds is None else self.audio_seconds + 1.0
        try:
            return read_audio(path, seconds=seconds)  # what the clip or the song needs, never more
        except VideoProblem as exc:
            raise SampleError(f"row {index + 1}: {path.name!r} (column {param!r}) {exc}", index=index,
                              source=str(self.metadata_path)) from None

    def _clip(self, index: int, param: str, path: Path) -> list[Any]:
        try:
            return read_clip(path, self.num_frames)
        except VideoProblem as exc:
            raise SampleError(f"row {index + 1}: video {path.name!r} (column {param!r}) {exc}", index=index,
                              source=str(self.metadata_path)) from None
        except Exception as exc:  # a still image PIL cannot read
            raise SampleError(f"row {index + 1}: cannot read {path.name!r} (column {param!r}): "
                              f"{type(exc).__name__}: {_first_line(exc)}", index=index,
                              source=str(self.metadata_path)) from None

    def _value(self, index: int, param: str) -> Any:
        value = self.rows[index].get(param)
        if value == "":
            value = None
        if value is not None and param in self.param_types:
            kind = self.param_types[param]
            try:
                value = kind(value)
                if kind is float and not math.isfinite(value):
                    raise ValueError(value)
            except (TypeError, ValueError, OverflowError):
                shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:60]}..."
                raise BackendError(f"row {index + 1}: column {param!r} must be a {'finite ' if kind is float else ''}"
                                   f"{kind.__name__}, got {shown}", source=str(self.metadata_path)) from None
        return value

    def sample(self, index: int) -> dict[str, Any]:
        """The dataset params of one sample (None where the dataset provides nothing); images as 8-bit RGB.

        An image that cannot be decoded or converted is a SampleError naming the row and the file.
        """
        files = self.files(index)
        state: dict[str, Any] = {}
        for param in self.dataset_params:
            if param not in self.inputs:
                state[param] = None
                continue
            if param in files and param in self.video_params:
                clips = [self._clip(index, param, path) for path in files[param]]
                state[param] = clips[0] if len(clips) == 1 else clips
                continue
            if param in files and param in self.audio_params:  # (samples, rate) of the file's sound track, or None
                tracks = [self._audio(index, param, path) for path in files[param]]
                state[param] = tracks[0] if len(tracks) == 1 else tracks
                continue
            if param in files:
                images = []
                for path in files[param]:
                    try:
                        with open_image(path) as img:
                            images.append(image_to_rgb(img))
                    except ImageProblem as exc:
                        raise SampleError(f"row {index + 1}: image {path.name!r} (column {param!r}) {exc}", index=index,
                                          source=str(self.metadata_path)) from None
                    except Exception as exc:  # PIL's decoders raise many types for damaged files
                        raise SampleError(f"row {index + 1}: cannot read image {path.name!r} (column {param!r}): "
                                          f"{type(exc).__name__}: {_first_line(exc)}", index=index,
                                          source=str(self.metadata_path)) from None
                state[param] = images[0] if len(images) == 1 else images
                continue
            state[param] = self._value(index, param)
        return state


def _tone(index: int, seconds: float, rate: int = 16000) -> tuple[Any, int]:
    """A stereo sine tone of `seconds` (the clip's length at its 8 fps), its pitch set by the row: a synthetic sound track."""
    import numpy as np

    t = np.arange(int(round(seconds * rate)), dtype=np.float32) / rate
    wave = 0.3 * np.sin(2 * np.pi * (220.0 + 55.0 * index) * t)
    return np.stack([wave, 0.5 * wave]).astype(np.float32), rate


def _not_a_file(path: Path) -> Optional[str]:
    """Why `path` is not a regular file to read, in words ("is missing", "is a folder", ...), or None."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "is missing" if not path.is_symlink() else "is a symlink to a file that does not exist"
    except OSError as exc:  # ELOOP (a symlink loop), ENAMETOOLONG, EACCES ...
        return f"cannot be opened ({exc.strerror or exc})"
    except ValueError:  # a NUL byte in the name
        return "is not a usable file name"
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (a named pipe), not a file"
    if not stat.S_ISREG(mode):
        return "is a device or socket, not a file"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ImageProblem(Exception):
    """What is wrong with an image file, said as the rest of a sentence ("is 20000x20000 px, ..."): the caller
    adds the row and the file and raises a SampleError."""


def open_image(path: Path) -> Any:
    """`PIL.Image.open(path)`, refusing (ImageProblem) an image of more than `Image.MAX_IMAGE_PIXELS` pixels
    before anything is decoded; PIL only warns up to twice that many and fails past it."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below says it in one line
            img = Image.open(path)
    except Image.DecompressionBombError as exc:
        raise ImageProblem(f"is too large to decode safely ({_first_line(exc)})") from None
    width, height = img.size
    if limit and width * height > limit:
        img.close()
        raise ImageProblem(f"is {width}x{height} px ({width * height} pixels), more than the {limit} pixels PIL decodes "
                           "safely (Image.MAX_IMAGE_PIXELS): a decompression bomb?")
    return img


def image_to_rgb(img: Any) -> Any:
    """An 8-bit RGB copy of a PIL image, whatever its mode (see the module docstring).

    16-bit grayscale is scaled (0..65535 to 0..255, rounded), float (mode F) taken as 0..1 and clipped;
    ImageProblem for a float image with NaN or infinite pixels or a mode PIL cannot convert.
    """
    import numpy as np
    from PIL import Image

    mode = img.mode
    if mode in SIXTEEN_BIT_MODES:
        values = np.asarray(img)
        if mode == "I":  # 32-bit signed: taken as a 16-bit image, values outside 0..65535 clipped
            values = np.clip(values, 0, 65535)
        gray = ((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    if mode == "F":
        values = np.asarray(img, dtype=np.float32)
        if not np.isfinite(values).all():
            raise ImageProblem("is a float image with NaN or infinite pixels")
        gray = np.rint(np.clip(values, 0.0, 1.0) * 255.0).astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    try:
        return img.convert("RGB")
    except ValueError:
        if not _converts_to_rgb(mode):
            raise ImageProblem(f"is an image of mode {mode}, which has no RGB conversion") from None
        raise


@lru_cache(maxsize=None)
def _converts_to_rgb(mode: str) -> bool:
    if mode in SIXTEEN_BIT_MODES or mode in ("F", "RGB"):
        return True
    from PIL import Image

    try:
        Image.new(mode, (1, 1)).convert("RGB")
    except Exception:  # an unknown mode or one without a conversion
        return False
    return True


def write_synthetic_dataset(folder: str | Path, count: int = 8, size: int = 64, seed: int = 0,
                            edit: bool = False, distill: bool = False, images: Iterable[str] = (),
                            videos: Iterable[str] = (), frames: int = 5, audio: bool = False,
                            songs: float = 0.0) -> Path:
    """A small captioned image set (coloured shapes on a background) with metadata.csv; returns the csv path.

    For tests and the demo. `images` adds a column per name, each naming a mirrored copy of the row's
    image (a reference or edit image); `videos` a column per name, each naming an mp4 clip of `frames`
    frames in which the row's image scrolls sideways (2 px a frame); `edit` adds the edit_image column;
    `distill` adds seed, num_inference_steps and cfg_scale columns; `audio` gives the clips a sound track (a tone of
    the row's own pitch, 16 kHz stereo) and an `input_audio` column naming the first clip (DiffSynth's column);
    `songs` (seconds) an `audio` column naming a WAV of the row's tone, mono on every third row, with `lyrics` (the third
    row's empty: an instrumental) and a `bpm` column (empty on odd rows), as ACE-Step's dataset has them.
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
        for column in dict.fromkeys([*(["edit_image"] if edit else []), *images]):
            suffix = "edit" if column == "edit_image" else column
            extra_name = f"images/{i:03d}_{suffix}.png"
            img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(folder / extra_name)
            row[column] = extra_name
        for column in dict.fromkeys(videos):
            from PIL import ImageChops

            from .video import write_clip

            clip_name = f"images/{i:03d}_{column}.mp4"
            write_clip(folder / clip_name, [ImageChops.offset(img, 2 * k, 0) for k in range(frames)],
                       audio=_tone(i, frames / 8.0) if audio else None)
            row[column] = clip_name
            if audio:
                row.setdefault("input_audio", clip_name)
        if songs:
            song_name = f"images/{i:03d}_song.wav"
            samples, rate = _tone(i, songs)
            from .audio import wav_bytes

            (folder / song_name).write_bytes(wav_bytes(samples[:1] if i % 3 == 2 else samples, rate))
            row.update({"audio": song_name, "lyrics": "" if i % 3 == 2 else f"[verse]\nla la {fg} {shape}",
                        "bpm": "" if i % 2 else str(90 + 10 * i)})
        if distill:
            row.update({"seed": i, "num_inference_steps": 2, "cfg_scale": 1.0})
        rows.append(row)
    path = folder / "metadata.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def add_synthetic_masks(folder: str | Path, size: Optional[tuple[int, int]] = None) -> None:
    """A `mask` column for a synthetic dataset's metadata.csv (--masked_loss), for tests and benchmarks: per row in
    turn, a mask whose left half is white, a vertical grey ramp, an all-white mask; each of its image's size, or
    of `size` (a wrong one, to test the check)."""
    from PIL import Image

    folder = Path(folder)
    with (folder / "metadata.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for i, row in enumerate(rows):
        with Image.open(folder / row["image"]) as image:
            w, h = size or image.size
        mask = Image.new("L", (w, h), 0)
        if i % 3 == 0:
            mask.paste(255, (0, 0, w // 2, h))
        elif i % 3 == 1:
            mask.putdata([int(255 * y / max(1, h - 1)) for y in range(h) for _ in range(w)])
        else:
            mask.paste(255, (0, 0, w, h))
        row["mask"] = f"mask-{i}.png"
        mask.save(folder / row["mask"])
    with (folder / "metadata.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

"""The stage-1 cache: content-addressed safetensors entries, a manifest with checksums, per-process journals.

Layout of a cache folder (docs/cache.md has the full story):

    manifest.json                       format, status, the plan and its fingerprint, what the entry keys
                                        were derived from (`key_inputs`), the arguments stage 1 ran with
                                        (`made_with`), the samples (index, sample_id, key), one record per
                                        entry (file, size, sha256) and the samples stage 1 skipped
    entries/<key>.safetensors           one file per distinct entry key
    journal/rank-<r>.jsonl              while stage 1 runs: one line per entry process r finished
    hashes.json                         sha256 of model weights and data files, keyed by path, size, mtime
    .lock                               held by the process that fills the cache

An entry's key is the sha256 of everything its values depend on, read off the plan: the unit list,
the settings those units read, the weights of the models they call, and the sample's dataset
values that stage 1 reads (file bytes, metadata fields). Two samples with the same inputs share
one entry; a changed input gives a new key, so a stale entry can never be mistaken for a fresh one.

An entry file holds the sample's cached values under their entry keys (`param` in latest mode,
`param@writer` in versioned mode). Tensors are safetensors tensors; everything else (None, ints,
strings, lists, tuples) is JSON in the safetensors header (key `unitgraph`), where a tensor nested
in a list is a reference to a stored tensor. Never pickle.

Crash safety: an entry is written to a temporary file, fsynced and renamed into place, then
recorded (size and sha256) in its process's journal, fsynced. The main process merges journals
into the manifest before and after the work, under the lock, so no two processes ever write the
manifest and an interrupted run leaves only complete, recorded entries (an entry renamed but not
yet recorded is recomputed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from unitgraph.atomic import write_bytes_atomic, write_text_atomic
from unitgraph.userfiles import parse_user_json, read_user_json

from .args import BackendError
from .manifest import FORMAT, Manifest, describe_plan_change

if TYPE_CHECKING:  # torch is imported where tensors are handled: `cache verify` and `cache info` start without it
    import torch

HASHES_FORMAT = "unitgraph.hashes/v1"
MANIFEST = "manifest.json"
ENTRIES = "entries"
JOURNAL = "journal"
HASHES = "hashes.json"
LOCK = ".lock"
HEADER_KEY = "unitgraph"
ENTRY_SUFFIX = ".safetensors"
# Files that can run code when loaded (pickle and formats built on it). A cache never contains
# them; one found in a cache folder is ignored with a warning, never opened.
UNSAFE_SUFFIXES = (".pkl", ".pickle", ".pth", ".pt", ".ckpt", ".bin", ".joblib", ".dill", ".npy", ".npz")
# A file modified this close to the moment it was hashed may change again without a visible
# mtime change (coarse timestamps): its remembered hash is not trusted (git's "racily clean").
RACY_NS = 2_000_000_000


# ------------------------------------------------------------------------------------------------
# values <-> safetensors + JSON


def _encode(value: Any, tensors: dict[str, "torch.Tensor"], path: str) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().to("cpu").contiguous().clone()
        return {"__tensor__": path}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _is_pil(value):  # a raw dataset image: stored as uint8 pixels, restored as a PIL image
        import numpy as np

        tensors[path] = torch.from_numpy(np.asarray(value.convert("RGB"), dtype=np.uint8).copy())
        return {"__image__": path}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if {"__tensor__", "__tuple__", "__image__"} & set(value):
            raise TypeError(f"cannot cache a dict with reserved key at {path}")
        return {k: _encode(v, tensors, f"{path}.{k}") for k, v in value.items()}
    raise TypeError(f"cannot cache a value of type {type(value).__name__} at {path} (tensors, JSON values, lists, tuples)")


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a backend dependency
        return False
    return isinstance(value, Image.Image)


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if set(value) == {"__image__"}:
            from PIL import Image

            return Image.fromarray(tensors[value["__image__"]].numpy())
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def _tensor_refs(value: Any) -> list[str]:
    """Names of the stored tensors an encoded value refers to."""
    if isinstance(value, dict):
        if set(value) in ({"__tensor__"}, {"__image__"}):
            return [next(iter(value.values()))]
        if set(value) == {"__tuple__"}:
            return [r for v in value["__tuple__"] for r in _tensor_refs(v)]
        return [r for v in value.values() for r in _tensor_refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _tensor_refs(v)]
    return []


def entry_bytes(values: dict[str, Any], meta: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    encoded = {key: _encode(value, tensors, key) for key, value in values.items()}
    header = json.dumps({"meta": meta, "values": encoded}, sort_keys=True)
    return save(tensors, metadata={HEADER_KEY: header})


def _safetensors_header(data: bytes, source: str) -> dict[str, Any]:
    if len(data) < 8:
        raise BackendError(f"not a safetensors file ({len(data)} bytes)", source=source)
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise BackendError("not a safetensors file (bad header length)", source=source)
    try:
        header = parse_user_json(data[8:8 + size].decode("utf-8"), source, BackendError)
    except (UnicodeDecodeError, BackendError):
        raise BackendError("not a safetensors file (unreadable header)", source=source) from None
    if not isinstance(header, dict):
        raise BackendError("not a safetensors file (header is not an object)", source=source)
    return header


def parse_entry(data: bytes, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values by entry key, meta) of the bytes of one entry file."""
    from safetensors.torch import load

    header = _safetensors_header(data, source)
    raw = (header.get("__metadata__") or {}).get(HEADER_KEY)
    if raw is None:
        raise BackendError("not a unitgraph cache entry (no header)", source=source)
    try:
        tensors = load(data)
        content = json.loads(raw)
        return _decode(content["values"], tensors), content["meta"]
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise BackendError(f"unreadable cache entry ({type(exc).__name__}: {exc})", source=source) from None


def write_entry(path: str | Path, values: dict[str, Any], meta: dict[str, Any]) -> None:
    write_bytes_atomic(path, entry_bytes(values, meta))


def read_entry(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values by entry key, meta) of one entry file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BackendError("cache entry is missing; run the data_process stage again", source=str(path)) from None
    except OSError as exc:
        raise BackendError(f"unreadable cache entry ({exc.strerror or exc})", source=str(path)) from None
    return parse_entry(data, str(path))


def entry_key_sizes(path: str | Path) -> dict[str, int]:
    """Bytes of tensor data under each entry key of one entry file (reads only the header)."""
    path = Path(path)
    with path.open("rb") as handle:
        head = handle.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        data = head + handle.read(size)
    header = _safetensors_header(data, str(path))
    content = parse_user_json(str((header.get("__metadata__") or {}).get(HEADER_KEY, "{}")), str(path), BackendError)
    if not isinstance(content, dict):
        raise BackendError("not a unitgraph cache entry (its header is not an object)", source=str(path))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    out = {}
    for key, value in (content.get("values") or {}).items():
        out[key] = sum(int(tensors[r]["data_offsets"][1]) - int(tensors[r]["data_offsets"][0])
                       for r in _tensor_refs(value) if r in tensors)
    return out


# ------------------------------------------------------------------------------------------------
# hashing


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def canonical_hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def settings_hash(settings: dict[str, Any]) -> str:
    return "sha256:" + canonical_hash(settings)


def entry_key(static_hash: str, sample_inputs: dict[str, Any]) -> str:
    """The key of one sample's entry: its inputs under the shared unit list, settings and models."""
    return canonical_hash({"static": static_hash, "sample": sample_inputs})


class HashMemo:
    """sha256 of files, remembered in `path` (JSON) keyed by path, size, mtime (and inode, ctime).

    Weights are hashed once per file version: a later run only stats them. `hashed` lists the
    files this memo actually read.
    """

    def __init__(self, path: Optional[Path]):
        self.path = path
        self.files: dict[str, dict[str, Any]] = {}
        self.hashed: list[Path] = []
        self.touched: set[str] = set()
        self.dirty = False
        if path is not None and path.is_file():
            try:
                data = read_user_json(path, BackendError, "a hash memo", max_bytes=1 << 30)
                if isinstance(data, dict) and data.get("format") == HASHES_FORMAT and isinstance(data.get("files"), dict):
                    self.files = data["files"]
            except BackendError:
                self.files = {}  # a damaged memo only costs re-hashing

    def digest(self, path: Path) -> str:
        path = Path(path)
        stat = path.stat()
        name = os.path.realpath(path)
        self.touched.add(name)
        ident = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, "ino": stat.st_ino}
        known = self.files.get(name)
        if known and all(known.get(k) == v for k, v in ident.items()) and stat.st_mtime_ns + RACY_NS < known.get("hashed_at_ns", 0):
            return known["sha256"]
        value = sha256_file(path)
        self.files[name] = {**ident, "sha256": value, "hashed_at_ns": time.time_ns()}
        self.hashed.append(path)
        self.dirty = True
        return value

    def save(self, prune: bool = False) -> None:
        """Write the memo (when it changed); `prune` forgets files this memo was not asked about."""
        if prune and set(self.files) - self.touched:
            self.files = {k: v for k, v in self.files.items() if k in self.touched}
            self.dirty = True
        if self.path is None or not self.dirty or not self.path.parent.is_dir():
            return
        write_text_atomic(self.path, json.dumps({"format": HASHES_FORMAT, "files": self.files}, sort_keys=True) + "\n")
        self.dirty = False


# ------------------------------------------------------------------------------------------------
# journals: one append-only file per process


class Journal:
    """Append-only JSON lines, each fsynced: what one process has finished."""

    def __init__(self, path: Path):
        self.path, self.fd = path, -1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise BackendError(f"cannot write the stage-1 journal ({exc.strerror or exc})", source=str(path)) from None

    def append(self, record: dict[str, Any]) -> None:
        try:
            os.write(self.fd, (json.dumps(record, sort_keys=True) + "\n").encode("utf-8"))
            os.fsync(self.fd)
        except OSError as exc:
            raise BackendError(f"cannot write the stage-1 journal ({exc.strerror or exc}); the entries recorded so far "
                               "are kept and the next run computes only the rest", source=str(self.path)) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
# the cache folder


def sample_label(sample: dict[str, Any]) -> str:
    index = int(sample["index"])
    sid = str(sample.get("sample_id") or "")[:12]
    return f"sample {index} (metadata row {index + 1}{', id ' + sid if sid else ''})"


class Cache:
    """One cache folder (see the module docstring)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    # --- paths -----------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST

    @property
    def entries_dir(self) -> Path:
        return self.folder / ENTRIES

    @property
    def journal_dir(self) -> Path:
        return self.folder / JOURNAL

    @property
    def hashes_path(self) -> Path:
        return self.folder / HASHES

    def entry_file(self, key: str) -> Path:
        return self.entries_dir / f"{key}{ENTRY_SUFFIX}"

    def entry_path(self, sample_id: str) -> Path:
        """The entry file of the sample with this id, looked up in the manifest (for readers keyed by sample id).

        Reading through this path skips the checksum; `load_entry` checks it.
        """
        if getattr(self, "_by_sample_id", None) is None:
            manifest = self.read_manifest()
            samples = manifest.samples if manifest is not None else []
            self._by_sample_id = {str(s["sample_id"]): str(s["key"]) for s in samples}
        key = self._by_sample_id.get(str(sample_id))
        if key is None:
            raise BackendError(f"no cache entry for sample id {str(sample_id)[:12]} in the manifest", source=str(self.folder))
        return self.entry_file(key)

    @property
    def lock_path(self) -> Path:
        return self.folder / LOCK

    def check_owned(self) -> None:
        """Stage 1 writes only into a new or empty folder or a unitgraph cache; anything else is refused.

        (A folder holding only the lock is a first run that stopped before its manifest.)
        """
        if self.folder.is_symlink() and not self.folder.exists():
            raise BackendError("is a dangling symlink", source=str(self.folder))
        if not self.folder.exists():
            return
        if not self.folder.is_dir():
            raise BackendError("is a file, not a cache folder; choose another --output_path/--cache_path", source=str(self.folder))
        if self.read_manifest() is not None:
            return
        foreign = sorted(p.name for p in self.folder.iterdir() if p.name != LOCK and not (p.name.startswith(".")
                                                                                          and p.name.endswith(".tmp")))
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise BackendError(f"is not empty and not a unitgraph cache (it holds {shown}, no manifest.json); unitgraph "
                               "writes only into a new, empty or own folder: choose another --output_path/--cache_path",
                               source=str(self.folder))

    def journal_path(self, rank: int) -> Path:
        return self.journal_dir / f"rank-{rank}.jsonl"

    # --- manifest --------------------------------------------------------------------------------
    def read_manifest(self) -> Optional[Manifest]:
        """The folder's manifest (None when it has none), checked against its schema."""
        if self.folder.exists() and not self.folder.is_dir():
            raise BackendError("is a file, not a cache folder", source=str(self.folder))
        if not self.manifest_path.is_file():
            return None
        try:
            data = read_user_json(self.manifest_path, BackendError, "a cache manifest", max_bytes=1 << 30)
        except BackendError as exc:
            raise BackendError(f"unreadable cache manifest ({exc.message}); delete the cache folder and run the "
                               "data_process stage again", source=str(self.manifest_path)) from None
        if isinstance(data, dict) and isinstance(data.get("format"), str) and data["format"] != FORMAT \
                and data["format"].startswith("unitgraph.cache/"):
            return Manifest.from_dict(data, str(self.folder))  # raises: another version's cache
        return Manifest.from_dict(data, str(self.manifest_path))

    def write_manifest(self, manifest: Manifest) -> None:
        write_text_atomic(self.manifest_path, json.dumps(manifest.to_dict(), indent=1, sort_keys=True) + "\n")

    def open_for_training(self, plan: Any, task: str = "sft") -> Manifest:
        """The manifest of a complete cache made under `plan`; a one-line BackendError otherwise.

        `task` (the --task family) only shapes the advice in the message.
        """
        if not self.folder.is_dir():
            raise BackendError("cache folder does not exist (run the data_process stage first)", source=str(self.folder))
        manifest = self.read_manifest()
        if manifest is None:
            raise BackendError("no manifest.json: not a cache folder (run the data_process stage first)", source=str(self.folder))
        if manifest.plan_fingerprint != plan.fingerprint:
            raise BackendError(
                f"cache was made under another plan ({describe_plan_change(manifest, plan)}); train with the "
                "--trainable_models/--lora_base_model/--cache_mode it was made with, or build this plan's cache in another "
                f"folder (--task {task}:data_process, or --task {task}:split)",
                source=str(self.folder))
        if not manifest.complete:
            raise BackendError(f"cache is incomplete ({len(manifest.entries)} entries; its data_process stage did not finish): "
                               "re-run the data_process stage to complete it", source=str(self.folder))
        return manifest

    # --- folder hygiene --------------------------------------------------------------------------
    def unsafe_files(self) -> list[Path]:
        """Pickle-like files in the folder: never loaded, reported so the user knows."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.rglob("*") if p.is_file() and p.suffix.lower() in UNSAFE_SUFFIXES)

    def warn_unsafe(self, warn: Callable[[str], None]) -> None:
        for path in self.unsafe_files():
            warn(f"warning: ignoring {path}: unitgraph never loads {path.suffix} files (they can run code); "
                 "caches hold only safetensors and JSON")

    def clean_temp_files(self) -> int:
        """Temporary files left by an interrupted atomic write (main process, under the lock)."""
        removed = 0
        for folder in (self.folder, self.entries_dir):
            if folder.is_dir():
                for path in folder.glob(".*.tmp"):
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed

    def entry_files(self) -> list[Path]:
        return sorted(self.entries_dir.glob(f"*{ENTRY_SUFFIX}")) if self.entries_dir.is_dir() else []

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive right to fill this cache (released by the kernel if the process dies)."""
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BackendError("another unitgraph process is filling this cache; wait for it to finish "
                                   "or choose another cache folder", source=str(self.folder)) from None
            yield
        finally:
            os.close(fd)

    # --- journals --------------------------------------------------------------------------------
    def read_journals(self) -> list[dict[str, Any]]:
        """Every complete record of every process's journal (a line cut short by a crash is ignored)."""
        records = []
        if not self.journal_dir.is_dir():
            return records
        for path in sorted(self.journal_dir.glob("*.jsonl")):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    record = parse_user_json(line, str(path), BackendError)
                except BackendError:
                    continue  # a line cut short by a crash
                if isinstance(record, dict):
                    records.append(record)
        return records

    def clear_journals(self) -> None:
        if self.journal_dir.is_dir():
            for path in self.journal_dir.glob("*.jsonl"):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.journal_dir.rmdir()

    # --- entries ---------------------------------------------------------------------------------
    def store_entry(self, key: str, values: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        """Write one entry atomically; its record (file, size, sha256) for the manifest."""
        data = entry_bytes(values, meta)
        path = self.entry_file(key)
        write_bytes_atomic(path, data)
        return {"key": key, "file": f"{ENTRIES}/{path.name}", "size": len(data), "sha256": sha256_bytes(data)}

    def check_entry(self, record: dict[str, Any]) -> Optional[str]:
        """None when the entry file has the recorded size and checksum; the problem otherwise."""
        path = self.folder / record["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return "entry file is missing"
        if size != record["size"]:
            return f"entry file has {size} bytes, expected {record['size']} (truncated or overwritten)"
        if sha256_file(path) != record["sha256"]:
            return "entry file does not match its checksum (corrupted)"
        return None

    def load_entry(self, record: dict[str, Any], label: str, verify: bool = True) -> dict[str, Any]:
        """The values of one entry, checked against its record (size always, checksum when `verify`)."""
        path = self.folder / record["file"]
        hint = f"run 'unitgraph cache repair {self.folder}' or the data_process stage again"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BackendError(f"cache entry of {label} is missing; {hint}", source=str(path)) from None
        except OSError as exc:
            raise BackendError(f"cache entry of {label} is unreadable ({exc.strerror or exc}); {hint}", source=str(path)) from None
        if len(data) != record["size"]:
            raise BackendError(f"cache entry of {label} has {len(data)} bytes, expected {record['size']} "
                               f"(truncated or overwritten); {hint}", source=str(path))
        if verify and sha256_bytes(data) != record["sha256"]:
            raise BackendError(f"cache entry of {label} does not match its checksum (corrupted); {hint}", source=str(path))
        values, _ = parse_entry(data, str(path))
        return values


def model_files_digest(files_by_slot: dict[str, list[Path]], digest: Callable[[Path], str] = sha256_file) -> dict[str, dict[str, str]]:
    """{slot: {parent/name: sha256}}: what the stage-1 models are, independent of where they live."""
    return {slot: {f"{p.parent.name}/{p.name}": digest(p) for p in files} for slot, files in sorted(files_by_slot.items())}


# ------------------------------------------------------------------------------------------------
# `unitgraph cache verify` and `unitgraph cache info` (no torch needed)


def open_cache(folder: str | Path) -> tuple[Cache, Manifest]:
    cache = Cache(folder)
    if not cache.folder.is_dir():
        raise BackendError("no such cache folder", source=str(cache.folder))
    manifest = cache.read_manifest()
    if manifest is None:
        raise BackendError("no manifest.json: not a cache folder", source=str(cache.folder))
    return cache, manifest


def verify_cache(folder: str | Path) -> tuple[list[str], dict[str, Any]]:
    """Check every entry a cache's manifest lists (size and sha256). Returns (problems, statistics)."""
    start = time.perf_counter()
    cache, manifest = open_cache(folder)
    records, samples = manifest.entries, manifest.samples
    problems: list[str] = []
    results: dict[str, Optional[str]] = {}
    unrecorded = [s for s in samples if s.get("key") not in records]
    if not manifest.complete:
        problems.append(f"{cache.folder}: cache is incomplete ({len(unrecorded)} of {len(samples)} samples have no entry "
                        "yet: its data_process stage did not finish); run it again to complete the cache")
    else:
        for s in unrecorded:
            problems.append(f"{cache.manifest_path}: {sample_label(s)} has no entry record")
    total = 0
    for s in samples:
        record = records.get(s.get("key"))
        if record is None:
            continue
        key = record["key"]
        if key not in results:
            results[key] = cache.check_entry(record)
            if results[key] is None:
                total += int(record["size"])
        if results[key] is not None:
            problems.append(f"{cache.folder / record['file']}: {sample_label(s)}: {results[key]}")
    stats = {"samples": len(samples), "entries": len(results), "bytes": total,
             "seconds": time.perf_counter() - start, "skipped": len(manifest.skipped)}
    return problems, stats


def cache_info(folder: str | Path) -> dict[str, Any]:
    """What `unitgraph cache info` prints: samples, bytes (per entry key too), plan, models, settings."""
    cache, manifest = open_cache(folder)
    records, samples, plan = manifest.entries, manifest.samples, manifest.plan
    key_sizes: dict[str, dict[str, int]] = {}
    for key, record in records.items():
        path = cache.folder / record["file"]
        try:
            key_sizes[key] = entry_key_sizes(path)
        except (OSError, BackendError, ValueError, KeyError):
            key_sizes[key] = {}
    per_key: dict[str, int] = {}
    for s in samples:
        for name, size in key_sizes.get(s.get("key"), {}).items():
            per_key[name] = per_key.get(name, 0) + size
    n = max(1, len(samples))
    total = sum(int(r["size"]) for r in records.values())
    return {
        "folder": str(cache.folder),
        "format": manifest.format,
        "status": manifest.status,
        "pipeline": manifest.pipeline,
        "plan_fingerprint": manifest.plan_fingerprint,
        "cache_mode": manifest.cache_mode,
        "models_require_backward": plan.get("models_require_backward"),
        "data_process": plan.get("data_process"),
        "train": plan.get("train"),
        "samples": len(samples),
        "skipped": manifest.skipped,
        "entries": len(records),
        "bytes": total,
        "bytes_per_sample": total / n if samples else 0,
        "bytes_per_sample_by_key": {k: per_key.get(k, 0) / n for k in (manifest.keys or sorted(per_key))},
        "models": manifest.model_digests,
        "settings": manifest.settings,
        "made_with": manifest.made_with,
        "unsafe_files": [str(p) for p in cache.unsafe_files()],
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover

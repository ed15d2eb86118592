"""The stage-1 cache folder: content-addressed entries, a manifest with checksums, per-process journals, shards.

A cache lives in a local folder or under an `s3://bucket/prefix` (store.py gives both the same few
operations). Its layout (docs/cache.md has the full story):

    manifest.json                       format, status, the plan and its fingerprint, what the entry keys
                                        were derived from (`key_inputs`), the arguments stage 1 ran with
                                        (`made_with`), the samples (index, sample_id, key), one record per
                                        entry (file, size, sha256; offset in a shard) and the skipped samples
    entries/<key>.safetensors           one file per distinct entry key (layout `files`, the default)
    shards/rank-<r>-<run>-<n>.ugshard   or many entries back to back in one object (layout `shards`)
    journal/rank-<r>.jsonl              while stage 1 runs: one line per entry process r finished
    journal/rank-<r>/<run>-<n>.jsonl    (on an object store, which has no append: one object per batch)
    hashes.json                         sha256 of model weights and data files, keyed by path, size, mtime
    .lock                               held by the process that fills the cache (a lease on an object store),
                                        removed when it is done: left only by a process that was killed

An entry's key and what it is made of: keys.py. An entry's bytes (safetensors plus JSON, never pickle):
entries.py. Checking and describing a finished cache: verify.py.

Crash safety: an entry (or a shard) is written whole (locally: a temporary file, fsynced and
renamed; on an object store: one PUT, which S3 shows only once complete), then recorded (size and
sha256) in its process's journal. The main process merges journals into the manifest before and
after the work, under the lock, so no two processes ever write the manifest and an interrupted run
leaves only complete, recorded entries (an entry written but not yet recorded is recomputed).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from unitgraph.atomic import temp_target
from unitgraph.errors import path_missing
from unitgraph.userfiles import parse_user_json, read_user_json

from ..errors import BackendError
from .entries import HEADER_KEY, entry_bytes, parse_entry, safetensors_header
from .keys import HashMemo, sha256_bytes, sha256_file
from .manifest import ENTRY_FIELDS, FORMAT, Manifest, describe_plan_change

if TYPE_CHECKING:
    from .store import Journal, Store

MANIFEST = "manifest.json"
ENTRIES = "entries"
JOURNAL = "journal"
LOCK = ".lock"
SHARDS = "shards"
SHARD_SUFFIX = ".ugshard"  # not .bin: a cache never holds a file of a pickle-able suffix
SHARD_ENTRIES = 256  # entries per shard ...
SHARD_BYTES = 64 << 20  # ... or bytes, whichever comes first
ENTRY_SUFFIX = ".safetensors"
# Files that can run code when loaded (pickle and formats built on it). A cache never contains
# them; one found in a cache folder is ignored with a warning, never opened.
UNSAFE_SUFFIXES = (".pkl", ".pickle", ".pth", ".pt", ".ckpt", ".bin", ".joblib", ".dill", ".npy", ".npz")


# ------------------------------------------------------------------------------------------------
# the cache


def sample_label(sample: dict[str, Any]) -> str:
    index = int(sample["index"])
    sid = str(sample.get("sample_id") or "")[:12]
    if sample.get("dataset") is not None:  # --dataset_config: the row of its own dataset's metadata
        place = f"dataset {sample['dataset']!r} metadata row {sample.get('row', '?')}"
    else:
        place = f"metadata row {index + 1}"
    return f"sample {index} ({place}{', id ' + sid if sid else ''})"


def entry_record(record: Any) -> Optional[dict[str, Any]]:
    """The manifest record ({key, file, size, sha256} and a shard entry's offset) of a journal record, or None."""
    if not isinstance(record, dict) or not all(k in record for k in ENTRY_FIELDS):
        return None
    out = {k: record[k] for k in ENTRY_FIELDS}
    if record.get("offset") is not None:  # an entry in a shard (at 0 too)
        out["offset"] = int(record["offset"])
    return out


_ENTRY_NAME = re.compile(rf"^{ENTRIES}/[0-9a-f]{{64}}{re.escape(ENTRY_SUFFIX)}$")
_SHARD_NAME = re.compile(rf"^{SHARDS}/rank-\d+-[0-9a-f]+-[0-9a-f]+-\d+{re.escape(SHARD_SUFFIX)}$")


def _is_cache_temp(name: str) -> bool:
    """A temporary file of an atomic write of a cache file (JSON, safetensors, a shard): never a user's ".notes.tmp"."""
    target = temp_target(name)
    return target is not None and target.endswith((".json", ENTRY_SUFFIX, SHARD_SUFFIX))


class Cache:
    """One cache: a local folder or an object-store prefix (store.py; see the module docstring for the layout)."""

    def __init__(self, location: "str | Path | Store"):
        from .location import open_store
        from .store import Store

        self.store = location if isinstance(location, Store) else open_store(location)
        self.location = self.store.location  # as given, for messages and commands to copy
        self.local = self.store.local

    # --- names -----------------------------------------------------------------------------------
    @property
    def folder(self) -> Path:
        """The cache folder of a local cache (object-store caches have none)."""
        if not self.local:
            raise AttributeError("an object-store cache has no local folder")
        return self.store.root  # type: ignore[attr-defined]

    def describe(self, rel: str = "") -> str:
        return self.store.describe(rel)

    @property
    def manifest_path(self) -> str:
        return self.describe(MANIFEST)

    @staticmethod
    def entry_name(key: str) -> str:
        return f"{ENTRIES}/{key}{ENTRY_SUFFIX}"

    def entry_file(self, key: str) -> Path:
        """The entry file of a local cache's one-file entry `key`."""
        return self.folder / self.entry_name(key)

    def entry_path(self, sample_id: str) -> Path:
        """The entry file of the sample with this id, looked up in the manifest (for readers keyed by sample id).

        Reading through this path skips the checksum; `load_entry` checks it.
        """
        if getattr(self, "_by_sample_id", None) is None:  # sample id -> entry file, made once (stage 2 asks every step)
            manifest = self.read_manifest()
            samples = manifest.samples if manifest is not None else []
            self._by_sample_id = {str(s["sample_id"]): self.entry_file(str(s["key"])) for s in samples}
        path = self._by_sample_id.get(str(sample_id))
        if path is None:
            raise BackendError(f"no cache entry for sample id {str(sample_id)[:12]} in the manifest", source=self.location)
        return path

    def memo(self) -> HashMemo:
        return HashMemo(self.store)

    def check_owned(self) -> None:
        """Stage 1 writes only into a new or empty folder (or prefix) or a unitgraph cache; anything else is refused.

        (A folder holding only the lock is a first run that was killed before its manifest; a run that ends, even with
        an error, removes its lock file.)
        """
        if self.local:
            if self.folder.is_symlink() and not self.folder.exists():
                raise BackendError(path_missing(self.folder), source=self.location)  # a dangling link or a loop
            if not self.folder.exists():
                return
            if not self.folder.is_dir():
                raise BackendError("is a file, not a cache folder; choose another --output_path/--cache_path",
                                   source=self.location)
        if self.read_manifest() is not None:
            return
        if self.local:
            foreign = sorted(p.name for p in self.folder.iterdir() if p.name != LOCK and not _is_cache_temp(p.name))
        else:
            foreign = sorted({rel.split("/", 1)[0] for rel in self.store.list() if rel != LOCK})
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            where = "folder" if self.local else "prefix"
            raise BackendError(f"is not empty and not a unitgraph cache (it holds {shown}, no manifest.json); unitgraph "
                               f"writes only into a new, empty or own {where}: choose another --output_path/--cache_path",
                               source=self.location)

    # --- manifest --------------------------------------------------------------------------------
    def read_manifest(self) -> Optional[Manifest]:
        """The cache's manifest (None when it has none), checked against its schema."""
        if self.local:
            if self.folder.exists() and not self.folder.is_dir():
                raise BackendError("is a file, not a cache folder", source=self.location)
            if not (self.folder / MANIFEST).is_file():
                return None
            try:
                data = read_user_json(self.folder / MANIFEST, BackendError, "a cache manifest", max_bytes=1 << 30)
            except BackendError as exc:
                raise BackendError(f"unreadable cache manifest ({exc.message}); delete the cache folder and run the "
                                   "data_process stage again", source=self.manifest_path) from None
        else:
            try:
                raw = self.store.read(MANIFEST)
            except FileNotFoundError:
                return None
            try:
                data = parse_user_json(raw.decode("utf-8"), self.manifest_path, BackendError)
            except (UnicodeDecodeError, BackendError) as exc:
                reason = exc.message if isinstance(exc, BackendError) else "not UTF-8"
                raise BackendError(f"unreadable cache manifest ({reason}); delete the cache prefix and run the "
                                   "data_process stage again", source=self.manifest_path) from None
        if isinstance(data, dict) and isinstance(data.get("format"), str) and data["format"] != FORMAT \
                and data["format"].startswith("unitgraph.cache/"):
            return Manifest.from_dict(data, self.location)  # raises: another version's cache
        return Manifest.from_dict(data, self.manifest_path)

    def write_manifest(self, manifest: Manifest) -> None:
        self.store.write(MANIFEST, (json.dumps(manifest.to_dict(), indent=1, sort_keys=True) + "\n").encode("utf-8"))

    def open_for_training(self, plan: Any, task: str = "sft") -> Manifest:
        """The manifest of a complete cache made under `plan`; a one-line BackendError otherwise.

        `task` (the --task family) only shapes the advice in the message.
        """
        if self.local and not self.folder.is_dir():
            what = path_missing(self.folder) if not self.folder.exists() else "is not a folder"
            raise BackendError(f"cache folder {what} (run the data_process stage first)", source=self.location)
        manifest = self.read_manifest()
        if manifest is None:
            where = "a cache folder" if self.local else "a cache (no manifest.json under this prefix)"
            raise BackendError(f"no manifest.json: not {where} (run the data_process stage first)", source=self.location)
        if manifest.plan_fingerprint != plan.fingerprint:
            raise BackendError(
                f"cache was made under another plan ({describe_plan_change(manifest, plan)}); train with the "
                "--trainable_models/--lora_base_model/--cache_mode (and --caption_dropout, --vae_latents) it was made with, or build this plan's cache in another "
                f"folder (--task {task}:data_process, or --task {task}:split)",
                source=self.location)
        if not manifest.complete:
            raise BackendError(f"cache is incomplete ({len(manifest.entries)} entries; its data_process stage did not finish): "
                               "re-run the data_process stage to complete it", source=self.location)
        return manifest

    # --- hygiene ---------------------------------------------------------------------------------
    def unsafe_files(self, listing: Optional[dict[str, int]] = None) -> list[str]:
        """Pickle-like files in the cache: never loaded, reported so the user knows.

        `listing`: the cache's `store.list()` when the caller has it already (on an object store each
        listing is a request, paged by a thousand objects)."""
        if listing is None:
            if self.local and not self.folder.is_dir():
                return []
            listing = self.store.list()
        return sorted(self.describe(rel) for rel in listing if Path(rel).suffix.lower() in UNSAFE_SUFFIXES)

    def warn_unsafe(self, warn: Callable[[str], None], listing: Optional[dict[str, int]] = None) -> None:
        for path in self.unsafe_files(listing):
            warn(f"warning: ignoring {path}: unitgraph never loads {Path(path).suffix} files (they can run code); "
                 "caches hold only safetensors and JSON")

    def clean_temp_files(self) -> int:
        """Temporary files left by an interrupted atomic write (main process, under the lock; local folders)."""
        removed = 0
        if not self.local:
            return removed  # an object store has no temporary objects: a PUT is whole or absent
        for folder in (self.folder, self.folder / ENTRIES, self.folder / SHARDS):
            if folder.is_dir():
                for path in folder.glob(".*.tmp"):
                    if _is_cache_temp(path.name):  # never a user's ".notes.tmp"
                        path.unlink(missing_ok=True)
                        removed += 1
        return removed

    def locked(self) -> contextlib.AbstractContextManager:
        """Exclusive right to fill this cache (see store.py: flock locally, a lease on an object store)."""
        return self.store.locked("another unitgraph process is filling this cache; wait for it to finish or choose "
                                 "another cache folder")

    def prune(self, keep: set[str], records: dict[str, dict[str, Any]]) -> int:
        """Remove entry files and shards that no record of a key in `keep` points to; how many were removed.

        Only files this cache can prove it wrote go: one a manifest record names, or one named as entries and
        shards are named (`entries/<sha256>.safetensors`, `shards/rank-<r>-<run>-<n>.ugshard`) that, for a local
        entry, carries the cache's own header. Anything else a user put inside is left alone."""
        used = {records[k]["file"] for k in keep if k in records}
        recorded = {r["file"] for r in records.values()}
        removed = 0
        for rel in list(self.store.list(ENTRIES)) + list(self.store.list(SHARDS)):
            if rel in used or not (rel in recorded or self._made_here(rel)):
                continue
            self.store.delete(rel)
            removed += 1
        return removed

    def _made_here(self, rel: str) -> bool:
        """Whether an unrecorded file under entries/ or shards/ is one this cache wrote (a killed run's, say)."""
        if _SHARD_NAME.match(rel):
            return True
        if not _ENTRY_NAME.match(rel):
            return False
        if not self.local:
            return True  # the name alone: reading every header would be a request each
        try:
            with (self.folder / rel).open("rb") as handle:
                head = handle.read(1 << 16)
            return HEADER_KEY in safetensors_header(head, rel).get("__metadata__", {})
        except (OSError, BackendError, ValueError):
            return False

    # --- journals --------------------------------------------------------------------------------
    def journal(self, rank: int) -> "Journal":
        return self.store.journal(f"{JOURNAL}/rank-{rank}")

    def read_journals(self) -> list[dict[str, Any]]:
        """Every complete record of every process's journal (a line cut short by a crash is ignored)."""
        return self.store.journal_records(JOURNAL)

    def clear_journals(self) -> None:
        for rel in self.store.list(JOURNAL):
            self.store.delete(rel)
        if self.local:
            for folder in sorted((p for p in (self.folder / JOURNAL).rglob("*") if p.is_dir()), reverse=True):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            with contextlib.suppress(OSError):
                (self.folder / JOURNAL).rmdir()

    # --- entries ---------------------------------------------------------------------------------
    def writer(self, rank: int, layout: str = "files") -> "EntryWriter":
        """Where process `rank` stores the entries it computes, each recorded in its journal once it is in place."""
        return ShardWriter(self, rank) if layout == "shards" else EntryWriter(self, rank)

    def store_entry(self, key: str, values: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        """Write one entry as its own file, atomically; its record (file, size, sha256) for the manifest."""
        data = entry_bytes(values, meta)
        rel = self.entry_name(key)
        self.store.write(rel, data)
        return {"key": key, "file": rel, "size": len(data), "sha256": sha256_bytes(data)}

    def entry_data(self, record: dict[str, Any]) -> bytes:
        """The bytes of one entry (a shard entry: a ranged read); FileNotFoundError when it is gone."""
        if "offset" not in record:
            return self.store.read(record["file"])
        offset = int(record["offset"])
        return self.store.read_range(record["file"], offset, offset + int(record["size"]))

    def entry_header(self, record: dict[str, Any]) -> dict[str, Any]:
        """The safetensors header of one entry, read alone (two small ranged reads)."""
        offset = int(record.get("offset", 0))
        head = self.store.read_range(record["file"], offset, offset + 8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        if size <= 0 or size > min(int(record["size"]) - 8, 100 << 20):
            raise ValueError("bad safetensors header length")
        data = head + self.store.read_range(record["file"], offset + 8, offset + 8 + size)
        return safetensors_header(data, self.describe(record["file"]))

    def check_entry(self, record: dict[str, Any]) -> Optional[str]:
        """None when the entry has the recorded size and checksum; the problem otherwise."""
        size = self.store.size(record["file"])
        if size is None:
            return "entry file is missing"
        end = int(record.get("offset", 0)) + int(record["size"])
        if ("offset" in record and size < end) or ("offset" not in record and size != record["size"]):
            return f"entry file has {size} bytes, expected {end} (truncated or overwritten)"
        try:
            data = self.entry_data(record) if "offset" in record or not self.local else None
        except FileNotFoundError:
            return "entry file is missing"
        digest = sha256_bytes(data) if data is not None else sha256_file(self.folder / record["file"])
        if digest != record["sha256"]:
            return "entry file does not match its checksum (corrupted)"
        return None

    def check_entries(self, records: list[dict[str, Any]]) -> list[Optional[str]]:
        """`check_entry` of each record, concurrently on an object store (one GET each, READ_THREADS at a time)."""
        if self.local or len(records) <= 1:
            return [self.check_entry(r) for r in records]
        from concurrent.futures import ThreadPoolExecutor

        from .store import READ_THREADS

        with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            return list(pool.map(self.check_entry, records))

    def load_entry(self, record: dict[str, Any], label: str, verify: bool = True,
                   data: Optional[bytes] = None) -> dict[str, Any]:
        """The values of one entry, checked against its record (size always, checksum when `verify`).

        `data`: the entry's bytes when they were read already (read-ahead)."""
        shown = self.describe(record["file"])
        hint = f"run 'unitgraph cache repair {self.location}' or the data_process stage again"
        if data is None:
            try:
                data = self.entry_data(record)
            except FileNotFoundError:
                raise BackendError(f"cache entry of {label} is missing; {hint}", source=shown) from None
            except OSError as exc:
                raise BackendError(f"cache entry of {label} is unreadable ({exc.strerror or exc}); {hint}",
                                   source=shown) from None
        if len(data) != record["size"]:
            raise BackendError(f"cache entry of {label} has {len(data)} bytes, expected {record['size']} "
                               f"(truncated or overwritten); {hint}", source=shown)
        if verify and sha256_bytes(data) != record["sha256"]:
            raise BackendError(f"cache entry of {label} does not match its checksum (corrupted); {hint}", source=shown)
        values, _ = parse_entry(data, shown)
        return values


class EntryWriter:
    """One file per entry: written whole (rename or one PUT), then recorded in the process's journal."""

    def __init__(self, cache: Cache, rank: int):
        self.cache, self.rank = cache, rank
        self.journal = cache.journal(rank)

    def add(self, key: str, values: dict[str, Any], meta: dict[str, Any]) -> None:
        record = self.cache.store_entry(key, values, meta)
        self.journal.append({**record, "index": meta.get("index"), "rank": self.rank})

    def close(self) -> None:
        self.journal.close()

    def __enter__(self) -> "EntryWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ShardWriter(EntryWriter):
    """Entries packed into shard objects (`shards/rank-<r>-<run>-<n>.ugshard`): the bytes of whole entries back to
    back, each entry recorded with its offset.

    A shard is written once, whole and only if absent, when it holds SHARD_ENTRIES entries or SHARD_BYTES
    (and at close); its entries' records go to the journal right after, in one flush. A kill before that
    leaves a shard no record points to: its entries are computed again and the unreferenced shard is
    removed when the cache is next completed. Keys stay per entry: content-keyed reuse and invalidation
    work exactly as with one file per entry.
    """

    def __init__(self, cache: Cache, rank: int):
        super().__init__(cache, rank)
        self.run = f"{int(time.time()):x}-{os.urandom(4).hex()}"
        self.count = 0
        self.parts: list[bytes] = []
        self.pending: list[dict[str, Any]] = []
        self.size = 0

    def add(self, key: str, values: dict[str, Any], meta: dict[str, Any]) -> None:
        data = entry_bytes(values, meta)
        self.pending.append({"key": key, "offset": self.size, "size": len(data), "sha256": sha256_bytes(data),
                             "index": meta.get("index"), "rank": self.rank})
        self.parts.append(data)
        self.size += len(data)
        if len(self.pending) >= SHARD_ENTRIES or self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        rel = f"{SHARDS}/rank-{self.rank}-{self.run}-{self.count:05d}{SHARD_SUFFIX}"
        if not self.cache.store.create(rel, b"".join(self.parts)):  # pragma: no cover - names are unique per run
            raise BackendError("a shard of this name exists already", source=self.cache.describe(rel))
        for record in self.pending:
            self.journal.append({**record, "file": rel})
        self.journal.flush()
        self.count, self.parts, self.pending, self.size = self.count + 1, [], [], 0

    def close(self) -> None:
        self.flush()
        super().close()

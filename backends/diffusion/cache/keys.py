"""What an entry key is made of: sha256 of files (remembered in the cache's hashes.json) and of canonical JSON.

An entry's key is the sha256 of everything its values depend on, read off the plan: the unit list,
the settings those units read, the weights of the models they call, and the sample's dataset
values that stage 1 reads (file bytes, metadata fields). Two samples with the same inputs share
one entry; a changed input gives a new key, so a stale entry can never be mistaken for a fresh one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from unitgraph.userfiles import parse_user_json

from ..errors import BackendError

if TYPE_CHECKING:
    from .store import Store

HASHES_FORMAT = "unitgraph.hashes/v1"
HASHES = "hashes.json"
# A file modified this close to the moment it was hashed may change again without a visible
# mtime change (coarse timestamps): its remembered hash is not trusted (git's "racily clean").
RACY_NS = 2_000_000_000


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
    """sha256 of files, remembered in the cache (`hashes.json`, JSON) keyed by path, size, mtime (and inode, ctime).

    Weights are hashed once per file version: a later run only stats them. `hashed` lists the
    files this memo actually read. A memo made on another machine never matches (its inodes differ):
    it only costs hashing again.
    """

    def __init__(self, store: Optional["Store"], rel: str = HASHES):
        self.store, self.rel = store, rel
        self.files: dict[str, dict[str, Any]] = {}
        self.hashed: list[Path] = []
        self.touched: set[str] = set()
        self.dirty = False
        if store is None:
            return
        try:
            data = parse_user_json(store.read(rel).decode("utf-8", errors="replace"), store.describe(rel), BackendError)
            if isinstance(data, dict) and data.get("format") == HASHES_FORMAT and isinstance(data.get("files"), dict):
                self.files = data["files"]
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, BackendError):
            self.files = {}  # none yet, or a damaged memo: that only costs re-hashing

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
        if self.store is None or not self.dirty or not self.store.exists():
            return
        text = json.dumps({"format": HASHES_FORMAT, "files": self.files}, sort_keys=True) + "\n"
        self.store.write(self.rel, text.encode("utf-8"))
        self.dirty = False


def model_files_digest(files_by_slot: dict[str, list[Path]], digest: Callable[[Path], str] = sha256_file) -> dict[str, dict[str, str]]:
    """{slot: {parent/name: sha256}}: what the stage-1 models are, independent of where they live."""
    return {slot: {f"{p.parent.name}/{p.name}": digest(p) for p in files} for slot, files in sorted(files_by_slot.items())}

"""Where a stage-1 cache lives, behind the few operations the cache needs: the interface, and its local-folder form.

The object-store form (a prefix of an S3-compatible bucket) is object_store.py; location.py turns a path or URL
into the store.

The cache's guarantees (cache.py: entries visible only when complete, exact-once over processes,
resume after a kill) rest on seven operations. Each has a local form and an object-store form:

    operation                   local folder                    object store (fsspec / s3fs)
    read, ranged read           open, seek, read                GET, GET with Range
    write, seen only whole      temp file, fsync, rename        one PUT: S3 shows an object only once
                                                                its upload completed, never half of it
    create only if absent       O_CREAT | O_EXCL                PUT with If-None-Match: * (412 if present)
    list under a prefix         walk the folder                 LIST, never from a listings cache (another
                                                                node's writes must show at once)
    delete                      unlink                          DELETE
    the filler's lock           flock (the kernel frees it      a lease object: created only if absent,
                                when the process dies)          renewed by a heartbeat; one not renewed for
                                                                LEASE_S, or held by a dead process of this
                                                                host, is stale and taken over
    a process's journal         one line appended and fsynced   numbered segment objects, one PUT per flush
                                per entry                       (every JOURNAL_BATCH records or
                                                                JOURNAL_SECONDS, and at close);
                                                                an entry whose record was not flushed yet
                                                                when a kill came is computed again

`location.open_store(location)` takes a plain path, a `file://` URL or an `s3://bucket/prefix` URL. Credentials,
region and endpoint come only from where botocore looks for them (the AWS_* variables, including
AWS_ENDPOINT_URL, and the AWS config files): this module never reads, stores or prints them, and a URL
that carries them (`s3://key:secret@bucket`) is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from unitgraph.atomic import write_bytes_atomic
from unitgraph.errors import OutputError

from ..errors import BackendError

__all__ = ["Store", "Journal", "LocalStore", "READ_THREADS", "take_flock", "release_flock", "missing_folders",
           "remove_empty_folders"]

READ_THREADS = 16  # concurrent GETs of a batched read


class Store:
    """The operations of the module docstring; `rel` names are '/'-separated and relative to the store's root."""

    location: str  # as shown in messages
    local: bool

    def describe(self, rel: str = "") -> str:
        raise NotImplementedError

    def exists(self) -> bool:
        """Whether the root holds anything (a folder that exists; a prefix with an object under it)."""
        raise NotImplementedError

    def read(self, rel: str) -> bytes:
        """The whole object; FileNotFoundError when there is none."""
        raise NotImplementedError

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        raise NotImplementedError

    def read_many(self, rels: list[str]) -> dict[str, Any]:
        """{rel: bytes, or the exception reading it raised}, read concurrently on an object store."""
        out: dict[str, Any] = {}
        for rel in rels:
            try:
                out[rel] = self.read(rel)
            except Exception as exc:  # handed back, not raised: the caller names the entry
                out[rel] = exc
        return out

    def write(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data`; a reader sees the old object or the new one, never part of either."""
        raise NotImplementedError

    def create(self, rel: str, data: bytes) -> bool:
        """Write `rel` only if there is no such object yet; False (nothing written) when there is."""
        raise NotImplementedError

    def size(self, rel: str) -> Optional[int]:
        raise NotImplementedError

    def list(self, prefix: str = "") -> dict[str, int]:
        """{rel: size} of every object under `prefix` (recursively)."""
        raise NotImplementedError

    def delete(self, rel: str) -> None:
        """Remove `rel` (nothing when it is not there)."""
        raise NotImplementedError

    def locked(self, busy_message: str) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def journal(self, name: str) -> "Journal":
        raise NotImplementedError

    def journal_records(self, prefix: str) -> list[dict[str, Any]]:
        """Every complete record of every journal under `prefix` (a line a crash cut short is ignored)."""
        records = []
        names = sorted(rel for rel in self.list(prefix) if rel.endswith(".jsonl"))
        for rel, data in self.read_many(names).items():
            if isinstance(data, Exception):
                continue  # removed meanwhile
            for line in data.decode("utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
        return records


class Journal:
    """A process's record of the entries it finished (append, flush, close)."""

    def append(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make every appended record durable now."""

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
# a local folder's lock: an flock on a file that is removed when its holder is done

LOCK_NAME = ".lock"
LOCK_TRIES = 100  # a lock file removed and made again between our open and our lock, this many times in a row: busy


def take_flock(path: Path) -> int:
    """An exclusive flock on the file `path` (created when absent), taken without waiting; its open descriptor.

    BlockingIOError when another process holds it, OSError when the file cannot be opened (a read-only folder).
    A holder removes the file when it is done (`release_flock`), so a process that opened the file just before
    that and locks it just after would hold a lock on a file no longer there, while a third process creates a new
    one and locks that: both would go ahead. So, once locked, the descriptor's file must still be the one `path`
    names; when it is not, the lock is taken again on the file that is there now.
    """
    import fcntl

    for _ in range(LOCK_TRIES):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, path, follow=True):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the file was removed (or replaced) after we opened it: lock the one there now
    raise BlockingIOError(f"{path}: the lock file keeps being replaced")


def release_flock(fd: int, path: Path) -> None:
    """Remove the lock file (only while holding its lock, and only when `path` still names that very file: never a
    newer lock file, a symlink or a user's file put in its place), then close the descriptor, which releases it."""
    try:
        if _same_file(fd, path, follow=False):
            os.unlink(path)
    except OSError:
        pass  # left in place: an empty lock file is harmless and taken again by the next holder
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path, follow: bool) -> bool:
    mine = os.fstat(fd)
    try:
        there = os.stat(path, follow_symlinks=follow)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(there.st_mode) and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first: what creating it will create."""
    missing = []
    for path in (Path(folder), *Path(folder).parents):
        if path.exists() or path.is_symlink():
            break
        missing.append(path)
    return missing


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove each of `folders` (deepest first) that is still an empty folder: one that holds anything stays."""
    for path in folders:
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()  # refused when not empty: nothing in it is ever removed
        except OSError:
            return  # not empty (or not ours to remove): its parents are not empty either


# ------------------------------------------------------------------------------------------------
# a local folder


class LocalStore(Store):
    """A cache folder on a local (or mounted) file system."""

    local = True

    def __init__(self, root: Path):
        self.root = Path(root)
        self.location = str(self.root)

    def path(self, rel: str = "") -> Path:
        return self.root / rel if rel else self.root

    def describe(self, rel: str = "") -> str:
        return str(self.path(rel))

    def exists(self) -> bool:
        return self.root.exists()

    def read(self, rel: str) -> bytes:
        return self.path(rel).read_bytes()

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        with self.path(rel).open("rb") as handle:
            handle.seek(start)
            return handle.read(end - start)

    def write(self, rel: str, data: bytes) -> None:
        write_bytes_atomic(self.path(rel), data)

    def create(self, rel: str, data: bytes) -> bool:
        path = self.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with tmp.open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)  # fails when `path` exists: create-if-absent, and whole when it appears
            except FileExistsError:
                return False
            except OSError:  # a file system without hard links: exclusive create (seen only once recorded)
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
            return True
        except OSError as exc:
            raise OutputError(f"cannot write ({exc.strerror or exc})", source=str(path)) from None
        finally:
            tmp.unlink(missing_ok=True)

    def size(self, rel: str) -> Optional[int]:
        try:
            return self.path(rel).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self.path(prefix)
        if not base.is_dir():
            return {}
        out = {}
        for path in base.rglob("*"):
            if path.is_file() and not path.name.endswith(".tmp"):
                out[path.relative_to(self.root).as_posix()] = path.stat().st_size
        return out

    def delete(self, rel: str) -> None:
        self.path(rel).unlink(missing_ok=True)

    @contextlib.contextmanager
    def locked(self, busy_message: str) -> Iterator[None]:
        """Exclusive right to fill this cache (released by the kernel if the process dies); the lock file is removed
        when the holder is done. The folders it had to create (the cache folder, and its parents: OUTPUT of a
        `:split`) are removed again when the holder fails and leaves them empty."""
        created = missing_folders(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK_NAME
        try:
            fd = take_flock(path)
        except BlockingIOError:
            remove_empty_folders(created)
            raise BackendError(busy_message, source=self.location) from None
        except BaseException:
            remove_empty_folders(created)
            raise
        try:
            yield
        except BaseException:
            release_flock(fd, path)
            remove_empty_folders(created)
            raise
        release_flock(fd, path)

    def journal(self, name: str) -> Journal:
        return _FileJournal(self.path(f"{name}.jsonl"))


class _FileJournal(Journal):
    """Append-only JSON lines, each fsynced."""

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

"""Where a stage-1 cache lives: a local folder or a prefix of an S3-compatible bucket, behind the few
operations the cache needs.

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

`open_store(location)` takes a plain path, a `file://` URL or an `s3://bucket/prefix` URL. Credentials,
region and endpoint come only from where botocore looks for them (the AWS_* variables, including
AWS_ENDPOINT_URL, and the AWS config files): this module never reads, stores or prints them, and a URL
that carries them (`s3://key:secret@bucket`) is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

from unitgraph.atomic import write_bytes_atomic
from unitgraph.errors import OutputError

from .args import BackendError

__all__ = ["Store", "LocalStore", "ObjectStore", "open_store", "is_url", "LEASE_S", "JOURNAL_BATCH"]

LEASE_S = 60.0  # an object-store lock not renewed for this long belongs to a dead run
JOURNAL_BATCH = 32  # records per journal segment object at most ...
JOURNAL_SECONDS = 2.0  # ... and at most this old: a kill loses at most this much finished work
READ_THREADS = 16  # concurrent GETs of a batched read


def is_url(location: str | Path) -> bool:
    """Whether `location` names an object store (`s3://...`) rather than a local path."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def open_store(location: str | Path) -> "Store":
    """The store at `location`: a path or `file://` URL (a local folder) or `s3://bucket/prefix`.

    >>> open_store("/tmp/cache").describe("manifest.json")
    '/tmp/cache/manifest.json'

    Raises BackendError (one line) for an unsupported scheme or a URL carrying credentials.
    """
    if isinstance(location, Path):
        return LocalStore(location)
    text = str(location)
    if "://" not in text:
        return LocalStore(Path(text))
    parts = _split(text)
    if parts.scheme == "file":
        return LocalStore(Path(parts.path))
    if parts.scheme not in ("s3", "s3a"):
        raise BackendError(f"unsupported storage scheme {parts.scheme}:// (caches live in a local folder or at "
                           "s3://bucket/prefix)", source=_safe(text))
    if "@" in parts.netloc:
        raise BackendError("a cache URL must not carry credentials; set them in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                           "or the AWS config files", source=_safe(text))
    if not parts.netloc:
        raise BackendError("no bucket in the URL (expected s3://bucket/prefix)", source=text)
    if parts.query or parts.fragment:
        raise BackendError("a cache URL takes no query or fragment (expected s3://bucket/prefix)", source=_safe(text))
    return ObjectStore(parts.netloc, parts.path.strip("/"))


def _split(text: str) -> Any:
    try:
        return urlsplit(text)
    except ValueError as exc:  # e.g. an unclosed '[' (urllib reads it as an IPv6 host)
        raise BackendError(f"not a valid URL ({exc})", source=_safe(text)) from None


def _safe(text: str) -> str:
    """A URL for messages, with anything before '@' in its host part removed."""
    try:
        parts = urlsplit(text)
    except ValueError:
        return text.split("://", 1)[0] + "://..." if "@" in text else text
    if "@" not in parts.netloc:
        return text
    return f"{parts.scheme}://***@{parts.netloc.rsplit('@', 1)[1]}{parts.path}"


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
        """Exclusive right to fill this cache (released by the kernel if the process dies)."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BackendError(busy_message, source=self.location) from None
            yield
        finally:
            os.close(fd)

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


# ------------------------------------------------------------------------------------------------
# an S3-compatible bucket


def _object_errors(location: str):
    """Turn the object store's failures into one line naming the location (never a credential)."""

    @contextlib.contextmanager
    def translated() -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, FileExistsError, BackendError, OutputError):
            raise
        except PermissionError as exc:
            raise BackendError(f"access denied by the object store ({_first_line(exc)}); check the AWS credentials "
                               "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the AWS config files)",
                               source=location) from None
        except OSError as exc:
            raise BackendError(f"object store error ({_first_line(exc)})", source=location) from None
        except Exception as exc:
            name = type(exc).__name__
            if name == "NoCredentialsError":
                raise BackendError("no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the "
                                   "AWS config files)", source=location) from None
            if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError"):
                raise BackendError(f"cannot reach the object store ({_first_line(exc)}); check AWS_ENDPOINT_URL",
                                   source=location) from None
            if type(exc).__module__.startswith(("botocore", "aiobotocore", "aiohttp", "s3fs")):
                raise BackendError(f"object store error ({name}: {_first_line(exc)})", source=location) from None
            raise

    return translated


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class ObjectStore(Store):
    """A prefix of an S3-compatible bucket, through fsspec's s3fs."""

    local = False

    def __init__(self, bucket: str, prefix: str):
        self.bucket, self.prefix = bucket, prefix
        self.location = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.errors = _object_errors(self.location)
        self._fs: Any = None

    # s3fs is imported, and its client made, on first use (and anew in a process that unpickled this store)
    def __getstate__(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["bucket"], state["prefix"])

    @property
    def fs(self) -> Any:
        if self._fs is None:
            try:
                import s3fs
            except ImportError:
                raise BackendError("s3:// caches need s3fs (pip install s3fs)", source=self.location) from None
            # no listings cache and no shared instance: every listing and existence check asks the store, so
            # what another process or machine wrote shows at once
            self._fs = s3fs.S3FileSystem(use_listings_cache=False, skip_instance_cache=True)
            with self.errors():
                try:
                    self._fs.call_s3("head_bucket", Bucket=self.bucket)  # fails here, once, in one line
                except FileNotFoundError:
                    raise BackendError(f"bucket {self.bucket!r} does not exist (or is not visible with these "
                                       "credentials)", source=self.location) from None
        return self._fs

    def key(self, rel: str = "") -> str:
        return "/".join(p for p in (self.bucket, self.prefix, rel) if p)

    def describe(self, rel: str = "") -> str:
        return f"s3://{self.key(rel)}"

    def exists(self) -> bool:
        with self.errors():
            try:
                return bool(self.fs.ls(self.key(), refresh=True))
            except FileNotFoundError:
                return False

    def read(self, rel: str) -> bytes:
        with self.errors():
            return self.fs.cat_file(self.key(rel), start=0)  # one GET (without `start`, s3fs asks HEAD first)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        with self.errors():
            return self.fs.cat_file(self.key(rel), start=start, end=end)

    def read_many(self, rels: list[str]) -> dict[str, Any]:
        if len(rels) <= 1:
            return super().read_many(rels)
        with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(rels))) as pool:
            futures = {rel: pool.submit(self._read_or_error, rel) for rel in rels}
            return {rel: f.result() for rel, f in futures.items()}

    def _read_or_error(self, rel: str) -> Any:
        try:
            return self.read(rel)
        except Exception as exc:
            return exc

    def write(self, rel: str, data: bytes) -> None:
        with self.errors():
            self.fs.pipe_file(self.key(rel), data)

    def create(self, rel: str, data: bytes) -> bool:
        with self.errors():
            try:
                self.fs.pipe_file(self.key(rel), data, mode="create")  # If-None-Match: *
                return True
            except FileExistsError:
                return False

    def size(self, rel: str) -> Optional[int]:
        with self.errors():
            try:
                return int(self.fs.info(self.key(rel), refresh=True)["size"])
            except FileNotFoundError:
                return None

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self.key(prefix)
        root = self.key() + "/"
        with self.errors():
            try:
                found = self.fs.find(base, withdirs=False, detail=True)
            except FileNotFoundError:
                return {}
        out = {}
        for name, info in found.items():
            if name.startswith(root) and info.get("type", "file") == "file":
                out[name[len(root):]] = int(info.get("size") or 0)
        return out

    def delete(self, rel: str) -> None:
        with self.errors():
            try:
                self.fs.rm_file(self.key(rel))
            except FileNotFoundError:
                pass

    @contextlib.contextmanager
    def locked(self, busy_message: str) -> Iterator[None]:
        lease = _Lease(self, ".lock")
        lease.acquire(busy_message)
        try:
            yield
        finally:
            lease.release()

    def journal(self, name: str) -> Journal:
        return _SegmentJournal(self, name)


class _Lease:
    """The object-store lock: `.lock` holds who holds it and when it was last renewed.

    Created only if absent (If-None-Match), so two runs starting at once cannot both take it; a
    heartbeat thread renews it every LEASE_S / 4. A lease is stale, and is taken over, when it was
    not renewed for LEASE_S, or when it names a process of this host that is gone (a run killed a
    moment ago: its successor need not wait).
    """

    def __init__(self, store: ObjectStore, rel: str):
        self.store, self.rel = store, rel
        self.token = uuid.uuid4().hex
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _body(self) -> bytes:
        return json.dumps({"format": "unitgraph.lease/v1", "token": self.token, "host": self.host, "pid": self.pid,
                           "renewed": time.time()}).encode()

    def acquire(self, busy_message: str) -> None:
        for _ in range(3):
            if self.store.create(self.rel, self._body()):
                self._thread = threading.Thread(target=self._renew, name="unitgraph-lease", daemon=True)
                self._thread.start()
                return
            holder = self._holder()
            if holder is None or self._stale(holder):
                self.store.delete(self.rel)  # our own kind of object, left by a dead run
                continue
            raise BackendError(f"{busy_message} (held by {holder.get('host')} pid {holder.get('pid')}, renewed "
                               f"{max(0, time.time() - float(holder.get('renewed', 0))):.0f} s ago)",
                               source=self.store.location)
        raise BackendError(busy_message, source=self.store.location)

    def _holder(self) -> Optional[dict[str, Any]]:
        try:
            data = json.loads(self.store.read(self.rel))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _stale(self, holder: dict[str, Any]) -> bool:
        try:
            renewed = float(holder.get("renewed", 0))
        except (TypeError, ValueError):
            return True
        if time.time() - renewed > LEASE_S:
            return True
        if holder.get("host") == self.host:
            try:
                os.kill(int(holder.get("pid", -1)), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, ValueError, TypeError, OverflowError):
                return False
        return False

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 4):
            with contextlib.suppress(Exception):  # a missed renewal is retried; the lease lasts LEASE_S
                self.store.write(self.rel, self._body())

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            holder = self._holder()
            if holder is not None and holder.get("token") == self.token:
                self.store.delete(self.rel)


class _SegmentJournal(Journal):
    """A process's journal on an object store: `<name>/<run>-<n>.jsonl` segment objects, each written once.

    There is no append on an object store: records are buffered and written as a new segment every
    JOURNAL_BATCH records or JOURNAL_SECONDS, and at close (and when the writer calls `flush`, e.g. right
    after a shard).
    """

    def __init__(self, store: ObjectStore, name: str):
        self.store, self.name = store, name
        self.run = f"{int(time.time()):x}-{uuid.uuid4().hex[:8]}"
        self.buffer: list[str] = []
        self.count = 0
        self.since = time.monotonic()  # when the oldest buffered record was appended

    def append(self, record: dict[str, Any]) -> None:
        if not self.buffer:
            self.since = time.monotonic()
        self.buffer.append(json.dumps(record, sort_keys=True))
        if len(self.buffer) >= JOURNAL_BATCH or time.monotonic() - self.since >= JOURNAL_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        data = ("\n".join(self.buffer) + "\n").encode("utf-8")
        try:
            self.store.create(f"{self.name}/{self.run}-{self.count:06d}.jsonl", data)
        except BackendError as exc:
            raise BackendError(f"cannot write the stage-1 journal ({exc.message}); the entries recorded so far are kept "
                               "and the next run computes only the rest", source=self.store.describe(self.name)) from None
        self.buffer, self.count = [], self.count + 1

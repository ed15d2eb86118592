"""A cache on an S3-compatible bucket: the store's operations over fsspec/s3fs, the filler's lease, journal segments.

store.py's table says how each operation maps to the object store; credentials come only from where
botocore looks for them and are never read, stored or printed here.
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
from typing import Any, Iterator, Optional

from unitgraph.errors import OutputError

from ..errors import BackendError
from .store import READ_THREADS, Journal, Store

LEASE_S = 60.0  # an object-store lock not renewed for this long belongs to a dead run
JOURNAL_BATCH = 32  # records per journal segment object at most ...
JOURNAL_SECONDS = 2.0  # ... and at most this old: a kill loses at most this much finished work


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


# One S3 filesystem per process and AWS configuration, kept for the process's life. s3fs closes a filesystem's
# session in a weakref finalizer that blocks on its event loop (up to 0.1 s); a filesystem per store, dropped
# while a run goes on, ran that finalizer mid-run, and a Ctrl-C landing in it was swallowed ("Exception ignored
# in weakref callback") and the run went on. Kept alive, the finalizer runs only at the interpreter's exit, and
# Ctrl-C always lands in the run's own code: KeyboardInterrupt propagates (exit 130, one line).
_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}


def _filesystem(s3fs: Any) -> Any:
    """The process's S3 filesystem for the current AWS_* variables (a forked worker makes its own): no listings
    cache, so every listing and existence check asks the store and what another process wrote shows at once."""
    key = (os.getpid(), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    fs = _FILESYSTEMS.get(key)
    if fs is None:  # two threads at once: one instance is kept; the other never connected, so it has no finalizer
        fs = _FILESYSTEMS.setdefault(key, s3fs.S3FileSystem(use_listings_cache=False, skip_instance_cache=True))
    return fs


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
            self._fs = _filesystem(s3fs)
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
        with self.errors(), self._bucket_gone():
            self.fs.pipe_file(self.key(rel), data)

    def create(self, rel: str, data: bytes) -> bool:
        with self.errors(), self._bucket_gone():
            try:
                self.fs.pipe_file(self.key(rel), data, mode="create")  # If-None-Match: *
                return True
            except FileExistsError:
                return False

    @contextlib.contextmanager
    def _bucket_gone(self) -> Iterator[None]:
        """A write that finds nothing to write into: the bucket itself is gone (deleted while the run went on)."""
        try:
            yield
        except FileNotFoundError:
            raise BackendError(f"bucket {self.bucket!r} does not exist (deleted while this run was writing?); "
                               "the entries written before are lost with it: create the bucket and run again",
                               source=self.describe()) from None

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

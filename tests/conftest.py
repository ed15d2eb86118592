"""Fixtures shared by the backend tests."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest


def _threads_per_worker() -> None:
    """Under pytest-xdist (scripts/test.sh runs a worker per core), each worker's torch gets its share of the cores
    instead of all of them: OpenMP threads spinning for cores another worker holds made every worker slower than
    one process alone. Set before torch is imported; a value the caller exported wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


_threads_per_worker()


def pytest_runtest_setup(item):
    """A test of the backend starts with what earlier tests left alive frozen out of the garbage collector's sight.

    The suite's process holds ~900k long-lived objects (torch, diffusers and transformers as imported, the
    session's fixtures); every full collection walks them all, and the collections the backend tests' allocations
    trigger took a quarter of the suite's time (measured: 165 s of 686). Collecting first and then freezing
    (gc.freeze) leaves only the objects a test makes itself to be walked (on four of the heaviest test files: 5 s of
    collection in place of 59 s). The frozen objects are still freed by reference counting; only a reference cycle
    that dies later is kept until the end of the session.

    The core's tests (modules without torch) run with nothing frozen: the planner handles the collector itself
    (unitgraph/plan.py, gc_paused) and leaves a host that froze objects as it is, which they test.
    """
    if getattr(getattr(item, "module", None), "torch", None) is None:
        gc.unfreeze()
        return
    gc.collect()
    gc.freeze()


def pytest_runtest_call(item):
    """A test of the backend starts with the memory earlier tests and its fixtures freed handed back to the system
    (`_return_freed_memory`): a fixture may have written a released-size model, holding its weights a while."""
    if getattr(getattr(item, "module", None), "torch", None) is not None:
        _return_freed_memory()


def _return_freed_memory() -> None:
    """The memory freed so far, handed back to the system (glibc's malloc_trim).

    glibc keeps freed blocks below its mmap threshold for the process to reuse, and the threshold rises to 32 MB as
    large blocks are freed, so the weights of a model an earlier test loaded and dropped stay in the process: measured
    in the DiffSynth tests, 6.59 GB resident after Anima's step test with no tensor alive, 1.10 GB once trimmed. A
    later test loading an encoder of 17.5 GB (Boogu-Image's, in blocks larger than the threshold, so fresh pages) then
    went past the machine's 24 GiB. Where the C library has no malloc_trim (not glibc), nothing is done."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim(0)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A test-size Qwen-Image pipeline folder, written once per session. Tests that change model
    files work on a copy of it."""
    from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny") / "qwen", size="test", seed=0)


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server on 127.0.0.1 (tests/s3server.py), one for the session; the tests that use it
    are skipped with the reason when moto's server is not installed."""
    from s3server import start_server

    server = start_server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The server, emptied, with an empty bucket `cache`, reached through the AWS_* variables alone."""
    s3fs = pytest.importorskip("s3fs")
    s3_server.reset()
    s3_server.apply(monkeypatch)
    s3_server.make_bucket("cache")
    # s3fs reuses one instance per argument set, with its listing cache: start each test afresh.
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_server
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def user_shell(capsys, monkeypatch):
    """A DiffSynth user's shell run in this process (tests/pasted.py): ported commands without an interpreter each."""
    from pasted import UserShell

    return UserShell(capsys, monkeypatch)

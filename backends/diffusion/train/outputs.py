"""A training run's output folder: claimed before anything is written, locked while the run writes.

unitgraph writes a run's files (plan.json, training_args.json, loss.csv, loss.png, checkpoints) only
into a folder that is new, empty, or marked as its own by `unitgraph-run.json`, the marker naming the
run (task, pipeline, plan fingerprint, status). A folder holding anything else is refused with one
line, so a mistyped --output_path never mixes a run into someone's files. Unitgraph caches inside it
(folders with a cache manifest, e.g. OUTPUT/cache of `:split`) are fine.

A folder that already holds a run (finished or killed) is never silently written over: the run is
refused unless `--overwrite`, which moves the old run's files aside into `OUTPUT/replaced-<time>/`
(never deletes them; a cache inside the folder stays where it is and is reused when valid). While a
run writes, it holds an exclusive lock on the folder (released by the kernel if it dies; its file,
`.unitgraph-run.lock`, is removed when the run ends), so a second run into the same folder is refused
instead of both exiting 0 with one's output lost. Temporary files of unitgraph's own naming
(".<run file>.<8 random>.tmp", left by a kill during an atomic write of one of the run's files) are
removed when a marked run starts; nothing else is.

A run that fails before it made anything of value (no checkpoint, no training state, no loss row: an error
while it sets up, or at its first step) leaves the folder as it found it: the files it wrote are removed, an
earlier run it moved aside is moved back, and a folder it created is removed when that leaves it empty.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from unitgraph.atomic import make_folder, temp_target, write_text_atomic
from unitgraph.errors import OutputError, path_missing

from ..cache.store import missing_folders, release_flock, remove_empty_folders, take_flock
from .resume import STATE_DIR
from .validation import SAMPLES_DIR, SAMPLES_PAGE

MARKER = "unitgraph-run.json"
MARKER_FORMAT = "unitgraph.run/v1"
LOCK = ".unitgraph-run.lock"
# the files a run writes (moved aside together by --overwrite)
RUN_FILES = ("plan.json", "training_args.json", "loss.csv", "loss.png", "*.safetensors", SAMPLES_PAGE, MARKER)
RUN_DIRS = (STATE_DIR, SAMPLES_DIR, "logs")  # training states, validation samples, tracker logs (--report_to)
CACHE_MANIFEST = "manifest.json"


def _is_run_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in RUN_FILES)


def _is_temp(name: str) -> bool:
    """A temporary file of an atomic write of one of the run's files (never a user's ".notes.tmp")."""
    target = temp_target(name)
    return target is not None and _is_run_file(target)


def read_marker(folder: Path) -> Optional[dict[str, Any]]:
    """The run marker of `folder` (None when it has none); an OutputError when it is not one of ours."""
    path = folder / MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OutputError(f"unreadable run marker ({type(exc).__name__}); move the folder aside or choose another "
                          "--output_path", source=str(path)) from None
    if not isinstance(data, dict) or data.get("format") != MARKER_FORMAT:
        raise OutputError("not a unitgraph run marker; choose another --output_path", source=str(path))
    return data


def foreign_entries(folder: Path, marked: bool) -> list[str]:
    """What in `folder` unitgraph cannot prove it made. Always its caches (a folder whose manifest.json is a unitgraph
    cache manifest) and an empty lock file; with the run marker (`marked`) also the run's files, its folders and the
    temporary files of its atomic writes. Without the marker a file that merely has a run file's name (the plan.json,
    loss.csv or epoch-0.safetensors an earlier DiffSynth run leaves) is someone else's."""
    out = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if name == LOCK and entry.is_file() and not entry.is_symlink() and entry.stat().st_size == 0:
            continue
        if entry.is_dir() and not entry.is_symlink() and _is_cache(entry):
            continue
        if marked and (_is_temp(name) or (entry.is_file() and _is_run_file(name)) or (
                entry.is_dir() and not entry.is_symlink() and (name.startswith("replaced-") or name in RUN_DIRS))):
            continue
        out.append(name)
    return out


def _is_cache(folder: Path) -> bool:
    """Whether `folder` holds a unitgraph cache manifest (its format string says so)."""
    try:
        data = json.loads((folder / CACHE_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("format", "")).startswith("unitgraph.cache/")


def _has_rows(path: Path) -> bool:
    """Whether a loss log holds a row beyond its header (an optimizer step was made)."""
    try:
        with path.open("rb") as handle:
            return len(handle.read(1 << 16).splitlines()) > 1
    except OSError:
        return True  # cannot tell: keep it


def remove_sample_temps(folder: Path) -> int:
    """The temporary files of validation images a kill interrupted (OUTPUT/samples/..., ".<name>.png.<8>.tmp");
    only those: a marked run's samples folder is its own. Returns how many were removed."""
    samples = folder / SAMPLES_DIR
    if not samples.is_dir() or samples.is_symlink():
        return 0
    removed = 0
    for path in samples.rglob(".*.tmp"):
        target = temp_target(path.name)
        if target is not None and target.endswith(".png") and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def lock_held(lock: Path) -> bool:
    """Whether a live process holds the lock `lock` (the kernel releases a dead one's): looked at without creating
    the file. Two runs started at once into one new folder: the second finds the first's marker, and this tells a
    run at work from one that stopped."""
    import fcntl

    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases the shared lock taken to look


def move_aside(folder: Path) -> Path:
    """Move the run files of `folder` (and its training states) into a new `replaced-<UTC time>` folder inside it;
    return that folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = folder / f"replaced-{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = folder / f"replaced-{stamp}-{n}"
    make_folder(aside)
    for entry in sorted(folder.iterdir()):
        if (entry.is_file() and _is_run_file(entry.name)) or (entry.is_dir() and entry.name in RUN_DIRS):
            os.replace(entry, aside / entry.name)
    return aside


class RunFolder:
    """The output folder of one training run (main process only writes; see the module docstring)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._fd: Optional[int] = None
        self.replaced: Optional[Path] = None

    def check(self, overwrite: bool, resume: Optional[dict[str, Any]] = None, locked: bool = False) -> None:
        """Refuse a folder that is not unitgraph's or holds another run (unless `overwrite`, or `resume` with
        the record of the run to continue: then the folder must hold that run), or that another run is writing into
        (`locked`: this process holds the folder's lock). Writes nothing."""
        folder = self.folder
        if folder.is_symlink() and not folder.exists():
            raise OutputError(path_missing(folder), source=str(folder))  # a dangling link or a symlink loop
        if folder.exists() and not folder.is_dir():
            raise OutputError("is a file, not a folder; choose another --output_path", source=str(folder))
        if not folder.exists():
            return
        marker = read_marker(folder)
        if marker is not None and not locked and lock_held(folder / LOCK):  # a run at work, not one that stopped
            raise OutputError("another unitgraph run is writing into this folder; wait for it to finish or choose "
                              "another --output_path", source=str(folder))
        foreign = foreign_entries(folder, marked=marker is not None)
        if marker is None and (folder / CACHE_MANIFEST).is_file():
            raise OutputError("is a stage-1 cache folder, not a run's output folder; choose another --output_path "
                              "(stage 2 reads the cache through --dataset_base_path)", source=str(folder))
        if foreign and marker is None:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise OutputError(f"is not empty and not a unitgraph run folder (it holds {shown}); unitgraph writes only "
                              "into a new, empty or own folder: choose another --output_path", source=str(folder))
        if marker is not None and resume is not None:
            for key in ("task", "pipeline", "plan_fingerprint"):
                if marker.get(key) != resume.get(key):
                    raise OutputError(f"--resume: the folder holds another run ({key} {marker.get(key)!r}, this run "
                                      f"{resume.get(key)!r}); choose its --output_path or start anew", source=str(folder))
            return
        if marker is not None and not overwrite:
            checkpoints = sorted(p.name for p in folder.glob("*.safetensors"))
            state = "a finished run" if marker.get("status") == "finished" else "the run of a process that stopped"
            raise OutputError(f"holds {state} ({marker.get('task')}, {len(checkpoints)} checkpoints); pass "
                              "--overwrite to move its files aside into replaced-<time>/ (nothing is deleted), or "
                              "choose another --output_path", source=str(folder))

    @contextlib.contextmanager
    def claimed(self, overwrite: bool, run: dict[str, Any], resume: bool = False) -> Iterator["RunFolder"]:
        """Check, lock, clean our temp files, move an old run aside (`overwrite`; with `resume` the run is
        continued in place), write the marker; on a normal exit mark the run finished. The lock file is removed
        when the run ends; a run that fails before it made anything of value is rolled back (`_roll_back`)."""
        self.check(overwrite, run if resume else None)
        created = missing_folders(self.folder)
        make_folder(self.folder)
        lock = self.folder / LOCK
        try:
            fd = take_flock(lock)
        except BlockingIOError:
            remove_empty_folders(created)
            raise OutputError("another unitgraph run is writing into this folder; wait for it to finish or "
                              "choose another --output_path", source=str(self.folder)) from None
        except OSError as exc:
            remove_empty_folders(created)
            raise OutputError(f"cannot write into the folder ({exc.strerror})", source=str(self.folder)) from None
        failed = True
        try:
            self.check(overwrite, run if resume else None, locked=True)  # again, now that no other run can change it
            for entry in self.folder.iterdir():
                if entry.is_file() and _is_temp(entry.name):
                    entry.unlink(missing_ok=True)
            remove_sample_temps(self.folder)
            continued = resume and read_marker(self.folder) is not None  # the files here are the run's to continue
            if read_marker(self.folder) is not None and not resume:
                self.replaced = move_aside(self.folder)
            before = {entry.name for entry in self.folder.iterdir()}  # what this run found (a cache, the moved run)
            try:
                self._write_marker({**run, "status": "running"})
                yield self
            except BaseException:
                if not continued:
                    self._roll_back(before)
                raise
            self._write_marker({**run, "status": "finished"})
            failed = False
        finally:
            release_flock(fd, lock)
            if failed:
                remove_empty_folders(created)

    def _roll_back(self, before: set[str]) -> bool:
        """After a failed run: when it made nothing of value (no checkpoint, no training state, no loss row), remove
        the run files it wrote (those whose names were not in the folder before it, `before`) and move back the files
        of the earlier run `--overwrite` moved aside. Whether it did; a run that made something keeps all of it."""
        folder = self.folder
        new = [entry for entry in folder.iterdir() if entry.name not in before and entry.name != LOCK]
        for entry in new:
            if entry.is_symlink() or not (_is_run_file(entry.name) or _is_temp(entry.name) or entry.name in RUN_DIRS):
                return False  # not a file this run writes: the folder is not as the run alone left it
            if entry.name.endswith(".safetensors") or (entry.is_dir() and any(entry.rglob("*.safetensors"))):
                return False  # a checkpoint or a training state
            if entry.name == "loss.csv" and _has_rows(entry):
                return False
        for entry in new:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)  # logs/ of a tracker started for this run
            else:
                entry.unlink(missing_ok=True)
        if self.replaced is not None:
            for entry in sorted(self.replaced.iterdir()):
                if not (folder / entry.name).exists() and not (folder / entry.name).is_symlink():
                    os.rename(entry, folder / entry.name)
            with contextlib.suppress(OSError):
                self.replaced.rmdir()
                self.replaced = None
        return True

    def _write_marker(self, run: dict[str, Any]) -> None:
        data = {"format": MARKER_FORMAT, **run, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_text_atomic(self.folder / MARKER, json.dumps(data, indent=1, sort_keys=True) + "\n")


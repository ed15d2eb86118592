"""Write files so that a reader sees the old content or the new one, never half of either.

What may be written, decided once for every file unitgraph writes (plans, drawings, cache entries,
manifests, checkpoints):

- a path that does not exist yet, or an existing **regular file**, which is replaced atomically
  (written to a temporary file beside it, fsynced, renamed over it);
- a **symlink** is written *through*: its final target is replaced, the link stays a link (so a
  user's `-o latest.json -> runs/7/plan.json` keeps pointing where it did);
- anything else that exists (a directory, a device node such as /dev/full, a FIFO, a socket) is
  refused with an `OutputError` before a byte is written: renaming over it would destroy it.

Every failure (no permission, a read-only or full disk, a file where a folder should be) is an
`OutputError`: one line naming the path, and the previous file, if any, is left as it was.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import OutputError

TEMP_SUFFIX = ".tmp"  # temporary files are named ".<name>.<random>.tmp" beside their target
# tempfile.mkstemp's random part: 8 characters of this alphabet
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX) + "$")


def temp_target(name: str) -> str | None:
    """The file name an atomic write's temporary file `name` was for, or None when `name` is not of that form.

    >>> temp_target(".loss.csv.k3j9x_2a.tmp")
    'loss.csv'
    >>> temp_target(".notes.tmp") is None
    True

    A folder's owner removes a leftover temporary file only when its target is a file it writes: a user's
    ".notes.tmp", or ".draft.abcdefgh.tmp" beside files unitgraph never writes, is never taken for one.
    """
    match = _TEMP_NAME.match(name)
    return match.group("target") if match else None


STALE_TEMP_SECONDS = 60.0  # a temporary file untouched this long has no writer any more (a write keeps it fresh)


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Remove the temporary files an atomic write of `path` left when it was killed (`.<name>.<8 random>.tmp` beside
    it, for this very name, a regular file untouched for STALE_TEMP_SECONDS): a command that writes `path` again
    (`unitgraph lora convert`) cleans up after its own killed run. Never another name's, nor a user's `.notes.tmp`."""
    import time

    target = Path(path)
    removed = []
    try:
        siblings = list(target.parent.iterdir()) if target.parent.is_dir() else []
    except OSError:
        return removed
    for sibling in siblings:
        if temp_target(sibling.name) != target.name or sibling.is_symlink() or not sibling.is_file():
            continue
        try:
            if time.time() - sibling.stat().st_mtime >= STALE_TEMP_SECONDS:
                sibling.unlink()
                removed.append(sibling)
        except OSError:
            continue
    return removed


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` (or a symlink's target) with `data` atomically; see the module docstring."""
    shown = Path(path)
    target = writable_target(shown)
    make_folder(target.parent, shown)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
    except OSError as exc:
        raise OutputError(f"cannot write ({_reason(exc)})", source=str(shown)) from None
    try:
        os.chmod(tmp, _mode_for(target))  # mkstemp makes 0600; the result should look like any new file
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write ({_reason(exc)}); the previous file, if any, is unchanged",
                              source=str(shown)) from None
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def writable_target(path: Path) -> Path:
    """The file a write to `path` replaces: `path`, or a symlink's final target; an OutputError when that
    exists and is not a regular file."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as exc:
        raise OutputError(f"cannot write ({_reason(exc)})", source=str(path)) from None
    if not stat.S_ISREG(mode):
        raise OutputError(f"is {_kind(mode)}, not a regular file: unitgraph never writes over it", source=str(path))
    return target


def make_folder(folder: Path, shown: Path | None = None) -> None:
    """Create `folder` and its parents; an OutputError when a file is in the way or creating is refused."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"cannot create folder {folder}: a file is in the way", source=str(shown or folder)) from None
    except OSError as exc:
        raise OutputError(f"cannot create folder {folder} ({_reason(exc)})", source=str(shown or folder)) from None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return "a file is in the way of a folder"
    return exc.strerror or type(exc).__name__


def _mode_for(path: Path) -> int:
    """The replaced file's mode, or what the umask gives a new file."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask

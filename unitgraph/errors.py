"""Errors the command line turns into exit code 2 and one line on stderr.

Every error a user can cause by handing us bad input derives from `UnitgraphError`, so the CLI
can catch exactly those and let real bugs keep their tracebacks.
"""

from __future__ import annotations


class UnitgraphError(Exception):
    """Bad input: printed as one line, exit code 2."""

    def __init__(self, message: str, *, source: str | None = None, unit: str | None = None):
        self.message = message
        self.source = source
        self.unit = unit
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = []
        if self.source:
            parts.append(str(self.source))
        if self.unit:
            parts.append(f"unit {self.unit!r}")
        prefix = ": ".join(parts)
        text = f"{prefix}: {self.message}" if prefix else self.message
        return " ".join(text.split())  # one line, whatever the message contained


class SpecError(UnitgraphError):
    """A pipeline spec that cannot be loaded or is not valid."""


class PlanFileError(UnitgraphError):
    """A plan file that cannot be read as a unitgraph plan."""


class OutputError(UnitgraphError):
    """A file or folder unitgraph was asked to write cannot be written (or is not its to write)."""


# What an errno means for the user, where the C library's words mislead ("Too many levels of symbolic links" is a
# symlink loop; ENOENT on a dangling link is not a missing file). Everything else keeps its strerror.
_OS_PROBLEMS = {
    "ELOOP": "is a symlink loop (too many levels of symbolic links)",
    "ENAMETOOLONG": "file name too long (the system allows 255 bytes per name and 4096 per path)",
    "EACCES": "permission denied",
    "EPERM": "operation not permitted",
    "EROFS": "is on a read-only file system",
    "ENOSPC": "no space left on the device",
    "EDQUOT": "disk quota exceeded",
    "ENOENT": "does not exist",
    "ENOTDIR": "a file is in the way of a folder in the path",
    "EISDIR": "is a folder, not a file",
    "EEXIST": "already exists",
}


def os_error_line(exc: BaseException) -> str:
    """The one line for an OSError (or MemoryError) no reader turned into a `UnitgraphError`: the path it names
    (`exc.filename`, and `exc.filename2` for a move or link) and the problem (a plain word for the common errno, else
    `strerror`), never a traceback. Every command's errors of the file system end in this one place (cli/app.py).

    >>> os_error_line(PermissionError(13, "Permission denied", "/models/vae/weights.safetensors"))
    '/models/vae/weights.safetensors: permission denied'
    >>> os_error_line(OSError(40, "Too many levels of symbolic links", "out/a"))
    'out/a: is a symlink loop (too many levels of symbolic links)'
    >>> os_error_line(MemoryError())
    'out of memory (MemoryError): the machine could not give the memory this command asked for'
    """
    import errno as errno_names

    if isinstance(exc, MemoryError):
        detail = f": {exc}" if str(exc) else ""
        return (f"out of memory (MemoryError{detail}): the machine could not give the memory this command asked "
                "for")
    problem = os_problem(exc)
    if getattr(exc, "errno", None) == errno_names.ENOENT and getattr(exc, "filename", None) is not None:
        problem = path_missing(exc.filename)
    paths = [str(p) for p in (getattr(exc, "filename", None), getattr(exc, "filename2", None)) if p is not None]
    text = f"{' -> '.join(paths)}: {problem}" if paths else f"{problem} ({type(exc).__name__})"
    return " ".join(text.split())


def os_problem(exc: BaseException) -> str:
    """An OSError's problem in plain words (`_OS_PROBLEMS`), else its strerror."""
    import errno as errno_names

    name = errno_names.errorcode.get(getattr(exc, "errno", None) or -1)
    return _OS_PROBLEMS.get(name or "") or getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def path_missing(path) -> str:
    """Why a path that does not stat is not there, as what it is: a missing path ("does not exist"), a dangling
    symlink, a symlink loop (ELOOP, which `Path.exists()` reports as plain absence), a folder without permission.
    Every "does not exist" message of the commands goes through here, so a loop is never called missing.

    >>> path_missing("/nowhere/at/all")
    'does not exist'
    """
    import os

    try:
        os.stat(path)
    except FileNotFoundError:
        try:
            if os.path.islink(path):
                return "is a symlink to a path that does not exist"
        except (OSError, ValueError, TypeError):
            pass
        return "does not exist"
    except OSError as exc:
        return os_problem(exc)
    except (ValueError, TypeError):
        return "is not a usable path"
    return "does not exist"  # it exists now (made meanwhile): the caller's check said otherwise a moment ago

"""Model folders unitgraph writes (`tiny-models`, `--size real`, the demo's models): only the files it wrote.

A folder unitgraph wrote may later hold a user's files: real weights copied into a config-only folder, a shard
beside the tiny ones. So a write never goes into the folder directly. It goes into a fresh folder inside it
(`.unitgraph-new-<random>`), where a library's clean-up (diffusers' `save_pretrained` deletes the weight files of
other names it finds) can reach nothing of the user's; then only the files it wrote are moved in.

The marker (`unitgraph_tiny.json`, `unitgraph_config_only.json`) records each file unitgraph wrote, with its size
and sha256 (`files`). A file in the folder is unitgraph's only while the marker names it and it is unchanged: any
other file the write would replace (the user's weights under a name the write also uses, a folder or file in the
way) refuses the write, naming it, before anything moves. Files of the earlier write that the new one does not make
are removed only while unchanged. The marker is written first, `"complete": false` (so a write killed half-way
leaves a folder the same command recognises as its own, and finishes), and last, complete. A write that fails or is
refused before anything moved leaves the folder as it was (a folder it created is removed again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import BackendError

MARKERS = ("unitgraph_tiny.json", "unitgraph_config_only.json")  # tiny models; a release's config files only
STAGING_PREFIX = ".unitgraph-new-"  # the fresh folder a write goes into, inside the folder it writes


def read_marker(folder: Path, name: str) -> Optional[dict[str, Any]]:
    """A marker's JSON object, or None when the folder has none (or it is unreadable: then it proves nothing)."""
    path = Path(folder) / name
    if path.is_symlink() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recorded_files(folder: Path) -> dict[str, dict[str, Any]]:
    """The files the folder's markers record as unitgraph's: relative path -> {size, sha256}. A marker of an earlier
    unitgraph (no `files`) records none: its files are then the user's to move, never unitgraph's to replace."""
    found: dict[str, dict[str, Any]] = {}
    for name in MARKERS:
        files = (read_marker(folder, name) or {}).get("files")
        if isinstance(files, dict):
            found.update({rel: rec for rel, rec in files.items()
                          if isinstance(rel, str) and isinstance(rec, dict) and _safe_relative(rel)})
    return found


def is_complete(folder: Path, name: str) -> bool:
    """Whether the folder holds a finished write of this kind (its marker, not marked incomplete)."""
    marker = read_marker(folder, name)
    return marker is not None and marker.get("complete", True) is not False


def write_own_folder(outdir: str | Path, marker: str, write: Callable[[Path], Any]) -> Path:
    """Run `write(staging)` (it writes a complete model folder, its `marker` last) in a fresh folder inside `outdir`,
    then move its files into `outdir`, replacing only files unitgraph wrote there and that are unchanged; returns
    `outdir`. The caller has checked that `outdir` is new, empty or marked as unitgraph's (`claim_model_folder`)."""
    out = Path(outdir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    previous = recorded_files(out)
    before = (out / marker).read_bytes() if (out / marker).is_file() and not (out / marker).is_symlink() else None
    _write_marker(out / marker, {**(read_marker(out, marker) or {}), "complete": False, "files": previous})
    for stale in out.glob(STAGING_PREFIX + "*"):  # a write killed earlier: only this module's own name
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    try:
        try:
            write(staging)
        except BaseException:  # nothing moved: the folder as it was (its marker, or no folder at all)
            shutil.rmtree(staging, ignore_errors=True)
            _restore_marker(out / marker, before, created)
            raise
        info = read_marker(staging, marker) or {}
        made = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*")
                      if p.is_file() and not p.is_symlink() and p.name not in MARKERS)
        for rel in made:
            problem = _in_the_way(out, rel, previous.get(rel))
            if problem:
                shutil.rmtree(staging, ignore_errors=True)
                _restore_marker(out / marker, before, created)
                raise BackendError(f"{rel} {problem}: unitgraph replaces only files it wrote and that are unchanged; "
                                   "move it out of the folder or choose another folder", source=str(out))
        records = {rel: _record(staging / rel) for rel in made}
        # from here a failure leaves the incomplete marker naming every file: the same command finishes the folder
        _write_marker(out / marker, {**info, "complete": False, "files": {**previous, **records}})
        for rel in made:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, out / rel)
        for rel, record in previous.items():  # the earlier write's files the new one did not make
            if rel not in records and _unchanged(out / rel, record):
                (out / rel).unlink()
        for other in MARKERS:  # a folder of the other kind (config files only, tiny models) is now of this kind
            if other != marker and (out / other).is_file():
                (out / other).unlink()
        _write_marker(out / marker, {**info, "files": records})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _restore_marker(path: Path, before: Optional[bytes], created: bool) -> None:
    """Undo the incomplete marker of a write that moved nothing: the earlier marker back, or none (and the folder
    removed when the write created it and nothing else is in it)."""
    from unitgraph.atomic import write_bytes_atomic

    if before is not None:
        write_bytes_atomic(path, before)
        return
    path.unlink(missing_ok=True)
    if created:
        try:
            path.parent.rmdir()
        except OSError:
            pass


def _in_the_way(out: Path, rel: str, record: Optional[dict[str, Any]]) -> Optional[str]:
    """Why the file at `rel` cannot be replaced (None: nothing there, or unitgraph's own unchanged file)."""
    target = out / rel
    parent = target.parent
    while parent != out:
        if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
            return f"cannot be written: {parent.relative_to(out).as_posix()} is not a folder unitgraph made"
        parent = parent.parent
    if not target.exists() and not target.is_symlink():
        return None
    if target.is_symlink() or not target.is_file():
        return "is in the way (not a regular file unitgraph wrote)"
    if record is None:
        return "is a file unitgraph did not write"
    if not _unchanged(target, record):
        return "was changed since unitgraph wrote it"
    return None


def _unchanged(path: Path, record: dict[str, Any]) -> bool:
    """Whether `path` is still the regular file unitgraph recorded (size, then sha256)."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size != record.get("size"):
            return False
        return _sha256(path) == record.get("sha256")
    except OSError:
        return False


def _record(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _safe_relative(rel: str) -> bool:
    """A recorded path stays inside the folder (a hand-edited marker cannot point a removal elsewhere)."""
    parts = Path(rel).parts
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts and rel not in MARKERS


def _write_marker(path: Path, content: dict[str, Any]) -> None:
    from unitgraph.atomic import write_text_atomic

    write_text_atomic(path, json.dumps(content, indent=2, sort_keys=True) + "\n")

"""Adapters: read pipelines people already declare elsewhere as unitgraph pipelines.

- `diffusers_modular` (`diffusers:` references): diffusers Modular Pipelines blocks.
- `diffsynth` (`diffsynth:` references): DiffSynth-Studio pipeline units.

Both are backends of the `unitgraph.backends` entry-point group that offer `resolve(name, ...)`
(see unitgraph/references.py), and neither imports torch, diffusers or DiffSynth-Studio when it is
imported: the diffusers adapter imports diffusers when it resolves a reference, the DiffSynth
adapter can read a source folder without importing anything. docs/adapters.md describes the
mappings and the decisions behind them.

What an adapter has to tell the user but is not an error (a conservative choice it made, a
declaration mistake it found) is issued as a Python warning of class `AdapterNote` or
`DeclarationWarning`: Python users see ordinary warnings, the command line prints one line each on
stderr (`note: ...`, `warning: ...`).

Code runs only from installed packages unless the user opts in (`trust_remote_code=True`, the
command line's `--trust-remote-code`): `untrusted_location` tells, without running anything, where a
module would be imported from when that is not an installed package, and `refuse_untrusted` is the
one-line error the adapters raise then (docs/adapters.md, 'What runs').
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import site
import sysconfig
import warnings
from pathlib import Path
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

from ..errors import SpecError

TRUST_FLAG = "--trust-remote-code"


class AdapterNote(UserWarning):
    """Something an adapter decided that changes the pipeline it produced (printed as `note:`)."""


class DeclarationWarning(AdapterNote):
    """A declaration mistake in the source pipeline that changes its own behaviour (printed as `warning:`)."""


def note(message: str) -> None:
    warnings.warn(message, AdapterNote, stacklevel=3)


def declaration_warning(message: str) -> None:
    warnings.warn(message, DeclarationWarning, stacklevel=3)


def short_list(names, limit: int = 6) -> str:
    """`a, b, c` or `a, b, c and 4 more`, for one-line notes."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


# --- what may run ----------------------------------------------------------------------------------


def refuse_untrusted(what: str, where: str) -> SpecError:
    """The error for code that would run without the opt-in: `what` says what would run."""
    return SpecError(f"{what}; {TRUST_FLAG} allows it", source=where)


def untrusted_location(module: str) -> str | None:
    """Where the top-level package of `module` would be imported from, when that is not installed code.

    None when it is installed code (the standard library, a site-packages folder of this Python, or
    the project folder of an editable install that provides that package) and when it is not found
    at all (importing it then fails with its own error). Nothing is imported to find out: a
    top-level module is located by the path finders, which only look at files.
    """
    top = module.lstrip(".").partition(".")[0]
    importlib.invalidate_caches()  # a module file written a moment ago must be seen
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # ValueError: in sys.modules without a __spec__
        return None
    if spec is None:
        return None
    if spec.origin in ("built-in", "frozen"):
        return None
    places = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not places and spec.origin and spec.has_location:
        places = [Path(spec.origin)]
    if not places:
        return f"an unknown location ({spec.loader!r})"
    roots = _install_roots()
    outside = [p for p in places if not _under(p, roots)]
    if outside:
        editable = _editable_roots(top)
        outside = [p for p in outside if not _under(p, editable)]
    return str(outside[0]) if outside else None


def _install_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    candidates = [paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        candidates += site.getsitepackages()
    except AttributeError:  # pragma: no cover - some old virtualenvs
        pass
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    return list(dict.fromkeys(Path(c).resolve() for c in candidates if c))


def _editable_roots(top: str) -> list[Path]:
    """Project folders of the editable installs that provide the top-level package `top`.

    Only editable installs can qualify, so those are found first (a direct_url.json that says so: one
    small file, absent from most installs); a copy is taken when it provides `top` itself, or, failing
    that, when another distribution of its name does (`packages_distributions`, which reads every
    installed distribution's metadata: 0.5-0.8 s in a virtualenv of ~300 packages, the most of
    `unitgraph plan`'s start-up, so only looked at in that rare case).
    """
    from importlib.metadata import distributions

    editable: list[tuple[object, Path]] = []
    for dist in distributions():  # every copy of the name (an egg-info in the cwd may come first)
        try:
            text = dist.read_text("direct_url.json")
            data = json.loads(text) if text else None
        except (ValueError, OSError):
            continue
        if not (isinstance(data, dict) and isinstance(data.get("dir_info"), dict) and data["dir_info"].get("editable")):
            continue
        url = urlparse(str(data.get("url", "")))
        if url.scheme == "file":
            editable.append((dist, Path(url2pathname(unquote(url.path))).resolve()))
    roots: list[Path] = []
    providers: set[str] | None = None
    for dist, root in editable:
        if top not in _top_levels(dist):
            if providers is None:
                from importlib.metadata import packages_distributions

                providers = set(packages_distributions().get(top, ()))
            if dist.metadata["Name"] not in providers:
                continue
        roots.append(root)
    return roots


def _top_levels(dist) -> set[str]:
    """The top-level names a distribution provides, as `packages_distributions` finds them: its
    top_level.txt, else the first part of each file it installed."""
    declared = (dist.read_text("top_level.txt") or "").split()
    if declared:
        return set(declared)
    names = set()
    for file in dist.files or ():
        parts = file.parts
        if len(parts) > 1:
            names.add(parts[0])
        elif parts and parts[0].endswith(".py"):
            names.add(parts[0][:-3])
    return names


def _under(path: Path, roots: list[Path]) -> bool:
    try:
        path = path.resolve()
    except OSError:
        return False
    return any(path == root or root in path.parents for root in roots)


__all__ = ["AdapterNote", "DeclarationWarning", "TRUST_FLAG", "declaration_warning", "note", "refuse_untrusted",
           "short_list", "untrusted_location"]

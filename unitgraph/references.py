"""Resolve what a user names on the command line into a Pipeline.

A SPEC is either a spec file (JSON or YAML) or a backend reference `backend:pipeline`. Backends
are found through the `unitgraph.backends` entry-point group: each entry point names a module
(or object) with a `PIPELINES` mapping from pipeline name to a zero-argument factory returning a
`Pipeline`. Only the chosen backend is imported, and backends keep torch out of that import.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import SpecError
from .spec import Pipeline, read_spec_file

ENTRY_POINT_GROUP = "unitgraph.backends"
_REFERENCE = re.compile(r"^(?P<backend>[A-Za-z_][\w.-]*):(?P<name>[^/\\]+)$")


def load_pipeline(path_or_ref: str | Path | Pipeline) -> Pipeline:
    """A Pipeline from a spec file path, a `backend:name` reference, or a Pipeline (returned as is)."""
    if isinstance(path_or_ref, Pipeline):
        return path_or_ref
    text = str(path_or_ref)
    match = _REFERENCE.match(text)
    if match and not Path(text).exists():
        return load_reference(match["backend"], match["name"])
    return read_spec_file(text)


def available_backends() -> dict[str, Any]:
    """Entry points of the backend group by name (not yet loaded)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_pipelines(backend: str, source: str | None = None) -> Mapping[str, Callable[[], Pipeline]]:
    """The pipeline factories a backend offers; a SpecError when the backend is unknown or broken."""
    source = source or f"{backend}:"
    backends = available_backends()
    if backend not in backends:
        known = ", ".join(sorted(backends)) or "none installed"
        raise SpecError(f"unknown backend {backend!r} (installed backends: {known})", source=source)
    try:
        target = backends[backend].load()
    except Exception as exc:  # a backend that fails to import is the user's environment, not our bug
        raise SpecError(f"backend {backend!r} failed to load: {type(exc).__name__}: {exc}", source=source) from None
    pipelines = getattr(target, "PIPELINES", None)
    if not isinstance(pipelines, Mapping):
        raise SpecError(f"backend {backend!r} has no PIPELINES mapping", source=source)
    return pipelines


def load_reference(backend: str, name: str) -> Pipeline:
    """The pipeline `name` of `backend`, e.g. `diffusion:qwen_image`."""
    source = f"{backend}:{name}"
    pipelines = backend_pipelines(backend, source)
    if name not in pipelines:
        known = ", ".join(sorted(pipelines)) or "none"
        raise SpecError(f"backend {backend!r} has no pipeline {name!r} (it has: {known})", source=source)
    pipeline = pipelines[name]()
    if not isinstance(pipeline, Pipeline):
        raise SpecError(f"backend returned {type(pipeline).__name__}, expected a Pipeline", source=source)
    return pipeline

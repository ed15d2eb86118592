"""Resolve what a user names on the command line into a Pipeline.

A SPEC is either a spec file (JSON or YAML) or a backend reference `backend:pipeline`. Backends
are found through the `unitgraph.backends` entry-point group: each entry point names a module
(or object) with a `PIPELINES` mapping from pipeline name to a zero-argument factory returning a
`Pipeline`. Only the chosen backend is imported, and backends keep torch out of that import.

A backend whose pipeline names are open-ended (the `diffusers:` and `diffsynth:` adapters read any
class a user names) offers `resolve(name, **options) -> Pipeline` instead of, or next to,
`PIPELINES`. Options are passed by keyword and only when given: `provided` (the dataset params a run
provides, `--with`: an adapter may use them to pick conditional branches) and `source` (a folder to
read the pipeline from, `--source`). A PIPELINES factory that declares a keyword receives it too.

`trust_remote_code` (`--trust-remote-code`, off by default) is the permission to run code that is
not an installed package: a saved folder's custom blocks, a `module:Class` found outside installed
packages, a `diffsynth` package on PYTHONPATH. A backend that declares the keyword always receives
it (False included), one that takes `**kwargs` only when it is True; a backend that cannot take it
needs no permission, so that is no error. Spec files are data and run nothing.
"""

from __future__ import annotations

import inspect
import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .errors import SpecError
from .spec import Pipeline, read_spec_file

ENTRY_POINT_GROUP = "unitgraph.backends"
_REFERENCE = re.compile(r"^(?P<backend>[A-Za-z_][\w.-]*):(?P<name>[^/\\]+)$")
# a reference whose name is a path (`diffusers:./saved_blocks`); only for installed backends
_PATH_REFERENCE = re.compile(r"^(?P<backend>[A-Za-z_][\w.-]+):(?P<name>.+)$")
# options that change what is loaded, so a backend that cannot honour them must say so
_STRICT_OPTIONS = ("source",)
# the permission to run code that is not installed: passed to backends that declare it, never required
_TRUST_OPTION = "trust_remote_code"


def load_pipeline(
    path_or_ref: str | Path | Pipeline,
    *,
    provided: Iterable[str] | None = None,
    source: str | Path | None = None,
    trust_remote_code: bool = False,
) -> Pipeline:
    """A Pipeline from a spec file path, a `backend:name` reference, or a Pipeline (returned as is).

    `provided`, `source` and `trust_remote_code` are handed to backends that take them (see the
    module docstring); a spec file takes no `source`.
    """
    if isinstance(path_or_ref, Pipeline):
        return path_or_ref
    text = str(path_or_ref)
    reference = _parse_reference(text)
    if reference is not None:
        return load_reference(*reference, provided=provided, source=source, trust_remote_code=trust_remote_code)
    if source is not None:
        raise SpecError("--source applies to backend references (such as diffsynth:qwen_image.QwenImagePipeline), "
                        "not to spec files", source=text)
    return read_spec_file(text)


def _parse_reference(text: str) -> tuple[str, str] | None:
    if Path(text).exists():
        return None
    match = _REFERENCE.match(text)
    if match:
        return match["backend"], match["name"]
    match = _PATH_REFERENCE.match(text)
    if match and match["backend"] in available_backends():
        return match["backend"], match["name"]
    return None


def available_backends() -> dict[str, Any]:
    """Entry points of the backend group by name (not yet loaded)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _load_backend(backend: str, source: str, trust_remote_code: bool = False) -> Any:
    backends = available_backends()
    if backend not in backends:
        known = ", ".join(sorted(backends)) or "none installed"
        raise SpecError(f"unknown backend {backend!r} (installed backends: {known})", source=source)
    # an entry point may come from metadata on sys.path (an egg-info in the working directory under
    # `python -m`): its module is imported only when it is installed code, or with the permission
    module = getattr(backends[backend], "module", None)
    if isinstance(module, str) and module and not trust_remote_code:
        from .adapters import refuse_untrusted, untrusted_location

        place = untrusted_location(module)
        if place is not None:
            raise refuse_untrusted(f"backend {backend!r} would run code from {place}, which is not an installed "
                                   f"package", source)
    try:
        return backends[backend].load()
    except Exception as exc:  # a backend that fails to import is the user's environment, not our bug
        raise SpecError(f"backend {backend!r} failed to load: {type(exc).__name__}: {exc}", source=source) from None


def load_reference(
    backend: str,
    name: str,
    *,
    provided: Iterable[str] | None = None,
    source: str | Path | None = None,
    trust_remote_code: bool = False,
) -> Pipeline:
    """The pipeline `name` of `backend`, e.g. `diffusion:qwen_image` or `diffusers:QwenImageAutoBlocks`."""
    where = f"{backend}:{name}"
    options = {"provided": None if provided is None else list(provided),
               "source": None if source is None else str(source),
               "trust_remote_code": True if trust_remote_code else None}
    options = {k: v for k, v in options.items() if v is not None}
    target = _load_backend(backend, where, trust_remote_code)
    pipelines = getattr(target, "PIPELINES", None)
    resolve = getattr(target, "resolve", None)
    if isinstance(pipelines, Mapping) and name in pipelines:
        pipeline = _call_with_options(pipelines[name], options, backend, where)
    elif callable(resolve):
        pipeline = _call_with_options(resolve, options, backend, where, name)
    elif isinstance(pipelines, Mapping):
        known = ", ".join(sorted(pipelines)) or "none"
        raise SpecError(f"backend {backend!r} has no pipeline {name!r} (it has: {known})", source=where)
    else:
        raise SpecError(f"backend {backend!r} has no PIPELINES mapping", source=where)
    if not isinstance(pipeline, Pipeline):
        raise SpecError(f"backend returned {type(pipeline).__name__}, expected a Pipeline", source=where)
    return pipeline


def _call_with_options(factory: Callable, options: dict[str, Any], backend: str, where: str, *args: Any) -> Any:
    """Call a factory with the options it declares; an option it cannot take is an error if it matters."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no keywords
        parameters = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = {k: v for k, v in options.items() if takes_any or k in parameters}
    if _TRUST_OPTION in parameters:  # a backend that knows the permission is told when it is withheld too
        accepted[_TRUST_OPTION] = bool(options.get(_TRUST_OPTION, False))
    for key in _STRICT_OPTIONS:
        if key in options and key not in accepted:
            raise SpecError(f"backend {backend!r} takes no --{key}", source=where)
    return factory(*args, **accepted)

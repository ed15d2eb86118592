"""DiffSynth-Studio's own diffusion modules (flow_match.py, ddim_scheduler.py, loss.py), loaded by path from the wheel
scripts/setup.sh unpacks into .venv/diffsynth-wheel, for the tests that check unitgraph's objectives against them.

Its package is never imported as a whole (that would need its every dependency): each module is loaded under a
private package name, with the one import loss.py makes of the package (the pipeline base class it names in an
annotation) stood in for, and sys.modules is left as it was found afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Iterator

import pytest

WHEEL = Path(__file__).resolve().parents[1] / ".venv" / "diffsynth-wheel" / "diffsynth" / "diffusion"
needs_wheel = pytest.mark.skipif(not (WHEEL / "flow_match.py").is_file(),
                                 reason="the diffsynth wheel is not unpacked (scripts/setup.sh does it)")


def load_module(name: str, path: Path) -> types.ModuleType:
    """The Python file `path` as the module `name` (registered in sys.modules, as a module's own imports expect)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def wheel_modules(package: str, *names: str) -> Iterator[tuple[types.ModuleType, ...]]:
    """The wheel's modules `names` (e.g. "flow_match", "loss"), loaded as `<package>.<name>`, in that order."""
    own = types.ModuleType(package)
    own.__path__ = [str(WHEEL)]
    base = types.ModuleType(f"{package}.base_pipeline")
    base.BasePipeline = object
    keys = [package, f"{package}.base_pipeline", *(f"{package}.{name}" for name in names)]
    saved = {key: sys.modules.get(key) for key in keys}
    sys.modules[package], sys.modules[f"{package}.base_pipeline"] = own, base
    try:
        yield tuple(load_module(f"{package}.{name}", WHEEL / f"{name}.py") for name in names)
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value

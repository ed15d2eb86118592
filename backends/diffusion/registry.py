"""The diffusion backend's families and pipelines (no torch here).

`FAMILY_MODULES` is the one place that names the families: each entry is a folder under
`families/` whose package defines `FAMILY` (a `family.Family`). Adding a family is adding its folder
and one entry here; the conformance suite (tests/test_conformance.py) then runs on it.

`PIPELINES` is what the `unitgraph.backends` entry point `diffusion` exposes, so
`unitgraph plan diffusion:<pipeline>` resolves from the declarations alone, without torch,
diffusers or transformers.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Callable

from unitgraph.spec import Pipeline

from .errors import BackendError
from .family import Family, PipelineDef

# The registered families, the first being the default when nothing else decides.
FAMILY_MODULES = ("qwen_image", "flux", "wan", "sd15", "sdxl", "z_image", "flux2", "ltx2")


@lru_cache(maxsize=None)
def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    out = []
    for name in FAMILY_MODULES:
        module = importlib.import_module(f"{__package__}.families.{name}")
        out.append(module.FAMILY)
    return tuple(out)


def family(name: str) -> Family:
    """The family named `name` (a BackendError listing the known ones otherwise)."""
    for fam in families():
        if fam.name == name:
            return fam
    raise BackendError(f"unknown family {name!r} (families: {', '.join(f.name for f in families())})")


def pipeline_defs() -> dict[str, tuple[Family, PipelineDef]]:
    """Every pipeline of every family, by pipeline name."""
    return {p.name: (fam, p) for fam in families() for p in fam.pipelines}


def find_pipeline(name: str) -> tuple[Family, PipelineDef]:
    """(family, pipeline) for a pipeline name; a family name gives its first pipeline."""
    defs = pipeline_defs()
    if name in defs:
        return defs[name]
    for fam in families():
        if fam.name == name:
            return fam, fam.pipelines[0]
    raise BackendError(f"unknown pipeline {name!r} (pipelines: {', '.join(defs)})")


def pipeline_for_task(name: str, task: str) -> tuple[Family, PipelineDef]:
    """The pipeline `--pipeline NAME --task TASK` runs: NAME itself when it serves TASK, else its family's
    pipeline for TASK."""
    fam, pipeline = find_pipeline(name)
    if pipeline.task == task:
        return fam, pipeline
    for candidate in fam.pipelines:
        if candidate.task == task:
            return fam, candidate
    raise BackendError(f"pipeline {pipeline.name} does not train --task {task} (its family {fam.name} has: "
                       f"{', '.join(f'{p.name} ({p.task})' for p in fam.pipelines)})")


def default_family() -> Family:
    return families()[0]


def _factory(pipeline: PipelineDef) -> Callable[[], Pipeline]:
    def make() -> Pipeline:
        return pipeline.spec()

    make.__name__ = pipeline.name
    make.__doc__ = pipeline.description
    return make


# name -> factory of the planner's `unitgraph.spec.Pipeline` (importing the families is cheap: no torch)
PIPELINES: dict[str, Callable[[], Pipeline]] = {name: _factory(p) for name, (_, p) in pipeline_defs().items()}

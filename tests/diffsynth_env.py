"""The environment DiffSynth-Studio's loader reads, set for the tests of its own pipelines."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def diffsynth_models(models: Path) -> Iterator[None]:
    """DiffSynth's `./models` at `models`, downloads off (DIFFSYNTH_MODEL_BASE_PATH, DIFFSYNTH_SKIP_DOWNLOAD); the
    variables as they were afterwards."""
    env = {"DIFFSYNTH_MODEL_BASE_PATH": str(models), "DIFFSYNTH_SKIP_DOWNLOAD": "True"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def any_attention_kernel(module: str) -> Iterator[None]:
    """For DiffSynth's pipeline `module`, whose DiT allows torch only some attention kernels (glue.attention: Krea 2's
    asks for cuDNN's alone, which no CPU has), its module's `sdpa_kernel` made to leave torch's choice as it is, for
    as long as the context lasts: the math kernel computes the same attention, and DiffSynth's own step and
    unitgraph's both run with it. Nothing changes for a pipeline that declares no such function."""
    import importlib

    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    declared = glue_for(module).attention
    if not declared:
        yield
        return
    owner = importlib.import_module(declared.partition(":")[0])
    saved = owner.sdpa_kernel
    owner.sdpa_kernel = lambda *backends, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        owner.sdpa_kernel = saved


def add_distill_columns(folder: Path, steps: int = 2, first_seed: int = 40) -> None:
    """Give each row of `folder`'s metadata.csv the columns of DiffSynth's direct-distill example datasets (its Wan
    2.1 1.3B direct_distill command passes them as --extra_inputs): a seed of its own (`first_seed` + row), rand_device
    cpu, `steps` inference steps and cfg_scale 1."""
    import csv

    path = folder / "metadata.csv"
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for i, row in enumerate(rows):
        row.update(seed=str(first_seed + i), rand_device="cpu", num_inference_steps=str(steps), cfg_scale="1")
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

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

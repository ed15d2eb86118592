"""Fixtures shared by the backend tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A test-size Qwen-Image pipeline folder, written once per session. Tests that change model
    files work on a copy of it."""
    from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny") / "qwen", size="test", seed=0)

"""Example pipeline specs, offered as the `examples` backend (`unitgraph inspect examples:z_image`).

Each example is a JSON spec next to this file; `PIPELINES` maps its name to a zero-argument factory
that loads it, as the `unitgraph.backends` entry-point group expects. Nothing here imports torch.

- `qwen_image`: a Qwen-Image-style pipeline (shape check, noise set-up, VAE image encode, edit-image
  auto-resize and encode, prompt embedding, latent packing) with a declared sink calling `dit`.
- `z_image`: modelled on DiffSynth-Studio's Z-Image pipeline, where the prompt embedder reads the
  edit image *before* it is auto-resized. Training the text encoder with LoRA then makes the
  write-hazard rule W pull the auto-resize unit, and with it the VAE and SigLIP edit-image
  embedders, into stage 2 in `latest` mode; `versioned` mode keeps them in stage 1.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

from unitgraph.spec import Pipeline, read_spec_file

HERE = Path(__file__).resolve().parent


def spec_path(name: str) -> Path:
    """The JSON spec file of example `name`."""
    return HERE / f"{name}.json"


def load_example(name: str) -> Pipeline:
    """The example pipeline `name`, loaded from its JSON spec."""
    return read_spec_file(spec_path(name))


PIPELINES: dict[str, Callable[[], Pipeline]] = {
    path.stem: partial(load_example, path.stem) for path in sorted(HERE.glob("*.json"))
}

__all__ = ["PIPELINES", "load_example", "spec_path"]

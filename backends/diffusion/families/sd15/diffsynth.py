"""Stable Diffusion 1.x as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:stable_diffusion`,
backends/diffusion/diffsynth_source): how its example's train.py builds it, and its test-size models in DiffSynth's
`./models` layout (this family's tiny folder, its text encoder's keys with the release's `text_model.` prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...family import DiffSynthPipeline, DiffSynthTokenizer
from ...models.diffsynth_layout import relay

MODEL_ID = "AI-ModelScope/stable-diffusion-v1-5"

PIPELINES = (
    DiffSynthPipeline("stable_diffusion", "StableDiffusionPipeline", "Stable Diffusion 1.x (DiffSynth's pipeline)",
                      dtype="float32", division=32, example="stable_diffusion",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", MODEL_ID, "tokenizer/"),)),
)


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0) -> dict[str, Any]:
    """The family's tiny folder re-laid as DiffSynth's download of SD 1.5 under `outdir`; the flags naming it."""
    from .tiny import write_tiny_models

    return relay(lambda folder: write_tiny_models(folder, "test", seed), Path(outdir), MODEL_ID,
                 {"text_encoder": "text_model."})

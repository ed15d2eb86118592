"""Stable Diffusion XL as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:stable_diffusion_xl`,
backends/diffusion/diffsynth_source): how its example's train.py builds it (two tokenizers; its checkpoints in the
open-source LoRA layout with --align_to_opensource_format), and its test-size models in DiffSynth's `./models`
layout (this family's tiny folder, the first text encoder's keys with the release's `text_model.` prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...family import DiffSynthPipeline, DiffSynthTokenizer
from ...models.diffsynth_layout import relay

MODEL_ID = "stabilityai/stable-diffusion-xl-base-1.0"

PIPELINES = (
    DiffSynthPipeline("stable_diffusion_xl", "StableDiffusionXLPipeline",
                      "Stable Diffusion XL (DiffSynth's pipeline)", dtype="float32", division=32,
                      example="stable_diffusion_xl",
                      opensource_lora="diffsynth.utils.lora.sdxl:SdxlLoRAConverter.align_to_opensource_format",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", MODEL_ID, "tokenizer/"),
                                  DiffSynthTokenizer("tokenizer_2_config", "tokenizer_2_path", MODEL_ID, "tokenizer_2/",
                                                     encoder="text_encoder_2"))),
)


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0) -> dict[str, Any]:
    """The family's tiny folder re-laid as DiffSynth's download of SDXL base 1.0 under `outdir`; the flags naming it."""
    from .tiny import write_tiny_models

    return relay(lambda folder: write_tiny_models(folder, "test", seed), Path(outdir), MODEL_ID,
                 {"text_encoder": "text_model."})  # text_encoder_2 (with projection) keeps its own prefix

"""Validation samples of FLUX.1: diffusers' FluxPipeline with the trained DiT and stage 1's T5 and CLIP embeddings
(no text encoder is loaded); a Kontext DiT renders text-to-image the same way, or, given a --validation_image,
edits it through FluxKontextPipeline (which sizes the reference image to Kontext's preferred resolution, VAE-encodes it
itself and draws a sample of the run's area). FLUX.1's guidance is a scale embedded in its distilled DiT
(`guidance_scale`, 3.5 by default): one pass a step, no negative prompt."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance

PIPELINES = ("flux", "flux_kontext")
IMAGE_PIPELINES = ("flux_kontext",)  # those that take --validation_image
EMBEDDED = Guidance(3.5, negative=False)  # FluxPipeline's default embedded guidance
GUIDANCE = EMBEDDED.default


def guidance(pipeline: Any) -> Guidance:
    return EMBEDDED


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None,
           image: Any = None) -> Any:
    from diffusers import FluxKontextPipeline, FluxPipeline

    cls, edit = (FluxPipeline, {}) if image is None else (FluxKontextPipeline, {"image": image, "max_area": width * height})
    pipe = cls(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae_encoder"], text_encoder=None,
               tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt_embeds=embeds["prompt_emb"], pooled_prompt_embeds=embeds["pooled_prompt_emb"], width=width,
                height=height, num_inference_steps=steps, guidance_scale=GUIDANCE if guidance is None else guidance,
                generator=generator, **edit).images[0]

"""Validation samples of Stable Diffusion 1.5: diffusers' StableDiffusionPipeline with the trained UNet and stage 1's
CLIP embeddings (no text encoder is loaded), sampled with the folder's scheduler (SD 1.5's PNDM) and no
classifier-free guidance (guidance scale 1: the prompts are encoded without a negative prompt)."""

from __future__ import annotations

import copy
from typing import Any

PIPELINES = ("sd15",)
GUIDANCE = 1.0


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any) -> Any:
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=models["vae"], text_encoder=None, tokenizer=None, unet=models["unet"],
                                   scheduler=copy.deepcopy(models["scheduler"]), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt_embeds=embeds["prompt_embeds"], width=width, height=height, num_inference_steps=steps,
                guidance_scale=GUIDANCE, generator=generator).images[0]

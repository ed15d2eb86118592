"""Validation samples of SDXL: diffusers' StableDiffusionXLPipeline with the trained UNet and stage 1's embeddings of
both CLIP encoders (no text encoder is loaded: the pipeline gets `prompt_embeds` and `pooled_prompt_embeds`, and its
negative embeddings are zeros, as `force_zeros_for_empty_prompt` makes them without a negative prompt)."""

from __future__ import annotations

import copy
from typing import Any

PIPELINES = ("sdxl",)
GUIDANCE = 5.0  # StableDiffusionXLPipeline's default guidance scale


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any) -> Any:
    from diffusers import StableDiffusionXLPipeline

    from .units import join_prompt_embeds

    pipe = StableDiffusionXLPipeline(vae=models["vae"], text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=models["unet"], scheduler=copy.deepcopy(models["scheduler"]),
                                     add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    prompt_emb = join_prompt_embeds(embeds["prompt_emb_1"], embeds["prompt_emb_2"])
    return pipe(prompt_embeds=prompt_emb, pooled_prompt_embeds=embeds["pooled_prompt_emb"], width=width, height=height,
                num_inference_steps=steps, guidance_scale=GUIDANCE, generator=generator).images[0]

"""Validation samples of FLUX.1: diffusers' FluxPipeline with the trained DiT and stage 1's T5 and CLIP embeddings
(no text encoder is loaded); a Kontext DiT renders text-to-image the same way."""

from __future__ import annotations

import copy
from typing import Any

PIPELINES = ("flux", "flux_kontext")
GUIDANCE = 3.5  # FluxPipeline's default embedded guidance


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any) -> Any:
    from diffusers import FluxPipeline

    pipe = FluxPipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae_encoder"], text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt_embeds=embeds["prompt_emb"], pooled_prompt_embeds=embeds["pooled_prompt_emb"], width=width,
                height=height, num_inference_steps=steps, guidance_scale=GUIDANCE, generator=generator).images[0]

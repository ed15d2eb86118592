"""Validation samples of Z-Image: diffusers' ZImagePipeline with the trained DiT and stage 1's prompt embeddings (no
text encoder is loaded: the pipeline gets `prompt_embeds`, one unpadded embedding per prompt), without classifier-free
guidance (there is no negative prompt's embedding to guide with; Z-Image-Turbo samples so). Z-Image-Omni-Base's
text-to-image DiT renders the same way through ZImageOmniPipeline, from stage 1's omni prompt segments."""

from __future__ import annotations

import copy
from typing import Any

PIPELINES = ("z_image", "z_image_omni_t2i")
GUIDANCE = 0.0  # ZImagePipeline guides only when guidance_scale > 0


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any) -> Any:
    from diffusers import ZImageOmniPipeline, ZImagePipeline

    from .losses import unpad

    if pipeline.name == "z_image_omni_t2i":
        pipe = ZImageOmniPipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae_encoder"],
                                  text_encoder=None, tokenizer=None, transformer=models["dit"], siglip=None,
                                  siglip_processor=None)
        pipe.set_progress_bar_config(disable=True)
        return pipe(prompt_embeds=embeds["prompt_segments"], width=width, height=height, num_inference_steps=steps,
                    guidance_scale=GUIDANCE, generator=generator).images[0]
    pipe = ZImagePipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae_encoder"], text_encoder=None,
                          tokenizer=None, transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    prompt_embeds = unpad(embeds["prompt_emb"], embeds.get("prompt_emb_mask"))
    return pipe(prompt_embeds=prompt_embeds, width=width, height=height, num_inference_steps=steps,
                guidance_scale=GUIDANCE, generator=generator).images[0]

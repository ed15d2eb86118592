"""Validation samples of Z-Image: diffusers' ZImagePipeline with the trained DiT and stage 1's prompt embeddings (no
text encoder is loaded: the pipeline gets `prompt_embeds`, one unpadded embedding per prompt). It guides classifier-free
(`guidance_scale`, 5 by default; 0 turns it off, as Z-Image-Turbo samples) against a negative prompt's embedding,
which stage 1 encodes too: the empty prompt, as the pipeline uses, unless --validation_negative_prompt is given.
Z-Image-Omni-Base's text-to-image DiT renders the same way through ZImageOmniPipeline, from stage 1's omni prompt
segments."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance

PIPELINES = ("z_image", "z_image_omni_t2i")
CFG = Guidance(5.0)  # ZImagePipeline's default guidance_scale; it guides when the scale is above 0
GUIDANCE = CFG.default


def guidance(pipeline: Any) -> Guidance:
    return CFG


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None) -> Any:
    from diffusers import ZImageOmniPipeline, ZImagePipeline

    from .losses import unpad

    scale = GUIDANCE if guidance is None else guidance
    if pipeline.name == "z_image_omni_t2i":
        pipe = ZImageOmniPipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae_encoder"],
                                  text_encoder=None, tokenizer=None, transformer=models["dit"], siglip=None,
                                  siglip_processor=None)
        pipe.set_progress_bar_config(disable=True)
        against = {} if negative is None else {"negative_prompt_embeds": negative["prompt_segments"]}
        return pipe(prompt_embeds=embeds["prompt_segments"], width=width, height=height, num_inference_steps=steps,
                    guidance_scale=scale, generator=generator, **against).images[0]
    pipe = ZImagePipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae_encoder"], text_encoder=None,
                          tokenizer=None, transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    prompt_embeds = unpad(embeds["prompt_emb"], embeds.get("prompt_emb_mask"))
    against = {} if negative is None else {
        "negative_prompt_embeds": unpad(negative["prompt_emb"], negative.get("prompt_emb_mask"))}
    return pipe(prompt_embeds=prompt_embeds, width=width, height=height, num_inference_steps=steps,
                guidance_scale=scale, generator=generator, **against).images[0]

"""Validation samples of SDXL: diffusers' StableDiffusionXLPipeline with the trained UNet and stage 1's embeddings of
both CLIP encoders (no text encoder is loaded: the pipeline gets `prompt_embeds` and `pooled_prompt_embeds`). It guides
classifier-free (`guidance_scale`, 5 by default): against a --validation_negative_prompt's embeddings, which stage 1
encodes too, or without one against zeros, as `force_zeros_for_empty_prompt` makes the pipeline do."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance

PIPELINES = ("sdxl",)
CFG = Guidance(5.0, empty_negative=False)  # StableDiffusionXLPipeline's default guidance scale; zeros for no negative
GUIDANCE = CFG.default


def guidance(pipeline: Any) -> Guidance:
    return CFG


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None) -> Any:
    from diffusers import StableDiffusionXLPipeline

    from .units import join_prompt_embeds

    pipe = StableDiffusionXLPipeline(vae=models["vae"], text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=models["unet"], scheduler=copy.deepcopy(models["scheduler"]),
                                     add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    prompt_emb = join_prompt_embeds(embeds["prompt_emb_1"], embeds["prompt_emb_2"])
    against = {} if negative is None else {
        "negative_prompt_embeds": join_prompt_embeds(negative["prompt_emb_1"], negative["prompt_emb_2"]),
        "negative_pooled_prompt_embeds": negative["pooled_prompt_emb"]}
    return pipe(prompt_embeds=prompt_emb, pooled_prompt_embeds=embeds["pooled_prompt_emb"], width=width, height=height,
                num_inference_steps=steps, guidance_scale=GUIDANCE if guidance is None else guidance,
                generator=generator, **against).images[0]

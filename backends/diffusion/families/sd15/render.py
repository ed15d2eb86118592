"""Validation samples of Stable Diffusion 1.5: diffusers' StableDiffusionPipeline with the trained UNet and stage 1's
CLIP embeddings (no text encoder is loaded), sampled with the folder's scheduler (SD 1.5's PNDM). It guides
classifier-free (`guidance_scale`, 7.5 by default) against a negative prompt's embedding, which stage 1 encodes too:
the empty prompt, as the pipeline uses, unless --validation_negative_prompt is given."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance

PIPELINES = ("sd15",)
CFG = Guidance(7.5)  # StableDiffusionPipeline's default guidance_scale
GUIDANCE = CFG.default


def guidance(pipeline: Any) -> Guidance:
    return CFG


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None) -> Any:
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=models["vae"], text_encoder=None, tokenizer=None, unet=models["unet"],
                                   scheduler=copy.deepcopy(models["scheduler"]), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    against = {} if negative is None else {"negative_prompt_embeds": negative["prompt_embeds"]}
    return pipe(prompt_embeds=embeds["prompt_embeds"], width=width, height=height, num_inference_steps=steps,
                guidance_scale=GUIDANCE if guidance is None else guidance, generator=generator, **against).images[0]

"""Validation samples of FLUX.2: the pipeline's diffusers class (Flux2KleinPipeline for klein, Flux2Pipeline for
FLUX.2-dev) with the trained DiT and stage 1's prompt embedding (no text encoder is loaded; FLUX.2's prompt embedding
does not read the edit image). The edit pipelines' DiTs render text-to-image the same way, or, given a
--validation_image, edit it: the pipeline sizes and VAE-encodes the reference image itself.

klein guides classifier-free (`guidance_scale`, 4 by default) against a negative prompt's embedding, which stage 1
encodes too: the empty prompt, as Flux2KleinPipeline uses, unless --validation_negative_prompt is given. The render
builds the pipeline undistilled, so it guides; a step-distilled klein (whose model_index.json says `is_distilled`,
and whose pipeline then ignores the scale) renders as its pipeline does with --validation_guidance 1. FLUX.2-dev's
guidance is embedded in its DiT (one pass, no negative prompt): its pipeline's default, 4."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance

PIPELINES = ("flux2_klein", "flux2", "flux2_klein_edit", "flux2_edit")
IMAGE_PIPELINES = ("flux2_klein_edit", "flux2_edit")  # those that take --validation_image
MIN_IMAGE_SIDE = 64  # Flux2ImageProcessor's smallest side of a reference image
KLEIN = Guidance(4.0)  # Flux2KleinPipeline's default guidance_scale (classifier-free)
DEV = Guidance(4.0, negative=False)  # Flux2Pipeline's default embedded guidance
GUIDANCE, DEV_GUIDANCE = KLEIN.default, DEV.default


def image_problem(pipeline: Any, image: Any) -> Optional[str]:
    """What the pipelines' image processor refuses of a reference image, said before training starts."""
    if min(image.size) < MIN_IMAGE_SIDE:
        return (f"is {image.width}x{image.height} px: FLUX.2's pipelines take reference images of at least "
                f"{MIN_IMAGE_SIDE} px a side")
    return None


def guidance(pipeline: Any) -> Guidance:
    return DEV if pipeline.diffusers_pipeline == "Flux2Pipeline" else KLEIN


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None,
           image: Any = None) -> Any:
    import diffusers

    dev = pipeline.diffusers_pipeline == "Flux2Pipeline"
    cls = getattr(diffusers, pipeline.diffusers_pipeline)
    pipe = cls(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae"], text_encoder=None, tokenizer=None,
               transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    extra = {} if negative is None else {"negative_prompt_embeds": negative["prompt_emb"]}
    if image is not None:
        extra["image"] = image
    scale = (DEV if dev else KLEIN).default if guidance is None else guidance
    return pipe(prompt_embeds=embeds["prompt_emb"], width=width, height=height, num_inference_steps=steps,
                guidance_scale=scale, generator=generator, **extra).images[0]

"""Validation samples of FLUX.2: the pipeline's diffusers class (Flux2KleinPipeline for klein, Flux2Pipeline for
FLUX.2-dev) with the trained DiT and stage 1's prompt embedding (no text encoder is loaded). The edit pipelines'
DiTs render text-to-image the same way (a validation prompt has no edit image).

klein renders with guidance 1: its classifier-free guidance would need the empty prompt's embedding, which stage 1
does not compute (a step-distilled klein ignores guidance anyway). FLUX.2-dev's guidance is embedded in the DiT
(no second pass): its pipeline's default, 4."""

from __future__ import annotations

import copy
from typing import Any

PIPELINES = ("flux2_klein", "flux2", "flux2_klein_edit", "flux2_edit")
GUIDANCE = 1.0  # klein
DEV_GUIDANCE = 4.0  # Flux2Pipeline's default embedded guidance


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any) -> Any:
    import diffusers

    dev = pipeline.diffusers_pipeline == "Flux2Pipeline"
    cls = getattr(diffusers, pipeline.diffusers_pipeline)
    pipe = cls(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae"], text_encoder=None, tokenizer=None,
               transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt_embeds=embeds["prompt_emb"], width=width, height=height, num_inference_steps=steps,
                guidance_scale=DEV_GUIDANCE if dev else GUIDANCE, generator=generator).images[0]

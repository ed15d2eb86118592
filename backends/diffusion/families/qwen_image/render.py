"""Validation samples of Qwen-Image: diffusers' QwenImagePipeline with the trained DiT and stage 1's prompt embeddings
(no text encoder is loaded: the pipeline gets `prompt_embeds` and their mask)."""

from __future__ import annotations

import copy
from typing import Any

PIPELINES = ("qwen_image", "qwen_image_distill")


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any) -> Any:
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae"], text_encoder=None,
                             tokenizer=None, transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt_embeds=embeds["prompt_emb"], prompt_embeds_mask=embeds["prompt_emb_mask"], width=width,
                height=height, num_inference_steps=steps, true_cfg_scale=1.0, generator=generator).images[0]

"""Validation samples of Qwen-Image: diffusers' QwenImagePipeline with the trained DiT and stage 1's prompt embeddings
(no text encoder is loaded: the pipeline gets `prompt_embeds` and their mask). Its guidance is true classifier-free
guidance (`true_cfg_scale`, 4 by default) against a negative prompt's embeddings, which stage 1 encodes too (the empty
prompt unless --validation_negative_prompt is given): the pipeline guides only when it has them."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance

PIPELINES = ("qwen_image", "qwen_image_distill")
TRUE_CFG = Guidance(4.0)  # QwenImagePipeline's default true_cfg_scale


def guidance(pipeline: Any) -> Guidance:
    return TRUE_CFG


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None) -> Any:
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae"], text_encoder=None,
                             tokenizer=None, transformer=models["dit"])
    pipe.set_progress_bar_config(disable=True)
    against = {} if negative is None else {"negative_prompt_embeds": negative["prompt_emb"],
                                           "negative_prompt_embeds_mask": negative["prompt_emb_mask"]}
    return pipe(prompt_embeds=embeds["prompt_emb"], prompt_embeds_mask=embeds["prompt_emb_mask"], width=width,
                height=height, num_inference_steps=steps, generator=generator,
                true_cfg_scale=TRUE_CFG.default if guidance is None else guidance, **against).images[0]

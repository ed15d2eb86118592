"""Validation samples of Qwen-Image: diffusers' QwenImagePipeline with the trained DiT and stage 1's prompt embeddings
(no text encoder is loaded: the pipeline gets `prompt_embeds` and their mask). Its guidance is true classifier-free
guidance (`true_cfg_scale`, 4 by default) against a negative prompt's embeddings, which stage 1 encodes too (the empty
prompt unless --validation_negative_prompt is given): the pipeline guides only when it has them.

The edit pipelines (`qwen_image_edit`, `qwen_image_edit_plus`) render each prompt's edit of its --validation_image
through QwenImageEditPipeline / QwenImageEditPlusPipeline. Their vision-language encoder reads the image with the
prompt, so stage 1 encodes each prompt (and its negative prompt) with its image as the pipeline shows it to that
encoder (`prompt_image_inputs`: resized to 1024x1024's area for Edit, 384x384's for Edit-Plus); the pipeline itself
resizes the image again and VAE-encodes it at render time."""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance

PIPELINES = ("qwen_image", "qwen_image_distill", "qwen_image_edit", "qwen_image_edit_plus")
IMAGE_PIPELINES = ("qwen_image_edit", "qwen_image_edit_plus")  # those that take --validation_image: the image to edit
IMAGE_REQUIRED = IMAGE_PIPELINES  # an edit needs its image
PROMPT_IMAGE_INPUTS = ("condition_images",)  # what their prompt encoders read beside the prompt
TRUE_CFG = Guidance(4.0)  # QwenImagePipeline's default true_cfg_scale


def guidance(pipeline: Any) -> Guidance:
    return TRUE_CFG


def prompt_image_inputs(pipeline: Any, image: Any) -> dict[str, Any]:
    """What an edit pipeline's prompt encoder reads of a validation image: the image as the diffusers pipeline shows
    it to its vision-language encoder (Edit: the image its VAE encodes, at 1024x1024's area; Edit-Plus: at 384x384's)."""
    from .units import CONDITION_IMAGE_AREA, VAE_IMAGE_AREA, resize_edit

    area = CONDITION_IMAGE_AREA if getattr(pipeline, "name", pipeline) == "qwen_image_edit_plus" else VAE_IMAGE_AREA
    return {"condition_images": [resize_edit(image if image.mode == "RGB" else image.convert("RGB"), area)]}


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None,
           image: Any = None) -> Any:
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline

    parts = dict(scheduler=copy.deepcopy(models["scheduler"]), vae=models["vae"], text_encoder=None, tokenizer=None,
                 transformer=models["dit"])
    if image is None:
        pipe, edit = QwenImagePipeline(**parts), {}
    else:  # the edit of the image; the pipeline resizes and VAE-encodes it, its prompt was encoded with it
        plus = getattr(pipeline, "name", pipeline) == "qwen_image_edit_plus"
        pipe = (QwenImageEditPlusPipeline if plus else QwenImageEditPipeline)(**parts, processor=None)
        edit = {"image": [image] if plus else image}
    pipe.set_progress_bar_config(disable=True)
    against = {} if negative is None else {"negative_prompt_embeds": negative["prompt_emb"],
                                           "negative_prompt_embeds_mask": negative["prompt_emb_mask"]}
    return pipe(prompt_embeds=embeds["prompt_emb"], prompt_embeds_mask=embeds["prompt_emb_mask"], width=width,
                height=height, num_inference_steps=steps, generator=generator,
                true_cfg_scale=TRUE_CFG.default if guidance is None else guidance, **edit, **against).images[0]

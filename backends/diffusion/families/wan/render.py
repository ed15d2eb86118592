"""Validation samples of Wan text-to-video: diffusers' WanPipeline with the trained DiT and stage 1's UMT5
embeddings (no text encoder is loaded); the clip's frames side by side as one image. A run of one of Wan 2.2 A14B's
experts renders through both (`models["experts"]`: subfolder -> model, the trained one with its LoRA), switching
at the boundary ratio as the pipeline does. Wan 2.2 TI2V-5B (`wan_ti2v`) renders text-to-video through the same
pipeline with expand_timesteps, as its release's model_index.json sets it. It guides classifier-free
(`guidance_scale`, 5 by default; both experts with the same scale, as the pipeline's `guidance_scale_2` defaults to)
against a negative prompt's UMT5 embedding, which stage 1 encodes too: the empty prompt, as the pipeline uses, unless
--validation_negative_prompt is given.

Image-to-video (`wan_i2v`, and `wan_ti2v` given an image) renders through WanImageToVideoPipeline from the
`--validation_image` of each prompt, the clip's first frame, which the pipeline encodes itself at render time:
with the VAE, and for Wan 2.1 I2V, whose DiT takes CLIP image features (its config's image_dim), with the CLIP image
encoder and its processor too, loaded only while rendering (`render_models`). Wan 2.2 I2V A14B's DiT takes none."""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

from ...family import Guidance

PIPELINES = ("wan", "wan_ti2v", "wan_i2v")
IMAGE_PIPELINES = ("wan_i2v", "wan_ti2v")  # those that take --validation_image: the first frame of the clip
IMAGE_REQUIRED = ("wan_i2v",)  # those that cannot render without one
FRAMES = 5  # two latent frames: enough to see motion, cheap to render
CFG = Guidance(5.0)  # WanPipeline's default guidance_scale
GUIDANCE = CFG.default


def guidance(pipeline: Any) -> Guidance:
    return CFG


def render_models(pipeline: Any, config: Callable[[str], Any]) -> tuple[str, ...]:
    """The models a sample needs beyond the stage's: the VAE (the decoder; the first frame's encoder too), and for an
    I2V DiT that takes CLIP image features (`config("dit")`'s image_dim: Wan 2.1 I2V) the CLIP image encoder with
    its processor, which WanImageToVideoPipeline runs on the first frame."""
    if getattr(pipeline, "name", pipeline) == "wan_i2v" and config("dit").get("image_dim") is not None:
        return ("vae", "image_encoder", "image_processor")
    return ("vae",)


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None,
           image: Any = None) -> Any:
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    ti2v = getattr(pipeline, "name", pipeline) == "wan_ti2v"
    if ti2v:  # sides the 16x VAE and the DiT's 2x2 patches divide
        width, height = max(32, width // 32 * 32), max(32, height // 32 * 32)
    experts = models.get("experts") or {"transformer": models["dit"]}
    parts = dict(tokenizer=None, text_encoder=None, vae=models["vae"], scheduler=copy.deepcopy(models["scheduler"]),
                 transformer=experts["transformer"], transformer_2=experts.get("transformer_2"),
                 boundary_ratio=models.get("boundary_ratio") if "transformer_2" in experts else None,
                 expand_timesteps=ti2v)
    if image is None:
        pipe, start = WanPipeline(**parts), {}
    else:  # the first frame: encoded by the pipeline (VAE latents and mask, or TI2V's clean first latent frame)
        pipe = WanImageToVideoPipeline(**parts, image_encoder=models.get("image_encoder"),
                                       image_processor=models.get("image_processor"))
        start = {"image": image}
    pipe.set_progress_bar_config(disable=True)
    against = {} if negative is None else {"negative_prompt_embeds": negative["prompt_emb"]}
    frames = pipe(prompt_embeds=embeds["prompt_emb"], width=width, height=height, num_frames=FRAMES,
                  num_inference_steps=steps, guidance_scale=GUIDANCE if guidance is None else guidance,
                  generator=generator, output_type="pil", **start, **against).frames[0]
    strip = Image.new("RGB", (frames[0].width * len(frames), frames[0].height))
    for i, frame in enumerate(frames):
        strip.paste(frame, (i * frame.width, 0))
    return strip

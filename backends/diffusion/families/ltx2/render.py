"""Validation samples of LTX-2: diffusers' LTX2Pipeline with the trained DiT and stage 1's contexts (no text encoder is
loaded); the clip's frames side by side as one image.

Stage 1 keeps what the connectors made of the prompt, not Gemma's hidden states, so the pipeline's `connectors` is a
stand-in that hands those contexts back. The audio VAE is loaded for the shape and statistics of the audio stream the
pipeline denoises beside the video; the video alone is decoded (the pipeline returns denormalised latents and the video VAE
decodes them as LTX2Pipeline does), so no vocoder is needed.
"""

from __future__ import annotations

import copy
from typing import Any

PIPELINES = ("ltx2",)
FRAMES = 9  # a few latent frames: enough to see motion, cheap to render


class CachedContexts:
    """LTX2Pipeline's `connectors` for prompts encoded beforehand: returns the cached contexts whatever it is given."""

    def __init__(self, video: Any, audio: Any, mask: Any) -> None:
        self.outputs = (video, audio, mask)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.outputs


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any) -> Any:
    import torch
    from diffusers import LTX2Pipeline
    from PIL import Image

    with torch.no_grad():
        return _render(LTX2Pipeline, Image, models, embeds, width, height, steps, generator)


def _render(LTX2Pipeline: Any, Image: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int,
            steps: int, generator: Any) -> Any:

    width, height = max(32, width // 32 * 32), max(32, height // 32 * 32)  # the pipeline's sides: multiples of 32
    vae, dit = models["video_vae_encoder"], models["dit"]
    video_context, mask = embeds["video_context"], embeds["context_mask"]
    connectors = CachedContexts(video_context, embeds["audio_context"], mask)
    pipe = LTX2Pipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=vae, audio_vae=models["audio_vae_encoder"],
                        text_encoder=None, tokenizer=None, connectors=None, transformer=dit, vocoder=None)
    pipe.connectors = connectors  # after registration: a stand-in is no pipeline component
    pipe.set_progress_bar_config(disable=True)
    latents, _ = pipe(prompt_embeds=video_context.to(dit.dtype), prompt_attention_mask=mask, width=width, height=height,
                      num_frames=FRAMES, num_inference_steps=steps, guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0,
                      modality_scale=1.0, guidance_rescale=0.0, use_cross_timestep=False, generator=generator, output_type="latent",
                      return_dict=False)
    video = vae.decode(latents.to(vae.dtype), None, return_dict=False)[0]
    frames = pipe.video_processor.postprocess_video(video, output_type="pil")[0]
    strip = Image.new("RGB", (frames[0].width * len(frames), frames[0].height))
    for i, frame in enumerate(frames):
        strip.paste(frame, (i * frame.width, 0))
    return strip

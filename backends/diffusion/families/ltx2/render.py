"""Validation samples of LTX-2: diffusers' LTX2Pipeline with the trained DiT and stage 1's contexts (no text encoder is
loaded); the clip's frames side by side as one image, and its sound (a `Sound`, written beside the image as a WAV file).

Stage 1 keeps what the connectors made of the prompt, not Gemma's hidden states, so the pipeline's `connectors` is a
stand-in that hands those contexts back. The pipeline returns the denormalised latents of both streams; each is decoded
as LTX2Pipeline decodes it: the video by the video VAE, the sound by the audio VAE into a mel spectrogram and by the
vocoder into the waveform. A folder without a vocoder (an optional slot) renders the frames alone.

It guides classifier-free as the pipeline does by default (`guidance_scale` 3 for the video, `audio_guidance_scale` 7
for the sound; --validation_guidance sets both) against a negative prompt's contexts, which stage 1 encodes too: the
empty prompt unless --validation_negative_prompt is given. The pipeline's further guidance terms, spatio-temporal
guidance (STG, at blocks that depend on the release) and modality isolation, each another DiT pass a step, and its
guidance rescale stay off, as the LTX-2.0 DiT the family trains samples without them (and `use_cross_timestep` off).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from ...family import Guidance, Sound

PIPELINES = ("ltx2",)
FRAMES = 9  # a few latent frames: enough to see motion, cheap to render
CFG = Guidance(3.0)  # LTX2Pipeline's default guidance_scale (the video's)
AUDIO_GUIDANCE = 7.0  # its default audio_guidance_scale
GUIDANCE = CFG.default
# STG, modality isolation and rescale off for both streams (the pipeline reads an audio value of 0 or None as "the
# video's", so both are given)
GUIDANCE_TERMS_OFF = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                          guidance_rescale=0.0, audio_guidance_rescale=0.0)


def guidance(pipeline: Any) -> Guidance:
    return CFG


class CachedContexts:
    """LTX2Pipeline's `connectors` for prompts encoded beforehand: returns the cached contexts whatever it is given
    (when the pipeline guides, it batches the negative prompt before the prompt: the negative's contexts, then the
    prompt's)."""

    def __init__(self, embeds: dict[str, Any], negative: Optional[dict[str, Any]] = None) -> None:
        import torch

        names = ("video_context", "audio_context", "context_mask")
        both = [embeds] if negative is None else [negative, embeds]
        self.outputs = tuple(torch.cat([e[n] for e in both]) for n in names)

    def __call__(self, prompt_embeds: Any, *args: Any, **kwargs: Any) -> Any:
        rows = prompt_embeds.shape[0]  # 2 under guidance, else 1: the prompt's alone
        return tuple(o[-rows:] for o in self.outputs)


def render(pipeline: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int, steps: int,
           generator: Any, guidance: Optional[float] = None, negative: Optional[dict[str, Any]] = None) -> Any:
    import torch
    from diffusers import LTX2Pipeline
    from PIL import Image

    with torch.no_grad():
        return _render(LTX2Pipeline, Image, models, embeds, width, height, steps, generator, guidance, negative)


def _render(LTX2Pipeline: Any, Image: Any, models: dict[str, Any], embeds: dict[str, Any], width: int, height: int,
            steps: int, generator: Any, guidance: Optional[float], negative: Optional[dict[str, Any]]) -> Any:

    width, height = max(32, width // 32 * 32), max(32, height // 32 * 32)  # the pipeline's sides: multiples of 32
    vae, dit = models["video_vae_encoder"], models["dit"]
    video_context, mask = embeds["video_context"], embeds["context_mask"]
    connectors = CachedContexts(embeds, negative)
    pipe = LTX2Pipeline(scheduler=copy.deepcopy(models["scheduler"]), vae=vae, audio_vae=models["audio_vae_encoder"],
                        text_encoder=None, tokenizer=None, connectors=None, transformer=dit, vocoder=None)
    pipe.connectors = connectors  # after registration: a stand-in is no pipeline component
    pipe.set_progress_bar_config(disable=True)
    # the pipeline checks the negative's shape against the prompt's and batches them; the stand-in ignores both
    against = {} if negative is None else {"negative_prompt_embeds": video_context.to(dit.dtype),
                                           "negative_prompt_attention_mask": mask}
    latents, audio_latents = pipe(
        prompt_embeds=video_context.to(dit.dtype), prompt_attention_mask=mask, width=width, height=height,
        num_frames=FRAMES, num_inference_steps=steps, guidance_scale=GUIDANCE if guidance is None else guidance,
        audio_guidance_scale=AUDIO_GUIDANCE if guidance is None else guidance, **GUIDANCE_TERMS_OFF,
        use_cross_timestep=False, generator=generator, output_type="latent", return_dict=False, **against)
    video = vae.decode(latents.to(vae.dtype), None, return_dict=False)[0]
    frames = pipe.video_processor.postprocess_video(video, output_type="pil")[0]
    strip = Image.new("RGB", (frames[0].width * len(frames), frames[0].height))
    for i, frame in enumerate(frames):
        strip.paste(frame, (i * frame.width, 0))
    vocoder = models.get("vocoder")
    if vocoder is None:
        return strip
    audio_vae = models["audio_vae_encoder"]
    mel = audio_vae.decode(audio_latents.to(audio_vae.dtype), return_dict=False)[0]
    waveform = vocoder(mel)[0]  # [channels, samples]
    return strip, Sound(waveform.float().cpu(), int(vocoder.config.output_sampling_rate))

"""Wan's units: each declaration right above the code that runs it.

Params of the Wan pipelines (one sample; tensors carry a batch dimension of 1), as diffusers' WanPipeline
and WanImageToVideoPipeline compute them and DiffSynth-Studio's Wan training feeds them:

  dataset    video (a clip: the first --num_frames frames, 4k+1, as PIL frames; a still image is one frame),
             prompt (str)
  shape      video becomes a float tensor (1, 3, F, H, W) in [-1, 1], each frame resized to cover the target
             size and centre-cropped (sides multiples of 16); height, width, num_frames
  vae        latent_mean, latent_logvar (1, z, (F-1)/4+1, H/8, W/8): the posterior, normalised by the VAE's
             latents_mean / latents_std
  text       prompt_emb (1, 512, D): UMT5's last hidden state over the cleaned prompt padded to 512 tokens,
             zero after the prompt's own tokens
  latents    input_latents: the posterior mean (--vae_latents sample: a draw of the posterior, non-deterministic)
  fresh      noise; timestep and loss_weight: a position of TRAINING_SCHEDULE and its weight (non-deterministic)
  wan_ti2v   (Wan 2.2 TI2V-5B, its 4x16x16 VAE of z 48: frame sides multiples of 32) first_frame_latents
             (1, z, 1, h, w): the VAE mode of the clip's first frame alone, normalised, with `--extra_inputs
             input_image` (image-to-video); None without (text-to-video)
  wan_i2v    input_image: the clip's first frame (DiffSynth's `input_image`, data["video"][0]);
             condition (1, 4 + z, T, h, w): the first-frame mask and the VAE mode of [frame, zeros...];
             image_embeds (1, 257, D_clip): CLIP vision's penultimate hidden states of the first frame, or
             None for a DiT without image conditioning (its config's image_dim, read without its weights)

Each function is `fn(ctx, **inputs) -> {output: value}` over one sample. torch is imported on first use.
"""

from __future__ import annotations

import html
import re
from typing import Any

from ...data.imaging import cover_crop, image_to_pixels
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, padded_prompts, unit
from ...flowmatch import TrainingSchedule, sample_training_timestep

torch = lazy_module("torch")

MULTIPLE = 16  # frame sides are multiples of this (VAE factor 8 x 2x2 patches)
TEXT_LENGTH = 512  # diffusers' max_sequence_length; the I2V attention splits text from image tokens at 512
TI2V_MULTIPLE = 32  # Wan 2.2 TI2V-5B: VAE factor 16 x 2x2 patches
# DiffSynth-Studio's "Wan" training template: a static shift of 5 over 1000 sigmas from 1 towards 0 (0 itself left out)
TRAINING_SCHEDULE = TrainingSchedule(shift=5.0)

# ------------------------------------------------------------------------------------------------
# shapes


def clip_frames(video: Any) -> list[Any]:
    """A sample's clip as a list of PIL frames (a single image is a one-frame clip)."""
    from PIL import Image

    if video is None:
        raise BackendError("sample has no video (the Wan pipelines need a video column)")
    frames = list(video) if isinstance(video, (list, tuple)) else [video]
    if not frames or not all(isinstance(f, Image.Image) for f in frames):
        raise BackendError("expected a video clip (a list of frames)")
    return frames


def shaped_clip(ctx, video: Any, multiple: int) -> dict[str, Any]:
    frames = [image_to_pixels(f, ctx.size, ctx.dtype, multiple) for f in clip_frames(video)]
    pixels = torch.stack(frames, dim=2)  # (1, 3, F, H, W)
    return {"video": pixels, "height": int(pixels.shape[-2]), "width": int(pixels.shape[-1]),
            "num_frames": int(pixels.shape[2])}


@unit("VideoShapeChecker", inputs=("video",), outputs=("video", "height", "width", "num_frames"),
      settings=("image_size", "dtype", "cache_dtype"))
def video_shape_checker(ctx, video: Any) -> dict[str, Any]:
    return shaped_clip(ctx, video, MULTIPLE)


@unit("TI2VShapeChecker", inputs=("video",), outputs=("video", "height", "width", "num_frames"),
      settings=("image_size", "dtype", "cache_dtype"))
def ti2v_shape_checker(ctx, video: Any) -> dict[str, Any]:
    """As VideoShapeChecker, sides multiples of 32: TI2V-5B's VAE downsamples 16x and its DiT takes 2x2 patches, so
    a side of 16 (k odd) would leave the DiT a latent row it cannot patch; --height/--width must be such sides."""
    size = ctx.size
    if size.height is not None and size.width is not None and (size.height % TI2V_MULTIPLE or size.width % TI2V_MULTIPLE):
        raise BackendError(f"wan_ti2v needs --height and --width multiples of {TI2V_MULTIPLE} (its VAE downsamples 16x "
                           f"and its DiT takes 2x2 patches), got {size.height}x{size.width}")
    return shaped_clip(ctx, video, TI2V_MULTIPLE)


@unit("FirstFrame", inputs=("video",), outputs=("input_image",), settings=("image_size",))
def first_frame(ctx, video: Any) -> dict[str, Any]:
    """The image the clip starts from, at the clip's size (DiffSynth's `--extra_inputs input_image`)."""
    return {"input_image": cover_crop(clip_frames(video)[0], ctx.size, MULTIPLE)}


# ------------------------------------------------------------------------------------------------
# VAE


def _stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, dtype=like.dtype, device=like.device).view(1, z, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=like.dtype, device=like.device).view(1, z, 1, 1, 1)
    return mean, std


def encode_distribution(ctx, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior of a clip, normalised as the pipelines do ((z - latents_mean) / latents_std)."""
    raw = ctx.raw("vae")
    posterior = ctx.model("vae").encode(ctx.tensor(pixels).to(raw.dtype)).latent_dist
    mean, std = _stats(raw, posterior.mean)
    return (posterior.mean - mean) / std, posterior.logvar - 2.0 * torch.log(std)


@unit("VideoEncoder", inputs=("video",), outputs=("latent_mean", "latent_logvar"), models=("vae",),
      settings=("dtype", "cache_dtype"), batch="stack")
def video_encoder(ctx, video: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, video)
    return {"latent_mean": mean, "latent_logvar": logvar}


def first_frame_mask(num_frames: int, latent_frames: int, h: int, w: int, factor: int) -> torch.Tensor:
    """(1, factor, T, h, w): WanImageToVideoPipeline's mask, 1 on the latent frame holding the given image."""
    mask = torch.ones(1, 1, num_frames, h, w)
    mask[:, :, 1:] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=factor)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)
    return mask.view(1, -1, factor, h, w).transpose(1, 2)[:, :, :latent_frames]


@unit("ImageConditioner", inputs=("video", "num_frames"), outputs=("condition",), models=("vae",),
      settings=("dtype", "cache_dtype"))
def image_conditioner(ctx, video: torch.Tensor, num_frames: int) -> dict[str, Any]:
    """The I2V conditioning latents: the VAE mode of [first frame, zeros x (F-1)], normalised, after the mask."""
    raw = ctx.raw("vae")
    pixels = ctx.tensor(video).to(raw.dtype)
    condition = torch.cat([pixels[:, :, :1], torch.zeros_like(pixels[:, :, 1:])], dim=2)
    latents = ctx.model("vae").encode(condition).latent_dist.mode()
    mean, std = _stats(raw, latents)
    latents = (latents - mean) / std
    factor = int(getattr(raw.config, "scale_factor_temporal", None) or 4)
    _, _, t, h, w = latents.shape
    mask = first_frame_mask(int(num_frames), t, h, w, factor).to(latents.device, latents.dtype)
    return {"condition": torch.cat([mask, latents], dim=1)}


@unit("FirstFrameLatents", inputs=("video", "num_frames"), outputs=("first_frame_latents",), models=("vae",),
      settings=("dtype", "cache_dtype", "derived_inputs"))
def first_frame_latents(ctx, video: torch.Tensor, num_frames: int) -> dict[str, Any]:
    """TI2V-5B's image conditioning, asked for with `--extra_inputs input_image` as DiffSynth's command asks: the
    VAE mode of the clip's first frame encoded alone, normalised (WanImageToVideoPipeline.prepare_latents with
    expand_timesteps; DiffSynth's WanVideoUnit_ImageEmbedderFused). The loss puts it in place of the first latent
    frame, clean. Without the flag None: the sample trains text-to-video, as DiffSynth's does."""
    if "input_image" not in ctx.settings.derived_inputs:
        return {"first_frame_latents": None}
    if int(num_frames) < 5:
        raise BackendError(f"wan_ti2v with --extra_inputs input_image needs clips of 5 frames or more (a clip of "
                           f"{int(num_frames)} has no frame after the given one to train; --num_frames)")
    raw = ctx.raw("vae")
    pixels = ctx.tensor(video).to(raw.dtype)[:, :, :1]
    latents = ctx.model("vae").encode(pixels).latent_dist.mode()
    mean, std = _stats(raw, latents)
    return {"first_frame_latents": (latents - mean) / std}


@unit("ImageEmbedder", inputs=("input_image",), outputs=("image_embeds",), models=("image_encoder",),
      configs=("dit",), settings=("dtype", "cache_dtype"))
def image_embedder(ctx, input_image: Any) -> dict[str, Any]:
    """CLIP vision's penultimate hidden states of the first frame (WanImageToVideoPipeline.encode_image); None when
    the DiT takes no image embedding (image_dim None: Wan 2.2), which only the DiT's config says."""
    if ctx.config("dit").get("image_dim") is None:
        return {"image_embeds": None}
    if "image_encoder" not in ctx.models:
        raise BackendError("this DiT takes CLIP image features (its config's image_dim), but no image_encoder was given "
                           "(none in the pipeline folder or the model paths): add the image encoder's folder to "
                           "--model_paths or --model_id_with_origin_paths")
    inputs = ctx.model("image_processor")(images=input_image, return_tensors="pt")
    out = ctx.model("image_encoder")(pixel_values=inputs["pixel_values"].to(ctx.device), output_hidden_states=True)
    return {"image_embeds": out.hidden_states[-2].to(ctx.dtype)}


# ------------------------------------------------------------------------------------------------
# text


def clean_prompt(text: str) -> str:
    """diffusers' Wan prompt_clean without ftfy: HTML entities undone (twice), whitespace collapsed."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


def encode_prompts(ctx, prompts: list[Any]) -> torch.Tensor:
    """UMT5 over each prompt padded to 512 tokens, zeroed after its own (WanPipeline._get_t5_prompt_embeds): (n, 512, D)."""
    tokens = ctx.model("tokenizer")([clean_prompt(prompt_text(p)) for p in prompts], padding="max_length", max_length=TEXT_LENGTH,
                                    truncation=True, add_special_tokens=True, return_attention_mask=True,
                                    return_tensors="pt")
    ids, mask = tokens.input_ids.to(ctx.device), tokens.attention_mask.to(ctx.device)
    hidden = ctx.model("text_encoder")(ids, mask).last_hidden_state
    return torch.where(mask[..., None].bool(), hidden, hidden.new_zeros(())).to(ctx.dtype)  # exact zeros after


@unit("PromptEncoder", inputs=("prompt",), outputs=("prompt_emb",), models=("text_encoder",),
      settings=("dtype", "cache_dtype"), batch=padded_prompts(encode_prompts, "prompt_emb"))
def prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    return {"prompt_emb": encode_prompts(ctx, [prompt])}


# ------------------------------------------------------------------------------------------------
# noise, timesteps


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "loss_weighting", "timestep_sampling", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    return sample_training_timestep(ctx, TRAINING_SCHEDULE)


# ------------------------------------------------------------------------------------------------
# direct distillation (DiffSynth's examples/wanvideo/model_training/special/direct_distill)


@unit("SeededNoise", inputs=("input_latents", "seed", "rand_device"), outputs=("noise",), settings=("cache_dtype",))
def seeded_noise(ctx, input_latents: torch.Tensor, seed: Any, rand_device: Any) -> dict[str, Any]:
    """The sampler's starting noise as DiffSynth's generate_noise draws it: float32 normals from a generator seeded
    with the sample's `seed` on `rand_device` (default cpu), shaped as the clip's latents, then in their dtype.
    Deterministic, so stage 1 computes it once."""
    if seed is None:
        raise BackendError("direct_distill needs a 'seed' column in the metadata (and --extra_inputs seed,...)")
    device = str(rand_device or "cpu")
    try:
        generator = torch.Generator(device).manual_seed(int(seed))
        noise = torch.randn(tuple(input_latents.shape), generator=generator, device=device, dtype=torch.float32)
    except RuntimeError as exc:
        raise BackendError(f"rand_device {device!r}: cannot draw noise there ({str(exc).splitlines()[0]})") from None
    return {"noise": noise.to(device=input_latents.device, dtype=input_latents.dtype)}

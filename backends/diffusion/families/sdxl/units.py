"""SDXL's units: each declaration right above the code that runs it.

Params of the sdxl pipeline (one sample; tensors carry a batch dimension of 1), computed as diffusers'
StableDiffusionXLPipeline and DiffSynth-Studio's StableDiffusionXLPipeline compute them:

  dataset    image (PIL), prompt (str)
  shape      image becomes a float tensor (1, 3, H, W) in [-1, 1]: --height x --width, else scaled down to
             --max_pixels with sides multiples of 32 (DiffSynth's SDXL dataset); height, width (multiples of 8)
  vae        latent_mean, latent_logvar: the VAE posterior times scaling_factor (SDXL's VAE has no shift); a
             float16 VAE whose config says force_upcast encodes in float32, as the pipeline decodes
  clip       prompt_emb_1 (1, 77, D_1): text_encoder's penultimate hidden states over the prompt padded to 77 tokens
  clip 2     prompt_emb_2 (1, 77, D_2): text_encoder_2's penultimate hidden states (its tokenizer pads with its own
             pad token); pooled_prompt_emb (1, P): its projected pooled output (`text_embeds`)
  joined     prompt_emb (1, 77, D_1 + D_2): the two concatenated, as encode_prompt concatenates them
  time ids   add_time_ids (1, 6) int64: original size (height, width), crop top-left (0, 0), target size (height,
             width) of the training image (`_get_add_time_ids` as the pipeline calls it by default, and DiffSynth's
             AddTimeIdsComputer: the image is a whole picture of its own size; the dataset's centre crop is not told)
  latents    input_latents: a draw of the posterior (mean + std x noise, from ctx.rng("latent"), fresh every epoch),
             as DiffSynth's SDXL pipeline encodes the training image (`vae.encode(image).sample()`); --vae_latents
             mean: the posterior mean, computed once in stage 1
  fresh      noise; timestep (int64, one of the scheduler's 1000 training steps) and loss_weight (None: the DDPM
             weight is 1), non-deterministic (ddpm.sample_ddpm_timestep)

Where this knowingly differs from DiffSynth-Studio's own SDXL pipeline (2.1.12): its text_encoder unit reads the hidden
states of one layer earlier (`hidden_states[-(clip_skip + 1)]` with clip_skip 2: the output of layer 10 of CLIP
ViT-L's 12), where diffusers' StableDiffusionXLPipeline and SDXL's reference code read the penultimate layer, as here;
and its text_encoder_2 projects the first token's hidden state as the pooled embedding (`last_hidden_state[:, 0]`,
the same for every prompt under CLIP's causal mask), where CLIP pools at the end-of-text token, as here. Given those
two, both sources give the same loss (tests/test_diffsynth_both_sources.py).

The two CLIP encoders are separate units, so a LoRA on one leaves the other (and the VAE) in stage 1. Each function
is `fn(ctx, **inputs) -> {output: value}` over one sample; it touches only the models it declares, and a
non-deterministic unit draws only from `ctx.rng(purpose)`. torch is imported on first use.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from ...data.imaging import image_to_pixels
from ...ddpm import sample_ddpm_timestep
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, padded_prompts, unit

torch = lazy_module("torch")

MULTIPLE = 32  # DiffSynth's SDXL dataset sizes images with sides multiples of 32 (--max_pixels)
VAE_FACTOR = 8  # the VAE's downsampling: the pipeline's sides must be multiples of it
CROP_TOP_LEFT = (0, 0)  # the crop coordinates SDXL is told: the image is the whole picture
PENULTIMATE = -2  # both encoders' hidden states are read one layer before the last (SDXL's clip skip)
CLIP_MAX_LENGTH = 77  # SDXL's tokenizers' model_max_length, which the units pad every prompt to
TIME_IDS = 6  # original size, crop top-left, target size

# ------------------------------------------------------------------------------------------------
# shapes


@unit("ShapeChecker", inputs=("image",), outputs=("image", "height", "width"),
      settings=("image_size", "dtype", "cache_dtype"))
def shape_checker(ctx, image: Any) -> dict[str, Any]:
    if image is None:
        raise BackendError("sample has no image")
    pixels = image_to_pixels(image, ctx.size, ctx.dtype, MULTIPLE)
    height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
    if height % VAE_FACTOR or width % VAE_FACTOR:
        raise BackendError(f"an image of {width}x{height} px: SDXL needs sides that are multiples of {VAE_FACTOR}")
    return {"image": pixels, "height": height, "width": width}


# ------------------------------------------------------------------------------------------------
# VAE


def _device_kind(ctx) -> str:
    return getattr(ctx.device, "type", None) or str(ctx.device).split(":")[0]


def _upcast(ctx, vae) -> bool:
    """True when the VAE must encode in float32: a float16 VAE whose config says force_upcast (SDXL's VAE overflows
    in float16), which is then converted to float32 once, as StableDiffusionXLPipeline.upcast_vae converts it."""
    key = ("vae-upcast", id(vae))
    if key not in ctx.memo:
        weights = [p for p in vae.parameters() if p.is_floating_point()]
        upcast = bool(getattr(vae.config, "force_upcast", False)) and bool(weights) and \
            all(p.dtype == torch.float16 for p in weights)
        if upcast:  # (torch's own `to`: diffusers' warns of float32 modules an AutoencoderKL does not have)
            torch.nn.Module.to(vae, torch.float32)
        ctx.memo[key] = upcast
    return ctx.memo[key]


def encode_posterior(ctx, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior of images in the UNet's latent space: (mean * scale, logvar + 2 log scale)."""
    vae = ctx.raw("vae")
    upcast = _upcast(ctx, vae)
    dtype = torch.float32 if upcast else vae.dtype
    off = torch.autocast(_device_kind(ctx), enabled=False) if upcast else contextlib.nullcontext()
    with off:
        posterior = ctx.model("vae").encode(ctx.tensor(pixels).to(dtype)).latent_dist
    scale = float(vae.config.scaling_factor)
    return posterior.mean * scale, posterior.logvar + 2.0 * math.log(scale)


@unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae",),
      settings=("dtype", "cache_dtype"), batch="stack")
def image_encoder(ctx, image: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_posterior(ctx, image)
    return {"latent_mean": mean, "latent_logvar": logvar}


# ------------------------------------------------------------------------------------------------
# text



def token_ids(tokenizer: Any, prompts: list[Any]) -> torch.Tensor:
    """Each prompt padded (and cut) to the tokenizer's model_max_length, as encode_prompt tokenizes it."""
    return tokenizer([prompt_text(p) for p in prompts], padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids


def clip_hidden(ctx, prompts: list[Any]) -> torch.Tensor:
    """text_encoder's penultimate hidden states: (n, 77, D_1)."""
    ids = token_ids(ctx.model("tokenizer"), prompts)
    out = ctx.model("text_encoder")(ids.to(ctx.device), output_hidden_states=True)
    return out.hidden_states[PENULTIMATE].to(ctx.dtype)


def clip_2_outputs(ctx, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """text_encoder_2's penultimate hidden states (n, 77, D_2) and its projected pooled output (n, P)."""
    ids = token_ids(ctx.model("tokenizer_2"), prompts)
    out = ctx.model("text_encoder_2")(ids.to(ctx.device), output_hidden_states=True)
    return out.hidden_states[PENULTIMATE].to(ctx.dtype), out.text_embeds.to(ctx.dtype)


@unit("ClipPromptEncoder", inputs=("prompt",), outputs=("prompt_emb_1",), models=("text_encoder",),
      settings=("dtype", "cache_dtype"), batch=padded_prompts(clip_hidden, "prompt_emb_1"))
def clip_prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    return {"prompt_emb_1": clip_hidden(ctx, [prompt])}


def _clip_2_batch(ctx, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    hidden, pooled = clip_2_outputs(ctx, [s["prompt"] for s in samples])
    return [{"prompt_emb_2": hidden[k:k + 1], "pooled_prompt_emb": pooled[k:k + 1]} for k in range(len(samples))]


@unit("Clip2PromptEncoder", inputs=("prompt",), outputs=("prompt_emb_2", "pooled_prompt_emb"),
      models=("text_encoder_2",), settings=("dtype", "cache_dtype"), batch=_clip_2_batch)
def clip_2_prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    hidden, pooled = clip_2_outputs(ctx, [prompt])
    return {"prompt_emb_2": hidden, "pooled_prompt_emb": pooled}


def join_prompt_embeds(prompt_emb_1: torch.Tensor, prompt_emb_2: torch.Tensor) -> torch.Tensor:
    """The UNet's cross-attention context: both encoders' hidden states side by side, the first's first."""
    return torch.cat([prompt_emb_1, prompt_emb_2.to(prompt_emb_1.dtype)], dim=-1)


@unit("PromptEmbedJoiner", inputs=("prompt_emb_1", "prompt_emb_2"), outputs=("prompt_emb",), settings=("cache_dtype",))
def prompt_embed_joiner(ctx, prompt_emb_1: torch.Tensor, prompt_emb_2: torch.Tensor) -> dict[str, Any]:
    return {"prompt_emb": join_prompt_embeds(ctx.tensor(prompt_emb_1), ctx.tensor(prompt_emb_2))}


# ------------------------------------------------------------------------------------------------
# micro-conditioning, noise, timesteps


def time_ids(original_size: tuple[int, int], crops_coords_top_left: tuple[int, int],
             target_size: tuple[int, int]) -> torch.Tensor:
    """(1, 6) int64: the sizes and crop SDXL is conditioned on, in `_get_add_time_ids`' order (exact integers: the
    loss casts them to the UNet's dtype, as the pipeline makes them in the prompt embeddings' dtype)."""
    return torch.tensor([list(original_size) + list(crops_coords_top_left) + list(target_size)], dtype=torch.long)


@unit("AddTimeIdsComputer", inputs=("height", "width"), outputs=("add_time_ids",), settings=("cache_dtype",))
def add_time_ids_computer(ctx, height: int, width: int) -> dict[str, Any]:
    size = (int(height), int(width))
    return {"add_time_ids": time_ids(size, CROP_TOP_LEFT, size)}


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "timestep_sampling", "snr_gamma", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    """One of the scheduler's training timesteps (999 .. 0), drawn within --min/max_timestep_boundary."""
    return sample_ddpm_timestep(ctx)

"""Stable Diffusion 1.5's units: each declaration right above the code that runs it.

Params of the pipeline (one sample; tensors carry a batch dimension of 1), computed as diffusers'
StableDiffusionPipeline computes them and as DiffSynth-Studio's StableDiffusionPipeline units do:

  dataset    image (PIL), prompt (str)
  shape      image becomes a float tensor (1, 3, H, W) in [-1, 1], sides multiples of 32 (DiffSynth's SD training
             script sizes its images by 32: examples/stable_diffusion/model_training/train.py)
  vae        latent_mean, latent_logvar: the VAE posterior in the UNet's latent space (times scaling_factor)
  latents    input_latents: the posterior mean (--vae_latents sample: a draw of the posterior, non-deterministic)
  clip       prompt_embeds (1, 77, D): CLIP's last hidden state over the prompt padded to 77 tokens
             (StableDiffusionPipeline.encode_prompt without clip_skip; DiffSynth's SDUnit_PromptEmbedder)
  fresh      noise; timestep (an integer 0..999 of the DDPM schedule, ddpm.py) and loss_weight (None: DiffSynth's
             DDPM weight is 1), both non-deterministic

Each function is `fn(ctx, **inputs) -> {output: value}` over one sample; it touches only the models it declares,
and a non-deterministic unit draws only from `ctx.rng(purpose)`. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any

from ...data.imaging import image_to_pixels
from ...ddpm import sample_ddpm_timestep
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, padded_prompts, unit

torch = lazy_module("torch")

# Image sides are multiples of this: DiffSynth's SD dataset operator rounds to 32 (height/width_division_factor=32),
# which also satisfies diffusers' rule for the pipeline (multiples of the VAE's factor 8).
MULTIPLE = 32
CLIP_MAX_LENGTH = 77  # CLIP ViT-L/14's positions: the tokenizer's model_max_length, as both pipelines pad to it

# ------------------------------------------------------------------------------------------------
# shapes


@unit("ShapeChecker", inputs=("image",), outputs=("image", "height", "width"),
      settings=("image_size", "dtype", "cache_dtype"))
def shape_checker(ctx, image: Any) -> dict[str, Any]:
    if image is None:
        raise BackendError("sample has no image")
    pixels = image_to_pixels(image, ctx.size, ctx.dtype, MULTIPLE)
    return {"image": pixels, "height": int(pixels.shape[-2]), "width": int(pixels.shape[-1])}


# ------------------------------------------------------------------------------------------------
# VAE


def encode_distribution(ctx, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior of an image in the UNet's latent space: (mean * scale, logvar + 2 log scale), with
    SD's scaling_factor (0.18215); a VAE with a shift_factor is shifted first, as diffusers does."""
    vae = ctx.model("vae")
    config = ctx.raw("vae").config
    posterior = vae.encode(ctx.tensor(pixels).to(ctx.raw("vae").dtype)).latent_dist
    scale, shift = float(config.scaling_factor), float(getattr(config, "shift_factor", None) or 0.0)
    mean = (posterior.mean - shift) * scale
    logvar = posterior.logvar + 2.0 * torch.log(torch.tensor(scale, dtype=posterior.logvar.dtype))
    return mean, logvar


@unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae",),
      settings=("dtype", "cache_dtype"), batch="stack")
def image_encoder(ctx, image: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, image)
    return {"latent_mean": mean, "latent_logvar": logvar}


# ------------------------------------------------------------------------------------------------
# text



def clip_hidden(ctx, prompts: list[Any]) -> torch.Tensor:
    """CLIP's last hidden state (after its final layer norm) over each prompt padded to 77 tokens: (n, 77, D).

    As StableDiffusionPipeline.encode_prompt computes prompt_embeds without clip_skip (an attention mask only for a
    text encoder whose config asks for one), and as DiffSynth's SDUnit_PromptEmbedder does."""
    tokenizer = ctx.model("tokenizer")
    encoder = ctx.model("text_encoder")
    tokens = tokenizer([prompt_text(p) for p in prompts], padding="max_length", max_length=CLIP_MAX_LENGTH,
                       truncation=True, return_tensors="pt")
    mask = None
    if getattr(ctx.raw("text_encoder").config, "use_attention_mask", False):
        mask = tokens.attention_mask.to(ctx.device)
    out = encoder(tokens.input_ids.to(ctx.device), attention_mask=mask)
    return out[0].to(ctx.dtype)


@unit("PromptEncoder", inputs=("prompt",), outputs=("prompt_embeds",), models=("text_encoder",),
      settings=("dtype", "cache_dtype"), batch=padded_prompts(clip_hidden, "prompt_embeds"))
def prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    return {"prompt_embeds": clip_hidden(ctx, [prompt])}


# ------------------------------------------------------------------------------------------------
# noise, timesteps


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "timestep_sampling", "snr_gamma", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    """A DDPM timestep of the scheduler config's schedule (ddpm.sample_ddpm_timestep); loss_weight None."""
    return sample_ddpm_timestep(ctx)

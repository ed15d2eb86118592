"""FLUX.1's units: each declaration right above the code that runs it.

Params of the FLUX pipelines (one sample; tensors carry a batch dimension of 1), computed as diffusers'
FluxPipeline and FluxKontextPipeline compute them:

  dataset    image (PIL), prompt (str), embedded_guidance (float, optional: the distilled guidance the
             DiT is told; 1 when absent, as DiffSynth-Studio trains), kontext_images (flux_kontext: one
             PIL image or a list of them, --extra_inputs kontext_images)
  shape      image becomes a float tensor (1, 3, H, W) in [-1, 1], sides multiples of 16
  vae        latent_mean, latent_logvar: the VAE posterior, shifted and scaled (shift_factor, scaling_factor)
  clip       pooled_prompt_emb (1, D_clip): CLIP's pooled output over the prompt padded to 77 tokens
  t5         prompt_emb (1, 512, D_t5): T5's last hidden state over the prompt padded to 512 tokens
  guidance   guidance (1,): the embedded guidance value
  latents    input_latents: the posterior mean (--vae_latents sample: a draw of the posterior, non-deterministic)
  fresh      noise; timestep and loss_weight: a position of TRAINING_SCHEDULE and its weight (non-deterministic)
  packed     input_latents/noise as 2x2 patches (1, h/2 * w/2, 4 C); latent_grid [[h/2, w/2]] (the RoPE
             ids are made from it in the loss: (0, row, col) per image token, zeros per text token)
  kontext    kontext_pixels (each kontext image sized like the target), kontext_latents (their VAE modes,
             packed and joined along the tokens), kontext_grids [[[h/2, w/2], ...]] (ids (1, row, col))

CLIP and T5 are separate units, so a LoRA on one text encoder leaves the other (and the VAE) in stage 1.
Each function is `fn(ctx, **inputs) -> {output: value}` over one sample; it touches only the models it
declares, and a non-deterministic unit draws only from `ctx.rng(purpose)`. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any

from ...data.imaging import image_list, image_to_pixels
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, padded_prompts, unit
from ...flowmatch import TrainingSchedule, sample_training_timestep

torch = lazy_module("torch")

MULTIPLE = 16  # image sides are multiples of this (VAE factor 8 x 2x2 patches)
CLIP_MAX_LENGTH = 77  # diffusers' tokenizer_max_length (the CLIP tokenizer's model_max_length)
T5_SEQUENCE_LENGTH = 512  # diffusers' max_sequence_length default, DiffSynth's t5_sequence_length
DEFAULT_GUIDANCE = 1.0  # DiffSynth-Studio's FLUX training passes embedded_guidance=1

# ------------------------------------------------------------------------------------------------
# shapes


@unit("ShapeChecker", inputs=("image",), outputs=("image", "height", "width"),
      settings=("image_size", "dtype", "cache_dtype"))
def shape_checker(ctx, image: Any) -> dict[str, Any]:
    if image is None:
        raise BackendError("sample has no image")
    pixels = image_to_pixels(image, ctx.size, ctx.dtype, MULTIPLE)
    return {"image": pixels, "height": int(pixels.shape[-2]), "width": int(pixels.shape[-1])}


def kontext_list(kontext_images: Any) -> list[Any]:
    """A sample's Kontext reference images as a list (one image, or a list of them)."""
    return image_list(kontext_images, "kontext image", "sample has no kontext image (flux_kontext needs a "
                      "kontext_images column: --extra_inputs kontext_images)")


@unit("KontextShapeChecker", inputs=("kontext_images",), outputs=("kontext_pixels",),
      settings=("image_size", "dtype", "cache_dtype"))
def kontext_shape_checker(ctx, kontext_images: Any) -> dict[str, Any]:
    """Each reference image sized by the target's rule (as DiffSynth's dataset sizes every image file it loads)."""
    return {"kontext_pixels": [image_to_pixels(im, ctx.size, ctx.dtype, MULTIPLE) for im in kontext_list(kontext_images)]}


# ------------------------------------------------------------------------------------------------
# VAE


def encode_distribution(ctx, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior of an image in the DiT's latent space: ((mean - shift) * scale, logvar + 2 log scale)."""
    vae = ctx.model("vae_encoder")
    config = ctx.raw("vae_encoder").config
    posterior = vae.encode(ctx.tensor(pixels).to(ctx.raw("vae_encoder").dtype)).latent_dist
    scale, shift = float(config.scaling_factor), float(config.shift_factor or 0.0)
    mean = (posterior.mean - shift) * scale
    logvar = posterior.logvar + 2.0 * torch.log(torch.tensor(scale, dtype=posterior.logvar.dtype))
    return mean, logvar


@unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae_encoder",),
      settings=("dtype", "cache_dtype"), batch="stack")
def image_encoder(ctx, image: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, image)
    return {"latent_mean": mean, "latent_logvar": logvar}


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): 2x2 patches, as diffusers' FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise BackendError(f"cannot pack latents of shape {tuple(latents.shape)} (need even sides)")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


@unit("KontextImageEncoder", inputs=("kontext_pixels",), outputs=("kontext_latents", "kontext_grids"),
      models=("vae_encoder",), settings=("dtype", "cache_dtype"))
def kontext_image_encoder(ctx, kontext_pixels: list) -> dict[str, Any]:
    """The reference images' latents (the posterior mode, as FluxKontextPipeline's argmax), packed and joined."""
    latents = [encode_distribution(ctx, pixels)[0] for pixels in kontext_pixels]
    grids = [[int(z.shape[-2]) // 2, int(z.shape[-1]) // 2] for z in latents]
    return {"kontext_latents": torch.cat([pack(z) for z in latents], dim=1), "kontext_grids": [grids]}


# ------------------------------------------------------------------------------------------------
# text



def clip_pooled(ctx, prompts: list[Any]) -> torch.Tensor:
    """CLIP's pooled output over each prompt padded to 77 tokens (FluxPipeline._get_clip_prompt_embeds): (n, D)."""
    tokenizer = ctx.model("tokenizer_1")
    ids = tokenizer([prompt_text(p) for p in prompts], padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True,
                    return_tensors="pt").input_ids
    out = ctx.model("text_encoder_1")(ids.to(ctx.device), output_hidden_states=False)
    return out.pooler_output.to(ctx.dtype)


@unit("ClipPromptEncoder", inputs=("prompt",), outputs=("pooled_prompt_emb",), models=("text_encoder_1",),
      settings=("dtype", "cache_dtype"), batch=padded_prompts(clip_pooled, "pooled_prompt_emb"))
def clip_prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    return {"pooled_prompt_emb": clip_pooled(ctx, [prompt])}


def t5_hidden(ctx, prompts: list[Any]) -> torch.Tensor:
    """T5's last hidden state over each prompt padded to 512 tokens (FluxPipeline._get_t5_prompt_embeds): (n, 512, D)."""
    tokenizer = ctx.model("tokenizer_2")
    ids = tokenizer([prompt_text(p) for p in prompts], padding="max_length", max_length=T5_SEQUENCE_LENGTH,
                    truncation=True, return_tensors="pt").input_ids
    out = ctx.model("text_encoder_2")(ids.to(ctx.device), output_hidden_states=False)
    return out[0].to(ctx.dtype)


def _t5_batch(ctx, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    hidden = t5_hidden(ctx, [s["prompt"] for s in samples])  # every prompt padded to 512: one batch
    return [{"prompt_emb": hidden[k:k + 1]} for k in range(len(samples))]


@unit("T5PromptEncoder", inputs=("prompt",), outputs=("prompt_emb",), models=("text_encoder_2",),
      settings=("dtype", "cache_dtype"), batch=_t5_batch)
def t5_prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    return {"prompt_emb": t5_hidden(ctx, [prompt])}


@unit("GuidanceEmbedder", inputs=("embedded_guidance",), outputs=("guidance",), settings=("cache_dtype",))
def guidance_embedder(ctx, embedded_guidance: Any) -> dict[str, Any]:
    """The distilled guidance value FLUX.1-dev's DiT is conditioned on (the metadata column, else 1)."""
    value = DEFAULT_GUIDANCE if embedded_guidance is None else float(embedded_guidance)
    return {"guidance": torch.tensor([value], dtype=torch.float32)}


# ------------------------------------------------------------------------------------------------
# noise, packing, timesteps


@unit("LatentPacker", inputs=("input_latents", "noise"), outputs=("input_latents", "noise", "latent_grid"),
      settings=("cache_dtype",))
def latent_packer(ctx, input_latents: torch.Tensor, noise: torch.Tensor) -> dict[str, Any]:
    grid = [int(input_latents.shape[-2]) // 2, int(input_latents.shape[-1]) // 2]
    return {"input_latents": pack(input_latents), "noise": pack(noise), "latent_grid": [grid]}


# DiffSynth-Studio's "FLUX.1" training template: a static shift of 3 over 1000 sigmas from 1 down to 0.003/1.002,
# the same for every image size (diffusers' FluxPipeline shifts with the token count when it samples).
TRAINING_SCHEDULE = TrainingSchedule(shift=3.0, sigma_min=0.003 / 1.002, open_end=False)


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "loss_weighting", "timestep_sampling", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    return sample_training_timestep(ctx, TRAINING_SCHEDULE)

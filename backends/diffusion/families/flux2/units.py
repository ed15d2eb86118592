"""FLUX.2's units: each declaration right above the code that runs it.

Params of the FLUX.2 pipelines (one sample; tensors carry a batch dimension of 1), computed as diffusers'
Flux2Pipeline (FLUX.2-dev, `flux2`) and Flux2KleinPipeline (`flux2_klein`) compute them:

  dataset    image (PIL), prompt (str)
  shape      image becomes a float tensor (1, 3, H, W) in [-1, 1], sides multiples of 16
  vae        latent_mean, latent_logvar (1, 4 z, H/16, W/16): the VAE posterior patchified 2x2 (each latent
             channel's 2x2 cells become 4 channels) and normalised by the VAE's batch-norm running statistics,
             the space the DiT denoises in (Flux2KleinPipeline._encode_vae_image)
  text       prompt_emb (1, 512, 3 D): flux2_klein: the Qwen3 hidden states of layers 9, 18 and 27 over the
             chat-formatted prompt padded to 512 tokens, side by side per token (_get_qwen3_prompt_embeds);
             flux2: Mistral's layers 10, 20 and 30 over the system turn and the prompt
             (_get_mistral_3_small_prompt_embeds)
  latents    input_latents: the posterior mean (DiffSynth's VAE keeps the mean channels; --vae_latents sample:
             a draw of the posterior, non-deterministic)
  fresh      noise; timestep and loss_weight: a position of TRAINING_SCHEDULE and its weight (non-deterministic)
  packed     input_latents/noise as tokens (1, h * w, 4 z), row-major; latent_grid [[h, w]] (the loss makes the
             4-axis RoPE ids from it: (0, row, col, 0) per image token, (0, 0, 0, k) for text token k)

The text encoder has its own unit, so a LoRA on it leaves the VAE in stage 1. Each function is
`fn(ctx, **inputs) -> {output: value}` over one sample; it touches only the models it declares, and a
non-deterministic unit draws only from `ctx.rng(purpose)`. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any

from ...data.imaging import image_to_pixels
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, padded_prompts, unit
from ...flowmatch import TrainingSchedule, sample_training_timestep

torch = lazy_module("torch")

MULTIPLE = 16  # image sides are multiples of this (VAE factor 8 x 2x2 patches), DiffSynth's division factor
MAX_SEQUENCE_LENGTH = 512  # diffusers' max_sequence_length default (DiffSynth's too): prompts are padded to it
QWEN3_LAYERS = (9, 18, 27)  # klein: the Qwen3 hidden states stacked into the prompt embedding (text_encoder_out_layers)
MISTRAL_LAYERS = (10, 20, 30)  # FLUX.2-dev: the Mistral hidden states stacked
# FLUX.2-dev's system turn, as Black Forest Labs' reference code and diffusers' Flux2Pipeline give it (a line break
# after "object"; DiffSynth's copy has a space there, one token apart: the released pipeline's text is kept)
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")

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


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2): each channel's 2x2 cells as 4 channels (channel c's cell (i, j) becomes
    channel 4c + 2i + j), as Flux2KleinPipeline._patchify_latents."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise BackendError(f"cannot patchify latents of shape {tuple(latents.shape)} (need even sides)")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def batch_norm_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm running mean and std over the patchified channels, shaped (1, 4z, 1, 1)."""
    bn = vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + float(vae.config.batch_norm_eps)).to(like.device, like.dtype)
    return mean, std


def encode_distribution(ctx, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior in the DiT's latent space:
    ((patchify(mean) - bn_mean) / bn_std, patchify(logvar) - 2 log bn_std)."""
    raw = ctx.raw("vae")
    posterior = ctx.model("vae").encode(ctx.tensor(pixels).to(raw.dtype)).latent_dist
    mean, logvar = patchify(posterior.mean), patchify(posterior.logvar)
    shift, std = batch_norm_stats(raw, mean)
    return (mean - shift) / std, logvar - 2.0 * torch.log(std)


@unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae",),
      settings=("dtype", "cache_dtype"), batch="stack")
def image_encoder(ctx, image: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, image)
    return {"latent_mean": mean, "latent_logvar": logvar}


# ------------------------------------------------------------------------------------------------
# text



def stack_layers(hidden_states: Any, layers: tuple[int, ...]) -> torch.Tensor:
    """The chosen hidden states side by side per token: (n, L, len(layers) * D), layer by layer within a token."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)  # (n, layers, L, D)
    n, k, length, d = out.shape
    return out.permute(0, 2, 1, 3).reshape(n, length, k * d)


def qwen3_token_ids(tokenizer: Any, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt as a chat user turn (generation prompt added, thinking off), padded to 512 tokens: (ids, mask)."""
    ids, masks = [], []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(prompt)}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        out = tokenizer(text, return_tensors="pt", padding="max_length", truncation=True,
                        max_length=MAX_SEQUENCE_LENGTH)
        ids.append(out["input_ids"])
        masks.append(out["attention_mask"])
    return torch.cat(ids, dim=0), torch.cat(masks, dim=0)


def qwen3_embeds(ctx, prompts: list[Any]) -> torch.Tensor:
    """Flux2KleinPipeline._get_qwen3_prompt_embeds: the stacked hidden states, (n, 512, 3 D)."""
    ids, mask = qwen3_token_ids(ctx.model("tokenizer"), prompts)
    out = ctx.model("text_encoder_qwen3")(input_ids=ids.to(ctx.device), attention_mask=mask.to(ctx.device),
                                          output_hidden_states=True, use_cache=False)
    return stack_layers(out.hidden_states, QWEN3_LAYERS).to(ctx.dtype)


def _qwen3_batch(ctx, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    embeds = qwen3_embeds(ctx, [s["prompt"] for s in samples])  # every prompt padded to 512: one batch
    return [{"prompt_emb": embeds[k:k + 1]} for k in range(len(samples))]


@unit("Qwen3PromptEmbedder", inputs=("prompt",), outputs=("prompt_emb",), models=("text_encoder_qwen3",),
      settings=("dtype", "cache_dtype"), batch=_qwen3_batch)
def qwen3_prompt_embedder(ctx, prompt: Any) -> dict[str, Any]:
    return {"prompt_emb": qwen3_embeds(ctx, [prompt])}


def mistral_messages(prompts: list[Any]) -> list[list[dict[str, Any]]]:
    """Each prompt as a system turn and a user turn of text parts; "[IMG]" is removed from prompts, since the
    Pixtral processor counts those tokens (diffusers' format_input)."""
    return [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
             {"role": "user", "content": [{"type": "text", "text": prompt_text(p).replace("[IMG]", "")}]}] for p in prompts]


def mistral_token_ids(tokenizer: Any, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The chat-formatted prompts padded to 512 tokens (by the tokenizer, or the release's Pixtral processor):
    (ids, mask)."""
    out = tokenizer.apply_chat_template(mistral_messages(prompts), add_generation_prompt=False, tokenize=True,
                                        return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
                                        max_length=MAX_SEQUENCE_LENGTH)
    return out["input_ids"], out["attention_mask"]


def mistral_embeds(ctx, prompts: list[Any]) -> torch.Tensor:
    """Flux2Pipeline._get_mistral_3_small_prompt_embeds: the stacked hidden states, (n, 512, 3 D)."""
    ids, mask = mistral_token_ids(ctx.model("tokenizer"), prompts)
    out = ctx.model("text_encoder")(input_ids=ids.to(ctx.device), attention_mask=mask.to(ctx.device),
                                    output_hidden_states=True, use_cache=False)
    return stack_layers(out.hidden_states, MISTRAL_LAYERS).to(ctx.dtype)


@unit("PromptEmbedder", inputs=("prompt",), outputs=("prompt_emb",), models=("text_encoder",),
      settings=("dtype", "cache_dtype"), batch=padded_prompts(mistral_embeds, "prompt_emb"))
def prompt_embedder(ctx, prompt: Any) -> dict[str, Any]:
    return {"prompt_emb": mistral_embeds(ctx, [prompt])}


# ------------------------------------------------------------------------------------------------
# noise, packing, timesteps


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h * w, C): one token per (already patchified) latent cell, row-major
    (Flux2KleinPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


@unit("LatentPacker", inputs=("input_latents", "noise"), outputs=("input_latents", "noise", "latent_grid"),
      settings=("cache_dtype",))
def latent_packer(ctx, input_latents: torch.Tensor, noise: torch.Tensor) -> dict[str, Any]:
    grid = [int(input_latents.shape[-2]), int(input_latents.shape[-1])]
    return {"input_latents": pack(input_latents), "noise": pack(noise), "latent_grid": [grid]}


# DiffSynth-Studio's "FLUX.2" training template (set_timesteps_flux2 as its training module calls it:
# set_timesteps(1000, training=True), no dynamic_shift_len): 1000 sigmas from 1 down to 1/1000 (both ends kept),
# shifted exponentially with the fixed mu 0.8, the same table at every image size. (Its sampler and diffusers'
# shift with the image's token count instead; training does not.)
TRAINING_SCHEDULE = TrainingSchedule(mu=0.8, sigma_min=1.0 / 1000, open_end=False)


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "loss_weighting", "timestep_sampling", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    return sample_training_timestep(ctx, TRAINING_SCHEDULE)

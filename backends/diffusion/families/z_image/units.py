"""Z-Image's units: each declaration right above the code that runs it.

Params of the z_image pipeline (one sample; tensors carry a batch dimension of 1), computed as diffusers'
ZImagePipeline and DiffSynth-Studio's ZImagePipeline compute them:

  dataset    image (PIL), prompt (str)
  shape      image becomes a float tensor (1, 3, H, W) in [-1, 1], sides multiples of 16 (VAE factor 8 x 2x2 patches)
  vae        latent_mean, latent_logvar: the 16-channel VAE's posterior, shifted and scaled ((mean - shift_factor) *
             scaling_factor), which is what the pipeline's decode undoes and DiffSynth's VAE encoder returns
  text       prompt_emb (1, L, D): the Qwen3 text encoder's second-to-last hidden states over the prompt in the
             tokenizer's chat template (one user turn, the generation prompt, thinking enabled as diffusers and
             DiffSynth call apply_chat_template), padded to 512 tokens for the call and cut back to the L tokens the
             attention mask keeps; prompt_emb_mask (1, L): ones (a batch pads both, family.pad)
  latents    input_latents: the posterior mean (--vae_latents sample: a draw of the posterior, non-deterministic)
  fresh      noise (1, 16, H/8, W/8); timestep and loss_weight: a position of TRAINING_SCHEDULE and its weight

Each function is `fn(ctx, **inputs) -> {output: value}` over one sample; it touches only the models it declares, and
a non-deterministic unit draws only from `ctx.rng(purpose)`. torch is imported on first use, so `unitgraph plan
diffusion:z_image` reads these declarations without it.
"""

from __future__ import annotations

from typing import Any

from ...data.imaging import image_to_pixels
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, unit
from ...flowmatch import TrainingSchedule, sample_training_timestep

torch = lazy_module("torch")

MULTIPLE = 16  # the pipeline's sides are multiples of vae_scale_factor * 2
MAX_SEQUENCE_LENGTH = 512  # encode_prompt's max_sequence_length: the template and prompt are padded/cut to it
HIDDEN_LAYER = -2  # the text encoder's second-to-last hidden states condition the DiT
ENABLE_THINKING = True  # what diffusers' ZImagePipeline and DiffSynth's ZImageUnit_PromptEmbedder pass the template

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
    """The VAE posterior in the DiT's latent space: ((mean - shift) * scale, logvar + 2 log scale)."""
    raw = ctx.raw("vae_encoder")
    posterior = ctx.model("vae_encoder").encode(ctx.tensor(pixels).to(raw.dtype)).latent_dist
    scale, shift = float(raw.config.scaling_factor), float(raw.config.shift_factor or 0.0)
    mean = (posterior.mean - shift) * scale
    logvar = posterior.logvar + 2.0 * torch.log(torch.tensor(scale, dtype=posterior.logvar.dtype))
    return mean, logvar


@unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae_encoder",),
      settings=("dtype", "cache_dtype"), batch="stack")
def image_encoder(ctx, image: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, image)
    return {"latent_mean": mean, "latent_logvar": logvar}


# ------------------------------------------------------------------------------------------------
# text



def chat_text(tokenizer: Any, prompt: str) -> str:
    """The prompt as one user turn of the tokenizer's chat template, with the assistant's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise BackendError("the tokenizer has no chat template (Z-Image's prompts go through Qwen3's: is it the "
                           "Z-Image tokenizer folder?)")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=ENABLE_THINKING)


def encode_prompts(ctx, prompts: list[Any]) -> list[torch.Tensor]:
    """Each prompt's embedding (L_i, D): the hidden states of the tokens the attention mask keeps."""
    tokenizer = ctx.model("tokenizer")
    texts = [chat_text(tokenizer, prompt_text(p)) for p in prompts]
    tokens = tokenizer(texts, padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                       return_tensors="pt")
    ids, mask = tokens.input_ids.to(ctx.device), tokens.attention_mask.to(ctx.device).bool()
    hidden = ctx.model("text_encoder")(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    if len(hidden) < 2:
        raise BackendError("the text encoder returned a single hidden state: Z-Image reads the second-to-last layer")
    return [h[m].to(ctx.dtype) for h, m in zip(hidden[HIDDEN_LAYER], mask)]


def _as_sample(emb: torch.Tensor) -> dict[str, Any]:
    mask = torch.ones(1, emb.shape[0], dtype=torch.long, device=emb.device)
    return {"prompt_emb": emb[None], "prompt_emb_mask": mask}


def _prompt_batch(ctx, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every prompt is padded to 512 tokens whatever the batch, so one call serves them all."""
    return [_as_sample(e) for e in encode_prompts(ctx, [s["prompt"] for s in samples])]


@unit("PromptEncoder", inputs=("prompt",), outputs=("prompt_emb", "prompt_emb_mask"), models=("text_encoder",),
      settings=("dtype", "cache_dtype"), batch=_prompt_batch)
def prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    return _as_sample(encode_prompts(ctx, [prompt])[0])


# ------------------------------------------------------------------------------------------------
# noise, timesteps


# DiffSynth-Studio's "Z-Image" training template (set_timesteps_z_image, as its training sets it up: 1000 steps,
# shift None -> 3): 1000 points from 1 towards 0 without the last, statically shifted by 3, the same for every image
# size; the DiT is told 1 - sigma (the loss).
TRAINING_SCHEDULE = TrainingSchedule(shift=3.0)


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "loss_weighting", "timestep_sampling", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    return sample_training_timestep(ctx, TRAINING_SCHEDULE)

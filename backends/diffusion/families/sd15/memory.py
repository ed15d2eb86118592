"""Stable Diffusion 1.5 at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call,
from configs.

The memory plan traces one step on fake tensors; running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, images), so the shapes the units would produce are made here, from the
VAE's and the UNet's configs and the units' constants. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...ddpm import noisy_latents
from ...family import lazy_module
from .units import CLIP_MAX_LENGTH, MULTIPLE

torch = lazy_module("torch")

NOTES = ("Stable Diffusion 1.5: CLIP prompts padded to 77 tokens, as the prompt unit pads them",)


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON). CLIP always reads 77 tokens: `text_tokens` is moot."""
    vae = configs["vae"]
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    width, height = run_pixels(cfg.units.image_size, MULTIPLE)
    h, w = height // scale, width // scale
    out = {"width": width, "height": height, "latent": [int(vae["latent_channels"]), h, w],
           "text_tokens": CLIP_MAX_LENGTH}
    out["description"] = f"{width}x{height} px, a {h}x{w} latent, {CLIP_MAX_LENGTH} text tokens"
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over (latents, noise, integer timesteps, CLIP states)."""
    z, h, w = dims["latent"]
    return {
        "input_latents": torch.randn(batch, z, h, w, dtype=dtype),
        "noise": torch.randn(batch, z, h, w, dtype=dtype),
        "timestep": torch.full((batch,), 500, dtype=torch.long),
        "loss_weight": None if cfg.units.snr_gamma is None else torch.ones(batch),
        "prompt_embeds": torch.randn(batch, dims["text_tokens"], int(configs["unet"]["cross_attention_dim"]), dtype=dtype),
    }


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on."""

    def vae(model: Any) -> Any:
        return model.encode(torch.randn(batch, 3, dims["height"], dims["width"], dtype=dtype)).latent_dist.mean

    def clip(model: Any) -> Any:
        return model(torch.zeros(batch, dims["text_tokens"], dtype=torch.long))[0]

    return {"vae": vae, "text_encoder": clip}


def warm_context(cfg: Any, ctx: Any, dims: Mapping[str, Any]) -> None:
    """The loss looks a_t up in the schedule's table, made from the real scheduler config: computed here first, outside
    the fake tensors, into the context's memo where the loss finds it."""
    noisy_latents(ctx, torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, dtype=torch.long))

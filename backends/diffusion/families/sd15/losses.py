"""Stable Diffusion 1.5's sink: the DDPM loss (ddpm.py), epsilon or v prediction as the scheduler config says.

The UNet is called as diffusers' StableDiffusionPipeline calls it in a denoising step (the noisy latents, the integer
timestep, the CLIP hidden states as encoder_hidden_states; no timestep_cond, added_cond_kwargs or cross-attention
kwargs), and as DiffSynth's model_fn_stable_diffusion does. The noising and the target are computed in fp32 (DiffSynth
trains SD 1.5 in fp32); the UNet receives its inputs in its own dtype and the timestep as the drawn integer, which
its sinusoidal embedding reads exactly in any dtype. It runs on a batch: tensors have the batch dimension first.
"""

from __future__ import annotations

from typing import Any

from ...ddpm import ddpm_loss as mse, noisy_latents, training_target
from ...family import lazy_module, sink

torch = lazy_module("torch")


def predict(ctx, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: Any) -> torch.Tensor:
    """The UNet's prediction (noise, or v) for noisy latents (B, C, h, w) at integer timesteps (B,) or ()."""
    dtype = ctx.model_dtype("unet")
    return ctx.model("unet")(
        latents.to(dtype),
        ctx.tensor(timestep),
        encoder_hidden_states=ctx.tensor(prompt_embeds).to(dtype),
        return_dict=False,
    )[0]


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_embeds"), models=("unet",))
def ddpm_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_embeds) -> torch.Tensor:
    """MSE between the UNet's prediction at x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise and the training target
    (the noise, or v); DiffSynth's DDPM training weight is 1, Min-SNR's with --snr_gamma."""
    x0, noise = ctx.tensor(input_latents).float(), ctx.tensor(noise).float()
    t = ctx.tensor(timestep).long().reshape(-1)
    pred = predict(ctx, noisy_latents(ctx, x0, noise, t), t, prompt_embeds)
    return mse(pred, training_target(ctx, x0, noise, t), ctx.tensor(loss_weight))

"""SDXL's sink: the DDPM loss DiffSynth-Studio trains its SDXL UNet with (ddpm.py).

x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise at the drawn timestep t; the UNet is called as diffusers'
StableDiffusionXLPipeline calls it in a denoising step (DiffSynth's model_fn_stable_diffusion_xl makes the same call):
the noisy latents, t, the joined prompt embeddings as cross-attention context and `added_cond_kwargs` {"text_embeds": the pooled
embedding, "time_ids": the size and crop ids}; the target is the noise (or v, for a v-prediction scheduler config);
the loss is the plain MSE in fp32. It runs on a batch: tensors have the batch dimension first, and a batch shares one
latent size (samples of different shapes are never batched together).
"""

from __future__ import annotations

from typing import Any

from ...ddpm import ddpm_loss as mse, noisy_latents, training_target
from ...errors import BackendError
from ...family import lazy_module, sink

torch = lazy_module("torch")


def check_added_conditioning(unet: Any, add_time_ids: torch.Tensor, pooled: torch.Tensor) -> None:
    """The UNet's added embedding takes the time ids' sinusoidal embeddings and the pooled embedding side by side
    (the check of StableDiffusionXLPipeline._get_add_time_ids), one line when they do not fit."""
    expected = int(unet.add_embedding.linear_1.in_features)
    passed = int(unet.config.addition_time_embed_dim) * int(add_time_ids.shape[-1]) + int(pooled.shape[-1])
    if expected != passed:
        raise BackendError(f"the UNet expects an added embedding of {expected} values, but {add_time_ids.shape[-1]} "
                           f"time ids x addition_time_embed_dim {unet.config.addition_time_embed_dim} + a pooled "
                           f"prompt embedding of {pooled.shape[-1]} make {passed}: are the UNet and text_encoder_2 "
                           "of one model?")


def predict(ctx, latents: torch.Tensor, timestep: torch.Tensor, prompt_emb: Any, pooled_prompt_emb: Any,
            add_time_ids: Any) -> torch.Tensor:
    """The UNet's output for noisy latents at integer timesteps (one per sample), as the pipeline's denoising step."""
    unet, raw = ctx.model("unet"), ctx.raw("unet")
    dtype = ctx.model_dtype("unet")
    pooled = ctx.tensor(pooled_prompt_emb)
    ids = ctx.tensor(add_time_ids)
    check_added_conditioning(raw, ids, pooled)
    added = {"text_embeds": pooled.to(dtype), "time_ids": ids.to(dtype)}
    return unet(latents.to(dtype), timestep.reshape(-1).expand(latents.shape[0]),
                encoder_hidden_states=ctx.tensor(prompt_emb).to(dtype), added_cond_kwargs=added, return_dict=False)[0]


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_emb", "pooled_prompt_emb", "add_time_ids"),
      models=("unet",))
def denoising_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, pooled_prompt_emb,
                   add_time_ids) -> torch.Tensor:
    """MSE between the UNet's prediction at x_t and the noise (epsilon) or v, at the drawn integer timestep."""
    x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
    t = ctx.tensor(timestep).long()
    noisy = noisy_latents(ctx, x0, noise, t)
    pred = predict(ctx, noisy, t, prompt_emb, pooled_prompt_emb, add_time_ids)
    return mse(pred, training_target(ctx, x0, noise, t), ctx.tensor(loss_weight))

"""FLUX.1's sink: the flow-matching loss, for text-to-image (`flux`) and with Kontext reference tokens.

The transformer is called as diffusers' FluxPipeline / FluxKontextPipeline call it in a denoising step:
timestep / 1000, the embedded guidance (None for a DiT without a guidance embedding, FLUX.1-schnell's
kind), the T5 sequence and CLIP's pooled embedding, RoPE ids (0, row, col) per image token and zeros
per text token; Kontext's reference tokens follow the target's with ids (1, row, col) and the output
is cut back to the target's tokens. It runs on a batch: tensors have the batch dimension first, and
a batch shares one latent grid (samples of different shapes are never batched together).
"""

from __future__ import annotations

from typing import Any

from ...family import lazy_module, sink
from ...flowmatch import flow_matching_mse

torch = lazy_module("torch")


def grid_ids(grid: Any, first: float, like: torch.Tensor) -> torch.Tensor:
    """(h*w, 3) RoPE ids of an h x w token grid: (first, row, col), as FluxPipeline._prepare_latent_image_ids."""
    h, w = int(grid[0]), int(grid[1])
    ids = torch.zeros(h, w, 3, dtype=like.dtype, device=like.device)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(h, dtype=like.dtype, device=like.device)[:, None]
    ids[..., 2] = torch.arange(w, dtype=like.dtype, device=like.device)[None, :]
    return ids.reshape(h * w, 3)


def predict(ctx, latents: torch.Tensor, sigma: torch.Tensor, prompt_emb: Any, pooled_prompt_emb: Any, guidance: Any,
            latent_grid: Any, kontext_latents: Any = None, kontext_grids: Any = None) -> torch.Tensor:
    """The transformer's velocity for packed latents at noise level sigma (reference tokens appended, then cut off)."""
    dit, raw = ctx.model("dit"), ctx.raw("dit")
    dtype = ctx.model_dtype("dit")
    tokens = latents.shape[1]
    hidden = latents
    img_ids = grid_ids(latent_grid[0], 0.0, latents)
    if kontext_latents is not None:
        hidden = torch.cat([latents, ctx.tensor(kontext_latents).to(latents.dtype)], dim=1)
        img_ids = torch.cat([img_ids, *[grid_ids(g, 1.0, latents) for g in kontext_grids[0]]], dim=0)
    text = ctx.tensor(prompt_emb).to(dtype)
    embed_guidance = bool(getattr(raw.config, "guidance_embeds", False))
    out = dit(
        hidden_states=hidden.to(dtype),
        timestep=sigma.to(dtype).reshape(-1).expand(latents.shape[0]),
        guidance=ctx.tensor(guidance).to(dtype).reshape(-1).expand(latents.shape[0]) if embed_guidance else None,
        pooled_projections=ctx.tensor(pooled_prompt_emb).to(dtype),
        encoder_hidden_states=text,
        txt_ids=torch.zeros(text.shape[1], 3, dtype=dtype, device=text.device),
        img_ids=img_ids.to(dtype),
        return_dict=False,
    )[0]
    return out[:, :tokens]


def _loss(kontext: bool) -> Any:
    inputs = ("input_latents", "noise", "timestep", "loss_weight", "prompt_emb", "pooled_prompt_emb", "guidance", "latent_grid")
    if kontext:
        inputs += ("kontext_latents", "kontext_grids")

    @sink(inputs=inputs, models=("dit",))
    def flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, pooled_prompt_emb, guidance,
                           latent_grid, kontext_latents=None, kontext_grids=None) -> torch.Tensor:
        """MSE between the predicted velocity and noise - x0 at a noisy point x_t = (1 - s) x0 + s noise, times the
        timestep's loss weight (flowmatch.flow_matching_mse)."""
        x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
        sigma = ctx.tensor(timestep).to(x0.dtype) / 1000.0
        noisy = (1.0 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
        pred = predict(ctx, noisy, sigma, prompt_emb, pooled_prompt_emb, guidance, latent_grid,
                       kontext_latents, kontext_grids)
        return flow_matching_mse(pred, noise - x0, ctx.tensor(loss_weight))

    return flow_matching_loss


flow_matching_loss = _loss(kontext=False)
kontext_flow_matching_loss = _loss(kontext=True)

"""FLUX.2's sink: the flow-matching loss.

The transformer is called as diffusers' Flux2KleinPipeline calls it in a denoising step: the packed latents,
timestep / 1000, the stacked text embedding, and 4-axis RoPE ids (t, h, w, l): (0, row, col, 0) per image
token and (0, 0, 0, k) per text token k. A DiT with a guidance embedding (FLUX.2-dev's kind) is told the
embedded guidance DiffSynth trains with (1); one without it (klein's) gets none, as the klein pipeline passes
none. It runs on a batch: tensors have the batch dimension first, and a batch shares one latent grid.
"""

from __future__ import annotations

from typing import Any

from ...family import lazy_module, sink
from ...flowmatch import flow_matching_mse

torch = lazy_module("torch")

TRAINING_GUIDANCE = 1.0  # DiffSynth's FLUX.2 training passes embedded_guidance=1.0


def image_ids(grid: Any, like: torch.Tensor) -> torch.Tensor:
    """(h*w, 4) ids of an h x w token grid, row-major: (0, row, col, 0), as Flux2KleinPipeline._prepare_latent_ids."""
    h, w = int(grid[0]), int(grid[1])
    ids = torch.zeros(h, w, 4, dtype=like.dtype, device=like.device)
    ids[..., 1] = torch.arange(h, dtype=like.dtype, device=like.device)[:, None]
    ids[..., 2] = torch.arange(w, dtype=like.dtype, device=like.device)[None, :]
    return ids.reshape(h * w, 4)


def text_ids(length: int, like: torch.Tensor) -> torch.Tensor:
    """(L, 4) ids of L text tokens: (0, 0, 0, k), as Flux2KleinPipeline._prepare_text_ids."""
    ids = torch.zeros(length, 4, dtype=like.dtype, device=like.device)
    ids[:, 3] = torch.arange(length, dtype=like.dtype, device=like.device)
    return ids


def predict(ctx, latents: torch.Tensor, sigma: torch.Tensor, prompt_emb: Any, latent_grid: Any,
            reference: Any = None, reference_ids: Any = None) -> torch.Tensor:
    """The transformer's velocity for packed latents at noise level sigma; `reference` tokens (B, N, C) with their
    ids (N, 4) go after the target's, and the output is cut back to the target's tokens (edit.py)."""
    dit, raw = ctx.model("dit"), ctx.raw("dit")
    dtype = ctx.model_dtype("dit")
    batch, tokens = latents.shape[0], latents.shape[1]
    text = ctx.tensor(prompt_emb).to(dtype)
    guided = bool(getattr(raw.config, "guidance_embeds", False))
    guidance = torch.full((batch,), TRAINING_GUIDANCE, dtype=torch.float32, device=latents.device) if guided else None
    img = image_ids(latent_grid[0], latents)
    if reference is not None:
        latents = torch.cat([latents, reference], dim=1)
        img = torch.cat([img, reference_ids], dim=0)
    txt = text_ids(text.shape[1], latents)
    return dit(
        hidden_states=latents.to(dtype),
        timestep=sigma.to(dtype).reshape(-1).expand(batch),
        guidance=guidance,
        encoder_hidden_states=text,
        txt_ids=txt.unsqueeze(0).expand(batch, -1, -1),
        img_ids=img.unsqueeze(0).expand(batch, -1, -1),
        return_dict=False,
    )[0][:, :tokens]


def flow_matching(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, latent_grid, reference: Any = None,
                  reference_ids: Any = None) -> torch.Tensor:
    """MSE between the predicted velocity and noise - x0 at a noisy point x_t = (1 - s) x0 + s noise, times the
    timestep's loss weight (flowmatch.flow_matching_mse); `reference` tokens as predict() takes them."""
    x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
    sigma = ctx.tensor(timestep).to(x0.dtype) / 1000.0
    noisy = (1.0 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
    pred = predict(ctx, noisy, sigma, prompt_emb, latent_grid, reference, reference_ids)
    return flow_matching_mse(pred, noise - x0, ctx.tensor(loss_weight))


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_emb", "latent_grid"), models=("dit",))
def flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, latent_grid) -> torch.Tensor:
    """The text-to-image loss (flow_matching)."""
    return flow_matching(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, latent_grid)

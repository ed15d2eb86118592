"""Z-Image's sink: the flow-matching loss.

x_t = (1 - s) x0 + s noise at the drawn sigma s = timestep / 1000, and the target is noise - x0, as DiffSynth's
FlowMatchSFTLoss trains. The Z-Image DiT runs the other way round: it is told t = (1000 - timestep) / 1000 (1 at the
clean end) and predicts x0 - noise, so its output is negated, exactly as diffusers' ZImagePipeline calls it in its
denoising loop (`timestep = (1000 - t) / 1000`, `noise_pred = -output`) and as DiffSynth's model_fn_z_image does.

The transformer takes lists: one latent (C, 1, h, w) and one unpadded prompt embedding (L_i, D) per sample (it pads
and masks the sequences itself), so a batch's padded prompt_emb is cut back to each sample's tokens by its mask. Tensors
have the batch dimension first; a batch shares one latent size.
"""

from __future__ import annotations

from typing import Any

from ...family import lazy_module, sink
from ...flowmatch import flow_matching_mse

torch = lazy_module("torch")


def unpad(prompt_emb: torch.Tensor, prompt_emb_mask: Any) -> list[torch.Tensor]:
    """One (L_i, D) embedding per sample: the rows its mask marks."""
    if prompt_emb_mask is None:
        return list(prompt_emb.unbind(0))
    return [e[m.bool()] for e, m in zip(prompt_emb, prompt_emb_mask)]


def predict(ctx, latents: torch.Tensor, timestep: torch.Tensor, prompt_emb: Any, prompt_emb_mask: Any) -> torch.Tensor:
    """The velocity (noise - x0 direction) at noisy latents (B, C, h, w) and scheduler timesteps (B,) (sigma * 1000)."""
    dit = ctx.model("dit")
    dtype = ctx.model_dtype("dit")
    t = (1000 - timestep.float().reshape(-1).expand(latents.shape[0])) / 1000
    captions = [e.to(dtype) for e in unpad(ctx.tensor(prompt_emb), ctx.tensor(prompt_emb_mask))]
    out = dit(list(latents.to(dtype).unsqueeze(2).unbind(0)), t, captions, return_dict=False)[0]
    return -torch.stack(list(out), dim=0).squeeze(2)


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_emb", "prompt_emb_mask"), models=("dit",))
def flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, prompt_emb_mask) -> torch.Tensor:
    """MSE between the predicted velocity and noise - x0 at x_t = (1 - s) x0 + s noise, times the timestep's loss
    weight (flowmatch.flow_matching_mse)."""
    x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
    t = ctx.tensor(timestep)
    sigma = t.to(x0.dtype).reshape(-1, 1, 1, 1) / 1000.0
    noisy = (1.0 - sigma) * x0 + sigma * noise
    pred = predict(ctx, noisy, t, prompt_emb, prompt_emb_mask)
    return flow_matching_mse(pred, noise - x0, ctx.tensor(loss_weight))

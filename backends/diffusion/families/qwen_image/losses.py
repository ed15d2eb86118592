"""Qwen-Image's sinks: the flow-matching loss (sft) and the direct-distillation loss.

Both read the sink params declared on them and call the transformer through `ctx.model("dit")`
(the DDP-wrapped module in a multi-process run). They run on a batch: tensors have the batch
dimension first, `img_shapes` holds one entry per sample.
"""

from __future__ import annotations

from typing import Any

from ...family import lazy_module, sink
from ...flowmatch import flow_matching_mse, schedule_sigmas

torch = lazy_module("torch")
F = lazy_module("torch.nn.functional")


def predict(ctx, latents: torch.Tensor, sigma: torch.Tensor, prompt_emb: torch.Tensor,
            prompt_emb_mask: Any, edit_latents: Any, img_shapes: Any) -> torch.Tensor:
    """The transformer's velocity for packed latents at noise level sigma (edit tokens appended, then cut off)."""
    dit = ctx.model("dit")
    dtype = ctx.model_dtype("dit")
    tokens = latents.shape[1]
    hidden = latents if edit_latents is None else torch.cat([latents, ctx.tensor(edit_latents)], dim=1)
    mask = ctx.tensor(prompt_emb_mask)
    out = dit(
        hidden_states=hidden.to(dtype),
        encoder_hidden_states=ctx.tensor(prompt_emb).to(dtype),
        encoder_hidden_states_mask=mask,
        timestep=sigma.to(dtype).reshape(-1).expand(latents.shape[0]),
        img_shapes=[[tuple(s) for s in shapes] for shapes in img_shapes],
        return_dict=False,
    )[0]
    return out[:, :tokens]


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_emb", "prompt_emb_mask", "edit_latents",
              "img_shapes"),
      models=("dit",))
def flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, prompt_emb_mask,
                       edit_latents, img_shapes) -> torch.Tensor:
    """MSE between the predicted velocity and noise - x0 at a noisy point x_t = (1 - s) x0 + s noise, times the
    timestep's loss weight (flowmatch.flow_matching_mse)."""
    x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
    sigma = ctx.tensor(timestep).to(x0.dtype) / 1000.0
    noisy = (1.0 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
    pred = predict(ctx, noisy, sigma, prompt_emb, prompt_emb_mask, edit_latents, img_shapes)
    return flow_matching_mse(pred, noise - x0, ctx.tensor(loss_weight))


@sink(inputs=("input_latents", "noise", "prompt_emb", "prompt_emb_mask", "negative_prompt_emb",
              "negative_prompt_emb_mask", "edit_latents", "img_shapes", "num_inference_steps", "cfg_scale"),
      models=("dit",))
def direct_distill_loss(ctx, input_latents, noise, prompt_emb, prompt_emb_mask, negative_prompt_emb,
                        negative_prompt_emb_mask, edit_latents, img_shapes, num_inference_steps, cfg_scale) -> torch.Tensor:
    """Run the few-step Euler sampler with gradients from the seeded noise; MSE to the image's latents."""
    steps = int(num_inference_steps or 0)
    if steps < 1:
        raise ValueError("direct_distill needs num_inference_steps >= 1 (metadata column)")
    cfg = float(cfg_scale) if cfg_scale is not None else 1.0
    x0 = ctx.tensor(input_latents)
    latents = ctx.tensor(noise)
    _, h, w = img_shapes[0][0]
    sigmas = schedule_sigmas(ctx, int(h * w), steps, inference=True).to(latents.device, latents.dtype)
    for i in range(steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        velocity = predict(ctx, latents, sigma, prompt_emb, prompt_emb_mask, edit_latents, img_shapes)
        if cfg > 1.0 and negative_prompt_emb is not None:
            negative = predict(ctx, latents, sigma, negative_prompt_emb, negative_prompt_emb_mask, edit_latents, img_shapes)
            combined = negative + cfg * (velocity - negative)
            velocity = combined * (velocity.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        latents = latents + (sigma_next - sigma) * velocity
    return F.mse_loss(latents.float(), x0.float())

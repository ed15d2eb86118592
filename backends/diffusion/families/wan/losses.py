"""Wan's sink: the flow-matching loss, for text-to-video (`wan`), with image conditioning (`wan_i2v`) and for
Wan 2.2 TI2V-5B (`wan_ti2v`: a timestep per token, the first latent frame given clean when an image is).

The transformer is called as diffusers' WanPipeline / WanImageToVideoPipeline call it in a denoising
step: the noisy latents (with the I2V conditioning `condition` concatenated along the channels), the
timestep on the 0..1000 scale, UMT5's 512-token sequence and, for I2V, CLIP's image embedding. The
target is noise - x0, as DiffSynth-Studio's FlowMatchSFTLoss trains Wan. It runs on a batch of clips of
one shape.
"""

from __future__ import annotations

from typing import Any

from ...errors import BackendError
from ...family import lazy_module, sink
from ...flowmatch import flow_matching_mse

torch = lazy_module("torch")


def predict(ctx, latents: torch.Tensor, timestep: torch.Tensor, prompt_emb: Any, condition: Any = None,
            image_embeds: Any = None) -> torch.Tensor:
    """The transformer's velocity for latents (B, z, T, h, w) at `timestep` (B,), on the 0..1000 scale."""
    dit = ctx.model("dit")
    dtype = ctx.model_dtype("dit")
    hidden = latents if condition is None else torch.cat([latents, ctx.tensor(condition).to(latents.dtype)], dim=1)
    return dit(
        hidden_states=hidden.to(dtype),
        timestep=timestep.to(dtype).reshape(-1).expand(latents.shape[0]),
        encoder_hidden_states=ctx.tensor(prompt_emb).to(dtype),
        encoder_hidden_states_image=None if image_embeds is None else ctx.tensor(image_embeds).to(dtype),
        return_dict=False,
    )[0]


def _loss(i2v: bool) -> Any:
    inputs = ("input_latents", "noise", "timestep", "loss_weight", "prompt_emb") + (("condition", "image_embeds") if i2v else ())

    @sink(inputs=inputs, models=("dit",))
    def flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, condition=None,
                           image_embeds=None):
        """MSE between the predicted velocity and noise - x0 at x_t = (1 - s) x0 + s noise, s = timestep / 1000,
        times the timestep's loss weight (flowmatch.flow_matching_mse)."""
        x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
        t = ctx.tensor(timestep).to(x0.dtype)
        s = (t / 1000.0).view(-1, 1, 1, 1, 1)
        noisy = (1.0 - s) * x0 + s * noise
        pred = predict(ctx, noisy, t, prompt_emb, condition, image_embeds)
        return flow_matching_mse(pred, noise - x0, ctx.tensor(loss_weight))

    return flow_matching_loss


flow_matching_loss = _loss(i2v=False)
i2v_flow_matching_loss = _loss(i2v=True)


def ti2v_predict(ctx, latents: torch.Tensor, timestep: torch.Tensor, prompt_emb: Any,
                 first_frame_latents: Any = None) -> torch.Tensor:
    """The TI2V DiT's velocity as WanPipeline / WanImageToVideoPipeline with expand_timesteps call it: one timestep
    per video token ((B, T x h/2 x w/2)); with an image, its latents replace the first latent frame and that
    frame's tokens get timestep 0 (diffusers' first_frame_mask; DiffSynth's seperated_timestep)."""
    dit = ctx.model("dit")
    dtype = ctx.model_dtype("dit")
    _, ph, pw = ctx.raw("dit").config.patch_size
    b, _, t, h, w = latents.shape
    mask = latents.new_ones(b, t, h // ph, w // pw, dtype=torch.float32)
    if first_frame_latents is not None:
        latents = torch.cat([ctx.tensor(first_frame_latents).to(latents.dtype), latents[:, :, 1:]], dim=2)
        mask[:, 0] = 0
    per_token = (mask * timestep.float().reshape(-1, 1, 1, 1).expand(b, 1, 1, 1)).flatten(1)
    return dit(
        hidden_states=latents.to(dtype),
        timestep=per_token.to(dtype),
        encoder_hidden_states=ctx.tensor(prompt_emb).to(dtype),
        return_dict=False,
    )[0]


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_emb", "first_frame_latents"), models=("dit",))
def ti2v_flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, first_frame_latents=None):
    """DiffSynth's FlowMatchSFTLoss for TI2V-5B: x_t = (1 - s) x0 + s noise, target noise - x0; with the first
    frame's latents (--extra_inputs input_image) that frame is given clean and left out of the MSE (it is the
    condition, not a prediction), else every frame is trained (text-to-video)."""
    x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
    t = ctx.tensor(timestep).to(x0.dtype)
    s = (t / 1000.0).view(-1, 1, 1, 1, 1)
    noisy = (1.0 - s) * x0 + s * noise
    pred = ti2v_predict(ctx, noisy, t, prompt_emb, first_frame_latents)
    target = noise - x0
    if first_frame_latents is not None:
        pred, target = pred[:, :, 1:], target[:, :, 1:]
    return flow_matching_mse(pred, target, ctx.tensor(loss_weight))


@sink(inputs=("input_latents", "noise", "prompt_emb", "num_inference_steps", "cfg_scale"), models=("dit",))
def direct_distill_loss(ctx, input_latents, noise, prompt_emb, num_inference_steps, cfg_scale=None) -> torch.Tensor:
    """DiffSynth's DirectDistillLoss for Wan: the Euler sampler of its Wan schedule (FlowMatchScheduler's
    set_timesteps_wan: `num_inference_steps` sigmas from 1, shift 5, then 0), run with gradients from the seeded
    noise with the prompt alone, and the MSE of where it ends to the clip's latents. DiffSynth's Wan training calls
    the DiT without guidance here, so a `cfg_scale` column is read and, as there, not used."""
    from dataclasses import replace

    from .units import TRAINING_SCHEDULE

    steps = int(num_inference_steps or 0)
    if steps < 1:
        raise BackendError("direct_distill needs num_inference_steps >= 1 (a metadata column)")
    x0 = ctx.tensor(input_latents)
    latents = ctx.tensor(noise)
    sigmas = replace(TRAINING_SCHEDULE, steps=steps).sigmas().to(latents.device)
    for i in range(steps):
        sigma = sigmas[i]
        following = sigmas[i + 1] if i + 1 < steps else sigma.new_zeros(())
        velocity = predict(ctx, latents, (sigma * 1000.0).reshape(1), prompt_emb)
        latents = latents + (following - sigma).to(latents.dtype) * velocity.to(latents.dtype)
    return torch.nn.functional.mse_loss(latents.float(), x0.float())

"""unitgraph's timestep samplings, loss weightings and masked loss on a DiffSynth pipeline's supervised loss
(`--timestep_sampling`, `--weighting_scheme`, `--masked_loss`; flowmatch.TimestepSampling holds the first's
parameters).

At the defaults (`diffsynth` for both, no mask) a step's loss is DiffSynth's own `FlowMatchSFTLoss`, called as it is.
Otherwise it is `flow_match_sft`: the same loss built from the same parts of the pipeline (its scheduler's
`timesteps`, `add_noise`, `training_target` and `training_weight`, its `model_fn` over its in-iteration models, the
first-frame latents a video pipeline pins), in the same order and dtypes, with three parts chosen by the flags:

* **the position**: DiffSynth draws it uniformly from the positions --min/max_timestep_boundary leave
  (`torch.randint` on the global stream); `uniform`, `logit_normal` and `mode` draw u in [0, 1] from diffusers'
  `compute_density_for_timestep_sampling` on the same stream and take position first + int(u x count), as
  unitgraph's own families do (flowmatch.draw_position);
* **the weight**: DiffSynth's `training_weight` at the timestep (`diffsynth`), none (`none`: the plain MSE), or
  diffusers' `compute_loss_weighting_for_sd3` (`sigma_sqrt`, `cosmap`) at the sigma the noise was mixed with (the
  scheduler's own lookup of the timestep; a flow-matching scheduler only: the DDIM pipelines have no sigma);
* **the mask** (`loss_mask` in the state: the sample's mask resized as its image, its pixels as uint8 RGB, which
  every stage carries as it is; `mask_pixels`): averaged over each cell of the latent the loss reads
  (`loss_mask_of`; the latent may be made in stage 2, from a VAE's posterior sample), the mean of the squared errors
  each weighted by m + W (1 - m) (--masked_loss_unmasked_weight W), as unitgraph's own families weigh them
  (masked_loss.py), instead of the MSE.

Why this is right: at the defaults `flow_match_sft` makes the very calls of `FlowMatchSFTLoss` on the same stream,
so its loss is DiffSynth's bit for bit (tests/test_diffsynth_source.py compares them), and a flag changes only its
own part. Every draw is on torch's global stream, which the step seeds from (--seed, epoch, sample) before its
units run, the same way split and unsplit: split equals unsplit for every setting.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import BackendError
from ..flowmatch import SD3_WEIGHTINGS, TimestepSampling

__all__ = ["LOSS_MASK", "check_objective", "flow_match_sft", "loss_mask_of", "mask_pixels", "sft_loss"]

LOSS_MASK = "loss_mask"  # the state's param holding a sample's resized mask, (H, W, 3) uint8


def sft_loss(sampling: TimestepSampling, weighting: str, unmasked: Optional[float] = None) -> Callable[..., Any]:
    """The `sft` loss of these settings, called as DiffSynth calls its own: `loss(pipe, **inputs)`; `unmasked`: the
    weight W of what a mask leaves out, None without --masked_loss."""
    from diffsynth.diffusion.loss import FlowMatchSFTLoss

    if sampling.scheme == "diffsynth" and weighting == "diffsynth" and unmasked is None:
        return FlowMatchSFTLoss

    def loss(pipe: Any, **inputs: Any) -> Any:
        return flow_match_sft(pipe, sampling, weighting, unmasked, **inputs)

    return loss


def mask_pixels(mask: Any) -> Any:
    """A sample's mask (a PIL image already resized as its target image was) as the state carries it: its RGB
    pixels, (H, W, 3) uint8 (an integer tensor: no stage casts it to the pipeline's dtype)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(mask.convert("RGB"), dtype=np.uint8).copy())


def latent_grid(pixels: Any, latents: Any) -> tuple[int, int]:
    """The (rows, columns) of latent cells over an image of `pixels` (H, W, ...): the last two sides of a latent grid
    (..., h, w), or of a pipeline's latent tokens (B, h w, C), one per cell in row order (a DiT that reads tokens),
    the sides in the image's proportion.

    >>> import torch
    >>> latent_grid(torch.zeros(64, 32, 3), torch.zeros(1, 16, 4, 8, 4)), latent_grid(torch.zeros(64, 32, 3),
    ...                                                                            torch.zeros(1, 8, 128))
    ((8, 4), (4, 2))
    """
    import math

    if latents.dim() != 3:
        return int(latents.shape[-2]), int(latents.shape[-1])
    height, width, tokens = int(pixels.shape[0]), int(pixels.shape[1]), int(latents.shape[1])
    factor = round(math.sqrt(height * width / tokens)) if tokens else 0
    if not factor or height % factor or width % factor or (height // factor) * (width // factor) != tokens:
        raise BackendError(f"--masked_loss: {tokens} latent tokens do not tile a {width}x{height} px mask")
    return height // factor, width // factor


def loss_mask_of(pixels: Any, latents: Any) -> Any:
    """The mask's coverage of each latent cell of `latents` (`latent_grid`): the mean brightness (of the three
    channels, over 255) over the cell, 0 to 1, shape (1, 1, h, w), float32."""
    import torch.nn.functional as F

    brightness = pixels.to("cpu").float().mean(dim=-1) / 255.0
    return F.adaptive_avg_pool2d(brightness[None, None], latent_grid(pixels, latents))


def check_objective(pipe: Any, weighting: str) -> None:
    """One line when the pipeline's scheduler cannot weigh by `weighting` (an SD3 weighting needs a sigma)."""
    if weighting in SD3_WEIGHTINGS and not hasattr(pipe.scheduler, "sigmas"):
        raise BackendError(f"--weighting_scheme {weighting}: {type(pipe).__name__} trains with "
                           f"{type(pipe.scheduler).__name__}, which has no sigma to weigh by; use diffsynth or none")


def _position(pipe: Any, sampling: TimestepSampling, bounds: tuple[float, float]) -> Any:
    """The drawn index into the scheduler's timesteps, shape (1,), within the boundaries (max, min) as DiffSynth
    reads them."""
    import torch

    count = len(pipe.scheduler.timesteps)
    last, first = int(bounds[0] * count), int(bounds[1] * count)
    if sampling.scheme == "diffsynth":
        return torch.randint(first, last, (1,))
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(sampling.scheme, 1, logit_mean=sampling.logit_mean,
                                              logit_std=sampling.logit_std, mode_scale=sampling.mode_scale,
                                              device="cpu")
    u = min(max(float(u[0]), 0.0), 1.0)  # `mode` leaves [0, 1] for a mode_scale above about 1.3
    return torch.tensor([min(last - 1, first + int(u * (last - first)))])


def _weight(pipe: Any, weighting: str, timestep: Any) -> Any:
    import torch

    if weighting == "diffsynth":
        return pipe.scheduler.training_weight(timestep)
    if weighting == "none":
        return None
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    scheduler = pipe.scheduler
    sigma = scheduler.sigmas[torch.argmin((scheduler.timesteps - timestep.cpu()).abs())]  # as add_noise finds it
    return compute_loss_weighting_for_sd3(weighting, sigma.reshape(1)).float()[0]


def flow_match_sft(pipe: Any, sampling: TimestepSampling, weighting: str, unmasked: Optional[float] = None,
                   **inputs: Any) -> Any:
    """The supervised loss of one sample (the module docstring): noise mixed in at a drawn timestep, the model's
    prediction against the scheduler's training target, weighted (and with `unmasked` not None, each squared error
    by the sample's `loss_mask`)."""
    import torch

    from ..masked_loss import mask_like, weights_of

    # (the dict `inputs` is read key by key before `latents` is set: planning.loss_overwrites reads this function
    # as it reads DiffSynth's, and both overwrite the same param)
    mask = inputs.get(LOSS_MASK)
    if unmasked is not None and mask is None:
        raise BackendError("--masked_loss: the sample's state holds no loss mask")
    if "lora" in inputs:
        raise BackendError(f"--timestep_sampling/--weighting_scheme/--masked_loss: {type(pipe).__name__} loads a LoRA "
                           "per sample inside DiffSynth's loss; train it with DiffSynth's own loss (their defaults)")
    index = _position(pipe, sampling, (inputs.get("max_timestep_boundary", 1), inputs.get("min_timestep_boundary", 0)))
    timestep = pipe.scheduler.timesteps[index].to(dtype=pipe.torch_dtype, device=pipe.device)
    clean = inputs["input_latents"]
    noise = torch.randn_like(clean) * inputs.get("noise_scale", 1.0)
    inputs["latents"] = pipe.scheduler.add_noise(clean, noise, timestep)
    target = pipe.scheduler.training_target(clean, noise, timestep)
    pinned = "first_frame_latents" in inputs  # a video pipeline's given first frame: not predicted, not scored
    if pinned:
        inputs["latents"][:, :, 0:1] = inputs["first_frame_latents"]
    given = {name: value for name, value in inputs.items() if name != LOSS_MASK}
    prediction = pipe.model_fn(**{name: getattr(pipe, name) for name in pipe.in_iteration_models}, **given,
                               timestep=timestep)
    if pinned:
        prediction, target = prediction[:, :, 1:], target[:, :, 1:]
    if unmasked is None:
        loss = torch.nn.functional.mse_loss(prediction.float(), target.float())
    else:
        coverage = loss_mask_of(mask, clean)
        cells = mask_like(weights_of(coverage, unmasked).to(prediction.device), prediction)
        loss = ((prediction.float() - target.float()).pow(2) * cells).mean()
    weight = _weight(pipe, weighting, timestep)
    return loss if weight is None else loss * weight

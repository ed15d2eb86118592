"""Flow-matching schedules from a diffusers FlowMatchEulerDiscreteScheduler config, shared by the families.

Training draws a noise level sigma from the scheduler's own training schedule (its
`num_train_timesteps` sigmas, with the config's static or resolution-dependent shift), as
DiffSynth-Studio and the diffusers pipelines use it, or from a static-shift schedule (DiffSynth's video template);
`--min/max_timestep_boundary` narrow the draw to a range of the schedule's positions (`_draw_index`). Sigmas are memoised per (sequence length, steps) in the unit context.
"""

from __future__ import annotations

from typing import Any

__all__ = ["calculate_shift", "draw_latents", "draw_noise", "schedule_sigmas", "sample_timestep", "shifted_sigmas",
           "sample_shifted_timestep"]


def calculate_shift(seq_len: int, config: Any) -> float:
    """diffusers' mu for a resolution-dependent shift: linear in the image's token count between the
    config's (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * slope + base_shift - slope * base_len


def schedule_sigmas(ctx: Any, seq_len: int, num_steps: int, inference: bool = False) -> Any:
    """The scheduler's sigmas for an image of `seq_len` tokens (num_steps + 1 values, ending at 0).

    `inference` gives the sampler's evenly spaced schedule (diffusers' pipelines pass
    linspace(1, 1/steps, steps) as sigmas), else the training schedule of `num_steps` steps.
    """
    import copy

    import numpy as np
    import torch

    key = ("flowmatch", seq_len, num_steps, inference)
    if key not in ctx.memo:
        scheduler = copy.deepcopy(ctx.model("scheduler"))
        mu = calculate_shift(seq_len, scheduler.config)
        kwargs = {"mu": mu} if scheduler.config.get("use_dynamic_shifting", False) else {}
        if inference:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps).tolist(), device="cpu", **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        ctx.memo[key] = scheduler.sigmas.detach().to(torch.float32).clone()
    return ctx.memo[key]


def sample_timestep(ctx: Any, seq_len: int) -> Any:
    """One training timestep (sigma * 1000, shape (1,)) drawn from `ctx.rng("timestep")` within the bounds."""
    steps = int(ctx.model("scheduler").config.get("num_train_timesteps", 1000))
    sigmas = schedule_sigmas(ctx, int(seq_len), steps)[:steps]
    index = _draw_index(ctx, steps)
    return (sigmas[index] * 1000.0).reshape(1).to(ctx.device)


def _draw_index(ctx: Any, steps: int) -> int:
    """An index into a schedule of `steps` sigmas, uniform in [min_boundary * steps, max_boundary * steps).

    As DiffSynth-Studio's FlowMatchSFTLoss reads --min/max_timestep_boundary: fractions of the schedule's
    positions counted from its noisiest end (index 0, sigma ~1), so a two-expert video model's high-noise
    expert trains on `--max_timestep_boundary 0.358` (shift 5: sigmas from 1 down to ~0.9), the low-noise one on the rest.
    """
    import torch

    lo, hi = ctx.timestep_bounds
    first = min(steps - 1, int(lo * steps))
    last = max(first + 1, min(steps, int(hi * steps)))
    return int(torch.randint(first, last, (1,), generator=ctx.rng("timestep")).item())


def shifted_sigmas(num_steps: int, shift: float) -> Any:
    """A static-shift training schedule (DiffSynth-Studio's video template): num_steps sigmas evenly spaced from
    1 down to (but not including) 0, each shifted as shift * s / (1 + (shift - 1) * s)."""
    import torch

    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)[:-1]
    return (shift * s / (1.0 + (shift - 1.0) * s)).to(torch.float32)


def sample_shifted_timestep(ctx: Any, shift: float, num_steps: int = 1000) -> Any:
    """One training timestep (sigma * 1000, shape (1,)) of `shifted_sigmas`, drawn within the bounds."""
    key = ("shifted", num_steps, shift)
    if key not in ctx.memo:
        ctx.memo[key] = shifted_sigmas(num_steps, shift)
    sigmas = ctx.memo[key]
    return (sigmas[_draw_index(ctx, num_steps)] * 1000.0).reshape(1).to(ctx.device)


def draw_latents(ctx: Any, mean: Any, logvar: Any) -> Any:
    """A sample of the VAE posterior N(mean, exp(logvar)) from `ctx.rng("latent")`: the cache keeps the posterior,
    training draws a fresh latent each epoch (honest VAE sampling)."""
    import torch

    eps = torch.randn(mean.shape, generator=ctx.rng("latent"), dtype=mean.dtype)
    mean, logvar = ctx.tensor(mean), ctx.tensor(logvar)
    return mean + torch.exp(0.5 * logvar) * eps.to(mean.device)


def draw_noise(ctx: Any, like: Any) -> Any:
    """Gaussian noise shaped like `like`, from `ctx.rng("noise")`."""
    import torch

    return torch.randn(like.shape, generator=ctx.rng("noise"), dtype=like.dtype).to(like.device)

"""Flow matching as the families train it: DiffSynth-Studio's objective, shared by the families.

What a flow-matching step trains on, by default the objective DiffSynth-Studio's FlowMatchSFTLoss computes:

  * the latent: the VAE posterior's mean (`posterior_mean`), or with `--vae_latents sample` a fresh draw of
    the posterior each epoch (`latent_sampler`);
  * the noise level: one position of the family's `TrainingSchedule` (DiffSynth's template for the family: one
    fixed table of 1000 sigmas), uniform over the positions `--min/max_timestep_boundary` leave (`_draw_index`);
  * the loss: the MSE of the predicted velocity against noise - x0, times the schedule's training weight at the
    drawn position (`--loss_weighting diffsynth`), or unweighted (`--loss_weighting none`).

`schedule_sigmas` is the sampler's side: the sigmas a diffusers FlowMatchEulerDiscreteScheduler config gives
for inference (direct distillation's few-step sampler), memoised per (sequence length, steps) in the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .family import unit

__all__ = ["LOSS_WEIGHTINGS", "TrainingSchedule", "VAE_LATENTS", "calculate_shift", "draw_latents", "draw_noise",
           "flow_matching_mse", "latent_sampler", "position_range", "posterior_mean", "sample_training_timestep",
           "schedule_sigmas", "with_vae_latents"]


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


@dataclass(frozen=True)
class TrainingSchedule:
    """A family's training schedule as DiffSynth-Studio's FlowMatchScheduler template computes it for training
    (`set_timesteps(1000, training=True)`): `steps` sigmas from the noisiest end, and a loss weight per position.

    The grid is `steps` evenly spaced points from 1 towards `sigma_min`: either ending there (`open_end=False`)
    or stopping one step short of it (`open_end=True`, linspace over steps + 1 points without the last).
    Each point s is then shifted, either statically (`shift`: shift * s / (1 + (shift - 1) s)) or exponentially
    (`mu`: e^mu / (e^mu + 1/s - 1)), and with `terminal` the distances from 1 are stretched so that the last
    sigma is `terminal`. A schedule is one fixed table: the same for every image size, unlike diffusers'
    resolution-dependent shift, because that is what DiffSynth trains with.

    >>> s = TrainingSchedule(shift=5.0)
    >>> [round(float(x), 4) for x in s.sigmas()[:2]], round(float(s.sigmas()[-1]), 4)
    ([1.0, 0.9992], 0.005)
    """

    shift: float = 1.0
    mu: Optional[float] = None
    terminal: Optional[float] = None
    sigma_min: float = 0.0
    open_end: bool = True
    steps: int = 1000

    def sigmas(self) -> Any:
        """The schedule's `steps` sigmas, float32, from ~1 (index 0) down."""
        import torch

        n = self.steps
        grid = (torch.linspace(1.0, self.sigma_min, n + 1)[:-1] if self.open_end
                else torch.linspace(1.0, self.sigma_min, n))
        if self.mu is not None:
            e = math.exp(self.mu)
            sigmas = e / (e + (1.0 / grid - 1.0))
        else:
            sigmas = self.shift * grid / (1.0 + (self.shift - 1.0) * grid)
        if self.terminal is not None:
            distance = 1.0 - sigmas
            sigmas = 1.0 - distance / (distance[-1] / (1.0 - self.terminal))
        return sigmas

    def weights(self) -> Any:
        """DiffSynth's training weight per position: a bell curve over the timestep (sigma * 1000), centred on 500,
        less its minimum, normalised to mean 1 over the schedule. It is 0 at the schedule's noisiest end when that
        is sigma 1, and peaks where the schedule crosses sigma 0.5."""
        import torch

        x = self.sigmas().to(torch.float32) * 1000.0
        bell = torch.exp(-2.0 * ((x - 500.0) / 1000.0) ** 2)
        bell = bell - bell.min()
        return bell * (self.steps / bell.sum())


LOSS_WEIGHTINGS = ("diffsynth", "none")


def sample_training_timestep(ctx: Any, schedule: TrainingSchedule) -> dict[str, Any]:
    """One training timestep of `schedule`, drawn from `ctx.rng("timestep")` within the bounds, and its loss weight.

    {"timestep": sigma * 1000 (shape (1,)), "loss_weight": the schedule's weight at the drawn position (shape (1,)),
    or None with --loss_weighting none}. The timestep is the schedule's float32 value: DiffSynth first casts it to
    bf16 and looks the sigma up again by the nearest timestep, which leaves only about a third of the positions
    reachable; that is an artifact of its dtype handling, not part of the objective, so it is not reproduced.
    """
    key = ("training-schedule", schedule)
    if key not in ctx.memo:
        ctx.memo[key] = (schedule.sigmas(), schedule.weights())
    sigmas, weights = ctx.memo[key]
    index = _draw_index(ctx, schedule.steps)
    weight = weights[index].reshape(1).to(ctx.device) if ctx.settings.loss_weighting == "diffsynth" else None
    return {"timestep": (sigmas[index] * 1000.0).reshape(1).to(ctx.device), "loss_weight": weight}


def _draw_index(ctx: Any, steps: int) -> int:
    """An index into a schedule of `steps` sigmas, uniform in [min_boundary * steps, max_boundary * steps).

    As DiffSynth-Studio's FlowMatchSFTLoss reads --min/max_timestep_boundary: fractions of the schedule's
    positions counted from its noisiest end (index 0, sigma ~1), so a two-expert video model's high-noise
    expert trains on `--max_timestep_boundary 0.358` (shift 5: sigmas from 1 down to ~0.9), the low-noise one on the rest.
    """
    import torch

    first, last = position_range(ctx.timestep_bounds, steps)
    return int(torch.randint(first, last, (1,), generator=ctx.rng("timestep")).item())


def position_range(bounds: tuple[float, float], steps: int) -> tuple[int, int]:
    """[first, last) of the schedule positions --min/max_timestep_boundary leave, DiffSynth's int() of each
    fraction times the positions (at least one position).

    >>> position_range((0.0, 0.417), 1000), position_range((0.417, 1.0), 1000)
    ((0, 417), (417, 1000))
    """
    lo, hi = bounds
    first = min(steps - 1, int(lo * steps))
    return first, max(first + 1, min(steps, int(hi * steps)))


def flow_matching_mse(pred: Any, target: Any, loss_weight: Any = None) -> Any:
    """The flow-matching loss of a batch: the MSE of each sample times its loss weight, averaged over the batch.

    Without weights, the plain MSE over the batch (DiffSynth's unweighted loss). With one sample, MSE x weight,
    which is DiffSynth's FlowMatchSFTLoss; with several, each sample's own MSE is weighted by its own timestep's
    weight (DiffSynth trains one sample a step).
    """
    import torch.nn.functional as F

    pred, target = pred.float(), target.float()
    if loss_weight is None:
        return F.mse_loss(pred, target)
    weight = loss_weight.float().reshape(-1)
    if pred.shape[0] == 1:
        return F.mse_loss(pred, target) * weight[0]
    per_sample = (pred - target).pow(2).flatten(1).mean(dim=1)
    return (per_sample * weight).mean()


def draw_latents(ctx: Any, mean: Any, logvar: Any) -> Any:
    """A sample of the VAE posterior N(mean, exp(logvar)) from `ctx.rng("latent")` (--vae_latents sample)."""
    import torch

    eps = torch.randn(mean.shape, generator=ctx.rng("latent"), dtype=mean.dtype)
    mean, logvar = ctx.tensor(mean), ctx.tensor(logvar)
    return mean + torch.exp(0.5 * logvar) * eps.to(mean.device)


# The latent a family trains on, from the VAE posterior its encoder unit gives (latent_mean, latent_logvar): what
# DiffSynth-Studio trains the family on, as the family's pipelines declare it. The flow-matching families declare
# the posterior mean (deterministic, so the unit runs in stage 1 and the cache holds the one latent instead of the
# two posterior tensors), the UNet families a draw of the posterior each step. `--vae_latents mean|sample` puts the
# other unit in its place (`with_vae_latents`).


@unit("PosteriorMean", inputs=("latent_mean",), outputs=("input_latents",), settings=("cache_dtype",))
def posterior_mean(ctx: Any, latent_mean: Any) -> dict[str, Any]:
    return {"input_latents": latent_mean}


@unit("LatentSampler", inputs=("latent_mean", "latent_logvar"), outputs=("input_latents",), deterministic=False,
      settings=("seed", "cache_dtype"))
def latent_sampler(ctx: Any, latent_mean: Any, latent_logvar: Any) -> dict[str, Any]:
    return {"input_latents": draw_latents(ctx, latent_mean, latent_logvar)}


VAE_LATENTS = ("mean", "sample")


def with_vae_latents(pipeline: Any, mode: Optional[str]) -> Any:
    """`pipeline` training on the posterior's "mean" (PosteriorMean) or a "sample" of it (LatentSampler): the one
    unit put in the other's place; None, or a pipeline with neither unit (a distillation that targets the mean),
    gives the pipeline as it is declared."""
    import dataclasses

    swap = {"mean": (latent_sampler, posterior_mean), "sample": (posterior_mean, latent_sampler)}.get(mode or "")
    if swap is None or not any(u is swap[0] for u in pipeline.units):
        return pipeline
    old, new = swap
    return dataclasses.replace(pipeline, units=tuple(new if u is old else u for u in pipeline.units))


def draw_noise(ctx: Any, like: Any) -> Any:
    """Gaussian noise shaped like `like`, from `ctx.rng("noise")`."""
    import torch

    return torch.randn(like.shape, generator=ctx.rng("noise"), dtype=like.dtype).to(like.device)


@unit("NoiseInitializer", inputs=("input_latents",), outputs=("noise",), deterministic=False,
      settings=("seed", "cache_dtype"))
def noise_initializer(ctx: Any, input_latents: Any) -> dict[str, Any]:
    """The noise a training step mixes into the latents, every family's (flow-matching and DDPM alike): drawn from
    the sample's `noise` stream, so a split run and an unsplit run draw the same."""
    return {"noise": draw_noise(ctx, input_latents)}

"""Flow matching as the families train it: DiffSynth-Studio's objective, shared by the families.

What a flow-matching step trains on, by default the objective DiffSynth-Studio's FlowMatchSFTLoss computes:

  * the latent: the VAE posterior's mean (`posterior_mean`), or with `--vae_latents sample` a fresh draw of
    the posterior each epoch (`latent_sampler`);
  * the noise level: one position of the family's `TrainingSchedule` (DiffSynth's template for the family: one
    fixed table of 1000 sigmas), uniform over the positions `--min/max_timestep_boundary` leave (`draw_position`);
    `--timestep_sampling uniform|logit_normal|mode` draws the position through diffusers'
    `compute_density_for_timestep_sampling` instead (SD3's densities over [0, 1], mapped onto those positions);
  * the loss: the MSE of the predicted velocity against noise - x0, times the schedule's training weight at the
    drawn position (`--weighting_scheme diffsynth`), unweighted (`none`), or weighted by diffusers'
    `compute_loss_weighting_for_sd3` at the drawn sigma (`sigma_sqrt`, `cosmap`).

Every draw comes from the sample's `timestep` stream (randomness.py), whatever the scheme, so a split run, an
unsplit run and a resumed run draw the same positions.

`schedule_sigmas` is the sampler's side: the sigmas a diffusers FlowMatchEulerDiscreteScheduler config gives
for inference (direct distillation's few-step sampler), memoised per (sequence length, steps) in the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .family import unit

__all__ = ["LOSS_WEIGHTINGS", "TIMESTEP_SAMPLINGS", "TimestepSampling", "TrainingSchedule", "VAE_LATENTS",
           "calculate_shift", "draw_latents", "draw_noise", "draw_position", "flow_matching_mse", "latent_sampler",
           "position_range", "posterior_mean", "sample_training_timestep", "schedule_sigmas", "with_vae_latents"]


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
    ([1.0, 0.9998], 0.005)
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


LOSS_WEIGHTINGS = ("diffsynth", "none", "sigma_sqrt", "cosmap")
SD3_WEIGHTINGS = ("sigma_sqrt", "cosmap")  # computed by diffusers' compute_loss_weighting_for_sd3
TIMESTEP_SAMPLINGS = ("diffsynth", "uniform", "logit_normal", "mode")


@dataclass(frozen=True)
class TimestepSampling:
    """How a training position is drawn (--timestep_sampling and its parameters, diffusers' names and defaults).

    `diffsynth`, the default, is DiffSynth's uniform draw of an integer position. The others are the densities of
    diffusers' `compute_density_for_timestep_sampling` (SD3's: `uniform`, `logit_normal` with `logit_mean` and
    `logit_std`, `mode` with `mode_scale`): a value u in [0, 1] maps to position int(u x n) of the n positions
    the boundaries leave, as diffusers' flow-matching training examples index their scheduler's timesteps (u near 0: the
    noisiest position). The parameters of a scheme that does not read them are not recorded (`key`).
    """

    scheme: str = "diffsynth"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29

    def key(self) -> dict[str, Any]:
        """What a resume state records: the scheme and the parameters it reads."""
        read = {"logit_normal": ("logit_mean", "logit_std"), "mode": ("mode_scale",)}.get(self.scheme, ())
        return {"scheme": self.scheme, **{name: getattr(self, name) for name in read}}

    def problem(self) -> str:
        """Why these settings cannot be drawn from ("" when they can)."""
        if self.scheme not in TIMESTEP_SAMPLINGS:
            return f"--timestep_sampling must be one of {', '.join(TIMESTEP_SAMPLINGS)}, got {self.scheme!r}"
        for name in ("logit_mean", "logit_std", "mode_scale"):
            if not math.isfinite(getattr(self, name)):
                return f"--{name} must be a finite number, got {getattr(self, name)}"
        if self.logit_std <= 0:
            return f"--logit_std must be above 0, got {self.logit_std}"
        return ""


def sample_training_timestep(ctx: Any, schedule: TrainingSchedule) -> dict[str, Any]:
    """One training timestep of `schedule`, drawn from `ctx.rng("timestep")` within the bounds, and its loss weight.

    {"timestep": sigma * 1000 (shape (1,)), "loss_weight": the weight of --weighting_scheme at the drawn position
    (shape (1,)), or None with `none`}. The timestep is the schedule's float32 value: DiffSynth first casts it to
    bf16 and looks the sigma up again by the nearest timestep, which leaves only about a third of the positions
    reachable; that is an artifact of its dtype handling, not part of the objective, so it is not reproduced.
    """
    key = ("training-schedule", schedule)
    if key not in ctx.memo:
        ctx.memo[key] = (schedule.sigmas(), schedule.weights())
    sigmas, weights = ctx.memo[key]
    index = draw_position(ctx, schedule.steps)
    scheme = ctx.settings.loss_weighting
    if scheme == "diffsynth":
        weight = weights[index].reshape(1)
    elif scheme in SD3_WEIGHTINGS:
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        weight = compute_loss_weighting_for_sd3(scheme, sigmas[index].reshape(1)).float()
    else:
        weight = None
    return {"timestep": (sigmas[index] * 1000.0).reshape(1).to(ctx.device),
            "loss_weight": None if weight is None else weight.to(ctx.device)}


def draw_position(ctx: Any, steps: int) -> int:
    """An index into a schedule of `steps` positions, within [min_boundary * steps, max_boundary * steps).

    As DiffSynth-Studio's FlowMatchSFTLoss reads --min/max_timestep_boundary: fractions of the schedule's
    positions counted from its noisiest end (index 0, sigma ~1), so a two-expert video model's high-noise
    expert trains on `--max_timestep_boundary 0.358` (shift 5: sigmas from 1 down to ~0.9), the low-noise one on
    the rest. Uniform over them by default (DiffSynth's draw); else u of diffusers' density for
    --timestep_sampling (one value from the same stream) picks position first + int(u x count).
    """
    import torch

    first, last = position_range(ctx.timestep_bounds, steps)
    sampling = ctx.settings.timestep_sampling
    if sampling is None or sampling.scheme == "diffsynth":
        return int(torch.randint(first, last, (1,), generator=ctx.rng("timestep")).item())
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(sampling.scheme, 1, logit_mean=sampling.logit_mean,
                                              logit_std=sampling.logit_std, mode_scale=sampling.mode_scale,
                                              device="cpu", generator=ctx.rng("timestep"))
    u = min(max(float(u[0]), 0.0), 1.0)  # `mode` leaves [0, 1] for a mode_scale above about 1.3
    return min(last - 1, first + int(u * (last - first)))


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

    from .masked_loss import masked_mse

    pred, target = pred.float(), target.float()
    masked = masked_mse(pred, target, loss_weight)
    if masked is not None:
        return masked
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

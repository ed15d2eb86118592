"""The DDPM objective the UNet families train (epsilon or v prediction), as DiffSynth-Studio computes it.

DiffSynth trains its UNet families with the same FlowMatchSFTLoss as its flow-matching ones, around a DDIM
scheduler set up for training (`set_timesteps(1000, training=True)`: the timesteps 999, 998, ..., 0): one
timestep t drawn uniformly from the positions `--min/max_timestep_boundary` leave (counted from the noisiest,
999), the noisy latent x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise with a_t the cumulative product of the
scheduler's alphas, the target the noise (`epsilon` prediction) or v = sqrt(a_t) noise - sqrt(1 - a_t) x0
(`v_prediction`), the plain MSE (its training weight is 1). The betas, the prediction type and the
zero-terminal-SNR rescaling come from the scheduler config of the model's own folder (`scheduler/`), as
diffusers' pipelines read it.

`--timestep_sampling` draws the position through diffusers' densities as for flow matching
(flowmatch.draw_position), and `--snr_gamma` weighs each sample's MSE by Min-SNR (`min_snr_weight`, from
diffusers' `compute_snr`), as diffusers' text-to-image example does.

Where unitgraph knowingly differs: DiffSynth casts the drawn timestep to bf16 before it looks a_t up, which
rounds timesteps above 256 to even numbers (above 512 to multiples of 4); here the drawn integer is used as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .flowmatch import draw_position

__all__ = ["DdpmSchedule", "PREDICTION_TYPES", "ddpm_loss", "min_snr_weight", "noisy_latents", "sample_ddpm_timestep",
           "training_target"]

PREDICTION_TYPES = ("epsilon", "v_prediction")


@dataclass(frozen=True)
class DdpmSchedule:
    """A DDPM noise schedule: the betas (scaled_linear: squares of a linspace of square roots; linear) over
    `num_train_timesteps`, optionally rescaled to zero terminal SNR, and what the model predicts.

    >>> s = DdpmSchedule()
    >>> round(float(s.alphas_cumprod()[0]), 5), round(float(s.alphas_cumprod()[-1]), 5)
    (0.99915, 0.00466)
    """

    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    prediction_type: str = "epsilon"
    rescale_zero_terminal_snr: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "DdpmSchedule":
        """The schedule a diffusers scheduler config (DDPM, DDIM, PNDM, Euler, ...) describes; ValueError (one line)
        for a beta schedule or prediction type this objective does not train."""
        schedule = cls(
            num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
            beta_start=float(config.get("beta_start", 0.00085)),
            beta_end=float(config.get("beta_end", 0.012)),
            beta_schedule=str(config.get("beta_schedule", "scaled_linear")),
            prediction_type=str(config.get("prediction_type", "epsilon")),
            rescale_zero_terminal_snr=bool(config.get("rescale_betas_zero_snr", False)),
        )
        if schedule.beta_schedule not in ("scaled_linear", "linear"):
            raise ValueError(f"beta_schedule {schedule.beta_schedule!r} is not trained here (scaled_linear or linear)")
        if schedule.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type {schedule.prediction_type!r} is not trained here "
                             f"({' or '.join(PREDICTION_TYPES)})")
        if schedule.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be at least 1, got {schedule.num_train_timesteps}")
        return schedule

    def alphas_cumprod(self) -> Any:
        """a_t for t = 0 .. num_train_timesteps - 1 (float32), as DiffSynth's and diffusers' schedulers compute it."""
        import torch

        n = self.num_train_timesteps
        if self.beta_schedule == "scaled_linear":
            betas = torch.linspace(math.sqrt(self.beta_start), math.sqrt(self.beta_end), n, dtype=torch.float32) ** 2
        else:
            betas = torch.linspace(self.beta_start, self.beta_end, n, dtype=torch.float32)
        cumprod = torch.cumprod(1.0 - betas, dim=0)
        if self.rescale_zero_terminal_snr:
            root = cumprod.sqrt()
            first, last = root[0].clone(), root[-1].clone()
            root = (root - last) * (first / (first - last))  # the last a_t becomes 0, the first stays
            cumprod = root ** 2
        return cumprod


def _schedule(ctx: Any) -> DdpmSchedule:
    key = ("ddpm-schedule",)
    if key not in ctx.memo:
        ctx.memo[key] = DdpmSchedule.from_config(ctx.model("scheduler").config)
    return ctx.memo[key]


def sample_ddpm_timestep(ctx: Any) -> dict[str, Any]:
    """One training timestep, drawn from `ctx.rng("timestep")` within the bounds: {"timestep": t (shape (1,),
    int64), "loss_weight": None (DiffSynth's DDPM weight is 1), or Min-SNR's weight with --snr_gamma}.

    As DiffSynth's training scheduler orders them, position k of the schedule is timestep T - 1 - k, so the
    boundaries (fractions of the positions from the noisiest end) mean the same as for the flow-matching families.
    """
    import torch

    schedule = _schedule(ctx)
    steps = schedule.num_train_timesteps
    timestep = torch.tensor([steps - 1 - draw_position(ctx, steps)], dtype=torch.long)
    gamma = ctx.settings.snr_gamma
    weight = None if gamma is None else min_snr_weight(_alphas(ctx), timestep, gamma, schedule.prediction_type)
    return {"timestep": timestep.to(ctx.device), "loss_weight": None if weight is None else weight.to(ctx.device)}


def min_snr_weight(alphas_cumprod: Any, timestep: Any, gamma: float, prediction_type: str) -> Any:
    """Min-SNR-gamma's loss weight per timestep (Hang et al. 2023), as diffusers' train_text_to_image computes it:
    min(SNR, gamma) / SNR for epsilon prediction, / (SNR + 1) for v prediction, with the SNR from diffusers'
    `compute_snr`. A timestep of SNR 0 (the last one of a zero-terminal-SNR schedule) weighs 1 rather than 0/0.

    >>> import torch
    >>> w = min_snr_weight(DdpmSchedule().alphas_cumprod(), torch.tensor([0, 999]), 5.0, "epsilon")
    >>> [round(float(x), 4) for x in w]
    [0.0043, 1.0]
    """
    from types import SimpleNamespace

    import torch
    from diffusers.training_utils import compute_snr

    snr = compute_snr(SimpleNamespace(alphas_cumprod=alphas_cumprod), timestep.long())
    clipped = torch.minimum(snr, torch.full_like(snr, float(gamma)))
    weight = clipped / (snr + 1.0 if prediction_type == "v_prediction" else snr)
    return torch.where(snr == 0, torch.ones_like(weight), weight).float()


def _alphas(ctx: Any) -> Any:
    key = ("ddpm-alphas",)
    if key not in ctx.memo:
        ctx.memo[key] = _schedule(ctx).alphas_cumprod()
    return ctx.memo[key]


def _coefficients(ctx: Any, timestep: Any, like: Any) -> tuple[Any, Any]:
    """sqrt(a_t) and sqrt(1 - a_t) per sample, shaped to broadcast over `like` (B, ...)."""
    a = _alphas(ctx).to(like.device)[timestep.long().reshape(-1).to(like.device)]
    shape = (-1,) + (1,) * (like.dim() - 1)
    return a.sqrt().reshape(shape).to(like.dtype), (1.0 - a).sqrt().reshape(shape).to(like.dtype)


def noisy_latents(ctx: Any, x0: Any, noise: Any, timestep: Any) -> Any:
    """x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise."""
    keep, mix = _coefficients(ctx, timestep, x0)
    return keep * x0 + mix * noise


def training_target(ctx: Any, x0: Any, noise: Any, timestep: Any) -> Any:
    """What the UNet learns to predict: the noise (epsilon), or v = sqrt(a_t) noise - sqrt(1 - a_t) x0."""
    if _schedule(ctx).prediction_type == "epsilon":
        return noise
    keep, mix = _coefficients(ctx, timestep, x0)
    return keep * noise - mix * x0


def ddpm_loss(pred: Any, target: Any, loss_weight: Any = None) -> Any:
    """The plain MSE over the batch, in fp32 (DiffSynth's DDPM training weight is 1); with a weight per sample
    (--snr_gamma), each sample's MSE times its weight, averaged over the batch (diffusers' reduction)."""
    import torch.nn.functional as F

    from .masked_loss import masked_mse

    masked = masked_mse(pred.float(), target.float(), loss_weight)
    if masked is not None:
        return masked
    if loss_weight is None:
        return F.mse_loss(pred.float(), target.float())
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").flatten(1).mean(dim=1)
    return (per_sample * loss_weight.float().reshape(-1)).mean()

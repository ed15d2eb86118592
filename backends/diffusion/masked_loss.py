"""Masked loss (`--masked_loss`): each latent position's squared error weighted by a per-sample mask image.

The metadata's `mask` column names an image per sample, of the same size as its target image. White counts: a
pixel's weight is its brightness, 0 to 1 (grey is a partial weight). `--masked_loss_unmasked_weight W` (default 0)
is the weight of black, so a position of brightness m weighs m + W (1 - m); W = 1 is the plain loss.

Why split equals unsplit, and what the cache holds:

* `LossMask` (data/masks.py), a unit placed right after the image encoder, reads the mask, the target image's
  pixels and the latent. It resizes the mask as the dataset resized the image (`data.imaging.cover_crop`, to the
  pixels' exact size: the same cover and centre crop), then averages it over each latent cell (area pooling to the
  latent's grid). It is deterministic and reads no model, so it runs in stage 1 and the cache holds `loss_mask`,
  one float per latent cell, (1, 1, h, w). Changing W reuses the cache: W is applied in the loss.
* The loss is wrapped (`data.masks.with_masked_loss`): its declaration reads `loss_mask` too, and while the
  family's own loss runs, the weights are active (a context variable), so `flowmatch.flow_matching_mse` and
  `ddpm.ddpm_loss` weigh each squared error by them. The families' losses are unchanged; the weights follow each
  family's latent layout (`mask_like`: the latent grid itself, one token per latent cell, or a 2x2 packing of cells
  into tokens, each channel of a cell weighted by that cell).
* The loss is the mean of the weighted squared errors over every position (as kohya's masked loss): a mask that
  covers half the image halves the loss at W = 0, and each covered position's gradient is the plain MSE's.

A pipeline without an image encoder feeding the loss (a video pipeline) or whose loss is not an MSE of the latent
(direct distillation) refuses the flag in one line. Every sample's mask is checked before any work (present,
readable, of its image's size), in one line naming the row: a wrong mask is never a skipped sample.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import Any, Iterator, Optional

from .errors import BackendError

__all__ = ["MASK", "active_weights", "check_unmasked_weight", "mask_like", "masked", "masked_mse", "weights_of"]

MASK = "mask"  # the metadata column
_ACTIVE: ContextVar[Optional[Any]] = ContextVar("loss_mask", default=None)


def check_unmasked_weight(weight: float) -> None:
    """A one-line error for a weight outside [0, 1]."""
    if not (isinstance(weight, (int, float)) and math.isfinite(weight) and 0.0 <= weight <= 1.0):
        raise BackendError(f"--masked_loss_unmasked_weight must be between 0 and 1, got {weight}")


def weights_of(loss_mask: Any, unmasked: Optional[float]) -> Any:
    """The weight of each latent cell: m + W (1 - m) of the mask's coverage m; None without a mask."""
    if loss_mask is None:
        return None
    m = loss_mask.float()
    return m if not unmasked else m + float(unmasked) * (1.0 - m)


@contextlib.contextmanager
def masked(weights: Any) -> Iterator[None]:
    """The mask's weights active while the loss runs (None: no mask)."""
    token = _ACTIVE.set(weights)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_weights(pred: Any) -> Any:
    """The active mask's weights shaped to broadcast over `pred` (the loss's prediction), or None."""
    weights = _ACTIVE.get()
    return None if weights is None else mask_like(weights.to(pred.device), pred)


def masked_mse(pred: Any, target: Any, loss_weight: Any = None) -> Any:
    """With the mask's weights active, the loss of a batch: each sample's mean of its weighted squared errors, times
    its loss weight when given, averaged over the batch (the flow-matching and DDPM losses both); None without."""
    mask = active_weights(pred)
    if mask is None:
        return None
    per_sample = ((pred - target).pow(2) * mask).flatten(1).mean(dim=1)
    return per_sample.mean() if loss_weight is None else (per_sample * loss_weight.float().reshape(-1)).mean()


def mask_like(weights: Any, pred: Any) -> Any:
    """Weights (B, 1, h, w) over the latent grid, laid out as `pred` lays the latent out: the grid itself ((B, C, h,
    w), or with frames (B, C, T, h, w)), one token per cell ((B, h w, C)), or 2x2 cells per token with each token's
    features ordered (channel, row, column) ((B, h/2 w/2, 4C): the packing of a DiT that reads 2x2 cells a token).

    >>> import torch
    >>> w = torch.arange(16.0).reshape(1, 1, 4, 4)
    >>> mask_like(w, torch.zeros(1, 4, 8))[0, 0].tolist()  # the first token: cells (0,0) (0,1) (1,0) (1,1), twice
    [0.0, 1.0, 4.0, 5.0, 0.0, 1.0, 4.0, 5.0]
    """
    b, _, h, w = weights.shape
    if pred.dim() >= 4 and tuple(pred.shape[-2:]) == (h, w):
        return weights.reshape(b, 1, *([1] * (pred.dim() - 4)), h, w)
    if pred.dim() == 3 and pred.shape[1] == h * w:
        return weights.reshape(b, h * w, 1)
    if pred.dim() == 3 and h % 2 == 0 and w % 2 == 0 and pred.shape[1] == (h // 2) * (w // 2) \
            and pred.shape[2] % 4 == 0:
        cells = weights.reshape(b, 1, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return cells.reshape(b, (h // 2) * (w // 2), 4).repeat(1, 1, pred.shape[2] // 4)
    raise BackendError(f"--masked_loss: a mask over a {h}x{w} latent does not fit the loss's prediction of shape "
                       f"{list(pred.shape)}")

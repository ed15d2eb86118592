"""The masked loss's pipeline side (`--masked_loss`, see masked_loss.py): the `LossMask` unit, which caches each
sample's mask as its coverage of the latent cells, and `with_masked_loss`, which places it and wraps the loss."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import BackendError
from ..family import SinkCode, unit
from ..masked_loss import MASK, masked, weights_of
from .imaging import cover_crop

__all__ = ["loss_mask_unit", "with_masked_loss"]


def _image_encoder(pipeline: Any) -> Any:
    return next((u for u in pipeline.units if tuple(u.inputs) == ("image",) and "latent_mean" in u.outputs), None)


def with_masked_loss(pipeline: Any, on: bool) -> Any:
    """`pipeline` with `LossMask` after its image encoder, its loss reading `loss_mask`, and `mask` a required
    image column; unchanged when off. A pipeline it cannot apply to is refused in one line."""
    if not on:
        return pipeline
    encoder = _image_encoder(pipeline)
    if encoder is None or pipeline.task != "sft":
        why = ("its loss is not an MSE of the target's latent" if pipeline.task != "sft"
               else "no unit encodes a target image into the latent the loss reads (a video pipeline?)")
        raise BackendError(f"--masked_loss: pipeline {pipeline.name} cannot weigh its loss by a mask ({why})")
    units = list(pipeline.units)
    units.insert(units.index(encoder) + 1, loss_mask_unit)
    loss = pipeline.loss
    declaration = dataclasses.replace(loss.declaration, inputs=(*loss.declaration.inputs, "loss_mask"))
    return dataclasses.replace(pipeline, units=tuple(units), loss=SinkCode(declaration, _MaskedLoss(loss.fn)),
                               required=(*pipeline.required, MASK), image_params=(*pipeline.image_params, MASK))


@dataclasses.dataclass(frozen=True)
class _MaskedLoss:
    """The family's loss run with the sample's mask weights active."""

    fn: Any

    def __call__(self, ctx: Any, loss_mask: Any = None, **inputs: Any) -> Any:
        with masked(weights_of(ctx.tensor(loss_mask), ctx.settings.masked_loss)):
            return self.fn(ctx, **inputs)


@unit("LossMask", inputs=(MASK, "image", "latent_mean"), outputs=("loss_mask",), settings=("dtype", "cache_dtype"))
def loss_mask_unit(ctx: Any, mask: Any, image: Any, latent_mean: Any) -> dict[str, Any]:
    """The mask's coverage of each latent cell, (1, 1, h, w) in [0, 1]: the mask cover-cropped to the target
    pixels' size as the image was, then averaged over each cell."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ..context import ImageSize

    height, width = int(image.shape[-2]), int(image.shape[-1])
    cropped = cover_crop(mask, ImageSize(height=height, width=width), 1)
    pixels = torch.from_numpy(np.asarray(cropped, dtype=np.float32).mean(axis=2) / 255.0)
    grid = tuple(int(d) for d in latent_mean.shape[-2:])
    coverage = F.adaptive_avg_pool2d(pixels[None, None], grid)
    return {"loss_mask": coverage.to(ctx.dtype)}  # in the compute dtype, as the other units' outputs

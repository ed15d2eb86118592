"""The dataset image operator every family shares: resize to cover the target size, then centre-crop.

DiffSynth-Studio's datasets resize each image file they load the same way (its ImageCropAndResize:
--height x --width, else scaled down to --max_pixels, sides multiples of the family's factor), so the
target image and a family's reference images (Kontext's, say) are sized by one rule. The result is
a float tensor (1, 3, H, W) in [-1, 1]; a family that works in frames adds its own frame axis.
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendError

__all__ = ["area_dimensions", "capped_area", "cover_crop", "image_list", "image_to_pixels"]


def cover_crop(image: Any, size: Any, multiple: int) -> Any:
    """`image` (PIL) resized (bicubic) to cover `size.target(...)` and centre-cropped to it, as RGB.

    A list of one image is taken as that image; anything else that is not a PIL image is a BackendError.
    """
    from PIL import Image

    if isinstance(image, list):
        if len(image) != 1:
            raise BackendError(f"expected one image per sample, got {len(image)}")
        image = image[0]
    if not isinstance(image, Image.Image):
        raise BackendError(f"expected an image, got {type(image).__name__}")
    w0, h0 = image.size
    w, h = size.target(w0, h0, multiple)
    scale = max(w / w0, h / h0)
    rw, rh = max(w, round(w0 * scale)), max(h, round(h0 * scale))
    if rw * rh > 4 * w * h:
        # an extreme aspect ratio: resizing to cover first would make a huge image (a 10000x16 strip
        # covering 1024x1024 is 640000 px wide); crop the source to the target's aspect first instead
        if w0 / h0 > w / h:
            cw, ch = max(1, round(h0 * w / h)), h0
        else:
            cw, ch = w0, max(1, round(w0 * h / w))
        left, top = (w0 - cw) // 2, (h0 - ch) // 2
        image = image.crop((left, top, left + cw, top + ch))
        w0, h0 = image.size
        scale = max(w / w0, h / h0)
        rw, rh = max(w, round(w0 * scale)), max(h, round(h0 * scale))
    image = image.convert("RGB").resize((rw, rh), Image.Resampling.BICUBIC)
    left, top = (rw - w) // 2, (rh - h) // 2
    return image.crop((left, top, left + w, top + h))


def image_to_pixels(image: Any, size: Any, dtype: Any, multiple: int) -> Any:
    """`cover_crop` as a float tensor (1, 3, H, W) in [-1, 1] of `dtype`."""
    import numpy as np
    import torch

    cropped = cover_crop(image, size, multiple)
    array = torch.from_numpy(np.asarray(cropped, dtype=np.float32).copy())  # H, W, 3
    return (array.permute(2, 0, 1) / 127.5 - 1.0)[None].to(dtype)


def run_pixels(size: Any, multiple: int) -> tuple[int, int]:
    """(width, height) a run's images take at most, for estimates made without images (the dry run): --width x
    --height rounded down to `multiple`, else the largest square of --max_pixels."""
    import math

    if size.height is not None and size.width is not None:
        return size.width // multiple * multiple, size.height // multiple * multiple
    side = max(multiple, int(math.isqrt(int(size.max_pixels))) // multiple * multiple)
    return side, side


def area_dimensions(area: int, width: int, height: int, multiple: int) -> tuple[int, int]:
    """(width, height) of an image of about `area` pixels with the aspect of width x height, each side rounded to
    the nearest multiple of `multiple` (at least one multiple): how DiffSynth's and diffusers' edit pipelines size a
    reference image (their calculate_dimensions, with 32), scaling up as well as down."""
    import math

    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return max(multiple, round(w / multiple) * multiple), max(multiple, round(h / multiple) * multiple)


def capped_area(size: Any, cap: int) -> int:
    """The area reference images are sized to: `cap` (1024 x 1024 in the edit pipelines), or the run's target area
    when that is smaller (--height x --width, else --max_pixels), so that small training runs stay small."""
    target = size.height * size.width if size.height is not None and size.width is not None else size.max_pixels
    return min(int(cap), int(target))


def image_list(value: Any, noun: str, missing: str) -> list[Any]:
    """A sample's reference images (one PIL image, or a list of them) as a list of PIL images; a BackendError line
    `missing` when there are none, and one naming the `noun` ("edit image") for an empty list or a non-image."""
    from PIL import Image

    if value is None:
        raise BackendError(missing)
    images = list(value) if isinstance(value, (list, tuple)) else [value]
    if not images:
        raise BackendError(f"sample has an empty list of {noun}s")
    for image in images:
        if not isinstance(image, Image.Image):
            raise BackendError(f"expected an image for each {noun}, got {type(image).__name__}")
    return images

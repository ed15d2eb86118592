"""FLUX.2's reference-image training (`flux2_klein_edit`, `flux2_edit`): its units and loss, each declaration right
above its code.

Both FLUX.2 DiTs take reference images as extra tokens after the target's: diffusers' Flux2KleinPipeline and
Flux2Pipeline do it for their `image` argument, DiffSynth-Studio's Flux2ImagePipeline for `edit_image` (its klein
LoRA examples train it with `--extra_inputs "edit_image"`). The checkpoint is the same as for text-to-image, so a
command naming klein's or FLUX.2-dev's model ids trains the edit pipeline when its dataset hands over edit images.

Params beyond the text-to-image pipelines' (one sample):

  dataset    edit_image: one PIL image or a list of them (the edit_image column, --extra_inputs edit_image)
  edit       edit_pixels [(1, 3, h, w), ...]: each edit image resized to cover about 1024 x 1024 px with its own
             aspect, sides rounded to multiples of 32, and centre-cropped (DiffSynth's edit_image_auto_resize); the
             area is the run's target area when that is smaller (--height x --width, else --max_pixels), so small
             runs stay small
  vae        edit_latents (1, N, 4 z): each edit image's posterior mean, patchified and batch-normalised as the
             target's (diffusers' argmax), packed and joined along the tokens; edit_grids [[[h, w], ...]]: each
             one's token grid

The loss appends the edit tokens to the noisy target's, with RoPE ids (10 (i + 1), row, col, 0) for edit image i
(Flux2KleinPipeline._prepare_image_ids), and cuts the DiT's output back to the target's tokens: the MSE is over the
target alone, as both pipelines' denoising step and DiffSynth's model_fn_flux2 use it.

Where this knowingly differs from DiffSynth-Studio: its dataset resizes each edit image file once by the
--max_pixels rule before its unit resizes it again (bilinear) to 1024 x 1024 px; here one resize (the dataset's
bicubic operator) goes straight to the area above. diffusers' pipelines, the samplers the LoRA is used with, keep
images under 1024 x 1024 px at their size (sides cut to multiples of 16).
"""

from __future__ import annotations

from typing import Any

from ...context import ImageSize
from ...data.imaging import area_dimensions, capped_area, image_list, image_to_pixels
from ...family import lazy_module, sink, unit
from .losses import flow_matching, image_ids
from .units import encode_distribution, pack

torch = lazy_module("torch")

EDIT_AREA = 1024 * 1024  # DiffSynth's edit_image_auto_resize and diffusers' cap on a reference image's area
EDIT_MULTIPLE = 32  # DiffSynth's calculate_dimensions rounds the sides to this
ID_STEP = 10  # the time coordinate of reference image i is ID_STEP * (i + 1) (diffusers' `scale`)


def edit_list(edit_image: Any) -> list[Any]:
    """A sample's edit images as a list of PIL images (one image, or a list of them)."""
    return image_list(edit_image, "edit image", "sample has no edit image (the FLUX.2 edit pipelines need an "
                      "edit_image column: --extra_inputs edit_image)")


def edit_size(width: int, height: int, run_size: Any) -> ImageSize:
    """The fixed size an edit image of width x height px is cropped to (see the module docstring)."""
    width, height = area_dimensions(capped_area(run_size, EDIT_AREA), width, height, EDIT_MULTIPLE)
    return ImageSize(height=height, width=width)


@unit("EditImageResizer", inputs=("edit_image",), outputs=("edit_pixels",), settings=("image_size", "dtype", "cache_dtype"))
def edit_image_resizer(ctx, edit_image: Any) -> dict[str, Any]:
    return {"edit_pixels": [image_to_pixels(image, edit_size(*image.size, ctx.size), ctx.dtype, EDIT_MULTIPLE)
                            for image in edit_list(edit_image)]}


@unit("EditImageEncoder", inputs=("edit_pixels",), outputs=("edit_latents", "edit_grids"), models=("vae",),
      settings=("dtype", "cache_dtype"))
def edit_image_encoder(ctx, edit_pixels: list) -> dict[str, Any]:
    latents = [encode_distribution(ctx, pixels)[0] for pixels in edit_pixels]
    grids = [[int(z.shape[-2]), int(z.shape[-1])] for z in latents]
    return {"edit_latents": torch.cat([pack(z) for z in latents], dim=1), "edit_grids": [grids]}


def edit_ids(grids: Any, like: torch.Tensor) -> torch.Tensor:
    """(N, 4) RoPE ids of the edit images' tokens: (ID_STEP (i + 1), row, col, 0) over edit image i's grid."""
    out = []
    for i, grid in enumerate(grids):
        ids = image_ids(grid, like)
        ids[:, 0] = ID_STEP * (i + 1)
        out.append(ids)
    return torch.cat(out, dim=0)


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_emb", "latent_grid", "edit_latents",
              "edit_grids"), models=("dit",))
def edit_flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, latent_grid, edit_latents,
                            edit_grids) -> torch.Tensor:
    """The text-to-image loss (losses.flow_matching) with the edit images' tokens after the target's."""
    reference = ctx.tensor(edit_latents)
    return flow_matching(ctx, input_latents, noise, timestep, loss_weight, prompt_emb, latent_grid,
                         reference=reference, reference_ids=edit_ids(edit_grids[0], reference))

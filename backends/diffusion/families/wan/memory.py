"""Wan at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call, from configs.

The memory plan traces one step on fake tensors; running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, video clips), so the shapes the units would produce are made here, from
the VAE's and the DiT's configs, --num_frames and the units' constants. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...family import lazy_module
from .units import MULTIPLE, TEXT_LENGTH

torch = lazy_module("torch")

NOTES = ("Wan: prompts padded to 512 tokens, as the units pad them; clips of --num_frames frames",)


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON)."""
    vae, dit = configs["vae"], configs["dit"]
    downsample = list(vae["temperal_downsample"])
    # TI2V-5B's VAE says its factors (2x2 pixel patches on top of 8x: 16); Wan 2.1's config leaves them out
    scale = int(vae.get("scale_factor_spatial") or 2 ** len(downsample))
    temporal = int(vae.get("scale_factor_temporal") or 2 ** sum(bool(d) for d in downsample))
    pt, ph, pw = dit["patch_size"]
    width, height = run_pixels(cfg.units.image_size, max(MULTIPLE, scale * ph))
    frames = int(cfg.data.num_frames)
    t, h, w = (frames - 1) // temporal + 1, height // scale, width // scale
    out = {"width": width, "height": height, "frames": frames, "latent": [int(vae["z_dim"]), t, h, w],
           "image_tokens": (t // pt) * (h // ph) * (w // pw), "text_tokens": int(text_tokens or TEXT_LENGTH)}
    if dit.get("image_dim") is not None and "image_embeds" in cfg.pipeline.loss.declaration.inputs:
        vision = configs.get("image_encoder")
        side, patch = (int(vision.image_size), int(vision.patch_size)) if vision is not None else (224, 14)
        out["image_embed_tokens"] = (side // patch) ** 2 + 1
        out["image_side"] = side
    out["description"] = (f"{width}x{height} px x {frames} frames, {out['image_tokens']} video tokens, "
                          f"{out['text_tokens']} text tokens")
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over (latents, UMT5's embedding, I2V's conditioning)."""
    z, t, h, w = dims["latent"]
    dit = configs["dit"]
    inputs = {
        "input_latents": torch.randn(batch, z, t, h, w, dtype=dtype),
        "noise": torch.randn(batch, z, t, h, w, dtype=dtype),
        "timestep": torch.full((batch,), 500.0),
        "loss_weight": torch.ones(batch),
        "prompt_emb": torch.randn(batch, dims["text_tokens"], int(dit["text_dim"]), dtype=dtype),
    }
    if "first_frame_latents" in cfg.pipeline.loss.declaration.inputs:  # TI2V: image-to-video with --extra_inputs input_image
        asked = "input_image" in cfg.units.derived_inputs
        inputs["first_frame_latents"] = torch.randn(batch, z, 1, h, w, dtype=dtype) if asked else None
    if "condition" in cfg.pipeline.loss.declaration.inputs:
        inputs["condition"] = torch.randn(batch, int(dit["in_channels"]) - z, t, h, w, dtype=dtype)
        inputs["image_embeds"] = None
        if "image_embed_tokens" in dims:
            inputs["image_embeds"] = torch.randn(batch, dims["image_embed_tokens"], int(dit["image_dim"]), dtype=dtype)
    return inputs


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on
    (the I2V conditioner encodes a clip of the same size again, so the VAE's peak is one encode's)."""

    def vae(model: Any) -> Any:
        clip = torch.randn(batch, 3, dims["frames"], dims["height"], dims["width"], dtype=dtype)
        return model.encode(clip).latent_dist.mean

    def text_encoder(model: Any) -> Any:
        ids = torch.zeros(batch, dims["text_tokens"], dtype=torch.long)
        return model(ids, torch.ones(batch, dims["text_tokens"], dtype=torch.long)).last_hidden_state

    def image_encoder(model: Any) -> Any:
        side = dims.get("image_side", 224)
        out = model(pixel_values=torch.randn(batch, 3, side, side, dtype=dtype), output_hidden_states=True)
        return out.hidden_states[-2]

    return {"vae": vae, "text_encoder": text_encoder, "image_encoder": image_encoder}

"""SDXL at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call, from configs.

The memory plan traces one step on fake tensors; running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, images), so the shapes the units would produce are made here, from the
VAE's and the UNet's configs and the units' constants. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...family import lazy_module
from .units import CLIP_MAX_LENGTH, MULTIPLE, PENULTIMATE, TIME_IDS

torch = lazy_module("torch")

NOTES = ("SDXL: both CLIP encoders read prompts padded to 77 tokens, as the units pad them",)


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON). CLIP reads 77 tokens whatever `text_tokens` says."""
    vae, unet = configs["vae"], configs["unet"]
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    width, height = run_pixels(cfg.units.image_size, MULTIPLE)
    h, w = height // scale, width // scale
    pooled = int(unet["projection_class_embeddings_input_dim"]) - TIME_IDS * int(unet["addition_time_embed_dim"])
    out = {"width": width, "height": height, "latent": [int(vae["latent_channels"]), h, w], "image_tokens": h * w,
           "text_tokens": CLIP_MAX_LENGTH, "context_dim": int(unet["cross_attention_dim"]), "pooled_dim": pooled}
    out["description"] = f"{width}x{height} px, a {h}x{w} latent, {CLIP_MAX_LENGTH} text tokens"
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over (latents, joined prompt embeddings, pooled, ids)."""
    z, h, w = dims["latent"]
    return {
        "input_latents": torch.randn(batch, z, h, w, dtype=dtype),
        "noise": torch.randn(batch, z, h, w, dtype=dtype),
        "timestep": torch.full((batch,), 500, dtype=torch.long),
        "loss_weight": None if cfg.units.snr_gamma is None else torch.ones(batch),
        "prompt_emb": torch.randn(batch, dims["text_tokens"], dims["context_dim"], dtype=dtype),
        "pooled_prompt_emb": torch.randn(batch, dims["pooled_dim"], dtype=dtype),
        "add_time_ids": torch.tensor([[dims["height"], dims["width"], 0, 0, dims["height"], dims["width"]]] * batch),
    }


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on."""

    def vae(model: Any) -> Any:
        return model.encode(torch.randn(batch, 3, dims["height"], dims["width"], dtype=dtype)).latent_dist.mean

    def ids() -> Any:
        return torch.zeros(batch, dims["text_tokens"], dtype=torch.long)

    def clip(model: Any) -> Any:
        return model(ids(), output_hidden_states=True).hidden_states[PENULTIMATE]

    def clip_2(model: Any) -> Any:
        out = model(ids(), output_hidden_states=True)
        return torch.cat([out.hidden_states[PENULTIMATE].flatten(1), out.text_embeds.flatten(1)], dim=1)

    return {"vae": vae, "text_encoder": clip, "text_encoder_2": clip_2}

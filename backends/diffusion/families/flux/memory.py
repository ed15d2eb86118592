"""FLUX.1 at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call, from configs.

The memory plan traces one step on fake tensors; running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, images), so the shapes the units would produce are made here, from the
VAE's and the DiT's configs and the units' constants. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...family import lazy_module
from .units import CLIP_MAX_LENGTH, MULTIPLE, T5_SEQUENCE_LENGTH

torch = lazy_module("torch")

NOTES = ("FLUX.1: T5 prompts padded to 512 tokens and CLIP's to 77, as the units pad them; flux_kontext: one "
         "reference image at the target's size",)


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON)."""
    vae = configs["vae_encoder"]
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    width, height = run_pixels(cfg.units.image_size, MULTIPLE)
    h, w = height // scale, width // scale
    out = {"width": width, "height": height, "latent": [int(vae["latent_channels"]), h, w],
           "image_tokens": (h // 2) * (w // 2), "text_tokens": int(text_tokens or T5_SEQUENCE_LENGTH),
           "clip_tokens": CLIP_MAX_LENGTH}
    if "kontext_latents" in cfg.pipeline.loss.declaration.inputs:
        out["kontext_tokens"] = out["image_tokens"]
    out["description"] = f"{width}x{height} px, {out['image_tokens']} image tokens, {out['text_tokens']} text tokens"
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over (packed latents, T5 and CLIP embeddings)."""
    z, h, w = dims["latent"]
    tokens = dims["image_tokens"]
    dit = configs["dit"]
    inputs = {
        "input_latents": torch.randn(batch, tokens, 4 * z, dtype=dtype),
        "noise": torch.randn(batch, tokens, 4 * z, dtype=dtype),
        "timestep": torch.full((batch,), 500.0),
        "loss_weight": torch.ones(batch),
        "prompt_emb": torch.randn(batch, dims["text_tokens"], int(dit["joint_attention_dim"]), dtype=dtype),
        "pooled_prompt_emb": torch.randn(batch, int(dit["pooled_projection_dim"]), dtype=dtype),
        "guidance": torch.ones(batch),
        "latent_grid": [[h // 2, w // 2] for _ in range(batch)],
    }
    if "kontext_tokens" in dims:
        inputs["kontext_latents"] = torch.randn(batch, dims["kontext_tokens"], 4 * z, dtype=dtype)
        inputs["kontext_grids"] = [[[h // 2, w // 2]] for _ in range(batch)]
    return inputs


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on."""

    def vae(model: Any) -> Any:
        return model.encode(torch.randn(batch, 3, dims["height"], dims["width"], dtype=dtype)).latent_dist.mean

    def clip(model: Any) -> Any:
        return model(torch.zeros(batch, dims["clip_tokens"], dtype=torch.long), output_hidden_states=False).pooler_output

    def t5(model: Any) -> Any:
        return model(torch.zeros(batch, dims["text_tokens"], dtype=torch.long), output_hidden_states=False)[0]

    return {"vae_encoder": vae, "text_encoder_1": clip, "text_encoder_2": t5}

"""FLUX.2 at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call, from configs.

The memory plan traces one step on fake tensors; running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, images), so the shapes the units would produce are made here, from the
VAE's, the text encoder's and the DiT's configs and the units' constants. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...family import lazy_module
from .edit import edit_size
from .units import MAX_SEQUENCE_LENGTH, MISTRAL_LAYERS, MULTIPLE, QWEN3_LAYERS

torch = lazy_module("torch")

NOTES = ("FLUX.2: prompts padded to 512 tokens, as the units pad them; the text embedding stacks three layers of "
         "the text encoder (Qwen3 for klein, Mistral for FLUX.2-dev); the edit pipelines: one edit image of the target's "
         "aspect, sized as their units size it",)


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON)."""
    vae = configs["vae"]
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    width, height = run_pixels(cfg.units.image_size, MULTIPLE)
    h, w = height // scale // 2, width // scale // 2  # the patchified grid: one token per cell
    out = {"width": width, "height": height, "latent": [4 * int(vae["latent_channels"]), h, w], "image_tokens": h * w,
           "text_tokens": int(text_tokens or MAX_SEQUENCE_LENGTH)}
    if "edit_latents" in cfg.pipeline.loss.declaration.inputs:
        edit = edit_size(width, height, cfg.units.image_size)
        out["edit_grid"] = [edit.height // scale // 2, edit.width // scale // 2]
    out["description"] = f"{width}x{height} px, {out['image_tokens']} image tokens, {out['text_tokens']} text tokens"
    if "edit_grid" in out:
        out["description"] += f", {out['edit_grid'][0] * out['edit_grid'][1]} edit image tokens"
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over (packed latents, the stacked text embedding)."""
    c, h, w = dims["latent"]
    tokens = dims["image_tokens"]
    dit = configs["dit"]
    inputs = {
        "input_latents": torch.randn(batch, tokens, c, dtype=dtype),
        "noise": torch.randn(batch, tokens, c, dtype=dtype),
        "timestep": torch.full((batch,), 500.0),
        "loss_weight": torch.ones(batch),
        "prompt_emb": torch.randn(batch, dims["text_tokens"], int(dit["joint_attention_dim"]), dtype=dtype),
        "latent_grid": [[h, w] for _ in range(batch)],
    }
    if "edit_grid" in dims:
        eh, ew = dims["edit_grid"]
        inputs["edit_latents"] = torch.randn(batch, eh * ew, c, dtype=dtype)
        inputs["edit_grids"] = [[[eh, ew]] for _ in range(batch)]
    return inputs


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on."""

    def vae(model: Any) -> Any:
        return model.encode(torch.randn(batch, 3, dims["height"], dims["width"], dtype=dtype)).latent_dist.mean

    def stacked(layers: tuple[int, ...]) -> Callable[[Any], Any]:
        def call(model: Any) -> Any:
            ids = torch.zeros(batch, dims["text_tokens"], dtype=torch.long)
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
            return torch.cat([out.hidden_states[k] for k in layers], dim=-1)

        return call

    return {"vae": vae, "text_encoder_qwen3": stacked(QWEN3_LAYERS), "text_encoder": stacked(MISTRAL_LAYERS)}

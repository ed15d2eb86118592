"""Z-Image at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call, from configs.

The memory plan traces one step on fake tensors; running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, images) and a step fake tensors cannot take (a prompt's tokens are the ones
its attention mask's values keep), so the shapes the units would produce are made here, from the VAE's, the text
encoder's and the DiT's configs and the units' constants. A prompt is taken at its longest: 512 tokens. torch is
imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...family import lazy_module
from .units import HIDDEN_LAYER, MAX_SEQUENCE_LENGTH, MULTIPLE

torch = lazy_module("torch")

NOTES = ("Z-Image: prompts at their longest (512 tokens with the chat template), as the text encoder is called; "
         "z_image_omni: one edit image at the target's size; z_image_omni_t2i: the prompt as the omni template's one "
         "segment",)
OMNI_TEMPLATE_TOKENS = 4  # the omni template's segments around the prompt's (a few tokens each)


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON)."""
    vae = configs["vae_encoder"]
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    width, height = run_pixels(cfg.units.image_size, MULTIPLE)
    h, w = height // scale, width // scale
    out = {"width": width, "height": height, "latent": [int(vae["latent_channels"]), h, w],
           "image_tokens": (h // 2) * (w // 2), "text_tokens": int(text_tokens or MAX_SEQUENCE_LENGTH)}
    if "edit_latents" in cfg.pipeline.loss.declaration.inputs:
        siglip = configs.get("image_encoder")

        def read(key: str, default: int) -> int:  # a transformers config object (or a dict, or None)
            value = siglip.get(key) if isinstance(siglip, Mapping) else getattr(siglip, key, None)
            return int(default if value is None else value)

        out["edit_latent"] = [h, w]
        out["siglip_grid"] = int(round(read("num_patches", 256) ** 0.5))
        out["siglip_width"] = read("hidden_size", 1152)
        out["siglip_patch"] = read("patch_size", 16)
    out["description"] = f"{width}x{height} px, {out['image_tokens']} image tokens, {out['text_tokens']} text tokens"
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over; no mask (every token real: the loss then cuts none,
    which fake tensors could not)."""
    z, h, w = dims["latent"]
    width = int(configs["dit"]["cap_feat_dim"])
    inputs = {
        "input_latents": torch.randn(batch, z, h, w, dtype=dtype),
        "noise": torch.randn(batch, z, h, w, dtype=dtype),
        "timestep": torch.full((batch,), 500.0),
        "loss_weight": torch.ones(batch),
        "prompt_emb": torch.randn(batch, dims["text_tokens"], width, dtype=dtype),
        "prompt_emb_mask": None,
    }
    if "edit_latent" in dims:  # z_image_omni: one edit image, the omni template's three segments
        grid, eh, ew = dims["siglip_grid"], *dims["edit_latent"]
        segments = (OMNI_TEMPLATE_TOKENS, dims["text_tokens"], OMNI_TEMPLATE_TOKENS)
        inputs.update(
            prompt_segments=[[torch.randn(n, width, dtype=dtype) for n in segments] for _ in range(batch)],
            edit_latents=[[torch.randn(1, z, eh, ew, dtype=dtype)] for _ in range(batch)],
            siglip_embeds=[[torch.randn(grid, grid, dims["siglip_width"], dtype=dtype)] for _ in range(batch)])
    elif "prompt_segments" in cfg.pipeline.loss.declaration.inputs:  # z_image_omni_t2i: the template's one segment
        inputs["prompt_segments"] = [[torch.randn(dims["text_tokens"], width, dtype=dtype)] for _ in range(batch)]
    return inputs


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on."""

    def vae(model: Any) -> Any:
        return model.encode(torch.randn(batch, 3, dims["height"], dims["width"], dtype=dtype)).latent_dist.mean

    def text_encoder(model: Any) -> Any:
        ids = torch.zeros(batch, MAX_SEQUENCE_LENGTH, dtype=torch.long)
        return model(input_ids=ids, output_hidden_states=True).hidden_states[HIDDEN_LAYER]

    return {"vae_encoder": vae, "text_encoder": text_encoder}

"""Qwen-Image at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call, from configs.

The memory plan traces one step on fake tensors. Running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, images) and steps that fake tensors cannot take (the prompt's template
tokens are dropped by the attention mask's values), so the shapes the units would produce are made here, from
the VAE's and the DiT's configs and the units' constants. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...family import lazy_module
from ...flowmatch import schedule_sigmas
from .units import (
    CONDITION_IMAGE_AREA,
    EDIT_TEMPLATE_DROP,
    MAX_SEQUENCE_LENGTH,
    MULTIPLE,
    PROMPT_TEMPLATE_DROP,
    edit_dimensions,
    vae_edit_area,
)

torch = lazy_module("torch")

VL_PATCH = 28  # Qwen2.5-VL: 14 px patches merged 2x2 into one image token
NOTES = ("Qwen-Image: prompts at their longest (512 tokens after the template); the edit pipelines' vision tower "
         "is not traced (its image tokens are)",)


def _edit(cfg: Any) -> Optional[str]:
    """'edit' (one edit image), 'plus' (the plus pipeline: one assumed), 't2i' with --extra_inputs edit_image, else None."""
    names = {u.name for u in cfg.pipeline.units}
    if "ConditionImageResizer" in names:
        return "plus" if cfg.pipeline.name.endswith("_plus") else "edit"
    return "t2i" if "edit_image" in cfg.data.extra_inputs else None


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON)."""
    vae = configs["vae"]
    scale = 2 ** len(vae["temperal_downsample"])
    width, height = run_pixels(cfg.units.image_size, MULTIPLE)
    h, w = height // scale, width // scale
    out = {"width": width, "height": height, "latent": [int(vae["z_dim"]), h, w], "image_tokens": (h // 2) * (w // 2),
           "text_tokens": int(text_tokens or MAX_SEQUENCE_LENGTH)}
    edit = _edit(cfg)
    if edit is not None:
        ew, eh = (width, height) if edit == "t2i" else edit_dimensions(vae_edit_area(cfg.units.image_size), width, height)
        out["edit_latent"] = [eh // scale, ew // scale]
        out["edit_tokens"] = (eh // scale // 2) * (ew // scale // 2)
        if edit != "t2i":
            area = CONDITION_IMAGE_AREA if edit == "plus" else vae_edit_area(cfg.units.image_size)
            cw, ch = edit_dimensions(area, width, height)
            out["vision_tokens"] = (cw // VL_PATCH) * (ch // VL_PATCH)
    out["description"] = f"{width}x{height} px, {out['image_tokens']} image tokens, {out['text_tokens']} text tokens"
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over (packed latents, the prompt's embedding)."""
    z, h, w = dims["latent"]
    tokens, text = dims["image_tokens"], dims["text_tokens"]
    width = int(configs["dit"]["joint_attention_dim"])
    shapes = [(1, h // 2, w // 2)]
    edit = None
    if "edit_tokens" in dims:
        eh, ew = dims["edit_latent"]
        shapes.append((1, eh // 2, ew // 2))
        edit = torch.randn(batch, dims["edit_tokens"], 4 * z, dtype=dtype)
    inputs = {
        "input_latents": torch.randn(batch, tokens, 4 * z, dtype=dtype),
        "noise": torch.randn(batch, tokens, 4 * z, dtype=dtype),
        "timestep": torch.full((batch,), 500.0),
        "loss_weight": torch.ones(batch),
        "prompt_emb": torch.randn(batch, text, width, dtype=dtype),
        "prompt_emb_mask": torch.ones(batch, text, dtype=torch.long),
        "edit_latents": edit,
        "img_shapes": [list(shapes) for _ in range(batch)],
    }
    # direct distillation: one sampler step without guidance (its activations grow with num_inference_steps)
    inputs.update(negative_prompt_emb=None, negative_prompt_emb_mask=None, num_inference_steps=1, cfg_scale=None)
    return inputs


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on."""
    edit = "vision_tokens" in dims

    def vae(model: Any) -> Any:
        mean = model.encode(torch.randn(batch, 3, 1, dims["height"], dims["width"], dtype=dtype)).latent_dist.mean
        if "edit_latent" in dims:  # the edit image, encoded by its own unit after the target
            eh, ew = dims["edit_latent"]
            scale = dims["height"] // dims["latent"][1]
            model.encode(torch.randn(batch, 3, 1, eh * scale, ew * scale, dtype=dtype))
        return mean

    def text_encoder(model: Any) -> Any:
        drop = EDIT_TEMPLATE_DROP if edit else PROMPT_TEMPLATE_DROP
        length = drop + dims["text_tokens"] + dims.get("vision_tokens", 0)
        ids = torch.zeros(batch, length, dtype=torch.long)
        positions = torch.arange(length).view(1, 1, length).expand(3, batch, length)
        out = model(input_ids=ids, position_ids=positions, output_hidden_states=True)
        return out.hidden_states[-1]

    return {"vae": vae, "text_encoder": text_encoder}


def warm_context(cfg: Any, ctx: Any, dims: Mapping[str, Any]) -> None:
    """The direct-distillation loss deep-copies the scheduler for its sampler's sigmas, which fake tensors cannot:
    computed here first, from the real scheduler, into the context's memo where the loss finds them."""
    if "num_inference_steps" in cfg.pipeline.loss.declaration.inputs:
        schedule_sigmas(ctx, int(dims["image_tokens"]), 1, inference=True)

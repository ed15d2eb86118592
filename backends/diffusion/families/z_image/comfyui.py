"""Z-Image's denoiser in ComfyUI's LoRA layout: the release checkpoint's names, which ComfyUI's Lumina2 / NextDiT
model (comfy/ldm/lumina) uses (comfy/utils.py's z_image_to_diffusers maps diffusers' names onto them).

Each block's `attention.qkv` stacks q, k and v in its rows (written as one LoRA whose lora_down stacks the parts'
lora_A and whose lora_up is block-diagonal: the same delta), `attention.out` is diffusers' `attention.to_out.0`,
the patch embedder and final layer drop diffusers' `all_..._2-1` dictionaries; every other name is diffusers' own.
"""

from __future__ import annotations

from ...models.release_names import ReleaseNames, rule

_BLOCKS = ("layers", "noise_refiner", "context_refiner", "siglip_refiner")

NAMES = ReleaseNames(
    *(rule(f"{b}.{{i}}.attention.qkv", *(f"{b}.{{i}}.attention.to_{p}" for p in "qkv")) for b in _BLOCKS),
    *(rule(f"{b}.{{i}}.attention.out", f"{b}.{{i}}.attention.to_out.0") for b in _BLOCKS),
    rule("x_embedder", "all_x_embedder.2-1"),
    rule("final_layer.{rest}", "all_final_layer.2-1.{rest}"),
    identity=True, roots=(*_BLOCKS, "t_embedder", "cap_embedder", "siglip_embedder"),
)

"""FLUX.2's denoiser in ComfyUI's LoRA layout: Black Forest Labs' module names, which ComfyUI's Flux model classes
(comfy/ldm/flux, FLUX.2's parameters) use.

Only a double block's `img_attn.qkv` / `txt_attn.qkv` fuse what diffusers keeps apart (q, k, v stacked in rows):
written as one LoRA whose lora_down stacks the parts' lora_A and whose lora_up is block-diagonal, the same delta.
diffusers' single block already fuses its input (`to_qkv_mlp_proj`, the release's `linear1`); the rest is renamed.
The final layer's adaLN yields (shift, scale), diffusers' norm_out (scale, shift): its LoRA's output halves swap.
"""

from __future__ import annotations

from ...models.release_names import ReleaseNames, rule

NAMES = ReleaseNames(
    rule("img_in", "x_embedder"),
    rule("txt_in", "context_embedder"),
    *(rule(f"{src}.{layer}", f"time_guidance_embed.{dst}.linear_{n}")
      for src, dst in (("time_in", "timestep_embedder"), ("guidance_in", "guidance_embedder"))
      for layer, n in (("in_layer", 1), ("out_layer", 2))),
    *(rule(f"{m}.lin", f"{m}.linear") for m in ("double_stream_modulation_img", "double_stream_modulation_txt",
                                                  "single_stream_modulation")),
    rule("double_blocks.{i}.img_attn.qkv", *(f"transformer_blocks.{{i}}.attn.to_{p}" for p in "qkv")),
    rule("double_blocks.{i}.txt_attn.qkv", *(f"transformer_blocks.{{i}}.attn.add_{p}_proj" for p in "qkv")),
    rule("double_blocks.{i}.img_attn.proj", "transformer_blocks.{i}.attn.to_out.0"),
    rule("double_blocks.{i}.txt_attn.proj", "transformer_blocks.{i}.attn.to_add_out"),
    rule("double_blocks.{i}.img_mlp.0", "transformer_blocks.{i}.ff.linear_in"),
    rule("double_blocks.{i}.img_mlp.2", "transformer_blocks.{i}.ff.linear_out"),
    rule("double_blocks.{i}.txt_mlp.0", "transformer_blocks.{i}.ff_context.linear_in"),
    rule("double_blocks.{i}.txt_mlp.2", "transformer_blocks.{i}.ff_context.linear_out"),
    rule("single_blocks.{i}.linear1", "single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"),
    rule("single_blocks.{i}.linear2", "single_transformer_blocks.{i}.attn.to_out"),
    rule("final_layer.linear", "proj_out"),
    rule("final_layer.adaLN_modulation.1", "norm_out.linear", swap_halves=True),
)

"""FLUX.1's denoiser in ComfyUI's LoRA layout: Black Forest Labs' module names (`single_file.py` reads the same
release file), which ComfyUI's Flux model (comfy/ldm/flux) uses.

The reference code fuses what diffusers keeps apart: a double block's `img_attn.qkv` / `txt_attn.qkv` stack q, k, v
in their rows, a single block's `linear1` q, k, v and the MLP input (four times the hidden width). A LoRA on each
diffusers part is written as one LoRA on the fused module whose lora_down stacks the parts' lora_A and whose lora_up
holds each part's lora_B in its own rows and rank columns (block-diagonal): the same delta, rank the parts' sum.
The final layer's adaLN yields (shift, scale), diffusers' norm_out (scale, shift): its LoRA's output halves swap.
"""

from __future__ import annotations

from ...models.release_names import ReleaseNames, rule

NAMES = ReleaseNames(
    rule("img_in", "x_embedder"),
    rule("txt_in", "context_embedder"),
    *(rule(f"{src}.{layer}", f"time_text_embed.{dst}.linear_{n}")
      for src, dst in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"),
                       ("guidance_in", "guidance_embedder"))
      for layer, n in (("in_layer", 1), ("out_layer", 2))),
    rule("double_blocks.{i}.img_mod.lin", "transformer_blocks.{i}.norm1.linear"),
    rule("double_blocks.{i}.txt_mod.lin", "transformer_blocks.{i}.norm1_context.linear"),
    rule("double_blocks.{i}.img_attn.qkv", *(f"transformer_blocks.{{i}}.attn.to_{p}" for p in "qkv")),
    rule("double_blocks.{i}.txt_attn.qkv", *(f"transformer_blocks.{{i}}.attn.add_{p}_proj" for p in "qkv")),
    rule("double_blocks.{i}.img_attn.proj", "transformer_blocks.{i}.attn.to_out.0"),
    rule("double_blocks.{i}.txt_attn.proj", "transformer_blocks.{i}.attn.to_add_out"),
    rule("double_blocks.{i}.img_mlp.0", "transformer_blocks.{i}.ff.net.0.proj"),
    rule("double_blocks.{i}.img_mlp.2", "transformer_blocks.{i}.ff.net.2"),
    rule("double_blocks.{i}.txt_mlp.0", "transformer_blocks.{i}.ff_context.net.0.proj"),
    rule("double_blocks.{i}.txt_mlp.2", "transformer_blocks.{i}.ff_context.net.2"),
    rule("single_blocks.{i}.linear1", *(f"single_transformer_blocks.{{i}}.attn.to_{p}" for p in "qkv"),
         ("single_transformer_blocks.{i}.proj_mlp", 4)),
    rule("single_blocks.{i}.linear2", "single_transformer_blocks.{i}.proj_out"),
    rule("single_blocks.{i}.modulation.lin", "single_transformer_blocks.{i}.norm.linear"),
    rule("final_layer.linear", "proj_out"),
    rule("final_layer.adaLN_modulation.1", "norm_out.linear", swap_halves=True),
)

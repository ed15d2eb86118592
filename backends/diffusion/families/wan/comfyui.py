"""Wan's denoiser in ComfyUI's LoRA layout: the release checkpoint's names (Wan's own `WanModel`), which ComfyUI's
Wan model (comfy/ldm/wan) uses. Every module is one of diffusers' renamed (diffusers' conversion of the release,
single_file_utils.convert_wan_transformer_to_diffusers, read the other way): nothing is fused.
"""

from __future__ import annotations

from ...models.release_names import ReleaseNames, rule

_ATTENTION = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))

NAMES = ReleaseNames(
    *(rule(f"blocks.{{i}}.{src}.{a}", f"blocks.{{i}}.{dst}.{b}")
      for src, dst in (("self_attn", "attn1"), ("cross_attn", "attn2")) for a, b in _ATTENTION),
    rule("blocks.{i}.cross_attn.k_img", "blocks.{i}.attn2.add_k_proj"),
    rule("blocks.{i}.cross_attn.v_img", "blocks.{i}.attn2.add_v_proj"),
    rule("blocks.{i}.ffn.0", "blocks.{i}.ffn.net.0.proj"),
    rule("blocks.{i}.ffn.2", "blocks.{i}.ffn.net.2"),
    rule("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    rule("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    rule("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    rule("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    rule("time_projection.1", "condition_embedder.time_proj"),
    rule("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    rule("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    rule("head.head", "proj_out"),
    rule("patch_embedding", "patch_embedding"),
)

"""Qwen-Image's denoiser in ComfyUI's LoRA layout: the names are diffusers' own.

ComfyUI's Qwen-Image model (comfy/ldm/qwen_image) names its modules as diffusers' QwenImageTransformer2DModel does
(the released bf16 file ComfyUI loads is in diffusers' names), and comfy/lora.py maps a Qwen-Image LoRA's
`<module>` and `transformer.<module>` keys onto the same names: `--lora_format comfyui` writes them under
`diffusion_model.` (ComfyUI's generic key) with lora_up / lora_down and each module's alpha.
"""

from __future__ import annotations

from ...models.release_names import ReleaseNames

NAMES = ReleaseNames(identity=True, roots=("transformer_blocks", "img_in", "txt_in", "txt_norm", "time_text_embed",
                                           "norm_out", "proj_out"))

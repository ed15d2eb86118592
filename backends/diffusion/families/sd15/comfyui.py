"""The UNet in ComfyUI's LoRA layout: the LDM names of the release checkpoint (`input_blocks.4.1.proj_in`), which
ComfyUI's UNet classes use (comfy/utils.py's unet_to_diffusers maps diffusers' names onto them), as
models/release_names.UNetNames derives them from the UNet's layers per block. Nothing is fused.
"""

from __future__ import annotations

from ...models.release_names import UNetNames

NAMES = UNetNames()

"""The released Stable Diffusion 1.5 configurations, for config-only folders (`tiny-models DIR --size real`).

Facts, copied from the published config.json of each component of stable-diffusion-v1-5/stable-diffusion-v1-5 (the
same files as runwayml/stable-diffusion-v1-5 and its ModelScope mirror AI-ModelScope/stable-diffusion-v1-5). On the
meta device the UNet has 859.5 M parameters, CLIP ViT-L/14's text model 123.1 M, the VAE 83.7 M. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import clip_vit_l14_text_config, write_config_folder
from . import SCHEDULER_CONFIG

RELEASE = "stable-diffusion-v1-5/stable-diffusion-v1-5"

# unet/config.json
UNET = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}

# vae/config.json (no scaling_factor key: AutoencoderKL's default, 0.18215, is SD 1.5's)
VAE = {
    "_class_name": "AutoencoderKL",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}

# text_encoder/config.json (openai/clip-vit-large-patch14's text model)
CLIP = clip_vit_l14_text_config("float32", _name_or_path="openai/clip-vit-large-patch14",
                                transformers_version="4.22.0.dev0")

# --size name -> the release it writes
RELEASES = {"real": RELEASE}


def files() -> dict[str, dict[str, Any]]:
    """The component files of the release (scheduler: the family's published config, families/sd15/__init__.py)."""
    return {"unet/config.json": UNET, "vae/config.json": VAE, "text_encoder/config.json": CLIP,
            "scheduler/scheduler_config.json": {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0",
                                                **SCHEDULER_CONFIG, "clip_sample": False}}


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write Stable Diffusion 1.5's config-only pipeline folder (its model_index.json as released: the safety checker and
    feature extractor it names are not written, unitgraph never loads them)."""
    from . import FAMILY

    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    index = {
        "_class_name": FAMILY.diffusers_pipelines[0],
        "_diffusers_version": "0.6.0",
        "feature_extractor": ["transformers", "CLIPImageProcessor"],
        "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
        "scheduler": ["diffusers", "PNDMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    return write_config_folder(outdir, index, files(), RELEASES[size])

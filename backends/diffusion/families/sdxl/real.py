"""The released SDXL base 1.0 configurations, for config-only folders (`tiny-models DIR --size real`).

Facts, copied from the published config.json of each component of stabilityai/stable-diffusion-xl-base-1.0. On the
meta device the UNet has 2.567 B parameters, OpenCLIP ViT-bigG's text model with its projection (text_encoder_2)
695 M, CLIP ViT-L's text model 123 M, the VAE 84 M. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import clip_vit_l14_text_config, write_config_folder

RELEASE = "stabilityai/stable-diffusion-xl-base-1.0"

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json
UNET = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "class_embed_type": None,
    "class_embeddings_concat": False,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "cross_attention_dim": 2048,
    "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_attention_heads": None,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default",
    "sample_size": 128,
    "time_cond_proj_dim": None,
    "time_embedding_act_fn": None,
    "time_embedding_dim": None,
    "time_embedding_type": "positional",
    "timestep_post_act": None,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None,
    "use_linear_projection": True,
}

# stabilityai/stable-diffusion-xl-base-1.0 vae/config.json
VAE = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}

# stabilityai/stable-diffusion-xl-base-1.0 text_encoder/config.json (openai/clip-vit-large-patch14's text model)
CLIP = clip_vit_l14_text_config("float16")

# stabilityai/stable-diffusion-xl-base-1.0 text_encoder_2/config.json (laion's OpenCLIP ViT-bigG/14 text model)
CLIP_2 = {
    "architectures": ["CLIPTextModelWithProjection"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "pad_token_id": 1,
    "projection_dim": 1280,
    "torch_dtype": "float16",
    "vocab_size": 49408,
}

# stabilityai/stable-diffusion-xl-base-1.0 scheduler/scheduler_config.json, whole (families/sdxl/__init__.py keeps the
# arguments EulerDiscreteScheduler takes)
SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}

# --size name -> the release it writes
RELEASES = {"real": RELEASE}


def files() -> dict[str, dict[str, Any]]:
    """The component files of the release."""
    return {"unet/config.json": UNET, "vae/config.json": VAE, "text_encoder/config.json": CLIP,
            "text_encoder_2/config.json": CLIP_2, "scheduler/scheduler_config.json": SCHEDULER}


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write SDXL base 1.0's config-only pipeline folder."""
    from . import FAMILY

    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    definition = FAMILY.pipeline_for(pipeline)
    index = {
        "_class_name": FAMILY.diffusers_class(definition),
        "force_zeros_for_empty_prompt": True,
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    return write_config_folder(outdir, index, files(), RELEASES[size])

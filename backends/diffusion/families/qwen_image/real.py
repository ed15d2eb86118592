"""The released Qwen-Image models' configurations, for config-only folders (`tiny-models DIR --size real`).

Facts, copied from the published config.json of each component of Qwen/Qwen-Image (the edit releases,
Qwen/Qwen-Image-Edit and Qwen/Qwen-Image-Edit-2509, publish the same transformer, VAE and text encoder configs
under another pipeline class). On the meta device the transformer has 20.43 B parameters, the text encoder
(Qwen2.5-VL-7B with its vision tower) 8.29 B, the VAE 127 M. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import write_config_folder
from . import SCHEDULER_CONFIG

RELEASE = "Qwen/Qwen-Image"

# Qwen/Qwen-Image transformer/config.json
TRANSFORMER = {
    "_class_name": "QwenImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 768,
}

# Qwen/Qwen-Image vae/config.json
VAE = {
    "_class_name": "AutoencoderKLQwenImage",
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                     -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                    1.6382, 1.1253, 2.8251, 1.916],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}

# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct)
TEXT_ENCODER = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "image_token_id": 151655,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "video_token_id": 151656,
    "vision_config": {
        "depth": 32,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "hidden_act": "silu",
        "hidden_size": 1280,
        "in_chans": 3,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
    "vision_token_id": 151654,
    "vocab_size": 152064,
}

# --size name -> the release it writes
RELEASES = {"real": RELEASE}


def files() -> dict[str, dict[str, Any]]:
    """The component files of the release (scheduler: the family's published config, families/qwen_image/__init__.py)."""
    return {"transformer/config.json": TRANSFORMER, "vae/config.json": VAE, "text_encoder/config.json": TEXT_ENCODER,
            "scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG}}


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write the release's config-only pipeline folder for `pipeline` (None: qwen_image): model_index.json names its
    diffusers class (QwenImageEditPipeline for qwen_image_edit, ...), the component configs are the same."""
    from . import FAMILY

    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    definition = FAMILY.pipeline_for(pipeline)
    index = {
        "_class_name": FAMILY.diffusers_class(definition),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    if any("processor" in aux for aux in definition.companions.values()):
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    return write_config_folder(outdir, index, files(), RELEASES[size])

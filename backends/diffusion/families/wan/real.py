"""The released Wan 2.1 and Wan 2.2 TI2V-5B configurations, for config-only folders (`tiny-models DIR --size
real|real-1.3b`; `--pipeline wan_ti2v` writes Wan-AI/Wan2.2-TI2V-5B-Diffusers at any real size).

Facts, copied from the published config.json of each component of Wan-AI/Wan2.1-T2V-14B-Diffusers (`--size real`,
or `real-14b`), Wan-AI/Wan2.1-T2V-1.3B-Diffusers (`real-1.3b`) and, for `--pipeline wan_i2v`,
Wan-AI/Wan2.1-I2V-14B-480P-Diffusers. On the meta device the 14B transformer has 14.29 B parameters, the 1.3B one
1.42 B, UMT5-XXL's encoder 5.68 B, the VAE 127 M. Wan-AI/Wan2.2-TI2V-5B-Diffusers (`--pipeline wan_ti2v`): the
5B transformer has 5.00 B parameters, its VAE (z 48, 4x16x16) 705 M. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import write_config_folder
from . import SCHEDULER_CONFIG

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
TRANSFORMER_1_3B = {
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}

# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json
TRANSFORMER_14B = dict(TRANSFORMER_1_3B, ffn_dim=13824, num_attention_heads=40, num_layers=40)

# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json
TRANSFORMER_I2V_14B = dict(TRANSFORMER_14B, added_kv_proj_dim=5120, image_dim=1280, in_channels=36)

# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json: the Wan 2.1 layout at dim 3072 (24 heads x 128), 30
# layers, ffn 14336, 48 latent channels in and out (the same numbers in Wan's wan/configs/wan_ti2v_5B.py and in
# DiffSynth's diffsynth/configs/model_configs.py entry for the TI2V-5B DiT: in_dim 48, dim 3072, ffn_dim 14336,
# num_heads 24, num_layers 30, text_dim 4096, freq_dim 256, patch (1, 2, 2))
TRANSFORMER_TI2V_5B = dict(TRANSFORMER_1_3B, ffn_dim=14336, in_channels=48, num_attention_heads=24, num_layers=30,
                           out_channels=48)

# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: the Wan 2.2 VAE, 2x2 pixel patches (12 channels) and residual
# blocks, 16x spatial and 4x temporal, 48 latent channels
VAE_TI2V = {
    "_class_name": "AutoencoderKLWan",
    "attn_scales": [],
    "base_dim": 160,
    "clip_output": False,
    "decoder_base_dim": 256,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "in_channels": 12,
    "is_residual": True,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
    "num_res_blocks": 2,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True],
    "z_dim": 48,
}

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json (the same in every Wan 2.1 release)
VAE = {
    "_class_name": "AutoencoderKLWan",
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

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers text_encoder/config.json (google/umt5-xxl's encoder; the same in every release)
TEXT_ENCODER = {
    "architectures": ["UMT5EncoderModel"],
    "classifier_dropout": 0.0,
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "umt5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "output_past": True,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "scalable_attention": True,
    "tie_word_embeddings": False,
    "tokenizer_class": "T5Tokenizer",
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 256384,
}

# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers image_encoder/config.json (open-clip ViT-H/14's vision tower)
IMAGE_ENCODER = {
    "architectures": ["CLIPVisionModel"],
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "image_size": 224,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "layer_norm_eps": 1e-05,
    "model_type": "clip_vision_model",
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 32,
    "patch_size": 14,
    "projection_dim": 1024,
    "torch_dtype": "float32",
}

# --size name -> (the T2V release, its transformer config)
RELEASES = {
    "real": ("Wan-AI/Wan2.1-T2V-14B-Diffusers", TRANSFORMER_14B),
    "real-14b": ("Wan-AI/Wan2.1-T2V-14B-Diffusers", TRANSFORMER_14B),
    "real-1.3b": ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", TRANSFORMER_1_3B),
    "real-a14b": ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", TRANSFORMER_14B),  # two experts of Wan 2.1 14B's config
}
# Wan 2.2 A14B (--size real-a14b): `transformer` and `transformer_2` of one config and model_index.json's boundary
# ratio; I2V A14B's DiT is Wan 2.1 I2V's without the CLIP image features (image_dim and added_kv_proj_dim null),
# and its folder has no image encoder (image_encoder and image_processor null)
A14B_BOUNDARY = {"wan": 0.875, "wan_i2v": 0.9}
I2V_A14B_RELEASE = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
I2V_RELEASE = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"  # --pipeline wan_i2v (any --size real*: the one I2V release here)
TI2V_RELEASE = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"  # --pipeline wan_ti2v (any --size real*)
# its scheduler/scheduler_config.json: UniPC at flow shift 5 (Wan's sample_shift for TI2V-5B)
TI2V_SCHEDULER = {"_class_name": "UniPCMultistepScheduler", **SCHEDULER_CONFIG, "flow_shift": 5.0}


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write the release's config-only pipeline folder: T2V for `wan` (14B, or 1.3B with size real-1.3b), Wan 2.1
    I2V 14B 480P for `wan_i2v` (its image encoder too), Wan 2.2 TI2V-5B for `wan_ti2v`; with size real-a14b Wan 2.2
    T2V A14B for `wan` and I2V A14B for `wan_i2v` (two experts)."""
    from . import FAMILY

    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    definition = FAMILY.pipeline_for(pipeline)
    class_name = FAMILY.diffusers_class(definition)
    i2v = class_name == "WanImageToVideoPipeline"
    ti2v = definition.name == "wan_ti2v"
    release, transformer = (I2V_RELEASE, TRANSFORMER_I2V_14B) if i2v else RELEASES[size]
    if ti2v:
        release, transformer = TI2V_RELEASE, TRANSFORMER_TI2V_5B
    a14b = size == "real-a14b"
    if a14b and ti2v:
        raise ValueError("Wan 2.2 TI2V-5B is one DiT: --size real for wan_ti2v")
    if a14b and i2v:
        release, transformer = I2V_A14B_RELEASE, dict(TRANSFORMER_I2V_14B, image_dim=None, added_kv_proj_dim=None)
    index = {
        "_class_name": class_name,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    files = {"transformer/config.json": transformer, "vae/config.json": VAE, "text_encoder/config.json": TEXT_ENCODER,
             "scheduler/scheduler_config.json": {"_class_name": "UniPCMultistepScheduler", **SCHEDULER_CONFIG}}
    if ti2v:  # one DiT, its timesteps expanded per token
        index.update(boundary_ratio=None, expand_timesteps=True, transformer_2=[None, None])
        files.update({"vae/config.json": VAE_TI2V, "scheduler/scheduler_config.json": TI2V_SCHEDULER})
    if a14b:
        index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=A14B_BOUNDARY[definition.name])
        files["transformer_2/config.json"] = transformer
    if i2v and a14b:
        index.update(image_encoder=[None, None], image_processor=[None, None])
    elif i2v:
        index.update(image_encoder=["transformers", "CLIPVisionModel"], image_processor=["transformers", "CLIPImageProcessor"])
        files["image_encoder/config.json"] = IMAGE_ENCODER
    return write_config_folder(outdir, index, files, release)

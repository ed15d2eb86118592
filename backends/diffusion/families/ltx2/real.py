"""The released LTX-2 configuration, for config-only folders (`tiny-models DIR --pipeline ltx2 --size real`).

Where each number comes from: the transformer, the video VAE, the connectors and the vocoder are the "2.0" configs of
diffusers' scripts/convert_ltx2_to_diffusers.py (the script that made Lightricks/LTX-2's diffusers folders); the audio
VAE is diffusers' AutoencoderKLLTX2Audio defaults (LTX-2's: 128 base channels, 8 latent channels, 64 mel bins at 16 kHz,
hop 160); the text encoder is google/gemma-3-12b-it's config.json (Gemma 3 12B: width 3840, 48 layers, a SigLIP tower
of 27 layers at 896 px). On the meta device the DiT has 18.9 B parameters (LTX-2's published "19B": a 14B video and
a 5B audio stream), Gemma 3 12.2 B (its published "12B"). No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import write_config_folder
from . import SCHEDULER_CONFIG

RELEASE = "Lightricks/LTX-2"

TRANSFORMER = {
    "_class_name": "LTX2VideoTransformer3DModel",
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "vae_scale_factors": [8, 32, 32],
    "pos_embed_max_pos": 20,
    "base_height": 2048,
    "base_width": 2048,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "num_layers": 48,
    "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "caption_channels": 3840,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_theta": 10000.0,
    "causal_offset": 1,
}

VAE = {
    "_class_name": "AutoencoderKLLTX2Video",
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 128,
    "block_out_channels": [256, 512, 1024, 2048],
    "down_block_types": ["LTX2VideoDownBlock3D"] * 4,
    "decoder_block_out_channels": [256, 512, 1024],
    "layers_per_block": [4, 6, 6, 2, 2],
    "decoder_layers_per_block": [5, 5, 5, 5],
    "spatio_temporal_scaling": [True, True, True, True],
    "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [False, False, False, False],
    "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
    "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2],
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "encoder_causal": True,
    "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8,
}

AUDIO_VAE = {
    "_class_name": "AutoencoderKLLTX2Audio",
    "base_channels": 128,
    "output_channels": 2,
    "ch_mult": [1, 2, 4],
    "num_res_blocks": 2,
    "attn_resolutions": None,
    "in_channels": 2,
    "resolution": 256,
    "latent_channels": 8,
    "norm_type": "pixel",
    "causality_axis": "height",
    "dropout": 0.0,
    "mid_block_add_attention": False,
    "sample_rate": 16000,
    "mel_hop_length": 160,
    "is_causal": True,
    "mel_bins": 64,
    "double_z": True,
}

CONNECTORS = {
    "_class_name": "LTX2TextConnectors",
    "caption_channels": 3840,
    "text_proj_in_factor": 49,
    "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128,
    "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128,
    "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128,
    "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128,
    "connector_rope_base_seq_len": 4096,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_temporal_positioning": False,
}

VOCODER = {
    "_class_name": "LTX2Vocoder",
    "in_channels": 128,
    "hidden_channels": 1024,
    "out_channels": 2,
    "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_factors": [6, 5, 2, 2, 2],
    "resnet_kernel_sizes": [3, 7, 11],
    "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "leaky_relu_negative_slope": 0.1,
    "output_sampling_rate": 24000,
}

# google/gemma-3-12b-it config.json (the same architecture as the QAT unquantized checkpoint LTX-2 names)
TEXT_ENCODER = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
        "vision_use_head": False,
    },
    "torch_dtype": "bfloat16",
}

# --size name -> the release it writes
RELEASES = {"real": RELEASE}


def files() -> dict[str, dict[str, Any]]:
    """The component files of the release (scheduler: the family's config, families/ltx2/__init__.py)."""
    return {"transformer/config.json": TRANSFORMER, "vae/config.json": VAE, "audio_vae/config.json": AUDIO_VAE,
            "connectors/config.json": CONNECTORS, "vocoder/config.json": VOCODER, "text_encoder/config.json": TEXT_ENCODER,
            "scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG}}


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write LTX-2's config-only LTX2Pipeline folder."""
    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    index = {
        "_class_name": "LTX2Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
        "tokenizer": ["transformers", "GemmaTokenizer"],
        "connectors": ["ltx2", "LTX2TextConnectors"],
        "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLLTX2Video"],
        "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
        "vocoder": ["ltx2", "LTX2Vocoder"],
    }
    return write_config_folder(outdir, index, files(), RELEASES[size])

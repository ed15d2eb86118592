"""The released FLUX.2 configurations, for config-only folders (`tiny-models DIR --size real`): FLUX.2 [klein] 4B
(`--pipeline flux2_klein`) and FLUX.2-dev (`--pipeline flux2`).

Where each number comes from (no network here): the DiT is diffusers' Flux2Transformer2DModel defaults (FLUX.2-dev's
architecture) with the klein-4B values DiffSynth-Studio's model registry gives it (diffsynth/configs/
model_configs.py: no guidance embedding, joint_attention_dim 7680, 24 heads, 5 double and 20 single blocks); the
Qwen3-4B text encoder is the config DiffSynth builds for it (its Qwen3 text-encoder module, model size "4B"); the VAE
is AutoencoderKLFlux2's defaults, which are the released VAE's. On the meta device the DiT has 3.88 B parameters
(BFL's "4B"), the text encoder 4.02 B (Qwen3-4B's published 4.0 B, embeddings tied), the VAE 84 M.

FLUX.2-dev: the DiT is Flux2Transformer2DModel's defaults (diffusers' docstring: the FLUX.2 model), 32 B parameters
counted as BFL publishes; its text encoder is Mistral-Small-3.1-24B-Instruct-2503 (Mistral3ForConditionalGeneration:
the language model and the Pixtral vision tower, 24.0 B), with the values of that release's config.json as
transformers' Mistral3/Pixtral config classes document them. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import qwen3_4b_config, write_config_folder

RELEASE = "black-forest-labs/FLUX.2-klein-4B"

# black-forest-labs/FLUX.2-klein-4B transformer/config.json
TRANSFORMER = {
    "_class_name": "Flux2Transformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [32, 32, 32, 32],
    "eps": 1e-06,
    "guidance_embeds": False,
    "in_channels": 128,
    "joint_attention_dim": 7680,
    "mlp_ratio": 3.0,
    "num_attention_heads": 24,
    "num_layers": 5,
    "num_single_layers": 20,
    "out_channels": None,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}

# black-forest-labs/FLUX.2-klein-4B vae/config.json (the FLUX.2 VAE, shared by the line)
VAE = {
    "_class_name": "AutoencoderKLFlux2",
    "act_fn": "silu",
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "block_out_channels": [128, 256, 512, 512],
    "decoder_block_out_channels": None,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 32,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}

# black-forest-labs/FLUX.2-klein-4B text_encoder/config.json (Qwen3-4B)
TEXT_ENCODER = qwen3_4b_config()


DEV_RELEASE = "black-forest-labs/FLUX.2-dev"

# black-forest-labs/FLUX.2-dev transformer/config.json
DEV_TRANSFORMER = {**TRANSFORMER, "guidance_embeds": True, "joint_attention_dim": 15360, "num_attention_heads": 48,
                   "num_layers": 8, "num_single_layers": 48}

# black-forest-labs/FLUX.2-dev text_encoder/config.json (Mistral-Small-3.1-24B-Instruct-2503)
DEV_TEXT_ENCODER = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "image_token_index": 10,
    "model_type": "mistral3",
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "tie_word_embeddings": False,
    "text_config": {
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 131072,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "image_size": 1540,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "pixtral",
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "vision_feature_layer": -1,
}


def _scheduler() -> dict[str, Any]:
    from . import SCHEDULER_CONFIG

    return {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG}


# --size name -> the release it writes
RELEASES = {"real": RELEASE}


def files(dev: bool = False) -> dict[str, dict[str, Any]]:
    """The component files of the release: klein 4B's, or FLUX.2-dev's."""
    return {"transformer/config.json": DEV_TRANSFORMER if dev else TRANSFORMER, "vae/config.json": VAE,
            "text_encoder/config.json": DEV_TEXT_ENCODER if dev else TEXT_ENCODER,
            "scheduler/scheduler_config.json": _scheduler()}


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write the config-only pipeline folder of the pipeline's release: FLUX.2 [klein] 4B (flux2_klein, the default)
    or FLUX.2-dev (flux2)."""
    from . import FAMILY

    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    definition = FAMILY.pipeline(pipeline) if pipeline else FAMILY.pipelines[0]
    dev = definition.diffusers_pipeline == "Flux2Pipeline"
    index = {
        "_class_name": definition.diffusers_pipeline,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration" if dev else "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "PixtralProcessor" if dev else "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    if not dev:
        index["is_distilled"] = True
    return write_config_folder(outdir, index, files(dev), DEV_RELEASE if dev else RELEASES[size])

"""The released FLUX.1-dev configurations, for config-only folders (`tiny-models DIR --size real`).

Facts, copied from the published config.json of each component of black-forest-labs/FLUX.1-dev (FLUX.1 Kontext
[dev], black-forest-labs/FLUX.1-Kontext-dev, publishes the same configs under FluxKontextPipeline). On the meta
device the transformer has 11.90 B parameters, T5-XXL's encoder 4.76 B, CLIP-L's text model 123 M, the VAE 84 M.
No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import autoencoder_16ch_config, clip_vit_l14_text_config, write_config_folder
from . import SCHEDULER_CONFIG

RELEASE = "black-forest-labs/FLUX.1-dev"

# black-forest-labs/FLUX.1-dev transformer/config.json
TRANSFORMER = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}

# black-forest-labs/FLUX.1-dev vae/config.json
VAE = autoencoder_16ch_config()

# black-forest-labs/FLUX.1-dev text_encoder/config.json (openai/clip-vit-large-patch14's text model)
CLIP = clip_vit_l14_text_config("bfloat16")

# black-forest-labs/FLUX.1-dev text_encoder_2/config.json (google/t5-v1_1-xxl's encoder)
T5 = {
    "architectures": ["T5EncoderModel"],
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
    "model_type": "t5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "output_past": True,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32128,
}

# --size name -> the release it writes
RELEASES = {"real": RELEASE}


def files() -> dict[str, dict[str, Any]]:
    """The component files of the release (scheduler: the family's published config, families/flux/__init__.py)."""
    return {"transformer/config.json": TRANSFORMER, "vae/config.json": VAE, "text_encoder/config.json": CLIP,
            "text_encoder_2/config.json": T5,
            "scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG}}


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write FLUX.1-dev's config-only pipeline folder; for flux_kontext model_index.json names FluxKontextPipeline."""
    from . import FAMILY

    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    definition = FAMILY.pipeline_for(pipeline)
    index = {
        "_class_name": FAMILY.diffusers_class(definition),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    return write_config_folder(outdir, index, files(), RELEASES[size])

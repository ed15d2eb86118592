"""The released Z-Image-Turbo configurations, for config-only folders (`tiny-models DIR --size real`).

Facts, as published in Tongyi-MAI/Z-Image-Turbo's component config.json files (the values as quoted verbatim by public
projects that load them, and matching DiffSynth-Studio's own classes: its ZImageTextEncoder spells the Qwen3 config
out, its ZImageDiT's defaults are the transformer's, its VAE encoder and decoder classes the VAE's). Z-Image (the base model the
LoRA example trains) has the same transformer; DiffSynth's example takes the text encoder and VAE from Z-Image-Turbo.
On the meta device the transformer has 6.15 B parameters, the Qwen3-4B text encoder (its base model, no LM head) 4.02 B,
the VAE 84 M (tests/test_z_image.py measures them). No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ...models.config_folders import autoencoder_16ch_config, qwen3_4b_config, write_config_folder
from . import SCHEDULER_CONFIG

RELEASE = "Tongyi-MAI/Z-Image-Turbo"
OMNI_RELEASE = "Tongyi-MAI/Z-Image-Omni-Base"

# Tongyi-MAI/Z-Image-Turbo transformer/config.json
TRANSFORMER = {
    "_class_name": "ZImageTransformer2DModel",
    "all_f_patch_size": [1],
    "all_patch_size": [2],
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}

# Tongyi-MAI/Z-Image-Turbo text_encoder/config.json (Qwen3-4B)
TEXT_ENCODER = qwen3_4b_config()

# Tongyi-MAI/Z-Image-Turbo vae/config.json (Black Forest Labs' 16-channel autoencoder)
VAE = autoencoder_16ch_config()

# Tongyi-MAI/Z-Image-Omni-Base: the same transformer with a SigLIP embedder of the vision encoder's width (DiffSynth's
# model config for its transformer: siglip_feat_dim 1152), and the SigLIP2 vision encoder (siglip/; DiffSynth's
# Siglip2ImageEncoder428M spells its config and its image processor out). Not checked against a published file here.
OMNI_TRANSFORMER = {**TRANSFORMER, "siglip_feat_dim": 1152}
SIGLIP = {
    "architectures": ["Siglip2VisionModel"],
    "attention_dropout": 0.0,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "layer_norm_eps": 1e-06,
    "model_type": "siglip2_vision_model",
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 27,
    "num_patches": 256,
    "patch_size": 16,
    "torch_dtype": "bfloat16",
}
SIGLIP_PROCESSOR = {
    "image_processor_type": "Siglip2ImageProcessor",
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "max_num_patches": 256,
    "patch_size": 16,
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
}

# --size name -> the release it writes
RELEASES = {"real": RELEASE}


def files(omni: bool = False) -> dict[str, dict[str, Any]]:
    """The component files of the release (scheduler: the family's published config, families/z_image/__init__.py);
    `omni`: Z-Image-Omni-Base's, with its SigLIP2 encoder and processor."""
    out = {"transformer/config.json": OMNI_TRANSFORMER if omni else TRANSFORMER, "text_encoder/config.json": TEXT_ENCODER,
           "vae/config.json": VAE,
           "scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG}}
    if omni:
        out.update({"siglip/config.json": SIGLIP, "siglip_processor/preprocessor_config.json": SIGLIP_PROCESSOR})
    return out


def write_real_configs(outdir: Any, size: str = "real", pipeline: Optional[str] = None) -> Path:
    """Write Z-Image-Turbo's config-only pipeline folder (model_index.json names ZImagePipeline), or for z_image_omni
    Z-Image-Omni-Base's (ZImageOmniPipeline, with siglip/ and siglip_processor/)."""
    from . import FAMILY

    if size not in RELEASES:
        raise ValueError(f"unknown real size {size!r} (sizes: {', '.join(RELEASES)})")
    index = {
        "_class_name": FAMILY.diffusers_class(pipeline),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    omni = index["_class_name"] == "ZImageOmniPipeline"
    if omni:
        index.update(siglip=["transformers", "Siglip2VisionModel"], siglip_processor=["transformers", "Siglip2ImageProcessor"])
    return write_config_folder(outdir, index, files(omni), OMNI_RELEASE if omni else RELEASES[size])

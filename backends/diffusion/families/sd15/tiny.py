"""Tiny random-weight Stable Diffusion 1.5 pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline sd15`).

`write_tiny_models(outdir, size, seed)` writes a complete diffusers pipeline folder (model_index.json, unet/, vae/,
text_encoder/ (CLIP), tokenizer/, scheduler/ with SD 1.5's published PNDM config) that
`diffusers.StableDiffusionPipeline.from_pretrained(outdir)` loads and runs offline: no safety checker, no feature
extractor (requires_safety_checker false). The CLIP tokenizer is built here without a download
(models/tiny_tokenizers.py; model_max_length 77, which the text encoder's positions cover). The UNet keeps SD 1.5's
shape in small: a cross-attention block and a plain one on the way down, their mirror on the way up, a
cross-attention middle block; the VAE downsamples by 8 with 4 latent channels and SD's scaling factor. Sizes:

  * ``test``: a UNet LoRA step at 32 px (a 4x4 latent, 77 text tokens) takes a few ms on CPU.
  * ``demo``: wider and deeper models, still seconds per epoch at 256 px.

The weights are drawn from torch's generator seeded per component, so the same seed gives bitwise the same
safetensors files. Heavy imports happen inside the functions; importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny_tokenizers import clip_tokenizer, seeded
from . import SCHEDULER_CONFIG
from .units import CLIP_MAX_LENGTH

_VAE_BLOCKS = {"down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
               "latent_channels": 4, "scaling_factor": 0.18215, "in_channels": 3, "out_channels": 3,
               "layers_per_block": 1}

SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "UNet 8-16 ch (1 cross-attention block down, 1 up, cross-attention middle), 2 heads; "
                       "VAE /8 (8-16 ch); CLIP hidden 32 x 2 layers",
        "unet": {"sample_size": 4, "in_channels": 4, "out_channels": 4, "block_out_channels": [8, 16],
                 "layers_per_block": 1, "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                 "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 32,
                 "attention_head_dim": 2, "norm_num_groups": 4},
        "vae": {**_VAE_BLOCKS, "block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4, "sample_size": 32},
        "clip": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "projection_dim": 32},
    },
    "demo": {
        "description": "UNet 32-64-64 ch (2 cross-attention blocks down, 2 up, cross-attention middle), 4 heads; "
                       "VAE /8 (32-64 ch); CLIP hidden 128 x 4 layers",
        "unet": {"sample_size": 32, "in_channels": 4, "out_channels": 4, "block_out_channels": [32, 64, 64],
                 "layers_per_block": 1,
                 "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
                 "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
                 "cross_attention_dim": 128, "attention_head_dim": 4, "norm_num_groups": 16},
        "vae": {**_VAE_BLOCKS, "block_out_channels": [32, 64, 64, 64], "norm_num_groups": 16, "sample_size": 256},
        "clip": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "projection_dim": 128},
    },
}

# Per-component offsets added to the seed, so each component's weights do not depend on the build order.
_SEED_OFFSETS = {"unet": 0, "vae": 1, "text_encoder": 2}


def build_clip_tokenizer():
    """SD 1.5's tiny CLIP tokenizer (byte-level BPE, 77 tokens)."""
    return clip_tokenizer(CLIP_MAX_LENGTH)


def build_tiny_components(size: str = "test", seed: int = 0) -> dict[str, Any]:
    """The pipeline components in memory (keys: StableDiffusionPipeline's component names)."""
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r} (sizes: {', '.join(SIZES)})")
    spec = SIZES[size]
    tokenizer = build_clip_tokenizer()
    clip_config = CLIPTextConfig(vocab_size=len(tokenizer), max_position_embeddings=CLIP_MAX_LENGTH,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, **spec["clip"])
    components = {
        "unet": seeded(seed + _SEED_OFFSETS["unet"], lambda: UNet2DConditionModel(**spec["unet"])),
        "vae": seeded(seed + _SEED_OFFSETS["vae"], lambda: AutoencoderKL(**spec["vae"])),
        "text_encoder": seeded(seed + _SEED_OFFSETS["text_encoder"], lambda: CLIPTextModel(clip_config)),
        "tokenizer": tokenizer,
        "scheduler": PNDMScheduler(**SCHEDULER_CONFIG),
        "safety_checker": None,
        "feature_extractor": None,
    }
    for name in ("unet", "vae", "text_encoder"):
        components[name].eval()
    return components


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None) -> Path:
    """Write a complete random-weight Stable Diffusion 1.5 diffusers pipeline folder; return its path.

    `pipeline` (a name or a PipelineDef; None: the family's one) must be this family's; the folder also holds
    unitgraph_tiny.json {size, seed, config}.
    """
    import diffusers

    from . import FAMILY

    if pipeline is not None:
        name = str(getattr(pipeline, "name", pipeline))
        if name not in {p.name for p in FAMILY.pipelines}:
            raise ValueError(f"unknown {FAMILY.title} pipeline {name!r} "
                             f"(pipelines: {', '.join(p.name for p in FAMILY.pipelines)})")
    class_name = FAMILY.diffusers_pipelines[0]
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    components = build_tiny_components(size=size, seed=seed)
    pipe = getattr(diffusers, class_name)(**components, requires_safety_checker=False)
    pipe.save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size], "pipeline_class": class_name}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

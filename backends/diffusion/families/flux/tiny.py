"""Tiny random-weight FLUX.1 pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline flux`).

`write_tiny_models(outdir, size, seed)` writes a complete diffusers pipeline folder (model_index.json,
transformer/, vae/, text_encoder/ (CLIP), text_encoder_2/ (T5), tokenizer/, tokenizer_2/, scheduler/)
that `diffusers.FluxPipeline.from_pretrained(outdir)` loads and runs offline; with
`pipeline="flux_kontext"` its model_index.json names FluxKontextPipeline, which loads the same folder.

The tokenizers are built here, without a download: a byte-level BPE CLIP tokenizer (its vocabulary the
256 byte symbols, each also as a word end, the merges of a few prompt words, and the two CLIP
specials; model_max_length 77, which the text encoder's positions cover) and a Unigram T5 tokenizer
(<pad>, </s>, <unk>, characters, word pieces). Sizes:

  * ``test``: a DiT LoRA step at 32 px (4 image tokens + 512 text tokens) takes a few ms on CPU.
  * ``demo``: wider and deeper models, still seconds per epoch at 256 px.

The weights are drawn from torch's generator seeded per component, so the same seed gives bitwise the
same safetensors files. Heavy imports happen inside the functions; importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny_tokenizers import clip_tokenizer, seeded, t5_tokenizer
from . import SCHEDULER_CONFIG
from .units import CLIP_MAX_LENGTH


SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "DiT 1 double + 1 single block, 2 heads x 16; VAE /8 (8-16 ch), CLIP and T5 hidden 32 x 2 layers",
        "transformer": {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1,
                        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                        "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]},
        "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [8, 16, 16, 16],
                "layers_per_block": 1, "norm_num_groups": 4, "down_block_types": ["DownEncoderBlock2D"] * 4,
                "up_block_types": ["UpDecoderBlock2D"] * 4, "use_quant_conv": False, "use_post_quant_conv": False,
                "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "clip": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "projection_dim": 16},
        "t5": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
               "relative_attention_num_buckets": 8},
    },
    "demo": {
        "description": "DiT 2 double + 4 single blocks, 4 heads x 32; VAE /8 (32-64 ch), CLIP hidden 128, T5 d_model 128",
        "transformer": {"patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 4,
                        "attention_head_dim": 32, "num_attention_heads": 4, "joint_attention_dim": 128,
                        "pooled_projection_dim": 128, "guidance_embeds": True, "axes_dims_rope": [8, 12, 12]},
        "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [32, 64, 64, 64],
                "layers_per_block": 1, "norm_num_groups": 16, "down_block_types": ["DownEncoderBlock2D"] * 4,
                "up_block_types": ["UpDecoderBlock2D"] * 4, "use_quant_conv": False, "use_post_quant_conv": False,
                "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "clip": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "projection_dim": 64},
        "t5": {"d_model": 128, "d_kv": 32, "d_ff": 256, "num_layers": 4, "num_heads": 4,
               "relative_attention_num_buckets": 16},
    },
}

# Per-component offsets added to the seed, so each component's weights do not depend on the build order.
_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3}


def build_clip_tokenizer():
    """FLUX's tiny CLIP tokenizer (byte-level BPE, 77 tokens)."""
    return clip_tokenizer(CLIP_MAX_LENGTH)


def build_t5_tokenizer():
    """FLUX's tiny T5 tokenizer (Unigram)."""
    return t5_tokenizer()


def build_tiny_components(size: str = "test", seed: int = 0) -> dict[str, Any]:
    """The seven pipeline components in memory (keys: diffusers component names)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r} (sizes: {', '.join(SIZES)})")
    spec = SIZES[size]
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    clip_config = CLIPTextConfig(vocab_size=len(tokenizer), max_position_embeddings=CLIP_MAX_LENGTH,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, **spec["clip"])
    t5_config = T5Config(vocab_size=len(tokenizer_2), feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                         pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id, **spec["t5"])
    components = {
        "transformer": seeded(seed + _SEED_OFFSETS["transformer"], lambda: FluxTransformer2DModel(**spec["transformer"])),
        "vae": seeded(seed + _SEED_OFFSETS["vae"], lambda: AutoencoderKL(**spec["vae"])),
        "text_encoder": seeded(seed + _SEED_OFFSETS["text_encoder"], lambda: CLIPTextModel(clip_config)),
        "text_encoder_2": seeded(seed + _SEED_OFFSETS["text_encoder_2"], lambda: T5EncoderModel(t5_config)),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        components[name].eval()
    return components


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None) -> Path:
    """Write a complete random-weight FLUX.1 diffusers pipeline folder; return its path.

    `pipeline` (a name or a PipelineDef; None: flux) chooses the class model_index.json names
    (FluxPipeline, or FluxKontextPipeline for flux_kontext); the components are the same. The folder
    also holds unitgraph_tiny.json {size, seed, config}.
    """
    import diffusers

    from . import FAMILY

    class_name = FAMILY.diffusers_class(pipeline)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    components = build_tiny_components(size=size, seed=seed)
    getattr(diffusers, class_name)(**components).save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size], "pipeline_class": class_name}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

"""Tiny random-weight SDXL pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline sdxl`).

`write_tiny_models(outdir, size, seed)` writes a complete diffusers pipeline folder (model_index.json, unet/, vae/,
text_encoder/ (CLIPTextModel), text_encoder_2/ (CLIPTextModelWithProjection), tokenizer/, tokenizer_2/, scheduler/)
that `diffusers.StableDiffusionXLPipeline.from_pretrained(outdir)` loads and runs offline.

The UNet has SDXL's layout scaled down: a first level without attention, cross-attention levels after it, the
"text_time" added embedding (addition_time_embed_dim x 6 time ids + text_encoder_2's projection), cross-attention
over both encoders' widths side by side, linear projections in and out of each attention. The VAE is /8 with 4
latent channels, force_upcast and SDXL's scaling factor. The tokenizers are the byte-level BPE CLIP tokenizer built
offline (models/tiny_tokenizers.py); the second pads with "!" as SDXL's tokenizer_2 does. Sizes:

  * ``test``: a UNet LoRA step at 32 px (a 4 x 4 latent, 77 text tokens) takes a few ms on CPU.
  * ``demo``: three levels as SDXL has, wider encoders, still seconds per epoch at 256 px.

The weights are drawn from torch's generator seeded per component, so the same seed gives bitwise the same
safetensors files. Heavy imports happen inside the functions; importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny_tokenizers import clip_tokenizer, seeded
from . import SCHEDULER_CONFIG
from .units import CLIP_MAX_LENGTH, TIME_IDS

TOKENIZER_2_PAD = "!"  # SDXL's tokenizer_2 (OpenCLIP's) pads with "!", its first tokenizer with <|endoftext|>


def _unet(blocks: list[int], heads: list[int], layers: list[int], per_block: int, clip: int, clip_2: int,
          projection_2: int, time_dim: int, groups: int, sample: int) -> dict[str, Any]:
    """A UNet2DConditionModel config of SDXL's kind (its first level without attention)."""
    levels = len(blocks)
    return {"sample_size": sample, "in_channels": 4, "out_channels": 4, "block_out_channels": blocks,
            "down_block_types": ["DownBlock2D"] + ["CrossAttnDownBlock2D"] * (levels - 1),
            "up_block_types": ["CrossAttnUpBlock2D"] * (levels - 1) + ["UpBlock2D"],
            "layers_per_block": per_block, "attention_head_dim": heads, "transformer_layers_per_block": layers,
            "cross_attention_dim": clip + clip_2, "use_linear_projection": True, "addition_embed_type": "text_time",
            "addition_time_embed_dim": time_dim, "projection_class_embeddings_input_dim": time_dim * TIME_IDS + projection_2,
            "norm_num_groups": groups}


def _vae(blocks: list[int], groups: int) -> dict[str, Any]:
    return {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": blocks,
            "layers_per_block": 1, "norm_num_groups": groups, "down_block_types": ["DownEncoderBlock2D"] * len(blocks),
            "up_block_types": ["UpDecoderBlock2D"] * len(blocks), "scaling_factor": 0.13025, "force_upcast": True}


SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "UNet 8-16 ch (attention at the second level, 1 block each), VAE /8 (8-16 ch), CLIP 16 + 32 "
                       "wide x 2 layers",
        "unet": _unet([8, 16], [2, 4], [1, 1], 1, 16, 32, 16, 8, 4, 4),
        "vae": _vae([8, 16, 16, 16], 4),
        "clip": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "projection_dim": 16, "hidden_act": "quick_gelu"},
        "clip_2": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "projection_dim": 16, "hidden_act": "gelu"},
    },
    "demo": {
        "description": "UNet 32-64-128 ch (attention at the last two levels, 2 blocks each), VAE /8 (32-64 ch), "
                       "CLIP 64 + 128 wide x 4 layers",
        "unet": _unet([32, 64, 128], [2, 4, 8], [1, 1, 2], 2, 64, 128, 64, 32, 16, 32),
        "vae": _vae([32, 64, 64, 64], 16),
        "clip": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "projection_dim": 64, "hidden_act": "quick_gelu"},
        "clip_2": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "projection_dim": 64, "hidden_act": "gelu"},
    },
}

# Per-component offsets added to the seed, so each component's weights do not depend on the build order.
_SEED_OFFSETS = {"unet": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3}


def build_tokenizers() -> tuple[Any, Any]:
    """SDXL's two tiny CLIP tokenizers (77 tokens each; the second pads with "!")."""
    first, second = clip_tokenizer(CLIP_MAX_LENGTH), clip_tokenizer(CLIP_MAX_LENGTH)
    second.pad_token = TOKENIZER_2_PAD
    return first, second


def build_tiny_components(size: str = "test", seed: int = 0) -> dict[str, Any]:
    """The seven pipeline components in memory (keys: diffusers component names)."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r} (sizes: {', '.join(SIZES)})")
    spec = SIZES[size]
    tokenizer, tokenizer_2 = build_tokenizers()

    def clip_config(values: dict[str, Any], tok: Any) -> Any:
        return CLIPTextConfig(vocab_size=len(tok), max_position_embeddings=CLIP_MAX_LENGTH, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **values)

    clip, clip_2 = clip_config(spec["clip"], tokenizer), clip_config(spec["clip_2"], tokenizer_2)
    components = {
        "unet": seeded(seed + _SEED_OFFSETS["unet"], lambda: UNet2DConditionModel(**spec["unet"])),
        "vae": seeded(seed + _SEED_OFFSETS["vae"], lambda: AutoencoderKL(**spec["vae"])),
        "text_encoder": seeded(seed + _SEED_OFFSETS["text_encoder"], lambda: CLIPTextModel(clip)),
        "text_encoder_2": seeded(seed + _SEED_OFFSETS["text_encoder_2"], lambda: CLIPTextModelWithProjection(clip_2)),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "scheduler": EulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        components[name].eval()
    return components


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None) -> Path:
    """Write a complete random-weight SDXL diffusers pipeline folder; return its path.

    `pipeline` (a name or a PipelineDef; None: sdxl) chooses the class model_index.json names. The folder also holds
    unitgraph_tiny.json {size, seed, config}.
    """
    import diffusers

    from . import FAMILY

    class_name = FAMILY.diffusers_class(pipeline)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    components = build_tiny_components(size=size, seed=seed)
    pipe = getattr(diffusers, class_name)(**components, add_watermarker=False)
    pipe.save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size], "pipeline_class": class_name}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

"""Tiny random-weight Qwen-Image pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline qwen_image`).

`write_tiny_models(outdir, size, seed)` writes a complete diffusers pipeline folder
(model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/) that
`diffusers.QwenImagePipeline.from_pretrained(outdir)` loads and runs offline.

Two sizes:
  * ``test``: a DiT LoRA step at 64 px takes ~10 ms on CPU (VAE spatial factor 4, z_dim 4).
  * ``demo``: a DiT LoRA step at 256 px takes ~0.15 s (VAE spatial factor 8, z_dim 16).

The weights are drawn from torch's generator seeded per component, so the same seed gives
bitwise the same safetensors files. Heavy imports (torch, diffusers, transformers) happen
inside the functions; importing this module is cheap.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import SCHEDULER_CONFIG
from .units import PROMPT_TEMPLATE, PROMPT_TEMPLATE_DROP  # noqa: F401 - the tests check the template length

# The tokenizer below is trained so that every word of the pipeline's system template
# (diffusers' prompt_template_encode) is one token: the prefix up to "user\n" is then exactly
# PROMPT_TEMPLATE_DROP (prompt_template_encode_start_idx, 34) tokens long.

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 1024  # upper bound for the trained BPE; also the text model's vocab_size

# Qwen2's pre-tokenizer split pattern (same as transformers' Qwen2Tokenizer).
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Extra training text for the tokenizer: typical short image prompts.
_TOKENIZER_SENTENCES = (
    "a photo of a red cat sitting on a blue chair",
    "a small white dog running on green grass in the park",
    "an oil painting of a mountain lake at sunset",
    "a bowl of fresh fruit on a wooden table",
    "a city street at night with neon lights and rain",
    "a portrait of a woman with long black hair, soft light",
    "a yellow sports car parked near the beach",
    "a watercolor drawing of a bird on a branch",
    "two children playing with a ball in the snow",
    "a close-up of a flower with morning dew",
    "the text 'hello world' written on a chalkboard",
    "a cup of coffee and a book by the window",
    "a futuristic robot standing in a desert, 3d render",
    "a simple geometric pattern of circles and squares",
    "a green square on a white background",
    "a red circle in the center of a black image",
    "a dog",
    "a cat",
    "blue sky with white clouds over a field of flowers",
    "an old house in the forest, autumn leaves",
)

# Sizes. Each entry holds the constructor arguments of the three models; they are plain JSON.
SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "DiT 2 layers x 3 heads x 16, VAE /4 with z_dim 4, text hidden 16 x 2 layers",
        "transformer": {
            "patch_size": 2,
            "in_channels": 16,  # 4 * z_dim (2x2 patches)
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 3,
            "joint_attention_dim": 16,
            "guidance_embeds": False,
            "axes_dims_rope": [8, 4, 4],
        },
        "vae": {
            "base_dim": 24,
            "z_dim": 4,
            "dim_mult": [1, 2, 4],
            "num_res_blocks": 1,
            "attn_scales": [],
            "temperal_downsample": [False, True],
            "latents_mean": [0.0] * 4,
            "latents_std": [1.0] * 4,
        },
        "text": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "mrope_section": [1, 1, 2],  # sums to head_dim / 2 = 4
        },
        "vision": {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2},
    },
    "demo": {
        "description": "DiT 8 layers x 4 heads x 64, VAE /8 with z_dim 16 (narrow), text hidden 256 x 8 layers",
        "transformer": {
            "patch_size": 2,
            "in_channels": 64,
            "out_channels": 16,
            "num_layers": 8,
            "attention_head_dim": 64,
            "num_attention_heads": 4,
            "joint_attention_dim": 256,
            "guidance_embeds": False,
            "axes_dims_rope": [16, 24, 24],
        },
        "vae": {
            "base_dim": 32,
            "z_dim": 16,
            "dim_mult": [1, 2, 4, 4],
            "num_res_blocks": 1,
            "attn_scales": [],
            "temperal_downsample": [False, True, True],
            "latents_mean": [0.0] * 16,
            "latents_std": [1.0] * 16,
        },
        "text": {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "mrope_section": [8, 12, 12],  # sums to head_dim / 2 = 32
        },
        "vision": {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2},
    },
}

@dataclass(frozen=True)
class VaeGeometry:
    """Latent geometry of a Qwen-Image VAE: pixels per latent cell and latent channels."""

    scale_factor: int
    latent_channels: int


def vae_geometry(vae: Any) -> VaeGeometry:
    """Spatial downsampling factor (2**len(temperal_downsample)) and z_dim of a VAE.

    Accepts a loaded AutoencoderKLQwenImage, its config (dict-like), or a vae folder path.
    """
    if isinstance(vae, (str, os.PathLike)):
        config = json.loads((Path(vae) / "config.json").read_text(encoding="utf-8"))
    elif isinstance(vae, Mapping):
        config = vae
    else:
        config = getattr(vae, "config", None)
        if config is None:
            raise TypeError(f"not a VAE or VAE config: {type(vae).__name__}")
    try:
        return VaeGeometry(scale_factor=2 ** len(config["temperal_downsample"]), latent_channels=int(config["z_dim"]))
    except (KeyError, TypeError) as exc:
        raise TypeError(f"VAE config lacks temperal_downsample/z_dim: {exc}") from None


# Per-component offsets added to the seed, so each component's weights do not depend on
# the order in which the others are built.
_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2}


def _split_template_text(text: str) -> list[str]:
    """The template with the special tokens cut out (they are never merged by BPE)."""
    pieces = [text]
    for special in SPECIAL_TOKENS:
        pieces = [part for piece in pieces for part in piece.split(special)]
    return [p for p in pieces if p]


def build_tiny_tokenizer():
    """Train a tiny byte-level BPE offline and wrap it as a transformers Qwen2Tokenizer.

    Every word of the pipeline's system template becomes a single token, so the template's
    prefix tokenizes to exactly PROMPT_TEMPLATE_DROP tokens.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    template = PROMPT_TEMPLATE.replace("{}", "")
    corpus = _split_template_text(template) + ["assistant", "user", "system"] + list(_TOKENIZER_SENTENCES)
    bpe.train_from_iterator(corpus, trainer=trainer)

    model_state = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(model_state["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model_state["merges"]]

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    n = len(tokenizer)
    if n > TOKENIZER_VOCAB_SIZE:  # pragma: no cover - guards the constant above
        raise RuntimeError(f"tiny tokenizer has {n} tokens, more than {TOKENIZER_VOCAB_SIZE}")
    return tokenizer


def _text_encoder_config(spec: dict[str, Any], tokenizer):
    from transformers import Qwen2_5_VLConfig

    text, vision = spec["text"], spec["vision"]
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text_config = {
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"],
        "num_hidden_layers": text["num_hidden_layers"],
        "num_attention_heads": text["num_attention_heads"],
        "num_key_value_heads": text["num_key_value_heads"],
        "max_position_embeddings": 4096,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "rope_scaling": {
            "mrope_section": list(text["mrope_section"]),
            "rope_type": "default",
            "type": "default",
        },
    }
    vision_config = {
        "depth": vision["depth"],
        "hidden_size": vision["hidden_size"],
        "intermediate_size": vision["intermediate_size"],
        "num_heads": vision["num_heads"],
        "out_hidden_size": text["hidden_size"],
        "fullatt_block_indexes": [0],
    }
    return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config)


def build_tiny_components(size: str = "test", seed: int = 0) -> dict[str, Any]:
    """Build the five pipeline components in memory (keys: diffusers component names)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r}; choose one of {sorted(SIZES)}")
    spec = copy.deepcopy(SIZES[size])
    tokenizer = build_tiny_tokenizer()

    def seeded(component: str, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed) * 16 + _SEED_OFFSETS[component])
            return build()

    tf_args = dict(spec["transformer"])
    tf_args["axes_dims_rope"] = tuple(tf_args["axes_dims_rope"])
    transformer = seeded("transformer", lambda: QwenImageTransformer2DModel(**tf_args))
    vae = seeded("vae", lambda: AutoencoderKLQwenImage(**spec["vae"]))
    te_config = _text_encoder_config(spec, tokenizer)
    text_encoder = seeded("text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(te_config))
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def write_tiny_models(outdir, size: str = "test", seed: int = 0) -> Path:
    """Write a complete random-weight Qwen-Image diffusers pipeline folder; return its path.

    The folder holds model_index.json and the transformer/, vae/, text_encoder/, tokenizer/
    and scheduler/ subfolders (weights as safetensors), plus unitgraph_tiny.json {size, seed}.
    """
    from diffusers import QwenImagePipeline

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    components = build_tiny_components(size=size, seed=seed)
    pipe = QwenImagePipeline(**components)
    pipe.save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size]}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out

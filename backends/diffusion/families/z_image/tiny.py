"""Tiny random-weight Z-Image pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline z_image`).

`write_tiny_models(outdir, size, seed)` writes a complete diffusers pipeline folder (model_index.json, transformer/,
vae/, text_encoder/ (a Qwen3Model), tokenizer/, scheduler/) that `diffusers.ZImagePipeline.from_pretrained(outdir)`
loads and runs offline.

The tokenizer is trained here, without a download: a byte-level BPE over the prompt words the synthetic datasets use
(models/tiny_tokenizers.WORDS) and a few sentences, with Qwen's pre-tokenizer split, its special tokens
(<|endoftext|> pads, <|im_start|>, <|im_end|>, <think>, </think>) and a chat template that renders what Qwen3's
renders for one user turn with the generation prompt: "<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n",
plus an empty think block when thinking is disabled. Sizes:

  * ``test``: a DiT LoRA step at 32 px takes a few ms on CPU (dim 32, 1 layer and 1 refiner layer each).
  * ``demo``: a wider and deeper DiT and text encoder, still seconds per epoch at 256 px.

The weights are drawn from torch's generator seeded per component, so the same seed gives bitwise the same
safetensors files. Heavy imports happen inside the functions; importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny_tokenizers import WORDS, seeded
from . import SCHEDULER_CONFIG

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_start|>",
                  "<|vision_end|>")
VOCAB_SIZE = 512  # upper bound of the trained BPE

# Qwen2/Qwen3's pre-tokenizer split (words, single digits, punctuation runs, newlines, spaces)
_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# One user turn and the generation prompt, as Qwen3's chat template renders them (enable_thinking=False adds the
# empty think block Qwen3 adds); written for the tiny tokenizer, which has no system prompt or tool logic.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_SENTENCES = (
    "a photo of a red cat sitting on a blue chair",
    "a green square on a white background",
    "a red circle in the center of a black image",
    "an oil painting of a mountain lake at sunset",
    "user", "assistant", "system",
)

SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "DiT dim 32 (2 heads), 1 layer + 1 refiner layer each; VAE /8 (8-16 ch, 16 latent channels); "
                       "Qwen3 hidden 32 x 2 layers",
        "transformer": {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 32, "n_layers": 1,
                        "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "cap_feat_dim": 32,
                        "axes_dims": [4, 6, 6], "axes_lens": [1536, 512, 512]},
        "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [8, 16, 16, 16],
                "layers_per_block": 1, "norm_num_groups": 4, "down_block_types": ["DownEncoderBlock2D"] * 4,
                "up_block_types": ["UpDecoderBlock2D"] * 4, "use_quant_conv": False, "use_post_quant_conv": False,
                "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "head_dim": 16},
    },
    "demo": {
        "description": "DiT dim 128 (4 heads), 4 layers + 2 refiner layers each; VAE /8 (32-64 ch); "
                       "Qwen3 hidden 128 x 4 layers",
        "transformer": {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 128, "n_layers": 4,
                        "n_refiner_layers": 2, "n_heads": 4, "n_kv_heads": 4, "cap_feat_dim": 128,
                        "axes_dims": [8, 12, 12], "axes_lens": [1536, 512, 512]},
        "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [32, 64, 64, 64],
                "layers_per_block": 1, "norm_num_groups": 16, "down_block_types": ["DownEncoderBlock2D"] * 4,
                "up_block_types": ["UpDecoderBlock2D"] * 4, "use_quant_conv": False, "use_post_quant_conv": False,
                "scaling_factor": 0.3611, "shift_factor": 0.1159},
        "text": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 32},
    },
}

# z_image_omni's SigLIP2 vision encoder and processor, per size (the DiT's siglip_feat_dim is the encoder's width):
# 8 px patches, at most 16 of them (a 4 x 4 grid), so a 32 px edit image is 16 features.
SIGLIP_SIZES: dict[str, dict[str, Any]] = {
    "test": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "patch_size": 8, "num_patches": 16},
    "demo": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "patch_size": 16, "num_patches": 64},
}

# Per-component offsets added to the seed, so each component's weights do not depend on the build order.
_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2, "siglip": 3}


def build_tiny_tokenizer():
    """A Qwen2Tokenizer trained offline on the datasets' words, with Qwen's specials and CHAT_TEMPLATE."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([" ".join(WORDS), *_SENTENCES], trainer=trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=dict(state["vocab"]), merges=merges, unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_siglip(size: str, seed: int) -> tuple[Any, Any]:
    """z_image_omni's tiny SigLIP2 vision model and its image processor (normalised to [-1, 1], as the released one)."""
    from transformers import Siglip2ImageProcessor, Siglip2VisionConfig, Siglip2VisionModel

    spec = SIGLIP_SIZES[size]
    config = Siglip2VisionConfig(hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, **spec)
    model = seeded(seed * 16 + _SEED_OFFSETS["siglip"], lambda: Siglip2VisionModel(config)).eval()
    processor = Siglip2ImageProcessor(patch_size=spec["patch_size"], max_num_patches=spec["num_patches"],
                                      image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return model, processor


def build_tiny_components(size: str = "test", seed: int = 0, omni: bool = False) -> dict[str, Any]:
    """The pipeline components in memory (keys: diffusers component names); `omni` adds ZImageOmniPipeline's SigLIP2
    encoder and processor and gives the DiT its SigLIP embedder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r} (sizes: {', '.join(SIZES)})")
    spec = SIZES[size]
    transformer_args = dict(spec["transformer"])
    if omni:
        transformer_args["siglip_feat_dim"] = SIGLIP_SIZES[size]["hidden_size"]
    tokenizer = build_tiny_tokenizer()
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=1024, pad_token_id=pad_id,
                              bos_token_id=pad_id, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                              tie_word_embeddings=True, **spec["text"])
    components = {
        "transformer": seeded(seed * 16 + _SEED_OFFSETS["transformer"],
                              lambda: ZImageTransformer2DModel(**transformer_args)),
        "vae": seeded(seed * 16 + _SEED_OFFSETS["vae"], lambda: AutoencoderKL(**spec["vae"])),
        "text_encoder": seeded(seed * 16 + _SEED_OFFSETS["text_encoder"], lambda: Qwen3Model(text_config)),
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }
    if omni:
        components["siglip"], components["siglip_processor"] = build_siglip(size, seed)
    _randomise_zero_parameters(components["transformer"], seed)
    for name in ("transformer", "vae", "text_encoder"):
        components[name].eval()
    return components


def _randomise_zero_parameters(transformer: Any, seed: int) -> None:
    """ZImageTransformer2DModel starts its pad tokens at zero (the released ones are learnt): small random values,
    so that a test notices a pad token put where a real one belongs."""
    import torch

    gen = torch.Generator().manual_seed(int(seed) * 16 + 7)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if name.endswith("pad_token"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None) -> Path:
    """Write a complete random-weight Z-Image diffusers pipeline folder; return its path.

    `pipeline` (a name or a PipelineDef; None: z_image) chooses the class model_index.json names. The folder also
    holds unitgraph_tiny.json {size, seed, config}.
    """
    import diffusers

    from . import FAMILY

    class_name = FAMILY.diffusers_class(pipeline)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    components = build_tiny_components(size=size, seed=seed, omni=class_name == "ZImageOmniPipeline")
    getattr(diffusers, class_name)(**components).save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size]}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

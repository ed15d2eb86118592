"""Tiny random-weight FLUX.2 [klein] pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline flux2_klein`).

`write_tiny_models(outdir, size, seed)` writes a complete diffusers pipeline folder (model_index.json,
transformer/, vae/, text_encoder/ (Qwen3ForCausalLM), tokenizer/, scheduler/) that
`diffusers.Flux2KleinPipeline.from_pretrained(outdir)` loads and runs offline; with `pipeline="flux2"` FLUX.2-dev's
folder for `diffusers.Flux2Pipeline` (a Mistral3ForConditionalGeneration with a one-layer Pixtral vision tower, a
Mistral-style tokenizer, a DiT with a guidance embedding).

The tokenizer is trained here, without a download: a byte-level BPE over the Qwen2 split pattern, learnt from
typical prompts, wrapped as transformers' Qwen2Tokenizer with Qwen3's specials and a chat template that formats a
user turn as Qwen3's does with thinking off ("<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n<think>
\\n\\n</think>\\n\\n"), which is what the pipeline asks of it. The text encoder has 27 layers, so that the
pipeline's layers 9, 18 and 27 exist; its width stays tiny. The VAE's batch-norm running statistics are drawn
at random (a fresh BatchNorm has mean 0 and variance 1, which would leave the normalisation untested).

Sizes:
  * ``test``: a DiT LoRA step at 32 px (4 image tokens + 512 text tokens) takes a few ms on CPU.
  * ``demo``: wider and deeper models with the released VAE's 32 latent channels, seconds per epoch at 256 px.

The weights are drawn from torch's generator seeded per component, so the same seed gives bitwise the same
safetensors files. Heavy imports happen inside the functions; importing this module is cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny_tokenizers import WORDS, seeded
from . import SCHEDULER_CONFIG

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
VOCAB_SIZE = 640  # upper bound of the trained BPE; also the text model's vocab_size

# Qwen3's chat template, reduced to what the pipeline uses: plain-text turns, the generation prompt, and the empty
# thinking block `enable_thinking=False` adds.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# FLUX.2-dev's Mistral tokenizer: Mistral-Small-3.1's specials and the layout its chat template gives a system turn
# and a user turn of text parts ("<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]")
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]")
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# Qwen2's pre-tokenizer split pattern (transformers' Qwen2Tokenizer uses the same)
_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

_CORPUS = (
    "user", "assistant", "a photo of a red cat sitting on a blue chair", "a small white dog on green grass",
    "an oil painting of a mountain lake at sunset", "a green square on a white background",
    "a red circle in the center of a black image", "a yellow triangle on an orange background",
    " ".join(WORDS),
)

SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "DiT 1 double + 1 single block, 2 heads x 16; VAE /8 (8-16 ch, 8 latent channels), "
                       "Qwen3 hidden 16 x 27 layers",
        "transformer": {"patch_size": 1, "in_channels": 32, "num_layers": 1, "num_single_layers": 1,
                        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 48,
                        "timestep_guidance_channels": 32, "mlp_ratio": 3.0, "axes_dims_rope": [4, 4, 4, 4],
                        "guidance_embeds": False},
        "vae": {"block_out_channels": [8, 16, 16, 16], "latent_channels": 8, "layers_per_block": 1,
                "norm_num_groups": 4},
        "text": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 27, "num_attention_heads": 2,
                 "num_key_value_heads": 1, "head_dim": 8},
        "mistral": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 30, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 8},
        "vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "head_dim": 8, "image_size": 64, "patch_size": 8},
    },
    "demo": {
        "description": "DiT 2 double + 2 single blocks, 4 heads x 32; VAE /8 (32-64 ch, 32 latent channels), "
                       "Qwen3 hidden 64 x 27 layers",
        "transformer": {"patch_size": 1, "in_channels": 128, "num_layers": 2, "num_single_layers": 2,
                        "attention_head_dim": 32, "num_attention_heads": 4, "joint_attention_dim": 192,
                        "timestep_guidance_channels": 64, "mlp_ratio": 3.0, "axes_dims_rope": [8, 8, 8, 8],
                        "guidance_embeds": False},
        "vae": {"block_out_channels": [32, 64, 64, 64], "latent_channels": 32, "layers_per_block": 1,
                "norm_num_groups": 16},
        "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 27, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16},
        "mistral": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 30, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16},
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "head_dim": 16, "image_size": 64, "patch_size": 8},
    },
}

# Per-component offsets added to the seed, so each component's weights do not depend on the build order.
_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2}


def build_tokenizer():
    """The tiny Qwen3 tokenizer: byte-level BPE learnt from a few prompts, Qwen3's specials, the chat template."""
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
    bpe.train_from_iterator(list(_CORPUS), trainer=trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=dict(state["vocab"]), merges=merges, unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=40960)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) > VOCAB_SIZE:  # pragma: no cover - guards the constant above
        raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} tokens, more than {VOCAB_SIZE}")
    return tokenizer


def build_mistral_tokenizer():
    """FLUX.2-dev's tiny tokenizer: byte-level BPE learnt from a few prompts and the system turn, Mistral's specials,
    the chat template. A plain tokenizer, not the release's Pixtral processor (transformers builds that class only
    with torchvision); the pipeline and the unit call `apply_chat_template` on either alike, and unitgraph reads a
    processor folder's tokenizer files with AutoTokenizer, as DiffSynth does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from .units import SYSTEM_MESSAGE

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  special_tokens=list(MISTRAL_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([SYSTEM_MESSAGE, *_CORPUS], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", model_max_length=131072)
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def _mistral(spec: dict[str, Any], tokenizer: Any):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {"model_type": "mistral", "vocab_size": VOCAB_SIZE, "max_position_embeddings": 1024,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, **spec["mistral"]}
    config = Mistral3Config(text_config=text, vision_config={"model_type": "pixtral", **spec["vision"]},
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
    return Mistral3ForConditionalGeneration(config)


def _text_encoder(spec: dict[str, Any], tokenizer: Any):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=pad, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=pad, **spec["text"])
    return Qwen3ForCausalLM(config)


def _vae(spec: dict[str, Any]):
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**spec["vae"])
    channels = vae.bn.running_mean.shape[0]
    with torch.no_grad():  # drawn from the same seeded stream as the weights
        vae.bn.running_mean.copy_(torch.randn(channels) * 0.5)
        vae.bn.running_var.copy_(torch.rand(channels) * 2.0 + 0.25)
    return vae


def build_tiny_components(size: str = "test", seed: int = 0, dev: bool = False) -> dict[str, Any]:
    """The five pipeline components in memory (keys: diffusers component names): klein's, or with `dev` FLUX.2-dev's
    (the Mistral text encoder and tokenizer, a DiT with a guidance embedding and the Mistral's width)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r} (sizes: {', '.join(SIZES)})")
    spec = SIZES[size]
    transformer = dict(spec["transformer"])
    if dev:
        tokenizer = build_mistral_tokenizer()
        transformer.update(guidance_embeds=True, joint_attention_dim=3 * spec["mistral"]["hidden_size"])
        encoder = lambda: _mistral(spec, tokenizer)  # noqa: E731
    else:
        tokenizer = build_tokenizer()
        encoder = lambda: _text_encoder(spec, tokenizer)  # noqa: E731
    components = {
        "transformer": seeded(seed + _SEED_OFFSETS["transformer"], lambda: Flux2Transformer2DModel(**transformer)),
        "vae": seeded(seed + _SEED_OFFSETS["vae"], lambda: _vae(spec)),
        "text_encoder": seeded(seed + _SEED_OFFSETS["text_encoder"], encoder),
        "tokenizer": tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }
    for name in ("transformer", "vae", "text_encoder"):
        components[name].eval()
    return components


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None) -> Path:
    """Write a complete random-weight FLUX.2 diffusers pipeline folder; return its path.

    `pipeline` (a name or a PipelineDef; None: flux2_klein) chooses the folder: klein's (Flux2KleinPipeline, Qwen3)
    or FLUX.2-dev's (`flux2`: Flux2Pipeline, Mistral3). The folder also holds unitgraph_tiny.json {size, seed, config}.
    """
    import diffusers

    from . import FAMILY

    name = FAMILY.pipelines[0].name if pipeline is None else str(getattr(pipeline, "name", pipeline))
    if name not in {p.name for p in FAMILY.pipelines}:
        raise ValueError(f"unknown FLUX.2 pipeline {name!r} (pipelines: {', '.join(p.name for p in FAMILY.pipelines)})")
    class_name = FAMILY.pipeline(name).diffusers_pipeline
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    components = build_tiny_components(size=size, seed=seed, dev=class_name == "Flux2Pipeline")
    getattr(diffusers, class_name)(**components).save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size], "pipeline_class": class_name}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

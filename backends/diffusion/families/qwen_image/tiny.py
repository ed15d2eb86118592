"""Tiny random-weight Qwen-Image pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline qwen_image`).

`write_tiny_models(outdir, size, seed)` writes a complete diffusers pipeline folder
(model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/) that
`diffusers.QwenImagePipeline.from_pretrained(outdir)` loads and runs offline.

`write_tiny_models(outdir, size, seed, pipeline="qwen_image_edit")` (or `qwen_image_edit_plus`) writes
the edit pipelines' folder instead: the same components plus a processor/ subfolder (the tiny
tokenizer and a Qwen2-VL image processor with small min/max pixels), a tokenizer that also knows
the vision tokens and is trained on the edit template too (its system prefix is exactly the 64
tokens diffusers drops), and a text encoder whose config names those tokens' ids, so that its
1-layer vision tower runs on the edit image. Its model_index.json names QwenImageEditPipeline
(QwenImageEditPlusPipeline), which loads it (where transformers can build a Qwen2VLProcessor: it
needs torchvision for the processor's video part).

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
from .units import EDIT_TEMPLATE, EDIT_TEMPLATE_DROP, PROMPT_TEMPLATE, PROMPT_TEMPLATE_DROP  # noqa: F401 - the tests check the template lengths

# The tokenizer below is trained so that every word of the pipeline's system template
# (diffusers' prompt_template_encode) is one token: the prefix up to "user\n" is then exactly
# PROMPT_TEMPLATE_DROP (prompt_template_encode_start_idx, 34) tokens long.

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-VL's vision tokens, which the edit templates and the processor use (edit tokenizers only)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
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

# The edit pipelines' image processor (Qwen2VLImageProcessor), per size: the VL encoder sees the edit
# image at min_pixels..max_pixels (sides multiples of patch_size * merge_size = 28), so 56x56 gives
# 16 patches and 4 image tokens at test size. Kept out of SIZES so the text-to-image folder stays as it was.
PROCESSOR_SIZES: dict[str, dict[str, Any]] = {
    "test": {"min_pixels": 56 * 56, "max_pixels": 56 * 56, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2},
    "demo": {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2},
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


def build_tiny_tokenizer(edit: bool = False):
    """Train a tiny byte-level BPE offline and wrap it as a transformers Qwen2Tokenizer.

    Every word of the pipeline's system template becomes a single token, so the template's
    prefix tokenizes to exactly PROMPT_TEMPLATE_DROP tokens. With `edit`, the edit template is
    learnt too (its prefix is then EDIT_TEMPLATE_DROP tokens) and the vision tokens are special tokens.
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
    specials = list(SPECIAL_TOKENS) + (list(VISION_TOKENS) if edit else [])
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    template = PROMPT_TEMPLATE.replace("{}", "")
    corpus = _split_template_text(template) + ["assistant", "user", "system"] + list(_TOKENIZER_SENTENCES)
    if edit:
        corpus += _split_template_text(EDIT_TEMPLATE.replace("{}", "")) + ["Picture 1: ", "Picture 2: ", "Picture 3: "]
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
    extra = ["<|im_start|>", "<|im_end|>"] + (list(VISION_TOKENS) if edit else [])
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    n = len(tokenizer)
    if n > TOKENIZER_VOCAB_SIZE:  # pragma: no cover - guards the constant above
        raise RuntimeError(f"tiny tokenizer has {n} tokens, more than {TOKENIZER_VOCAB_SIZE}")
    return tokenizer


def _text_encoder_config(spec: dict[str, Any], tokenizer, edit: bool = False):
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
    if not edit:
        return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config)
    # the vision tokens' ids in the tiny vocabulary, so that the image features land on the image pads
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **ids)


def is_edit(pipeline: Any) -> bool:
    """Whether a pipeline's folder has a processor: its text encoder reads the edit images through one."""
    from . import FAMILY

    return any("processor" in aux for aux in FAMILY.pipeline_for(pipeline).companions.values())


def build_tiny_image_processor(size: str = "test"):
    """The edit pipelines' Qwen2-VL image processor with the size's small min/max pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # no torchvision needed

    return Qwen2VLImageProcessorPil(**PROCESSOR_SIZES[size])


def _processor_files(image_processor) -> dict[str, dict[str, Any]]:
    """preprocessor_config.json and video_preprocessor_config.json of a Qwen2VLProcessor folder.

    Written as JSON (not by Qwen2VLProcessor.save_pretrained): transformers builds that class only with
    torchvision, for the video processor, which this folder does not need to be written.
    """
    config = json.loads(image_processor.to_json_string())
    config["image_processor_type"] = "Qwen2VLImageProcessor"
    config["processor_class"] = "Qwen2VLProcessor"
    size = config.get("size") or {}
    config["min_pixels"], config["max_pixels"] = size.get("shortest_edge"), size.get("longest_edge")
    video = {k: v for k, v in config.items() if k != "image_processor_type"}
    video["video_processor_type"] = "Qwen2VLVideoProcessor"
    return {"preprocessor_config.json": config, "video_preprocessor_config.json": video}


def write_processor(folder, tokenizer, image_processor) -> Path:
    """A Qwen2VLProcessor folder: the tokenizer's files plus the image (and video) processor configs."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    for name, config in _processor_files(image_processor).items():
        (folder / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def build_tiny_components(size: str = "test", seed: int = 0, pipeline: Any = None) -> dict[str, Any]:
    """Build the five pipeline components in memory (keys: diffusers component names).

    For an edit pipeline the tokenizer and the text encoder's config are the edit ones (see the module
    docstring) and the image processor comes as `image_processor` (the folder's processor/ is it plus
    the tokenizer).
    """
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r}; choose one of {sorted(SIZES)}")
    spec = copy.deepcopy(SIZES[size])
    edit = is_edit(pipeline)
    tokenizer = build_tiny_tokenizer(edit=edit)

    def seeded(component: str, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed) * 16 + _SEED_OFFSETS[component])
            return build()

    tf_args = dict(spec["transformer"])
    tf_args["axes_dims_rope"] = tuple(tf_args["axes_dims_rope"])
    transformer = seeded("transformer", lambda: QwenImageTransformer2DModel(**tf_args))
    vae = seeded("vae", lambda: AutoencoderKLQwenImage(**spec["vae"]))
    te_config = _text_encoder_config(spec, tokenizer, edit=edit)
    text_encoder = seeded("text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(te_config))
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    for module in (transformer, vae, text_encoder):
        module.eval()
    components = {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }
    if edit:
        components["image_processor"] = build_tiny_image_processor(size)
    return components


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None) -> Path:
    """Write a complete random-weight Qwen-Image diffusers pipeline folder; return its path.

    The folder holds model_index.json and the transformer/, vae/, text_encoder/, tokenizer/
    and scheduler/ subfolders (weights as safetensors), plus unitgraph_tiny.json {size, seed}.
    `pipeline` (a name or a PipelineDef; None: qwen_image) chooses the folder: the edit pipelines'
    has a processor/ subfolder too and its model_index.json names their diffusers class.
    """
    import diffusers

    from . import FAMILY

    name = FAMILY.pipeline_for(pipeline).name
    class_name = FAMILY.diffusers_class(pipeline)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    components = build_tiny_components(size=size, seed=seed, pipeline=name)
    image_processor = components.pop("image_processor", None)
    cls = getattr(diffusers, class_name)
    if image_processor is None:
        pipe = cls(**components)
        pipe.save_pretrained(str(out), safe_serialization=True)
    else:
        from diffusers.utils import logging as diffusers_logging

        pipe = cls(processor=None, **components)
        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # "processor=None cannot be saved": it is written below
        try:
            pipe.save_pretrained(str(out), safe_serialization=True)
        finally:
            diffusers_logging.set_verbosity(level)
        write_processor(out / "processor", components["tokenizer"], image_processor)
        index_path = out / "model_index.json"
        index = json.loads(index_path.read_text(encoding="utf-8"))
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    info = {"size": size, "seed": int(seed), "config": SIZES[size]}
    if image_processor is not None:
        info.update(pipeline=name, processor=PROCESSOR_SIZES[size])
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out

"""Config-only pipeline folders: a released model's configuration files without its weights (`tiny-models --size real`).

A family's `real.py` holds the published config.json of each component of its releases; `write_config_folder`
lays them out as the release's diffusers pipeline folder (model_index.json, `<component>/config.json`,
`scheduler/scheduler_config.json`). No weights and no tokenizer files: the folder is for reading configurations
(the memory plan of `unitgraph train --dry_run`, parameter counts on the meta device), never for loading a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

CONFIG_ONLY_MARKER = "unitgraph_config_only.json"


def clip_vit_l14_text_config(torch_dtype: str, **extra: Any) -> dict[str, Any]:
    """openai/clip-vit-large-patch14's text model as its config.json is published in the releases that ship it as a
    text encoder (several families' `text_encoder/config.json`): one copy here, each release's stored dtype and
    any key of its own (`extra`) on top."""
    return {
        "architectures": ["CLIPTextModel"],
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "dropout": 0.0,
        "eos_token_id": 2,
        "hidden_act": "quick_gelu",
        "hidden_size": 768,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 77,
        "model_type": "clip_text_model",
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "pad_token_id": 1,
        "projection_dim": 768,
        "torch_dtype": torch_dtype,
        "vocab_size": 49408,
        **extra,
    }


def qwen3_4b_config() -> dict[str, Any]:
    """Qwen3-4B's config.json, the text encoder several image families' releases ship in text_encoder/."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 9728,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def autoencoder_16ch_config() -> dict[str, Any]:
    """Black Forest Labs' 16-channel AutoencoderKL as its vae/config.json is published, shipped by the releases of
    more than one family (scaling 0.3611 after a shift of 0.1159)."""
    return {
        "_class_name": "AutoencoderKL",
        "act_fn": "silu",
        "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "force_upcast": True,
        "in_channels": 3,
        "latent_channels": 16,
        "latents_mean": None,
        "latents_std": None,
        "layers_per_block": 2,
        "mid_block_add_attention": True,
        "norm_num_groups": 32,
        "out_channels": 3,
        "sample_size": 1024,
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "use_post_quant_conv": False,
        "use_quant_conv": False,
    }


def write_config_folder(outdir: Any, index: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]],
                        source: str) -> Path:
    """Write `index` as model_index.json and each `files` entry ("<subfolder>/<name>.json" -> its content) beside it,
    plus a marker naming the `source` release; returns the folder."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "model_index.json", index)
    for relative, content in files.items():
        _write(out / relative, content)
    _write(out / CONFIG_ONLY_MARKER, {"source": source, "weights": False,
                                      "note": "configuration files only: for unitgraph train --dry_run, not for loading"})
    return out


def _write(path: Path, content: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(content), indent=2, sort_keys=True) + "\n", encoding="utf-8")

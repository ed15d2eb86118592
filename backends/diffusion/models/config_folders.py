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

"""Checkpoints that diffusers loads: what was trained, under the slots' diffusers prefixes.

Keys follow diffusers' pipeline layout: `transformer.<module>.lora_A.weight` for a LoRA on the DiT,
`text_encoder.<...>` for a text encoder (each slot's `lora_prefix`). The LoRA config (rank, alpha,
targets) is kept in the safetensors header under `lora_adapter_metadata`, exactly as a diffusers
pipeline's `save_lora_weights(..., transformer_lora_adapter_metadata=...)` writes it, so its
`load_lora_weights` reproduces the trained output (alpha included). Full training of a model stores
its trainable weights under the same prefixes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from unitgraph.atomic import write_bytes_atomic

from .lora import METADATA_KEY, _jsonable, lora_state_dict


def checkpoint_state(models: Mapping[str, torch.nn.Module], lora_slot: str | None, trainable: Iterable[str],
                     prefixes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """Everything trained, under diffusers prefixes: LoRA weights of `lora_slot`, all weights of trainable models."""
    state: dict[str, torch.Tensor] = {}
    for slot in trainable:
        model = models[slot]
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_" not in name:
                state[f"{prefixes[slot]}.{name}"] = param.detach()
    if lora_slot is not None:
        for name, value in lora_state_dict(models[lora_slot]).items():
            state[f"{prefixes[lora_slot]}.{name}"] = value.detach()
    return state


def save_checkpoint(path: str | Path, state: dict[str, torch.Tensor], lora_prefix: str | None = None,
                    lora_config: Any = None, remove_prefix: str | None = None) -> Path:
    """Write a checkpoint atomically as safetensors (with diffusers' LoRA metadata when there is a LoRA)."""
    from safetensors.torch import save

    tensors = {}
    for key, value in state.items():
        if remove_prefix and key.startswith(remove_prefix):
            key = key[len(remove_prefix):]
        tensors[key] = value.detach().to("cpu").contiguous().clone()
    metadata = {"format": "pt"}
    if lora_prefix is not None and lora_config is not None:
        config = _jsonable(lora_config.to_dict())
        metadata[METADATA_KEY] = json.dumps({f"{lora_prefix}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True)
    path = Path(path)
    write_bytes_atomic(path, save(tensors, metadata=metadata))
    return path

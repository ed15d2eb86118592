"""LoRA through peft, and checkpoints that diffusers loads.

Checkpoint keys follow diffusers' pipeline layout: `transformer.<module>.lora_A.weight` for a LoRA on
the DiT, `text_encoder.<...>` for the text encoder; the LoRA config (rank, alpha, targets) is kept
in the safetensors header under `lora_adapter_metadata`, exactly as
`QwenImagePipeline.save_lora_weights(..., transformer_lora_adapter_metadata=...)` writes it, so
`QwenImagePipeline.load_lora_weights` reproduces the trained output (alpha included). Full training
of a model stores its trainable weights under the same prefixes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch

from unitgraph.atomic import write_bytes_atomic

from .args import BackendError
from .randomness import seeded_global_stream

# The diffusers pipeline attribute each slot is stored under (checkpoint key prefixes).
PREFIX = {"dit": "transformer", "text_encoder": "text_encoder", "vae": "vae"}
METADATA_KEY = "lora_adapter_metadata"
ADAPTER = "default"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(_jsonable(v) for v in value) if isinstance(value, (set, frozenset)) else [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(getattr(value, "value", value))


def add_lora(model: torch.nn.Module, slot: str, targets: list[str], rank: int, alpha: float | None, seed: int):
    """Attach a trainable LoRA adapter; its initialisation draws from a generator derived from --seed."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=list(targets),
                        lora_dropout=0.0, init_lora_weights=True)
    with seeded_global_stream(seed, "lora_init", slot):
        try:
            model.add_adapter(config)
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendError(f"--lora_target_modules {','.join(targets)}: no such modules in {slot} ({first})") from None
    return config


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


def load_lora_checkpoint(model: torch.nn.Module, slot: str, path: str | Path) -> None:
    """Load LoRA weights saved by `save_checkpoint` (or diffusers) into the adapter of `model`.

    The checkpoint must fit the adapter exactly: every LoRA weight of the checkpoint names a LoRA
    module of `model` with the same shape, and every LoRA module gets a weight. Anything else is
    a BackendError naming the file (a checkpoint whose keys match no module would otherwise load
    nothing and train from scratch without a word).
    """
    from peft.utils import set_peft_model_state_dict

    state = read_safetensors(path)
    prefix = PREFIX[slot] + "."
    picked = {}
    for key, value in state.items():
        if "lora_A" not in key and "lora_B" not in key:
            continue
        if key.startswith(prefix):
            picked[key[len(prefix):]] = value
        elif not any(key.startswith(p + ".") for p in PREFIX.values()):
            picked[key] = value  # saved with --remove_prefix_in_ckpt
    if not picked:
        raise BackendError(f"no LoRA weights for {slot} in the checkpoint", source=str(path))
    expected = {k: v.shape for k, v in lora_state_dict(model).items()}
    matched = [k for k in picked if k in expected]
    if not matched:
        raise BackendError(f"none of the checkpoint's {len(picked)} LoRA weights matches a LoRA module of {slot} "
                           f"(e.g. {next(iter(picked))}); check --lora_target_modules and --lora_base_model", source=str(path))
    unexpected = [k for k in picked if k not in expected]
    if unexpected:
        raise BackendError(f"LoRA checkpoint does not fit {slot} (e.g. {unexpected[0]}); check --lora_target_modules/--lora_rank",
                           source=str(path))
    for key in matched:
        if tuple(picked[key].shape) != tuple(expected[key]):
            raise BackendError(f"LoRA checkpoint does not fit {slot}: {key} has shape {list(picked[key].shape)}, the adapter "
                               f"{list(expected[key])}; check --lora_rank", source=str(path))
    missing = sorted(set(expected) - set(picked))
    if missing:
        raise BackendError(f"LoRA checkpoint has no weights for {len(missing)} of the {len(expected)} LoRA weights of {slot} "
                           f"(e.g. {missing[0]}); use the --lora_target_modules it was trained with", source=str(path))
    result = set_peft_model_state_dict(model, picked, adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise BackendError(f"LoRA checkpoint does not fit {slot} (e.g. {unexpected[0]}); check --lora_target_modules/--lora_rank",
                           source=str(path))


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise BackendError("no such file", source=str(path))
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise BackendError(f"not a safetensors file: {exc}", source=str(path)) from None


def _lora_metadata(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    raw = meta.get(METADATA_KEY)
    return json.loads(raw) if raw else {}


def merge_preset_lora(model: torch.nn.Module, slot: str, path: str | Path) -> int:
    """Add a LoRA's delta (scale * B @ A) into the base weights of `model`; returns the modules changed.

    Reads keys with or without the slot prefix; alpha from the adapter metadata or `.alpha` keys
    (default: alpha = rank, i.e. scale 1).
    """
    path = Path(path)
    state = read_safetensors(path)
    meta = _lora_metadata(path)
    prefix = PREFIX[slot] + "."
    modules = dict(model.named_modules())
    changed = 0
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[: -len(".lora_A.weight")]
        b = state.get(name + ".lora_B.weight")
        if b is None:
            continue
        module_name = name[len(prefix):] if name.startswith(prefix) else name
        module = modules.get(module_name)
        if module is None or not hasattr(module, "weight"):
            continue
        rank = a.shape[0]
        alpha = state.get(name + ".alpha")
        if alpha is not None:
            alpha = float(alpha)
        else:
            alpha = float(meta.get(f"{PREFIX[slot]}.lora_alpha", meta.get("lora_alpha", rank)))
            rank_meta = meta.get(f"{PREFIX[slot]}.r", meta.get("r", rank))
            rank = int(rank_meta) if isinstance(rank_meta, (int, float)) else rank
        with torch.no_grad():
            delta = (b.float() @ a.float()) * (alpha / rank)
            module.weight.add_(delta.to(module.weight.dtype).view_as(module.weight))
        changed += 1
    if changed == 0:
        raise BackendError(f"preset LoRA changes no module of {slot}", source=str(path))
    return changed


def checkpoint_state(models: dict[str, torch.nn.Module], lora_slot: str | None, trainable: Iterable[str]) -> dict[str, torch.Tensor]:
    """Everything trained, under diffusers prefixes: LoRA weights of `lora_slot`, all weights of trainable models."""
    state: dict[str, torch.Tensor] = {}
    for slot in trainable:
        model = models[slot]
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_" not in name:
                state[f"{PREFIX[slot]}.{name}"] = param.detach()
    if lora_slot is not None:
        for name, value in lora_state_dict(models[lora_slot]).items():
            state[f"{PREFIX[lora_slot]}.{name}"] = value.detach()
    return state


def save_checkpoint(path: str | Path, state: dict[str, torch.Tensor], lora_slot: str | None = None,
                    lora_config: Any = None, remove_prefix: str | None = None) -> Path:
    """Write a checkpoint atomically as safetensors (with diffusers' LoRA metadata when there is a LoRA)."""
    from safetensors.torch import save

    tensors = {}
    for key, value in state.items():
        if remove_prefix and key.startswith(remove_prefix):
            key = key[len(remove_prefix):]
        tensors[key] = value.detach().to("cpu").contiguous().clone()
    metadata = {"format": "pt"}
    if lora_slot is not None and lora_config is not None:
        config = _jsonable(lora_config.to_dict())
        metadata[METADATA_KEY] = json.dumps({f"{PREFIX[lora_slot]}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True)
    path = Path(path)
    write_bytes_atomic(path, save(tensors, metadata=metadata))
    return path

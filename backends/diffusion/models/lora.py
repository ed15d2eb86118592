"""LoRA adapters through peft, on any torch module (a diffusers DiT, a transformers text encoder).

Adapters are injected with peft's own `inject_adapter_in_model`, not through the model library's
`add_adapter` wrapper: transformers 5's wrapper refuses the peft version on the registry, while the
injection itself works for every torch module. Checkpoint keys carry the slot's diffusers pipeline
prefix (`transformer.` for the DiT, see `family.ModelSlot.lora_prefix`); `train/checkpoints.py` writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import BackendError
from ..randomness import seeded_global_stream

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
    """Attach a trainable LoRA adapter (only its weights trainable); the init draws from a stream derived from --seed.

    Target names that match no module of `model` are reported as such; any other refusal by peft is
    reported with peft's own words (it is not a matter of module names then).
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=list(targets),
                        lora_dropout=0.0, init_lora_weights=True)
    with seeded_global_stream(seed, "lora_init", slot):
        try:
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "not found in the base model" in first or type(exc).__name__ == "NoMatchingPeftModuleError":
                raise BackendError(f"--lora_target_modules {','.join(targets)}: no such modules in {slot}") from None
            raise BackendError(f"peft cannot add a LoRA adapter to {slot}: {first}") from None
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return config


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


DIFFSYNTH_ROOT = "pipe"  # DiffSynth's keys start with its pipeline's attribute path, e.g. "pipe.dit."
_LORA_PARTS = (".lora_A.", ".lora_B.")


def layout_of(state: Mapping[str, Any]) -> str:
    """'diffsynth' when the LoRA keys carry peft's adapter name or DiffSynth's `pipe.` root, else 'diffusers'."""
    lora = [k for k in state if any(part in k for part in _LORA_PARTS)]
    if any(".default." in k or k.startswith(f"{DIFFSYNTH_ROOT}.") for k in lora):
        return "diffsynth"
    return "diffusers"


def module_lora(state: Mapping[str, torch.Tensor], slot: str, prefixes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The LoRA weights of `slot` in a file of either layout (train/checkpoints.py), keyed `<module>.lora_A.weight` /
    `<module>.lora_B.weight`: the slot's prefix (`transformer.`, `pipe.dit.`, `diffusion_model.`) and peft's
    adapter name (`.default`) taken off; other models' weights left out; keys saved without any prefix
    (--remove_prefix_in_ckpt) taken as they are."""
    own = prefixes.get(slot, slot)
    others = [p for s, p in prefixes.items() if s != slot]
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not any(part in key for part in _LORA_PARTS):
            continue
        name = key
        for head in (f"{DIFFSYNTH_ROOT}.{slot}.", f"{own}.", "diffusion_model."):
            if name.startswith(head):
                name = name[len(head):]
                break
        else:
            if name.startswith(f"{DIFFSYNTH_ROOT}.") or any(name.startswith(f"{p}.") for p in others):
                continue  # another model's weights
        out[name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = value
    return out


def load_lora_checkpoint(model: torch.nn.Module, slot: str, path: str | Path, prefixes: Mapping[str, str]) -> None:
    """Load LoRA weights of `slot` from a checkpoint of either layout into the adapter of `model`.

    The checkpoint must fit the adapter exactly: every LoRA weight of the checkpoint names a LoRA
    module of `model` with the same shape, and every LoRA module gets a weight. Anything else is
    a BackendError naming the file (a checkpoint whose keys match no module would otherwise load
    nothing and train from scratch without a word). The file's own scale (alpha / rank from a
    diffusers file's metadata; 1 for a DiffSynth-layout file, which folds it into lora_A) is carried
    over into the adapter's scale, so the adapter computes what the file means.
    """
    from peft.utils import set_peft_model_state_dict

    config = model.peft_config[ADAPTER]
    scale = float(config.lora_alpha) / float(config.r)
    state = read_safetensors(path)
    picked = module_lora(state, slot, prefixes)
    file_scale = 1.0
    if layout_of(state) == "diffusers":
        meta = _lora_metadata(Path(path))
        own = prefixes.get(slot, slot)
        rank = meta.get(f"{own}.r", meta.get("r"))
        alpha = meta.get(f"{own}.lora_alpha", meta.get("lora_alpha"))
        if isinstance(rank, (int, float)) and isinstance(alpha, (int, float)) and rank > 0:
            file_scale = float(alpha) / float(rank)
    if file_scale != scale:
        picked = {k: v * (file_scale / scale) if ".lora_A." in k else v for k, v in picked.items()}
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
    try:
        value = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        raise BackendError(f"the {METADATA_KEY} in the file's header is not JSON", source=str(path)) from None
    if not isinstance(value, dict):
        raise BackendError(f"the {METADATA_KEY} in the file's header is not a JSON object", source=str(path))
    return value


def _preset_scale(state: dict[str, Any], meta: dict[str, Any], name: str, prefix: str, rank: int) -> float:
    """alpha / rank of one preset LoRA module: a `.alpha` key, else the adapter metadata, else 1."""
    alpha = state.get(name + ".alpha")
    if alpha is not None:
        return float(alpha) / rank
    value = float(meta.get(f"{prefix}.lora_alpha", meta.get("lora_alpha", rank)))
    rank_meta = meta.get(f"{prefix}.r", meta.get("r", rank))
    rank = int(rank_meta) if isinstance(rank_meta, (int, float)) and not isinstance(rank_meta, bool) else rank
    if not (value == value and abs(value) != float("inf")) or rank <= 0:
        raise ValueError(f"alpha {value} over rank {rank}")
    return value / rank


def merge_preset_lora(model: torch.nn.Module, slot: str, path: str | Path, prefix: str) -> int:
    """Add a LoRA's delta (scale * B @ A) into the base weights of `model`; returns the modules changed.

    Reads keys with or without the slot prefix; alpha from the adapter metadata or `.alpha` keys
    (default: alpha = rank, i.e. scale 1).
    """
    path = Path(path)
    state = read_safetensors(path)
    meta = _lora_metadata(path)
    key_prefix = prefix + "."
    modules = dict(model.named_modules())
    changed = 0
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[: -len(".lora_A.weight")]
        b = state.get(name + ".lora_B.weight")
        if b is None:
            continue
        module_name = name[len(key_prefix):] if name.startswith(key_prefix) else name
        module = modules.get(module_name)
        if module is None or not hasattr(module, "weight"):
            continue
        try:
            scale = _preset_scale(state, meta, name, prefix, int(a.shape[0]))
            with torch.no_grad():
                delta = (b.float() @ a.float()) * scale
                module.weight.add_(delta.to(module.weight.dtype).view_as(module.weight))
        except (ValueError, TypeError, RuntimeError, ZeroDivisionError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendError(f"preset LoRA weight {name} does not fit {slot} ({first})", source=str(path)) from None
        changed += 1
    if changed == 0:
        raise BackendError(f"preset LoRA changes no module of {slot}", source=str(path))
    return changed

"""Checkpoints in the two layouts users load: diffusers' and DiffSynth-Studio's.

**diffusers** (the default): keys follow a diffusers pipeline's attributes, `transformer.<module>.lora_A.weight`
for a LoRA on the DiT, `text_encoder.<...>` for a text encoder (each slot's `lora_prefix`). The LoRA
config (rank, alpha, targets) is kept in the safetensors header under `lora_adapter_metadata`,
exactly as a diffusers pipeline's `save_lora_weights(..., transformer_lora_adapter_metadata=...)`
writes it, so its `load_lora_weights` reproduces the trained output (alpha included).

**diffsynth**: the layout DiffSynth-Studio's training writes and its `pipe.load_lora(pipe.dit, path)`
fuses: `pipe.<slot>.<module>.lora_A.default.weight`, where `<module>` is the model's own module
name, so DiffSynth's `--remove_prefix_in_ckpt "pipe.dit."` leaves exactly the names its loader
matches. DiffSynth files carry no alpha (its loader fuses `B @ A`, and treats an `alpha` key as a
foreign file), so the LoRA scale `alpha / rank` is folded into `lora_A`: both layouts give the same
`scale * B @ A`. Full training of a model stores its trainable weights under the same prefixes.

`convert` turns one layout into the other (`unitgraph lora convert`), reading either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch

from unitgraph.atomic import remove_stale_temps, write_bytes_atomic

from ..errors import BackendError
from ..models.lora import DIFFSYNTH_ROOT, METADATA_KEY, jsonable, lora_state_dict, read_lora_file


def checkpoint_state(models: Mapping[str, torch.nn.Module], lora_slot: str | None, trainable: Iterable[str],
                     prefixes: Mapping[str, str],
                     tensors: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None) -> dict[str, torch.Tensor]:
    """Everything trained, under diffusers prefixes: LoRA weights of `lora_slot`, all weights of trainable models.

    `tensors` ({slot: {parameter name: whole tensor}}) gives the trained parameters already gathered, as a sharded
    engine gives them (train/engines.py); without it they are read from the models."""
    state: dict[str, torch.Tensor] = {}

    def trained(slot: str) -> Mapping[str, torch.Tensor]:
        if tensors is not None:
            return tensors[slot]
        return {name: p for name, p in models[slot].named_parameters() if p.requires_grad}

    for slot in trainable:
        for name, param in trained(slot).items():
            if "lora_" not in name:
                state[f"{prefixes[slot]}.{name}"] = param.detach()
    if lora_slot is not None:
        given = dict(trained(lora_slot)) if tensors is not None else None
        for name, value in lora_state_dict(models[lora_slot], given).items():
            state[f"{prefixes[lora_slot]}.{name}"] = value.detach()
    return state


def lora_scale(config: Any) -> float:
    """alpha / rank of a peft LoraConfig (or of its dict)."""
    data = config if isinstance(config, Mapping) else config.to_dict()
    rank = float(data.get("r") or 1)
    return float(data.get("lora_alpha") if data.get("lora_alpha") is not None else rank) / rank


def folded(state: Mapping[str, torch.Tensor], factors: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """`state` with each tensor named in `factors` multiplied by its factor (a LoRA scale folded into lora_A): computed
    in float32, and kept in the tensors' own dtype only where every result fits it. An fp16 lora_A times a large
    alpha / rank overflows fp16 (a file of inf, which the reader refuses): then the whole file is float32, the wider
    dtype, so each pair still multiplies in one dtype."""
    out = {k: (v.float() * float(factors[k]) if k in factors else v) for k, v in state.items()}
    fits = all(v.dtype == torch.float32 or not v.is_floating_point() or bool(torch.isfinite(out[k].to(v.dtype)).all())
               for k, v in state.items() if k in factors)
    if fits:
        return {k: (out[k].to(state[k].dtype) if k in factors else v) for k, v in state.items()}
    return {k: (v.float() if v.is_floating_point() else v) for k, v in out.items()}


def to_diffsynth(state: Mapping[str, torch.Tensor], prefixes: Mapping[str, str], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """diffusers-layout keys -> DiffSynth's: `pipe.<slot>.<module>.lora_A.default.weight`, the scale folded into A."""
    by_prefix = {prefix: slot for slot, prefix in prefixes.items()}
    out: dict[str, torch.Tensor] = {}
    factors: dict[str, float] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        slot = by_prefix.get(head)
        if slot is None:
            raise BackendError(f"checkpoint key {key!r} belongs to no model of the family (prefixes: "
                               f"{', '.join(sorted(by_prefix))})")
        if ".lora_A." in rest or ".lora_B." in rest:
            rest = rest.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
            if ".lora_A." in rest and scale != 1.0:
                factors[f"{DIFFSYNTH_ROOT}.{slot}.{rest}"] = scale
        out[f"{DIFFSYNTH_ROOT}.{slot}.{rest}"] = value
    return folded(out, factors)


def diffusers_remove_prefix(remove_prefix: Optional[str], prefixes: Mapping[str, str], full: Iterable[str],
                            layout: str) -> Optional[str]:
    """The prefix --remove_prefix_in_ckpt strips from a checkpoint's keys. DiffSynth's `"pipe.<model>."` names a
    model by DiffSynth's attribute; in the diffusers layout a model trained in full is written under its pipeline
    attribute (`transformer.<module>`), so the flag strips that (`transformer.`), and the file holds the model's
    own module names, which DiffSynth's validate_full scripts load into `pipe.<model>`. Otherwise it is the flag's
    prefix as given.

    >>> diffusers_remove_prefix("pipe.dit.", {"dit": "transformer"}, ["dit"], "diffusers")
    'transformer.'
    >>> diffusers_remove_prefix("pipe.dit.", {"dit": "transformer"}, [], "diffusers")
    'pipe.dit.'
    """
    if layout == "diffusers" and remove_prefix:
        for slot in full:
            if remove_prefix == f"{DIFFSYNTH_ROOT}.{slot}." and slot in prefixes:
                return f"{prefixes[slot]}."
    return remove_prefix


def save_checkpoint(path: str | Path, state: dict[str, torch.Tensor], lora_prefix: str | None = None,
                    lora_config: Any = None, remove_prefix: str | None = None, layout: str = "diffusers",
                    prefixes: Optional[Mapping[str, str]] = None) -> Path:
    """Write a checkpoint atomically as safetensors, in `layout` (diffusers' LoRA metadata for a diffusers LoRA)."""
    from safetensors.torch import save

    metadata = {"format": "pt"}
    if layout == "diffsynth":
        scale = lora_scale(lora_config) if lora_config is not None else 1.0
        state = to_diffsynth(state, prefixes or {}, scale)
    elif lora_prefix is not None and lora_config is not None:
        config = jsonable(lora_config.to_dict())
        metadata[METADATA_KEY] = json.dumps({f"{lora_prefix}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True)
    tensors = {}
    for key, value in state.items():
        if remove_prefix and key.startswith(remove_prefix):
            key = key[len(remove_prefix):]
        tensors[key] = value.detach().to("cpu").contiguous().clone()
    path = Path(path)
    write_bytes_atomic(path, save(tensors, metadata=metadata))
    return path


# ------------------------------------------------------------------------------------------------
# reading either layout, converting


def convert(src: str | Path, dst: str | Path, to: str, slot: str, prefixes: Mapping[str, str],
            remove_prefix: Optional[str] = None) -> tuple[str, int]:
    """Convert the LoRA of `slot` in `src` to layout `to` (diffusers or diffsynth) in `dst`; (source layout, tensors).

    `src` is read by models/lora.read_lora_file, the reader of --lora_checkpoint too (the whole file checked:
    see there); a converted file holds whole pairs of one rank, each module's scale as the source means it.
    """
    if to not in ("diffusers", "diffsynth"):
        raise BackendError(f"--to must be diffusers or diffsynth, got {to!r}")
    remove_stale_temps(dst)  # what a killed convert into `dst` left (its own temporary name only)
    lora = read_lora_file(src, slot, prefixes)
    if lora.unpaired:
        raise BackendError(f"the LoRA of {lora.unpaired[0]} ({slot}) has only one of lora_A and lora_B",
                           source=str(src))
    ranks = set(lora.ranks.values())
    if len(ranks) != 1:
        raise BackendError(f"the LoRA of {slot} has several ranks ({sorted(ranks)}); only one rank per file is supported",
                           source=str(src))
    rank = ranks.pop()
    prefix = prefixes[slot]
    alpha = lora.alpha if lora.alpha is not None else float(rank)
    common = alpha / rank
    factors = {}
    for key in lora.weights:
        module = key.rsplit(".lora_", 1)[0]
        if ".lora_A." in key and lora.scales[module] != common:  # a module of its own alpha: folded into its lora_A
            factors[key] = lora.scales[module] / common
    weights = folded(lora.weights, factors)  # and the common scale, into DiffSynth's lora_A, by save_checkpoint
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in weights})
    diffusers_state = {f"{prefix}.{k}": v for k, v in weights.items()}
    if to == "diffsynth":
        save_checkpoint(dst, diffusers_state, layout="diffsynth", prefixes={slot: prefix},
                        lora_config={"r": rank, "lora_alpha": alpha}, remove_prefix=remove_prefix)
    else:
        config = _ConfigDict({"r": rank, "lora_alpha": alpha, "target_modules": targets})
        save_checkpoint(dst, diffusers_state, prefix, config, remove_prefix=remove_prefix)
    return lora.layout, len(weights)


class _ConfigDict(dict):
    """A LoRA config as save_checkpoint reads one (`to_dict()`)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self)

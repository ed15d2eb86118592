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

**comfyui** (`--lora_format comfyui`, the denoiser's LoRA): the keys ComfyUI's own LoRA writer and its generic
reader use, `diffusion_model.<module>.lora_up.weight` / `.lora_down.weight` and `.alpha`, where `<module>` is the
release checkpoint's name of the module, as ComfyUI's model classes name it (the family's `ModelSlot.comfyui`,
models/release_names.py). A release module that computes several diffusers modules at once (q, k and v in one
matmul) gets one LoRA: lora_down the parts' lora_A stacked, lora_up each part's lora_B in its own rows and rank
columns, so lora_up @ lora_down is the parts' deltas stacked, exactly (rank: the parts' sum; the header records
the blocks, `COMFYUI_BLOCKS`, so unitgraph reads each part back as it was). ComfyUI scales by alpha / rank: each
module's alpha is written as its scale times its rank. `to_comfyui`.

`convert` turns one layout into another (`unitgraph lora convert`), reading any.

**LyCORIS** (a LoKr or LoHa, `--lora_type lokr|loha`): neither layout above can hold one (both hold lora_A/lora_B
pairs, and neither a Kronecker nor a Hadamard product is one), so it is written as LyCORIS' readers load it
(lycoris-lora, ComfyUI): `<LyCORIS prefix>_<module, dots as underscores>.<part>`, the prefix
`models/lora.lycoris_prefix`'s (`lycoris` for a transformer denoiser, `lora_unet` for a UNet, `lora_te` for a text
encoder), each module with its `.alpha`; `to_lycoris`. Such a file is no LoRA to convert: `convert` says so in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch

from unitgraph.atomic import remove_stale_temps, write_bytes_atomic

from ..errors import BackendError
from ..models.lora import (COMFYUI_BLOCKS, COMFYUI_STRUCTURE, DENOISER_ROOT, DIFFSYNTH_ROOT, KIND_TITLES,
                           LYCORIS_KINDS, LYCORIS_PARTS, METADATA_KEY, adapter_scale, comfyui_names, config_kind,
                           jsonable, lora_state_dict, lycoris_kind, lycoris_prefix, read_lora_file)

LAYOUTS = ("diffusers", "diffsynth", "comfyui")


class CheckpointState(dict):
    """What trains, by checkpoint key (a plain dict), with each trained model's config (`configs`: what a layout of
    release names may depend on, a UNet's layers per block)."""

    def __init__(self, state: Mapping[str, torch.Tensor], configs: Optional[Mapping[str, Any]] = None):
        super().__init__(state)
        self.configs = dict(configs or {})


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
    configs = {s: dict(c) for s in [*trainable, *([lora_slot] if lora_slot else [])]
               if isinstance(c := getattr(models[s], "config", None), Mapping)}
    return CheckpointState(state, configs)


def lora_scale(config: Any) -> float:
    """alpha / rank of a peft LoraConfig (or of its dict); alpha / sqrt(rank) for a rank-stabilised one."""
    return adapter_scale(config if isinstance(config, Mapping) else config.to_dict())


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


def stack_fused(fused: Any, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scales: Mapping[str, float],
                source: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, float, list[list[Any]]]:
    """One release module's LoRA from its diffusers parts' (`pairs`: {part: (lora_A [r, in], lora_B [out, r])}, each
    scaled by `scales[part]`): (lora_down [R, in], lora_up [rows, R], alpha, the blocks [[part, rank], ...]) with
    alpha / R * lora_up @ lora_down equal to the parts' scaled deltas stacked in the module's rows (a part without a
    LoRA: zero rows). Every part's scale is the first's, or its ratio is folded into its lora_A."""
    present = [(p, n) for p, n in fused.parts if p in pairs]
    units = {pairs[p][1].shape[0] // n for p, n in present if pairs[p][1].shape[0] % n == 0}
    widths = {pairs[p][0].shape[1] for p, _ in present}
    if len(units) != 1 or len(widths) != 1 or any(pairs[p][1].shape[0] % n for p, n in present):
        shown = ", ".join(f"{p} {list(pairs[p][1].shape[:1]) + list(pairs[p][0].shape[1:])}" for p, _ in present)
        raise BackendError(f"the LoRA modules {shown} do not fit {fused.release} of the release checkpoint (its parts "
                           f"{', '.join(f'{p} x{n}' for p, n in fused.parts)} share one input and one row width)",
                           source=source)
    unit = units.pop()
    first = scales[present[0][0]]
    if len(fused.parts) == 1 and not fused.swap_halves:
        (a, b), = (pairs[p] for p, _ in present)
        return a, b, first * a.shape[0], [[present[0][0], a.shape[0]]]
    rank = sum(pairs[p][0].shape[0] for p, _ in present)
    kind = pairs[present[0][0]][1]
    up = torch.zeros(unit * sum(n for _, n in fused.parts), rank, dtype=kind.dtype, device=kind.device)
    downs, blocks, row, col = [], [], 0, 0
    for part, n in fused.parts:
        if part in pairs:
            a, b = pairs[part]
            if scales[part] != first:
                a = folded({"a": a}, {"a": scales[part] / first})["a"]
            downs.append(a)
            up[row:row + unit * n, col:col + a.shape[0]] = b
            blocks.append([part, a.shape[0]])
            col += a.shape[0]
        else:
            blocks.append([part, 0])
        row += unit * n
    if fused.swap_halves:
        up = up.roll(up.shape[0] // 2, dims=0)
    dtype = downs[0].dtype
    for d in downs[1:]:
        dtype = torch.promote_types(dtype, d.dtype)
    return torch.cat([d.to(dtype) for d in downs]), up, first * rank, blocks


def comfyui_state(pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scales: Mapping[str, float], names: Any,
                  source: Optional[str] = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA in diffusers' module names ({module: (lora_A, lora_B)}, each scaled by `scales[module]`) in ComfyUI's
    layout by the release `names`: its tensors and the blocks of each fused module (for the header)."""
    groups: dict[str, Any] = {}
    for module in pairs:
        fused = names.release(module)
        if fused is None:
            raise BackendError(f"the LoRA module {module} has no module in the release checkpoint ComfyUI loads "
                               "(ComfyUI's layout names modules as the release does); leave it out of "
                               "--lora_target_modules or write --lora_format diffusers", source=source)
        groups.setdefault(fused.release, fused)
    out: dict[str, torch.Tensor] = {}
    fused_blocks: dict[str, Any] = {}
    for release, fused in sorted(groups.items()):
        mine = {p: pairs[p] for p, _ in fused.parts if p in pairs}
        down, up, alpha, blocks = stack_fused(fused, mine, scales, source)
        head = f"{DENOISER_ROOT}.{release}"
        out[f"{head}.lora_down.weight"], out[f"{head}.lora_up.weight"] = down, up
        out[f"{head}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
        if len(fused.parts) > 1:
            fused_blocks[release] = blocks
    return out, fused_blocks


def to_comfyui(state: Mapping[str, torch.Tensor], lora_prefix: str, config: Any, prefixes: Mapping[str, str],
               structure: Optional[Mapping[str, Any]] = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """peft's LoRA under diffusers prefixes (`<prefix>.<module>.lora_A.weight`, as checkpoint_state gives them) ->
    ComfyUI's layout (`comfyui_state`), scaled by the adapter's alpha / rank (or / sqrt(rank)): the same delta
    ComfyUI computes; and the file's header (`comfyui_metadata`). Only the denoiser has release names here; tensors
    of models trained in full beside the adapter keep their diffusers keys. `structure`: the adapter's model's config."""
    slot = next((s for s, p in prefixes.items() if p == lora_prefix), lora_prefix)
    head = f"{lora_prefix}."
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        rest = key[len(head):] if key.startswith(head) else None
        if rest is not None and (rest.endswith(".lora_A.weight") or rest.endswith(".lora_B.weight")):
            pairs.setdefault(rest[:-len(".lora_A.weight")], {})[rest[-len("A.weight"):-len(".weight")]] = value
        elif rest is not None and rest.endswith(".lora_magnitude_vector"):  # pragma: no cover - args.py refuses first
            raise BackendError("--lora_format comfyui cannot hold a DoRA (ComfyUI's dora_scale is another convention)")
        else:
            out[key] = value
    names = comfyui_names(prefixes, slot, structure, tuple(pairs))
    if names is None:
        raise BackendError(f"--lora_format comfyui: {slot} has no release module names here (ComfyUI's layout is the "
                           "denoiser's); write --lora_format diffusers")
    scale = lora_scale(config)
    tensors, blocks = comfyui_state({m: (h["A"], h["B"]) for m, h in pairs.items()}, {m: scale for m in pairs}, names)
    out.update(tensors)
    return out, comfyui_metadata(blocks, names)


def comfyui_metadata(blocks: Mapping[str, Any], names: Any) -> dict[str, str]:
    """The header of a ComfyUI-layout file, for unitgraph's reader (ComfyUI reads the tensors alone): how each fused
    module was stacked, and what the release names depended on."""
    out = {COMFYUI_BLOCKS: json.dumps(dict(blocks), sort_keys=True)} if blocks else {}
    structure = names.structure()
    return {**out, **({COMFYUI_STRUCTURE: json.dumps(structure, sort_keys=True)} if structure else {})}


def to_lycoris(state: Mapping[str, torch.Tensor], lora_prefix: str, config: Any,
               prefixes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """peft's LoKr / LoHa under diffusers prefixes (`<prefix>.<module>.lokr_w1`, as checkpoint_state gives them) ->
    LyCORIS' layout: `<LyCORIS prefix>_<module, dots as underscores>.<part>` and each module's `.alpha` (0-d float32).

    The file means what peft computes. LyCORIS' readers scale a module's product by alpha / rank where it has a
    rank-decomposed factor (a LoHa always; a LoKr whose lokr_w2 is lokr_w2_a @ lokr_w2_b), peft's own rule alpha /
    rank then; a LoKr of two whole factors they scale by 1 whatever its alpha, so there peft's alpha / rank is folded
    into lokr_w1 (the product is linear in it) and its alpha written is the rank, as LyCORIS writes it. Other tensors
    (a model trained in full beside the adapter) keep their diffusers keys."""
    lyco = lycoris_prefix(lora_prefix, prefixes)
    rank, alpha = int(config.r), float(config.alpha)
    head = f"{lora_prefix}."
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, _, part = key[len(head):].rpartition(".")
        if key.startswith(head) and part in LYCORIS_PARTS:
            modules.setdefault(module, {})[part] = value
        else:
            out[key] = value
    spelled: dict[str, str] = {}
    for module, parts in sorted(modules.items()):
        name = f"{lyco}_{module.replace('.', '_')}"
        if spelled.setdefault(name, module) != module:
            raise BackendError(f"{spelled[name]} and {module} are both {name} in LyCORIS' layout (dots as underscores); "
                               "leave one out of --lora_target_modules")
        written = alpha
        if "lokr_w1" in parts and "lokr_w2" in parts:
            parts = folded(parts, {"lokr_w1": alpha / rank})
            written = float(rank)
        for part, value in parts.items():
            out[f"{name}.{part}"] = value
        out[f"{name}.alpha"] = torch.tensor(written, dtype=torch.float32)
    return out


def lycoris_metadata(config: Any) -> dict[str, str]:
    """The header kohya's scripts write for a LyCORIS network (the module that loads it, its algorithm, rank and
    alpha), for tools that describe a LoRA file by it; the loaders read the tensors alone."""
    kind = config_kind(config)
    return {"ss_network_module": "lycoris.kohya", "ss_network_dim": str(int(config.r)),
            "ss_network_alpha": f"{float(config.alpha):g}", "ss_network_args": json.dumps({"algo": kind})}


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
    kind = config_kind(lora_config) if lora_config is not None else "lora"
    if kind in LYCORIS_KINDS:
        if layout == "diffsynth":  # pragma: no cover - args.py refuses --lora_format diffsynth with it first
            raise BackendError(f"--lora_format diffsynth cannot hold {KIND_TITLES[kind]}")
        state = to_lycoris(state, lora_prefix, lora_config, prefixes or {lora_prefix: lora_prefix})
        metadata.update(lycoris_metadata(lora_config))
    elif layout == "diffsynth":
        scale = lora_scale(lora_config) if lora_config is not None else 1.0
        state = to_diffsynth(state, prefixes or {}, scale)
    elif layout == "comfyui" and lora_prefix is not None and lora_config is not None:
        slot = next((s for s, p in (prefixes or {}).items() if p == lora_prefix), None)
        structure = getattr(state, "configs", {}).get(slot)
        state, header = to_comfyui(state, lora_prefix, lora_config, prefixes or {lora_prefix: lora_prefix}, structure)
        metadata.update(header)
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
    """Convert the LoRA of `slot` in `src` to layout `to` (diffusers, diffsynth or comfyui) in `dst`; (source
    layout, tensors).

    `src` is read by models/lora.read_lora_file, the reader of --lora_checkpoint too (the whole file checked:
    see there; a ComfyUI-layout file when `prefixes` name the family, family.LoraPrefixes); a converted file holds
    whole pairs of one rank (in ComfyUI's layout, a fused module the sum of its parts'), each module's scale as the
    source means it.
    """
    if to not in LAYOUTS:
        raise BackendError(f"--to must be one of {', '.join(LAYOUTS)}, got {to!r}")
    remove_stale_temps(dst)  # what a killed convert into `dst` left (its own temporary name only)
    held = lycoris_kind(src)
    if held is not None:
        product = "Kronecker" if held == "lokr" else "Hadamard"
        raise BackendError(f"is {KIND_TITLES[held]} in LyCORIS' layout, not a LoRA: the {', '.join(LAYOUTS)} layouts "
                           f"hold lora_A/lora_B pairs, which a {product} product is not; LyCORIS' readers (lycoris-lora, "
                           "ComfyUI) load the file as it is", source=str(src))
    lora = read_lora_file(src, slot, prefixes)
    if to == "comfyui":
        return lora.layout, _convert_to_comfyui(lora, dst, slot, prefixes, remove_prefix)
    if lora.unpaired:
        raise BackendError(f"the LoRA of {lora.unpaired[0]} ({slot}) has only one of lora_A and lora_B",
                           source=str(src))
    ranks = set(lora.ranks.values())
    if len(ranks) != 1:
        raise BackendError(f"the LoRA of {slot} has several ranks ({sorted(ranks)}); only one rank per file is supported",
                           source=str(src))
    rank = ranks.pop()
    if lora.dora and to == "diffsynth":
        raise BackendError("is a DoRA (it holds magnitudes), which DiffSynth-Studio's LoRA layout cannot hold; "
                           "convert it --to diffusers", source=str(src))
    prefix = prefixes[slot]
    alpha = lora.alpha if lora.alpha is not None else float(rank)
    common = adapter_scale({"r": rank, "lora_alpha": alpha, "use_rslora": lora.rslora})
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
                        lora_config={"r": rank, "lora_alpha": alpha, "use_rslora": lora.rslora}, remove_prefix=remove_prefix)
    else:
        config = _ConfigDict({"r": rank, "lora_alpha": alpha, "target_modules": targets,
                              **({"use_rslora": True} if lora.rslora else {}), **({"use_dora": True} if lora.dora else {})})
        save_checkpoint(dst, diffusers_state, prefix, config, remove_prefix=remove_prefix)
    return lora.layout, len(weights)


def _convert_to_comfyui(lora: Any, dst: str | Path, slot: str, prefixes: Mapping[str, str],
                        remove_prefix: Optional[str]) -> int:
    """A read LoRA (models/lora.LoraFile) written in ComfyUI's layout (`comfyui_state`, each module's scale as the
    source means it); the count of tensors written."""
    from safetensors.torch import save

    source = str(lora.path)
    if lora.unpaired:
        raise BackendError(f"the LoRA of {lora.unpaired[0]} ({slot}) has only one of lora_A and lora_B", source=source)
    if lora.dora:
        raise BackendError("is a DoRA (it holds magnitudes); ComfyUI's dora_scale divides by the base weight's row "
                           "norms where peft's DoRA divides by the adapted weight's, so it cannot be written exactly "
                           "in ComfyUI's layout; convert it --to diffusers", source=source)
    names = comfyui_names(prefixes, slot, None, tuple(lora.modules))
    if names is None:
        raise BackendError(f"{slot} has no release module names here (ComfyUI's layout is the denoiser's); convert "
                           "it --to diffusers", source=source)
    pairs = {m: (lora.weights[f"{m}.lora_A.weight"], lora.weights[f"{m}.lora_B.weight"]) for m in lora.modules}
    tensors, blocks = comfyui_state(pairs, lora.scales, names, source)
    metadata = {"format": "pt", **comfyui_metadata(blocks, names)}
    written = {}
    for key, value in tensors.items():
        if remove_prefix and key.startswith(remove_prefix):
            key = key[len(remove_prefix):]
        written[key] = value.detach().to("cpu").contiguous().clone()
    write_bytes_atomic(Path(dst), save(written, metadata=metadata))
    return len(written)


class _ConfigDict(dict):
    """A LoRA config as save_checkpoint reads one (`to_dict()`)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self)

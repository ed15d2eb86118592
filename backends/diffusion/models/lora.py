"""LoRA adapters through peft, on any torch module (a diffusers DiT, a transformers text encoder).

Adapters are injected with peft's own `inject_adapter_in_model`, not through the model library's
`add_adapter` wrapper: transformers 5's wrapper refuses the peft version on the registry, while the
injection itself works for every torch module. Checkpoint keys carry the slot's diffusers pipeline
prefix (`transformer.` for the DiT, see `family.ModelSlot.lora_prefix`); `train/checkpoints.py` writes them.
Every LoRA file a user hands in (`--lora_checkpoint`, `--preset_lora_path`, `unitgraph lora convert`) is read
by one reader, `read_lora_file`, which checks the whole file before any weight is used. A file in ComfyUI's layout
(`diffusion_model.<release module>.lora_up.weight`, `--lora_format comfyui`) is read by `read_comfyui_file` through
the family's release names (models/release_names.py), its fused modules split back into diffusers' exactly.

`--lora_type lokr` and `loha` train peft's LoKr (a Kronecker product of two factors) and LoHa (a Hadamard product
of two low-rank products) in place of the LoRA pair. Their files are in LyCORIS' layout, which no LoRA loader
reads and LyCORIS' readers do (lycoris-lora, ComfyUI): `<prefix>_<module, dots as
underscores>.lokr_w1` ... and a `.alpha` per module (`lycoris_prefix`). `read_lycoris_file` is their reader, as
careful as `read_lora_file`, for `--lora_checkpoint` and `--preset_lora_path`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..errors import BackendError
from ..randomness import seeded_global_stream
from ..tensorfile import finite, load_tensors, metadata_object, read_header

METADATA_KEY = "lora_adapter_metadata"
ADAPTER = "default"
LORA_KINDS = ("lora", "dora")  # peft's LoraConfig: files in diffusers' or DiffSynth-Studio's layout
LYCORIS_KINDS = ("lokr", "loha")  # peft's LoKrConfig / LoHaConfig: files in LyCORIS' layout
# what each kind's trained tensors are called in peft (`<module>.<part>.<adapter>`): how a parameter is known to be the
# adapter's, and so trained
ADAPTER_MARKS = {"lora": "lora_", "dora": "lora_", "lokr": "lokr_", "loha": "hada_"}
KIND_TITLES = {"lora": "a plain LoRA", "dora": "a DoRA", "lokr": "a LoKr", "loha": "a LoHa"}


def jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(jsonable(v) for v in value) if isinstance(value, (set, frozenset)) else [jsonable(v) for v in value]
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(getattr(value, "value", value))


def adapter_scale(config: Mapping[str, Any]) -> float:
    """What an adapter's B @ A is scaled by: alpha / rank, or alpha / sqrt(rank) with `use_rslora` (peft's rule;
    alpha defaults to the rank). `config`: a LoraConfig's dict, or a LoRA file's adapter metadata for one model."""
    rank = float(config.get("r") or 1)
    alpha = float(config.get("lora_alpha") if config.get("lora_alpha") is not None else rank)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def adapter_kind(kind: str) -> str:
    """`kind` checked: a --lora_type name (lora, dora, lokr, loha), as config.LoraSpec.kind hands it over."""
    if kind not in ADAPTER_MARKS:
        raise BackendError(f"--lora_type must be one of {', '.join(ADAPTER_MARKS)}, got {kind!r}")
    return kind


def config_kind(config: Any) -> str:
    """The kind of adapter a peft config (or its dict, or a LoRA file's adapter metadata) describes."""
    values = config if isinstance(config, Mapping) else config.to_dict()
    peft_type = str(getattr(values.get("peft_type"), "value", values.get("peft_type")) or "").upper()
    if peft_type in ("LOKR", "LOHA"):
        return peft_type.lower()
    return "dora" if values.get("use_dora") else "lora"


def adapter_config(kind: str, targets: list[str], rank: int, alpha: float | None, rslora: bool = False) -> Any:
    """peft's config of the adapter `kind` on `targets`: alpha defaults to the rank (scale 1), as DiffSynth's LoRA;
    no dropout of any kind (LoKr's and LoHa's rank and module dropout off), so a step is a function of its inputs."""
    alpha = alpha if alpha is not None else rank
    if kind in LYCORIS_KINDS:
        from peft import LoHaConfig, LoKrConfig

        if rslora:  # args.py refuses the flags together first
            raise BackendError(f"--use_rslora with --lora_type {kind}: peft's {KIND_TITLES[kind][2:]} has no "
                               "rank-stabilised scale")
        config = LoKrConfig if kind == "lokr" else LoHaConfig
        return config(r=rank, alpha=alpha, target_modules=list(targets), rank_dropout=0.0, module_dropout=0.0,
                      init_weights=True)
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, init_lora_weights=True,
                      use_dora=kind == "dora", use_rslora=bool(rslora))


def add_lora(model: torch.nn.Module, slot: str, targets: list[str], rank: int, alpha: float | None, seed: int,
             kind: str = "lora", rslora: bool = False):
    """Attach a trainable adapter (only its weights trainable); the init draws from a stream derived from --seed.
    `kind`: the --lora_type name of the adapter (`adapter_kind`): "dora" is peft's weight-decomposed LoRA (a
    magnitude per output row, initialised to the base weight's row norms), "lokr" / "loha" peft's LoKr / LoHa on the
    same targets, rank and alpha; `rslora`: scaled by alpha / sqrt(rank) (LoRA and DoRA only).

    LoKr's and LoHa's tensors are made fp32 here: peft makes them in the base layer's dtype, and the trained
    parameters of a run stay fp32 (precision.adapters_to_fp32 does it for LoRA's, by their `lora_` names).

    Target names that match no module of `model` are reported as such; any other refusal by peft is
    reported with peft's own words (it is not a matter of module names then).
    """
    from peft import inject_adapter_in_model

    kind = adapter_kind(kind)
    config = adapter_config(kind, targets, rank, alpha, rslora)
    from .shards import inject_adapters

    with seeded_global_stream(seed, "lora_init", slot):
        try:  # on a model built without weights (FSDP2), with the same initial values (models/shards.py)
            inject_adapters(model, lambda target: inject_adapter_in_model(config, target, adapter_name=ADAPTER))
        except (ValueError, TypeError) as exc:  # peft's LoKr / LoHa refuse a layer type with a TypeError
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "not found in the base model" in first or type(exc).__name__ == "NoMatchingPeftModuleError":
                raise BackendError(f"--lora_target_modules {','.join(targets)}: no such modules in {slot}") from None
            what = "a LoRA" if kind in LORA_KINDS else KIND_TITLES[kind]
            raise BackendError(f"peft cannot add {what} adapter to {slot}: {first}") from None
    mark = ADAPTER_MARKS[kind]
    for name, param in model.named_parameters():
        param.requires_grad_(mark in name)
        if kind in LYCORIS_KINDS and mark in name and param.dtype != torch.float32:
            param.data = param.data.float()
    if kind in LYCORIS_KINDS:
        from peft.tuners.lycoris_utils import LycorisLayer

        for module in model.modules():
            if isinstance(module, LycorisLayer):
                module.register_forward_pre_hook(_without_module_dropout)
    return config


def _without_module_dropout(module: torch.nn.Module, args: Any) -> None:
    """Run a LoKr / LoHa layer as in eval mode. In training mode peft's layer draws torch.rand(1) at every call to
    decide its module dropout, even at a dropout of 0: the draw changes nothing but that the adapter is skipped when it
    is exactly 0 (2^-24 a call: a few times over a long run of a large model), spends torch's global stream, and cannot
    be taken on the dry run's fake tensors. Without rank or module dropout (adapter_config) the layer computes the same
    in either mode, so it is evaluated as in eval mode (its `training` flag only: the rest of the model is untouched)."""
    module.training = False


def lora_state_dict(model: torch.nn.Module, state_dict: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The adapter's weights by peft's names; from `state_dict` (the model's parameters gathered whole under a
    sharded engine) when given, else from the model."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=ADAPTER)


# ------------------------------------------------------------------------------------------------
# the one reader of LoRA files: `--lora_checkpoint`, `--preset_lora_path` and `unitgraph lora convert`

DIFFSYNTH_ROOT = "pipe"  # DiffSynth's keys start with its pipeline's attribute path, e.g. "pipe.dit."
DENOISER_ROOT = "diffusion_model"  # ComfyUI's and others' prefix of the denoiser's weights
_LORA_KEY = re.compile(r"(.+)\.lora_([AB])(\.default)?\.weight")
_MAGNITUDE_KEY = re.compile(r"(.+)\.lora_magnitude_vector(\.default)?(\.weight)?")  # DoRA's, per output row
_ALPHA_KEY = re.compile(r"(.+)\.alpha")
# prefixes other tools give the weights of models that are no slot of a family here (a UNet's, kohya's, peft's
# wrapper, CompVis', other pipelines' attributes): without the model at hand to say which module names are its
# own, keys under one of them are never taken for module names saved without a prefix. (Not `model`, `text_model`,
# `encoder`, `decoder`: the top-level modules of text encoders and VAEs, whose LoRA may be saved without a prefix.)
FOREIGN_ROOTS = frozenset({"unet", "unet_2", "lora_unet", "lora_te", "lora_te1", "lora_te2", "te", "te1", "te2",
                           "base_model", "cond_stage_model", "first_stage_model", "conditioner", "controlnet",
                           "transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3",
                           "image_encoder", "vae", "pipe"})


@dataclass(frozen=True)
class LoraFile:
    """The LoRA of one model slot in a checked LoRA file, in the model's own module names.

    weights: `<module>.lora_A.weight` [rank, in] and `<module>.lora_B.weight` [out, rank] (as stored: a
    DiffSynth-layout file has the scale folded into lora_A), and a DoRA's `<module>.lora_magnitude_vector` [out];
    scales: what each module's `B @ A` is scaled by (alpha / rank from a `.alpha` tensor or the header's adapter
    metadata, alpha / sqrt(rank) where it says `use_rslora`, else 1); unpaired: modules with only one of the two;
    alpha: the header's alpha for the slot (None when it gives none).
    """

    path: Path
    layout: str  # "diffusers", "diffsynth" or "comfyui"
    weights: dict[str, torch.Tensor]
    ranks: dict[str, int]
    scales: dict[str, float]
    unpaired: tuple[str, ...]
    alpha: Optional[float]
    metadata: dict[str, Any]
    rslora: bool = False  # the header says use_rslora: scales are alpha / sqrt(rank)

    @property
    def modules(self) -> list[str]:
        return sorted(self.ranks)

    @property
    def dora(self) -> bool:
        """Whether the file is a DoRA (it holds magnitudes)."""
        return any(k.endswith(".lora_magnitude_vector") for k in self.weights)


def _positive(value: Any) -> bool:
    """A positive number that is a finite float (an integer of 400 digits is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:
        return False


def _check_adapter_metadata(meta: dict[str, Any], source: str) -> None:
    """Every alpha and rank the header's adapter metadata gives (`lora_alpha`, `r`, each bare or under a slot's
    prefix) is a positive finite number (a rank: a positive integer)."""
    for key, value in meta.items():
        if key == "lora_alpha" or key.endswith(".lora_alpha"):
            if not _positive(value):
                raise BackendError(f"{key} in the file's header is {json.dumps(value)[:40]}, not a positive finite "
                                   "number", source=source)
        elif key == "r" or key.endswith(".r"):
            if not (_positive(value) and isinstance(value, int)):
                raise BackendError(f"{key} in the file's header is {json.dumps(value)[:40]}, not a positive integer "
                                   "(a LoRA rank)", source=source)


def _known_prefixes(prefixes: Mapping[str, str]) -> str:
    heads = dict.fromkeys([*prefixes.values(), *prefixes])  # each slot's prefix, then its name where they differ
    return ", ".join([*(f"{h}." for h in heads), f"{DIFFSYNTH_ROOT}.<{'|'.join(prefixes)}>.", f"{DENOISER_ROOT}."])


def _owner(key: str, prefixes: Mapping[str, str], slot: str, roots: Optional[set[str]], strict: bool,
           source: str, full: str = "") -> Optional[tuple[str, str]]:
    """(slot, module path) of a LoRA key (without its `.lora_A...` / `.alpha` tail): under a slot's prefix,
    DiffSynth's `pipe.<slot>.`, `diffusion_model.` (the denoiser), or no prefix at all (module names of `slot`,
    as --remove_prefix_in_ckpt writes them). A prefix that belongs to no model slot is one line naming it and
    the known ones (None when not `strict`: a preset LoRA's other weights are left out)."""
    head, _, rest = key.partition(".")
    by_prefix = {p: s for s, p in prefixes.items()}
    if head == DIFFSYNTH_ROOT and rest:
        name, _, module = rest.partition(".")
        if name in prefixes and module:
            return name, module
        shown = f"{DIFFSYNTH_ROOT}.{name}."
    elif head in by_prefix and rest:
        return by_prefix[head], rest
    elif head in prefixes and rest:  # the slot's own name (DiffSynth's keys with only `pipe.` taken off)
        return head, rest
    elif head == DENOISER_ROOT and rest:
        return next(iter(prefixes)), rest
    elif (head in roots) if roots is not None else (head not in FOREIGN_ROOTS):
        return slot, key
    else:
        shown = f"{head}."
    if not strict:
        return None
    names = sorted(roots or ())
    modules = f": {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}" if names else ""
    raise BackendError(f"LoRA keys under {shown!r} (e.g. {(full or key)[:80]}) belong to no model of this family; its prefixes "
                       f"are {_known_prefixes(prefixes)} (or the module names of {slot} without a prefix{modules})",
                       source=source)


def read_lora_file(path: str | Path, slot: str, prefixes: Mapping[str, str], roots: Optional[set[str]] = None,
                   strict: bool = True, config: Optional[Mapping[str, Any]] = None) -> LoraFile:
    """The LoRA of `slot` in the LoRA file at `path`, every part of the file checked first; one BackendError line
    naming the file and the problem otherwise.

    The file: a whole safetensors file (not truncated); its header's adapter metadata a JSON object whose alphas
    are positive finite numbers and ranks positive integers; every LoRA tensor (`<module>.lora_A[.default].weight`,
    `...lora_B...`) 2-D and floating, lora_A [rank, in] and lora_B [out, rank] of one rank, finite; `.alpha`
    tensors single positive numbers; every LoRA key under a prefix of a model slot of the family (`prefixes`: slot
    -> its diffusers prefix, the denoiser first) or, without a prefix, a module name of `slot` (`roots`: the
    top-level module names of its model, when it is at hand); and some LoRA weights for `slot`. A file in ComfyUI's
    layout is read by `read_comfyui_file` when `prefixes` name the family (family.LoraPrefixes) and `slot` has
    release names (`config`: its model's config.json, when the model is at hand).
    """
    path = Path(path)
    source = str(path)
    header = read_header(path, source)
    names = comfyui_names(prefixes, slot, config or metadata_object(header, COMFYUI_STRUCTURE, source))
    if names is not None and _comfyui_layout(header, names):
        return read_comfyui_file(path, header, slot, names, getattr(getattr(prefixes, "family", None), "title", slot))
    meta = metadata_object(header, METADATA_KEY, source) or {}
    _check_adapter_metadata(meta, source)
    lora_keys, alpha_keys, magnitude_keys = {}, {}, {}
    for key, info in header.tensors.items():
        magnitude = _MAGNITUDE_KEY.fullmatch(key)
        if magnitude is not None:
            if not info.floating or len(info.shape) != 1 or 0 in info.shape:
                raise BackendError(f"DoRA magnitude {key[:80]} is {info.describe()}: a magnitude is a floating vector "
                                   "with one value per output of its module", source=source)
            magnitude_keys[key] = magnitude
            continue
        match = _LORA_KEY.fullmatch(key)
        if match is not None:
            if not info.floating or len(info.shape) != 2 or 0 in info.shape:
                what = "not 2-D" if len(info.shape) != 2 else "empty" if 0 in info.shape else "not floating"
                raise BackendError(f"LoRA tensor {key[:80]} is {info.describe()}, {what}: a LoRA weight is a floating "
                                   "matrix (lora_A [rank, in], lora_B [out, rank])", source=source)
            lora_keys[key] = match
        elif (".lora_A." in key or ".lora_B." in key) and key.endswith(".weight"):
            raise BackendError(f"LoRA tensor {key[:80]} is not <module>.lora_A.weight or <module>.lora_A.default.weight "
                               "(another adapter name)", source=source)
        elif _ALPHA_KEY.fullmatch(key):
            alpha_keys[key] = info  # checked below if its module has LoRA weights (else it is some model's own)
    if not lora_keys:
        held = _lycoris_kind(header)
        if held is not None:
            raise BackendError(f"holds {KIND_TITLES[held]} (LyCORIS' {_PARTS_SHOWN[held]} keys), not LoRA weights "
                               "(<module>.lora_A.weight / .lora_B.weight)", source=source)
        raise BackendError("holds no LoRA weights (no keys <module>.lora_A.weight / .lora_B.weight); is it a LoRA "
                           "file of diffusers' or DiffSynth-Studio's layout?", source=source)
    layout = "diffsynth" if any(m.group(3) or k.startswith(f"{DIFFSYNTH_ROOT}.") for k, m in lora_keys.items()) \
        else "diffusers"
    pairs: dict[tuple[str, str], dict[str, str]] = {}  # (slot, module) -> {"A": key, "B": key}
    for key, match in lora_keys.items():
        owner = _owner(match.group(1), prefixes, slot, roots, strict, source, key)
        if owner is None:
            continue
        half = pairs.setdefault(owner, {})
        if match.group(2) in half:
            raise BackendError(f"two tensors for {owner[1]}.lora_{match.group(2)} of {owner[0]} ({half[match.group(2)]} "
                               f"and {key})", source=source)
        half[match.group(2)] = key
    ranks: dict[str, int] = {}
    for (owner, module), half in sorted(pairs.items()):
        a, b = (header.tensors[half[h]] if h in half else None for h in "AB")
        if a is not None and b is not None and a.shape[0] != b.shape[1]:
            raise BackendError(f"the LoRA of {module} ({owner}) has lora_A {list(a.shape)} and lora_B {list(b.shape)}: "
                               "their ranks differ (lora_A [rank, in], lora_B [out, rank])", source=source)
        if owner == slot:
            ranks[module] = a.shape[0] if a is not None else b.shape[1]
    if not ranks:
        others = sorted({s for s, _ in pairs})
        held = f"; it holds LoRA weights of {', '.join(others)}" if others else ""
        raise BackendError(f"holds no LoRA weights of {slot}{held}", source=source)
    own = prefixes.get(slot, slot)
    alpha = meta.get(f"{own}.lora_alpha", meta.get("lora_alpha"))
    rank = meta.get(f"{own}.r", meta.get("r"))
    patterned = bool(meta.get(f"{own}.rank_pattern") or meta.get("rank_pattern"))
    if rank is not None and not patterned and set(ranks.values()) != {rank}:
        raise BackendError(f"the header gives {slot}'s LoRA rank {rank}, its tensors have rank "
                           f"{', '.join(map(str, sorted(set(ranks.values()))))}", source=source)
    wanted = {half[h]: (module, h) for (owner, module), half in pairs.items() if owner == slot for h in half}
    magnitudes = {}
    for key, match in magnitude_keys.items():
        owner = _owner(match.group(1), prefixes, slot, roots, False, source)
        if owner is None or owner[0] != slot:
            continue
        half = pairs.get(owner, {})
        if "B" not in half:
            raise BackendError(f"DoRA magnitude {key[:80]} has no lora_B beside it (a magnitude scales a LoRA's "
                               "module)", source=source)
        rows = header.tensors[half["B"]].shape[0]
        if header.tensors[key].shape[0] != rows:
            raise BackendError(f"DoRA magnitude {key[:80]} has {header.tensors[key].shape[0]} values, its module "
                               f"{rows} outputs (lora_B {list(header.tensors[half['B']].shape)})", source=source)
        magnitudes[key] = owner[1]
    alphas = {}
    for key, info in alpha_keys.items():
        owner = _owner(key[:-len(".alpha")], prefixes, slot, roots, False, source)
        if owner not in pairs:
            continue
        if info.numel != 1 or len(info.shape) > 1 or info.dtype in ("BOOL", "C64"):
            raise BackendError(f"LoRA alpha {key[:80]} is {info.describe()}, not a single number", source=source)
        if owner[0] == slot:
            alphas[key] = owner[1]
    tensors = load_tensors(path, header, source, [*wanted, *alphas, *magnitudes])
    weights: dict[str, torch.Tensor] = {}
    for key, (module, h) in sorted(wanted.items()):
        value = tensors[key]
        if not torch.isfinite(value.float()).all():
            raise BackendError(f"LoRA tensor {key[:80]} holds NaN or infinite values", source=source)
        weights[f"{module}.lora_{h}.weight"] = value
    for key, module in sorted(magnitudes.items()):
        value = tensors[key]
        if not torch.isfinite(value.float()).all():
            raise BackendError(f"DoRA magnitude {key[:80]} holds NaN or infinite values", source=source)
        weights[f"{module}.lora_magnitude_vector"] = value
    module_alpha = {}
    for key, module in alphas.items():
        value = float(tensors[key].reshape(()).float())
        if not _positive(value):
            raise BackendError(f"LoRA alpha {key[:80]} is {value}, not a positive finite number", source=source)
        module_alpha[module] = value
    base = float(alpha) if alpha is not None and layout == "diffusers" else None
    rslora = bool(meta.get(f"{own}.use_rslora", meta.get("use_rslora"))) and layout == "diffusers"
    per = {m: math.sqrt(r) if rslora else r for m, r in ranks.items()}  # what alpha is divided by
    scales = {m: module_alpha[m] / per[m] if m in module_alpha else base / per[m] if base is not None else 1.0
              for m in ranks}
    unpaired = tuple(sorted(m for (owner, m), half in pairs.items() if owner == slot and len(half) == 1))
    return LoraFile(path, layout, weights, ranks, scales, unpaired, base, meta, rslora)


# ------------------------------------------------------------------------------------------------
# LoRA in ComfyUI's layout: the release checkpoint's module names (models/release_names.py)

COMFYUI_BLOCKS = "comfyui_blocks"  # header: how unitgraph stacked each fused module (release -> [[part, rank], ...])
COMFYUI_STRUCTURE = "comfyui_structure"  # header: what the release names depended on (a UNet's layers per block)
_COMFYUI_KEY = re.compile(rf"{DENOISER_ROOT}\.(.+)\.(lora_up|lora_down|lora_A|lora_B)\.weight")
_COMFYUI_EXTRA = re.compile(rf"{DENOISER_ROOT}\.(.+)\.(alpha|dora_scale)")
_COMFYUI_HALF = {"lora_up": "up", "lora_B": "up", "lora_down": "down", "lora_A": "down"}


def comfyui_names(prefixes: Mapping[str, str], slot: str, config: Optional[Mapping[str, Any]] = None,
                  modules: tuple[str, ...] = ()) -> Any:
    """The release names of `slot` for a model of `config` (family.LoraPrefixes name the family; the slot declares
    them, `ModelSlot.comfyui`); None where either is missing."""
    family = getattr(prefixes, "family", None)
    names = family.comfyui_names(slot) if family is not None else None
    return names.for_config(config, modules) if names is not None else None


def _comfyui_layout(header: Any, names: Any) -> bool:
    """Whether a file is in ComfyUI's layout: kohya's lora_up / lora_down under `diffusion_model.`, or lora_A / lora_B
    of a release module named otherwise in diffusers (a file in diffusers' names under `diffusion_model.` keeps being
    read as one)."""
    for key in header.tensors:
        match = _COMFYUI_KEY.fullmatch(key)
        if match is None:
            continue
        fused = names.diffusers(match.group(1))
        if match.group(2) in ("lora_up", "lora_down") or (fused is not None and fused.parts != ((match.group(1), 1),)):
            return True
    return False


def _comfyui_parts(header: Any, source: str) -> dict[str, list[tuple[str, int]]]:
    """The header's record of how unitgraph stacked its fused modules, checked: {release: [(part, rank), ...]}."""
    blocks = metadata_object(header, COMFYUI_BLOCKS, source) or {}
    out = {}
    for name, parts in blocks.items():
        ok = isinstance(parts, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                             and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] >= 0
                                             for p in parts)
        if not ok:
            raise BackendError(f"{COMFYUI_BLOCKS} of {name[:60]} in the header is not a list of [module, rank] pairs",
                               source=source)
        out[name] = [(p[0], p[1]) for p in parts]
    return out


def read_comfyui_file(path: Path, header: Any, slot: str, names: Any, title: str) -> LoraFile:
    """The LoRA of `slot` in a ComfyUI-layout file, in diffusers' module names, every part checked first.

    Keys: `diffusion_model.<release module>.lora_up.weight` [out, rank] and `.lora_down.weight` [rank, in] (or
    lora_B / lora_A), `.alpha` (ComfyUI scales by alpha / rank, 1 without one). Each release module must be one of
    the family's (`names.diffusers`), with both halves. A fused module's rows are split among its parts: where the
    header records how unitgraph stacked them and the blocks off the diagonal are zero, each part gets its own
    lora_A rows and lora_B block back (the written LoRA exactly); otherwise each part gets the whole lora_down and
    its rows of lora_up (a LoRA trained on the fused module: the same delta, at the fused rank). `dora_scale`
    (ComfyUI's DoRA) is refused: its weight_decompose divides by the base weight's norms, peft's DoRA by the
    adapted weight's.
    """
    source = str(path)
    halves: dict[str, dict[str, str]] = {}
    alphas: dict[str, str] = {}
    for key, info in header.tensors.items():
        extra = _COMFYUI_EXTRA.fullmatch(key)
        if extra is not None:
            if extra.group(2) == "dora_scale":
                raise BackendError(f"{key[:80]} is ComfyUI's DoRA scale, whose weight_decompose divides by the base "
                                   "weight's row norms where peft's DoRA divides by the adapted weight's; unitgraph "
                                   "reads no DoRA in ComfyUI's layout", source=source)
            alphas[extra.group(1)] = key
            continue
        match = _COMFYUI_KEY.fullmatch(key)
        if match is None:
            continue
        if not info.floating or len(info.shape) != 2 or 0 in info.shape:
            raise BackendError(f"LoRA tensor {key[:80]} is {info.describe()}: a LoRA weight is a floating matrix "
                               "(lora_down [rank, in], lora_up [out, rank])", source=source)
        module, half = match.group(1), _COMFYUI_HALF[match.group(2)]
        if names.diffusers(module) is None:
            raise BackendError(f"{key[:80]}: {module} is no module of {title}'s release checkpoint, whose names "
                               f"ComfyUI's layout uses (is the file another model's LoRA?)", source=source)
        group = halves.setdefault(module, {})
        if half in group:
            raise BackendError(f"two tensors for the {half} half of {module} ({group[half]} and {key})", source=source)
        group[half] = key
    if not halves:
        raise BackendError(f"holds no LoRA weights in ComfyUI's layout ({DENOISER_ROOT}.<module>.lora_up.weight / "
                           ".lora_down.weight)", source=source)
    recorded = _comfyui_parts(header, source)
    for module, group in sorted(halves.items()):
        if len(group) == 1:
            raise BackendError(f"the LoRA of {module} has only its lora_{next(iter(group))} (a pair is lora_up and "
                               "lora_down)", source=source)
        up, down = header.tensors[group["up"]].shape, header.tensors[group["down"]].shape
        if up[1] != down[0]:
            raise BackendError(f"the LoRA of {module} has lora_up {list(up)} and lora_down {list(down)}: their ranks "
                               "differ (lora_down [rank, in], lora_up [out, rank])", source=source)
        fused = names.diffusers(module)
        units = sum(n for _, n in fused.parts) * (2 if fused.swap_halves else 1)
        if up[0] % units:
            raise BackendError(f"the LoRA of {module} has {up[0]} output rows, which do not split into its "
                               f"{units} parts' ({', '.join(p for p, _ in names.diffusers(module).parts)})", source=source)
        if module in alphas:
            info = header.tensors[alphas[module]]
            if info.numel != 1 or len(info.shape) > 1 or info.dtype in ("BOOL", "C64"):
                raise BackendError(f"LoRA alpha {alphas[module][:80]} is {info.describe()}, not a single number",
                                   source=source)
    keys = [k for g in halves.values() for k in g.values()]
    tensors = load_tensors(path, header, source, [*keys, *(alphas[m] for m in halves if m in alphas)])
    weights: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    scales: dict[str, float] = {}
    for module, group in sorted(halves.items()):
        up, down = tensors[group["up"]], tensors[group["down"]]
        for key in group.values():
            if not finite(tensors[key]):
                raise BackendError(f"LoRA tensor {key[:80]} holds NaN or infinite values", source=source)
        scale = 1.0
        if module in alphas:
            alpha = float(tensors[alphas[module]].reshape(()).float())
            if not _positive(alpha):
                raise BackendError(f"LoRA alpha {alphas[module][:80]} is {alpha}, not a positive finite number",
                                   source=source)
            scale = alpha / down.shape[0]
        for part, (a, b) in split_fused(names.diffusers(module), down, up, recorded.get(module)).items():
            weights[f"{part}.lora_A.weight"], weights[f"{part}.lora_B.weight"] = a, b
            ranks[part], scales[part] = a.shape[0], scale
    uniform = len(set(scales.values())) == 1 and len(set(ranks.values())) == 1
    alpha = next(iter(scales.values())) * next(iter(ranks.values())) if uniform else None
    return LoraFile(path, "comfyui", weights, ranks, scales, (), alpha, {})


def split_fused(fused: Any, down: torch.Tensor, up: torch.Tensor,
                recorded: Optional[list[tuple[str, int]]] = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A release module's LoRA (lora_down [R, in], lora_up [rows, R]) as LoRAs of its diffusers parts {part: (A, B)},
    each computing the part's rows of lora_up @ lora_down exactly. The parts' blocks as `recorded` (the writer's
    [(part, rank)], in row order) when they fit and nothing lies off them; else each part the whole lora_down."""
    if fused.swap_halves:
        up = up.roll(up.shape[0] // 2, dims=0)  # exchanging the halves is its own inverse
    unit = up.shape[0] // sum(n for _, n in fused.parts)
    rows = up.split([unit * n for _, n in fused.parts], dim=0)
    if len(fused.parts) == 1:
        return {fused.parts[0][0]: (down, up)}
    if recorded is not None and [p for p, _ in recorded] == [p for p, _ in fused.parts] \
            and sum(r for _, r in recorded) == down.shape[0]:
        cols = [r for _, r in recorded]
        blocks = [block.split(cols, dim=1) for block in rows]
        if all(not bool(piece.any()) for i, pieces in enumerate(blocks) for j, piece in enumerate(pieces) if i != j):
            downs = down.split(cols, dim=0)
            return {p: (downs[i], blocks[i][i]) for i, (p, r) in enumerate(recorded) if r}
    return {p: (down, block) for (p, _), block in zip(fused.parts, rows)}


# ------------------------------------------------------------------------------------------------
# LoKr and LoHa in LyCORIS' layout: the writer's names (train/checkpoints.to_lycoris) and the reader

# a LyCORIS module's tensors, by the kind they belong to (peft names its LoKr's and LoHa's tensors the same)
LYCORIS_PARTS = {"lokr_w1": "lokr", "lokr_w1_a": "lokr", "lokr_w1_b": "lokr", "lokr_w2": "lokr", "lokr_w2_a": "lokr",
                 "lokr_w2_b": "lokr", "hada_w1_a": "loha", "hada_w1_b": "loha", "hada_w2_a": "loha", "hada_w2_b": "loha"}
# LyCORIS' tensors that peft's LoKr / LoHa as unitgraph trains them have not: a file holding one is refused, naming it
_LYCORIS_OTHER = {"lokr_t2": "a Tucker core (LyCORIS' use_tucker)", "hada_t1": "a Tucker core (LyCORIS' use_tucker)",
                  "hada_t2": "a Tucker core (LyCORIS' use_tucker)",
                  "dora_scale": "a weight decomposition (LyCORIS' dora_wd)"}
_LYCORIS_KEY = re.compile(r"(.+)\.(lokr_w[12](?:_[ab])?|hada_w[12]_[ab]|lokr_t2|hada_t[12]|dora_scale)")
_PARTS_SHOWN = {"lokr": "lokr_w1 / lokr_w2", "loha": "hada_w1_a ... hada_w2_b"}
# the tensor of each kind that carries the module's scale when it is folded in: the product is linear in it
_SCALED_PART = ("lokr_w1", "lokr_w1_a", "hada_w1_a")


def lycoris_prefix(own: str, prefixes: Mapping[str, str]) -> str:
    """The LyCORIS name prefix of the model whose diffusers prefix is `own` (`prefixes`: each slot's, the denoiser
    first): what LyCORIS' readers look for. A UNet's is kohya's `lora_unet` (ComfyUI maps it to a UNet's diffusers
    module names; lycoris-lora reads it with its `lora_prefix` preset); another denoiser's is `lycoris`, LyCORIS' own
    (lycoris-lora's create_lycoris_from_weights reads it, and ComfyUI maps it to the denoiser's diffusers module
    names, as trainers built on LyCORIS write it); a text encoder's kohya's `lora_te`, numbered `lora_te1`,
    `lora_te2`, ... when the family has several; any other model's `lora_<its diffusers prefix>`.

    >>> lycoris_prefix("transformer", {"dit": "transformer", "text_encoder": "text_encoder"})
    'lycoris'
    >>> lycoris_prefix("text_encoder_2", {"unet": "unet", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2"})
    'lora_te2'
    """
    if own == "unet":
        return "lora_unet"
    if own == next(iter(prefixes.values()), None):
        return "lycoris"
    encoders = sorted({p for p in prefixes.values() if p == "text_encoder" or p.startswith("text_encoder_")},
                      key=lambda p: (len(p), p))
    if own in encoders:
        return "lora_te" if len(encoders) == 1 else f"lora_te{encoders.index(own) + 1}"
    return f"lora_{own}"


def _lycoris_kind(header: Any) -> Optional[str]:
    """"lokr" or "loha" when the checked header holds LyCORIS tensors of that kind (LoKr's first), else None."""
    kinds = {LYCORIS_PARTS.get(m.group(2)) for m in map(_LYCORIS_KEY.fullmatch, header.tensors) if m is not None}
    return next((k for k in LYCORIS_KINDS if k in kinds), None)


def lycoris_kind(path: str | Path) -> Optional[str]:
    """Whether the file at `path` is a LoKr ("lokr") or a LoHa ("loha") by its tensors' names; None for any other
    file. Its header is checked whole first (tensorfile.read_header: one line for a damaged file)."""
    return _lycoris_kind(read_header(Path(path), str(path)))


def module_names(model: torch.nn.Module) -> dict[str, Optional[str]]:
    """`model`'s module names by their LyCORIS spelling (dots as underscores); None for a spelling two modules share,
    which no LyCORIS name can then tell apart."""
    names: dict[str, Optional[str]] = {}
    for name, _ in model.named_modules():
        if name:
            spelled = name.replace(".", "_")
            names[spelled] = None if spelled in names and names[spelled] != name else name
    return names


@dataclass(frozen=True)
class LycorisFile:
    """The LoKr / LoHa of one model slot in a checked LyCORIS-layout file, in the model's own module names.

    parts: {module: {part: tensor}}, a LoKr's `lokr_w1` (or `lokr_w1_a` [a, rank] and `lokr_w1_b` [rank, c]) and
    `lokr_w2` (or `lokr_w2_a` / `lokr_w2_b`), a LoHa's `hada_w1_a` [out, rank], `hada_w1_b` [rank, in], `hada_w2_a`,
    `hada_w2_b`, as stored; kinds: {module: "lokr" | "loha"}; scales: what each module's product is scaled by, as
    LyCORIS' readers (lycoris-lora, ComfyUI) take a file: alpha / rank with the rank of the module's rank-decomposed
    factor, 1 for a LoKr of two whole factors or a module without alpha.
    """

    path: Path
    parts: dict[str, dict[str, torch.Tensor]]
    kinds: dict[str, str]
    scales: dict[str, float]

    @property
    def modules(self) -> list[str]:
        return sorted(self.parts)


def _lycoris_owner(head: str, prefixes: Mapping[str, str], slot: str, names: Mapping[str, Optional[str]],
                   roots: set[str], strict: bool, source: str, key: str) -> Optional[tuple[str, str]]:
    """(slot, module) of a LyCORIS key's module part: `<LyCORIS prefix>_<module, dots as underscores>` (the module
    found by its spelling in `names`; the spelling itself when `slot`'s model has no such module), or a dotted module
    path (under a slot's diffusers prefix, `diffusion_model.`, or none) as `read_lora_file` takes LoRA keys."""
    if "." in head or head in roots:
        return _owner(head, prefixes, slot, roots, strict, source, key)
    by_prefix: dict[str, str] = {}
    for name, own in prefixes.items():
        lyco = lycoris_prefix(own, prefixes)
        if name == slot or lyco not in by_prefix:
            by_prefix[lyco] = name
    for lyco in sorted(by_prefix, key=len, reverse=True):  # lora_te1_... before lora_te_...
        if head.startswith(f"{lyco}_") and len(head) > len(lyco) + 1:
            owner, spelled = by_prefix[lyco], head[len(lyco) + 1:]
            if owner != slot:
                return owner, spelled
            if spelled in names and names[spelled] is None:
                raise BackendError(f"{key[:80]}: two modules of {slot} are spelled {spelled!r} with dots as "
                                   "underscores, so LyCORIS' name cannot say which", source=source)
            return slot, names.get(spelled) or spelled
    if not strict:
        return None
    known = ", ".join(f"{p}_" for p in sorted(by_prefix))
    raise BackendError(f"LyCORIS key {key[:80]} belongs to no model of this family (its LyCORIS prefixes: {known})",
                       source=source)


def _check_lycoris_module(module: str, kind: str, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """A LoKr module: `lokr_w1` [a, c] or `lokr_w1_a` [a, r] and `lokr_w1_b` [r, c]; `lokr_w2` [b, d(, k, k)] or
    `lokr_w2_a` [b, r] and `lokr_w2_b` [r, d(*k*k)]; one rank where both are decomposed (LyCORIS' one rank a module).
    A LoHa module: `hada_w1_a` [out, r], `hada_w1_b` [r, in], `hada_w2_a` and `hada_w2_b` of the same shapes."""
    def bad(what: str) -> BackendError:
        shown = ", ".join(f"{p} {list(s)}" for p, s in sorted(shapes.items()))
        return BackendError(f"the {KIND_TITLES[kind][2:]} of {module} ({shown}): {what}", source=source)

    if kind == "loha":
        missing = [p for p in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b") if p not in shapes]
        if missing:
            raise bad(f"has no {missing[0]} (a LoHa module has hada_w1_a, hada_w1_b, hada_w2_a and hada_w2_b)")
        a, b = shapes["hada_w1_a"], shapes["hada_w1_b"]
        if any(len(s) != 2 for s in shapes.values()) or a[1] != b[0] or shapes["hada_w2_a"] != a or shapes["hada_w2_b"] != b:
            raise bad("a LoHa is hada_w1_a [out, rank] @ hada_w1_b [rank, in] times hada_w2_a @ hada_w2_b of the same "
                      "shapes")
        return
    ranks = []
    for side in ("lokr_w1", "lokr_w2"):
        whole, pair = side in shapes, (f"{side}_a" in shapes, f"{side}_b" in shapes)
        if whole == any(pair) or (any(pair) and not all(pair)):
            raise bad(f"give either {side} or both {side}_a and {side}_b")
        if whole:
            if len(shapes[side]) != 2 and not (side == "lokr_w2" and len(shapes[side]) == 4):
                raise bad(f"{side} is neither a matrix nor (lokr_w2 of a convolution) 4-D")
            continue
        a, b = shapes[f"{side}_a"], shapes[f"{side}_b"]
        if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            raise bad(f"{side}_a [rows, rank] and {side}_b [rank, columns] do not multiply")
        ranks.append(a[1])
    if len(set(ranks)) > 1:
        raise bad(f"its two factors are decomposed with two ranks ({ranks[0]} and {ranks[1]})")


def lycoris_scale(kind: str, shapes: Mapping[str, tuple[int, ...]], alpha: Optional[float]) -> float:
    """What LyCORIS' readers scale a module's product by: alpha / rank, the rank being a LoHa's, or that of a LoKr's
    rank-decomposed factor (lokr_w2's first: ComfyUI's order); 1 for a LoKr of two whole factors, or without alpha
    (lycoris-lora and ComfyUI agree on each)."""
    if kind == "loha":
        rank = shapes["hada_w1_b"][0]
    else:
        rank = shapes["lokr_w2_b"][0] if "lokr_w2_b" in shapes else shapes["lokr_w1_b"][0] if "lokr_w1_b" in shapes \
            else None
    return alpha / rank if alpha is not None and rank else 1.0


def read_lycoris_file(path: str | Path, slot: str, prefixes: Mapping[str, str], names: Mapping[str, Optional[str]],
                      roots: set[str], strict: bool = True) -> LycorisFile:
    """The LoKr / LoHa of `slot` in the LyCORIS-layout file at `path`, every part of it checked first; one
    BackendError line naming the file and the problem otherwise.

    The file: a whole safetensors file; every LyCORIS tensor floating, non-empty, of a module of a model slot
    (`<LyCORIS prefix>_<module>` as `lycoris_prefix` names them, `names`: the module names of `slot`'s model by
    their LyCORIS spelling; or a dotted module path, as LoRA keys); no part peft's LoKr / LoHa lack (a Tucker core,
    LyCORIS' weight decomposition); each module whole and of consistent shapes (`_check_lycoris_module`), of one kind;
    each module's `.alpha`, when given, a single positive finite number; finite values; and some for `slot`.
    """
    path = Path(path)
    source = str(path)
    header = read_header(path, source)
    groups: dict[tuple[str, str], dict[str, str]] = {}  # (slot, module) -> {part: key}
    heads: dict[tuple[str, str], str] = {}
    for key, info in header.tensors.items():
        match = _LYCORIS_KEY.fullmatch(key)
        if match is None:
            continue
        head, part = match.groups()
        owner = _lycoris_owner(head, prefixes, slot, names, roots, strict, source, key)
        if owner is None or owner[0] != slot:
            continue
        if part in _LYCORIS_OTHER:
            raise BackendError(f"{key[:80]} is {_LYCORIS_OTHER[part]}, which unitgraph's LoKr and LoHa (peft's) do not "
                               "have", source=source)
        if not info.floating or len(info.shape) not in (2, 4) or 0 in info.shape:
            raise BackendError(f"LyCORIS tensor {key[:80]} is {info.describe()}: a LoKr's or LoHa's factor is a "
                               "non-empty floating matrix (a LoKr's lokr_w2 of a convolution 4-D)", source=source)
        group = groups.setdefault(owner, {})
        if part in group:
            raise BackendError(f"two tensors for {owner[1]}.{part} of {slot} ({group[part]} and {key})", source=source)
        group[part] = key
        heads[owner] = head
    if not groups:
        held = _lycoris_kind(header)
        what = f"it holds {KIND_TITLES[held]} of another model" if held else "no LoKr or LoHa of any model"
        raise BackendError(f"holds no LoKr or LoHa weights of {slot} ({what}; LyCORIS' keys are "
                           f"{lycoris_prefix(prefixes.get(slot, slot), prefixes)}_<module>.lokr_w1 ...)", source=source)
    kinds: dict[str, str] = {}
    alphas: dict[str, str] = {}
    for owner, group in groups.items():
        module = owner[1]
        found = {LYCORIS_PARTS[p] for p in group}
        if len(found) > 1:
            raise BackendError(f"{module} of {slot} has both LoKr and LoHa tensors", source=source)
        kinds[module] = found.pop()
        _check_lycoris_module(module, kinds[module], {p: header.tensors[k].shape for p, k in group.items()}, source)
        alpha_key = f"{heads[owner]}.alpha"
        if alpha_key in header.tensors:
            info = header.tensors[alpha_key]
            if info.numel != 1 or len(info.shape) > 1 or info.dtype in ("BOOL", "C64"):
                raise BackendError(f"LyCORIS alpha {alpha_key[:80]} is {info.describe()}, not a single number",
                                   source=source)
            alphas[module] = alpha_key
    keys = [k for group in groups.values() for k in group.values()]
    tensors = load_tensors(path, header, source, [*keys, *alphas.values()])
    parts: dict[str, dict[str, torch.Tensor]] = {}
    scales: dict[str, float] = {}
    for (_, module), group in sorted(groups.items()):
        for part, key in sorted(group.items()):
            if not finite(tensors[key]):
                raise BackendError(f"LyCORIS tensor {key[:80]} holds NaN or infinite values", source=source)
            parts.setdefault(module, {})[part] = tensors[key]
        alpha = None
        if module in alphas:
            alpha = float(tensors[alphas[module]].reshape(()).float())
            if not _positive(alpha):
                raise BackendError(f"LyCORIS alpha {alphas[module][:80]} is {alpha}, not a positive finite number",
                                   source=source)
        scales[module] = lycoris_scale(kinds[module], {p: tuple(t.shape) for p, t in parts[module].items()}, alpha)
    return LycorisFile(path, parts, kinds, scales)


def lycoris_delta(kind: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A LyCORIS module's product, unscaled, in float32: a LoKr's kron(w1, w2), a LoHa's (w1_a @ w1_b) * (w2_a @ w2_b).
    A LoKr's factor given as a pair is its product; a 4-D lokr_w2 (a convolution's) takes w1 as [a, c, 1, 1]. Laid out
    as the layer's weight by a reshape (a convolution's columns are in, kernel rows, kernel columns)."""
    t = {k: v.float() for k, v in parts.items()}
    if kind == "loha":
        return (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    if w2.dim() > w1.dim():
        w1 = w1.reshape(*w1.shape, *[1] * (w2.dim() - w1.dim()))
    return torch.kron(w1, w2)


def _config(model: torch.nn.Module) -> Optional[dict[str, Any]]:
    """A diffusers model's config (what its release names may depend on: a UNet's layers per block), else None."""
    config = getattr(model, "config", None)
    return dict(config) if isinstance(config, Mapping) else None


def _roots(model: torch.nn.Module) -> set[str]:
    """The top-level module names of `model`: what a LoRA key saved without a prefix starts with."""
    return {name for name, _ in model.named_children()}


def _fit(picked: Mapping[str, torch.Tensor], expected: Mapping[str, Any], slot: str, path: str | Path) -> None:
    """A checkpoint's weights fit the adapter exactly: each names an adapter tensor of `slot` of its shape, and every
    adapter tensor is given (else one line: a checkpoint whose keys match no module would load nothing and train from
    scratch without a word)."""
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


def _set_adapter(model: torch.nn.Module, slot: str, picked: Mapping[str, torch.Tensor], path: str | Path) -> None:
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, dict(picked), adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise BackendError(f"LoRA checkpoint does not fit {slot} (e.g. {unexpected[0]}); check --lora_target_modules/--lora_rank",
                           source=str(path))


def _held_kind(path: str | Path) -> str:
    """What a checkpoint holds, for the line that names a kind another than the run's: a LoKr, a LoHa, a LoRA (plain or
    DoRA, as far as its keys say), or nothing unitgraph reads."""
    header = read_header(Path(path), str(path))
    held = _lycoris_kind(header)
    if held is not None:
        return held
    if any(_MAGNITUDE_KEY.fullmatch(k) for k in header.tensors):
        return "dora"
    return "lora" if any(_LORA_KEY.fullmatch(k) for k in header.tensors) else ""


def load_lora_checkpoint(model: torch.nn.Module, slot: str, path: str | Path, prefixes: Mapping[str, str]) -> None:
    """Load LoRA weights of `slot` from a checkpoint of either layout into the adapter of `model`.

    The file is read by `read_lora_file` (checked whole: see there). It must then fit the adapter exactly:
    every LoRA weight of the checkpoint names a LoRA module of `model` with the same shape, and every LoRA
    module gets both its weights. Anything else is a BackendError naming the file (a checkpoint whose keys
    match no module would otherwise load nothing and train from scratch without a word). The file's own
    scale (alpha / rank from a diffusers file's metadata or `.alpha` tensors; 1 for a DiffSynth-layout file,
    which folds it into lora_A) is carried over into the adapter's scale, so the adapter computes what the
    file means. A LoKr or LoHa run reads a LyCORIS-layout file of its kind the same way (`read_lycoris_file`).
    """
    config = model.peft_config[ADAPTER]
    kind = config_kind(config)
    held = _held_kind(path) if kind in LYCORIS_KINDS else lycoris_kind(path)
    if kind in LYCORIS_KINDS or held is not None:
        if not held:
            raise BackendError(f"holds no {KIND_TITLES[kind][2:]} weights (LyCORIS' {_PARTS_SHOWN[kind]} keys) for this "
                               f"{KIND_TITLES[kind][2:]} run to continue from", source=str(path))
        if held != kind:
            raise BackendError(f"the checkpoint is {KIND_TITLES[held]} and this run trains {KIND_TITLES[kind]}; give "
                               f"the --lora_type it was trained with ({held})", source=str(path))
        _load_lycoris_checkpoint(model, slot, path, prefixes)
        return
    scale = adapter_scale(config.to_dict())
    lora = read_lora_file(path, slot, prefixes, roots=_roots(model), config=_config(model))
    picked = {k: v * (lora.scales[k.rsplit(".lora_", 1)[0]] / scale) if ".lora_A." in k
              and lora.scales[k.rsplit(".lora_", 1)[0]] != scale else v for k, v in lora.weights.items()}
    expected = {k: v.shape for k, v in lora_state_dict(model).items()}
    if lora.dora != bool(getattr(config, "use_dora", False)):
        raise BackendError(f"the checkpoint is {'a DoRA' if lora.dora else 'a plain LoRA'} and this run trains "
                           f"{'a DoRA' if getattr(config, 'use_dora', False) else 'a plain LoRA'}; give the "
                           f"--lora_type it was trained with ({'dora' if lora.dora else 'lora'})", source=str(path))
    _fit(picked, expected, slot, path)
    _set_adapter(model, slot, picked, path)


def _load_lycoris_checkpoint(model: torch.nn.Module, slot: str, path: str | Path, prefixes: Mapping[str, str]) -> None:
    """A LyCORIS-layout LoKr / LoHa into the run's adapter of the same kind. Each module's scale as the file means it
    (`lycoris_scale`) is carried into the adapter's own (peft's alpha / rank) through the tensor the product is linear
    in (lokr_w1, or hada_w1_a), so the adapter computes what the file means."""
    lyco = read_lycoris_file(path, slot, prefixes, module_names(model), _roots(model))
    modules = dict(model.named_modules())
    picked: dict[str, torch.Tensor] = {}
    for module, parts in lyco.parts.items():
        scaling = getattr(modules.get(module), "scaling", None)
        own = scaling.get(ADAPTER) if isinstance(scaling, dict) else None
        for part, value in parts.items():
            if own and part in _SCALED_PART and lyco.scales[module] != own:
                value = value.float() * (lyco.scales[module] / own)
            picked[f"{module}.{part}"] = value
    _fit(picked, {k: v.shape for k, v in lora_state_dict(model).items()}, slot, path)
    _set_adapter(model, slot, picked, path)


def merge_preset_lora(model: torch.nn.Module, slot: str, path: str | Path, prefix: str,
                      prefixes: Optional[Mapping[str, str]] = None) -> int:
    """Add a LoRA's delta (scale * B @ A) into the base weights of `model`; returns the modules changed.

    The file is read by `read_lora_file` (either layout; keys with or without the slot prefix; alpha from
    `.alpha` tensors or the adapter metadata, default alpha = rank, i.e. scale 1). With the family's
    `prefixes`, a key under a prefix of no model slot is refused as for --lora_checkpoint; without them
    (only this slot's `prefix` known) other models' weights are left out. Modules the model does not have,
    or that have only one of lora_A and lora_B, are left out; a file that changes no module is refused.
    """
    path = Path(path)
    if lycoris_kind(path) is not None:
        return _merge_lycoris(model, slot, path, prefixes or {slot: prefix}, strict=prefixes is not None)
    lora = read_lora_file(path, slot, prefixes or {slot: prefix}, roots=_roots(model), strict=prefixes is not None,
                          config=_config(model))
    modules = dict(model.named_modules())
    merges = []
    for name in lora.modules:  # every delta checked to fit before any weight changes
        a, b = lora.weights.get(f"{name}.lora_A.weight"), lora.weights.get(f"{name}.lora_B.weight")
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if a is None or b is None or not isinstance(weight, torch.Tensor):
            continue
        if b.shape[0] != weight.shape[0] or b.shape[0] * a.shape[1] != weight.numel():
            raise BackendError(f"preset LoRA weight {name} does not fit {slot} (its delta is {b.shape[0]} x {a.shape[1]}, "
                               f"the weight {list(weight.shape)})", source=str(path))
        merges.append((name, weight, a, b))
    with torch.no_grad():
        for name, weight, a, b in merges:
            delta = (b.float() @ a.float()) * lora.scales[name]
            magnitude = lora.weights.get(f"{name}.lora_magnitude_vector")
            if magnitude is None:
                weight.add_(delta.to(weight.dtype).view_as(weight))
                continue
            # DoRA, as peft computes it: the adapted weight's rows rescaled to the magnitudes
            adapted = weight.float().reshape(weight.shape[0], -1) + delta
            rows = adapted.norm(p=2, dim=1, keepdim=True)
            weight.copy_((adapted * (magnitude.float().reshape(-1, 1) / rows)).to(weight.dtype).view_as(weight))
    changed = len(merges)
    if changed == 0:
        raise BackendError(f"preset LoRA changes no module of {slot}", source=str(path))
    return changed


def _merge_lycoris(model: torch.nn.Module, slot: str, path: Path, prefixes: Mapping[str, str], strict: bool) -> int:
    """A LyCORIS-layout LoKr / LoHa preset merged as merge_preset_lora merges a LoRA: each module's scaled product
    (`lycoris_delta` times `lycoris_scale`) added to its weight, every delta checked to fit before any weight changes;
    modules the model does not have are left out, and a file that changes no module is refused."""
    lyco = read_lycoris_file(path, slot, prefixes, module_names(model), _roots(model), strict=strict)
    modules = dict(model.named_modules())
    merges = []
    for name in lyco.modules:
        weight = getattr(modules.get(name), "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        delta = lycoris_delta(lyco.kinds[name], lyco.parts[name])
        if delta.shape[0] != weight.shape[0] or delta.numel() != weight.numel():
            raise BackendError(f"preset {KIND_TITLES[lyco.kinds[name]][2:]} weight {name} does not fit {slot} (its delta "
                               f"is {list(delta.shape)}, the weight {list(weight.shape)})", source=str(path))
        merges.append((weight, delta * lyco.scales[name]))
    if not merges:
        raise BackendError(f"preset LoRA changes no module of {slot}", source=str(path))
    with torch.no_grad():
        for weight, delta in merges:
            weight.add_(delta.reshape(weight.shape).to(weight.dtype))
    return len(merges)

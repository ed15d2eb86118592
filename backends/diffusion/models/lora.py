"""LoRA adapters through peft, on any torch module (a diffusers DiT, a transformers text encoder).

Adapters are injected with peft's own `inject_adapter_in_model`, not through the model library's
`add_adapter` wrapper: transformers 5's wrapper refuses the peft version on the registry, while the
injection itself works for every torch module. Checkpoint keys carry the slot's diffusers pipeline
prefix (`transformer.` for the DiT, see `family.ModelSlot.lora_prefix`); `train/checkpoints.py` writes them.
Every LoRA file a user hands in (`--lora_checkpoint`, `--preset_lora_path`, `unitgraph lora convert`) is read
by one reader, `read_lora_file`, which checks the whole file before any weight is used.
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
from ..tensorfile import load_tensors, metadata_object, read_header

METADATA_KEY = "lora_adapter_metadata"
ADAPTER = "default"


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


def add_lora(model: torch.nn.Module, slot: str, targets: list[str], rank: int, alpha: float | None, seed: int):
    """Attach a trainable LoRA adapter (only its weights trainable); the init draws from a stream derived from --seed.

    Target names that match no module of `model` are reported as such; any other refusal by peft is
    reported with peft's own words (it is not a matter of module names then).
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=list(targets),
                        lora_dropout=0.0, init_lora_weights=True)
    from .shards import inject_adapters

    with seeded_global_stream(seed, "lora_init", slot):
        try:  # on a model built without weights (FSDP2), with the same initial values (models/shards.py)
            inject_adapters(model, lambda target: inject_adapter_in_model(config, target, adapter_name=ADAPTER))
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "not found in the base model" in first or type(exc).__name__ == "NoMatchingPeftModuleError":
                raise BackendError(f"--lora_target_modules {','.join(targets)}: no such modules in {slot}") from None
            raise BackendError(f"peft cannot add a LoRA adapter to {slot}: {first}") from None
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return config


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
    DiffSynth-layout file has the scale folded into lora_A); scales: what each module's `B @ A` is scaled by
    (alpha / rank from a `.alpha` tensor or the header's adapter metadata, else 1); unpaired: modules with
    only one of the two; alpha: the header's alpha for the slot (None when it gives none).
    """

    path: Path
    layout: str  # "diffusers" or "diffsynth"
    weights: dict[str, torch.Tensor]
    ranks: dict[str, int]
    scales: dict[str, float]
    unpaired: tuple[str, ...]
    alpha: Optional[float]
    metadata: dict[str, Any]

    @property
    def modules(self) -> list[str]:
        return sorted(self.ranks)


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
                   strict: bool = True) -> LoraFile:
    """The LoRA of `slot` in the LoRA file at `path`, every part of the file checked first; one BackendError line
    naming the file and the problem otherwise.

    The file: a whole safetensors file (not truncated); its header's adapter metadata a JSON object whose alphas
    are positive finite numbers and ranks positive integers; every LoRA tensor (`<module>.lora_A[.default].weight`,
    `...lora_B...`) 2-D and floating, lora_A [rank, in] and lora_B [out, rank] of one rank, finite; `.alpha`
    tensors single positive numbers; every LoRA key under a prefix of a model slot of the family (`prefixes`: slot
    -> its diffusers prefix, the denoiser first) or, without a prefix, a module name of `slot` (`roots`: the
    top-level module names of its model, when it is at hand); and some LoRA weights for `slot`.
    """
    path = Path(path)
    source = str(path)
    header = read_header(path, source)
    meta = metadata_object(header, METADATA_KEY, source) or {}
    _check_adapter_metadata(meta, source)
    lora_keys, alpha_keys = {}, {}
    for key, info in header.tensors.items():
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
    alphas = {}
    for key, info in alpha_keys.items():
        owner = _owner(key[:-len(".alpha")], prefixes, slot, roots, False, source)
        if owner not in pairs:
            continue
        if info.numel != 1 or len(info.shape) > 1 or info.dtype in ("BOOL", "C64"):
            raise BackendError(f"LoRA alpha {key[:80]} is {info.describe()}, not a single number", source=source)
        if owner[0] == slot:
            alphas[key] = owner[1]
    tensors = load_tensors(path, header, source, [*wanted, *alphas])
    weights: dict[str, torch.Tensor] = {}
    for key, (module, h) in sorted(wanted.items()):
        value = tensors[key]
        if not torch.isfinite(value.float()).all():
            raise BackendError(f"LoRA tensor {key[:80]} holds NaN or infinite values", source=source)
        weights[f"{module}.lora_{h}.weight"] = value
    module_alpha = {}
    for key, module in alphas.items():
        value = float(tensors[key].reshape(()).float())
        if not _positive(value):
            raise BackendError(f"LoRA alpha {key[:80]} is {value}, not a positive finite number", source=source)
        module_alpha[module] = value
    base = float(alpha) if alpha is not None and layout == "diffusers" else None
    scales = {m: module_alpha[m] / r if m in module_alpha else base / r if base is not None else 1.0
              for m, r in ranks.items()}
    unpaired = tuple(sorted(m for (owner, m), half in pairs.items() if owner == slot and len(half) == 1))
    return LoraFile(path, layout, weights, ranks, scales, unpaired, base, meta)


def _roots(model: torch.nn.Module) -> set[str]:
    """The top-level module names of `model`: what a LoRA key saved without a prefix starts with."""
    return {name for name, _ in model.named_children()}


def load_lora_checkpoint(model: torch.nn.Module, slot: str, path: str | Path, prefixes: Mapping[str, str]) -> None:
    """Load LoRA weights of `slot` from a checkpoint of either layout into the adapter of `model`.

    The file is read by `read_lora_file` (checked whole: see there). It must then fit the adapter exactly:
    every LoRA weight of the checkpoint names a LoRA module of `model` with the same shape, and every LoRA
    module gets both its weights. Anything else is a BackendError naming the file (a checkpoint whose keys
    match no module would otherwise load nothing and train from scratch without a word). The file's own
    scale (alpha / rank from a diffusers file's metadata or `.alpha` tensors; 1 for a DiffSynth-layout file,
    which folds it into lora_A) is carried over into the adapter's scale, so the adapter computes what the
    file means.
    """
    from peft.utils import set_peft_model_state_dict

    config = model.peft_config[ADAPTER]
    scale = float(config.lora_alpha) / float(config.r)
    lora = read_lora_file(path, slot, prefixes, roots=_roots(model))
    picked = {k: v * (lora.scales[k.rsplit(".lora_", 1)[0]] / scale) if ".lora_A." in k
              and lora.scales[k.rsplit(".lora_", 1)[0]] != scale else v for k, v in lora.weights.items()}
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
    lora = read_lora_file(path, slot, prefixes or {slot: prefix}, roots=_roots(model), strict=prefixes is not None)
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
            weight.add_(delta.to(weight.dtype).view_as(weight))
    changed = len(merges)
    if changed == 0:
        raise BackendError(f"preset LoRA changes no module of {slot}", source=str(path))
    return changed

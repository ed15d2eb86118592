"""A model's module names in its release checkpoint, against diffusers' names of the same modules.

ComfyUI builds each model from its own classes, named as the release checkpoint names its weights (a DiT's
`double_blocks.0.img_attn.qkv`, a UNet's `input_blocks.1.1.proj_in`), and reads a LoRA whose keys are
`diffusion_model.<that name>.lora_up.weight` / `.lora_down.weight` / `.alpha` (comfy/lora.py, model_lora_keys_unet:
every weight of the model is a key of its "generic" LoRA format). A family says how its denoiser's diffusers
modules are named there (`ModelSlot.comfyui`, families/<family>/comfyui.py); the LoRA writer
(train/checkpoints.to_comfyui) and reader (models/lora.read_comfyui_file) use that and nothing family-specific.

Where a release module computes several diffusers modules in one matmul (q, k and v in one), its rows are theirs
stacked in order: a `Fused` names the parts with their relative row counts (a single block's linear1 may be q, k,
v of the hidden width each, then an MLP input of four times it). `swap_halves`: the release module's rows are the
diffusers module's with its two halves exchanged (an AdaLayerNormContinuous' (scale, shift) is the release's
(shift, scale)). `UNetNames`: the LDM names of diffusers' UNet2DConditionModel, which depend on its layers per
block. No torch here: names and numbers only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Fused:
    """One release module: its name, the diffusers modules whose output rows it stacks ((name, relative rows), in row
    order; one part for a module that is only renamed), and whether its rows are the part's with halves exchanged."""

    release: str
    parts: tuple[tuple[str, int], ...]
    swap_halves: bool = False


@dataclass(frozen=True)
class Rule:
    """A release module name template and its parts' templates: `{i}`-like fields are block numbers, `{rest}` any
    remaining dotted path (the same in both names)."""

    release: str
    parts: tuple[tuple[str, int], ...]
    swap_halves: bool = False


def _pattern(template: str) -> re.Pattern[str]:
    out, at = [], 0
    for match in _PLACEHOLDER.finditer(template):
        out.append(re.escape(template[at:match.start()]))
        name = match.group(1)
        out.append(f"(?P<{name}>.+)" if name.startswith("rest") else f"(?P<{name}>[0-9]+)")
        at = match.end()
    out.append(re.escape(template[at:]))
    return re.compile("".join(out))


def rule(release: str, *parts: Any, swap_halves: bool = False) -> Rule:
    """A Rule; each part a diffusers template, or (template, relative rows) for a part of a fused module."""
    return Rule(release, tuple((p, 1) if isinstance(p, str) else (p[0], int(p[1])) for p in parts), swap_halves)


class ReleaseNames:
    """A family's release names by rules (first match wins, both ways); names no rule matches are the same in both
    (`identity`) or, without it, no module of the release. `roots`: the first name components a release module of
    the family can have (a LoRA of another family's modules is told apart by them)."""

    def __init__(self, *rules: Rule, identity: bool = False, roots: tuple[str, ...] = ()):
        self.rules = rules
        self.identity = identity
        self._release = [(_pattern(r.release), r) for r in rules]
        self._parts = [(_pattern(p), r, i) for r in rules for i, (p, _) in enumerate(r.parts)]
        self.roots = frozenset(roots) | {r.release.split(".")[0] for r in rules}

    def for_config(self, config: Optional[Mapping[str, Any]] = None, modules: tuple[str, ...] = ()) -> "ReleaseNames":
        """The names for a model of `config` (its diffusers config.json): the same for every size here."""
        return self

    def structure(self) -> dict[str, Any]:
        """What the names depend on, for a file's header (`for_config` takes it back): nothing here."""
        return {}

    def release(self, module: str) -> Optional[Fused]:
        """The release module holding diffusers `module`'s rows; None when the release has no such module."""
        for pattern, r, _ in self._parts:
            match = pattern.fullmatch(module)
            if match is not None:
                return _fill(r, match.groupdict())
        return Fused(module, ((module, 1),)) if self.identity and module.split(".")[0] in self.roots else None

    def diffusers(self, name: str) -> Optional[Fused]:
        """The release module `name` and its diffusers parts; None when the family's release has no such module."""
        for pattern, r in self._release:
            match = pattern.fullmatch(name)
            if match is not None:
                return _fill(r, match.groupdict())
        return Fused(name, ((name, 1),)) if self.identity and name.split(".")[0] in self.roots else None


def _fill(r: Rule, fields: Mapping[str, str]) -> Fused:
    return Fused(r.release.format(**fields), tuple((p.format(**fields), n) for p, n in r.parts), r.swap_halves)


# ---- diffusers' UNet2DConditionModel in the LDM (CompVis) names

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_RESNET_BACK = {v: k for k, v in _RESNET.items()}
_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0",
        "conv_out": "out.2"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_DOWN = re.compile(r"(down|up)_blocks\.([0-9]+)\.(resnets|attentions)\.([0-9]+)\.(.+)")
_SAMPLER = re.compile(r"(down|up)_blocks\.([0-9]+)\.(downsamplers|upsamplers)\.0\.conv")
_MID = re.compile(r"mid_block\.(resnets|attentions)\.([0-9]+)\.(.+)")
_LDM = re.compile(r"(input_blocks|output_blocks)\.([0-9]+)\.([0-9]+)\.(.+)")
_MIDDLE = re.compile(r"middle_block\.([0-9]+)\.(.+)")
RELEASED_LAYERS_PER_BLOCK = 2  # every released SD-style UNet's (1.x, 2.x, XL)


def _one(release: str, module: str) -> Fused:
    return Fused(release, ((module, 1),))


class UNetNames:
    """diffusers' UNet2DConditionModel against the LDM names of its release checkpoint (ComfyUI's UNet classes and
    the original .ckpt / .safetensors files): input_blocks.k is down block (k-1) // (L+1), its layer (k-1) % (L+1)
    (a resnet at .0, its attention at .1; the last layer of a block its downsampler, `.0.op`), output_blocks.k up block
    k // (L+1), layer k % (L+1) (L+1 layers, its upsampler after the last's resnet and attention), with L the layers
    per block; the resnets' layers and the embeddings are renamed, the attentions keep their inner names."""

    roots = frozenset({"input_blocks", "output_blocks", "middle_block", "time_embed", "label_emb", "out"})

    def __init__(self, layers: int = RELEASED_LAYERS_PER_BLOCK, up_attention: Optional[frozenset[int]] = None):
        self.layers = layers
        self.up_attention = up_attention  # the up blocks with attentions; None: not known (only the LoRA's names tell)

    def for_config(self, config: Optional[Mapping[str, Any]] = None, modules: tuple[str, ...] = ()) -> "UNetNames":
        """The names for a UNet of `config` (its config.json, or a file header's `structure()`); without one, the layers
        per block the LoRA's own up-block modules show (an up block has L+1 layers; a LoRA's targets reach every block
        alike), else the released UNets'."""
        if config is not None and isinstance(config.get("layers_per_block"), int) and config["layers_per_block"] > 0:
            if isinstance(config.get("up_attention"), list):  # `structure()`, as a file's header keeps it
                return UNetNames(int(config["layers_per_block"]),
                                 frozenset(i for i in config["up_attention"] if isinstance(i, int)))
            types = config.get("up_block_types") or ()
            return UNetNames(int(config["layers_per_block"]),
                             frozenset(i for i, t in enumerate(types) if "CrossAttn" in str(t)) if types else None)
        ups = [m for m in map(_DOWN.fullmatch, modules) if m is not None and m.group(1) == "up"]
        layers = max((int(m.group(4)) for m in ups), default=RELEASED_LAYERS_PER_BLOCK)
        attention = frozenset(int(m.group(2)) for m in ups if m.group(3) == "attentions")
        return UNetNames(layers, attention if attention else None)

    def structure(self) -> dict[str, Any]:
        """The layers per block (and the up blocks with attentions, where known), for a file's header: a reader without
        the model takes the names back from it (`for_config`)."""
        up = {"up_attention": sorted(self.up_attention)} if self.up_attention is not None else {}
        return {"layers_per_block": self.layers, **up}

    def release(self, module: str) -> Optional[Fused]:
        width = self.layers + 1
        if module in _TOP:
            return _one(_TOP[module], module)
        match = _DOWN.fullmatch(module)
        if match is not None:
            side, block, kind, layer, rest = match.groups()
            block, layer = int(block), int(layer)
            if layer >= (self.layers if side == "down" else width):
                return None
            index = 1 + block * width + layer if side == "down" else block * width + layer
            where = "input_blocks" if side == "down" else "output_blocks"
            if kind == "attentions":
                return _one(f"{where}.{index}.1.{rest}", module)
            return _one(f"{where}.{index}.0.{_RESNET[rest]}", module) if rest in _RESNET else None
        match = _SAMPLER.fullmatch(module)
        if match is not None:
            side, block = match.group(1), int(match.group(2))
            if side == "down":
                return _one(f"input_blocks.{(block + 1) * width}.0.op", module)
            if self.up_attention is None:
                return None  # its place (after an attention or not) is not known: refused by the writer
            return _one(f"output_blocks.{block * width + self.layers}.{2 if block in self.up_attention else 1}.conv", module)
        match = _MID.fullmatch(module)
        if match is not None:
            kind, index, rest = match.group(1), int(match.group(2)), match.group(3)
            if kind == "attentions" and index == 0:
                return _one(f"middle_block.1.{rest}", module)
            if kind == "resnets" and index in (0, 1) and rest in _RESNET:
                return _one(f"middle_block.{2 * index}.{_RESNET[rest]}", module)
        return None

    def diffusers(self, name: str) -> Optional[Fused]:
        width = self.layers + 1
        if name in _TOP_BACK:
            return _one(name, _TOP_BACK[name])
        middle = _MIDDLE.fullmatch(name)
        if middle is not None:
            index, rest = int(middle.group(1)), middle.group(2)
            if index == 1:
                return _one(name, f"mid_block.attentions.0.{rest}")
            if index in (0, 2) and rest in _RESNET_BACK:
                return _one(name, f"mid_block.resnets.{index // 2}.{_RESNET_BACK[rest]}")
            return None
        match = _LDM.fullmatch(name)
        if match is None:
            return None
        where, index, position, rest = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        if where == "input_blocks":
            if index == 0:
                return None
            block, layer = divmod(index - 1, width)
            if layer == self.layers:
                return _one(name, f"down_blocks.{block}.downsamplers.0.conv") if (position, rest) == (0, "op") else None
            side = f"down_blocks.{block}"
        else:
            block, layer = divmod(index, width)
            if rest == "conv" and position in (1, 2) and layer == self.layers:
                return _one(name, f"up_blocks.{block}.upsamplers.0.conv")
            side = f"up_blocks.{block}"
        if position == 0 and rest in _RESNET_BACK:
            return _one(name, f"{side}.resnets.{layer}.{_RESNET_BACK[rest]}")
        if position == 1:
            return _one(name, f"{side}.attentions.{layer}.{rest}")
        return None

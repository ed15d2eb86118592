"""FLUX.1's release single files in Black Forest Labs' layout, turned into diffusers' modules.

Black Forest Labs publish FLUX.1 as two files beside the diffusers folders, and DiffSynth-Studio's FLUX
commands name them: `flux1-dev.safetensors`, the DiT as their reference code (`flux/model.py`) names its
parameters, and `ae.safetensors`, the autoencoder as their `flux/modules/autoencoder.py` (the LDM one) names
its. `TRANSFORMER` and `AUTOENCODER` read them as `FluxTransformer2DModel` and `AutoencoderKL`: `matches`
tells the layout from the header's names, `config` derives the diffusers config.json from the shapes
alone (so a file of any width and depth is read as what it is, not as the released size), `convert`
renames and reshapes the tensors into the diffusers state dict.

The DiT. Names map one to one (`img_in` is `x_embedder`, `txt_in` `context_embedder`, `time_in` /
`guidance_in` / `vector_in` the time, guidance and pooled-text embedders, a double block's `img_*` / `txt_*`
its image and text streams, `*_mod.lin` the AdaLayerNormZero linears, whose six chunks (shift, scale, gate
twice) are already in diffusers' order), except where the reference code fuses what diffusers keeps apart:

  * a double block's `img_attn.qkv` / `txt_attn.qkv` compute q, k and v in one matmul, their rows in that
    order (the reference rearranges `(K H D)` with K=3 outermost): split in three equal row blocks into
    `to_q/to_k/to_v` and `add_q_proj/add_k_proj/add_v_proj`;
  * a single block's `linear1` computes q, k, v and the MLP's input at once (rows 3 x hidden, then
    4 x hidden): split into `attn.to_q/to_k/to_v` and `proj_mlp`; `linear2` takes the attention output
    and the activated MLP concatenated in the same order as diffusers' `proj_out`, so it maps unchanged;
  * the final layer's `adaLN_modulation.1` yields (shift, scale) while diffusers' AdaLayerNormContinuous
    chunks its linear as (scale, shift): its two row halves are exchanged.

The head size is the length of a q norm's scale (the hidden width alone leaves heads x size open); the MLP
must be 4 x hidden, the one width diffusers' blocks build; `patch_size` is 1, as in every diffusers FLUX
config, since the pipeline packs 2x2 latent patches itself and `img_in`'s input width counts them.

The autoencoder. The encoder's `down.N` levels are diffusers' `down_blocks.N`; the decoder's `up.N` are
numbered by resolution (the reference builds them from the lowest level and prepends each), diffusers'
`up_blocks` in the order they run, so `up.N` is `up_blocks.(levels-1-N)`. The mid-block's attention is
four 1x1 convolutions (`q`, `k`, `v`, `proj_out`) where diffusers has Linear layers: a 1x1 convolution is
the same matmul, so their weights lose the two unit dimensions. GroupNorm's group count leaves no trace in
the weights; the reference code always uses 32.

Only the values no shape can tell come from elsewhere: the rotary axes' split of the head size, the VAE's
latent scaling and shift, its group count, from the diffusers config found beside the file (`beside`), or
else FLUX.1's released values where they fit; a config beside the file that contradicts its shapes is
refused, since it describes another model. Every tensor of the file is used exactly once; splits are
views and a reshape of a contiguous tensor is a view, so the one copy made is the final layer's exchange of
halves. No torch is imported here: the tensors' own methods do the work.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import torch

Shapes = Mapping[str, Sequence[int]]

# FLUX.1's released values for what an autoencoder's weights cannot tell: its vae/config.json's, the group
# count fixed in the reference code (the DiT's rotary split, (16, 56, 56) of 128, is `rope_axes`)
FLUX_VAE_DEFAULTS = {"norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611,
                     "shift_factor": 0.1159, "force_upcast": True}
FLUX_LATENT_CHANNELS = 16
MLP_RATIO = 4  # diffusers' FLUX blocks fix the MLP at 4 x hidden, as the released model has it

_SHOWN = 3  # names quoted in a message before "and N more"


@dataclass(frozen=True)
class _Move:
    """Where one tensor of the file goes: its expected shape, the diffusers names of its parts, each with its
    rows along dim 0 (a single part is the whole tensor), and the transform it needs first, if any."""

    shape: tuple[int, ...]
    parts: tuple[tuple[str, int], ...]
    transform: str = ""  # "", "swap_halves" (final adaLN) or "conv_to_linear" (VAE attention weights)


Plan = dict[str, _Move]


@dataclass(frozen=True)
class SingleFileFormat:
    """One single-file layout: how to recognise it, the diffusers config it implies, and the conversion."""

    description: str
    class_name: str
    markers: tuple[str, ...]  # tensor names that together identify the layout
    structure: Callable[[Shapes], dict[str, Any]]  # the config values the shapes fix
    extras: Callable[[dict[str, Any], Mapping[str, Any]], dict[str, Any]]  # the values they cannot tell
    plan: Callable[[dict[str, Any]], Plan]  # every tensor a file of that structure holds, and where it goes

    def matches(self, shapes: Shapes) -> bool:
        """True when the header's names are this layout's (the shapes are checked by `config` and `convert`)."""
        return all(name in shapes for name in self.markers)

    def config(self, shapes: Shapes, beside: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """The diffusers config.json content for a file of these shapes; `beside`, a diffusers config found
        next to the file, gives only what the shapes cannot tell and must agree with them on the rest."""
        beside = dict(beside or {})
        structure = self.structure(shapes)
        _check_agreement(self.class_name, structure, beside)
        return {"_class_name": self.class_name, **structure, **self.extras(structure, beside)}

    def convert(self, tensors: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """The diffusers state dict of these tensors; ValueError when they are not a whole file of this layout."""
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        plan = self.plan(self.structure(shapes))
        _check_names(self.description, plan, shapes)
        _check_shapes(self.description, plan, shapes)
        return _apply(plan, tensors)


# ---- reading shapes


def _shape(shapes: Shapes, name: str, ndim: int) -> tuple[int, ...]:
    """The shape of tensor `name`, which must exist with `ndim` dimensions, none empty."""
    if name not in shapes:
        raise ValueError(f"the file has no tensor {name}")
    shape = tuple(int(n) for n in shapes[name])
    if len(shape) != ndim or any(n < 1 for n in shape):
        raise ValueError(f"tensor {name} has shape {list(shape)}, expected {ndim} non-empty dimensions")
    return shape


def _count(shapes: Shapes, prefix: str) -> int:
    """How many numbered children `prefix.0.`, `prefix.1.`, ... the names hold; they must be numbered
    without a gap (a bogus index would otherwise make the plan of a huge model)."""
    pattern = re.compile(re.escape(prefix) + r"\.([0-9]+)\.")
    found = {int(m.group(1)) for name in shapes if (m := pattern.match(name))}
    count = len(found)
    if found and max(found) != count - 1:
        gap = min(set(range(count + 1)) - found)
        raise ValueError(f"{prefix} is numbered up to {max(found)} but has no {prefix}.{gap}")
    return count


def _summary(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _tensors(count: int) -> str:
    return f"{count} tensor" + ("" if count == 1 else "s")


def _check_names(description: str, plan: Plan, shapes: Shapes) -> None:
    missing = [name for name in plan if name not in shapes]
    unexpected = sorted(name for name in shapes if name not in plan)
    problems = []
    if missing:
        problems.append(f"{_tensors(len(missing))} missing ({_summary(missing)})")
    if unexpected:
        problems.append(f"{_tensors(len(unexpected))} unexpected ({_summary(unexpected)})")
    if problems:
        raise ValueError(f"not {description}: " + ", ".join(problems))


def _check_shapes(description: str, plan: Plan, shapes: Shapes) -> None:
    wrong = [f"{name} is {list(shapes[name])}, expected {list(move.shape)}"
             for name, move in plan.items() if tuple(shapes[name]) != move.shape]
    if wrong:
        raise ValueError(f"inconsistent shapes for {description}: {_summary(wrong)}")


def _comparable(class_name: str, config: Mapping[str, Any], in_channels: int) -> dict[str, Any]:
    """A config's values as compared: lists for tuples, and a DiT's output channels spelled out (diffusers
    writes null for "as many as the input")."""
    values = {key: list(value) if isinstance(value, (list, tuple)) else value for key, value in config.items()}
    if class_name == "FluxTransformer2DModel" and "out_channels" in values and values["out_channels"] is None:
        values["out_channels"] = values.get("in_channels", in_channels)
    return values


def _check_agreement(class_name: str, structure: dict[str, Any], beside: Mapping[str, Any]) -> None:
    """A config beside the file that describes another model would give it wrong rotary axes or scaling."""
    named = beside.get("_class_name")
    if named is not None and named != class_name:
        raise ValueError(f"the config beside the file is for {named}, not {class_name}")
    ours = _comparable(class_name, structure, structure["in_channels"])
    theirs = _comparable(class_name, beside, structure["in_channels"])
    for key in structure:
        if key in theirs and theirs[key] != ours[key]:
            raise ValueError(f"the config beside the file gives {key}={theirs[key]!r}, the file's shapes {ours[key]!r}")


# ---- applying a plan


def _apply(plan: Plan, tensors: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    out: dict[str, "torch.Tensor"] = {}
    for name, move in plan.items():
        tensor = tensors[name]
        if move.transform == "swap_halves":
            tensor = tensor.roll(tensor.shape[0] // 2, dims=0)  # rolling by half the rows exchanges the halves
        elif move.transform == "conv_to_linear":
            tensor = tensor.flatten(1)  # (out, in, 1, 1) -> (out, in)
        if len(move.parts) == 1:
            out[move.parts[0][0]] = tensor
        else:
            pieces = tensor.split([rows for _, rows in move.parts], dim=0)
            out.update((target, piece) for (target, _), piece in zip(move.parts, pieces))
    return out


def _whole(plan: Plan, source: str, target: str, shape: tuple[int, ...], transform: str = "") -> None:
    plan[source] = _Move(shape, ((target, shape[0]),), transform)


def _linear(plan: Plan, source: str, target: str, rows: int, columns: int) -> None:
    _whole(plan, f"{source}.weight", f"{target}.weight", (rows, columns))
    _whole(plan, f"{source}.bias", f"{target}.bias", (rows,))


def _fused_linear(plan: Plan, source: str, targets: Sequence[tuple[str, int]], columns: int) -> None:
    """A linear whose output rows are several diffusers linears' stacked in order."""
    rows = sum(n for _, n in targets)
    plan[f"{source}.weight"] = _Move((rows, columns), tuple((f"{t}.weight", n) for t, n in targets))
    plan[f"{source}.bias"] = _Move((rows,), tuple((f"{t}.bias", n) for t, n in targets))


# ---- the DiT


def _head_dim(shapes: Shapes) -> int:
    """The head size, the length of the first block's q norm (the hidden width alone leaves heads x size open)."""
    for name in ("double_blocks.0.img_attn.norm.query_norm.scale", "single_blocks.0.norm.query_norm.scale"):
        if name in shapes:
            return _shape(shapes, name, 1)[0]
    raise ValueError("the file has no double_blocks.0 or single_blocks.0, so its head size cannot be told")


def _dit_structure(shapes: Shapes) -> dict[str, Any]:
    hidden, in_channels = _shape(shapes, "img_in.weight", 2)
    out_channels = _shape(shapes, "final_layer.linear.weight", 2)[0]
    head_dim = _head_dim(shapes)
    if hidden % head_dim:
        raise ValueError(f"the hidden width {hidden} is not a whole number of heads of size {head_dim}")
    return {
        "patch_size": 1,  # diffusers' FLUX packs 2x2 latent patches outside the model: in_channels counts them
        "in_channels": in_channels,
        "out_channels": None if out_channels == in_channels else out_channels,
        "num_layers": _count(shapes, "double_blocks"),
        "num_single_layers": _count(shapes, "single_blocks"),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": _shape(shapes, "txt_in.weight", 2)[1],
        "pooled_projection_dim": _shape(shapes, "vector_in.in_layer.weight", 2)[1],
        "guidance_embeds": "guidance_in.in_layer.weight" in shapes,
    }


def rope_axes(head_dim: int) -> list[int]:
    """FLUX.1's rotary split of a head, (16, 56, 56) of 128, scaled to another head size: the first axis (the
    ids' index axis) the even size nearest an eighth, the two spatial axes equal even halves of the rest."""
    first = 4 if head_dim % 4 == 0 else 2  # the rest, head_dim - first, must be a multiple of 4
    if head_dim % 2 or head_dim < first + 4:
        raise ValueError(f"the head size {head_dim} has no split into three even rotary axes; "
                         "give the transformer's config.json (axes_dims_rope) beside the file")
    first += 4 * max(0, math.floor((head_dim / 8 - first) / 4 + 0.5))
    first = min(first, head_dim - 4)
    return [first, (head_dim - first) // 2, (head_dim - first) // 2]


def _dit_extras(structure: dict[str, Any], beside: Mapping[str, Any]) -> dict[str, Any]:
    head_dim = structure["attention_head_dim"]
    axes = beside.get("axes_dims_rope")
    if axes is None:
        return {"axes_dims_rope": rope_axes(head_dim)}
    valid = (isinstance(axes, (list, tuple)) and len(axes) == 3
             and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 and n % 2 == 0 for n in axes))
    if not valid or sum(axes) != head_dim:
        raise ValueError(f"the config beside the file gives axes_dims_rope={axes!r}, not three even sizes "
                         f"that add up to the head size {head_dim}")
    return {"axes_dims_rope": list(axes)}


def _dit_plan(config: dict[str, Any]) -> Plan:
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    head, mlp = config["attention_head_dim"], MLP_RATIO * hidden
    out_channels = config["out_channels"] or config["in_channels"]
    plan: Plan = {}
    _linear(plan, "img_in", "x_embedder", hidden, config["in_channels"])
    _linear(plan, "txt_in", "context_embedder", hidden, config["joint_attention_dim"])
    embedders = [("time_in", "timestep_embedder", 256), ("vector_in", "text_embedder", config["pooled_projection_dim"])]
    if config["guidance_embeds"]:
        embedders.append(("guidance_in", "guidance_embedder", 256))
    for source, target, columns in embedders:
        _linear(plan, f"{source}.in_layer", f"time_text_embed.{target}.linear_1", hidden, columns)
        _linear(plan, f"{source}.out_layer", f"time_text_embed.{target}.linear_2", hidden, hidden)
    for i in range(config["num_layers"]):
        _double_block(plan, f"double_blocks.{i}", f"transformer_blocks.{i}", hidden, head, mlp)
    for i in range(config["num_single_layers"]):
        _single_block(plan, f"single_blocks.{i}", f"single_transformer_blocks.{i}", hidden, head, mlp)
    _linear(plan, "final_layer.linear", "proj_out", out_channels, hidden)
    _whole(plan, "final_layer.adaLN_modulation.1.weight", "norm_out.linear.weight", (2 * hidden, hidden), "swap_halves")
    _whole(plan, "final_layer.adaLN_modulation.1.bias", "norm_out.linear.bias", (2 * hidden,), "swap_halves")
    return plan


def _double_block(plan: Plan, src: str, dst: str, hidden: int, head: int, mlp: int) -> None:
    streams = (("img", "norm1", ("to_q", "to_k", "to_v"), "to_out.0", "norm_q", "norm_k", "ff"),
               ("txt", "norm1_context", ("add_q_proj", "add_k_proj", "add_v_proj"), "to_add_out",
                "norm_added_q", "norm_added_k", "ff_context"))
    for stream, norm, qkv, out, norm_q, norm_k, ff in streams:
        _linear(plan, f"{src}.{stream}_mod.lin", f"{dst}.{norm}.linear", 6 * hidden, hidden)
        _fused_linear(plan, f"{src}.{stream}_attn.qkv", [(f"{dst}.attn.{t}", hidden) for t in qkv], hidden)
        _whole(plan, f"{src}.{stream}_attn.norm.query_norm.scale", f"{dst}.attn.{norm_q}.weight", (head,))
        _whole(plan, f"{src}.{stream}_attn.norm.key_norm.scale", f"{dst}.attn.{norm_k}.weight", (head,))
        _linear(plan, f"{src}.{stream}_attn.proj", f"{dst}.attn.{out}", hidden, hidden)
        _linear(plan, f"{src}.{stream}_mlp.0", f"{dst}.{ff}.net.0.proj", mlp, hidden)
        _linear(plan, f"{src}.{stream}_mlp.2", f"{dst}.{ff}.net.2", hidden, mlp)


def _single_block(plan: Plan, src: str, dst: str, hidden: int, head: int, mlp: int) -> None:
    parts = [(f"{dst}.attn.to_q", hidden), (f"{dst}.attn.to_k", hidden), (f"{dst}.attn.to_v", hidden),
             (f"{dst}.proj_mlp", mlp)]
    _fused_linear(plan, f"{src}.linear1", parts, hidden)
    _linear(plan, f"{src}.linear2", f"{dst}.proj_out", hidden, hidden + mlp)
    _whole(plan, f"{src}.norm.query_norm.scale", f"{dst}.attn.norm_q.weight", (head,))
    _whole(plan, f"{src}.norm.key_norm.scale", f"{dst}.attn.norm_k.weight", (head,))
    _linear(plan, f"{src}.modulation.lin", f"{dst}.norm.linear", 3 * hidden, hidden)


# ---- the autoencoder


def _vae_structure(shapes: Shapes) -> dict[str, Any]:
    levels = _count(shapes, "encoder.down")
    if not levels:
        raise ValueError("the file has no encoder.down.0, so its levels cannot be told")
    return {
        "in_channels": _shape(shapes, "encoder.conv_in.weight", 4)[1],
        "out_channels": _shape(shapes, "decoder.conv_out.weight", 4)[0],
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "block_out_channels": [_shape(shapes, f"encoder.down.{i}.block.0.conv1.weight", 4)[0] for i in range(levels)],
        "layers_per_block": _count(shapes, "encoder.down.0.block"),
        "act_fn": "silu",  # the reference's swish
        "latent_channels": _shape(shapes, "decoder.conv_in.weight", 4)[1],
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": "encoder.mid.attn_1.q.weight" in shapes,
    }


def _vae_extras(structure: dict[str, Any], beside: Mapping[str, Any]) -> dict[str, Any]:
    """The group count, the latents' scaling and the sample size: from the config beside the file, else
    FLUX.1's. Its scaling and shift are statistics of its own 16-channel latents: for another latent width
    there is no value to fall back on."""
    values = {}
    for key, default in FLUX_VAE_DEFAULTS.items():
        if key in beside:
            values[key] = beside[key]
        elif key in ("scaling_factor", "shift_factor") and structure["latent_channels"] != FLUX_LATENT_CHANNELS:
            raise ValueError(f"a VAE with {structure['latent_channels']} latent channels has no FLUX.1 {key}; "
                             "give its config.json beside the file")
        else:
            values[key] = default
    groups, channels = values["norm_num_groups"], structure["block_out_channels"]
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or any(c % groups for c in channels):
        raise ValueError(f"norm_num_groups={groups!r} does not divide the VAE's channels {channels}; "
                         "give its config.json beside the file")
    return values


def _vae_plan(config: dict[str, Any]) -> Plan:
    channels, layers = config["block_out_channels"], config["layers_per_block"]
    latent, levels, attention = config["latent_channels"], len(channels), config["mid_block_add_attention"]
    plan: Plan = {}
    _conv(plan, "encoder.conv_in", "encoder.conv_in", channels[0], config["in_channels"], 3)
    for i in range(levels):
        block_in = channels[max(i - 1, 0)]
        for j in range(layers):
            _resnet(plan, f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}",
                    block_in if j == 0 else channels[i], channels[i])
        if i < levels - 1:
            _conv(plan, f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv",
                  channels[i], channels[i], 3)
    _mid(plan, "encoder", channels[-1], attention)
    _norm(plan, "encoder.norm_out", "encoder.conv_norm_out", channels[-1])
    _conv(plan, "encoder.conv_out", "encoder.conv_out", 2 * latent, channels[-1], 3)  # mean and log-variance

    _conv(plan, "decoder.conv_in", "decoder.conv_in", channels[-1], latent, 3)
    _mid(plan, "decoder", channels[-1], attention)
    for i in reversed(range(levels)):
        block = levels - 1 - i  # diffusers numbers the decoder's levels in the order they run
        block_in = channels[min(i + 1, levels - 1)]
        for j in range(layers + 1):
            _resnet(plan, f"decoder.up.{i}.block.{j}", f"decoder.up_blocks.{block}.resnets.{j}",
                    block_in if j == 0 else channels[i], channels[i])
        if i > 0:
            _conv(plan, f"decoder.up.{i}.upsample.conv", f"decoder.up_blocks.{block}.upsamplers.0.conv",
                  channels[i], channels[i], 3)
    _norm(plan, "decoder.norm_out", "decoder.conv_norm_out", channels[0])
    _conv(plan, "decoder.conv_out", "decoder.conv_out", config["out_channels"], channels[0], 3)
    return plan


def _conv(plan: Plan, source: str, target: str, rows: int, columns: int, kernel: int, transform: str = "") -> None:
    _whole(plan, f"{source}.weight", f"{target}.weight", (rows, columns, kernel, kernel), transform)
    _whole(plan, f"{source}.bias", f"{target}.bias", (rows,))


def _norm(plan: Plan, source: str, target: str, channels: int) -> None:
    _whole(plan, f"{source}.weight", f"{target}.weight", (channels,))
    _whole(plan, f"{source}.bias", f"{target}.bias", (channels,))


def _resnet(plan: Plan, src: str, dst: str, block_in: int, block_out: int) -> None:
    _norm(plan, f"{src}.norm1", f"{dst}.norm1", block_in)
    _conv(plan, f"{src}.conv1", f"{dst}.conv1", block_out, block_in, 3)
    _norm(plan, f"{src}.norm2", f"{dst}.norm2", block_out)
    _conv(plan, f"{src}.conv2", f"{dst}.conv2", block_out, block_out, 3)
    if block_in != block_out:
        _conv(plan, f"{src}.nin_shortcut", f"{dst}.conv_shortcut", block_out, block_in, 1)


def _mid(plan: Plan, side: str, channels: int, attention: bool) -> None:
    _resnet(plan, f"{side}.mid.block_1", f"{side}.mid_block.resnets.0", channels, channels)
    if attention:
        src, dst = f"{side}.mid.attn_1", f"{side}.mid_block.attentions.0"
        _norm(plan, f"{src}.norm", f"{dst}.group_norm", channels)
        for source, target in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")):
            _conv(plan, f"{src}.{source}", f"{dst}.{target}", channels, channels, 1, "conv_to_linear")
    _resnet(plan, f"{side}.mid.block_2", f"{side}.mid_block.resnets.1", channels, channels)


TRANSFORMER = SingleFileFormat(
    description="a FLUX.1 DiT in Black Forest Labs' single-file layout",
    class_name="FluxTransformer2DModel",
    markers=("img_in.weight", "txt_in.weight", "time_in.in_layer.weight", "vector_in.in_layer.weight",
             "final_layer.linear.weight"),
    structure=_dit_structure,
    extras=_dit_extras,
    plan=_dit_plan,
)

AUTOENCODER = SingleFileFormat(
    description="a FLUX.1 autoencoder in Black Forest Labs' single-file layout",
    class_name="AutoencoderKL",
    markers=("encoder.conv_in.weight", "encoder.down.0.block.0.conv1.weight", "decoder.conv_in.weight",
             "decoder.up.0.block.0.conv1.weight", "decoder.conv_out.weight"),
    structure=_vae_structure,
    extras=_vae_extras,
    plan=_vae_plan,
)

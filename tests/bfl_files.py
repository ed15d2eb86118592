"""Diffusers' FLUX.1 modules written as Black Forest Labs' release files, for tests of the single-file reader.

`write_bfl_transformer(transformer, path)` writes a `FluxTransformer2DModel` as `flux1-dev.safetensors` is
laid out, `write_bfl_autoencoder(vae, path)` an `AutoencoderKL` as `ae.safetensors` is (the names of BFL's
reference code, flux/model.py and flux/modules/autoencoder.py). The mapping here is written from the diffusers
side, by renaming rules and concatenations, independently of the reader
(backends/diffusion/families/flux/single_file.py), so a test that reads such a file back checks the reader
against a second reading of the two architectures rather than running it backwards. The tensors are made
contiguous and written as they are (dtype kept).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Union

import torch
from safetensors.torch import save_file

# diffusers name -> BFL name, first match wins; a callable replacement gets the match
Rule = tuple[str, Union[str, Callable[[re.Match], str]]]

_DIT_RENAMES: list[Rule] = [
    (r"^x_embedder\.", "img_in."),
    (r"^context_embedder\.", "txt_in."),
    (r"^time_text_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"^time_text_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"^time_text_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"^time_text_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (r"^time_text_embed\.text_embedder\.linear_1\.", "vector_in.in_layer."),
    (r"^time_text_embed\.text_embedder\.linear_2\.", "vector_in.out_layer."),
    (r"^transformer_blocks\.(\d+)\.norm1\.linear\.", r"double_blocks.\1.img_mod.lin."),
    (r"^transformer_blocks\.(\d+)\.norm1_context\.linear\.", r"double_blocks.\1.txt_mod.lin."),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_q\.weight$", r"double_blocks.\1.img_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_k\.weight$", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_q\.weight$", r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_k\.weight$", r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
    (r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.", r"double_blocks.\1.img_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.2\.", r"double_blocks.\1.img_mlp.2."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj\.", r"double_blocks.\1.txt_mlp.0."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.2\.", r"double_blocks.\1.txt_mlp.2."),
    (r"^single_transformer_blocks\.(\d+)\.norm\.linear\.", r"single_blocks.\1.modulation.lin."),
    (r"^single_transformer_blocks\.(\d+)\.proj_out\.", r"single_blocks.\1.linear2."),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_q\.weight$", r"single_blocks.\1.norm.query_norm.scale"),
    (r"^single_transformer_blocks\.(\d+)\.attn\.norm_k\.weight$", r"single_blocks.\1.norm.key_norm.scale"),
    (r"^proj_out\.", "final_layer.linear."),
]

# diffusers names whose tensors BFL stacks (along the output rows) into one: (pattern, BFL name, position)
_DIT_FUSED: list[tuple[str, str, int]] = [
    (r"^transformer_blocks\.(\d+)\.attn\.to_q\.(weight|bias)$", r"double_blocks.\1.img_attn.qkv.\2", 0),
    (r"^transformer_blocks\.(\d+)\.attn\.to_k\.(weight|bias)$", r"double_blocks.\1.img_attn.qkv.\2", 1),
    (r"^transformer_blocks\.(\d+)\.attn\.to_v\.(weight|bias)$", r"double_blocks.\1.img_attn.qkv.\2", 2),
    (r"^transformer_blocks\.(\d+)\.attn\.add_q_proj\.(weight|bias)$", r"double_blocks.\1.txt_attn.qkv.\2", 0),
    (r"^transformer_blocks\.(\d+)\.attn\.add_k_proj\.(weight|bias)$", r"double_blocks.\1.txt_attn.qkv.\2", 1),
    (r"^transformer_blocks\.(\d+)\.attn\.add_v_proj\.(weight|bias)$", r"double_blocks.\1.txt_attn.qkv.\2", 2),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_q\.(weight|bias)$", r"single_blocks.\1.linear1.\2", 0),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_k\.(weight|bias)$", r"single_blocks.\1.linear1.\2", 1),
    (r"^single_transformer_blocks\.(\d+)\.attn\.to_v\.(weight|bias)$", r"single_blocks.\1.linear1.\2", 2),
    (r"^single_transformer_blocks\.(\d+)\.proj_mlp\.(weight|bias)$", r"single_blocks.\1.linear1.\2", 3),
]


def _state(module_or_state: Any) -> dict[str, torch.Tensor]:
    state = module_or_state.state_dict() if hasattr(module_or_state, "state_dict") else module_or_state
    return {name: tensor.detach() for name, tensor in state.items()}


def _rename(name: str, rules: list[Rule]) -> str | None:
    for pattern, replacement in rules:
        if re.search(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def bfl_transformer_state(transformer: Any) -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel's (or its state dict's) tensors under BFL's names."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in _state(transformer).items():
        if name.startswith("norm_out.linear."):
            # diffusers' AdaLayerNormContinuous rows are (scale, shift); BFL's LastLayer chunks (shift, scale)
            scale, shift = tensor.chunk(2, dim=0)
            out["final_layer.adaLN_modulation.1." + name.rsplit(".", 1)[1]] = torch.cat([shift, scale])
            continue
        fused = next(((re.sub(p, target, name), pos) for p, target, pos in _DIT_FUSED if re.search(p, name)), None)
        if fused is not None:
            stacks.setdefault(fused[0], {})[fused[1]] = tensor
            continue
        renamed = _rename(name, _DIT_RENAMES)
        if renamed is None:
            raise AssertionError(f"no BFL name for the diffusers tensor {name}")
        out[renamed] = tensor
    for name, parts in stacks.items():
        out[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    return {name: tensor.contiguous() for name, tensor in sorted(out.items())}


def _vae_renames(levels: int) -> list[Rule]:
    up = lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}."  # noqa: E731  BFL numbers up levels by resolution
    return [
        (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
        (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
        (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
        (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.", r"encoder.down.\1.downsample.conv."),
        (r"^decoder\.up_blocks\.(\d+)\.(?=resnets|upsamplers)", up),
        (r"\.resnets\.(\d+)\.", r".block.\1."),
        (r"\.upsamplers\.0\.conv\.", ".upsample.conv."),
        (r"\.mid_block\.attentions\.0\.group_norm\.", ".mid.attn_1.norm."),
        (r"\.mid_block\.attentions\.0\.to_q\.", ".mid.attn_1.q."),
        (r"\.mid_block\.attentions\.0\.to_k\.", ".mid.attn_1.k."),
        (r"\.mid_block\.attentions\.0\.to_v\.", ".mid.attn_1.v."),
        (r"\.mid_block\.attentions\.0\.to_out\.0\.", ".mid.attn_1.proj_out."),
        (r"\.conv_norm_out\.", ".norm_out."),
        (r"\.conv_shortcut\.", ".nin_shortcut."),
    ]


def bfl_autoencoder_state(vae: Any) -> dict[str, torch.Tensor]:
    """An AutoencoderKL's (or its state dict's) tensors under the names of BFL's ae.safetensors."""
    state = _state(vae)
    levels = 1 + max(int(m.group(1)) for n in state if (m := re.match(r"encoder\.down_blocks\.(\d+)\.", n)))
    rules = _vae_renames(levels)
    out = {}
    for name, tensor in state.items():
        if re.search(r"quant_conv\.", name):
            raise AssertionError(f"BFL's FLUX autoencoder has no quant convolutions ({name})")
        renamed = name  # the rules rewrite different parts of a name: each that matches applies, in order
        for pattern, replacement in rules:
            renamed = re.sub(pattern, replacement, renamed)
        if ".mid.attn_1." in renamed and renamed.endswith(".weight") and tensor.ndim == 2:
            tensor = tensor.reshape(*tensor.shape, 1, 1)  # the reference's attention is 1x1 convolutions
        out[renamed] = tensor
    return {name: tensor.contiguous() for name, tensor in sorted(out.items())}


def write_bfl_transformer(transformer: Any, path: Union[str, Path]) -> Path:
    """Write a FluxTransformer2DModel as a BFL-layout single file (flux1-dev.safetensors); return its path."""
    return _save(bfl_transformer_state(transformer), path)


def write_bfl_autoencoder(vae: Any, path: Union[str, Path]) -> Path:
    """Write an AutoencoderKL as a BFL-layout single file (ae.safetensors); return its path."""
    return _save(bfl_autoencoder_state(vae), path)


def _save(tensors: dict[str, torch.Tensor], path: Union[str, Path]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path

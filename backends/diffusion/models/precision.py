"""Precision and memory of the loaded models: compute dtype, fp8 storage, fp32 adapters, checkpointing.

The rules (docs/memory.md says why, and how they differ from DiffSynth-Studio):

- **Compute dtype** (`--mixed_precision`, accelerate's names): frozen weights are loaded directly in it
  (`from_pretrained(torch_dtype=...)`, no fp32 copy first). Every unit and the loss run under
  `torch.autocast` in it (`UnitContext.autocast`), in every stage, so stage 1, stage 2 and the unsplit run compute each value in
  the same context, and split training stays exactly the unsplit run at any precision.
- **Trained parameters stay fp32**: a model in `--trainable_models` loads in fp32, and LoRA adapters are
  cast to fp32 after peft creates them (peft makes them in the base layer's dtype). diffusers, musubi-tuner,
  ai-toolkit and OneTrainer do the same; DiffSynth-Studio keeps LoRA in bf16.
- **fp8 storage** (`--fp8_models`): a frozen model's Linear, Conv and Embedding weights are stored as
  float8_e4m3fn and cast to the compute dtype one layer at a time as it runs (diffusers' layerwise
  casting). Norms, positional and patch embeddings, the input and output projections and LoRA adapters
  keep the compute dtype. Applied after the LoRA injection, so the adapters are never fp8.
- **Gradient checkpointing** recomputes each block's activations in the backward pass; with offload the
  tensors autograd keeps are held in CPU memory (`torch.autograd.graph.save_on_cpu`), as DiffSynth does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

from ..errors import BackendError

COMPUTE_DTYPES = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --mixed_precision -> torch dtype name
FP8_STORAGE = "float8_e4m3fn"
# Modules whose weights stay in the compute dtype under fp8 storage: diffusers' defaults for layerwise casting
# (small and precision-sensitive) plus the LoRA adapters, which train in fp32. Regexes on module names.
FP8_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$", "lora_")


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def adapters_to_fp32(model: Any) -> int:
    """Cast the LoRA adapter parameters of `model` to fp32 (peft creates them in the base layer's dtype).
    Returns the number of parameters cast."""
    import torch

    cast = 0
    for name, param in model.named_parameters():
        if "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.float()
            cast += param.numel()
    return cast


def store_fp8(model: Any, slot: str, compute_dtype: str) -> int:
    """Store `model`'s weights in float8_e4m3fn, computed layer by layer in `compute_dtype` (diffusers' layerwise
    casting). Returns the number of parameters now stored in fp8."""
    import torch
    from diffusers.hooks import apply_layerwise_casting

    trained = [name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name]
    if trained:  # pragma: no cover - config refuses --fp8_models on a trained model first
        raise BackendError(f"--fp8_models {slot}: its own weights train ({trained[0]}, ...); only frozen models can be fp8")
    apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch_dtype(compute_dtype),
                            skip_modules_pattern=FP8_SKIP_PATTERNS)
    return sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)


def enable_checkpointing(model: Any) -> bool:
    """Turn on gradient checkpointing in a diffusers or transformers model; False when it has none."""
    if hasattr(model, "enable_gradient_checkpointing"):
        model.enable_gradient_checkpointing()
        return True
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return True
    return False


def offloaded_activations(enabled: bool, device: Any) -> contextlib.AbstractContextManager:
    """Hold the tensors autograd saves for backward in CPU memory (pinned when an accelerator is there)."""
    if not enabled:
        return contextlib.nullcontext()
    import torch

    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return torch.autograd.graph.save_on_cpu(pin_memory=kind == "cuda")


def transformer_blocks(model: Any) -> list[Any]:
    """The repeated transformer blocks of a denoiser (every ModuleList of blocks, in order), for block swap."""
    import torch

    blocks: list[Any] = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList) and "block" in name:
            blocks.extend(child)
    return blocks


def swap_blocks(model: Any, slot: str, count: int, device: Any, report: Any = None) -> list[int]:
    """Keep the last `count` transformer blocks of `model` in CPU memory, each brought to `device` just before it
    runs on a separate stream (diffusers' group offloading, block by block). Returns the swapped block indices.

    Without an accelerator there is nothing to swap to: one note, no effect."""
    blocks = transformer_blocks(model)
    if count >= len(blocks):
        raise BackendError(f"--blocks_to_swap {count}: {slot} has {len(blocks)} transformer blocks; at most "
                           f"{max(len(blocks) - 1, 0)} can live in CPU memory")
    chosen = list(range(len(blocks) - count, len(blocks)))
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind != "cuda":
        if report is not None and count:
            report(f"note: --blocks_to_swap {count}: no accelerator here, so nothing is swapped (blocks "
                   f"{chosen[0]}-{chosen[-1]} of {slot} would live in CPU memory)")
        return chosen
    import torch
    from diffusers.hooks import apply_group_offloading

    for index in chosen:
        apply_group_offloading(blocks[index], onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="leaf_level", use_stream=True)
    return chosen


def parameter_bytes(params: Iterable[Any]) -> int:
    return sum(p.numel() * p.element_size() for p in params)

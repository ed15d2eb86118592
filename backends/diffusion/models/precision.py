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
  float8_e4m3fn and cast to the compute dtype one layer at a time as it runs; a Linear layer keeps only
  its fp8 weight for the backward pass (`store_fp8` says why). Norms, positional and patch embeddings, the
  input and output projections and LoRA adapters keep the compute dtype, as diffusers' layerwise casting
  leaves them. Applied after the LoRA injection, so the adapters are never fp8.
- **Gradient checkpointing** recomputes each block's activations in the backward pass; with offload the
  tensors autograd keeps are held in CPU memory (`torch.autograd.graph.save_on_cpu`), as DiffSynth does.
"""

from __future__ import annotations

import contextlib
from typing import Any

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
    """Store `model`'s weights in float8_e4m3fn, computed layer by layer in `compute_dtype`. Returns the number of
    parameters now stored in fp8.

    A frozen Linear layer computes through `_StoredLinear`, and a frozen zero-padded Conv1d/2d/3d layer (a UNet's)
    through `_StoredConv`: each keeps only its fp8 weight for the backward pass and casts it again there. diffusers'
    layerwise casting, made for inference, would leave the compute-dtype copy of every layer alive until the backward
    pass (autograd saves the weight a linear or convolution layer used), so a training step would hold the model in
    the compute dtype after all: measured on Stable Diffusion 1.5's UNet at 512 px, the dry run's activations were
    2.13 GiB with the hook against 1.03 GiB in plain bf16. Other convolutions (transposed, padded by name or by
    another mode) and Embedding layers take diffusers' layerwise casting hook. Modules matching FP8_SKIP_PATTERNS
    are left as they are, as diffusers leaves them.
    """
    import re

    import torch
    from diffusers.hooks.layerwise_casting import apply_layerwise_casting_hook

    trained = [name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name]
    if trained:  # pragma: no cover - config refuses --fp8_models on a trained model first
        raise BackendError(f"--fp8_models {slot}: its own weights train ({trained[0]}, ...); only frozen models can be fp8")
    compute = torch_dtype(compute_dtype)
    hooked = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
              torch.nn.ConvTranspose3d, torch.nn.Embedding)

    def visit(module: Any, name: str) -> None:
        if name and any(re.search(pattern, name) for pattern in FP8_SKIP_PATTERNS):
            return
        if type(module) is torch.nn.Linear:
            _fp8_linear(module, compute)
            return
        if type(module) in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d) and _plain_padding(module):
            _fp8_conv(module, compute)
            return
        if isinstance(module, hooked):
            apply_layerwise_casting_hook(module, torch.float8_e4m3fn, compute, non_blocking=False)
            return
        for child, sub in module.named_children():
            visit(sub, f"{name}.{child}" if name else child)

    visit(model, "")
    _own_storage(model, torch.float8_e4m3fn)
    return sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)


def _own_storage(model: Any, fp8: Any) -> None:
    """Give the tensors fp8 storage left as they were storage of their own. A model loaded from safetensors holds
    views of the memory-mapped file, and one norm weight still pointing into it keeps the whole file's pages
    resident: measured on a 1.4 B-parameter DiT, 4.2 GB instead of 1.4 GB after the fp8 cast (the bf16 file and the fp8
    copy). Only the small tensors are copied (norms, biases, embeddings kept, adapters)."""
    for param in model.parameters():
        if param.dtype != fp8:
            param.data = param.data.clone()
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.clone()


def _fp8_linear(module: Any, compute: Any) -> None:
    """A frozen Linear layer with its weight stored in fp8 (its bias, small, in the compute dtype)."""
    import torch

    module.weight.data = module.weight.data.to(torch.float8_e4m3fn)
    if module.bias is not None:
        module.bias.data = module.bias.data.to(compute)
    _stored_forward(module, compute)


def _plain_padding(conv: Any) -> bool:
    """Whether a convolution pads with zeros by a number per side, which its input gradient can take as given."""
    return conv.padding_mode == "zeros" and not isinstance(conv.padding, str)


def _fp8_conv(module: Any, compute: Any) -> None:
    """A frozen convolution with its weight stored in fp8 (its bias in the compute dtype), run through `_StoredConv`."""
    import torch

    module.weight.data = module.weight.data.to(torch.float8_e4m3fn)
    if module.bias is not None:
        module.bias.data = module.bias.data.to(compute)
    module._unitgraph_compute = compute
    module.forward = lambda x: _StoredConv.apply(x, module.weight, module.bias, module._unitgraph_compute, module)


def _stored_forward(module: Any, compute: Any, device: Any = None) -> None:
    """Route a frozen Linear layer through `_StoredLinear`: its weight is cast to `compute` (and brought to `device`
    when it is stored elsewhere) each time it is used, forward and backward, and never kept in that form."""
    module._unitgraph_compute = compute
    module._unitgraph_device = device
    module.forward = lambda x: _StoredLinear.apply(x, module.weight, module.bias, module._unitgraph_compute,
                                                   module._unitgraph_device)


def _stored_function() -> Any:
    import torch
    import torch.nn.functional as F

    class StoredLinear(torch.autograd.Function):
        """y = x W^T + b with W as stored (fp8, or in CPU memory) cast and moved for the product; the backward pass
        does that again instead of keeping the cast copy."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any, compute: Any, device: Any) -> Any:
            ctx.save_for_backward(weight)
            ctx.compute, ctx.device, ctx.input_dtype = compute, device, x.dtype
            w = weight.to(device=device or x.device, dtype=compute, non_blocking=True)
            b = None if bias is None else bias.to(compute)
            return F.linear(x.to(compute), w, b)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (weight,) = ctx.saved_tensors
            w = weight.to(device=ctx.device or grad.device, dtype=ctx.compute, non_blocking=True)
            return (grad.to(ctx.compute) @ w).to(ctx.input_dtype), None, None, None, None

    return StoredLinear


def _stored_conv_function() -> Any:
    import torch
    import torch.nn.functional as F

    forwards = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
    input_grads = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}

    class StoredConv(torch.autograd.Function):
        """A zero-padded convolution with its fp8 weight cast for the product; the backward pass (the input's gradient
        only: the layer is frozen) casts it again instead of keeping the cast copy."""

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any, compute: Any, conv: Any) -> Any:
            ctx.save_for_backward(weight)
            ctx.compute, ctx.conv, ctx.input_dtype, ctx.input_shape = compute, conv, x.dtype, x.shape
            dims = weight.dim() - 2
            w = weight.to(dtype=compute)
            b = None if bias is None else bias.to(compute)
            return forwards[dims](x.to(compute), w, b, conv.stride, conv.padding, conv.dilation, conv.groups)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (weight,) = ctx.saved_tensors
            conv, dims = ctx.conv, weight.dim() - 2
            w = weight.to(dtype=ctx.compute)
            grad_x = input_grads[dims](ctx.input_shape, w, grad.to(ctx.compute), conv.stride, conv.padding,
                                       conv.dilation, conv.groups)
            return grad_x.to(ctx.input_dtype), None, None, None, None

    return StoredConv


class _LazyFunction:
    """An autograd function, made on first use (importing this module must not import torch)."""

    def __init__(self, make: Any) -> None:
        self._make, self._made = make, None

    def apply(self, *args: Any) -> Any:
        if self._made is None:
            self._made = self._make()
        return self._made.apply(*args)


_StoredLinear = _LazyFunction(_stored_function)
_StoredConv = _LazyFunction(_stored_conv_function)


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
    """Keep the frozen Linear weights of the last `count` transformer blocks of `model` in (pinned) CPU memory; each
    is brought to `device` as its layer runs, in the forward and again in the backward pass, and never kept there.
    The LoRA adapters and everything else stay on the device. Returns the swapped block indices.

    The copies are issued non-blocking from pinned memory but not yet prefetched on a side stream, so on a GPU
    they are not hidden behind the compute. Without an accelerator there is nothing to swap to: one note, no
    effect (the chosen blocks are still checked and returned)."""
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

    for index in chosen:
        for module in blocks[index].modules():
            if type(module) is torch.nn.Linear and not module.weight.requires_grad:
                compute = getattr(module, "_unitgraph_compute", None) or module.weight.dtype
                module.weight.data = module.weight.data.to("cpu").pin_memory()
                _stored_forward(module, compute, torch.device(device))
    return chosen


def place(model: Any, device: Any) -> None:
    """Move `model` to `device`, except the weights `swap_blocks` keeps in CPU memory."""
    for module in model.modules():
        swapped = getattr(module, "_unitgraph_device", None) is not None
        for name, param in module.named_parameters(recurse=False):
            if not (swapped and name == "weight"):
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)

"""Models loaded straight into their shards: a trained model under FSDP2 or DeepSpeed ZeRO-3 is built without
weights (on the meta device), sharded, and only then given its weights. Under FSDP2 each process reads from the
safetensors files just the rows of each tensor its own shard holds; under ZeRO-3 the main process reads one tensor
at a time and DeepSpeed's own conversion hands each process its partition (`partition_skeleton`).

Why: loading a model whole and sharding it afterwards, as accelerate's engines do by default, has every process
hold the whole model in host memory first: 82 GB in fp32 for Qwen-Image's 20.4 B DiT, in each of the 8 processes of
a node. Built on the meta device, a model costs nothing; `fully_shard` then decides which rows of each weight every
process keeps (`torch.chunk` of dim 0 over the processes), `to_empty` gives each process storage for its rows
only, and `fill_shards` reads those rows with safetensors' slices. No process holds more than its share of the
weights, plus the small tensors kept real below.

What is kept real (never on the meta device) and copied into the shards afterwards: the model's buffers (rotary
tables made in `__init__`, not in the files) and a LoRA's adapters. peft moves a new adapter to its base layer's
device, which on a skeleton would lose its seeded initial values; `inject_adapters` keeps them, so the adapters start
from the very numbers the run draws without an engine.

Loaded this way: a diffusers model of a folder with safetensors weights whose names are the model's own (every
family's denoiser as released in diffusers' layout). Other sources (a release single file, whose keys are
converted as a whole; a transformers model, whose loader renames keys) load whole as before, and the run says so.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .folders import ComponentSource, ModelLoadError, check_config_sizes, component_files

__all__ = ["Deferred", "load_skeleton", "deferred", "inject_adapters", "kept_tensors", "fill_shards",
           "partition_skeleton", "shard_rows", "local_rows", "file_key"]


@dataclass
class Deferred:
    """The weights a skeleton still needs: {file key: the safetensors file holding it}, the tensors kept real until
    the shards exist (`kept`), and the bytes this process read of the bytes its tensors have in the files
    (`fill_shards`)."""

    files: dict[str, Path]
    read_bytes: int = 0
    total_bytes: int = 0
    kept: dict[str, Any] = field(default_factory=dict)


_DEFERRED: "weakref.WeakKeyDictionary[Any, Deferred]" = weakref.WeakKeyDictionary()


def deferred(model: Any) -> Optional[Deferred]:
    """The weights `model` (a skeleton from `load_skeleton`) still needs, or None for a model loaded whole."""
    try:
        return _DEFERRED.get(model)
    except TypeError:
        return None


def load_skeleton(source: ComponentSource, cls: Any, dtype: Any, keep: set[str]) -> Any:
    """A diffusers model of `source`'s folder built on the meta device in `dtype` (the modules named in `keep` in
    fp32, as `from_pretrained` keeps them: loading.keep_in_fp32), with its weights deferred to `fill_shards`.

    Raises ModelLoadError when the folder's safetensors lack a weight of the model (the message names it), before
    anything is allocated."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open

    folder = source.path
    check_config_sizes(folder)
    weights = component_files(source, "model", include_config=False)
    try:
        config = cls.load_config(str(folder), local_files_only=True)
        with init_empty_weights(include_buffers=False):
            model = cls.from_config(config)
    except Exception as exc:
        raise ModelLoadError(folder, f"cannot build {cls.__name__} from its config: {type(exc).__name__}: "
                                     f"{_first_line(exc)}") from None
    for name, param in model.named_parameters():
        wanted = torch.float32 if any(part in keep for part in name.split(".")) else dtype
        if param.is_floating_point() and param.dtype != wanted:
            param.data = param.data.to(wanted)
    files: dict[str, Path] = {}
    try:
        for path in weights:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    files.setdefault(key, path)
    except Exception as exc:  # safetensors' own error types for a damaged file
        raise ModelLoadError(folder, f"unreadable safetensors file ({type(exc).__name__}: {_first_line(exc)})") from None
    missing = [name for name, _ in model.named_parameters() if name not in files]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(folder, f"the safetensors weights lack {len(missing)} weights of {cls.__name__} ({shown})")
    model.eval()
    model.register_to_config(_name_or_path=str(folder))
    _DEFERRED[model] = Deferred(files=files)
    return model


def inject_adapters(model: Any, inject: Callable[[Any], Any]) -> Any:
    """`inject(model)` (peft adding a LoRA), on a skeleton too, with the adapters' seeded initial values kept.

    peft makes each adapter on the CPU, drawing its initial values, then moves it to its base layer's device: on a
    skeleton, the meta device, where the values are lost. So on a skeleton peft first injects into a stand-in, a
    copy of the skeleton whose weights are real CPU tensors of no memory (one zero expanded to each shape), drawing
    the very numbers it draws for a model loaded whole; those adapters are kept for `fill_shards`, and peft then
    injects into the skeleton itself (what it draws there is not used). Returns what `inject` returns."""
    import torch

    record = deferred(model)
    if record is None:
        return inject(model)
    stand_in = copy.deepcopy(model)
    for module in stand_in.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.zeros((), dtype=param.dtype).expand(param.shape),
                                                         requires_grad=False))
    inject(stand_in)
    before = {name for name, _ in model.named_parameters()}
    result = inject(model)
    added = {name: value for name, value in stand_in.named_parameters() if file_key(name) not in before}
    record.kept.update({name: value.detach() for name, value in added.items()})
    return result


def kept_tensors(model: Any) -> None:
    """Before sharding a skeleton: its real tensors (adapters, buffers), copied, to be put back by `fill_shards`
    (`to_empty` gives every tensor new storage)."""
    record = deferred(model)
    if record is None:
        return
    record.kept.update({name: value.detach().clone()
                        for name, value in [*model.named_parameters(), *model.named_buffers()] if not value.is_meta})


def file_key(name: str) -> str:
    """The safetensors key of a parameter of a model peft injected into (its base layer's weight keeps the
    name the file gives it)."""
    return name.replace(".base_layer.", ".")


def shard_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [start, stop) of a tensor's dim 0 that process `index` of `parts` holds under FSDP2's Shard(0):
    torch.chunk's split, ceil(rows / parts) rows each, the last ones shorter or empty.

    >>> shard_rows(10, 4, 3)
    (9, 10)
    >>> shard_rows(2, 4, 3)
    (2, 2)
    """
    step = math.ceil(rows / parts) if rows else 0
    start = min(rows, step * index)
    return start, min(rows, start + step)


def fill_shards(model: Any, device: Any) -> Optional[Deferred]:
    """Give a sharded skeleton its weights: storage on `device` for each process's shard (`to_empty`), then every
    parameter's rows read from the files (or from the tensors kept real), and the buffers put back. Returns the
    record (bytes read, of bytes in all), or None for a model loaded whole. Every process calls it; no collective."""
    import torch
    from safetensors import safe_open

    record = deferred(model)
    if record is None:
        return None
    model.to_empty(device=device)
    handles: dict[Path, Any] = {}

    def read(key: str, rows: Optional[slice], like: Any) -> Any:
        path = record.files[key]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        piece = handles[path].get_slice(key)
        shape = tuple(piece.get_shape())
        if shape != tuple(like.shape):
            raise ModelLoadError(path, f"{key} has shape {list(shape)}, the model's {list(like.shape)}")
        part = piece[rows] if rows is not None else handles[path].get_tensor(key)
        record.read_bytes += part.numel() * part.element_size()
        record.total_bytes += math.prod(shape) * part.element_size()
        return part

    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                rows = local_rows(param, local)
                if name in record.kept:
                    part = record.kept[name] if rows is None else record.kept[name][rows]
                else:
                    part = read(file_key(name), rows, param)
                local.copy_(part.to(local.dtype))
            for name, buffer in model.named_buffers():
                if file_key(name) in record.files:  # a persistent buffer: the file's value, as from_pretrained loads it
                    buffer.copy_(read(file_key(name), None, buffer).to(buffer.dtype))
                elif name in record.kept:
                    buffer.copy_(record.kept[name])
            dora_magnitudes(model, record.kept)
    finally:
        handles.clear()
    record.kept = {}
    return record


def dora_magnitudes(model: Any, kept: dict[str, Any]) -> None:
    """DoRA's magnitudes taken again from the weights just read: peft sets each to the row norms of its base weight
    plus the LoRA's delta, ||W + s B A|| (DoraLinearLayer.update_layer), when it makes the adapter, which on a
    skeleton is the stand-in's zeros (`inject_adapters`). Each process computes its own rows: a magnitude vector is
    sharded over dim 0 as its weight's rows are, and the whole B and A are the kept ones."""
    import torch

    for prefix, module in model.named_modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not magnitudes or not hasattr(module, "get_base_layer"):
            continue
        weight = module.get_base_layer().weight
        local_weight = weight.to_local() if hasattr(weight, "to_local") else weight
        rows = local_rows(weight, local_weight)
        for adapter, layer in magnitudes.items():
            a = kept[f"{prefix}.lora_A.{adapter}.weight"]
            b = kept[f"{prefix}.lora_B.{adapter}.weight"]
            b = b if rows is None else b[rows]
            summed = local_weight.to(a.device) + module.scaling[adapter] * (b @ a)
            norm = torch.linalg.norm(summed, dim=1).to(summed.dtype)
            target = layer.weight.to_local() if hasattr(layer.weight, "to_local") else layer.weight
            target.copy_(norm.to(target.device, target.dtype))


def partition_skeleton(model: Any, ds_config: dict[str, Any], device: Any) -> Optional[Deferred]:
    """Give a skeleton its weights straight into DeepSpeed ZeRO-3's partitions (what accelerate's zero3_init_flag
    asks for: `deepspeed.zero.Init`), one parameter at a time. Returns the record, or None for a model loaded whole.

    ZeRO-3's conversion of a parameter (`Init(module=...)` converts every parameter of a module this way) broadcasts
    the whole tensor from the first process and keeps each process's flat slice of it. So the first process reads
    each tensor whole from the files (or takes it from the tensors kept real: a LoRA's seeded adapters), the others
    only make room for it, and each parameter is converted before the next is read: no process holds more than its
    partitions and one whole tensor. The partitions are the very numbers the engine cuts from a model loaded whole,
    so a run loaded either way trains the same. Every process calls it, in the same order (a broadcast per
    parameter). The buffers stay whole on `device`, as ZeRO-3 keeps them."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    record = deferred(model)
    if record is None:
        return None
    main = not dist.is_initialized() or dist.get_rank() == 0
    zero = deepspeed.zero.Init(config_dict_or_path=ds_config)  # no module given: converts only what it is handed
    handles: dict[Path, Any] = {}

    def whole(key: str, like: Any) -> Any:
        path = record.files[key]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        shape = tuple(handles[path].get_slice(key).get_shape())
        if shape != tuple(like.shape):
            raise ModelLoadError(path, f"{key} has shape {list(shape)}, the model's {list(like.shape)}")
        value = handles[path].get_tensor(key)
        record.read_bytes += value.numel() * value.element_size()
        return value

    done: dict[int, Any] = {}  # a parameter shared by two modules is converted once
    try:
        with torch.no_grad():
            for prefix, module in model.named_modules():
                for name, param in list(module._parameters.items()):
                    if param is None:
                        continue
                    if id(param) in done:
                        module._parameters[name] = done[id(param)]
                        continue
                    full_name = f"{prefix}.{name}" if prefix else name
                    size = param.numel() * param.element_size()
                    record.total_bytes += size
                    if not param.is_meta:
                        value = param.data
                    elif full_name in record.kept:
                        value = record.kept[full_name]
                    elif main:
                        value = whole(file_key(full_name), param)
                    else:
                        value = torch.empty(param.shape, dtype=param.dtype)
                    real = torch.nn.Parameter(value.to(dtype=param.dtype), requires_grad=param.requires_grad)
                    module._parameters[name] = done[id(param)] = real
                    zero._convert_to_zero_parameters([real])
                for name, buffer in list(module._buffers.items()):
                    if buffer is None:
                        continue
                    full_name = f"{prefix}.{name}" if prefix else name
                    if file_key(full_name) in record.files:  # a persistent buffer: the file's value
                        buffer = whole(file_key(full_name), buffer).to(buffer.dtype)
                    elif full_name in record.kept:
                        buffer = record.kept[full_name]
                    module._buffers[name] = buffer.to(device)
    finally:
        handles.clear()
    record.kept = {}
    return record


def local_rows(param: Any, local: Any) -> Optional[slice]:
    """The rows of `param` that `local` holds (a DTensor sharded on dim 0), or None when it holds it whole."""
    if not hasattr(param, "device_mesh") or not param.shape:
        return None
    mesh = param.device_mesh
    start, stop = shard_rows(param.shape[0], mesh.size(), mesh.get_local_rank())
    if local.shape[0] != stop - start:
        raise RuntimeError(f"a shard of {tuple(param.shape)} holds {local.shape[0]} rows, not {stop - start}")
    return slice(start, stop)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

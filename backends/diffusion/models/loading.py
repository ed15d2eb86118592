"""Loading one resolved component with its slot's class: models from safetensors only, tokenizers,
processors, and a family's default scheduler config.

torch, diffusers and transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..family import ModelSlot
from .folders import ComponentSource, ModelLoadError, check_config_sizes, component_files

# --------------------------------------------------------------------------------------------
# Loading


def _dtype(torch_dtype: Any):
    import torch

    if torch_dtype is None:
        return torch.float32
    if isinstance(torch_dtype, str):
        value = getattr(torch, torch_dtype.replace("torch.", ""), None)
        if not isinstance(value, torch.dtype):
            raise ModelLoadError(torch_dtype, "unknown torch dtype")
        return value
    return torch_dtype


def slot_class(slot: ModelSlot) -> Any:
    module = importlib.import_module(slot.module or slot.library)
    return getattr(module, slot.class_name)


@dataclass(frozen=True)
class ProcessorParts:
    """A transformers processor folder loaded as its image processor and tokenizer, where the processor
    class itself cannot be built (transformers 5 builds a processor with a video part only when torchvision
    is installed, even to process images). Unit code that reads a processor uses only these two attributes."""

    image_processor: Any
    tokenizer: Any


def _load_processor(cls: Any, folder: Path) -> Any:
    """The processor class from `folder`, or its parts when the class needs a library that is not installed."""
    try:
        return cls.from_pretrained(str(folder), local_files_only=True)
    except ImportError:
        from transformers import AutoImageProcessor, AutoTokenizer

        return ProcessorParts(image_processor=AutoImageProcessor.from_pretrained(str(folder), local_files_only=True),
                              tokenizer=AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


def load_component(source: ComponentSource, slot: ModelSlot, torch_dtype: Any = None, skeleton: bool = False):
    """Load one resolved component with its slot's class. Model weights are read from safetensors only.

    With `skeleton`, a diffusers model of a folder is built without its weights, which are read later into its
    shards (models/shards.py); any other component loads whole."""
    dtype = _dtype(torch_dtype)
    folder = source.path
    cls = slot_class(slot)
    if folder is None:  # the family's published scheduler config
        return cls(**dict(slot.default_config or {}))
    try:
        if source.single_file is not None:
            return load_single_file(source, slot, dtype)
        if skeleton and slot.kind == "model" and slot.library == "diffusers":
            from .shards import load_skeleton

            return load_skeleton(source, cls, dtype, keep_in_fp32(cls, slot.library, dtype))
        if slot.kind == "model":
            check_config_sizes(folder)  # before a layer is allocated
            component_files(source, slot.kind, include_config=False)  # clean error when weights are missing
            # diffusers names the argument torch_dtype, transformers 5 dtype
            dtype_arg = {"torch_dtype": dtype} if slot.library == "diffusers" else {"dtype": dtype}
            model = cls.from_pretrained(str(folder), use_safetensors=True, local_files_only=True, **dtype_arg)
            model.eval()
            return model
        if slot.kind == "tokenizer" and slot.library == "transformers":
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if slot.kind == "processor" and slot.library == "transformers":
            return _load_processor(cls, folder)
        return cls.from_pretrained(str(folder), local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(folder, f"cannot load {slot.name} ({slot.class_name}): {type(exc).__name__}"
                                     + (f": {detail}" if detail else "")) from None


# --------------------------------------------------------------------------------------------
# Release single files


def load_single_file(source: ComponentSource, slot: ModelSlot, dtype: Any) -> Any:
    """A release single file (models/release.py) as the slot's class: the model built from the config its format
    derives from the header (and the config beside it), without initialising a weight, then given the converted
    tensors. Each tensor is cast to `dtype` as it is read, so a file already in `dtype` is never copied to fp32
    first; the class's keep-in-fp32 modules stay fp32, as `from_pretrained` keeps them."""
    from accelerate import init_empty_weights
    from safetensors import safe_open

    from .release import header, single_file_config

    path, fmt, where = source.path, source.single_file, source.origin or str(source.path)
    config = single_file_config(path, fmt, source.beside, where)
    cls = slot_class(slot)
    try:
        with init_empty_weights(include_buffers=False):
            if slot.library == "diffusers":
                model = cls.from_config(config)
            else:
                model = cls._from_config(cls.config_class.from_dict({k: v for k, v in config.items()
                                                                      if not k.startswith("_")}))
    except Exception as exc:
        raise ModelLoadError(where, f"cannot build {slot.class_name} from the config of {fmt.description}: "
                                    f"{type(exc).__name__}: {_first_line(exc)}") from None
    head = header(path, where)
    tensors: dict[str, Any] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name, info in head.tensors.items():
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != info.shape:
                    raise ModelLoadError(where, f"changed while it was read (tensor {name!r})")
                tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    except ModelLoadError:
        raise
    except Exception as exc:  # safetensors' own error types for a damaged file
        raise ModelLoadError(where, f"unreadable safetensors file ({type(exc).__name__}: {_first_line(exc)})") from None
    try:
        state = fmt.convert(tensors)
    except ValueError as exc:
        raise ModelLoadError(where, f"cannot read it as {fmt.description}: {exc}") from None
    del tensors
    keep = keep_in_fp32(cls, slot.library, dtype)
    if keep:
        state = {name: value.float() if value.is_floating_point() and any(part in keep for part in name.split("."))
                 else value for name, value in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ModelLoadError(where, f"{fmt.description} converted does not fit {slot.class_name}: "
                                    f"{_names(result.missing_keys, 'missing')}{_names(result.unexpected_keys, 'unexpected')}")
    if hasattr(model, "tie_weights") and slot.library != "diffusers":
        model.tie_weights()
    on_meta = [name for name, value in [*model.named_parameters(), *model.named_buffers()] if value.is_meta]
    if on_meta:
        raise ModelLoadError(where, f"{slot.class_name} has weights the file does not give: {', '.join(on_meta[:3])}")
    model.eval()
    return model


def keep_in_fp32(cls: Any, library: str, dtype: Any) -> set[str]:
    """The module names `from_pretrained` keeps in fp32 at `dtype` (diffusers below fp32; transformers its strict list
    at fp16 and bf16, its other list at fp16)."""
    import torch

    if dtype == torch.float32:
        return set()
    if library == "diffusers":
        return set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    names = set(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        names |= set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    return names


def _names(names: list[str], what: str) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f" {len(names)} {what} ({shown})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

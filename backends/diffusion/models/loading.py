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


def _class(slot: ModelSlot) -> Any:
    module = importlib.import_module(slot.library)
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


def load_component(source: ComponentSource, slot: ModelSlot, torch_dtype: Any = None):
    """Load one resolved component with its slot's class. Model weights are read from safetensors only."""
    dtype = _dtype(torch_dtype)
    folder = source.path
    cls = _class(slot)
    if folder is None:  # the family's published scheduler config
        return cls(**dict(slot.default_config or {}))
    try:
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

"""The Qwen-Image family for the tests that exercise the generic machinery through it.

The generic loaders take a family's slots; these helpers bind them to Qwen-Image, the first
registered family, so those tests read as before the backend became family folders.
"""

from __future__ import annotations

from typing import Any

from unitgraph.backends.diffusion.config import offline_from_env
from unitgraph.backends.diffusion.models.sources import ModelSources
from unitgraph.backends.diffusion.registry import family

QWEN = family("qwen_image")
ALL_SLOTS = tuple(s.name for s in QWEN.slots if s.kind != "processor")  # the processor belongs to the edit pipelines


def sources(model_paths: Any = None, model_id_with_origin_paths: Any = None, tokenizer_path: Any = None,
            cache_dir: Any = None, offline: Any = None) -> ModelSources:
    """The family's sources; offline as UNITGRAPH_OFFLINE says unless given."""
    offline = offline_from_env() if offline is None else offline
    return ModelSources(QWEN.slots, model_paths, model_id_with_origin_paths, tokenizer_path, cache_dir, offline=offline)


def load_components(slots: Any, torch_dtype: Any = None, **where: Any) -> dict[str, Any]:
    return sources(**where).load(slots, torch_dtype=torch_dtype)


def resolve_components(slots: Any = ALL_SLOTS, **where: Any):
    return sources(**where).resolve_many(slots)


def model_weight_files(slot: str, include_config: bool = True, **where: Any):
    return sources(**where).files(slot, include_config=include_config)

"""What stage 1's entry keys are derived from, and what a cache records about the run that made it.

`key_inputs` is the part of every entry key shared by all samples: the plan's data_process units and
their code version, the settings those units declare, the digests of the weights (and the config files)
stage 1 reads. `made_with` is the arguments `unitgraph cache repair` re-runs stage 1 with, and
`describe_key_change` says in a user's words why a cache's entries no longer match (docs/cache.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from unitgraph.plan import Plan
from unitgraph.runtime import stage1_dependencies

from .cache.keys import HashMemo, model_files_digest
from .cache.manifest import FORMAT
from .config import RunConfig
from .context import describe_setting
from .errors import BackendError
from .models.stage import stage_slots

# Bump when a unit's code changes what it computes: every entry made before is then rebuilt.
UNITS_VERSION = 1


def unit_settings_names(cfg: RunConfig, plan: Plan) -> set[str]:
    """The settings the plan's data_process units declare (a unit declaring none reads none)."""
    code = cfg.pipeline.unit_code()
    return {name for unit in plan.data_process_units for name in code[unit].settings}


def key_settings(cfg: RunConfig, plan: Plan) -> dict[str, Any]:
    """The settings part of every entry key: what the plan's data_process units read, and which of the models
    they call are stored in fp8 (that changes what they compute; absent when none is, so keys stay as they were)."""
    settings = cfg.units.key_values(unit_settings_names(cfg, plan))
    fp8 = sorted(set(cfg.precision.fp8) & set(plan.data_process_models))
    if fp8:
        settings["fp8_models"] = fp8
    return settings


def model_files(cfg: RunConfig, models: list[str], offline: Optional[bool] = None) -> dict[str, list[Path]]:
    """{slot: files its loader reads} for the given models (and the tokenizer beside a text encoder)."""
    from .models.sources import ModelLoadError

    try:
        sources = cfg.models.sources(cfg.family, offline=offline)
        return {slot: sources.files(slot) for slot in stage_slots(cfg, models, training=False)}
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None


def key_inputs(cfg: RunConfig, plan: Plan, memo: HashMemo) -> dict[str, Any]:
    """The part of every entry key shared by all samples: unit list, settings used, model weights."""
    deps = stage1_dependencies(cfg.pipeline.spec_pipeline, plan)
    return {
        "format": FORMAT,
        "units_version": UNITS_VERSION,
        "pipeline": plan.pipeline,
        "cache_mode": plan.cache_mode,
        "units": deps.units,
        "entries": deps.entries,
        "dataset_params": deps.dataset_params,
        "settings": key_settings(cfg, plan),
        "models": model_files_digest(model_files(cfg, deps.models), memo.digest),
        **config_key(cfg, plan, memo),
    }


def config_key(cfg: RunConfig, plan: Plan, memo: HashMemo) -> dict[str, Any]:
    """{"configs": digests of the config.json files stage 1 reads without loading the model
    (plan.data_process_configs), each by its file name}, or nothing: keys of pipelines without config reads are as
    before. Not by its folder: two experts of one architecture (a pipeline folder's transformer/ and transformer_2/) have
    the same config, and stage 1, which reads only that, serves the runs of either."""
    from .models.sources import ModelLoadError

    slots = list(plan.data_process_configs)
    if not slots:
        return {}
    try:
        sources = cfg.models.sources(cfg.family)
        return {"configs": {slot: {p.name: memo.digest(p) for p in sources.config_files(slot)} for slot in sorted(slots)}}
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None


def recorded_settings(cfg: RunConfig, plan: Plan) -> dict[str, Any]:
    """What stage 1 ran with, for people: the key settings plus the dataset columns it was given."""
    return {**key_settings(cfg, plan), "data_file_keys": list(cfg.data.file_keys), "extra_inputs": list(cfg.data.extra_inputs)}


def made_with(cfg: RunConfig) -> dict[str, Any]:
    """The arguments stage 1 ran with (absolute paths): what `unitgraph cache repair` re-runs it with."""
    from .models.sources import ModelLoadError, parse_model_paths

    args = cfg.args

    def absolute(path: Optional[str]) -> Optional[str]:
        return os.path.abspath(path) if path else None

    model_paths = args.model_paths
    if model_paths:
        try:
            model_paths = json.dumps([os.path.abspath(p) for p in parse_model_paths(model_paths)])
        except ModelLoadError:
            pass
    tokenizer = args.first_tokenizer_path()
    if tokenizer and os.path.exists(tokenizer):
        tokenizer = os.path.abspath(tokenizer)
    tokenizer_2 = args.tokenizer_2_path
    if tokenizer_2 and os.path.exists(tokenizer_2):
        tokenizer_2 = os.path.abspath(tokenizer_2)
    processor = args.processor_path
    if processor and os.path.exists(processor):
        processor = os.path.abspath(processor)
    return {
        "task": args.family, "pipeline": cfg.pipeline.name, "dataset_base_path": absolute(args.dataset_base_path),
        "dataset_metadata_path": absolute(args.dataset_metadata_path), "data_file_keys": args.data_file_keys,
        "extra_inputs": args.extra_inputs, "model_paths": model_paths,
        "model_id_with_origin_paths": args.model_id_with_origin_paths, "tokenizer_path": tokenizer,
        "tokenizer_2_path": tokenizer_2, "processor_path": processor,
        "modelscope_cache_dir": absolute(args.modelscope_cache_dir), "trainable_models": args.trainable_models,
        "lora_base_model": args.lora_base_model, "cache_mode": args.cache_mode,
        "height": args.height, "width": args.width, "max_pixels": args.max_pixels, "cache_dtype": args.cache_dtype,
        **({"num_frames": args.num_frames} if cfg.pipeline.video_params else {}),
        **({"dataset_config": absolute(args.dataset_config)} if args.dataset_config else {}),
        **({"cache_layout": args.cache_layout} if args.cache_layout != "files" else {}),
        # the flags that add or swap units (each recorded only when given, as before they existed)
        **({"vae_latents": args.vae_latents} if args.vae_latents else {}),
        **({"caption_dropout": args.caption_dropout} if args.caption_dropout else {}),
        **({"masked_loss": True} if args.masked_loss else {}),
    }


def describe_key_change(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two `key_inputs` records, in words a user can act on."""
    changes = []
    old_settings, new_settings = old.get("settings") or {}, new.get("settings") or {}
    for name in sorted(set(old_settings) | set(new_settings)):
        if old_settings.get(name) != new_settings.get(name):
            changes.append(f"{describe_setting(name, new_settings.get(name))} now, "
                           f"{describe_setting(name, old_settings.get(name))} in the cache")
    old_models, new_models = old.get("models") or {}, new.get("models") or {}
    for slot in sorted(set(old_models) | set(new_models)):
        a, b = old_models.get(slot) or {}, new_models.get(slot) or {}
        if a != b:
            files = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
            changes.append(f"{slot} weights differ ({', '.join(files[:3])})")
    for part in ("format", "units_version", "pipeline", "cache_mode", "units", "entries", "dataset_params"):
        if old.get(part) != new.get(part):
            changes.append("the data_process units or their code changed")
            break
    return changes

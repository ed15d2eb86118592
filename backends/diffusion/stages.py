"""The training loops: unsplit (`sft`), stage 1 (`:data_process`), stage 2 (`:train`) and both (`:split`).

Stage 1 follows `unitgraph.runtime.stage1_schedule(plan)`: it runs the plan's data_process units
under no_grad and stores each sample's cache entry under a key derived from exactly what the entry
depends on (`stage1_dependencies`, `UNIT_SETTINGS`; see cache.py and docs/cache.md). A re-run
computes only the entries whose key is new or whose file fails its checksum. Stage 2 follows
`stage2_bindings`: every input of a train unit and of the sink comes either from a live train
output or from a cache entry, checked against its size and checksum. Each stage loads only its
plan's models.

All randomness comes from generators derived from --seed (see `randomness.py`), so the unsplit run
and the split run draw the same numbers and end with the same losses and weights.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import importlib
import io
import json
import math
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from unitgraph.atomic import write_text_atomic
from unitgraph.plan import Plan, split
from unitgraph.runtime import SINK, stage1_dependencies, stage1_schedule, stage2_bindings
from unitgraph.spec import Pipeline

from .args import CACHE_DTYPES, BackendError, TrainArgs, split_list
from .cache import (FORMAT, Cache, HashMemo, Journal, canonical_hash, describe_plan_change, entry_key,
                    model_files_digest, sample_label, settings_hash)
from .data import DiffusionDataset, SampleError
from .loader import Batch, Stage2Data, _cast, bucket_batches, expand, shard_batches, step_groups
from .losses import SINKS
from .qwen_image import ImageSize, UnitContext, run_unit
from .randomness import seeded_global_stream
from .registry import PIPELINES, TASK_PIPELINES

# Dataset columns each task family requires, and those it uses when present.
REQUIRED = {"sft": ("image", "prompt"), "direct_distill": ("image", "prompt", "seed", "num_inference_steps")}
OPTIONAL = {"sft": (), "direct_distill": ("cfg_scale", "negative_prompt")}
KEEP_IN_MEMORY_BYTES = 1 << 30  # stage 2 reads (and checks) a cache this small before its first step and keeps it

# The settings each unit reads from its UnitContext (see make_context). A stage-1 cache key holds
# exactly the settings of the plan's data_process units; a unit missing here is keyed on every
# setting, which can only rebuild too much, never trust a stale entry.
# `cache_dtype` (--cache_dtype) is the dtype stage 1 stores the floating tensors in: a setting of every
# unit whose outputs include floating tensors, since it changes the stored values of each of them.
UNIT_SETTINGS: dict[str, tuple[str, ...]] = {
    "ShapeChecker": ("image_size", "dtype", "cache_dtype"),
    "ImageEncoder": ("dtype", "cache_dtype"),
    "EditImageEncoder": ("dtype", "cache_dtype"),
    "PromptEncoder": ("dtype", "cache_dtype"),
    "NegativePromptEncoder": ("dtype", "cache_dtype"),
    "LatentSampler": ("seed", "cache_dtype"),
    "TargetLatents": ("cache_dtype",),
    "NoiseInitializer": ("seed", "cache_dtype"),
    "SeededNoise": ("cache_dtype",),
    "LatentPacker": ("cache_dtype",),
    "TimestepSampler": ("seed", "timestep_bounds", "cache_dtype"),
}
# Bump when a unit's code changes what it computes: every entry made before is then rebuilt.
UNITS_VERSION = 1
DTYPE = "float32"


@dataclass
class RunResult:
    task: str
    output_path: Path
    plan: Plan
    plan_path: Optional[Path] = None
    cache_path: Optional[Path] = None
    cache_reused: bool = False
    entries_computed: int = 0
    entries_reused: int = 0
    computed_indices: list[int] = field(default_factory=list)  # samples whose entry stage 1 computed
    skipped: list[dict[str, Any]] = field(default_factory=list)  # samples left out: {"index", "reason"}
    stage1_reason: str = ""
    loss_csv: Optional[Path] = None
    loss_plot: Optional[Path] = None
    checkpoints: list[Path] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    steps: int = 0
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def median_step_s(self) -> Optional[float]:
        times = self.step_times[1:] or self.step_times  # the first step pays one-off set-up costs
        return statistics.median(times) if times else None

    @property
    def last_checkpoint(self) -> Optional[Path]:
        return self.checkpoints[-1] if self.checkpoints else None


class Reporter:
    """Prints on the main process only."""

    def __init__(self, accelerator: Any, echo: Optional[Callable[[str], None]] = None):
        self.main = accelerator.is_main_process
        self.echo = echo or (lambda text: print(text, flush=True))

    def __call__(self, text: str) -> None:
        if self.main:
            self.echo(text)


# ------------------------------------------------------------------------------------------------
# planning and set-up


def pipeline_for(args: TrainArgs) -> Pipeline:
    return PIPELINES[TASK_PIPELINES[args.family]]()


def plan_for(args: TrainArgs, pipeline: Pipeline) -> Plan:
    models = pipeline.models
    if args.lora_base_model and args.lora_base_model not in models:
        raise BackendError(f"--lora_base_model {args.lora_base_model!r} is not a model of pipeline {pipeline.name} "
                           f"(models: {', '.join(models)})")
    for name in args.trainable():
        if name not in models:
            raise BackendError(f"--trainable_models: {name!r} is not a model of pipeline {pipeline.name} (models: {', '.join(models)})")
    if args.preset_lora_path and (args.preset_lora_model or args.lora_base_model) not in models:
        raise BackendError("--preset_lora_path needs --preset_lora_model (or --lora_base_model) naming a model of the pipeline")
    plan = split(pipeline, trainable_models=args.trainable(), lora_base_model=args.lora_base_model, cache_mode=args.cache_mode)
    if plan.violations:  # pragma: no cover - the planner proves its plans
        raise RuntimeError(f"planner produced a plan failing verification: {plan.violations[0]}")
    return plan


def make_accelerator(args: TrainArgs):
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # Qwen-Image's last block computes text-stream outputs nobody reads, so LoRA on txt_* / to_add_out
    # leaves parameters without gradients; DDP then needs find_unused_parameters. DiffSynth's Qwen-Image
    # scripts pass the flag; multi-process runs here turn it on by themselves.
    multi = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=args.find_unused_parameters or multi)]
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no", kwargs_handlers=handlers)


def make_dataset(args: TrainArgs, pipeline: Pipeline) -> DiffusionDataset:
    return DiffusionDataset(
        args.dataset_base_path, args.dataset_metadata_path, pipeline.version_graph.dataset_params,
        data_file_keys=args.file_keys(), extra_inputs=args.extra_input_names(),
        required=REQUIRED[args.family], optional=OPTIONAL[args.family],
    )


def _slots(models: list[str], need_scheduler: bool) -> list[str]:
    slots = list(models)
    if "text_encoder" in slots:
        slots.append("tokenizer")
    if need_scheduler:
        slots.append("scheduler")
    return slots


def _library_progress_bars(enabled: bool) -> None:
    """--no-progress also silences the loading bars of transformers and diffusers."""
    for module in ("transformers.utils.logging", "diffusers.utils.logging"):
        try:
            logging = importlib.import_module(module)
        except ImportError:  # pragma: no cover - both are backend dependencies
            continue
        (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()


def load_models(args: TrainArgs, models: list[str], need_scheduler: bool, device: Any) -> dict[str, Any]:
    from .models import ModelLoadError, load_components

    _library_progress_bars(args.progress)

    try:
        loaded = load_components(_slots(models, need_scheduler), model_paths=args.model_paths,
                                 model_id_with_origin_paths=args.model_id_with_origin_paths,
                                 tokenizer_path=args.tokenizer_path, cache_dir=args.modelscope_cache_dir,
                                 torch_dtype=torch.float32)
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None
    for value in loaded.values():
        if isinstance(value, torch.nn.Module):
            value.requires_grad_(False)
            value.eval()
            value.to(device)
    return loaded


def context_settings(args: TrainArgs) -> dict[str, Any]:
    """Every setting a unit can read from its context, by the names UNIT_SETTINGS uses."""
    if args.height is not None and args.width is not None:
        size: dict[str, Any] = {"height": args.height, "width": args.width}  # --max_pixels is then unused
    else:
        size = {"max_pixels": args.max_pixels}
    settings = {"image_size": size, "dtype": DTYPE, "seed": args.seed,
                "timestep_bounds": [args.min_timestep_boundary, args.max_timestep_boundary]}
    if cache_dtype_name(args) != DTYPE:  # absent: stored as computed (so caches made before --cache_dtype keep their keys)
        settings["cache_dtype"] = cache_dtype_name(args)
    return settings


def cache_dtype_name(args: TrainArgs) -> str:
    """The torch dtype name stage 1 stores floating tensors in: --cache_dtype, or the model's dtype."""
    return CACHE_DTYPES[args.cache_dtype] if args.cache_dtype else DTYPE


def stage1_key_settings(args: TrainArgs, plan: Plan) -> dict[str, Any]:
    """The settings the plan's data_process units read: the settings part of every entry key."""
    everything = context_settings(args)
    names: set[str] = set()
    for unit in plan.data_process_units:
        names.update(UNIT_SETTINGS.get(unit, tuple(everything)))
    return {name: everything[name] for name in sorted(names) if name in everything}


def describe_setting(name: str, value: Any) -> str:
    if name == "image_size" and isinstance(value, dict):
        if "max_pixels" in value:
            return f"--max_pixels {value['max_pixels']}"
        return f"--height {value.get('height')} --width {value.get('width')}"
    if name == "timestep_bounds" and isinstance(value, list) and len(value) == 2:
        return f"--min_timestep_boundary {value[0]} --max_timestep_boundary {value[1]}"
    if name == "seed":
        return f"--seed {value}"
    if name == "cache_dtype":
        flags = {v: k for k, v in CACHE_DTYPES.items()}
        return f"--cache_dtype {flags.get(value or DTYPE, value)}"  # absent: the model's dtype
    return f"{name} {value}"


def stage1_model_files(args: TrainArgs, models: list[str]) -> dict[str, list[Path]]:
    """{slot: files its loader reads} for the given models (and the tokenizer beside a text encoder)."""
    from .models import ModelLoadError, model_weight_files

    files = {}
    try:
        for slot in _slots(models, need_scheduler=False):
            files[slot] = model_weight_files(slot, model_paths=args.model_paths,
                                             model_id_with_origin_paths=args.model_id_with_origin_paths,
                                             tokenizer_path=args.tokenizer_path, cache_dir=args.modelscope_cache_dir)
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None
    return files


def stage1_key_inputs(args: TrainArgs, pipeline: Pipeline, plan: Plan, memo: HashMemo) -> dict[str, Any]:
    """The part of every entry key shared by all samples: unit list, settings used, model weights."""
    deps = stage1_dependencies(pipeline, plan)
    files = stage1_model_files(args, deps.models)
    return {
        "format": FORMAT,
        "units_version": UNITS_VERSION,
        "pipeline": plan.pipeline,
        "cache_mode": plan.cache_mode,
        "units": deps.units,
        "entries": deps.entries,
        "dataset_params": deps.dataset_params,
        "settings": stage1_key_settings(args, plan),
        "models": model_files_digest(files, memo.digest),
    }


def stage1_settings(args: TrainArgs, plan: Plan) -> dict[str, Any]:
    """What stage 1 ran with, for people: the key settings plus the dataset columns it was given."""
    return {**stage1_key_settings(args, plan), "data_file_keys": args.file_keys(), "extra_inputs": args.extra_input_names()}


def made_with(args: TrainArgs) -> dict[str, Any]:
    """The arguments stage 1 ran with (absolute paths): what `unitgraph cache repair` re-runs it with."""
    from .models import ModelLoadError, parse_model_paths

    def absolute(path: Optional[str]) -> Optional[str]:
        return os.path.abspath(path) if path else None

    model_paths = args.model_paths
    if model_paths:
        try:
            model_paths = json.dumps([os.path.abspath(p) for p in parse_model_paths(model_paths)])
        except ModelLoadError:
            pass
    tokenizer = args.tokenizer_path
    if tokenizer and os.path.exists(tokenizer):
        tokenizer = os.path.abspath(tokenizer)
    return {
        "task": args.family, "dataset_base_path": absolute(args.dataset_base_path),
        "dataset_metadata_path": absolute(args.dataset_metadata_path), "data_file_keys": args.data_file_keys,
        "extra_inputs": args.extra_inputs, "model_paths": model_paths,
        "model_id_with_origin_paths": args.model_id_with_origin_paths, "tokenizer_path": tokenizer,
        "modelscope_cache_dir": absolute(args.modelscope_cache_dir), "trainable_models": args.trainable_models,
        "lora_base_model": args.lora_base_model, "cache_mode": args.cache_mode,
        "height": args.height, "width": args.width, "max_pixels": args.max_pixels, "cache_dtype": args.cache_dtype,
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


def make_context(args: TrainArgs, models: dict[str, Any], device: Any) -> UnitContext:
    return UnitContext(models=models, size=ImageSize(args.height, args.width, args.max_pixels), device=device,
                       seed=args.seed, timestep_bounds=(args.min_timestep_boundary, args.max_timestep_boundary))


def _unit_grad(unit: Any, backward: set[str], inputs: dict[str, Any]) -> Any:
    """no_grad for a unit whose models are all frozen and whose inputs carry no gradient (same numbers, less memory)."""
    needs = bool(set(unit.models) & backward) or any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values())
    return contextlib.nullcontext() if needs else torch.no_grad()


def _progress(iterable: Any, total: int, desc: str, enabled: bool):
    """A progress bar on stderr; redrawn at most every 15 s when stderr is a log file, not a terminal."""
    import sys

    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True,
                mininterval=0.1 if interactive else 15.0)


# ------------------------------------------------------------------------------------------------
# stage 1


@dataclass
class Stage1Result:
    seconds: float
    samples: int  # samples in the cache (skipped ones left out)
    computed: list[int] = field(default_factory=list)  # indices of the samples whose entry this run computed
    reused: int = 0  # entries found valid and kept
    skipped: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""

    @property
    def reused_all(self) -> bool:
        return not self.computed


def _skip(skipped: list[dict[str, Any]], index: int, exc: BackendError, report: Reporter) -> None:
    skipped.append({"index": index, "reason": exc.one_line()})
    report(f"warning: skipping sample {index}: {exc.one_line()}")


def prepare_stage1(args: TrainArgs, pipeline: Pipeline, plan: Plan, dataset: DiffusionDataset, cache: Cache,
                   report: Reporter) -> tuple[dict[str, Any], str]:
    """Main process, under the cache lock: work out every sample's key, keep the valid entries, write the manifest.

    Returns the manifest (status `filling` with a `pending` list, or `complete`) and one line saying
    why entries are (re)computed.
    Raises BackendError before changing anything when the folder holds another plan's cache or the
    inputs are bad.
    """
    existing = cache.read_manifest()
    if existing is not None and existing.get("plan_fingerprint") != plan.fingerprint:
        raise BackendError(f"holds the cache of another plan ({describe_plan_change(existing, plan)}); choose another "
                           "cache folder (--cache_path or --output_path) or delete this one", source=str(cache.folder))
    cache.warn_unsafe(report)
    memo = HashMemo(cache.hashes_path)
    key_inputs = stage1_key_inputs(args, pipeline, plan, memo)
    static = canonical_hash(key_inputs)
    params = key_inputs["dataset_params"]
    samples: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i in range(len(dataset)):
        try:
            sid = dataset.sample_id(i, memo.digest)
            key = entry_key(static, dataset.key_inputs(i, params, memo.digest))
        except SampleError as exc:
            _skip(skipped, i, exc, report)
            continue
        samples.append({"index": i, "sample_id": sid, "key": key})

    # what is already there: the manifest's records and those of an interrupted run's journals
    records: dict[str, dict[str, Any]] = dict((existing or {}).get("entries") or {})
    for record in cache.read_journals():
        if all(k in record for k in ("key", "file", "size", "sha256")):
            records[record["key"]] = {k: record[k] for k in ("key", "file", "size", "sha256")}
    first: dict[str, dict[str, Any]] = {}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        first.setdefault(s["key"], s)
        by_key.setdefault(s["key"], []).append(s)
    valid: dict[str, dict[str, Any]] = {}
    damaged = 0
    for key in first:
        record = records.get(key)
        if record is None:
            continue
        problem = cache.check_entry(record)
        if problem is None:
            valid[key] = record
        else:
            damaged += 1
            report(f"warning: {sample_label(first[key])}: {problem}; recomputing it")
    # a cheap look at the samples about to be computed (missing, unreadable or tiny images are skipped)
    bad_keys = set()
    for key, s in first.items():
        if key in valid:
            continue
        try:
            dataset.check(s["index"])
        except SampleError as exc:
            bad_keys.add(key)
            for other in by_key[key]:
                _skip(skipped, other["index"], exc, report)
    samples = [s for s in samples if s["key"] not in bad_keys]
    skipped.sort(key=lambda s: s["index"])
    if not samples:
        first_reason = skipped[0]["reason"] if skipped else "the metadata has no rows"
        raise BackendError(f"no usable samples: all {len(dataset)} were skipped (first: {first_reason})",
                           source=str(dataset.metadata_path))
    pending = [{"key": key, "index": s["index"], "sample_id": s["sample_id"]}
               for key, s in first.items() if key not in valid and key not in bad_keys]

    # why there is work, in one line
    if existing is None:
        reason = f"new cache: computing {_count(len(pending), 'entry', 'entries')}"
    else:
        changes = describe_key_change(existing.get("key_inputs") or {}, key_inputs)
        if changes and pending:
            reason = f"{'; '.join(changes)}: recomputing {len(pending)} of {_count(len(first) - len(bad_keys), 'entry', 'entries')}"
        elif pending:
            parts = [_count(len(pending) - damaged, "new or changed sample", "new or changed samples")] if len(pending) > damaged else []
            parts += [f"{damaged} damaged"] if damaged else []
            reason = f"computing {_count(len(pending), 'entry', 'entries')} ({', '.join(parts)})"
        else:
            reason = f"all {_count(len(valid), 'entry', 'entries')} valid: nothing to compute"

    cache.entries_dir.mkdir(parents=True, exist_ok=True)
    cache.clean_temp_files()
    manifest = {
        "format": FORMAT,
        "status": "filling" if pending else "complete",
        "pipeline": plan.pipeline,
        "plan_fingerprint": plan.fingerprint,
        "cache_mode": plan.cache_mode,
        "keys": key_inputs["entries"],
        "plan": plan.to_dict(),
        "key_inputs": key_inputs,
        "key_inputs_hash": "sha256:" + static,
        "settings": stage1_settings(args, plan),
        "settings_hash": settings_hash(stage1_settings(args, plan)),
        "made_with": made_with(args),
        "num_samples": len(samples),
        "samples": samples,
        # while filling, records of other entries still on disk are kept (a changed setting may be reverted)
        "entries": {**{k: r for k, r in records.items() if k not in first and cache.folder.joinpath(r["file"]).is_file()},
                    **valid} if pending else valid,
        "skipped": skipped,
        "pending": pending,
    }
    if not pending:
        del manifest["pending"]
        _prune_orphans(cache, set(valid))
    if manifest != existing:
        cache.write_manifest(manifest)
    cache.clear_journals()
    memo.save(prune=True)  # this run asked about every file the cache depends on
    return manifest, reason


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _prune_orphans(cache: Cache, keep: set[str]) -> int:
    removed = 0
    for path in cache.entry_files():
        if path.name[: -len(".safetensors")] not in keep:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def finish_stage1(cache: Cache, manifest: dict[str, Any]) -> tuple[list[int], dict[int, int]]:
    """Main process, after every process finished: merge the journals; the manifest says `complete`.

    Returns the indices of the samples whose entries this run computed, and how many each process computed.
    """
    entries = dict(manifest["entries"])
    computed = []
    per_process: dict[int, int] = {}
    for record in cache.read_journals():
        if all(k in record for k in ("key", "file", "size", "sha256")):
            entries[record["key"]] = {k: record[k] for k in ("key", "file", "size", "sha256")}
            if "index" in record:
                computed.append(int(record["index"]))
            rank = int(record.get("rank", 0))
            per_process[rank] = per_process.get(rank, 0) + 1
    needed = {s["key"] for s in manifest["samples"]}
    missing = [s for s in manifest["samples"] if s["key"] not in entries or not cache.entry_file(s["key"]).is_file()]
    if missing:  # pragma: no cover - every process computes its share or stops with an error
        raise RuntimeError(f"stage 1 left {len(missing)} samples without a cache entry (e.g. index {missing[0]['index']})")
    manifest = {k: v for k, v in manifest.items() if k != "pending"}
    manifest.update(status="complete", entries={k: entries[k] for k in sorted(needed)})
    _prune_orphans(cache, needed)
    cache.write_manifest(manifest)
    cache.clear_journals()
    return sorted(set(computed)), dict(sorted(per_process.items()))


def write_entry(cache: Cache, key: str, values: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Store one entry (atomically); its record. A module-level hook: benchmarks time stage 1 per entry here."""
    return cache.store_entry(key, values, meta)


def compute_entries(args: TrainArgs, pipeline: Pipeline, plan: Plan, dataset: DiffusionDataset, cache: Cache,
                    work: list[dict[str, Any]], accelerator: Any) -> None:
    """Compute and store the given entries, recording each in this process's journal once it is in place."""
    models = load_models(args, plan.data_process_models, need_scheduler=False, device=accelerator.device)
    ctx = make_context(args, models, accelerator.device)
    schedule = stage1_schedule(plan)
    units = {u.name: u for u in pipeline.units}
    store_dtype = None if cache_dtype_name(args) == DTYPE else getattr(torch, cache_dtype_name(args))
    done = 0
    bar = _progress(work, len(work), "stage 1 (data_process)", args.progress and accelerator.is_local_main_process)
    with torch.no_grad(), Journal(cache.journal_path(accelerator.process_index)) as journal:
        for item in bar:
            index = int(item["index"])
            try:
                state = dataset.sample(index)
                values = {key: state.get(param) for param, key in schedule.snapshots_after.get(None, [])}
                for name in schedule.units:
                    state.update(run_unit(units[name], ctx, state))
                    for param, key in schedule.snapshots_after.get(name, []):
                        values[key] = state[param]
                for param, key in schedule.final:
                    values[key] = state.get(param)
                if store_dtype is not None:  # --cache_dtype: floating tensors stored in another dtype
                    values = {key: _cast(value, store_dtype) for key, value in values.items()}
            except BackendError as exc:
                raise BackendError(f"stage 1 stopped at sample {index} (metadata row {index + 1}): {exc.one_line()}; "
                                   f"the entries finished so far ({done} in this process) are kept: fix the input "
                                   "and run the same command again") from None
            record = write_entry(cache, item["key"], values, {"key": item["key"], "index": index, "sample_id": item["sample_id"]})
            journal.append({**record, "index": index, "rank": accelerator.process_index})
            done += 1
    del models, ctx
    gc.collect()


def run_data_process(args: TrainArgs, pipeline: Pipeline, plan: Plan, accelerator: Any, cache_dir: Path,
                     report: Reporter, before_compute: Optional[Callable[[], None]] = None) -> Stage1Result:
    """Fill `cache_dir` for `plan`: each missing or damaged entry once, sharded over processes.

    The main process decides the work under the cache lock and writes it into the manifest; every
    process takes its share of the pending entries (exactly once: no padding), journals them, and
    the main process merges the journals at the end. Bad input stops before anything is written; a
    stop while computing keeps every finished entry.
    """
    start = time.perf_counter()
    cache = Cache(cache_dir)
    main = accelerator.is_main_process
    dataset = make_dataset(args, pipeline)
    manifest: dict[str, Any] = {}
    reason = ""
    computed: list[int] = []
    with contextlib.ExitStack() as stack:
        if main:
            created = not cache.folder.exists()
            stack.enter_context(cache.locked())
            try:
                manifest, reason = prepare_stage1(args, pipeline, plan, dataset, cache, report)
            except BaseException:
                if created:  # nothing of value was written: leave no trace
                    shutil.rmtree(cache.folder, ignore_errors=True)
                raise
            report(f"stage 1: {manifest['num_samples']} samples; {reason}")
            if before_compute is not None:
                before_compute()
        accelerator.wait_for_everyone()
        if not main:
            manifest = cache.read_manifest() or {}
        pending = manifest.get("pending") or []
        mine = pending[accelerator.process_index::accelerator.num_processes]
        if mine:
            compute_entries(args, pipeline, plan, dataset, cache, mine, accelerator)
        accelerator.wait_for_everyone()
        if main and pending:
            computed, per_process = finish_stage1(cache, manifest)
            shares = ", ".join(str(per_process.get(r, 0)) for r in range(accelerator.num_processes))
            report(f"stage 1: computed {_count(sum(per_process.values()), 'entry', 'entries')} over {accelerator.num_processes} "
                   f"process{'es' if accelerator.num_processes > 1 else ''} ({shares})")
    accelerator.wait_for_everyone()
    skipped = list(manifest.get("skipped") or [])
    if main and skipped:
        report(f"stage 1: skipped {len(skipped)} of {len(skipped) + manifest['num_samples']} samples (warnings above); "
               "they are left out of the cache")
    unique = len({s["key"] for s in manifest.get("samples") or []})
    return Stage1Result(seconds=time.perf_counter() - start, samples=int(manifest.get("num_samples") or 0),
                        computed=computed, reused=unique - len(pending), skipped=skipped, reason=reason)


def repair_cache(cache_dir: str | Path, overrides: Optional[dict[str, Any]] = None,
                 echo: Optional[Callable[[str], None]] = None, progress: bool = False) -> Stage1Result:
    """Re-run stage 1 for an existing cache with the arguments recorded in it (`overrides` may relocate
    the dataset or the models): recomputes exactly the entries that are missing, damaged or out of date."""
    from .args import make_args

    cache = Cache(cache_dir)
    manifest = cache.read_manifest()
    if manifest is None:
        raise BackendError("no manifest.json: not a cache folder", source=str(cache.folder))
    recorded = dict(manifest.get("made_with") or {})
    if not recorded.get("task"):
        raise BackendError("the manifest does not record how stage 1 ran (made_with); re-run the data_process stage",
                           source=str(cache.manifest_path))
    family = recorded.pop("task")
    recorded.update({k: v for k, v in (overrides or {}).items() if v is not None})
    args = make_args(task=f"{family}:data_process", output_path=str(cache.folder), cache_path=str(cache.folder),
                     progress=progress, plot=False, **recorded)
    pipeline = pipeline_for(args)
    plan = plan_for(args, pipeline)
    if plan.fingerprint != manifest.get("plan_fingerprint"):
        raise BackendError(f"the recorded arguments give another plan ({describe_plan_change(manifest, plan)})",
                           source=str(cache.folder))
    accelerator = make_accelerator(args)
    return run_data_process(args, pipeline, plan, accelerator, cache.folder, Reporter(accelerator, echo))


# ------------------------------------------------------------------------------------------------
# sample providers: where a training step's sink inputs come from


@dataclass(frozen=True)
class Item:
    index: int
    sample_id: str


class LiveProvider:
    """The unsplit baseline: every unit runs on the raw sample, every step.

    Samples that the cheap look of `DiffusionDataset.check` rejects are skipped with a warning, as
    stage 1 skips them, so an unsplit run and a split run train on the same samples.
    """

    def __init__(self, args: TrainArgs, pipeline: Pipeline, plan: Plan, report: Optional[Callable[[str], None]] = None):
        report = report or (lambda _text: None)
        self.pipeline = pipeline
        self.dataset = make_dataset(args, pipeline)
        self.items: list[Item] = []
        self.skipped: list[dict[str, Any]] = []
        for i in range(len(self.dataset)):
            try:
                self.dataset.check(i)
                self.items.append(Item(i, self.dataset.sample_id(i)))
            except SampleError as exc:
                self.skipped.append({"index": i, "reason": exc.one_line()})
                report(f"warning: skipping sample {i}: {exc.one_line()}")
        if not self.items:
            raise BackendError(f"no usable samples: all {len(self.dataset)} were skipped (first: {self.skipped[0]['reason']})",
                               source=str(self.dataset.metadata_path))
        self.models = sorted(set(pipeline.models) | set(plan.models_require_backward))
        self.backward = set(plan.models_require_backward)

    def label(self, item: Item) -> str:
        return sample_label({"index": item.index, "sample_id": item.sample_id})

    def sink_inputs(self, item: Item, ctx: UnitContext) -> dict[str, Any]:
        state = self.dataset.sample(item.index)
        for unit in self.pipeline.units:
            with _unit_grad(unit, self.backward, {p: state.get(p) for p in unit.inputs}):
                state.update(run_unit(unit, ctx, state))
        return {p: state.get(p) for p in self.pipeline.sink.inputs}


@contextlib.contextmanager
def _local_models_only():
    """Resolve modelscope ids from the local cache only, for the duration of the block."""
    from .models import OFFLINE_ENV

    before = os.environ.get(OFFLINE_ENV)
    os.environ[OFFLINE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OFFLINE_ENV, None)
        else:
            os.environ[OFFLINE_ENV] = before


def check_cache_matches(args: TrainArgs, pipeline: Pipeline, plan: Plan, cache: Cache, manifest: dict[str, Any],
                        save_memo: bool = True) -> None:
    """Stop before training when the cache was made with other stage-1 settings, inputs or models.

    Compared: the settings the data_process units read, the dataset columns they were given
    (--extra_inputs, --data_file_keys), and, when this run can find them, the weights of the
    data_process models (hashed once, remembered beside the cache). The message says what changed
    and how to rebuild.
    """
    recorded = manifest.get("key_inputs") or {}
    changes = []
    now = stage1_key_settings(args, plan)
    before = recorded.get("settings") or {}
    for name in sorted(set(now) | set(before)):
        if now.get(name) != before.get(name):
            changes.append(f"{describe_setting(name, now.get(name))} now, {describe_setting(name, before.get(name))} in the cache")
    deps = stage1_dependencies(pipeline, plan)
    made = manifest.get("made_with") or {}
    for flag, current in (("extra_inputs", args.extra_inputs), ("data_file_keys", args.data_file_keys)):
        a = sorted(x for x in split_list(current) if x in deps.dataset_params)
        b = sorted(x for x in split_list(made.get(flag)) if x in deps.dataset_params)
        if a != b:
            changes.append(f"--{flag} {','.join(a) or '(none)'} now, {','.join(b) or '(none)'} in the cache")
    try:
        with _local_models_only():  # never download a stage-1 model just to compare it
            files = stage1_model_files(args, deps.models)
    except BackendError:
        files = None  # stage 2 need not have the stage-1 models at all; then there is nothing to compare
    if files is not None:
        memo = HashMemo(cache.hashes_path)
        digests = model_files_digest(files, memo.digest)
        if save_memo:
            with contextlib.suppress(OSError):
                memo.save()
        for slot in sorted(set(digests) | set(recorded.get("models") or {})):
            a, b = digests.get(slot) or {}, (recorded.get("models") or {}).get(slot) or {}
            if a != b:
                changed = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
                changes.append(f"{slot} weights differ from the cache's ({', '.join(changed[:3])})")
    if changes:
        family = args.family
        raise BackendError(f"cache entries do not match this run: {'; '.join(changes)}; rebuild them with --task "
                           f"{family}:data_process (same flags) or train with --task {family}:split", source=str(cache.folder))


class CacheProvider:
    """Stage 2: train units and the sink, fed per `stage2_bindings` from live outputs and cache entries.

    Before the first step: the cache must be complete, made under this plan (and, given `args`,
    with this run's stage-1 settings and models), and every entry file must have its recorded
    size. Each entry's checksum is checked the first time it is read; a small cache is read (and
    checked) entirely up front. A damaged entry stops training with one line naming the sample.
    """

    def __init__(self, pipeline: Pipeline, plan: Plan, cache_dir: Path, args: Optional[TrainArgs] = None,
                 report: Optional[Callable[[str], None]] = None, main: bool = True):
        report = report or (lambda _text: None)
        self.pipeline = pipeline
        self.plan = plan
        self.cache = Cache(cache_dir)
        manifest = self.cache.open_for_training(plan)
        self.cache.warn_unsafe(report)
        if args is not None:
            check_cache_matches(args, pipeline, plan, self.cache, manifest, save_memo=main)
        samples = sorted(manifest["samples"], key=lambda s: int(s["index"]))
        self.items = [Item(int(s["index"]), str(s["sample_id"])) for s in samples]
        self._keys = {str(s["sample_id"]): str(s["key"]) for s in samples}
        self._labels = {str(s["sample_id"]): sample_label(s) for s in samples}
        self.records = manifest.get("entries") or {}
        self.skipped = list(manifest.get("skipped") or [])
        self.models = list(plan.train_models)
        self.backward = set(plan.models_require_backward)
        self.bindings = stage2_bindings(pipeline, plan)
        self.units = [pipeline.units[pipeline.index(name)] for name in plan.train_units]
        self._entries: dict[str, dict[str, Any]] = {}
        self._verified: set[str] = set()
        # --cache_dtype: floating tensors stored in another dtype than the model's are cast back when read
        stored = ((manifest.get("key_inputs") or {}).get("settings") or {}).get("cache_dtype") or DTYPE
        self.dtype = None if stored == DTYPE else getattr(torch, DTYPE)
        total = 0
        hint = f"run 'unitgraph cache repair {self.cache.folder}' or the data_process stage again"
        for s in samples:
            record = self.records.get(str(s["key"]))
            if record is None:
                raise BackendError(f"{sample_label(s)} has no entry record; {hint}", source=str(self.cache.manifest_path))
            path = self.cache.folder / record["file"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise BackendError(f"cache entry of {sample_label(s)} is missing; {hint}", source=str(path)) from None
            if size != record["size"]:
                raise BackendError(f"cache entry of {sample_label(s)} has {size} bytes, expected {record['size']} "
                                   f"(truncated or overwritten); {hint}", source=str(path))
            total += size
        self.keep_in_memory = total <= KEEP_IN_MEMORY_BYTES
        if self.skipped:
            report(f"note: the cache leaves out {len(self.skipped)} samples that stage 1 skipped "
                   f"('unitgraph cache info {self.cache.folder}' lists them)")
        if self.keep_in_memory:
            for item in self.items:
                self.entry(item.sample_id)

    def label(self, item: Item) -> str:
        return self._labels.get(item.sample_id) or sample_label({"index": item.index, "sample_id": item.sample_id})

    def entry_file(self, item: Item) -> Path:
        """The entry file of a sample (its header gives the shapes stage 2 batches by; reading its values goes
        through `entry`, which checks the checksum)."""
        return self.cache.folder / self.records[self._keys[item.sample_id]]["file"]

    def entry(self, sample_id: str) -> dict[str, Any]:
        """The values of a sample's entry as stored, checked against its size and (on first read) its checksum."""
        key = self._keys[sample_id]
        if key in self._entries:
            return self._entries[key]
        values = self.cache.load_entry(self.records[key], self._labels[sample_id], verify=key not in self._verified)
        self._verified.add(key)
        if self.keep_in_memory:
            self._entries[key] = values
        return values

    def sink_inputs(self, item: Item, ctx: UnitContext) -> dict[str, Any]:
        cached = self.entry(item.sample_id)
        if self.dtype is not None:
            cached = {k: _cast(v, self.dtype) for k, v in cached.items()}
        live: dict[tuple[str, str], Any] = {}

        def value(reader: str, param: str) -> Any:
            binding = self.bindings[(reader, param)]
            if binding.source == "live":
                return live[(binding.writer, param)]
            return cached[binding.key]

        for unit in self.units:
            inputs = {p: value(unit.name, p) for p in unit.inputs}
            with _unit_grad(unit, self.backward, inputs):
                out = run_unit(unit, ctx, inputs)
            for p in unit.outputs:
                live[(unit.name, p)] = out[p]
        return {p: value(SINK, p) for p in self.pipeline.sink.inputs}


# ------------------------------------------------------------------------------------------------
# the training loop


def _prepare_models(args: TrainArgs, plan: Plan, models: dict[str, Any], accelerator: Any):
    from .lora import add_lora, load_lora_checkpoint, merge_preset_lora

    if args.preset_lora_path:
        target = args.preset_lora_model or args.lora_base_model
        if target not in models:
            raise BackendError(f"--preset_lora_model {target!r} is not loaded in this stage (stage models: {', '.join(sorted(models))})")
        merge_preset_lora(models[target], target, args.preset_lora_path)
    for slot in args.trainable():
        models[slot].requires_grad_(True)
        models[slot].train()
    lora_config = None
    if args.lora_base_model:
        base = models[args.lora_base_model]
        lora_config = add_lora(base, args.lora_base_model, args.lora_targets(), args.lora_rank, args.lora_alpha, args.seed)
        base.train()
        if args.lora_checkpoint:
            load_lora_checkpoint(base, args.lora_base_model, args.lora_checkpoint)
    if args.use_gradient_checkpointing or args.use_gradient_checkpointing_offload:
        for slot in plan.models_require_backward:
            model = models[slot]
            if hasattr(model, "enable_gradient_checkpointing"):
                model.enable_gradient_checkpointing()
            elif hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for slot in plan.models_require_backward for p in models[slot].parameters() if p.requires_grad]
    if not params:
        raise BackendError("no trainable parameters (check --lora_target_modules / --trainable_models)")
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    wrapped = dict(models)
    for slot in plan.models_require_backward:
        wrapped[slot] = accelerator.prepare(models[slot])
    optimizer = accelerator.prepare(optimizer)
    return wrapped, optimizer, lora_config


def _save(args: TrainArgs, output: Path, name: str, models: dict[str, Any], lora_config: Any, accelerator: Any) -> Path:
    from .lora import checkpoint_state, save_checkpoint

    raw = {slot: accelerator.unwrap_model(m) if isinstance(m, torch.nn.Module) else m for slot, m in models.items()}
    state = checkpoint_state(raw, args.lora_base_model, args.trainable())
    return save_checkpoint(output / name, state, args.lora_base_model, lora_config, args.remove_prefix_in_ckpt)


def write_loss_plot(rows: list[tuple[int, int, float, float]], path: Path, title: str) -> Optional[Path]:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from unitgraph.atomic import write_bytes_atomic

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    steps = [r[0] for r in rows]
    losses = [r[2] for r in rows]
    ax.plot(steps, losses, linewidth=1, label="loss")
    if len(losses) >= 10:
        k = max(2, len(losses) // 20)
        smooth = [sum(losses[max(0, i - k + 1): i + 1]) / len(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, linewidth=2, label=f"mean of {k}")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_bytes_atomic(path, buffer.getvalue())
    return path


def _stop_on_bad_loss(loss: torch.Tensor, step: int, epoch: int, items: list[Item], provider: Any, accelerator: Any,
                      result: RunResult, width: int = 1) -> None:
    """A NaN or infinite loss stops training before it reaches the weights, naming the step and the sample(s).

    With several processes every process learns whether any of them saw one (one tiny all-gather
    per micro-step: a flag, the loss and the indices of up to `width` samples), so they all stop
    together instead of waiting on each other in backward.
    """
    value = float(loss.detach().float())
    bad = not math.isfinite(value)
    if accelerator.num_processes > 1:
        indices = [float(it.index) for it in items][:width]
        indices += [-1.0] * (width - len(indices))
        mine = torch.tensor([[float(bad), value if bad else 0.0, *indices]], dtype=torch.float64, device=accelerator.device)
        every = accelerator.gather(mine).cpu().tolist()
        culprits = [(rank, row) for rank, row in enumerate(every) if row[0] > 0]
        if not culprits:
            return
        rank, row = culprits[0]
        value = row[1]
        names = {it.index: it for it in provider.items}
        items = [names.get(int(i), Item(int(i), "")) for i in row[2:] if i >= 0]
        where = f" (process {rank})"
    elif not bad:
        return
    else:
        where = ""
    last = result.checkpoints[-1] if result.checkpoints else None
    kept = f"the last good checkpoint is kept: {last}" if last else "no checkpoint had been saved yet"
    labels = [provider.label(it) for it in items]
    on = labels[0] if len(labels) == 1 else f"a batch of {len(labels)}: {'; '.join(labels)}"
    raise BackendError(f"loss is {value} at step {step} (epoch {epoch}) on {on}{where}: "
                       f"training stopped before updating the weights; {kept}")


class LiveData:
    """The unsplit run's samples, one per micro-batch, with the interface of `loader.Stage2Data`.

    Same elements, order and sharding as stage 2 at batch size 1; every unit runs on the raw sample
    when its batch is asked for (inside the step's dropout stream, as the units of stage 2 that call
    models do).
    """

    batch_size = 1

    def __init__(self, provider: "LiveProvider", seed: int, dataset_repeat: int = 1):
        self.provider = provider
        self.seed = int(seed)
        self.elements = expand(provider.items, dataset_repeat)

    def batches(self, epoch: int, rank: int = 0, world: int = 1) -> list[list[Any]]:
        order = bucket_batches([0] * len(self.elements), 1, self.seed, epoch)
        return shard_batches([[self.elements[j] for j in batch] for batch in order], rank, world)

    def iterate(self, epoch: int, ctx: UnitContext, rank: int = 0, world: int = 1, batches: Optional[list] = None,
                workers: int = 0, prefetch: Optional[int] = None):
        for elements in (self.batches(epoch, rank, world) if batches is None else batches):
            element = elements[0]
            ctx.epoch, ctx.sample_key = epoch, element.sample_key
            yield Batch(epoch, list(elements), inputs=self.provider.sink_inputs(element.item, ctx))


def stage2_data(args: TrainArgs, provider: "CacheProvider") -> Stage2Data:
    """Stage 2's batches from the provider's cache: entries read through `CacheProvider.entry` (checked
    against their size and checksum), bucketed by the shapes in their headers, cast back to the model's
    dtype when --cache_dtype stored them in another."""
    return Stage2Data(provider.pipeline, provider.plan, provider.items, read=lambda it: provider.entry(it.sample_id),
                      entry_path=provider.entry_file, seed=args.seed, batch_size=args.batch_size,
                      dataset_repeat=args.dataset_repeat, backward=provider.backward, dtype=provider.dtype)


_DROP_NAME = re.compile(r"Drop|dropout|drop_?path")


def draws_dropout(models: dict[str, Any]) -> bool:
    """Whether a training step can draw from torch's global random stream: some model in training mode
    has an active dropout (a dropout module with p > 0, a module of another kind named like one, or a
    positive `*dropout*` / `drop_path*` value in its config). When none has, the seeded dropout stream
    around each micro-step changes no number and is skipped."""
    for model in models.values():
        if not isinstance(model, torch.nn.Module):
            continue
        for module in model.modules():
            if not module.training:
                continue
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                if float(module.p) > 0:
                    return True
            elif _DROP_NAME.search(type(module).__name__):  # DropPath, StochasticDropout, ... (not EmbedRope)
                return True
            config = getattr(module, "config", None)
            if config is not None and _config_dropout(config):
                return True
    return False


def _config_dropout(config: Any, depth: int = 0) -> bool:
    if depth > 4:
        return False
    items = config.items() if isinstance(config, dict) else vars(config).items() if hasattr(config, "__dict__") else ()
    for key, value in items:
        if isinstance(value, (dict,)) or (hasattr(value, "__dict__") and not isinstance(value, (str, bytes, type))
                                          and type(value).__module__.startswith(("transformers", "diffusers"))):
            if _config_dropout(value, depth + 1):
                return True
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
                and ("dropout" in str(key).lower() or "drop_path" in str(key).lower()):
            return True
    return False


def run_training(args: TrainArgs, plan: Plan, provider: Any, accelerator: Any, output: Path, report: Reporter,
                 result: RunResult, data: Any = None) -> None:
    """AdamW over the provider's samples; loss.csv, checkpoints, loss plot in `output`.

    `data` gives each epoch's micro-batches and their sink inputs (`loader.Stage2Data` for stage 2,
    `LiveData` for the unsplit run; built from the provider when not given).
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    if data is None:
        data = stage2_data(args, provider) if isinstance(provider, CacheProvider) else LiveData(provider, args.seed, args.dataset_repeat)
    models = load_models(args, provider.models, need_scheduler=True, device=accelerator.device)
    models, optimizer, lora_config = _prepare_models(args, plan, models, accelerator)
    result.plan_path = _write_run_files(args, plan, output, accelerator)  # only once every input has been checked
    sink = SINKS[plan.pipeline]
    ctx = make_context(args, models, accelerator.device)
    wrapped = [models[s] for s in plan.models_require_backward if hasattr(models[s], "no_sync")]
    # Dropout draws from torch's global stream: each micro-step seeds it from its samples' keys, so the
    # unsplit and the split run draw the same masks. Without any active dropout there is nothing to seed.
    seeded = draws_dropout(models)

    accum = args.gradient_accumulation_steps
    total_steps = len(step_groups(data.batches(0, rank, world), accum)) * args.num_epochs
    main = accelerator.is_main_process
    loss_csv = output / "loss.csv"
    rows: list[tuple[int, int, float, float]] = []
    log: Any = None
    if main:
        output.mkdir(parents=True, exist_ok=True)
        log = loss_csv.open("w", encoding="utf-8", newline="")  # opened once; each row is flushed as it is written
        log.write("step,epoch,loss,elapsed_s\n")
        log.flush()
    show = args.progress and accelerator.is_local_main_process
    step = 0
    t0: Optional[float] = None
    last = None
    bar = _progress(range(total_steps), total_steps, "stage 2 (train)" if isinstance(provider, CacheProvider) else "train", show)
    try:
        for epoch in range(args.num_epochs):
            batches = data.batches(epoch, rank, world)
            it = data.iterate(epoch, ctx, rank, world, batches=batches, workers=args.dataset_num_workers)
            try:
                for group in step_groups(batches, accum):
                    total = sum(len(b) for b in group)
                    if t0 is None:
                        t0 = time.perf_counter()
                    losses = []
                    for k, elements in enumerate(group):
                        keys = [e.sample_key for e in elements]
                        sync = k == len(group) - 1
                        with contextlib.ExitStack() as stack:
                            if not sync and world > 1:
                                for model in wrapped:
                                    stack.enter_context(model.no_sync())
                            if seeded:  # the units that call models run in next(it): inside the stream too
                                stack.enter_context(seeded_global_stream(args.seed, "dropout", epoch, *keys))
                            batch = next(it)
                            if batch.sample_keys != keys:  # pragma: no cover - iterate() follows `batches`
                                raise RuntimeError(f"stage 2 batches out of order: {batch.sample_keys} instead of {keys}")
                            ctx.epoch, ctx.sample_key = epoch, keys[0]
                            loss = sink(ctx, **batch.inputs)
                            _stop_on_bad_loss(loss, step + 1, epoch, [e.item for e in elements], provider, accelerator,
                                              result, data.batch_size)
                            # each micro-batch loss is a mean over its samples: weight it by its share of the step
                            # (at one micro-batch per step the loss as it is: x / 1 is x, value and gradient)
                            accelerator.backward(loss if len(batch) == total else loss / total if len(batch) == 1
                                                 else loss * len(batch) / total)
                        losses.append((loss.detach().float(), len(batch)))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    step += 1
                    step_loss = (torch.stack([value for value, _ in losses]).mean() if all(n == 1 for _, n in losses)
                                 else sum(value * n for value, n in losses) / total)
                    if world > 1:
                        step_loss = accelerator.reduce(step_loss.to(accelerator.device), reduction="mean")
                    now = time.perf_counter()
                    row = (step, epoch, float(step_loss), now - t0)
                    rows.append(row)
                    result.step_times.append(now - (last if last is not None else t0))
                    last = now
                    if log is not None:
                        csv.writer(log).writerow([row[0], row[1], repr(row[2]), f"{row[3]:.6f}"])
                        log.flush()
                    if show:
                        bar.set_postfix(loss=f"{row[2]:.4f}", epoch=epoch, refresh=False)
                        bar.update(1)
                    if args.save_steps and step % args.save_steps == 0:
                        accelerator.wait_for_everyone()
                        if main:
                            result.checkpoints.append(_save(args, output, f"step-{step}.safetensors", models, lora_config, accelerator))
            finally:
                it.close()
            accelerator.wait_for_everyone()
            if main:
                result.checkpoints.append(_save(args, output, f"epoch-{epoch}.safetensors", models, lora_config, accelerator))
    finally:
        if log is not None:
            log.close()
    bar.close()
    result.steps = step
    result.losses = [r[2] for r in rows]
    result.loss_csv = loss_csv
    if main and args.plot:
        result.loss_plot = write_loss_plot(rows, output / "loss.png", f"{plan.pipeline} · {args.task}")
    accelerator.wait_for_everyone()


# ------------------------------------------------------------------------------------------------
# entry point


def _write_run_files(args: TrainArgs, plan: Plan, output: Path, accelerator: Any) -> Path:
    path = output / "plan.json"
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, plan.to_json())
        write_text_atomic(output / "training_args.json", args.to_json())
    return path


def run(args: TrainArgs, echo: Optional[Callable[[str], None]] = None, accelerator: Any = None) -> RunResult:
    """Execute `args.task`. Bad input raises BackendError (one line) before anything is written."""
    args.validate()
    if args.fp8_models:
        (echo or print)("note: --fp8_models is ignored (no fp8 training on this backend)")
    pipeline = pipeline_for(args)
    plan = plan_for(args, pipeline)
    accelerator = accelerator or make_accelerator(args)
    report = Reporter(accelerator, echo)
    output = Path(args.output_path)
    result = RunResult(task=args.task, output_path=output, plan=plan)
    stage = args.stage

    def stage1(cache_dir: Path, before_compute: Optional[Callable[[], None]] = None) -> None:
        s1 = run_data_process(args, pipeline, plan, accelerator, cache_dir, report, before_compute)
        result.cache_path, result.cache_reused = cache_dir, s1.reused_all
        result.entries_computed, result.entries_reused = len(s1.computed), s1.reused
        result.computed_indices, result.skipped, result.stage1_reason = s1.computed, s1.skipped, s1.reason
        result.stage_times["data_process"] = s1.seconds
        result.samples = s1.samples

    if stage == "data_process":
        cache_dir = Path(args.cache_path) if args.cache_path else output

        def write_run_files() -> None:
            result.plan_path = _write_run_files(args, plan, cache_dir, accelerator)

        stage1(cache_dir, write_run_files)
        return result

    if stage == "train":
        if not args.dataset_base_path:
            raise BackendError("--dataset_base_path must be the cache folder written by the data_process stage")
        provider: Any = CacheProvider(pipeline, plan, Path(args.dataset_base_path), args=args, report=report,
                                      main=accelerator.is_main_process)
        result.cache_path = Path(args.dataset_base_path)
        result.skipped = provider.skipped
    elif stage == "split":
        cache_dir = Path(args.cache_path) if args.cache_path else output / "cache"
        stage1(cache_dir)
        provider = CacheProvider(pipeline, plan, cache_dir, args=args, report=report, main=accelerator.is_main_process)
    else:
        provider = LiveProvider(args, pipeline, plan, report)
        result.skipped = provider.skipped
    result.samples = len(provider.items)
    data = stage2_data(args, provider) if isinstance(provider, CacheProvider) else LiveData(provider, args.seed, args.dataset_repeat)
    start = time.perf_counter()
    run_training(args, plan, provider, accelerator, output, report, result, data)
    result.stage_times["train"] = time.perf_counter() - start
    return result


def read_loss_csv(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8", newline="") as handle:
        return [{"step": int(r["step"]), "epoch": int(r["epoch"]), "loss": float(r["loss"]), "elapsed_s": float(r["elapsed_s"])}
                for r in csv.DictReader(handle)]

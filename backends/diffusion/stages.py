"""Running a task: unsplit (`sft`), stage 1 (`:data_process`), stage 2 (`:train`) and both (`:split`).

`run(args)` turns the flags into a `config.RunConfig` once, plans the split, and hands the stages
their parts: stage 1 (`stage1.py`) fills the cache; stage 2 reads it through a `CacheProvider`
(checked against the plan, the stage-1 settings and models) and `executor.Stage2Data` (the plan's
bindings); the unsplit run executes every unit per sample through a `LiveProvider`; both train in
`training.run_training`. Each stage loads only its plan's models.

All randomness comes from generators derived from --seed (see `randomness.py`), so the unsplit run
and the split run draw the same numbers and end with the same losses and weights.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from unitgraph.errors import OutputError
from unitgraph.plan import Plan
from unitgraph.runtime import stage1_dependencies

from .args import TrainArgs, split_list
from .cache.cache import ENTRIES, SHARDS, Cache, sample_label
from .cache.keys import model_files_digest
from .cache.manifest import Manifest
from .cache.location import is_url, masked_url, open_store
from .config import RunConfig
from .context import DTYPE, UnitContext, describe_setting
from .data.dataset import SampleError
from .errors import BackendError
from .family import PipelineDef
from .report import Reporter
from .result import RunResult
from .data.batching import Share
from .data.mixture import DatasetMixture
from .session import dataset_config, make_accelerator, make_dataset, plan_for, unit_grad
from .stage1 import placement, run_data_process
from .stage1_key import key_settings, model_files
from .train.executor import LiveData, Stage2Data, own_settings
from .train.loop import run_training
from .train.outputs import RunFolder
from .train.validation import check_supported

KEEP_IN_MEMORY_BYTES = 1 << 30  # stage 2 reads (and checks) a cache this small before its first step and keeps it
READ_AHEAD = 32  # entries fetched ahead of the step from an object store
READ_THREADS = 8  # ... by this many concurrent GETs


def location(text: "str | Path") -> "str | Path":
    """A cache location as given: an object-store URL stays a string, anything else is a local path."""
    return str(text) if is_url(text) else Path(text)


def present_sizes(listing: dict[str, int]) -> dict[str, int]:
    """{file: size} of the entry files and shards in `listing` (a whole cache's `store.list()`)."""
    return {rel: size for rel, size in listing.items() if rel.startswith((f"{ENTRIES}/", f"{SHARDS}/"))}


class ReadAhead:
    """Entries fetched from an object store ahead of the step that needs them, READ_THREADS GETs at a time.

    `schedule(keys)` gives the order entries will be asked for (an epoch's); at most READ_AHEAD of them
    are in flight or waiting. `take(key)` hands over the bytes of a fetched entry (and tops the window
    up), or None when that entry was not fetched ahead or its fetch failed: the caller then reads it
    itself, and that read names what is wrong. Checksums are checked by the caller, as for any read.
    """

    def __init__(self, cache: Cache, records: dict[str, dict[str, Any]], depth: int = READ_AHEAD,
                 threads: int = READ_THREADS):
        import threading
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.cache, self.records, self.depth = cache, records, depth
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="unitgraph-read-ahead")
        self.order: Any = deque()
        self.futures: dict[str, Any] = {}
        self.lock = threading.Lock()

    def schedule(self, keys: list[str]) -> None:
        with self.lock:
            self.order = self.order.__class__(keys)  # a fresh deque: the new epoch's order replaces the old
            self._fill()

    def take(self, key: str) -> Optional[bytes]:
        with self.lock:
            future = self.futures.pop(key, None)
            self._fill()
        if future is None:
            return None
        try:
            return future.result()
        except Exception:
            return None

    def _fill(self) -> None:
        while len(self.futures) < self.depth and self.order:
            key = self.order.popleft()
            if key not in self.futures:
                self.futures[key] = self.pool.submit(self.cache.entry_data, self.records[key])


@dataclass(frozen=True)
class Item:
    index: int
    sample_id: str
    dataset: Optional[str] = None  # the --dataset_config dataset it comes from (None: the run's one dataset)


class LiveProvider:
    """The unsplit baseline: every unit runs on the raw sample, every step.

    Samples that the cheap look of `DiffusionDataset.check` rejects are skipped with a warning, as
    stage 1 skips them, so an unsplit run and a split run train on the same samples.
    """

    def __init__(self, cfg: RunConfig, plan: Plan, report: Optional[Callable[[str], None]] = None):
        report = report or (lambda _text: None)
        self.pipeline = cfg.pipeline
        self.dataset = make_dataset(cfg)
        self.items: list[Item] = []
        self.skipped: list[dict[str, Any]] = []
        self.specs = tuple(cfg.data.datasets)
        self.shares = shares_of(self.specs)
        self.settings = dataset_settings(cfg, self.specs)  # the datasets' own sizes, which their units read
        mixture = isinstance(self.dataset, DatasetMixture)
        for i in range(len(self.dataset)):
            try:
                self.dataset.check(i)
                self.items.append(Item(i, self.dataset.sample_id(i), self.dataset.name_of(i) if mixture else None))
            except SampleError as exc:
                self.skipped.append({"index": i, "reason": exc.one_line()})
        if not self.items:
            raise BackendError(f"no usable samples: all {len(self.dataset)} were skipped (first: {self.skipped[0]['reason']})",
                               source=str(self.dataset.metadata_path))
        for skipped in self.skipped:  # warned only now: when nothing is usable, the error above is the one line
            report(f"warning: skipping sample {skipped['index']}: {skipped['reason']}")
        self.models = sorted(set(cfg.pipeline.spec_pipeline.models) | set(plan.models_require_backward))
        self.backward = set(plan.models_require_backward)

    def label(self, item: Item) -> str:
        place = placement(self.dataset, item.index)
        return sample_label({"index": item.index, "sample_id": item.sample_id, **place})

    def sink_inputs(self, item: Item, ctx: UnitContext) -> dict[str, Any]:
        """Every unit of the pipeline on the raw sample, in order (under its dataset's own settings, if it has
        any): the unsplit run's sink inputs."""
        state = self.dataset.sample(item.index)
        with own_settings(ctx, self.settings.get(item.dataset)):
            for unit in self.pipeline.units:
                with unit_grad(unit, self.backward, {p: state.get(p) for p in unit.inputs}):
                    state.update(unit(ctx, state))
        return {p: state.get(p) for p in self.pipeline.loss.declaration.inputs}


def shares_of(specs: Any) -> tuple[Share, ...]:
    """Each dataset's part of an epoch (none for the run's one dataset, which --dataset_repeat expands)."""
    return tuple(Share(spec.name, spec.repeats, spec.weight) for spec in specs)


def dataset_settings(cfg: RunConfig, specs: Any) -> dict[str, Any]:
    """{dataset: its unit settings} for the datasets of a --dataset_config that give a size of their own."""
    out = {}
    for spec in specs:
        own = dataset_config(cfg, spec)
        if own.units != cfg.units:
            out[spec.name] = own.units
    return out


def stage2_datasets(cfg: RunConfig, manifest: Manifest, cache: Cache) -> tuple[Any, ...]:
    """The datasets stage 2 trains on and their shares: those of --dataset_config when it is given (the cache's
    datasets, in their order, each with the settings its entries were made with), else those stage 1 recorded.
    A cache of one dataset made without a config has none; --dataset_repeat expands it."""
    from .data.dataset_config import SHAPING, parse_dataset

    recorded = manifest.datasets
    source = cache.manifest_path
    if recorded is None:
        if cfg.data.datasets:
            raise BackendError("--dataset_config: this cache holds one dataset, made without a dataset config; train "
                               "it with --dataset_repeat, or make its cache with --dataset_config", source=source)
        return ()
    if not cfg.data.datasets:
        if cfg.data.repeat != 1:
            raise BackendError(f"--dataset_repeat {cfg.data.repeat}: this cache holds the datasets of a dataset config, "
                               "each with its own repeats or weight; give --dataset_config to change them",
                               source=source)
        return tuple(parse_dataset(record, n, source, Path(source).parent, check_files=False)
                     for n, record in enumerate(recorded, start=1))
    names, theirs = [s.name for s in cfg.data.datasets], [r["name"] for r in recorded]
    if names != theirs:
        raise BackendError(f"--dataset_config lists the datasets {', '.join(names)}; this cache holds "
                           f"{', '.join(theirs)} (in that order): give the config stage 1 was given, or run stage 1 "
                           "with this one", source=cfg.data.config_path)
    for spec, record in zip(cfg.data.datasets, recorded):
        made = {k: v for k, v in record.items() if k in SHAPING}
        if spec.shaping() != made:
            raise BackendError(f"dataset {spec.name!r}: its settings ({spec.shaping() or 'the run flags'}) are not "
                               f"those its cache entries were made with ({made or 'the run flags'}); rebuild them with "
                               f"--task {cfg.task}:data_process (same config)", source=cfg.data.config_path)
    return tuple(cfg.data.datasets)



def check_cache_matches(cfg: RunConfig, plan: Plan, cache: Cache, manifest: Manifest, save_memo: bool = True) -> None:
    """Stop before training when the cache was made with other stage-1 settings, inputs or models.

    Compared: the settings the data_process units read, the dataset columns they were given
    (--extra_inputs, --data_file_keys), and, when this run can find them offline, the weights of the
    data_process models (hashed once, remembered beside the cache). The message says what changed
    and how to rebuild.
    """
    changes = []
    now, before = key_settings(cfg, plan), manifest.key_settings
    for name in sorted(set(now) | set(before)):
        if now.get(name) != before.get(name):
            changes.append(f"{describe_setting(name, now.get(name))} now, {describe_setting(name, before.get(name))} in the cache")
    deps = stage1_dependencies(cfg.pipeline.spec_pipeline, plan)
    for flag, current in (("extra_inputs", cfg.data.extra_inputs), ("data_file_keys", cfg.data.file_keys)):
        a = sorted(x for x in current if x in deps.dataset_params)
        b = sorted(x for x in split_list(manifest.made_with.get(flag)) if x in deps.dataset_params)
        if a != b:
            changes.append(f"--{flag} {','.join(a) or '(none)'} now, {','.join(b) or '(none)'} in the cache")
    try:
        files = model_files(cfg, deps.models, offline=True)  # never download a stage-1 model just to compare it
    except BackendError:
        files = None  # stage 2 need not have the stage-1 models at all; then there is nothing to compare
    if files is not None:
        memo = cache.memo()
        digests = model_files_digest(files, memo.digest)
        if save_memo:
            with contextlib.suppress(OSError, OutputError, BackendError):  # a read-only cache serves all the same
                memo.save()
        recorded = manifest.model_digests
        for slot in sorted(set(digests) | set(recorded)):
            a, b = digests.get(slot) or {}, recorded.get(slot) or {}
            if a != b:
                changed = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
                changes.append(f"{slot} weights differ from the cache's ({', '.join(changed[:3])})")
    if changes:
        raise BackendError(f"cache entries do not match this run: {'; '.join(changes)}; rebuild them with --task "
                           f"{cfg.task}:data_process (same flags) or train with --task {cfg.task}:split", source=cache.location)


class CacheProvider:
    """Stage 2's samples: the entries of a cache folder, checked before use (`executor.Stage2Data` runs them).

    Before the first step: the cache must be complete, made under this plan (and, given `cfg`,
    with this run's stage-1 settings and models), and every entry file must have its recorded
    size. Each entry's checksum is checked the first time it is read; a small cache is read (and
    checked) entirely up front. A damaged entry stops training with one line naming the sample.
    """

    def __init__(self, pipeline: PipelineDef, plan: Plan, cache_dir: "str | Path", cfg: Optional[RunConfig] = None,
                 report: Optional[Callable[[str], None]] = None, main: bool = True):
        report = report or (lambda _text: None)
        self.pipeline = pipeline
        self.plan = plan
        self.cache = Cache(cache_dir)
        manifest = self.cache.open_for_training(plan, pipeline.task)
        listing = self.cache.store.list()  # one listing for the hygiene check and the entries' sizes below
        self.cache.warn_unsafe(report, listing)
        if cfg is not None:
            check_cache_matches(cfg, plan, self.cache, manifest, save_memo=main)
        samples = sorted(manifest.samples, key=lambda s: int(s["index"]))
        self.items = [Item(int(s["index"]), str(s["sample_id"]), s.get("dataset")) for s in samples]
        self.specs = stage2_datasets(cfg, manifest, self.cache) if cfg is not None else ()
        self.shares = shares_of(self.specs)
        self.settings = dataset_settings(cfg, self.specs) if cfg is not None else {}
        # --validation_dataset's samples: entries read like the training samples', never trained
        held_out = sorted(manifest.held_out or [], key=lambda s: int(s["index"]))
        if cfg is not None and cfg.data.held_out is not None and not held_out:
            raise BackendError("--validation_dataset: this cache holds no held-out samples; make it with "
                               f"--validation_dataset (--task {cfg.task}:data_process or :split)",
                               source=self.cache.manifest_path)
        self.held_out_items = [Item(int(s["index"]), str(s["sample_id"]), s.get("dataset")) for s in held_out]
        self._keys = {str(s["sample_id"]): str(s["key"]) for s in held_out + samples}
        self._labels = {str(s["sample_id"]): sample_label(s) for s in held_out + samples}
        self.records = manifest.entries
        self.cache_dir, self.key_hash = self.cache, manifest.key_inputs_hash  # validation prompts beside it
        if cfg is not None and cfg.validation.prompts:
            from .train.validation import load_encoded, sample_prompt_units, validation_texts

            if all(u.name in plan.data_process_units for u in sample_prompt_units(cfg)):
                load_encoded(self.cache_dir, validation_texts(cfg).keyed, self.key_hash)  # before anything is written
        self.skipped = list(manifest.skipped)
        self.models = list(plan.train_models)
        self.backward = set(plan.models_require_backward)
        self._entries: dict[str, dict[str, Any]] = {}
        self._verified: set[str] = set()
        # --cache_dtype: floating tensors stored in another dtype than the model's are cast back when read
        compute = cfg.units.dtype if cfg is not None else manifest.key_settings.get("dtype") or DTYPE
        stored = manifest.key_settings.get("cache_dtype") or manifest.key_settings.get("dtype") or compute
        self.dtype = None if stored == compute else getattr(torch, compute)
        total = 0
        hint = f"run 'unitgraph cache repair {self.cache.location}' or the data_process stage again"
        sizes = present_sizes(listing)  # not a request per entry
        for s in samples + held_out:
            record = self.records.get(str(s["key"]))
            if record is None:
                raise BackendError(f"{sample_label(s)} has no entry record; {hint}", source=self.cache.manifest_path)
            shown, size = self.cache.describe(record["file"]), sizes.get(record["file"])
            end = int(record.get("offset", 0)) + int(record["size"])
            if size is None:
                raise BackendError(f"cache entry of {sample_label(s)} is missing; {hint}", source=shown)
            if size < end or ("offset" not in record and size != end):
                raise BackendError(f"cache entry of {sample_label(s)} has {size} bytes, expected {end} "
                                   f"(truncated or overwritten); {hint}", source=shown)
            total += int(record["size"])
        self.keep_in_memory = total <= KEEP_IN_MEMORY_BYTES
        self.ahead: Optional[ReadAhead] = None if self.cache.local else ReadAhead(self.cache, self.records)
        if self.skipped:
            report(f"note: the cache leaves out {len(self.skipped)} samples that stage 1 skipped "
                   f"('unitgraph cache info {self.cache.location}' lists them)")
        if self.keep_in_memory:
            if self.ahead is not None:  # fetched concurrently, checked as each is parsed
                self.ahead.schedule([self._keys[item.sample_id] for item in self.items + self.held_out_items])
            for item in self.items + self.held_out_items:
                self.entry(item.sample_id)

    def label(self, item: Item) -> str:
        return self._labels.get(item.sample_id) or sample_label({"index": item.index, "sample_id": item.sample_id})

    def entry_file(self, item: Item) -> "Path | dict[str, Any]":
        """The entry file of a sample, or its header where the entry is not a local file of its own (the header
        gives the shapes stage 2 batches by; reading its values goes through `entry`, which checks the checksum)."""
        record = self.records[self._keys[item.sample_id]]
        if self.cache.local and "offset" not in record:
            return self.cache.folder / record["file"]
        return self.cache.entry_header(record)

    def read_ahead(self, items: list[Item]) -> None:
        """An epoch's reading order: on an object store its entries are fetched ahead, concurrently."""
        if self.ahead is not None and not self.keep_in_memory:
            self.ahead.schedule([self._keys[item.sample_id] for item in items])

    def entry(self, sample_id: str) -> dict[str, Any]:
        """The values of a sample's entry as stored, checked against its size and (on first read) its checksum."""
        key = self._keys[sample_id]
        if key in self._entries:
            return self._entries[key]
        data = self.ahead.take(key) if self.ahead is not None else None
        values = self.cache.load_entry(self.records[key], self._labels[sample_id], verify=key not in self._verified,
                                       data=data)
        self._verified.add(key)
        if self.keep_in_memory:
            self._entries[key] = values
        return values


def write_cache_run_files(cfg: RunConfig, plan: Plan, cache_dir: "str | Path", accelerator: Any) -> "str | Path":
    """plan.json and training_args.json beside a data_process stage's cache (main process), local or not."""
    store = open_store(cache_dir)
    if accelerator.is_main_process:
        store.write("plan.json", plan.to_json().encode("utf-8"))
        store.write("training_args.json", cfg.args.to_json().encode("utf-8"))
    return Path(store.describe("plan.json")) if store.local else store.describe("plan.json")


def stage2_data(cfg: RunConfig, provider: CacheProvider) -> Stage2Data:
    """Stage 2's batches from the provider's cache: entries read through `CacheProvider.entry` (checked
    against their size and checksum), bucketed by the shapes in their headers, cast back to the model's
    dtype when --cache_dtype stored them in another."""
    return Stage2Data(provider.pipeline, provider.plan, provider.items, read=lambda it: provider.entry(it.sample_id),
                      entry_path=provider.entry_file, seed=cfg.seed, batch_size=cfg.optim.batch_size,
                      dataset_repeat=cfg.data.repeat, pad=cfg.family.pad, backward=provider.backward, dtype=provider.dtype,
                      ahead=provider.read_ahead, shares=provider.shares, settings=provider.settings)


def held_out_data(cfg: RunConfig, provider: CacheProvider) -> Optional[Stage2Data]:
    """The held-out samples' entries (--validation_dataset) as stage 2 reads the training ones, one a batch; None
    when the cache holds none."""
    if not provider.held_out_items:
        return None
    return Stage2Data(provider.pipeline, provider.plan, provider.held_out_items,
                      read=lambda it: provider.entry(it.sample_id), entry_path=provider.entry_file, seed=cfg.seed,
                      pad=cfg.family.pad, backward=provider.backward, dtype=provider.dtype)


def model_notes(cfg: RunConfig) -> list[str]:
    """A line for each model folder of weights without a config.json completed from the family's released configs
    (models/configless.py: DiffSynth's download)."""
    from .models.folders import ModelLoadError

    try:
        sources = cfg.models.sources(cfg.family)
    except ModelLoadError:
        return []  # said in one line where the models are resolved
    return [done.note for done in sources.completed]


def flag_notes(cfg: RunConfig, plan: Plan, accelerator: Any) -> list[str]:
    """One line, at start, for every accepted flag that does nothing here, saying what happens instead."""
    from .config import precision_note

    args, notes = cfg.args, [*model_notes(cfg), *cfg.args.diffsynth_notes()]
    note = precision_note(args, cfg.precision.mixed)
    if note:
        notes.append(note)
    if args.offload_models:
        stage1 = ", ".join(plan.data_process_models) or "none"
        notes.append(f"note: --offload_models is not needed: each stage loads only its plan's models "
                     f"(stage 1: {stage1}; stage 2: {', '.join(plan.train_models)})")
    prefix = cfg.output.remove_prefix
    full = [slot for slot in cfg.optim.trainable if prefix == f"pipe.{slot}." and slot in cfg.prefixes]
    if full and cfg.output.lora_format == "diffusers" and cfg.stage != "data_process":
        notes.append(f"note: --remove_prefix_in_ckpt {prefix}: {full[0]}'s weights are written under their own module "
                     f"names (without '{cfg.prefixes[full[0]]}.'), as DiffSynth's validate_full scripts load them")
    elif prefix and cfg.output.lora_format == "diffusers" and cfg.stage != "data_process":
        heads = sorted({f"{p}." for p in cfg.prefixes.values()})
        if not any(h.startswith(prefix) or prefix.startswith(h) for h in heads):
            notes.append(f"note: --remove_prefix_in_ckpt {prefix}: no key starts with it in the diffusers layout (keys "
                         f"start with {', '.join(heads)}); --lora_format diffsynth writes DiffSynth's 'pipe.<model>.' keys")
    if cfg.stage == "data_process":
        defaults = {"num_epochs": 1, "dataset_repeat": 1, "learning_rate": 1e-4, "weight_decay": 0.01, "lora_rank": 32,
                    "lora_alpha": None, "lora_target_modules": None, "lora_checkpoint": None, "save_steps": None,
                    "gradient_accumulation_steps": 1, "batch_size": 1, "lora_format": "diffusers",
                    "remove_prefix_in_ckpt": None, "use_gradient_checkpointing": False, "find_unused_parameters": False}
        given = [f"--{name}" for name, default in defaults.items() if getattr(args, name) != default]
        if given:
            notes.append(f"note: {', '.join(given)} {'is' if len(given) == 1 else 'are'} for training; stage 1 computes "
                         "each entry once (they are kept in training_args.json for the record)")
    companions = {slot for slots in cfg.pipeline.companions.values() for slot in slots}
    if args.processor_path and "processor" not in companions:
        notes.append(f"note: --processor_path is not used: pipeline {cfg.pipeline.name} has no processor")
    if args.initialize_model_on_cpu:
        where = ("; under FSDP2 each process reads the trained models' weights straight into its shard"
                 if cfg.engine.kind == "fsdp2" else f"; under {cfg.engine.name} each process then keeps only its shard"
                 if cfg.engine.shards_frozen else "")
        notes.append("note: --initialize_model_on_cpu is how unitgraph always loads: weights are read into CPU memory "
                     "and placed after" + where)
    if os.environ.get("MASTER_ADDR") and not os.environ.get("WORLD_SIZE") and accelerator.num_processes == 1:
        notes.append("warning: accelerate launch asked for several processes but started one; on a CPU add --multi_gpu "
                     "and set ACCELERATE_USE_CPU=true (docs/user-guide.md, 'Several processes')")
    return notes


def run(args: TrainArgs, echo: Optional[Callable[[str], None]] = None, accelerator: Any = None) -> RunResult:
    """Execute `args.task`. Bad input raises BackendError (one line) before anything is written."""
    cfg = RunConfig.from_args(args)
    plan = plan_for(cfg)
    check_supported(cfg)
    if args.dry_run:  # the memory plan from config files alone: nothing is loaded or written
        from .memory_plan import memory_plan

        return RunResult(task=args.task, output_path=location(cfg.output.path), plan=plan,
                         memory_plan=memory_plan(cfg, plan))
    accelerator = accelerator or make_accelerator(cfg)
    report = Reporter(accelerator, echo)
    engine_line = [cfg.engine.line(cfg.stage)] if cfg.engine.kind != "ddp" or accelerator.num_processes > 1 else []
    for note in [*cfg.notes[:1], *engine_line, *cfg.notes[1:], *flag_notes(cfg, plan, accelerator)]:
        report.note(note)
    if cfg.stage != "data_process" and is_url(cfg.output.path):
        raise BackendError("--output_path of a training run is a local folder (the cache may be on an object store: "
                           "--cache_path s3://... or --dataset_base_path s3://... for :train)",
                           source=masked_url(cfg.output.path))
    output = location(cfg.output.path)
    result = RunResult(task=args.task, output_path=output, plan=plan)
    if cfg.stage != "data_process" and accelerator.is_main_process:
        resume = None if cfg.output.resume is None else {"task": args.task, "pipeline": plan.pipeline,
                                                         "plan_fingerprint": plan.fingerprint}
        RunFolder(output).check(cfg.output.overwrite, resume)  # refused before stage 1 spends any time

    def stage1(cache_dir: "str | Path", before_compute: Optional[Callable[[], None]] = None) -> None:
        s1 = run_data_process(cfg, plan, accelerator, cache_dir, report, before_compute)
        result.cache_path, result.cache_reused = cache_dir, s1.reused_all
        result.entries_computed, result.entries_reused = len(s1.computed), s1.reused
        result.computed_indices, result.skipped, result.stage1_reason = s1.computed, s1.skipped, s1.reason
        result.stage_times["data_process"] = s1.seconds
        result.samples = s1.samples

    if cfg.stage == "data_process":
        cache_dir = location(cfg.cache_path) if cfg.cache_path else output
        stage1(cache_dir, lambda: setattr(result, "plan_path", write_cache_run_files(cfg, plan, cache_dir, accelerator)))
        return result

    if cfg.stage == "train":
        if not cfg.data.base_path:
            raise BackendError("--dataset_base_path must be the cache folder written by the data_process stage")
        cache_dir = location(cfg.data.base_path)
    elif cfg.stage == "split":
        cache_dir = location(cfg.cache_path) if cfg.cache_path else output / "cache"
        stage1(cache_dir)
    if cfg.stage in ("train", "split"):
        provider: Any = CacheProvider(cfg.pipeline, plan, cache_dir, cfg=cfg, report=report, main=accelerator.is_main_process)
        result.cache_path = cache_dir
        if cfg.stage == "train":
            result.skipped = provider.skipped
        data: Any = stage2_data(cfg, provider)
        provider.held_out_data = held_out_data(cfg, provider)
        name = "stage 2 (train)"
    else:
        provider = LiveProvider(cfg, plan, report)
        result.skipped = provider.skipped
        data = LiveData(provider.items, provider.sink_inputs, cfg.seed, cfg.data.repeat, provider.shares)
        name = "train"
    result.samples = len(provider.items)
    start = time.perf_counter()
    run_training(cfg, plan, provider, data, accelerator, output, result, name, report)
    result.stage_times["train"] = time.perf_counter() - start
    return result

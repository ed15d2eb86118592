"""Stage 1 (`:data_process`): fill the cache, each missing or damaged entry exactly once.

Stage 1 follows `unitgraph.runtime.stage1_schedule(plan)`: it runs the plan's data_process units
under no_grad and stores each sample's cache entry under a key derived from exactly what the entry
depends on (`key_inputs`: the units, the settings they declare, the weights of their models, and
the sample's dataset values they read; see cache/keys.py and docs/cache.md). A re-run computes only the
entries whose key is new or whose file fails its checksum. The main process decides the work under
the cache lock and writes it into the manifest; every process takes its share of the pending
entries (no padding: exactly once), journals each, and the main process merges the journals.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from unitgraph.plan import Plan
from unitgraph.runtime import stage1_schedule

from .cache.cache import ENTRIES, LOCK, SHARDS, Cache, entry_record, sample_label
from .cache.keys import HashMemo, canonical_hash, entry_key, settings_hash
from .cache.manifest import Manifest, describe_plan_change
from .config import RunConfig
from .data.batching import cast_floating
from .data.dataset import DiffusionDataset, SampleError
from .errors import BackendError
from .models.stage import load_models, make_context
from .report import Reporter, count, progress
from .data.mixture import DatasetMixture
from .session import dataset_config, make_dataset, own_shaping
from .stage1_key import describe_key_change, key_inputs, made_with, recorded_settings


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


def _skip(skipped: list[dict[str, Any]], index: int, exc: BackendError) -> None:
    skipped.append({"index": index, "reason": exc.one_line()})


@dataclass
class Stage1Work:
    """What stage 1 is about to do, decided before anything is written."""

    manifest: Manifest  # status `filling` with a `pending` list, or `complete`
    reason: str  # one line saying why entries are (re)computed
    memo: HashMemo
    changed: bool  # the manifest differs from the one on disk


def prepare_stage1(cfg: RunConfig, plan: Plan, dataset: DiffusionDataset, cache: Cache, report: Reporter) -> Stage1Work:
    """Main process, under the cache lock: work out every sample's key and which entries are valid. Writes nothing.

    Raises BackendError when the folder holds another plan's cache or the inputs are bad.
    """
    existing = cache.read_manifest()
    if existing is not None and existing.plan_fingerprint != plan.fingerprint:
        raise BackendError(f"holds the cache of another plan ({describe_plan_change(existing, plan)}); choose another "
                           "cache folder (--cache_path or --output_path) or delete this one", source=cache.location)
    cache.warn_unsafe(report)
    memo = cache.memo()
    inputs = key_inputs(cfg, plan, memo)
    static = canonical_hash(inputs)
    statics = dataset_statics(cfg, plan, memo, static)
    params = inputs["dataset_params"]
    samples: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    digest = functools.lru_cache(maxsize=None)(memo.digest)  # a file many rows name is looked at once per run
    held_out_from = getattr(dataset, "held_out_from", len(dataset))
    for i in range(len(dataset)):
        place = placement(dataset, i)
        try:
            sid = dataset.sample_id(i, digest)
            key = entry_key(statics.get(place.get("dataset"), static), dataset.key_inputs(i, params, digest))
        except SampleError as exc:
            _skip(skipped, i, exc)
            continue
        samples.append({"index": i, "sample_id": sid, "key": key, **place})

    # what is already there: the manifest's records and those of an interrupted run's journals
    records: dict[str, dict[str, Any]] = dict(existing.entries if existing is not None else {})
    for record in map(entry_record, cache.read_journals()):
        if record is not None:
            records[record["key"]] = record
    first: dict[str, dict[str, Any]] = {}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        first.setdefault(s["key"], s)
        by_key.setdefault(s["key"], []).append(s)
    valid: dict[str, dict[str, Any]] = {}
    damaged = 0
    known = [key for key in first if key in records]
    for key, problem in zip(known, cache.check_entries([records[key] for key in known])):  # every entry verified
        record = records[key]
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
                _skip(skipped, other["index"], exc)
    samples = [s for s in samples if s["key"] not in bad_keys]
    held_out = [s for s in samples if s["index"] >= held_out_from]  # --validation_dataset: cached, never trained
    samples = [s for s in samples if s["index"] < held_out_from]
    skipped.sort(key=lambda s: s["index"])
    if not samples:
        first_reason = skipped[0]["reason"] if skipped else "the metadata has no rows"
        raise BackendError(f"no usable samples: all {len(dataset)} were skipped (first: {first_reason})",
                           source=str(dataset.metadata_path))
    for item in skipped:  # warned only now: when nothing is usable, the error above is the one line
        report(f"warning: skipping sample {item['index']}: {item['reason']}")
    pending = [{"key": key, "index": s["index"], "sample_id": s["sample_id"]}
               for key, s in first.items() if key not in valid and key not in bad_keys]
    reason = _work_reason(existing, inputs, pending, valid, len(first) - len(bad_keys), damaged)
    settings = recorded_settings(cfg, plan)
    on_store = present(cache) if pending and len(records) > len(valid) else set()  # one listing, only if needed
    manifest = Manifest(
        status="filling" if pending else "complete", pipeline=plan.pipeline, plan_fingerprint=plan.fingerprint,
        cache_mode=plan.cache_mode, keys=inputs["entries"], plan=plan.to_dict(), key_inputs=inputs,
        key_inputs_hash="sha256:" + static, settings=settings, settings_hash=settings_hash(settings),
        made_with=made_with(cfg), num_samples=len(samples), samples=samples,
        # while filling, records of other entries still on disk are kept (a changed setting may be reverted)
        entries={**{k: r for k, r in records.items() if k not in first and r["file"] in on_store},
                 **valid} if pending else valid,
        skipped=skipped, pending=pending or None, layout=cfg.args.cache_layout,
        datasets=[spec.record() for spec in cfg.data.datasets] or None, held_out=held_out or None)
    return Stage1Work(manifest, reason, memo, existing is None or manifest.to_dict() != existing.to_dict())


def dataset_statics(cfg: RunConfig, plan: Plan, memo: HashMemo, static: str) -> dict[str, str]:
    """{dataset: the shared part of its entries' keys} of a --dataset_config run: the run's own (`static`) for a
    dataset that gives no setting of its own, so adding a dataset, or one of the run's flags' values, keeps the
    entries the others have; else the hash of the key inputs under its settings."""
    out = {}
    for spec in cfg.data.datasets:
        own = dataset_config(cfg, spec)
        out[spec.name] = canonical_hash(key_inputs(own, plan, memo)) if own_shaping(cfg, own) else static
    return out


def placement(dataset: Any, index: int) -> dict[str, Any]:
    """What a manifest's sample record says of its dataset ({} for the run's one dataset): its name and row."""
    if not isinstance(dataset, DatasetMixture):
        return {}
    k, row = dataset.locate(index)
    return {"dataset": dataset.names[k], "row": row + 1} if dataset.names[k] is not None else {}


def check_read_only(cache: Cache, work: Stage1Work) -> None:
    """A cache stage 1 cannot write into (a read-only folder) serves when it is complete and current: then nothing is
    written, not even its lock; otherwise one line says what would have to be computed."""
    pending = len(work.manifest.pending or [])
    if pending or work.changed:
        what = f"{count(pending, 'entry', 'entries')} to compute" if pending else "its manifest to update"
        raise BackendError(f"the cache folder is read-only and needs {what} ({work.reason}); make it writable or "
                           "build the cache elsewhere", source=cache.location)


def commit_stage1(cache: Cache, work: Stage1Work) -> None:
    """Main process, under the lock, once every whole-run check passed: the manifest and the folder's hygiene."""
    if cache.local:
        (cache.folder / ENTRIES).mkdir(parents=True, exist_ok=True)
    cache.clean_temp_files()
    if work.manifest.pending is None:
        cache.prune(set(work.manifest.entries), work.manifest.entries)
    if work.changed:
        cache.write_manifest(work.manifest)
    cache.clear_journals()
    work.memo.save(prune=True)  # this run asked about every file the cache depends on


def _work_reason(existing: Optional[Manifest], inputs: dict[str, Any], pending: list, valid: dict, usable: int,
                 damaged: int) -> str:
    """Why there is work, in one line."""
    if existing is None:
        return f"new cache: computing {count(len(pending), 'entry', 'entries')}"
    changes = describe_key_change(existing.key_inputs, inputs)
    if changes and pending:
        return f"{'; '.join(changes)}: recomputing {len(pending)} of {count(usable, 'entry', 'entries')}"
    if pending:
        parts = [count(len(pending) - damaged, "new or changed sample", "new or changed samples")] if len(pending) > damaged else []
        parts += [f"{damaged} damaged"] if damaged else []
        return f"computing {count(len(pending), 'entry', 'entries')} ({', '.join(parts)})"
    return f"all {count(len(valid), 'entry', 'entries')} valid: nothing to compute"


def present(cache: Cache) -> set[str]:
    """The entry files and shards the cache holds (one listing)."""
    return set(cache.store.list(ENTRIES)) | set(cache.store.list(SHARDS))


def finish_stage1(cache: Cache, manifest: Manifest) -> tuple[list[int], dict[int, int]]:
    """Main process, after every process finished: merge the journals; the manifest says `complete`.

    Returns the indices of the samples whose entries this run computed, and how many each process computed.
    """
    entries = dict(manifest.entries)
    computed = []
    per_process: dict[int, int] = {}
    for raw in cache.read_journals():
        record = entry_record(raw)
        if record is not None:
            entries[record["key"]] = record
            if raw.get("index") is not None:
                computed.append(int(raw["index"]))
            rank = int(raw.get("rank", 0))
            per_process[rank] = per_process.get(rank, 0) + 1
    every = manifest.samples + (manifest.held_out or [])
    needed = {s["key"] for s in every}
    files = present(cache)
    missing = [s for s in every if s["key"] not in entries or entries[s["key"]]["file"] not in files]
    if missing:  # pragma: no cover - every process computes its share or stops with an error
        raise RuntimeError(f"stage 1 left {len(missing)} samples without a cache entry (e.g. index {missing[0]['index']})")
    manifest.status, manifest.pending = "complete", None
    manifest.entries = {k: entries[k] for k in sorted(needed)}
    cache.prune(needed, manifest.entries)
    cache.write_manifest(manifest)
    cache.clear_journals()
    return sorted(set(computed)), dict(sorted(per_process.items()))


def compute_entries(cfg: RunConfig, plan: Plan, dataset: DiffusionDataset, cache: Cache, work: list[dict[str, Any]],
                    accelerator: Any, models: Optional[dict[str, Any]] = None) -> None:
    """Compute and store the given entries, recording each in this process's journal once it is in place.

    Samples go through the units `batch_size` at a time (--data_process_batch_size): a unit with a batch form
    (family.UnitCode.batch) computes the samples of equal shapes in one model call, every other unit one
    sample at a time. Entries stay one per sample, written (and journaled) as each batch finishes.
    """
    if models is None:
        models = load_models(cfg, plan.data_process_models, training=False, device=accelerator.device)
    contexts = dataset_contexts(cfg, dataset, models, accelerator.device)
    schedule = stage1_schedule(plan)
    code = cfg.pipeline.unit_code()
    store_dtype = None if cfg.units.cache_dtype == cfg.units.dtype else getattr(torch, cfg.units.cache_dtype)
    size = data_process_batch_size(cfg)
    done = 0
    bar = progress(None, len(work), "stage 1 (data_process)", cfg.output.progress and accelerator.is_local_main_process)
    with torch.no_grad(), cache.writer(accelerator.process_index, cfg.args.cache_layout) as writer, \
            decoded_ahead(dataset, [int(item["index"]) for item in work], cfg.data.num_workers) as samples:
        for chunk in dataset_chunks(work, size, dataset):
            indices = [int(item["index"]) for item in chunk]
            ctx = contexts(indices[0])  # a chunk lies in one dataset: one size, one context
            states = []
            for index in indices:
                with _naming(index, done, dataset.where):
                    states.append(samples(index))
            values = [{key: state.get(param) for param, key in schedule.snapshots_after.get(None, [])} for state in states]
            for name in schedule.units:
                for state, out in zip(states, run_unit(code[name], ctx, states, indices, done, dataset.where)):
                    state.update(out)
                for param, key in schedule.snapshots_after.get(name, []):
                    for state, kept in zip(states, values):
                        kept[key] = state[param]
            for item, index, state, kept in zip(chunk, indices, states, values):
                for param, key in schedule.final:
                    kept[key] = state.get(param)
                if store_dtype is not None:  # --cache_dtype: floating tensors stored in another dtype
                    kept = {key: cast_floating(value, store_dtype) for key, value in kept.items()}
                writer.add(item["key"], kept, {"key": item["key"], "index": index, "sample_id": item["sample_id"]})
                done += 1
            bar.update(len(chunk))
    bar.close()


def dataset_contexts(cfg: RunConfig, dataset: Any, models: dict[str, Any], device: Any) -> Callable[[int], Any]:
    """index -> the unit context its sample runs in: the run's, or under --dataset_config its dataset's (its own
    size), each made once."""
    ctx = make_context(cfg, models, device)
    if not isinstance(dataset, DatasetMixture):
        return lambda index: ctx
    own = [make_context(dataset_config(cfg, spec), models, device) for spec in cfg.data.datasets] or [ctx]
    if len(own) < len(dataset.parts):  # --validation_dataset's samples: the run's settings
        own.append(ctx)
    return lambda index: own[dataset.locate(index)[0]]


def dataset_chunks(work: list[dict[str, Any]], size: int, dataset: Any) -> list[list[dict[str, Any]]]:
    """The work in runs of at most `size` entries, a run never crossing from one dataset to the next (whose units
    may read another size)."""
    part = (lambda item: dataset.locate(int(item["index"]))[0]) if isinstance(dataset, DatasetMixture) else (lambda item: 0)
    chunks: list[list[dict[str, Any]]] = []
    for item in work:
        if chunks and len(chunks[-1]) < size and part(chunks[-1][-1]) == part(item):
            chunks[-1].append(item)
        else:
            chunks.append([item])
    return chunks


def data_process_batch_size(cfg: RunConfig) -> int:
    """--data_process_batch_size, else the family's default."""
    return int(cfg.args.data_process_batch_size or cfg.family.data_process_batch_size)


@contextlib.contextmanager
def _naming(index: int, done: int, where: Optional[Callable[[int], str]] = None):
    """A BackendError about one sample becomes stage 1's one line naming it (`where`: its place in words) and what
    is kept."""
    try:
        yield
    except BackendError as exc:
        place = where(index) if where is not None else f"metadata row {index + 1}"
        raise BackendError(f"stage 1 stopped at sample {index} ({place}): {exc.one_line()}; "
                           f"the entries finished so far ({done} in this process) are kept: fix the input "
                           "and run the same command again") from None


def run_unit(unit: Any, ctx: Any, states: list[dict[str, Any]], indices: list[int], done: int,
             where: Optional[Callable[[int], str]] = None) -> list[dict[str, Any]]:
    """One unit over a batch of samples: batched where the unit can (a bad sample then runs alone, so the error
    names it), else sample by sample."""
    if len(states) > 1 and unit.batch is not None:
        try:
            outs = unit.run_batch(ctx, states)
            for out in outs:
                check_finite(unit, out)
            return outs
        except BackendError:
            pass  # one of them is bad: run one by one below, which names it
    outs = []
    for state, index in zip(states, indices):
        with _naming(index, done, where):
            outs.append(unit(ctx, state))
            check_finite(unit, outs[-1], state)
    return outs


INPUT_MAGNITUDE = 1e4  # a floating input beyond this (sound is within 1, latents within tens) overflows what it feeds


def check_finite(unit: Any, out: dict[str, Any], state: Optional[dict[str, Any]] = None) -> None:
    """Stage 1 stores no NaN or infinity: a model that gives one (a VAE overflowing in fp16, say) is named here,
    not blamed on a sample's loss in stage 2. When one of the unit's inputs (`state`) already holds non-finite or huge
    values (a sound track of NaN or of 1e30), the sample's input is named instead of the model."""
    import torch

    for name, value in out.items():
        for tensor in _arrays(value):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and \
                    not bool(torch.isfinite(tensor).all()):
                models = f" (model: {', '.join(unit.models)})" if unit.models else ""
                suspect = _suspect_input(unit, state)
                if suspect is not None:
                    raise BackendError(f"unit {unit.name}{models} gave non-finite values in {name!r} from this "
                                       f"sample's {suspect}: nothing of this sample is cached; check that file")
                raise BackendError(f"unit {unit.name}{models} gave non-finite values in {name!r}: nothing of this "
                                   "sample is cached (a model's weights, or the precision: try --mixed_precision "
                                   "no or another --cache_dtype)")


def _arrays(value: Any) -> Any:
    """The tensors and numpy arrays in a value (nested in lists and tuples: a sound track is (samples, rate))."""
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _arrays(item)


def _suspect_input(unit: Any, state: Optional[dict[str, Any]]) -> Optional[str]:
    """The first of the unit's inputs holding non-finite or huge floating values, in words; None when none does."""
    import numpy as np

    declared = getattr(getattr(unit, "declaration", None), "inputs", None) or list(state or {})
    for name in declared:
        for array in _arrays((state or {}).get(name)):
            try:
                values = np.asarray(array.detach().float().cpu() if hasattr(array, "detach") else array)
            except (TypeError, ValueError, RuntimeError):
                continue
            if values.dtype.kind != "f" or values.size == 0:
                continue
            if not np.isfinite(values).all():
                return f"{name!r} (it holds NaN or infinity)"
            peak = float(np.abs(values).max())
            if peak > INPUT_MAGNITUDE:
                return f"{name!r} (values up to {peak:.3g})"
    return None


@contextlib.contextmanager
def decoded_ahead(dataset: DiffusionDataset, indices: list[int], workers: int):
    """`sample(index)` for `indices` in order; with `workers` > 0 the samples' files are read and decoded that
    many threads ahead (--dataset_num_workers: PIL decodes outside the GIL), at most 2 x workers in memory."""
    if workers <= 0:
        yield dataset.sample
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="unitgraph-decode")
    ahead: deque = deque()
    upcoming = iter(indices)

    def refill() -> None:
        while len(ahead) < 2 * workers:
            index = next(upcoming, None)
            if index is None:
                return
            ahead.append((index, pool.submit(dataset.sample, index)))

    def sample(index: int) -> dict[str, Any]:
        refill()
        expected, future = ahead.popleft()
        if expected != index:  # pragma: no cover - compute_entries asks in the order it gave
            raise RuntimeError(f"decoded sample {expected} where {index} was asked for")
        return future.result()

    try:
        yield sample
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_data_process(cfg: RunConfig, plan: Plan, accelerator: Any, cache_dir: "str | Path", report: Reporter,
                     before_compute: Optional[Callable[[], None]] = None) -> Stage1Result:
    """Fill `cache_dir` for `plan`: each missing or damaged entry once, sharded over processes.

    The main process decides the work under the cache lock and writes it into the manifest; every
    process takes its share of the pending entries (exactly once: no padding), journals them, and
    the main process merges the journals at the end. Bad input stops before anything is written; a
    stop while computing keeps every finished entry.
    """
    start = time.perf_counter()
    cache = Cache(cache_dir)
    main = accelerator.is_main_process
    dataset = make_dataset(cfg, held_out=True)
    manifest: Optional[Manifest] = None
    reason = ""
    computed: list[int] = []
    models = None
    with contextlib.ExitStack() as stack:
        if main:
            cache.check_owned()
            created = not cache.store.exists()
            had_lock = cache.local and (cache.folder / LOCK).exists()
            read_only = False
            try:
                stack.enter_context(cache.locked())
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or created:
                    raise BackendError(f"cannot take the cache's lock ({exc.strerror or exc})",
                                       source=cache.location) from None
                read_only = True  # a complete cache is still usable: checked below, nothing written
            try:
                work = prepare_stage1(cfg, plan, dataset, cache, report)
                if read_only:
                    check_read_only(cache, work)
                if work.manifest.pending:  # a model that cannot load stops here, before anything is written
                    models = load_models(cfg, plan.data_process_models, training=False, device=accelerator.device)
            except BaseException:
                if created and cache.local:  # nothing of value was written: leave no trace
                    shutil.rmtree(cache.folder, ignore_errors=True)
                elif not had_lock and cache.local:
                    (cache.folder / LOCK).unlink(missing_ok=True)
                raise
            if not read_only:
                commit_stage1(cache, work)
            manifest, reason = work.manifest, work.reason
            report(f"stage 1: {manifest.num_samples} samples; {reason}")
            if before_compute is not None:
                before_compute()
        accelerator.wait_for_everyone()
        if not main:
            manifest = cache.read_manifest()
        if manifest is None:  # pragma: no cover - the main process wrote it before the barrier
            raise BackendError("stage 1: the cache manifest vanished while starting", source=cache.location)
        pending = manifest.pending or []
        mine = pending[accelerator.process_index::accelerator.num_processes]
        if mine:
            compute_entries(cfg, plan, dataset, cache, mine, accelerator, models)
        models = None
        gc.collect()  # the encoders' memory back (cycles too) before what follows: validation, sft's stage 2
        accelerator.wait_for_everyone()
        if main and pending:
            computed, per_process = finish_stage1(cache, manifest)
            shares = ", ".join(str(per_process.get(r, 0)) for r in range(accelerator.num_processes))
            report(f"stage 1: computed {count(sum(per_process.values()), 'entry', 'entries')} over {accelerator.num_processes} "
                   f"process{'es' if accelerator.num_processes > 1 else ''} ({shares})")
    accelerator.wait_for_everyone()
    stage1_validation(cfg, plan, cache, manifest.key_inputs_hash, accelerator, report)
    accelerator.wait_for_everyone()  # every process reads the encoded prompts the main process stored
    skipped = list(manifest.skipped)
    if main and skipped:
        report(f"stage 1: skipped {len(skipped)} of {len(skipped) + manifest.num_samples} samples (warnings above); "
               "they are left out of the cache")
    unique = len({s["key"] for s in manifest.samples + (manifest.held_out or [])})
    return Stage1Result(seconds=time.perf_counter() - start, samples=manifest.num_samples,
                        computed=computed, reused=unique - len(pending), skipped=skipped, reason=reason)


def stage1_validation(cfg: RunConfig, plan: Plan, cache: Cache, key_hash: str, accelerator: Any,
                      report: Reporter) -> None:
    """The prompts stage 2 needs encoded without a text encoder, stored beside the cache by the prompt units run
    here: the --validation_prompt values and the negative prompts their guidance reads (train/validation.py) and,
    with --caption_dropout, the empty prompt (caption_dropout.py). The models are loaded once for all, and only when
    a file is missing or stale."""
    from .cache.encoded_prompts import EMPTY_PROMPT, VALIDATION
    from .caption_dropout import CAPTION_DROPOUT, EMPTY
    from .train.validation import (encode_prompts, encode_validation, load_encoded, prompt_units,
                                   sample_prompt_units, store_encoded, validation_texts)

    units = list(dict.fromkeys([*sample_prompt_units(cfg), *prompt_units(cfg.pipeline)]))
    if not accelerator.is_main_process or not units or not all(u.name in plan.data_process_units for u in units):
        return  # nothing to encode, or the prompt units train (they run in stage 2)
    texts = validation_texts(cfg)
    wanted = [(kind, prompts) for kind, prompts in ((VALIDATION, texts.keyed),
                                                    (EMPTY_PROMPT, [EMPTY] if CAPTION_DROPOUT in plan.train_units else []))
              if prompts]
    missing = []
    for kind, prompts in wanted:
        try:
            load_encoded(cache, prompts, key_hash, kind=kind)  # already there for these prompts and this cache
        except BackendError:
            missing.append((kind, prompts))
    if not missing:
        return
    needed = sorted({m for u in units for m in u.models})
    models = load_models(cfg, needed, training=False, device=accelerator.device)
    ctx = make_context(cfg, models, accelerator.device)
    for kind, prompts in missing:
        encoded = encode_validation(ctx, cfg, texts) if kind is VALIDATION else encode_prompts(ctx, cfg.pipeline, prompts)
        store_encoded(cache, prompts, key_hash, encoded, kind=kind)
        negatives = len(prompts) - len(cfg.validation.prompts)
        what = (count(len(cfg.validation.prompts), "validation prompt", "validation prompts")
                + (f" and {count(negatives, 'negative prompt', 'negative prompts')}" if negatives > 0 else "")
                + " for stage 2, which renders samples" if kind is VALIDATION
                else "the empty prompt for caption dropout: stage 2 trains")
        report(f"stage 1: encoded {what} without loading {', '.join(needed)} ({kind.name})")


def repair_cache(cache_dir: str | Path, overrides: Optional[dict[str, Any]] = None,
                 echo: Optional[Callable[[str], None]] = None, progress: bool = False) -> Stage1Result:
    """Re-run stage 1 for an existing cache with the arguments recorded in it (`overrides` may relocate
    the dataset or the models): recomputes exactly the entries that are missing, damaged or out of date."""
    from .args import make_args
    from .session import make_accelerator, plan_for

    cache = Cache(cache_dir)
    manifest = cache.read_manifest()
    if manifest is None:
        raise BackendError("no manifest.json: not a cache folder", source=cache.location)
    recorded = dict(manifest.made_with)
    if not recorded.get("task"):
        raise BackendError("the manifest does not record how stage 1 ran (made_with); re-run the data_process stage",
                           source=cache.manifest_path)
    task = recorded.pop("task")
    recorded.setdefault("pipeline", manifest.pipeline)
    recorded.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        args = make_args(task=f"{task}:data_process", output_path=cache.location, cache_path=cache.location,
                         progress=progress, plot=False, **recorded)
    except TypeError as exc:  # a hand-edited made_with of the wrong shape
        raise BackendError(f"damaged cache manifest: made_with does not hold training arguments ({exc})",
                           source=cache.manifest_path) from None
    cfg = RunConfig.from_args(args)
    plan = plan_for(cfg)
    if plan.fingerprint != manifest.plan_fingerprint:
        raise BackendError(f"the recorded arguments give another plan ({describe_plan_change(manifest, plan)})",
                           source=cache.location)
    accelerator = make_accelerator(cfg)
    return run_data_process(cfg, plan, accelerator, cache.location, Reporter(accelerator, echo))

"""Stage 2's executor: cache entries -> batches of sink inputs, following the plan's bindings.

This is the one place that runs a plan's train units. For every input of a train unit and of the
sink, `unitgraph.runtime.stage2_bindings` says whether it comes from a live train output or from a
cache entry (and which one); the verifier simulates exactly those bindings, so what runs here is
what was proved equal to the unsplit run.

* **Per-sample randomness.** The train units run per sample, each under its own sample key, and
  only the sink runs on the collated batch (see data/batching.py).
* **Prefetch.** Train units that call no model (noise, latent sampling, packing, timesteps) and
  whose inputs come only from the cache are "early": they run with the entry read and the
  collation, before the step, on the CPU, and can run ahead of it: in a background thread
  (`prefetch=k`) or in DataLoader worker processes (`workers>0`, pinned memory with CUDA). On a
  GPU that hides them behind the step. On a CPU-only machine a thread cannot hide them even behind
  backward on a spare core: torch's CPU backward needs the GIL again between its kernels, so a
  thread's Python work delays it by as much as it does (benchmarks/thread_overlap.py), and the
  default there is to prepare batches in the caller when they are asked for, SYNC_RUN at a time
  (`_in_runs`): right after a step the data path runs from cold CPU caches, and the batches after
  the first of a run find them warm (measured in docs/benchmarks.md). Units that call a model (a
  trainable text encoder, say) run in the training process, per sample, at step time.
* **Reading entries.** An entry is read whole (its checksum covers every byte) and parsed from
  memory (`cache.read_entry`); a small cache may be kept in memory after its first read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Optional, Sequence

from unitgraph.runtime import SINK, stage2_bindings

from ..data.batching import (
    CachedItem,
    Element,
    Share,
    cast_floating,
    is_tensor,
    pin_tensors,
    bucket_batches,
    collate,
    entry_signature,
    expand,
    mixed_elements,
    shard_batches,
    to_device,
    value_signature,
    varies_by_epoch,
)

SYNC_RUN = 4  # batches prepared together in the caller (prefetch=0): an A/B at test size, 1.06x the limit -> ~1.04x


# ------------------------------------------------------------------------------------------------
# the stage-2 data source


@dataclass
class Batch:
    """The elements of one micro-batch and, once ready, their (collated) sink inputs."""

    epoch: int
    elements: list[Element]
    inputs: Optional[dict[str, Any]] = None
    prepared: Optional[list[Any]] = None  # per-sample states while units that call models remain to run

    def __len__(self) -> int:
        return len(self.elements)

    @property
    def sample_keys(self) -> list[str]:
        return [e.sample_key for e in self.elements]

    def pin_memory(self) -> "Batch":
        """Called by a DataLoader with pin_memory=True (in the training process)."""
        if self.inputs is not None:
            self.inputs = pin_tensors(self.inputs)
        return self


@dataclass
class _State:
    cached: dict[str, Any]
    live: dict[tuple[str, str], Any] = field(default_factory=dict)


class Stage2Data:
    """Cache entries -> batches of sink inputs, following the plan's `stage2_bindings`.

    pipeline: the family's `PipelineDef` (its units' code); pad: the family's padded params.
    items: the cache's samples (objects with .index and .sample_id, e.g. `stages.CacheSource.items`).
    read(item) -> the entry's values by entry key (e.g. `stages.CacheSource.entry(item.sample_id)`).
    entry_path(item) -> the entry's safetensors file (or its parsed header), when there is one: bucket
    keys then come from its header alone; without it they come from the loaded values.
    ahead(items): told each epoch's reading order before it starts (a read-ahead of entries).
    dtype: when given, floating cached tensors are cast to it as they are read (a cache stored in
    bf16/fp16 by `--cache_dtype`, trained in the model's dtype).
    shares: with several datasets (--dataset_config), each one's part of an epoch (`batching.Share`; the items
    carry `.dataset`), in place of `dataset_repeat`; settings: {dataset: its unit settings} for the datasets that
    have their own (a size), which their samples' train units then read.
    """

    def __init__(self, pipeline: Any, plan: Any, items: Sequence[Any], read: Callable[[Any], dict[str, Any]], *,
                 seed: int, entry_path: Optional[Callable[[Any], Path]] = None, batch_size: int = 1,
                 dataset_repeat: int = 1, drop_last: bool = False, pad: Mapping[str, str] = {},
                 keep_in_memory: bool = False, backward: Optional[Iterable[str]] = None, dtype: Any = None,
                 ahead: Optional[Callable[[list[Any]], None]] = None, shares: Sequence[Share] = (),
                 settings: Mapping[str, Any] = {}):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.pipeline = pipeline
        spec = pipeline.spec_pipeline
        self.plan = plan
        self.items = list(items)
        self.reader = read
        self.entry_path = entry_path
        self.ahead = ahead
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.pad = dict(pad)
        self.keep_in_memory = keep_in_memory
        self.dtype = dtype
        self.backward = set(plan.models_require_backward if backward is None else backward)
        self.epochs = EpochElements(self.items, self.seed, dataset_repeat, shares)
        self.elements = self.epochs(0)
        self.settings = dict(settings)
        self.bindings = stage2_bindings(spec, plan)
        code = pipeline.unit_code()
        self.units = [code[name] for name in plan.train_units]
        self.sink_params = list(spec.sink.inputs)
        self.sink_keys = sorted({b.key for (reader_, _), b in self.bindings.items() if reader_ == SINK and b.source == "cache"})
        # Units that can run ahead of the step: no model, inputs from the cache or from such units.
        early: set[str] = set()
        for unit in self.units:
            sources = [self.bindings[(unit.name, p)] for p in unit.inputs]
            if not unit.models and all(b.source == "cache" or b.writer in early for b in sources):
                early.add(unit.name)
        self.early_units = [u for u in self.units if u.name in early]
        self.step_units = [u for u in self.units if u.name not in early]
        # Each reader's inputs as (param, live key or None, cache key): the bindings looked up once, not per
        # sample and param (at test size a step is a few milliseconds, and this runs for every input of every unit)
        self._sources = {reader: [self._source(reader, p) for p in params]
                         for reader, params in [(u.name, u.inputs) for u in self.units] + [(SINK, self.sink_params)]}
        self._entries: dict[str, dict[str, Any]] = {}
        self._keys: dict[str, Hashable] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_cache(cls, pipeline: Any, plan: Any, cache_dir: str | Path, **kwargs: Any) -> "Stage2Data":
        """A source over a complete cache folder made under `plan` (checked as stage 2 checks it).

        Written against the cache layout of `cache/cache.py` (manifest samples with index and sample_id,
        `Cache.entry_path`, `read_entry`); a stage that has its own provider passes items and read instead.
        """
        from ..cache.cache import Cache

        cache = Cache(cache_dir)
        manifest = cache.open_for_training(plan, pipeline.task)
        items = sorted((CachedItem(int(s["index"]), str(s["sample_id"])) for s in manifest.samples),
                       key=lambda it: it.index)
        kwargs.setdefault("entry_path", _EntryPath(cache_dir))
        return cls(pipeline, plan, items, _EntryReader(cache_dir), **kwargs)

    # -- the epoch's batches ---------------------------------------------------------------------

    def bucket_key(self, item: Any) -> Hashable:
        sample_id = item.sample_id
        if sample_id not in self._keys:
            key: Hashable = None
            if self.entry_path is not None:
                try:
                    key = entry_signature(self.entry_path(item), self.sink_keys, self.pad)
                except (OSError, ValueError, KeyError, TypeError):
                    key = None  # an unreadable header: reading the entry says what is wrong with it
            if key is None:
                key = value_signature(self.read(item), self.sink_keys, self.pad)
            self._keys[sample_id] = key
        return self._keys[sample_id]

    def buckets(self, epoch: int = 0) -> dict[Hashable, list[int]]:
        """Element positions (of `epoch`'s elements) by bucket key."""
        out: dict[Hashable, list[int]] = {}
        for j, element in enumerate(self.epochs(epoch)):
            out.setdefault(self.bucket_key(element.item), []).append(j)
        return out

    def batches(self, epoch: int, rank: int = 0, world: int = 1) -> list[list[Element]]:
        """This process's micro-batches of one epoch, in training order."""
        elements = self.epochs(epoch)
        if self.batch_size == 1:
            keys: list[Hashable] = [0] * len(elements)
        else:
            keys = [self.bucket_key(e.item) for e in elements]
        positions = bucket_batches(keys, self.batch_size, self.seed, epoch, self.drop_last)
        return shard_batches([[elements[j] for j in batch] for batch in positions], rank, world)

    # -- per-sample work -------------------------------------------------------------------------

    def read(self, item: Any) -> dict[str, Any]:
        sample_id = item.sample_id
        if sample_id in self._entries:
            return self._entries[sample_id]
        values = self.reader(item)
        if self.dtype is not None:
            values = {k: cast_floating(v, self.dtype) for k, v in values.items()}
        if self.keep_in_memory:
            with self._lock:
                self._entries[sample_id] = values
        return values

    def _source(self, reader: str, param: str) -> tuple[str, Optional[tuple[str, str]], Optional[str]]:
        """(param, the live key it is read from or None, its cache key): where `reader` takes `param` from, by
        the plan's binding (a live train output, or a cache entry)."""
        binding = self.bindings[(reader, param)]
        if binding.source == "live":
            return param, (binding.writer, param), None
        return param, None, binding.key

    def _inputs(self, state: _State, reader: str) -> dict[str, Any]:
        """{param: value} for every input of `reader`, each from the live output or the cache entry `_source` names."""
        live, cached = state.live, state.cached
        return {p: live[lk] if lk is not None else cached[ck] for p, lk, ck in self._sources[reader]}

    def _run(self, units: Sequence[Any], state: _State, ctx: Any, grad: bool) -> None:
        import torch

        if not grad:  # one no_grad around all of them (the early units, per sample: every microsecond shows at test size)
            with torch.no_grad():
                for unit in units:
                    out = unit(ctx, self._inputs(state, unit.name))
                    for p in unit.outputs:
                        state.live[(unit.name, p)] = out[p]
            return
        for unit in units:
            inputs = self._inputs(state, unit.name)
            needs = bool(set(unit.models) & self.backward) or any(is_tensor(v) and v.requires_grad for v in inputs.values())
            with contextlib.nullcontext() if needs else torch.no_grad():
                out = unit(ctx, inputs)
            for p in unit.outputs:
                state.live[(unit.name, p)] = out[p]

    def early_context(self, ctx: Any, device: Any = "cpu") -> Any:
        """A copy of the training context for the early units: no model but configs (the scheduler), on `device`.

        Ahead of the step (a thread or a worker) they run on the CPU; in the caller they run on ctx.device,
        (the same numbers on a GPU too).
        """
        import torch

        models = {k: v for k, v in ctx.models.items() if not isinstance(v, torch.nn.Module)}
        return dataclasses.replace(ctx, models=models, device=device, epoch=None, sample_key=None, memo={})

    def prepare(self, element: Element, epoch: int, early_ctx: Any, cached: Optional[dict[str, Any]] = None) -> _State:
        """Read one element's entry (or take `cached`) and run its early units (under its own sample key)."""
        state = _State(cached=self.read(element.item) if cached is None else cached)
        if self.early_units:
            own = self.settings.get(getattr(element.item, "dataset", None))
            ctx = dataclasses.replace(early_ctx, epoch=epoch, sample_key=element.sample_key,
                                      **({"settings": own} if own is not None else {}))
            self._run(self.early_units, state, ctx, grad=False)
        return state

    def sink_inputs(self, state: _State) -> dict[str, Any]:
        return self._inputs(state, SINK)

    def produce(self, elements: list[Element], epoch: int, early_ctx: Any, pin: bool = False) -> Batch:
        """A batch with its early work done: collated inputs when no unit is left for the step."""
        states = [self.prepare(e, epoch, early_ctx) for e in elements]
        if self.step_units:
            return Batch(epoch, elements, prepared=states)
        inputs = collate([self.sink_inputs(s) for s in states], self.pad)
        return Batch(epoch, elements, inputs=pin_tensors(inputs) if pin else inputs)

    def finish(self, batch: Batch, ctx: Any) -> dict[str, Any]:
        """The batch's sink inputs: run the units that call models, per sample, then collate."""
        if batch.inputs is not None:
            return batch.inputs
        samples = []
        for element, state in zip(batch.elements, batch.prepared or []):
            ctx.epoch, ctx.sample_key = batch.epoch, element.sample_key
            with own_settings(ctx, self.settings.get(getattr(element.item, "dataset", None))):
                self._run(self.step_units, state, ctx, grad=True)
            samples.append(self.sink_inputs(state))
        batch.inputs, batch.prepared = collate(samples, self.pad), None
        return batch.inputs

    # -- the epoch as an iterator ----------------------------------------------------------------

    def iterate(self, epoch: int, ctx: Any, rank: int = 0, world: int = 1, prefetch: Optional[int] = None,
                workers: int = 0, batches: Optional[Sequence[list[Element]]] = None) -> Iterator[Batch]:
        """Ready batches of one epoch (inputs on ctx.device).

        prefetch=0 prepares batches in the caller when they are asked for, SYNC_RUN at a time (see the
        module docstring; an error is raised when its own batch is asked for); prefetch=k > 0 prepares up
        to k batches ahead in a background thread; workers > 0 uses a torch DataLoader with that many
        processes (and prefetch_factor k). The default (None) is a thread with k = 2 when training on
        CUDA, where the host CPU is otherwise idle, and 0 on the CPU, where preparing a batch competes
        with the training step for the same cores (see docs/benchmarks.md). `batches` replaces this
        rank's batches of the epoch (e.g. the rest of an epoch when resuming).
        """
        import torch

        batches = list(self.batches(epoch, rank, world) if batches is None else batches)
        if self.ahead is not None:
            self.ahead([e.item for b in batches for e in b])
        cuda = torch.cuda.is_available() and str(getattr(ctx, "device", "cpu")).startswith("cuda")
        if prefetch is None:
            prefetch = 2 if cuda else 0
        early_ctx = self.early_context(ctx, "cpu" if prefetch > 0 or workers > 0 else ctx.device)
        if workers > 0:
            source: Iterable[Batch] = _dataloader(self, batches, epoch, early_ctx, workers, max(1, prefetch), cuda)
        elif prefetch > 0:
            source = _Prefetched(((lambda b=b: self.produce(b, epoch, early_ctx, cuda)) for b in batches), prefetch)
        else:
            source = _in_runs(((lambda b=b: self.produce(b, epoch, early_ctx)) for b in batches), SYNC_RUN)
        try:
            for batch in source:
                inputs = self.finish(batch, ctx)
                batch.inputs = to_device(inputs, ctx.device, non_blocking=cuda)
                yield batch
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()


class EpochElements:
    """epoch -> its elements: the items `repeat` times each (--dataset_repeat), or with several datasets their
    shares (`batching.mixed_elements`); made once when they do not change from epoch to epoch."""

    def __init__(self, items: Sequence[Any], seed: int, repeat: int = 1, shares: Sequence[Share] = ()):
        self.items, self.seed, self.repeat, self.shares = list(items), int(seed), int(repeat), tuple(shares)
        self.fixed = not varies_by_epoch(self.shares)
        self._made: dict[int, list[Element]] = {}

    def __call__(self, epoch: int) -> list[Element]:
        key = 0 if self.fixed else epoch
        if key not in self._made:
            if not self.fixed:
                self._made.clear()  # one epoch's at a time
            self._made[key] = (mixed_elements(self.items, self.shares, self.seed, epoch) if self.shares
                               else expand(self.items, self.repeat))
        return self._made[key]


@contextlib.contextmanager
def own_settings(ctx: Any, settings: Any):
    """The unit context with a dataset's own settings while its sample's units run (none: as it is)."""
    if settings is None:
        yield
        return
    saved, ctx.settings = ctx.settings, settings
    try:
        yield
    finally:
        ctx.settings = saved


def _in_runs(jobs: Iterable[Callable[[], Any]], run: int) -> Iterator[Any]:
    """Each job's result in order, the jobs called `run` at a time when the first of a run is asked for.

    Nothing but the timing changes: the same calls in the same order, in the caller. A job's error is
    kept and raised when its own result would have been (the results before it are handed out first),
    and no job after it is called; so a stop happens at the batch it always happened at.
    """
    jobs = iter(jobs)
    while True:
        results: list[tuple[bool, Any]] = []
        for job in jobs:
            try:
                results.append((True, job()))
            except Exception as exc:  # raised at its turn, below
                results.append((False, exc))
                break
            if len(results) >= run:
                break
        if not results:
            return
        for ok, value in results:
            if not ok:
                raise value
            yield value


class _Prefetched:
    """Run jobs in one background thread, at most `depth` results ahead of the consumer."""

    _DONE = object()

    def __init__(self, jobs: Iterable[Callable[[], Any]], depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(iter(jobs),), name="unitgraph-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, jobs: Iterator[Callable[[], Any]]) -> None:
        try:
            for job in jobs:
                if self._stop.is_set() or not self._put(("ok", job())):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(("error", exc))
            return
        self._put(("done", self._DONE))

    def __iter__(self) -> Iterator[Any]:
        while True:
            kind, value = self._queue.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)


class _EntryPath:
    """item -> its entry file in a cache folder (picklable, for DataLoader workers)."""

    def __init__(self, cache_dir: str | Path):
        self.cache_dir = Path(cache_dir)
        self._cache: Any = None  # one Cache, its manifest read once (made in the process that reads)

    def __getstate__(self) -> dict[str, Any]:
        return {"cache_dir": self.cache_dir, "_cache": None}

    def __call__(self, item: Any) -> Path:
        if self._cache is None:
            from ..cache.cache import Cache

            self._cache = Cache(self.cache_dir)
        return self._cache.entry_path(item.sample_id)


class _EntryReader(_EntryPath):
    """item -> its entry's values (cache.read_entry: the file read whole, parsed from memory)."""

    def __call__(self, item: Any) -> dict[str, Any]:
        from ..cache.entries import read_entry

        values, _meta = read_entry(super().__call__(item))
        return values


class _BatchDataset:
    """Map-style dataset over one epoch's batches, for DataLoader workers."""

    def __init__(self, data: Stage2Data, batches: list[list[Element]], epoch: int, early_ctx: Any):
        self.data, self.batches, self.epoch, self.early_ctx = data, batches, epoch, early_ctx

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Batch:
        return self.data.produce(self.batches[i], self.epoch, self.early_ctx)


def _identity(value: Any) -> Any:
    return value


def _one_thread(_worker_id: int) -> None:
    import torch

    torch.set_num_threads(1)


def _dataloader(data: Stage2Data, batches: list[list[Element]], epoch: int, early_ctx: Any, workers: int,
                prefetch: int, pin: bool) -> Iterable[Batch]:
    import torch
    from torch.utils.data import DataLoader

    dataset = _BatchDataset(data, batches, epoch, early_ctx)
    # Its own generator: starting the workers then draws nothing from torch's global stream (the training
    # loop may have seeded that stream for dropout when it asks for the first batch).
    seeds = torch.Generator().manual_seed(data.seed)
    return DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers, prefetch_factor=prefetch,
                      collate_fn=_identity, pin_memory=pin, worker_init_fn=_one_thread, persistent_workers=False,
                      generator=seeds)


class LiveData:
    """The unsplit run's samples, one per micro-batch, with the interface of `Stage2Data`.

    Same elements, order and sharding as stage 2 at batch size 1. `sink_inputs(item, ctx)` runs every
    unit of the pipeline on the raw sample when its batch is asked for (inside the step's dropout
    stream, as the units of stage 2 that call models do).
    """

    batch_size = 1

    def __init__(self, items: Sequence[Any], sink_inputs: Callable[[Any, Any], dict[str, Any]], seed: int,
                 dataset_repeat: int = 1, shares: Sequence[Share] = ()):
        self.sink_inputs = sink_inputs
        self.seed = int(seed)
        self.epochs = EpochElements(items, self.seed, dataset_repeat, shares)
        self.elements = self.epochs(0)

    def batches(self, epoch: int, rank: int = 0, world: int = 1) -> list[list[Element]]:
        elements = self.epochs(epoch)
        order = bucket_batches([0] * len(elements), 1, self.seed, epoch)
        return shard_batches([[elements[j] for j in batch] for batch in order], rank, world)

    def iterate(self, epoch: int, ctx: Any, rank: int = 0, world: int = 1, batches: Optional[Sequence] = None,
                workers: int = 0, prefetch: Optional[int] = None) -> Iterator[Batch]:
        for elements in (self.batches(epoch, rank, world) if batches is None else batches):
            element = elements[0]
            ctx.epoch, ctx.sample_key = epoch, element.sample_key
            yield Batch(epoch, list(elements), inputs=self.sink_inputs(element.item, ctx))

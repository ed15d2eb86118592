"""Stage 2's data path: shape buckets, seeded batches, collation and prefetch of cached samples.

Stage 2 turns cache entries into sink inputs. This module does that for `--batch_size B`:

* **Elements.** An epoch walks the expanded list `[(item, r) for item in items for r in range(repeat)]`,
  exactly like the B = 1 loop of `stages.run_training`; each element has the sample key
  `"{index}:{sample_id}:{repeat}"` from which all of its randomness is derived.
* **Shape buckets.** Two samples may share a batch when their sink inputs have the same shapes.
  `entry_signature` reads that from the safetensors header of the cache entry alone (no tensor
  data): the shape and dtype of every cached tensor, the None-ness of every value, and the value of
  every non-tensor the sink reads directly (e.g. `num_inference_steps`). The sequence length of
  padded params (prompt embeddings and their masks, see `PAD`) is left out: those are padded.
* **Seeded shuffle within and across buckets.** `bucket_batches` streams the epoch's permutation
  (`permutation(n, seed, "shuffle", epoch)`, the same one the B = 1 loop uses) into per-bucket
  batches and emits each batch when it fills up, so both the order inside a bucket and the
  interleaving of buckets are random and a pure function of (seed, epoch). For B = 1 the order is
  the B = 1 loop's order exactly. Every element appears exactly once per epoch; each bucket ends
  with at most one partial batch (kept unless `drop_last`).
* **Per-sample randomness.** The train units run per sample, each under its own sample key, and
  only the sink runs on the batch; `collate` stacks the per-sample results (padding prompt
  embeddings with a zero mask, which the Qwen-Image transformer ignores). The flow-matching loss
  is a mean over equally-shaped samples, so one batch of B gives the gradient of B accumulated
  steps of `loss / B` (to float rounding). With gradient accumulation, weight micro-batch k of an
  optimizer step by `len(batch_k) / samples in the step` (`micro_weights`).
* **Prefetch.** Train units that call no model (noise, latent sampling, packing, timesteps) and
  whose inputs come only from the cache are "early": they run with the entry read and the
  collation, before the step, on the CPU, and can run ahead of it: in a background thread
  (`prefetch=k`) or in DataLoader worker processes (`workers>0`, pinned memory with CUDA). On a
  GPU that hides them behind the step. On a CPU-only machine they cost the same CPU time wherever
  they run, and a thread adds GIL hand-offs, so the default there is to prepare each batch when it
  is asked for (measured in docs/benchmarks.md). Entries are read through safetensors'
  memory-mapped `safe_open` (`cache.read_entry`); a small cache may be kept in memory after its
  first read. Units that call a model (a trainable text encoder, say) run in the training process,
  per sample, at step time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Optional, Sequence

from unitgraph.runtime import SINK, stage2_bindings

from .randomness import permutation

# Params padded along dim 1 to the longest in a batch (value -> its 0/1 mask param). The mask marks
# the padded positions with 0; Qwen-Image's transformer excludes them from attention.
PAD: dict[str, str] = {"prompt_emb": "prompt_emb_mask", "negative_prompt_emb": "negative_prompt_emb_mask"}
HEADER_KEY = "unitgraph"  # the cache's JSON header inside the safetensors metadata (see cache.py)


# ------------------------------------------------------------------------------------------------
# elements, batches and the epoch's order


@dataclass(frozen=True)
class CachedItem:
    """A sample of a cache (what `stages.Item` is; any object with .index and .sample_id works)."""

    index: int
    sample_id: str


@dataclass(frozen=True)
class Element:
    """One sample draw of an epoch: a cached item and its repeat number (--dataset_repeat)."""

    item: Any
    repeat: int = 0

    @property
    def sample_key(self) -> str:
        """The key all of this draw's randomness derives from (the same as stages.run_training's)."""
        return f"{self.item.index}:{self.item.sample_id}:{self.repeat}"


def expand(items: Sequence[Any], repeat: int = 1) -> list[Element]:
    """The epoch's elements in the order `stages.run_training` expands them."""
    return [Element(item, r) for item in items for r in range(repeat)]


def bucket_batches(keys: Sequence[Hashable], batch_size: int, seed: int, epoch: int,
                   drop_last: bool = False, purpose: str = "shuffle") -> list[list[int]]:
    """Batches of element positions for one epoch; every batch lies inside one bucket (equal keys).

    The epoch's permutation is streamed into per-bucket batches; a batch is emitted when it holds
    `batch_size` elements, and the partial batches left at the end follow in the order of their
    first element (or are dropped with `drop_last`). With batch_size 1 this is the permutation itself.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = permutation(len(keys), seed, purpose, epoch)
    if batch_size == 1:
        return [[j] for j in order]
    open_batches: dict[Hashable, list[int]] = {}
    out: list[list[int]] = []
    for j in order:
        batch = open_batches.setdefault(keys[j], [])
        batch.append(j)
        if len(batch) == batch_size:
            out.append(batch)
            del open_batches[keys[j]]
    if not drop_last:
        out.extend(open_batches.values())  # dicts keep insertion order: order of each batch's first element
    return out


def shard_batches(batches: Sequence[Any], rank: int, world: int) -> list[Any]:
    """This process's batches: round-robin, padded by wrapping around so every rank takes as many steps."""
    if world <= 1:
        return list(batches)
    per_rank = -(-len(batches) // world)
    padded = list(batches) + [batches[k % len(batches)] for k in range(per_rank * world - len(batches))] if batches else []
    return padded[rank::world]


def step_groups(batches: Sequence[Any], accumulation: int) -> list[list[Any]]:
    """Micro-batches grouped into optimizer steps (--gradient_accumulation_steps)."""
    return [list(batches[k:k + accumulation]) for k in range(0, len(batches), accumulation)]


def micro_weights(sizes: Sequence[int]) -> list[float]:
    """Weights of the micro-batch losses of one optimizer step: len(batch) / samples in the step.

    Each micro-batch loss is a mean over its samples, so the weighted sum is the mean over every
    sample of the step, as with one sample per micro-step and loss / len(group).
    """
    total = sum(sizes)
    return [size / total for size in sizes]


# ------------------------------------------------------------------------------------------------
# bucket keys from the safetensors header


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor names -> dtype/shape/offsets, and __metadata__)."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 * 1024 * 1024:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        return json.loads(handle.read(length))


def _param(key: str) -> str:
    """The param of an entry key (`param` in latest mode, `param@writer` in versioned mode)."""
    return key.split("@", 1)[0]


def _padded_params(pad: Mapping[str, str]) -> set[str]:
    return set(pad) | set(pad.values())


def entry_signature(path: str | Path, sink_keys: Iterable[str] = (), pad: Mapping[str, str] = PAD) -> Hashable:
    """The bucket key of one cache entry, from its header: samples with equal keys batch together."""
    header = read_safetensors_header(path)
    padded = _padded_params(pad)
    sink_keys = set(sink_keys)
    tensors: dict[str, tuple] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = list(info.get("shape", ()))
        if _param(name.split(".", 1)[0]) in padded and len(shape) > 1:
            shape[1] = None
        tensors[name] = (tuple(shape), info.get("dtype"))
    values: Any = None
    meta = header.get("__metadata__") or {}
    if HEADER_KEY in meta:
        try:
            values = json.loads(meta[HEADER_KEY]).get("values")
        except (ValueError, AttributeError):
            values = None
    if not isinstance(values, dict):  # an unknown header: tensor shapes only
        return ("tensors", tuple(sorted(tensors.items())))

    def describe(key: str, value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"__tensor__"} or set(value) == {"__image__"}:
                ref = next(iter(value.values()))
                return ("tensor", tensors.get(ref))
            return ("dict", tuple(sorted((k, describe(key, v)) for k, v in value.items())))
        if isinstance(value, list):
            return ("list", tuple(describe(key, v) for v in value))
        if value is None:
            return None
        # a plain value: it must be equal within a batch only when the sink reads it as it is
        return ("value", json.dumps(value, sort_keys=True)) if key in sink_keys else ("value", "*")

    return ("entry", tuple(sorted((key, describe(key, value)) for key, value in values.items())))


def value_signature(values: Mapping[str, Any], sink_keys: Iterable[str] = (), pad: Mapping[str, str] = PAD) -> Hashable:
    """The bucket key of a loaded entry (values by entry key); equal to nothing from `entry_signature`."""
    padded = _padded_params(pad)
    sink_keys = set(sink_keys)

    def describe(key: str, value: Any) -> Any:
        if _is_tensor(value):
            shape = list(value.shape)
            if _param(key) in padded and len(shape) > 1:
                shape[1] = None
            return ("tensor", tuple(shape), str(value.dtype))
        if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
            return ("image", tuple(value.size), value.mode)
        if isinstance(value, dict):
            return ("dict", tuple(sorted((k, describe(key, v)) for k, v in value.items())))
        if isinstance(value, (list, tuple)):
            return ("list", tuple(describe(key, v) for v in value))
        if value is None:
            return None
        return ("value", json.dumps(value, sort_keys=True, default=str)) if key in sink_keys else ("value", "*")

    return ("values", tuple(sorted((key, describe(key, value)) for key, value in values.items())))


# ------------------------------------------------------------------------------------------------
# collation


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def collate(samples: Sequence[Mapping[str, Any]], pad: Mapping[str, str] = PAD) -> dict[str, Any]:
    """One batch of sink inputs from per-sample sink inputs (each with batch dimension 1).

    Tensors are concatenated along dim 0; params in `pad` are first zero-padded along dim 1 to the
    longest, with their masks padded by 0 (a missing mask counts as all ones). Lists (per-sample
    lists such as img_shapes) are concatenated. None and plain values must agree across the batch.
    A single sample is returned as it is.
    """
    import torch

    if not samples:
        raise ValueError("cannot collate an empty batch")
    if len(samples) == 1:
        return dict(samples[0])
    names = list(samples[0])
    for s in samples[1:]:
        if list(s) != names:
            raise ValueError(f"cannot batch samples with different sink inputs: {sorted(names)} vs {sorted(s)}")
    masks = {mask: value for value, mask in pad.items()}
    out: dict[str, Any] = {}
    for name in names:
        values = [s[name] for s in samples]
        if name in pad or name in masks:
            emb_name = name if name in pad else masks[name]
            mask_name = pad[emb_name]
            embs = [s.get(emb_name) for s in samples]
            if all(e is None for e in embs):
                if all(v is None for v in values):
                    out[name] = None
                    continue
                if name == mask_name:  # masks without embeddings: batch them like any tensor
                    out[name] = _concat(name, values)
                    continue
            if any(e is None for e in embs):
                raise ValueError(f"cannot batch {emb_name}: None in some samples only")
            length = max(int(e.shape[1]) for e in embs)
            if name == emb_name:
                out[name] = torch.cat([_pad_dim1(e, length, 0) for e in embs], dim=0)
            else:
                like = next((m for m in values if m is not None), None)
                dtype = like.dtype if like is not None else torch.long
                full = [m if m is not None else torch.ones(e.shape[0], e.shape[1], dtype=dtype, device=e.device)
                        for m, e in zip(values, embs)]
                out[name] = torch.cat([_pad_dim1(m, length, 0) for m in full], dim=0)
            continue
        out[name] = _concat(name, values)
    return out


def _pad_dim1(tensor: Any, length: int, value: float) -> Any:
    import torch.nn.functional as F

    missing = length - int(tensor.shape[1])
    if missing == 0:
        return tensor
    # F.pad counts from the last dimension: (last_lo, last_hi, ..., dim1_lo, dim1_hi)
    spec = [0, 0] * (tensor.dim() - 2) + [0, missing]
    return F.pad(tensor, spec, value=value)


def _concat(name: str, values: list[Any]) -> Any:
    import torch

    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"cannot batch {name}: None in some samples only")
    if all(_is_tensor(v) for v in values):
        shapes = {tuple(v.shape[1:]) for v in values}
        if len(shapes) > 1:
            raise ValueError(f"cannot batch {name}: shapes differ ({sorted(shapes)}); the bucket key must separate them")
        return torch.cat(values, dim=0)
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    first = values[0]
    if all(type(v) is type(first) and v == first for v in values):
        return first
    raise ValueError(f"cannot batch {name}: values differ across the batch ({values[:3]}...)")


def _cast(value: Any, dtype: Any) -> Any:
    """Floating tensors (also inside lists, tuples and dicts) to `dtype`; everything else as it is."""
    if _is_tensor(value):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def to_device(values: Mapping[str, Any], device: Any, non_blocking: bool = False) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=non_blocking) if _is_tensor(v) else v for k, v in values.items()}


def _pin(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.pin_memory() if _is_tensor(v) else v for k, v in values.items()}


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
            self.inputs = _pin(self.inputs)
        return self


@dataclass
class _State:
    cached: dict[str, Any]
    live: dict[tuple[str, str], Any] = field(default_factory=dict)


class Stage2Data:
    """Cache entries -> batches of sink inputs, following the plan's `stage2_bindings`.

    items: the cache's samples (objects with .index and .sample_id, e.g. `CacheProvider.items`).
    read(item) -> the entry's values by entry key (e.g. `CacheProvider.entry(item.sample_id)`).
    entry_path(item) -> the entry's safetensors file, when there is one: bucket keys then come from
    its header alone; without it they come from the loaded values.
    dtype: when given, floating cached tensors are cast to it as they are read (a cache stored in
    bf16/fp16 by `--cache_dtype`, trained in the model's dtype).
    """

    def __init__(self, pipeline: Any, plan: Any, items: Sequence[Any], read: Callable[[Any], dict[str, Any]], *,
                 seed: int, entry_path: Optional[Callable[[Any], Path]] = None, batch_size: int = 1,
                 dataset_repeat: int = 1, drop_last: bool = False, pad: Mapping[str, str] = PAD,
                 keep_in_memory: bool = False, backward: Optional[Iterable[str]] = None, dtype: Any = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.pipeline = pipeline
        self.plan = plan
        self.items = list(items)
        self.reader = read
        self.entry_path = entry_path
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.pad = dict(pad)
        self.keep_in_memory = keep_in_memory
        self.dtype = dtype
        self.backward = set(plan.models_require_backward if backward is None else backward)
        self.elements = expand(self.items, dataset_repeat)
        self.bindings = stage2_bindings(pipeline, plan)
        self.units = [pipeline.units[pipeline.index(name)] for name in plan.train_units]
        self.sink_params = list(pipeline.sink.inputs)
        self.sink_keys = sorted({b.key for (reader_, _), b in self.bindings.items() if reader_ == SINK and b.source == "cache"})
        # Units that can run ahead of the step: no model, inputs from the cache or from such units.
        early: set[str] = set()
        for unit in self.units:
            sources = [self.bindings[(unit.name, p)] for p in unit.inputs]
            if not unit.models and all(b.source == "cache" or b.writer in early for b in sources):
                early.add(unit.name)
        self.early_units = [u for u in self.units if u.name in early]
        self.step_units = [u for u in self.units if u.name not in early]
        self._entries: dict[str, dict[str, Any]] = {}
        self._keys: dict[str, Hashable] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_cache(cls, pipeline: Any, plan: Any, cache_dir: str | Path, **kwargs: Any) -> "Stage2Data":
        """A source over a complete cache folder made under `plan` (checked as stage 2 checks it).

        Written against the cache layout of `cache.py` (manifest samples with index and sample_id,
        `Cache.entry_path`, `read_entry`); a stage that has its own provider passes items and read instead.
        """
        from .cache import Cache

        cache = Cache(cache_dir)
        manifest = cache.open_for_training(plan)
        items = sorted((CachedItem(int(s["index"]), str(s["sample_id"])) for s in manifest["samples"]),
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

    def buckets(self) -> dict[Hashable, list[int]]:
        """Element positions by bucket key."""
        out: dict[Hashable, list[int]] = {}
        for j, element in enumerate(self.elements):
            out.setdefault(self.bucket_key(element.item), []).append(j)
        return out

    def batches(self, epoch: int, rank: int = 0, world: int = 1) -> list[list[Element]]:
        """This process's micro-batches of one epoch, in training order."""
        if self.batch_size == 1:
            keys: list[Hashable] = [0] * len(self.elements)
        else:
            keys = [self.bucket_key(e.item) for e in self.elements]
        positions = bucket_batches(keys, self.batch_size, self.seed, epoch, self.drop_last)
        return shard_batches([[self.elements[j] for j in batch] for batch in positions], rank, world)

    # -- per-sample work -------------------------------------------------------------------------

    def read(self, item: Any) -> dict[str, Any]:
        sample_id = item.sample_id
        if sample_id in self._entries:
            return self._entries[sample_id]
        values = self.reader(item)
        if self.dtype is not None:
            values = {k: _cast(v, self.dtype) for k, v in values.items()}
        if self.keep_in_memory:
            with self._lock:
                self._entries[sample_id] = values
        return values

    def _value(self, state: _State, reader: str, param: str) -> Any:
        binding = self.bindings[(reader, param)]
        if binding.source == "live":
            return state.live[(binding.writer, param)]
        return state.cached[binding.key]

    def _run(self, units: Sequence[Any], state: _State, ctx: Any, grad: bool) -> None:
        import torch

        from .qwen_image import run_unit

        if not grad:  # one no_grad around all of them (the early units, per sample: every microsecond shows at test size)
            with torch.no_grad():
                for unit in units:
                    out = run_unit(unit, ctx, {p: self._value(state, unit.name, p) for p in unit.inputs})
                    for p in unit.outputs:
                        state.live[(unit.name, p)] = out[p]
            return
        for unit in units:
            inputs = {p: self._value(state, unit.name, p) for p in unit.inputs}
            needs = bool(set(unit.models) & self.backward) or any(_is_tensor(v) and v.requires_grad for v in inputs.values())
            with contextlib.nullcontext() if needs else torch.no_grad():
                out = run_unit(unit, ctx, inputs)
            for p in unit.outputs:
                state.live[(unit.name, p)] = out[p]

    def early_context(self, ctx: Any, device: Any = "cpu") -> Any:
        """A copy of the training context for the early units: no model but configs (the scheduler), on `device`.

        Ahead of the step (a thread or a worker) they run on the CPU; in the caller they run on ctx.device,
        exactly as `stages.CacheProvider` runs them (the same numbers on a GPU too).
        """
        import torch

        models = {k: v for k, v in ctx.models.items() if not isinstance(v, torch.nn.Module)}
        return dataclasses.replace(ctx, models=models, device=device, epoch=None, sample_key=None, _sigma_cache={})

    def prepare(self, element: Element, epoch: int, early_ctx: Any, cached: Optional[dict[str, Any]] = None) -> _State:
        """Read one element's entry (or take `cached`) and run its early units (under its own sample key)."""
        state = _State(cached=self.read(element.item) if cached is None else cached)
        if self.early_units:
            ctx = dataclasses.replace(early_ctx, epoch=epoch, sample_key=element.sample_key)
            self._run(self.early_units, state, ctx, grad=False)
        return state

    def sink_inputs(self, state: _State) -> dict[str, Any]:
        return {p: self._value(state, SINK, p) for p in self.sink_params}

    def produce(self, elements: list[Element], epoch: int, early_ctx: Any, pin: bool = False) -> Batch:
        """A batch with its early work done: collated inputs when no unit is left for the step."""
        states = [self.prepare(e, epoch, early_ctx) for e in elements]
        if self.step_units:
            return Batch(epoch, elements, prepared=states)
        inputs = collate([self.sink_inputs(s) for s in states], self.pad)
        return Batch(epoch, elements, inputs=_pin(inputs) if pin else inputs)

    def finish(self, batch: Batch, ctx: Any) -> dict[str, Any]:
        """The batch's sink inputs: run the units that call models, per sample, then collate."""
        if batch.inputs is not None:
            return batch.inputs
        samples = []
        for element, state in zip(batch.elements, batch.prepared or []):
            ctx.epoch, ctx.sample_key = batch.epoch, element.sample_key
            self._run(self.step_units, state, ctx, grad=True)
            samples.append(self.sink_inputs(state))
        batch.inputs, batch.prepared = collate(samples, self.pad), None
        return batch.inputs

    # -- the epoch as an iterator ----------------------------------------------------------------

    def iterate(self, epoch: int, ctx: Any, rank: int = 0, world: int = 1, prefetch: Optional[int] = None,
                workers: int = 0, batches: Optional[Sequence[list[Element]]] = None) -> Iterator[Batch]:
        """Ready batches of one epoch (inputs on ctx.device).

        prefetch=0 prepares each batch in the caller, when it is asked for; prefetch=k > 0 prepares up
        to k batches ahead in a background thread; workers > 0 uses a torch DataLoader with that many
        processes (and prefetch_factor k). The default (None) is a thread with k = 2 when training on
        CUDA, where the host CPU is otherwise idle, and 0 on the CPU, where preparing a batch competes
        with the training step for the same cores (see docs/benchmarks.md). `batches` replaces this
        rank's batches of the epoch (e.g. the rest of an epoch when resuming).
        """
        import torch

        batches = list(self.batches(epoch, rank, world) if batches is None else batches)
        cuda = torch.cuda.is_available() and str(getattr(ctx, "device", "cpu")).startswith("cuda")
        if prefetch is None:
            prefetch = 2 if cuda else 0
        early_ctx = self.early_context(ctx, "cpu" if prefetch > 0 or workers > 0 else ctx.device)
        if workers > 0:
            source: Iterable[Batch] = _dataloader(self, batches, epoch, early_ctx, workers, max(1, prefetch), cuda)
        elif prefetch > 0:
            source = _Prefetched(((lambda b=b: self.produce(b, epoch, early_ctx, cuda)) for b in batches), prefetch)
        else:
            source = (self.produce(b, epoch, early_ctx) for b in batches)
        try:
            for batch in source:
                inputs = self.finish(batch, ctx)
                batch.inputs = to_device(inputs, ctx.device, non_blocking=cuda)
                yield batch
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()


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

    def __call__(self, item: Any) -> Path:
        from .cache import Cache

        return Cache(self.cache_dir).entry_path(item.sample_id)


class _EntryReader(_EntryPath):
    """item -> its entry's values, read through safetensors' memory-mapped safe_open (cache.read_entry)."""

    def __call__(self, item: Any) -> dict[str, Any]:
        from .cache import read_entry

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

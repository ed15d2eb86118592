"""Batches of samples: the epoch's seeded order, shape buckets, sharding, collation.

* **Elements.** An epoch walks the expanded list `[(item, r) for item in items for r in range(repeat)]`;
  each element has the sample key `"{index}:{sample_id}:{repeat}"` from which all of its randomness
  is derived, so a sample draws the same numbers in the unsplit loop and in stage 2. With several
  datasets (--dataset_config) each dataset contributes its own `Share` (`mixed_elements`): its repeats,
  or by weight whole passes plus a subset drawn per epoch from the seed; one dataset of repeats r is
  the expanded list above.
* **Shape buckets.** Two samples may share a batch when their sink inputs have the same shapes.
  `entry_signature` reads that from the safetensors header of the cache entry alone (no tensor
  data): the shape and dtype of every cached tensor, the None-ness of every value, and the value of
  every non-tensor the sink reads directly (e.g. `num_inference_steps`). The sequence length of
  the family's padded params (prompt embeddings and their masks, `Family.pad`) is left out.
* **Seeded shuffle within and across buckets.** `bucket_batches` streams the epoch's permutation
  (`permutation(n, seed, "shuffle", epoch)`) into per-bucket batches and emits each batch when it
  fills up, so both the order inside a bucket and the interleaving of buckets are random and a pure
  function of (seed, epoch). For B = 1 the order is the permutation itself. Every element appears
  exactly once per epoch; each bucket ends with at most one partial batch (kept unless `drop_last`).
* **Collation.** `collate` stacks per-sample sink inputs, padding the padded params with a zero
  mask, which the denoisers ignore. A loss that is a mean over equally-shaped samples then gives,
  for one batch of B, the gradient of B accumulated steps of `loss / B` (to float rounding); with
  gradient accumulation, micro-batch k of a step weighs `len(batch_k) / samples in the step`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Iterable, Mapping, Optional, Sequence

from ..randomness import permutation

HEADER_KEY = "unitgraph"  # the cache's JSON header inside the safetensors metadata (see cache/entries.py)


# ------------------------------------------------------------------------------------------------
# elements, batches and the epoch's order


@dataclass(frozen=True)
class CachedItem:
    """A sample: its position in the metadata and its identity (any object with .index and .sample_id works)."""

    index: int
    sample_id: str
    dataset: Optional[str] = None  # the --dataset_config dataset it comes from (None: the run's one dataset)


@dataclass(frozen=True)
class Element:
    """One sample draw of an epoch: a cached item and its repeat number (--dataset_repeat)."""

    item: Any
    repeat: int = 0

    @property
    def sample_key(self) -> str:
        """The key all of this draw's randomness derives from."""
        return f"{self.item.index}:{self.item.sample_id}:{self.repeat}"


def expand(items: Sequence[Any], repeat: int = 1) -> list[Element]:
    """The epoch's elements: each item `repeat` times (--dataset_repeat), in item order."""
    return [Element(item, r) for item in items for r in range(repeat)]


@dataclass(frozen=True)
class Share:
    """One dataset's part of an epoch (--dataset_config): `repeats` passes over its samples, or with `weight` a
    number of draws proportional to its size (`draws`)."""

    name: str
    repeats: int = 1
    weight: Optional[float] = None

    def draws(self, size: int) -> int:
        """Elements an epoch takes from a dataset of `size` samples: repeats x size, or round(weight x size) (halves
        rounded up), at least one."""
        if self.weight is None:
            return self.repeats * size
        return max(1, math.floor(self.weight * size + 0.5)) if size else 0


def mixed_elements(items: Sequence[Any], shares: Sequence[Share], seed: int, epoch: int) -> list[Element]:
    """One epoch's elements of several datasets (items carry `.dataset`, the name of a share), dataset by dataset in
    the shares' order, each dataset's items in their order.

    A share of `repeats` r expands its items r times (as `expand`); one of `weight` takes floor(draws / n) whole
    passes and then a subset of the rest's size drawn anew each epoch, from the seeded stream of the purpose
    ("dataset", name, epoch): it depends on nothing else, so the unsplit run and stage 2 draw the same subset. The
    subset's elements have the next repeat number, so a sample drawn in two epochs keeps its key.
    """
    by_name: dict[str, list[Any]] = {share.name: [] for share in shares}
    for item in items:
        by_name[item.dataset].append(item)
    out: list[Element] = []
    for share in shares:
        group = by_name[share.name]
        if share.weight is None:
            out += expand(group, share.repeats)
            continue
        whole, rest = divmod(share.draws(len(group)), len(group)) if group else (0, 0)
        out += expand(group, whole)
        if rest:
            chosen = sorted(permutation(len(group), seed, "dataset", share.name, epoch)[:rest])
            out += [Element(group[k], whole) for k in chosen]
    return out


def varies_by_epoch(shares: Sequence[Share]) -> bool:
    """Whether an epoch's elements depend on the epoch: some share draws a subset by weight."""
    return any(share.weight is not None and share.weight != int(share.weight) for share in shares)


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


def entry_signature(path: "str | Path | dict[str, Any]", sink_keys: Iterable[str] = (), pad: Mapping[str, str] = {}) -> Hashable:
    """The bucket key of one cache entry, from its header (read from the file at `path`, or given as the parsed
    header itself): samples with equal keys batch together."""
    header = path if isinstance(path, dict) else read_safetensors_header(path)
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
            if set(value) in ({"__tensor__"}, {"__image__"}, {"__complex__"}):
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


def value_signature(values: Mapping[str, Any], sink_keys: Iterable[str] = (), pad: Mapping[str, str] = {}) -> Hashable:
    """The bucket key of a loaded entry (values by entry key); equal to nothing from `entry_signature`."""
    padded = _padded_params(pad)
    sink_keys = set(sink_keys)

    def describe(key: str, value: Any) -> Any:
        if is_tensor(value):
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


def is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def collate(samples: Sequence[Mapping[str, Any]], pad: Mapping[str, str] = {}) -> dict[str, Any]:
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
    if all(is_tensor(v) for v in values):
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


def cast_floating(value: Any, dtype: Any) -> Any:
    """Floating tensors (also inside lists, tuples and dicts) to `dtype`; everything else as it is."""
    if is_tensor(value):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, tuple):
        return tuple(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def to_device(values: Mapping[str, Any], device: Any, non_blocking: bool = False) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=non_blocking) if is_tensor(v) else v for k, v in values.items()}


def pin_tensors(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.pin_memory() if is_tensor(v) else v for k, v in values.items()}

"""A cache entry's bytes: one sample's cached values as safetensors tensors plus JSON in the header.

An entry file holds the sample's cached values under their entry keys (`param` in latest mode,
`param@writer` in versioned mode). Tensors are safetensors tensors; everything else (None, ints,
strings, lists, tuples) is JSON in the safetensors header (key `unitgraph`), where a tensor nested
in a list is a reference to a stored tensor. safetensors has no complex dtypes: a complex tensor (a
rotary embedding's frequencies, which a DiffSynth unit may compute) is stored as its real and
imaginary parts along a last dimension of 2 (`torch.view_as_real`) and read back as the complex
tensor it was, bit for bit. Never pickle. torch is imported where tensors are
handled, so `cache verify` and `cache info` start without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unitgraph.atomic import write_bytes_atomic
from unitgraph.userfiles import parse_user_json

from ..errors import BackendError

if TYPE_CHECKING:
    import torch

HEADER_KEY = "unitgraph"


# ------------------------------------------------------------------------------------------------
# values <-> safetensors + JSON


def _encode(value: Any, tensors: dict[str, "torch.Tensor"], path: str, keep_layout: bool = False) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.is_complex():  # its (real, imaginary) pairs, a last dim of 2
        tensors[path] = torch.view_as_real(value.detach().to("cpu").contiguous()).clone()
        return {"__complex__": path}
    if isinstance(value, torch.Tensor):
        order = _memory_order(value) if keep_layout else None
        if order is None:
            tensors[path] = value.detach().to("cpu").contiguous().clone()
            return {"__tensor__": path}
        tensors[path] = value.detach().to("cpu").permute(order).contiguous().clone()
        return {"__tensor__": path, "__order__": order}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _is_pil(value):  # a raw dataset image: stored as uint8 pixels, restored as a PIL image
        import numpy as np

        tensors[path] = torch.from_numpy(np.asarray(value.convert("RGB"), dtype=np.uint8).copy())
        return {"__image__": path}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}", keep_layout) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}.{i}", keep_layout) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if {"__tensor__", "__tuple__", "__image__", "__order__", "__complex__"} & set(value):
            raise TypeError(f"cannot cache a dict with reserved key at {path}")
        return {k: _encode(v, tensors, f"{path}.{k}", keep_layout) for k, v in value.items()}
    raise TypeError(f"cannot cache a value of type {type(value).__name__} at {path} (tensors, JSON values, lists, tuples)")


def _memory_order(tensor: "torch.Tensor") -> list[int] | None:
    """The order of `tensor`'s dimensions in memory when it is a dense permuted view (a `rearrange` of a contiguous
    tensor), else None. Its layout is part of what it means to the code that reads it: `torch.randn_like` keeps a
    dense tensor's strides and fills its memory in order, so the same values laid out otherwise draw other noise at
    the same positions (DiffSynth's loss draws its noise like its `input_latents`, which an image unit may return
    as a permuted view). The entry stores the tensor in memory order and `_decode` permutes it back: the same values
    with the same layout. Only where the writer asks (`keep_layout`: DiffSynth's own units, foreign code whose stage 2
    may read a layout); unitgraph's families store contiguous tensors, so that a batched stage 1, whose slices of a
    batch are laid out otherwise, writes the very bytes an unbatched one does."""
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))
    return order if tensor.permute(order).is_contiguous() else None


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a backend dependency
        return False
    return isinstance(value, Image.Image)


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if set(value) == {"__tensor__", "__order__"}:  # stored in memory order: the view it was (_memory_order)
            stored, order = tensors[value["__tensor__"]], value["__order__"]
            if (not isinstance(order, list) or any(type(d) is not int for d in order)
                    or sorted(order) != list(range(stored.dim()))):
                raise ValueError(f"the layout record {order!r} is not an order of the tensor's {stored.dim()} dims")
            return stored.permute(sorted(range(len(order)), key=order.__getitem__))
        if set(value) == {"__complex__"}:  # stored as (real, imaginary) pairs: the complex tensor it was
            import torch

            stored = tensors[value["__complex__"]]
            if not stored.is_floating_point() or stored.dim() < 1 or stored.shape[-1] != 2:
                raise ValueError(f"a complex value's parts must lie along a last dimension of 2, not {list(stored.shape)}")
            return torch.view_as_complex(stored)
        if set(value) == {"__image__"}:
            from PIL import Image

            return Image.fromarray(tensors[value["__image__"]].numpy())
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def _tensor_refs(value: Any) -> list[str]:
    """Names of the stored tensors an encoded value refers to."""
    if isinstance(value, dict):
        if set(value) in ({"__tensor__"}, {"__image__"}, {"__tensor__", "__order__"}, {"__complex__"}):
            return [value.get("__tensor__", value.get("__image__", value.get("__complex__")))]
        if set(value) == {"__tuple__"}:
            return [r for v in value["__tuple__"] for r in _tensor_refs(v)]
        return [r for v in value.values() for r in _tensor_refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _tensor_refs(v)]
    return []


def entry_bytes(values: dict[str, Any], meta: dict[str, Any], keep_layout: bool = False) -> bytes:
    """An entry's bytes; with `keep_layout`, a dense permuted view is stored as one (`_memory_order`)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    encoded = {key: _encode(value, tensors, key, keep_layout) for key, value in values.items()}
    header = json.dumps({"meta": meta, "values": encoded}, sort_keys=True)
    return save(tensors, metadata={HEADER_KEY: header})


def _header_bytes(data: bytes, source: str) -> bytes:
    """The JSON header of a safetensors file's bytes (its length checked against the data)."""
    if len(data) < 8:
        raise BackendError(f"not a safetensors file ({len(data)} bytes)", source=source)
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise BackendError("not a safetensors file (bad header length)", source=source)
    return data[8:8 + size]


def safetensors_header(data: bytes, source: str) -> dict[str, Any]:
    raw = _header_bytes(data, source)
    try:
        header = parse_user_json(raw.decode("utf-8"), source, BackendError)
    except (UnicodeDecodeError, BackendError):
        raise BackendError("not a safetensors file (unreadable header)", source=source) from None
    if not isinstance(header, dict):
        raise BackendError("not a safetensors file (header is not an object)", source=source)
    return header


def _entry_metadata(data: bytes, source: str) -> dict[str, Any]:
    """The safetensors metadata of an entry's bytes, read with the plain C JSON parser: stage 2 reads every
    entry at every step, and the strict user-file parser of `safetensors_header` costs ~30 us an entry at
    test size. Nothing is lost: safetensors' own loader re-reads this header strictly (and refuses a damaged
    one) right after, and the values come from the unitgraph header inside it, parsed as before."""
    raw = _header_bytes(data, source)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise BackendError("not a safetensors file (unreadable header)", source=source) from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(header, dict) or not isinstance(metadata or {}, dict):
        raise BackendError("not a safetensors file (header is not an object)", source=source)
    return metadata or {}


def parse_entry(data: bytes, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values by entry key, meta) of the bytes of one entry file."""
    from safetensors.torch import load

    header = _entry_metadata(data, source)
    raw = header.get(HEADER_KEY)
    if raw is None:
        raise BackendError("not a unitgraph cache entry (no header)", source=source)
    try:
        tensors = load(data)
        content = json.loads(raw)
        return _decode(content["values"], tensors), content["meta"]
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise BackendError(f"unreadable cache entry ({type(exc).__name__}: {exc})", source=source) from None


def write_entry(path: str | Path, values: dict[str, Any], meta: dict[str, Any], keep_layout: bool = False) -> None:
    write_bytes_atomic(path, entry_bytes(values, meta, keep_layout))


def read_entry(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values by entry key, meta) of one entry file."""
    try:
        with open(path, "rb") as handle:  # not Path.read_bytes: stage 2 reads an entry per sample per step
            data = handle.read()
    except FileNotFoundError:
        raise BackendError("cache entry is missing; run the data_process stage again", source=str(path)) from None
    except OSError as exc:
        raise BackendError(f"unreadable cache entry ({exc.strerror or exc})", source=str(path)) from None
    return parse_entry(data, str(path))


def entry_key_sizes(path: str | Path) -> dict[str, int]:
    """Bytes of tensor data under each entry key of one entry file (reads only the header)."""
    path = Path(path)
    with path.open("rb") as handle:
        head = handle.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        data = head + handle.read(size)
    return header_key_sizes(safetensors_header(data, str(path)), str(path))


def header_key_sizes(header: dict[str, Any], source: str) -> dict[str, int]:
    """Bytes of tensor data under each entry key, from an entry's safetensors header."""
    content = parse_user_json(str((header.get("__metadata__") or {}).get(HEADER_KEY, "{}")), source, BackendError)
    if not isinstance(content, dict):
        raise BackendError("not a unitgraph cache entry (its header is not an object)", source=source)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    out = {}
    for key, value in (content.get("values") or {}).items():
        out[key] = sum(int(tensors[r]["data_offsets"][1]) - int(tensors[r]["data_offsets"][0])
                       for r in _tensor_refs(value) if r in tensors)
    return out

"""Safetensors files read as user files: the whole header checked before a single tensor is loaded.

A safetensors file is 8 bytes (the header's length, little-endian), a JSON header (each tensor's dtype,
shape and byte range; `__metadata__`, a JSON object of strings) and the tensors' bytes back to back.
`parse_header` checks all of it against the file's size without torch: the length, the JSON (strict:
duplicate keys, NaN and deep nesting are refused), each tensor's entry (a known dtype, a shape of
non-negative integers, a byte range of exactly shape x item size), that the ranges tile the data with
no gap or overlap, and that the file ends where the last tensor does (a truncated file is named as
such). Every problem is one `BackendError` line naming the file, so the readers built on it (training
states, LoRA files, the encoded validation prompts) decide on a checked `Header` and call
`load_tensors` only when everything they need is known to be there. No torch at import time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from unitgraph.userfiles import open_user_file, parse_user_json

from .errors import BackendError

__all__ = ["FLOATING", "Header", "ITEM_SIZES", "MAX_HEADER_BYTES", "TensorInfo", "dtype_code", "finite",
           "header_of_bytes", "load_tensors", "metadata_object", "parse_header", "read_header"]

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
# the dtypes of whole bytes (safetensors' names); sub-byte ones (F4, F6) are not used by unitgraph
ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
              "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8,
              "U64": 8, "F64": 8, "C64": 8}
FLOATING = frozenset({"F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F8_E8M0", "F16", "BF16", "F32", "F64"})
_TORCH_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
                "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ",
                "float8_e8m0fnu": "F8_E8M0", "complex64": "C64", "uint64": "U64", "uint32": "U32", "uint16": "U16"}
_TORCH_OF = {code: name for name, code in _TORCH_NAMES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it."""

    dtype: str  # safetensors' name: F32, BF16, I64, ...
    shape: tuple[int, ...]
    begin: int  # byte range in the data section
    end: int

    @property
    def floating(self) -> bool:
        return self.dtype in FLOATING

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_name(self) -> str:
        """The torch dtype's name (float32, bfloat16, ...), for messages."""
        return _TORCH_OF.get(self.dtype, self.dtype)

    def describe(self) -> str:
        return f"{list(self.shape)} {self.torch_name}"


@dataclass(frozen=True)
class Header:
    """A checked safetensors header: its tensors by name, its metadata, where the data starts."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int  # 8 + the header's length
    size: int  # the file's size in bytes


def dtype_code(dtype: Any) -> str:
    """safetensors' name of a torch dtype (torch.float32 -> "F32"); the dtype's own name when it has none."""
    name = str(dtype).removeprefix("torch.")
    return _TORCH_NAMES.get(name, name)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_header(head: bytes, size: int, source: str) -> Header:
    """The checked header of a safetensors file of `size` bytes whose first bytes are `head` (at least the
    8-byte length and the header itself); a BackendError naming `source` otherwise."""
    if size < 8 or len(head) < 8:
        raise BackendError(f"not a safetensors file ({size} bytes: shorter than its 8-byte header length; empty or "
                           "truncated)", source=source)
    length = int.from_bytes(head[:8], "little")
    if length < 2 or length > MAX_HEADER_BYTES:
        raise BackendError(f"not a safetensors file (a header length of {length} bytes)", source=source)
    if 8 + length > size:
        raise BackendError(f"truncated: its header needs {8 + length} bytes, the file has {size} (not a whole "
                           "safetensors file)", source=source)
    if len(head) < 8 + length:  # the file shrank while its header was read
        raise BackendError("truncated while it was read (not a whole safetensors file)", source=source)
    try:
        text = head[8:8 + length].decode("utf-8")
    except UnicodeDecodeError:
        raise BackendError("not a safetensors file (its header is not UTF-8 text)", source=source) from None
    try:
        raw = parse_user_json(text, source, BackendError)
    except BackendError as exc:
        raise BackendError(f"not a safetensors file (unreadable header: {exc.message})", source=source) from None
    if not isinstance(raw, dict):
        raise BackendError(f"not a safetensors file (its header is {_kind(raw)}, not a JSON object)", source=source)
    metadata = raw.get("__metadata__", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        what = _kind(metadata) if not isinstance(metadata, dict) else "an object with values that are not strings"
        raise BackendError(f"the header's metadata (__metadata__) is {what}, not a JSON object of strings",
                           source=source)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        shown = _clip(repr(name))
        if not name:
            raise BackendError("not a safetensors file (a tensor without a name)", source=source)
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise BackendError(f"not a safetensors file (the entry of tensor {shown} is not "
                               "{dtype, shape, data_offsets})", source=source)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ITEM_SIZES:
            raise BackendError(f"tensor {shown} has dtype {_clip(repr(dtype), 24)}, which unitgraph does not read "
                               f"({', '.join(sorted(ITEM_SIZES))})", source=source)
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise BackendError(f"not a safetensors file (the shape of tensor {shown} is not a list of sizes)",
                               source=source)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise BackendError(f"not a safetensors file (the data_offsets of tensor {shown} are not a byte range)",
                               source=source)
        need = math.prod(shape) * ITEM_SIZES[dtype]
        if offsets[1] - offsets[0] != need:
            raise BackendError(f"not a safetensors file (tensor {shown} of shape {shape} {dtype} needs {need} bytes, "
                               f"its byte range holds {offsets[1] - offsets[0]})", source=source)
        tensors[name] = TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != end:
            raise BackendError(f"not a safetensors file (tensor {_clip(repr(name))} starts at byte {info.begin} of "
                               f"the data, the tensor before it ends at {end})", source=source)
        end = info.end
    have = size - 8 - length
    if have < end:
        raise BackendError(f"truncated: its tensors need {end} bytes of data, the file holds {have}", source=source)
    if have > end:
        raise BackendError(f"not a safetensors file ({have - end} bytes after its last tensor)", source=source)
    return Header(tensors, dict(metadata), 8 + length, size)


def header_of_bytes(data: bytes, source: str) -> Header:
    """The checked header of a safetensors file held in memory."""
    return parse_header(data, len(data), source)


def read_header(path: str | Path, source: Optional[str] = None) -> Header:
    """The checked header of the safetensors file at `path` (only the header is read; a FIFO or a device is
    refused before a byte is read from it)."""
    source = source or str(path)
    with open_user_file(path, BackendError, "a safetensors file") as (fd, info):
        head = os.pread(fd, 8, 0)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if 2 <= length <= MAX_HEADER_BYTES and 8 + length <= info.st_size:
            while len(head) < 8 + length:
                chunk = os.pread(fd, 8 + length - len(head), len(head))
                if not chunk:
                    break
                head += chunk
    return parse_header(head, info.st_size, source)


def load_tensors(where: "str | Path | bytes", header: Header, source: str,
                 names: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """The tensors `names` (default: all) of a file whose `header` was checked, as torch tensors; a file changed
    since (or damaged where the header could not tell) is one line naming it."""
    from safetensors import safe_open
    from safetensors.torch import load

    wanted = list(header.tensors) if names is None else list(names)
    try:
        if isinstance(where, (bytes, bytearray, memoryview)):
            everything = load(bytes(where))
            out = {name: everything[name] for name in wanted}
        else:
            with safe_open(str(where), framework="pt") as handle:
                out = {name: handle.get_tensor(name) for name in wanted}
    except Exception as exc:  # safetensors raises its own error types (and OSError) for a damaged or changed file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackendError(f"unreadable safetensors file ({type(exc).__name__}: {_clip(first, 120)})",
                           source=source) from None
    for name, tensor in out.items():
        info = header.tensors[name]
        if tuple(tensor.shape) != info.shape or dtype_code(tensor.dtype) != info.dtype:
            raise BackendError(f"changed while it was read (tensor {_clip(repr(name))})", source=source)
    return out


def finite(tensor: Any) -> bool:
    """Whether a floating tensor holds no NaN or infinity (other tensors: True)."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return bool(torch.isfinite(tensor).all())
    return bool(torch.isfinite(tensor.float()).all())


def metadata_object(header: Header, key: str, source: str) -> Optional[dict[str, Any]]:
    """The JSON object stored under metadata `key` (None when absent); strict JSON, one line when it is not an object."""
    raw = header.metadata.get(key)
    if raw is None:
        return None
    try:
        value = parse_user_json(raw, source, BackendError)
    except BackendError as exc:
        raise BackendError(f"the {key} in the file's header is not JSON ({exc.message})", source=source) from None
    if not isinstance(value, dict):
        raise BackendError(f"the {key} in the file's header is {_kind(value)}, not a JSON object", source=source)
    return value

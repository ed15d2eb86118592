"""Encoded prompts stored beside a cache: the validation prompts (`validation.safetensors`) and the empty prompt
of caption dropout (`empty_prompt.safetensors`), each sealed and checked whole (a `PromptFile` names which).

Stage 1 stores the prompt units' outputs for the --validation_prompt values, followed by those of the negative
prompts their guidance reads, beside the cache, so stage 2 renders samples without a text encoder
(train/validation.py); the file's `prompts` are all of these texts, so its key covers the negative prompts too. The file carries its own checksum in its
header (`unitgraph_validation_sha256`: the sha256 of its tensor table, its other metadata and its tensor
bytes), so a flipped bit anywhere is found by `cache verify` and by stage 2 before it trains, rather
than used silently. Its structure is checked against the cache it sits in: each prompt holds exactly
the outputs the cache's prompt units declare, and each tensor has the dtype, rank, batch size and
feature size of the same value in the cache's entries (which the denoiser trains on), a mask its
embeddings' length. A wrong one is one line naming the file before training, never a crash at the
first sample after it. No torch here: `cache verify` runs without it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..errors import BackendError
from ..tensorfile import Header, TensorInfo, dtype_code, header_of_bytes, metadata_object

if TYPE_CHECKING:
    from .cache import Cache
    from .manifest import Manifest

__all__ = ["DIGEST_KEY", "EMPTY_PROMPT", "EncodedPrompts", "HINT", "META_KEY", "PromptFile", "VALIDATION",
           "VALIDATION_FILE", "check_against_cache",
           "content_digest", "prompts_key", "read_encoded", "validation_problem"]

VALIDATION_FILE = "validation.safetensors"
META_KEY = "unitgraph_validation"
DIGEST_KEY = "unitgraph_validation_sha256"
HINT = ("run stage 1 (--task sft:data_process, or sft:split) with the same --validation_prompt and "
        "--validation_negative_prompt values")


@dataclass(frozen=True)
class PromptFile:
    """Which file of encoded prompts: its name beside the entries, how messages call it, how to make it again."""

    name: str
    what: str  # "encoded validation prompts"
    one: str  # "encoded validation prompt" (one of them)
    hint: str


VALIDATION = PromptFile(VALIDATION_FILE, "encoded validation prompts", "encoded validation prompt", HINT)
EMPTY_PROMPT = PromptFile("empty_prompt.safetensors", "encoded empty prompt", "encoded empty prompt",
                          "run stage 1 (--task sft:data_process, or sft:split) with --caption_dropout")
_NAME = re.compile(r"(0|[1-9][0-9]*)\.(.+)")


def prompts_key(prompts: list[str], key_hash: str) -> str:
    """What binds the file to its prompts and to the cache's key inputs."""
    return hashlib.sha256(json.dumps({"prompts": prompts, "key": key_hash}).encode("utf-8")).hexdigest()


def content_digest(header: Header, data: bytes) -> str:
    """The sha256 of everything in the file but the digest itself: the tensor table, the other metadata (as
    canonical JSON) and the tensor bytes."""
    table = {name: [info.dtype, list(info.shape), info.begin, info.end] for name, info in header.tensors.items()}
    meta = {k: v for k, v in header.metadata.items() if k != DIGEST_KEY}
    head = json.dumps({"metadata": meta, "tensors": table}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(head.encode("ascii"))
    digest.update(b"\0")
    digest.update(memoryview(data)[header.data_start:])
    return digest.hexdigest()


@dataclass(frozen=True)
class EncodedPrompts:
    """The checked contents of a validation.safetensors file (tensors described, not loaded)."""

    header: Header
    prompts: list[str]
    key: str
    values: list[dict[str, Optional[TensorInfo]]]  # per prompt: output -> its tensor (None: the unit gave None)


def read_encoded(data: bytes, source: str, kind: PromptFile = VALIDATION) -> EncodedPrompts:
    """The file's header checked whole: a safetensors file, unitgraph's metadata, the checksum over all of it,
    and one value per prompt for each of the same outputs."""
    header = header_of_bytes(data, source)
    meta = metadata_object(header, META_KEY, source)
    if meta is None:
        raise BackendError(f"not the {kind.what} of a unitgraph cache (no {META_KEY} in its header); "
                           f"{kind.hint}", source=source)
    digest = header.metadata.get(DIGEST_KEY)
    if digest is None:
        raise BackendError(f"the {kind.what} have no checksum (written by an older unitgraph); {kind.hint}",
                           source=source)
    if digest != content_digest(header, data):
        raise BackendError(f"the {kind.what} do not match their checksum (corrupted); {kind.hint}",
                           source=source)
    prompts, key, none = meta.get("prompts"), meta.get("key"), meta.get("none", [])
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts) and isinstance(key, str)
            and isinstance(none, list) and all(isinstance(n, str) for n in none)):
        raise BackendError(f"damaged {kind.what}: its {META_KEY} is not {{prompts, key, none}}; {kind.hint}",
                           source=source)
    values: list[dict[str, Optional[TensorInfo]]] = [{} for _ in prompts]
    for name, info in [*header.tensors.items(), *((n, None) for n in none)]:
        match = _NAME.fullmatch(name)
        if match is None or int(match.group(1)) >= len(prompts):
            raise BackendError(f"damaged {kind.what}: {name[:60]!r} is not <prompt 0..{len(prompts) - 1}>."
                               f"<output>; {kind.hint}", source=source)
        index, output = int(match.group(1)), match.group(2)
        if output in values[index]:
            raise BackendError(f"damaged {kind.what}: {name[:60]!r} is given twice; {kind.hint}", source=source)
        values[index][output] = info
    for index, outputs in enumerate(values):
        if set(outputs) != set(values[0]) or not outputs:
            raise BackendError(f"damaged {kind.what}: prompt {index} holds "
                               f"{', '.join(sorted(outputs)) or 'nothing'}, prompt 0 {', '.join(sorted(values[0]))}; "
                               f"{kind.hint}", source=source)
    return EncodedPrompts(header, list(prompts), key, values)


def _prompt_outputs(manifest: "Manifest") -> dict[str, str]:
    """output -> prompt unit, for the cache's prompt units (units that read only `prompt` and call a model, as
    train/validation.prompt_units picks them), from the declarations the cache's key was made of."""
    out: dict[str, str] = {}
    units = manifest.key_inputs.get("units")
    for unit in units if isinstance(units, list) else []:
        if isinstance(unit, dict) and unit.get("inputs") == ["prompt"] and unit.get("models") \
                and isinstance(unit.get("outputs"), list):
            for output in unit["outputs"]:
                if isinstance(output, str):
                    out[output] = str(unit.get("name"))
    return out


def _reference(cache: "Cache", manifest: "Manifest", outputs: dict[str, str]) -> dict[str, TensorInfo]:
    """The tensors of the cache's first entry under the prompt units' outputs (`output`, or `output@unit` in
    versioned mode), read from its header alone; whatever cannot be read is left out (the entry's own checks
    report a damaged entry)."""
    samples = manifest.samples
    record = manifest.entries.get(samples[0].get("key")) if samples else None
    if record is None:
        return {}
    try:
        header = cache.entry_header(record)
        values = json.loads((header.get("__metadata__") or {}).get("unitgraph", "{}")).get("values") or {}
        out = {}
        for output, unit in outputs.items():
            value = values.get(output, values.get(f"{output}@{unit}"))
            if isinstance(value, dict) and set(value) == {"__tensor__"}:
                info = header.get(value["__tensor__"])
                shape = info.get("shape") if isinstance(info, dict) else None
                if isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                    out[output] = TensorInfo(str(info.get("dtype")), tuple(shape), 0, 0)
        return out
    except (OSError, ValueError, AttributeError, TypeError, KeyError, BackendError):
        return {}


def _leading_part_of(output: str, reference: dict[str, TensorInfo]) -> Optional[str]:
    """The output whose shape `output`'s shape is the leading part of (a mask over embeddings), if any."""
    shape = reference[output].shape
    for other, info in sorted(reference.items()):
        if other != output and len(shape) >= 1 and info.shape[:-1] == shape:
            return other
    return None


def check_against_cache(encoded: EncodedPrompts, cache: "Cache", manifest: "Manifest", source: str,
                        kind: PromptFile = VALIDATION) -> None:
    """Each prompt holds exactly the outputs of the cache's prompt units, each as the denoiser reads it from the
    cache's entries: the same dtype (floating ones in the dtype stage 1 computed in), rank and batch size, the
    same feature size, a mask as long as its embeddings."""
    outputs = _prompt_outputs(manifest)
    if outputs and set(encoded.values[0]) != set(outputs):
        raise BackendError(f"the {kind.what} hold {', '.join(sorted(encoded.values[0]))}, the cache's "
                           f"prompt units give {', '.join(sorted(outputs))}; {kind.hint}", source=source)
    reference = _reference(cache, manifest, outputs)
    settings = manifest.key_inputs.get("settings")
    compute = settings.get("dtype") if isinstance(settings, dict) else None
    compute = dtype_code(compute) if isinstance(compute, str) else None
    for index, values in enumerate(encoded.values):
        label = f"the {kind.one} {index} ({encoded.prompts[index][:40]!r})"
        for output, info in sorted(values.items()):
            ref = reference.get(output)
            if info is None or ref is None:
                continue
            if ref.floating:
                ok = info.floating and (compute is None or info.dtype == compute)
                wanted = (TensorInfo(compute, (), 0, 0).torch_name if compute else "floating")
            else:
                ok, wanted = info.dtype == ref.dtype, ref.torch_name
            if not ok:
                raise BackendError(f"{label} has {output} of dtype {info.torch_name}, the cache's entries {wanted}; "
                                   f"{kind.hint}", source=source)
            problem = None
            if len(info.shape) != len(ref.shape) or (ref.shape and info.shape[0] != ref.shape[0]):
                problem = f"{len(ref.shape)}-D with a batch of {ref.shape[0] if ref.shape else 1}"
            else:
                owner = _leading_part_of(output, reference)
                if owner is not None:
                    theirs = values.get(owner)
                    if theirs is not None and info.shape != theirs.shape[:-1]:
                        problem = f"the leading part of {owner}'s {list(theirs.shape)}"
                elif len(ref.shape) >= 2 and info.shape[-1] != ref.shape[-1]:
                    problem = f"of size {ref.shape[-1]} in its last dimension"
            if problem is not None:
                raise BackendError(f"{label} has {output} of shape {list(info.shape)}, which the denoiser cannot read "
                                   f"(in the cache's entries: {list(ref.shape)}, so {problem}); {kind.hint}", source=source)


def validation_problem(cache: "Cache", manifest: "Manifest", kind: PromptFile = VALIDATION) -> Optional[str]:
    """What `cache verify` says of one file of encoded prompts beside the cache (validation.safetensors by
    default): None when it has none or it is sound."""
    if cache.store.size(kind.name) is None:
        return None
    shown = cache.describe(kind.name)
    try:
        data = cache.store.read(kind.name)
    except OSError as exc:
        return f"{shown}: unreadable ({getattr(exc, 'strerror', None) or exc})"
    try:
        encoded = read_encoded(data, shown, kind)
        if encoded.key == prompts_key(encoded.prompts, manifest.key_inputs_hash):  # else stale: stage 1 replaces it
            check_against_cache(encoded, cache, manifest, shown, kind)
    except BackendError as exc:
        return exc.one_line()
    return None

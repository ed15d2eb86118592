"""The stage-1 cache: one safetensors file per sample, plus manifest.json.

Layout of a cache folder:

    manifest.json                 format, status, plan (and its fingerprint), settings + their hash,
                                  the entry keys and the list of samples (index, sample_id, file)
    entries/<sample_id>.safetensors

An entry file holds the sample's cached values under their entry keys (`param` in latest mode,
`param@writer` in versioned mode). Tensors are safetensors tensors; everything else (None, ints,
strings, lists, tuples) is JSON in the safetensors header (key `unitgraph`), where a tensor nested
in a list is a reference to a stored tensor. Never pickle. Every file is written atomically, so an
interrupted stage 1 leaves whole entries only; a manifest that says `complete` is written last.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch

from unitgraph.atomic import write_bytes_atomic, write_text_atomic

from .args import BackendError

FORMAT = "unitgraph.cache/v1"
MANIFEST = "manifest.json"
ENTRIES = "entries"
HEADER_KEY = "unitgraph"
_LARGE_FILE = 256 * 1024 * 1024  # files above this are identified by size and mtime, not content


# ------------------------------------------------------------------------------------------------
# values <-> safetensors + JSON


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().to("cpu").contiguous().clone()
        return {"__tensor__": path}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _is_pil(value):  # a raw dataset image: stored as uint8 pixels, restored as a PIL image
        import numpy as np

        tensors[path] = torch.from_numpy(np.asarray(value.convert("RGB"), dtype=np.uint8).copy())
        return {"__image__": path}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if {"__tensor__", "__tuple__", "__image__"} & set(value):
            raise TypeError(f"cannot cache a dict with reserved key at {path}")
        return {k: _encode(v, tensors, f"{path}.{k}") for k, v in value.items()}
    raise TypeError(f"cannot cache a value of type {type(value).__name__} at {path} (tensors, JSON values, lists, tuples)")


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
        if set(value) == {"__image__"}:
            from PIL import Image

            return Image.fromarray(tensors[value["__image__"]].numpy())
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def entry_bytes(values: dict[str, Any], meta: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    encoded = {key: _encode(value, tensors, key) for key, value in values.items()}
    header = json.dumps({"meta": meta, "values": encoded}, sort_keys=True)
    return save(tensors, metadata={HEADER_KEY: header})


def write_entry(path: str | Path, values: dict[str, Any], meta: dict[str, Any]) -> None:
    write_bytes_atomic(path, entry_bytes(values, meta))


def read_entry(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values by entry key, meta) of one entry file."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            header = (handle.metadata() or {}).get(HEADER_KEY)
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except FileNotFoundError:
        raise BackendError("cache entry is missing; run the data_process stage again", source=str(path)) from None
    except Exception as exc:
        raise BackendError(f"unreadable cache entry ({type(exc).__name__}: {exc})", source=str(path)) from None
    if header is None:
        raise BackendError("not a unitgraph cache entry (no header)", source=str(path))
    data = json.loads(header)
    return _decode(data["values"], tensors), data["meta"]


# ------------------------------------------------------------------------------------------------
# settings hash


def file_digest(path: Path) -> str:
    stat = path.stat()
    if stat.st_size > _LARGE_FILE:
        return f"size={stat.st_size};mtime={stat.st_mtime_ns}"
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def settings_hash(settings: dict[str, Any]) -> str:
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------------------------
# the cache folder


class Cache:
    """A cache folder for one plan and one set of stage-1 settings."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST

    def entry_path(self, sample_id: str) -> Path:
        return self.folder / ENTRIES / f"{sample_id}.safetensors"

    def read_manifest(self) -> dict[str, Any] | None:
        if not self.manifest_path.is_file():
            return None
        try:
            data = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise BackendError(f"unreadable cache manifest: {exc}", source=str(self.manifest_path)) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BackendError(f"not a unitgraph cache manifest (expected format {FORMAT})", source=str(self.manifest_path))
        return data

    def matches(self, manifest: dict[str, Any] | None, fingerprint: str, settings_digest: str) -> bool:
        return bool(manifest) and manifest.get("plan_fingerprint") == fingerprint and manifest.get("settings_hash") == settings_digest

    def begin(self, plan: Any, settings: dict[str, Any], settings_digest: str) -> bool:
        """Prepare for stage 1 (main process). Returns True when existing entries are kept (same plan and settings)."""
        manifest = self.read_manifest()
        keep = self.matches(manifest, plan.fingerprint, settings_digest)
        if not keep:
            if (self.folder / ENTRIES).is_dir():
                shutil.rmtree(self.folder / ENTRIES)
        (self.folder / ENTRIES).mkdir(parents=True, exist_ok=True)
        self._write_manifest(plan, settings, settings_digest, status="filling", samples=None)
        return keep

    def finish(self, plan: Any, settings: dict[str, Any], settings_digest: str, samples: list[dict[str, Any]]) -> None:
        missing = [s for s in samples if not self.entry_path(s["sample_id"]).is_file()]
        if missing:
            raise RuntimeError(f"stage 1 left {len(missing)} samples without a cache entry (e.g. index {missing[0]['index']})")
        self._write_manifest(plan, settings, settings_digest, status="complete", samples=samples)

    def _write_manifest(self, plan: Any, settings: dict[str, Any], settings_digest: str, status: str,
                        samples: list[dict[str, Any]] | None) -> None:
        from unitgraph.runtime import cache_keys

        manifest = {
            "format": FORMAT,
            "status": status,
            "pipeline": plan.pipeline,
            "plan_fingerprint": plan.fingerprint,
            "cache_mode": plan.cache_mode,
            "keys": cache_keys(plan),
            "settings_hash": settings_digest,
            "settings": settings,
            "plan": plan.to_dict(),
            "num_samples": None if samples is None else len(samples),
            "samples": samples,
        }
        write_text_atomic(self.manifest_path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    def is_complete_for(self, fingerprint: str, settings_digest: str, sample_ids: Iterable[str]) -> bool:
        manifest = self.read_manifest()
        if not self.matches(manifest, fingerprint, settings_digest) or manifest.get("status") != "complete":
            return False
        listed = {s["sample_id"] for s in manifest.get("samples") or []}
        ids = list(sample_ids)
        return listed == set(ids) and all(self.entry_path(i).is_file() for i in ids)

    def open_for_training(self, plan: Any) -> dict[str, Any]:
        """The manifest of a complete cache made under `plan`; a one-line BackendError otherwise."""
        if not self.folder.is_dir():
            raise BackendError("cache folder does not exist (run the data_process stage first)", source=str(self.folder))
        manifest = self.read_manifest()
        if manifest is None:
            raise BackendError("no manifest.json: not a cache folder (run the data_process stage first)", source=str(self.folder))
        if manifest.get("status") != "complete":
            raise BackendError("cache is incomplete (its data_process stage did not finish)", source=str(self.folder))
        if manifest.get("plan_fingerprint") != plan.fingerprint:
            theirs = manifest.get("plan", {})
            raise BackendError(
                "cache was made under another plan "
                f"(cache: {manifest.get('pipeline')}, backward {theirs.get('models_require_backward')}, {manifest.get('cache_mode')}; "
                f"now: {plan.pipeline}, backward {plan.models_require_backward}, {plan.cache_mode}); "
                "run data_process again with the same --trainable_models/--lora_base_model/--cache_mode",
                source=str(self.folder))
        return manifest


def model_files_digest(files_by_slot: dict[str, list[Path]]) -> dict[str, dict[str, str]]:
    """{slot: {parent/name: digest}}: what the stage-1 models are, independent of where they live."""
    return {slot: {f"{p.parent.name}/{p.name}": file_digest(p) for p in files} for slot, files in sorted(files_by_slot.items())}

"""Checking and describing a finished cache: what `unitgraph cache verify` and `unitgraph cache info` print.

No torch is needed: entries are checked by size and sha256, and described from their safetensors headers; the
encoded validation prompts beside a cache (validation.safetensors) by their own checksum and against the
entries (encoded_prompts.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..errors import BackendError
from .cache import Cache, sample_label
from .encoded_prompts import EMPTY_PROMPT, VALIDATION, validation_problem
from .entries import header_key_sizes
from .manifest import Manifest


def open_cache(location: str | Path) -> tuple[Cache, Manifest]:
    cache = Cache(location)
    if cache.local and not cache.folder.is_dir():
        raise BackendError("no such cache folder", source=cache.location)
    manifest = cache.read_manifest()
    if manifest is None:
        raise BackendError("no manifest.json: not a cache folder" if cache.local
                           else "no manifest.json under this prefix: not a cache", source=cache.location)
    return cache, manifest


def verify_cache(location: str | Path) -> tuple[list[str], dict[str, Any]]:
    """Check every entry a cache's manifest lists (size and sha256), and the encoded validation prompts beside it
    (their checksum and shapes). Returns (problems, statistics)."""
    start = time.perf_counter()
    cache, manifest = open_cache(location)
    records, samples = manifest.entries, manifest.samples + (manifest.held_out or [])  # held-out entries are checked too
    problems: list[str] = []
    unrecorded = [s for s in samples if s.get("key") not in records]
    if not manifest.complete:
        problems.append(f"{cache.location}: cache is incomplete ({len(unrecorded)} of {len(samples)} samples have no entry "
                        "yet: its data_process stage did not finish); run it again to complete the cache")
    else:
        for s in unrecorded:
            problems.append(f"{cache.manifest_path}: {sample_label(s)} has no entry record")
    keys = sorted({s["key"] for s in samples if s.get("key") in records})
    results = dict(zip(keys, cache.check_entries([records[k] for k in keys])))
    total = sum(int(records[k]["size"]) for k, problem in results.items() if problem is None)
    for s in samples:
        record = records.get(s.get("key"))
        if record is not None and results[record["key"]] is not None:
            problems.append(f"{cache.describe(record['file'])}: {sample_label(s)}: {results[record['key']]}")
    for kind in (VALIDATION, EMPTY_PROMPT):  # the encoded prompts beside the entries
        problem = validation_problem(cache, manifest, kind)
        if problem is not None:
            problems.append(problem)
    stats = {"samples": len(samples), "entries": len(results), "bytes": total,
             "seconds": time.perf_counter() - start, "skipped": len(manifest.skipped)}
    return problems, stats


def cache_info(location: str | Path) -> dict[str, Any]:
    """What `unitgraph cache info` prints: samples, bytes (per entry key too), plan, models, settings."""
    cache, manifest = open_cache(location)
    records, samples, plan = manifest.entries, manifest.samples, manifest.plan
    key_sizes: dict[str, dict[str, int]] = {}
    for key, record in records.items():
        try:
            key_sizes[key] = header_key_sizes(cache.entry_header(record), cache.describe(record["file"]))
        except (OSError, BackendError, ValueError, KeyError):
            key_sizes[key] = {}
    per_key: dict[str, int] = {}
    for s in samples:
        for name, size in key_sizes.get(s.get("key"), {}).items():
            per_key[name] = per_key.get(name, 0) + size
    n = max(1, len(samples))
    total = sum(int(r["size"]) for r in records.values())
    return {
        "folder": cache.location,
        "format": manifest.format,
        "layout": manifest.layout,
        "status": manifest.status,
        "pipeline": manifest.pipeline,
        "plan_fingerprint": manifest.plan_fingerprint,
        "cache_mode": manifest.cache_mode,
        "models_require_backward": plan.get("models_require_backward"),
        "data_process": plan.get("data_process"),
        "train": plan.get("train"),
        "samples": len(samples),
        "skipped": manifest.skipped,
        "entries": len(records),
        "bytes": total,
        "bytes_per_sample": total / n if samples else 0,
        "bytes_per_sample_by_key": {k: per_key.get(k, 0) / n for k in (manifest.keys or sorted(per_key))},
        "models": manifest.model_digests,
        "settings": manifest.settings,
        "made_with": manifest.made_with,
        "unsafe_files": cache.unsafe_files(),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover

"""The plan as data: a split written down as JSON (docs/plan-format.md, 'Plan'), read back strictly,
fingerprinted.

This is what a plan *is*, apart from how one is made: the verifier checks a Plan against its
pipeline and needs only this module, while making a plan (plan.py) ends by verifying it. With the
record here, plan.py imports soundness.py and soundness.py imports this, and neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .closure import LATEST, VERSIONED
from .errors import PlanFileError
from .prune import prune
from .spec import Pipeline
from .userfiles import read_user_json

FORMAT = "unitgraph.plan/v1"


@dataclass
class Plan:
    """A split of one pipeline for one set of models that need backward.

    Cache entries are (param, writer unit name or None for the dataset value).

    `data_process_configs` and `train_configs`: the models whose config (config.json) a stage's
    units read but whose weights that stage does not load, sorted; the stage reads only their
    configs. Empty for pipelines without `configs`, whose plan files then have no such key.
    """

    pipeline: str
    models_require_backward: list[str]
    cache_mode: str
    data_process_units: list[str]
    data_process_models: list[str]
    train_units: list[str]
    train_models: list[str]
    cache_entries: list[tuple[str, str | None]]
    fingerprint: str
    checks: dict[str, bool | None] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    reason_details: dict[str, dict] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # keys of newer formats, kept on round trips
    declared_cache_params: list[str] | None = None  # `cache.params` as read from a file, checked by verify
    data_process_configs: list[str] = field(default_factory=list)  # configs read in stage 1, weights not loaded
    train_configs: list[str] = field(default_factory=list)  # configs read in stage 2, weights not loaded
    # what verify found when split() made this plan (empty for a sound one); not part of the file
    violations: list[str] = field(default_factory=list, compare=False, repr=False)

    @property
    def cache_params(self) -> list[str]:
        return sorted({p for p, _ in self.cache_entries})

    @property
    def checks_pass(self) -> bool:
        return all(v is not False for v in self.checks.values())

    def stage_of(self, unit_name: str) -> str:
        return "train" if unit_name in self.train_units else "data_process"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": FORMAT,
            "pipeline": self.pipeline,
            "models_require_backward": sorted(self.models_require_backward),
            "data_process": _stage_dict(self.data_process_units, self.data_process_models, self.data_process_configs),
            "train": _stage_dict(self.train_units, self.train_models, self.train_configs),
            "cache_mode": self.cache_mode,
            "cache": {
                "params": self.cache_params,
                "entries": [{"param": p, "writer": w} for p, w in self.cache_entries],
            },
            "checks": dict(self.checks),
            "reasons": dict(self.reasons),
            "reason_details": dict(self.reason_details),
            "fingerprint": self.fingerprint,
        }
        for key, value in self.extra.items():
            data.setdefault(key, value)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str = "<plan>") -> "Plan":
        """Read a plan strictly enough that a malformed file is one clear error, not a crash later."""
        reader = _PlanReader(data, source)
        return reader.plan()


def _stage_dict(units: list[str], models: list[str], configs: list[str]) -> dict[str, Any]:
    """One stage's section; `configs` only when the stage reads some, so plans without any stay as they were."""
    data: dict[str, Any] = {"units": list(units), "models": sorted(models)}
    if configs:
        data["configs"] = sorted(configs)
    return data


def fingerprint(pipeline: Pipeline, backward: Iterable[str], cache_mode: str) -> str:
    """sha256 of the canonical spec, B, the cache mode and the format: what a cache was made under.

    Units' `configs` enter through the canonical spec, and only for units that have some
    (spec.Pipeline.canonical_dict): a pipeline without configs keeps the fingerprint it always had.
    """
    header = json.dumps(
        {"format": FORMAT, "models_require_backward": sorted(set(backward)), "cache_mode": cache_mode},
        sort_keys=True, separators=(",", ":"),
    )
    # the hash of f'{header[:-1]},"spec":{canonical_json}}}', fed in pieces: no copy of a big spec's text
    digest = hashlib.sha256(f'{header[:-1]},"spec":'.encode("utf-8"))
    digest.update(pipeline.canonical_json.encode("utf-8"))
    digest.update(b"}")
    return "sha256:" + digest.hexdigest()


def active_pipeline(pipeline: Pipeline, plan: Plan) -> Pipeline:
    """The pipeline a plan was made for: pruned by the `provided` params it records, if any."""
    provided = plan.extra.get("provided")
    return prune(pipeline, provided)[0] if provided is not None else pipeline


def read_plan_file(path: str | Path) -> Plan:
    """A plan file read back strictly: any problem, from an unreadable file to a bad field, is one PlanFileError."""
    return Plan.from_dict(read_user_json(path, PlanFileError, "a plan file"), source=str(path))


class _PlanReader:
    """Field-by-field reading of a plan dict with errors that name the field."""

    def __init__(self, data: Any, source: str):
        if not isinstance(data, dict):
            raise PlanFileError("a plan must be a JSON object", source=source)
        self.data = data
        self.source = source

    def fail(self, message: str) -> PlanFileError:
        return PlanFileError(message, source=self.source)

    def get(self, key: str, kind: type, container: dict | None = None, where: str = "") -> Any:
        container = self.data if container is None else container
        if key not in container:
            raise self.fail(f"missing key '{where}{key}'")
        value = container[key]
        if not isinstance(value, kind):
            raise self.fail(f"'{where}{key}' must be {kind.__name__}, got {type(value).__name__}")
        return value

    def strings(self, key: str, container: dict | None = None, where: str = "") -> list[str]:
        values = self.get(key, list, container, where)
        if not all(isinstance(v, str) for v in values):
            raise self.fail(f"'{where}{key}' must be a list of strings")
        return list(values)

    def optional_strings(self, key: str, container: dict, where: str) -> list[str]:
        """A list of strings that may be missing (empty then), e.g. a stage's `configs`."""
        if key not in container:
            return []
        return self.strings(key, container, where)

    def plan(self) -> Plan:
        fmt = self.get("format", str)
        if fmt != FORMAT:
            raise self.fail(f"unsupported plan format {fmt!r} (this unitgraph reads {FORMAT})")
        dp = self.get("data_process", dict)
        tr = self.get("train", dict)
        cache = self.get("cache", dict)
        mode = self.get("cache_mode", str)
        if mode not in (LATEST, VERSIONED):
            raise self.fail(f"'cache_mode' must be latest or versioned, got {mode!r}")
        entries = []
        for k, entry in enumerate(self.get("entries", list, cache, "cache.")):
            if not isinstance(entry, dict) or set(entry) != {"param", "writer"}:
                raise self.fail(f"'cache.entries[{k}]' must be an object with keys param and writer")
            if not isinstance(entry["param"], str) or not (entry["writer"] is None or isinstance(entry["writer"], str)):
                raise self.fail(f"'cache.entries[{k}]' needs a string param and a string or null writer")
            entries.append((entry["param"], entry["writer"]))
        checks = self.data.get("checks", {})
        reasons = self.data.get("reasons", {})
        details = self.data.get("reason_details", {})
        for key, value in (("checks", checks), ("reasons", reasons), ("reason_details", details)):
            if not isinstance(value, dict):
                raise self.fail(f"'{key}' must be an object")
        provided = self.data.get("provided")
        if provided is not None and not (isinstance(provided, list) and all(isinstance(p, str) for p in provided)):
            raise self.fail("'provided' must be a list of strings")
        known = {"format", "pipeline", "models_require_backward", "data_process", "train", "cache_mode",
                 "cache", "checks", "reasons", "reason_details", "fingerprint"}
        return Plan(
            pipeline=self.get("pipeline", str),
            models_require_backward=self.strings("models_require_backward"),
            cache_mode=mode,
            data_process_units=self.strings("units", dp, "data_process."),
            data_process_models=self.strings("models", dp, "data_process."),
            train_units=self.strings("units", tr, "train."),
            train_models=self.strings("models", tr, "train."),
            cache_entries=entries,
            declared_cache_params=self.strings("params", cache, "cache."),
            data_process_configs=self.optional_strings("configs", dp, "data_process."),
            train_configs=self.optional_strings("configs", tr, "train."),
            fingerprint=self.get("fingerprint", str),
            checks=dict(checks),
            reasons=dict(reasons),
            reason_details=dict(details),
            extra={k: v for k, v in self.data.items() if k not in known},
        )

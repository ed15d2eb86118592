"""A cache folder's manifest.json as a typed object, checked against its schema before use.

The manifest records what a cache is (the plan, what every entry key was derived from, the
arguments stage 1 ran with) and what it holds (the samples, one record per entry, the skipped
samples, and while filling the pending work). `Manifest.from_dict` checks the shape of every field
it reads, so a hand-edited or damaged manifest is one line naming the file and the field, never a
traceback deep inside stage 2 or `cache verify`. No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..errors import BackendError

FORMAT = "unitgraph.cache/v2"
ENTRY_FIELDS = ("key", "file", "size", "sha256")  # and "offset" for an entry packed in a shard
LAYOUTS = ("files", "shards")


@dataclass
class Manifest:
    status: str  # "filling" or "complete"
    pipeline: str
    plan_fingerprint: str
    cache_mode: str
    keys: list[str]  # the entry keys every entry holds
    plan: dict[str, Any]
    key_inputs: dict[str, Any]  # what every entry key was derived from (see stage1.key_inputs)
    key_inputs_hash: str
    settings: dict[str, Any]
    settings_hash: str
    made_with: dict[str, Any]  # the arguments stage 1 ran with: what `cache repair` re-runs
    num_samples: int
    samples: list[dict[str, Any]]  # {"index", "sample_id", "key"}
    entries: dict[str, dict[str, Any]]  # key -> {"key", "file", "size", "sha256"}
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {"index", "reason"}
    pending: Optional[list[dict[str, Any]]] = None  # while filling: {"key", "index", "sample_id"}
    layout: str = "files"  # how new entries are written: a file each, or packed in per-process shards
    # --dataset_config: the datasets as stage 1 was given them (DatasetSpec.record()), in order; each sample record
    # then names its "dataset" and "row". None (absent from the file) for the run's one dataset
    datasets: Optional[list[dict[str, Any]]] = None
    # --validation_dataset: its samples' records ({index, sample_id, key, dataset, row}), cached and never trained
    held_out: Optional[list[dict[str, Any]]] = None
    format: str = FORMAT

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def key_settings(self) -> dict[str, Any]:
        return dict(self.key_inputs.get("settings") or {})

    @property
    def model_digests(self) -> dict[str, Any]:
        return dict(self.key_inputs.get("models") or {})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["pending"] is None:
            del data["pending"]
        if data["layout"] == "files":  # the manifests of one-file-per-entry caches stay as they were
            del data["layout"]
        if data["datasets"] is None:  # and those of one dataset
            del data["datasets"]
        if data["held_out"] is None:  # and those without held-out samples
            del data["held_out"]
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str) -> "Manifest":
        """The manifest in `data`; a BackendError naming `source` and the first field of the wrong shape."""
        if not isinstance(data, dict):
            raise BackendError("not a unitgraph cache manifest (not a JSON object)", source=source)
        fmt = data.get("format")
        if fmt != FORMAT:
            if isinstance(fmt, str) and fmt.startswith("unitgraph.cache/"):
                raise BackendError(f"cache format {fmt} is not {FORMAT} (made by another unitgraph version); "
                                   "delete the folder or choose another cache folder", source=source)
            raise BackendError(f"not a unitgraph cache manifest (expected format {FORMAT})", source=source)

        def need(name: str, kind: Any, default: Any = ...) -> Any:
            if name not in data:
                if default is ...:
                    raise BackendError(f"damaged cache manifest: no field {name!r}", source=source)
                return default
            value = data[name]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
                raise BackendError(f"damaged cache manifest: field {name!r} is not {_kind_name(kind)}", source=source)
            return value

        samples = need("samples", list)
        for n, sample in enumerate(samples):
            if not (isinstance(sample, dict) and isinstance(sample.get("index"), int) and isinstance(sample.get("key"), str)
                    and isinstance(sample.get("sample_id"), str)):
                raise BackendError(f"damaged cache manifest: samples[{n}] is not {{index, sample_id, key}}", source=source)
        entries = need("entries", dict)
        for key, record in entries.items():
            if not (isinstance(record, dict) and all(f in record for f in ENTRY_FIELDS)
                    and isinstance(record["file"], str) and isinstance(record["size"], int)
                    and isinstance(record["sha256"], str) and record["key"] == key):
                raise BackendError(f"damaged cache manifest: the record of entry {key[:16]} is not "
                                   "{key, file, size, sha256}", source=source)
            if record["file"].startswith(("/", "..")) or ".." in record["file"].split("/"):
                raise BackendError(f"damaged cache manifest: entry file {record['file']!r} is outside the cache", source=source)
            offset = record.get("offset", 0)
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise BackendError(f"damaged cache manifest: the offset of entry {key[:16]} is not a byte position",
                                   source=source)
        skipped = need("skipped", list, [])
        for n, item in enumerate(skipped):
            if not (isinstance(item, dict) and isinstance(item.get("index"), int)):
                raise BackendError(f"damaged cache manifest: skipped[{n}] is not {{index, reason}}", source=source)
        pending = need("pending", list, None)
        held_out = need("held_out", list, None)
        for n, sample in enumerate(held_out or []):
            if not (isinstance(sample, dict) and isinstance(sample.get("index"), int) and isinstance(sample.get("key"), str)
                    and isinstance(sample.get("sample_id"), str)):
                raise BackendError(f"damaged cache manifest: held_out[{n}] is not {{index, sample_id, key}}", source=source)
        datasets = need("datasets", list, None)
        for n, spec in enumerate(datasets or []):
            if not (isinstance(spec, dict) and isinstance(spec.get("name"), str)):
                raise BackendError(f"damaged cache manifest: datasets[{n}] is not a dataset record", source=source)
        if datasets is not None:
            names = {spec["name"] for spec in datasets}
            for n, sample in enumerate(samples):
                if sample.get("dataset") not in names:
                    raise BackendError(f"damaged cache manifest: samples[{n}] names no dataset of the cache",
                                       source=source)
        status = need("status", str)
        layout = need("layout", str, "files")
        if layout not in LAYOUTS:
            raise BackendError(f"damaged cache manifest: layout {layout!r} is neither files nor shards", source=source)
        if status not in ("filling", "complete"):
            raise BackendError(f"damaged cache manifest: status {status!r} is neither filling nor complete", source=source)
        return cls(status=status, pipeline=need("pipeline", str), plan_fingerprint=need("plan_fingerprint", str),
                   cache_mode=need("cache_mode", str), keys=list(need("keys", list, [])), plan=need("plan", dict),
                   key_inputs=need("key_inputs", dict), key_inputs_hash=need("key_inputs_hash", str, ""),
                   settings=need("settings", dict, {}), settings_hash=need("settings_hash", str, ""),
                   made_with=need("made_with", dict, {}), num_samples=need("num_samples", int, len(samples)),
                   samples=samples, entries=entries, skipped=skipped, pending=pending, layout=layout,
                   datasets=datasets, held_out=held_out)


def _kind_name(kind: Any) -> str:
    return {list: "a list", dict: "an object", str: "a string", int: "an integer"}.get(kind, str(kind))


def describe_plan_change(manifest: Manifest, plan: Any) -> str:
    """What differs between the plan a cache was made under and this run's: the pipeline, the trained models, the
    cache mode, and the units only one of them has (a --caption_dropout or --vae_latents unit, say)."""
    theirs = manifest.plan
    text = (f"cache: {manifest.pipeline}, backward {theirs.get('models_require_backward')}, {manifest.cache_mode}; "
            f"now: {plan.pipeline}, backward {plan.models_require_backward}, {plan.cache_mode}")
    units = [(theirs.get(stage) or {}).get("units") if isinstance(theirs.get(stage), dict) else None
             for stage in ("data_process", "train")]
    if all(isinstance(u, list) for u in units):
        before = set(units[0]) | set(units[1])
        now = set(plan.data_process_units) | set(plan.train_units)
        added, gone = sorted(now - before), sorted(before - now)
        if added:
            text += f"; units only this run has: {', '.join(map(str, added))}"
        if gone:
            text += f"; units only the cache's plan has: {', '.join(map(str, gone))}"
    return text

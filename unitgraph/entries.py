"""Cache entries and stage-2 input bindings of a split (DESIGN §3, cache modes).

A cache entry is (param, writer position or None for the dataset value). In `latest` mode stage 1
keeps each param's last stage-1 value, so the entry of a param is its last data_process writer;
in `versioned` mode each needed version is its own entry, snapshotted right after its writer.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable

from .closure import LATEST
from .graph import VersionGraph

Entry = tuple[str, "int | None"]


def needed_versions(vg: VersionGraph, train: set[int]) -> set[Entry]:
    """Every version stage 2 must get from the cache: TRAIN reads and sink reads whose writer is not in TRAIN."""
    needed: set[Entry] = set()
    for t in sorted(train):
        for p, writer in vg.reaching[t].items():
            if writer is None or writer not in train:
                needed.add((p, writer))
    for read in vg.sink_reads():
        if read.writer is None or read.writer not in train:
            needed.add((read.param, read.writer))
    return needed


def last_stage1_writer(vg: VersionGraph, train: set[int], param: str) -> int | None:
    """The last data_process unit that writes `param` (None: the dataset value survives stage 1)."""
    for w in reversed(vg.writers.get(param, [])):
        if w not in train:
            return w
    return None


def cache_entries(vg: VersionGraph, train: set[int], cache_mode: str) -> list[Entry]:
    """The entries a plan stores, sorted by param then writer position (dataset first)."""
    needed = needed_versions(vg, train)
    if cache_mode == LATEST:
        params = {p for p, _ in needed}
        entries = {(p, last_stage1_writer(vg, train, p)) for p in params}
    else:
        entries = needed
    return sorted(entries, key=entry_sort_key)


def entry_sort_key(entry: Entry) -> tuple[str, int]:
    param, writer = entry
    return (param, -1 if writer is None else writer)


def bind_inputs(
    vg: VersionGraph, train: Iterable[int], entries: Iterable[Entry], cache_mode: str
) -> dict[tuple[int, str], tuple[str, int | None]]:
    """Where stage 2 takes each input of each TRAIN unit and of the sink (position len(units)).

    Returns {(reader, param): (source, writer)} with source "live" (the output of an earlier TRAIN
    unit), "cache" (an entry), or "missing". In `latest` mode the live state starts as the cache;
    in `versioned` mode a read takes the newest version available before the reader, live or
    cached. This is the rule the backend executes, so the verifier simulates exactly it.
    """
    train_order = sorted(set(train))
    by_param: dict[str, list[int]] = {}  # versioned: cached writer positions per param, sorted (-1 = dataset)
    latest_cache: dict[str, int | None] = {}
    for p, w in entries:
        if cache_mode == LATEST:
            latest_cache[p] = w
        else:
            by_param.setdefault(p, []).append(-1 if w is None else w)
    for positions in by_param.values():
        positions.sort()

    bindings: dict[tuple[int, str], tuple[str, int | None]] = {}
    live: dict[str, int] = {}

    def lookup(reader: int, p: str) -> tuple[str, int | None]:
        live_writer = live.get(p)
        if cache_mode == LATEST:
            if live_writer is not None:
                return ("live", live_writer)
            if p in latest_cache:
                return ("cache", latest_cache[p])
            return ("missing", None)
        cached = by_param.get(p, [])
        k = bisect_left(cached, reader) - 1
        cached_writer = cached[k] if k >= 0 else None
        if live_writer is not None and (cached_writer is None or live_writer > cached_writer):
            return ("live", live_writer)
        if cached_writer is not None:
            return ("cache", None if cached_writer == -1 else cached_writer)
        return ("missing", None)

    for t in train_order:
        unit = vg.pipeline.units[t]
        for p in dict.fromkeys(unit.inputs):
            bindings[(t, p)] = lookup(t, p)
        for p in unit.outputs:
            live[p] = t
    sink = vg.n
    for p in vg.sink_inputs():
        bindings[(sink, p)] = lookup(sink, p)
    return bindings

"""Cache entries and stage-2 input bindings of a split (docs/semantics.md, 'What the stages do' and
'Cache mode `versioned`').

A cache entry is (param, writer position or None for the dataset value). In `latest` mode stage 1
keeps each param's last stage-1 value, so the entry of a param is its last data_process writer;
in `versioned` mode each needed version is its own entry, snapshotted right after its writer.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable, Iterator

from .closure import LATEST
from .graph import VersionGraph

Entry = tuple[str, "int | None"]


def needed_versions(vg: VersionGraph, train: set[int]) -> set[Entry]:
    """Every version stage 2 must get from the cache: TRAIN reads and sink reads whose writer is not in TRAIN."""
    needed: set[Entry] = set()
    add = needed.add
    reaching = vg.reaching
    for t in train:  # a set is built: the order of the visits does not matter
        for p, writer in reaching[t].items():
            if writer is None or writer not in train:
                add((p, writer))
    for p, writer in zip(vg._sink_inputs, vg._sink_writers):  # vg.sink_reads() without a Read object each
        if writer is None or writer not in train:
            add((p, writer))
    return needed


def needed_versions_ordered(vg: VersionGraph, train: set[int]) -> dict[Entry, None]:
    """`needed_versions` as a dict (an insertion-ordered set), in the order the reads come: TRAIN
    units in pipeline order, then the sink.

    The same pairs, only found in order: `sort_entries` then sorts a list already in pipeline order,
    which on big pipelines takes about half the time of a set's hash order (strings made in that
    order, compared in it). TRAIN membership is a byte per unit (`train_flags`) instead of a set probe.
    The last result is kept with the graph, for the same TRAIN, as `latest_entries` does: `split`
    computes the entries of its plan, then the verifier computes them again from the plan's TRAIN.
    """
    key = frozenset(train)
    memo = vg.__dict__.get("_needed_versions_memo")
    if memo is not None and memo[0] == key:
        return dict(memo[1])
    flags = train_flags(vg, train)
    needed: dict[Entry, None] = {}
    reaching = vg.reaching
    for t in sorted(train):
        for p, writer in reaching[t].items():
            if writer is None or not flags[writer]:
                needed[(p, writer)] = None
    for p, writer in zip(vg._sink_inputs, vg._sink_writers):
        if writer is None or not flags[writer]:
            needed[(p, writer)] = None
    vg.__dict__["_needed_versions_memo"] = (key, needed)
    return dict(needed)


def needed_params(vg: VersionGraph, train: set[int]) -> dict[str, None]:
    """The params of `needed_versions`, without building a pair for each version (latest mode keeps
    one entry per param, so the params are all it needs).

    A dict used as an ordered set, in the order of `needed_versions_ordered` (TRAIN units in pipeline
    order, then the sink), for the same reason: sorting it is faster than sorting a set.
    """
    flags = train_flags(vg, train)
    needed: dict[str, None] = {}
    reaching = vg.reaching
    for t in sorted(train):
        for p, writer in reaching[t].items():
            if writer is None or not flags[writer]:
                needed[p] = None
    for p, writer in zip(vg._sink_inputs, vg._sink_writers):
        if writer is None or not flags[writer]:
            needed[p] = None
    return needed


def train_flags(vg: VersionGraph, train: Iterable[int]) -> bytearray:
    """A byte per unit position, 1 for TRAIN: `flags[w]` is `w in train`, a look-up into n bytes
    (which stay in the CPU's caches) instead of a probe into a hash table of TRAIN's positions."""
    flags = bytearray(vg.n)
    for t in train:
        flags[t] = 1
    return flags


def last_stage1_writer(vg: VersionGraph, train: set[int], param: str) -> int | None:
    """The last data_process unit that writes `param` (None: the dataset value survives stage 1)."""
    for w in reversed(vg.writers.get(param, [])):
        if w not in train:
            return w
    return None


def last_stage1_writers(vg: VersionGraph, train: set[int]) -> dict[str, int]:
    """`last_stage1_writer` of every param that some data_process unit writes, in one pass.

    Walking each param's update chain back from its end visits every TRAIN writer on the way; when
    TRAIN is most of the pipeline (and without a declared sink every param is asked about) that is
    nearly every write of the pipeline. A forward pass over the data_process units alone does less.
    """
    found: dict[str, int] = {}
    units = vg.pipeline.units
    for i in range(vg.n):
        if i not in train:
            for p in units[i].outputs:
                found[p] = i
    return found


def latest_entries(vg: VersionGraph, train: set[int]) -> dict[str, int | None]:
    """Latest mode's entries as {param: its last stage-1 writer, None for the dataset value}.

    The last result is kept with the graph, for the same TRAIN: `split` computes the entries of its
    plan, then the verifier computes them again from the plan's TRAIN to compare, and on a big
    pipeline that is a pass over every TRAIN read and every sink param. A copy is returned.
    """
    key = frozenset(train)
    memo = vg.__dict__.get("_latest_entries_memo")
    if memo is not None and memo[0] == key:
        return dict(memo[1])
    last = last_stage1_writers(vg, train).get
    found = {p: last(p) for p in needed_params(vg, train)}  # in needed_params' order: sorts faster
    vg.__dict__["_latest_entries_memo"] = (key, found)
    return dict(found)


def cache_entries(vg: VersionGraph, train: set[int], cache_mode: str) -> list[Entry]:
    """The entries a plan stores, sorted by param then writer position (dataset first)."""
    if cache_mode == LATEST:  # one entry per param: sorting the params (plain strings) is the order
        entries = latest_entries(vg, train)
        return [(p, entries[p]) for p in sorted(entries)]
    return sort_entries(needed_versions_ordered(vg, train))


def cache_entry_set(vg: VersionGraph, train: set[int], cache_mode: str) -> set[Entry]:
    """`cache_entries` as a set, for the verifier, which compares sets and needs no order."""
    if cache_mode == LATEST:
        return set(latest_entries(vg, train).items())
    return set(needed_versions_ordered(vg, train))


def cache_entries_reference(vg: VersionGraph, train: set[int], cache_mode: str) -> list[Entry]:
    """`cache_entries` as first written, straight from the cache rules of docs/semantics.md ('What the
    stages do', 'Cache mode `versioned`'); kept for the tests."""
    needed = needed_versions(vg, train)
    if cache_mode == LATEST:
        params = {p for p, _ in needed}
        entries = {(p, last_stage1_writer(vg, train, p)) for p in params}
    else:
        entries = needed
    return sorted(entries, key=entry_sort_key)


def sort_entries(entries: Iterable[Entry]) -> list[Entry]:
    """sorted(entries, key=entry_sort_key), by sorting the params alone (strings compare fastest
    among themselves) and only the writers of a param that has several entries."""
    first: dict[str, Entry] = {}
    more: dict[str, list[Entry]] = {}
    for entry in entries:
        p = entry[0]
        if p not in first:
            first[p] = entry
        elif p in more:
            more[p].append(entry)
        else:
            more[p] = [first[p], entry]
    if not more:
        return [first[p] for p in sorted(first)]
    out: list[Entry] = []
    for p in sorted(first):
        group = more.get(p)
        if group is None:
            out.append(first[p])
        else:
            out.extend(sorted(group, key=entry_sort_key))
    return out


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
    return {(reader, p): (source, writer) for reader, p, source, writer in iter_bindings(vg, train, entries, cache_mode)}


def iter_bindings(
    vg: VersionGraph, train: Iterable[int], entries: Iterable[Entry], cache_mode: str
) -> Iterator[tuple[int, str, str, int | None]]:
    """`bind_inputs` as a stream of (reader, param, source, writer), in the dict's order: TRAIN units
    in pipeline order, each unit's inputs in declared order (a repeated input once), then the sink.

    The verifier walks this stream instead of building the dict: on a big pipeline the dict and its
    keys are a large share of the memory a verification touches.
    """
    train_order = sorted(set(train))
    by_param: dict[str, list[int]] = {}  # versioned: cached writer positions per param, sorted (-1 = dataset)
    latest_cache: dict[str, int | None] = {}
    latest = cache_mode == LATEST
    for p, w in entries:
        if latest:
            latest_cache[p] = w
        else:
            by_param.setdefault(p, []).append(-1 if w is None else w)
    for positions in by_param.values():
        positions.sort()

    live: dict[str, int] = {}
    live_get = live.get
    units = vg.pipeline.units
    reaching = vg.reaching
    sink = vg.n
    # the readers: each TRAIN unit (its inputs in declared order, each once), then the sink
    readers = [(t, reaching[t], units[t].outputs) for t in train_order]
    readers.append((sink, vg._sink_inputs, ()))
    for reader, inputs, outputs in readers:
        for p in inputs:
            live_writer = live_get(p)
            if latest:
                if live_writer is not None:
                    yield reader, p, "live", live_writer
                elif p in latest_cache:
                    yield reader, p, "cache", latest_cache[p]
                else:
                    yield reader, p, "missing", None
                continue
            cached = by_param.get(p)
            cached_writer = None
            if cached:
                k = bisect_left(cached, reader) - 1
                if k >= 0:
                    cached_writer = cached[k]
            if live_writer is not None and (cached_writer is None or live_writer > cached_writer):
                yield reader, p, "live", live_writer
            elif cached_writer is not None:
                yield reader, p, "cache", None if cached_writer == -1 else cached_writer
            else:
                yield reader, p, "missing", None
        for p in outputs:
            live[p] = reader

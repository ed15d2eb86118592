"""Pipelines and units: the declarations the planner reasons about (docs/plan-format.md, 'Pipeline spec').

A unit is plain data. Backends keep the code that runs it elsewhere, keyed by the unit's name, so
the planner never needs torch or a model to decide a split.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _json_string  # what json.dumps uses (ensure_ascii)
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

from .errors import SpecError
from .userfiles import parse_user_json, parse_user_yaml, read_user_text

UNIT_KEYS = {"name", "inputs", "outputs", "models", "deterministic", "requires", "configs"}
SINK_KEYS = {"inputs", "models"}
PIPELINE_KEYS = {"name", "units", "sink"}

T = TypeVar("T")


@dataclass(frozen=True)
class Unit:
    """One preprocessing step: what it reads, writes and calls.

    `configs` names models whose configuration the unit reads without calling the model (a channel
    count of the DiT, the VAE's scale factor). A config is fixed for a run, like a setting: reading
    it gives no gradient and no data dependency, so it never seeds the unit into TRAIN, and a stage
    that runs the unit loads the model's config, not its weights (docs/semantics.md, 'Config reads';
    closure.py). A model the unit calls is not listed here too: calling it reads its config anyway.
    """

    name: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    deterministic: bool = True
    # inputs without which the unit is a no-op (spec v1 extension; empty: always active)
    requires: tuple[str, ...] = ()
    # models whose config the unit reads without calling them (empty: none)
    configs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for attr in ("inputs", "outputs", "models", "requires", "configs"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))

    def to_dict(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "models": list(self.models),
            "deterministic": self.deterministic,
        }
        if self.requires:
            data["requires"] = list(self.requires)
        if self.configs:  # absent when empty, like `requires`: older spec dicts stay byte-identical
            data["configs"] = list(self.configs)
        return data


@dataclass(frozen=True)
class Sink:
    """The loss: what it reads and which models it calls, after the last unit."""

    inputs: tuple[str, ...] = ()
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "models", tuple(self.models))

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": list(self.inputs), "models": list(self.models)}


@dataclass(frozen=True)
class Pipeline:
    """An ordered list of units over one state dictionary, plus an optional declared sink.

    `sink` is None when the pipeline does not declare one: the sink then reads every param and
    calls only the models that need backward (resolved per split, since it depends on them).
    """

    name: str
    units: tuple[Unit, ...]
    sink: Sink | None = None
    source: str = field(default="<python>", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        validate(self)

    def __len__(self) -> int:
        return len(self.units)

    def index(self, unit_name: str) -> int:
        """Position of a unit, or a SpecError naming the unknown unit."""
        for i, unit in enumerate(self.units):
            if unit.name == unit_name:
                return i
        raise SpecError(f"no unit named {unit_name!r} in pipeline {self.name!r}", source=self.source)

    @property
    def params(self) -> list[str]:
        """Every param a unit or the declared sink touches, in first-mention order."""
        seen: dict[str, None] = {}
        for unit in self.units:
            for p in (*unit.inputs, *unit.outputs):
                seen.setdefault(p, None)
        if self.sink is not None:
            for p in self.sink.inputs:
                seen.setdefault(p, None)
        return list(seen)

    @property
    def models(self) -> list[str]:
        """Every model a unit or the declared sink calls, sorted."""
        names = {m for unit in self.units for m in unit.models}
        if self.sink is not None:
            names.update(self.sink.models)
        return sorted(names)

    @property
    def configs(self) -> list[str]:
        """Every model some unit reads the config of (without calling it), sorted.

        A name may also be in `models`: one unit may call a model whose config another only reads.
        """
        return sorted({m for unit in self.units for m in unit.configs})

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "units": [u.to_dict() for u in self.units]}
        if self.sink is not None:
            data["sink"] = self.sink.to_dict()
        return data

    @cached_property
    def canonical_json(self) -> str:
        """canonical_dict() as compact JSON, computed once: fingerprints of big pipelines reuse it.

        The text is `canonical_json_reference()`, json.dumps of canonical_dict() with sorted keys,
        written out directly (tests check they agree): on a big pipeline the dict of lists of the
        reference, built only to be printed, cost more than the printing.
        """
        return _canonical_json(self)

    def canonical_json_reference(self) -> str:
        """canonical_json as first defined: the canonical dict printed by json.dumps."""
        return json.dumps(self.canonical_dict(), sort_keys=True, separators=(",", ":"))

    def derived(self, build: Callable[[Pipeline], T]) -> T:
        """`build(self)`, computed on the first call with this `build` and kept with the pipeline.

        A Pipeline is immutable, so whatever is computed from it alone stays right for as long as
        the pipeline lives; kept here, it also goes away with it. A module-level cache would do
        neither well: keyed on pipelines it hashes every unit on each look-up and keeps dead
        pipelines alive, keyed on id() it can hand a new pipeline a dead one's result. The modules
        above spec keep their views of a pipeline this way (graph.py: `VersionGraph.of`), which
        keeps spec, the declarations, from importing them: the package's imports stay acyclic.
        """
        memo = self.__dict__.get("_derived")
        if memo is None:  # a frozen dataclass: its __dict__ is still writable, as cached_property uses
            memo = self.__dict__["_derived"] = {}
        if build not in memo:
            memo[build] = build(self)
        return memo[build]

    def canonical_dict(self) -> dict[str, Any]:
        """The spec with every order that carries no meaning sorted away, for fingerprints."""
        units = []
        for u in self.units:
            unit = {
                "name": u.name,
                "inputs": _sorted_set(u.inputs),
                "outputs": _sorted_set(u.outputs),
                "models": _sorted_set(u.models),
                "deterministic": u.deterministic,
            }
            if u.requires:  # absent when empty, so specs without `requires` keep their fingerprints
                unit["requires"] = sorted(set(u.requires))
            if u.configs:  # likewise: pipelines without `configs` keep their fingerprints (and caches)
                unit["configs"] = sorted(set(u.configs))
            units.append(unit)
        sink = None
        if self.sink is not None:
            sink = {"inputs": sorted(set(self.sink.inputs)), "models": sorted(set(self.sink.models))}
        return {"name": self.name, "units": units, "sink": sink}


def _json_names(values: tuple[str, ...]) -> str:
    """json.dumps(sorted(set(values))) in the compact separators.

    The distinct values are taken with dict.fromkeys, not set: the same elements, so the same
    sorted list, but in their declared order, which sorts up to twice as fast as a set's hash order
    on a big sink's hundreds of thousands of params (fewer comparisons, each touching strings in
    the order they were made).
    """
    if not values:
        return "[]"
    if len(values) == 1:
        return f"[{_json_string(values[0])}]"
    return "[" + ",".join(map(_json_string, sorted(dict.fromkeys(values)))) + "]"


def _canonical_json(pipeline: Pipeline) -> str:
    """json.dumps(pipeline.canonical_dict(), sort_keys=True, separators=(",", ":")), printed unit by unit.

    The keys are written in sorted order (configs < deterministic < inputs < models < name < outputs
    < requires; name < sink < units; inputs < models), strings by the encoder json.dumps uses, and
    `deterministic` is a bool (validate() sees to that).
    """
    names = _json_names
    string = _json_string
    parts = []
    for u in pipeline.units:
        head = f'{{"configs":{names(u.configs)},' if u.configs else "{"
        tail = f',"requires":{names(u.requires)}}}' if u.requires else "}"
        parts.append(
            f'{head}"deterministic":{"true" if u.deterministic else "false"},"inputs":{names(u.inputs)},'
            f'"models":{names(u.models)},"name":{string(u.name)},"outputs":{names(u.outputs)}{tail}'
        )
    sink = pipeline.sink
    sink_text = "null" if sink is None else f'{{"inputs":{names(sink.inputs)},"models":{names(sink.models)}}}'
    return f'{{"name":{string(pipeline.name)},"sink":{sink_text},"units":[{",".join(parts)}]}}'


def _sorted_set(values: tuple[str, ...]) -> list[str]:
    """sorted(set(values)), without building a set for the common none or one."""
    return list(values) if len(values) < 2 else sorted(set(values))


def validate(pipeline: Pipeline) -> None:
    """Reject what would make a plan ambiguous: empty or duplicate names, non-string entries, a model a
    unit both calls and only reads the config of."""
    src = pipeline.source
    if not isinstance(pipeline.name, str) or not pipeline.name.strip():
        raise SpecError("pipeline 'name' must be a non-empty string", source=src)
    seen: set[str] = set()
    for i, unit in enumerate(pipeline.units):
        if not isinstance(unit, Unit):
            raise SpecError(f"units[{i}] is {type(unit).__name__}, expected a Unit", source=src)
        if not isinstance(unit.name, str) or not unit.name.strip():
            raise SpecError(f"units[{i}] has an empty name", source=src)
        if unit.name in seen:
            raise SpecError("duplicate unit name", source=src, unit=unit.name)
        seen.add(unit.name)
        for attr in ("inputs", "outputs", "models", "requires", "configs"):
            values = getattr(unit, attr)
            if values:  # empty lists, most of them, have nothing to check
                _check_names(values, f"'{attr}'", src, unit.name)
        if unit.configs:
            both = [m for m in dict.fromkeys(unit.configs) if m in unit.models]
            if both:
                raise SpecError(f"{both[0]!r} is in both 'models' and 'configs'; a unit that calls a model reads its config "
                                f"anyway, so list it only in 'models'", source=src, unit=unit.name)
        if unit.requires:
            stray = [p for p in unit.requires if p not in unit.inputs]
            if stray:
                raise SpecError(f"'requires' names {stray[0]!r}, which is not one of the unit's inputs", source=src, unit=unit.name)
        if not isinstance(unit.deterministic, bool):
            raise SpecError("'deterministic' must be true or false", source=src, unit=unit.name)
    if pipeline.sink is not None:
        _check_names(pipeline.sink.inputs, "sink 'inputs'", src, None)
        _check_names(pipeline.sink.models, "sink 'models'", src, None)


def _check_names(values: Iterable[Any], what: str, src: str, unit: str | None) -> None:
    for value in values:
        if not isinstance(value, str) or not value.strip():
            raise SpecError(f"{what} must hold non-empty strings, got {value!r}", source=src, unit=unit)


def pipeline_from_dict(data: Any, source: str = "<dict>") -> Pipeline:
    """Build a Pipeline from parsed JSON/YAML, strictly: unknown keys and wrong types are errors."""
    if not isinstance(data, Mapping):
        raise SpecError(f"a pipeline spec must be a mapping, got {_kind(data)}", source=source)
    _reject_unknown(data, PIPELINE_KEYS, "pipeline", source, None)
    if "name" not in data:
        raise SpecError("missing key 'name'", source=source)
    if "units" not in data:
        raise SpecError("missing key 'units'", source=source)
    name = data["name"]
    if not isinstance(name, str):
        raise SpecError(f"'name' must be a string, got {_kind(name)}", source=source)
    raw_units = data["units"]
    if not isinstance(raw_units, list):
        raise SpecError(f"'units' must be a list, got {_kind(raw_units)}", source=source)
    units = [_unit_from_dict(raw, i, source) for i, raw in enumerate(raw_units)]
    sink = None
    if data.get("sink") is not None:
        raw_sink = data["sink"]
        if not isinstance(raw_sink, Mapping):
            raise SpecError(f"'sink' must be a mapping, got {_kind(raw_sink)}", source=source)
        _reject_unknown(raw_sink, SINK_KEYS, "sink", source, None)
        sink = Sink(
            inputs=_string_list(raw_sink, "inputs", source, None, what="sink 'inputs'"),
            models=_string_list(raw_sink, "models", source, None, what="sink 'models'"),
        )
    return Pipeline(name=name, units=tuple(units), sink=sink, source=source)


def _unit_from_dict(raw: Any, index: int, source: str) -> Unit:
    if not isinstance(raw, Mapping):
        raise SpecError(f"units[{index}] must be a mapping, got {_kind(raw)}", source=source)
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        shown = "missing" if name is None else repr(name)
        raise SpecError(f"units[{index}] needs a non-empty string 'name' ({shown})", source=source)
    _reject_unknown(raw, UNIT_KEYS, "unit", source, name)
    deterministic = raw.get("deterministic", True)
    if not isinstance(deterministic, bool):
        raise SpecError(f"'deterministic' must be true or false, got {deterministic!r}", source=source, unit=name)
    return Unit(
        name=name,
        inputs=_string_list(raw, "inputs", source, name),
        outputs=_string_list(raw, "outputs", source, name),
        models=_string_list(raw, "models", source, name),
        deterministic=deterministic,
        requires=_string_list(raw, "requires", source, name),
        configs=_string_list(raw, "configs", source, name),
    )


def _string_list(raw: Mapping, key: str, source: str, unit: str | None, what: str | None = None) -> tuple[str, ...]:
    what = what or f"'{key}'"
    value = raw.get(key, [])
    if value is None:
        value = []
    if not isinstance(value, list):
        raise SpecError(f"{what} must be a list of strings, got {_kind(value)}", source=source, unit=unit)
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise SpecError(f"{what} must hold non-empty strings, got {item!r}", source=source, unit=unit)
    return tuple(value)


def _reject_unknown(raw: Mapping, allowed: set[str], what: str, source: str, unit: str | None) -> None:
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise SpecError(
            f"unknown {what} key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})",
            source=source,
            unit=unit,
        )


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "null"}.get(type(value), type(value).__name__)


def read_spec_file(path: str | Path) -> Pipeline:
    """Load a JSON or YAML spec file; any problem is one SpecError naming the file.

    The readers of userfiles.py bound the file's size and nesting and refuse what is not plain data
    (duplicate keys, NaN, integers past Python's digit limit, YAML alias bombs).
    """
    path = Path(path)
    source = str(path)
    text = read_user_text(path, SpecError, "a spec file")
    if path.suffix.lower() in {".yaml", ".yml"}:
        data = parse_user_yaml(text, source, SpecError)
    else:
        data = parse_user_json(text, source, SpecError)
    return pipeline_from_dict(data, source=source)

"""Which units must stay in the training loop (docs/semantics.md, 'The rules'): TRAIN, the closure of the seeds.

TRAIN is the least fixed point above the seed set X0 of T(X) = X ∪ F(X) ∪ W(X) in cache mode
`latest`, and of X ∪ F(X) in mode `versioned`. The set operators are here as plain functions, for
reading and for tests; `train_set` computes the fixed point in one forward sweep, recording for
every unit why it is in TRAIN.

Why one sweep is a worklist in disguise: F adds only units that read a version written by a
TRAIN unit, so they stand later in the pipeline; W adds only writers that come after the first
TRAIN access of a param, so they stand later too. Visiting positions in pipeline order therefore
sees every unit after everything that can pull it in, and each param's first TRAIN access is
settled the first time the sweep meets it. Total work: units + reads + update-chain lengths.

Config reads (a unit's `configs`; docs/semantics.md, 'Config reads') take no part in any of this. X0
holds a unit for what it *calls*: a unit calling a model of B produces values that carry gradients
and change as the weights do. A model's config is not its weights: it is fixed for the run, like a
setting, and training never changes it, so a unit that only reads the config of a model of B
computes the same deterministic value in every epoch; it is no seed. Nor is a config a param: no
unit writes it, so it has no versions, adds no edge to the reaching-write tables of graph.py, and F,
U and W (which look only at params) never see it. The whole closure, and with it every proof of
docs/semantics.md, is therefore unchanged by `configs`; they matter only for what a stage loads
(plan.py: the stage reads the model's config without loading its weights).

The module is named for what it computes, a closure, and not `split`: the package exports the
function `unitgraph.split` (plan.py), and a submodule of the same name would be shadowed by it, so
`import unitgraph.split` would hand back the function instead of this module (CONTRIBUTING.md,
'Imports in the core').
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable

from .graph import VersionGraph

LATEST = "latest"
VERSIONED = "versioned"
CACHE_MODES = (LATEST, VERSIONED)


@dataclass(frozen=True)
class Reason:
    """Why a unit is in TRAIN.

    rule: "model" (calls a model that needs backward), "nondeterministic", "F" (reads a version
    written by `via`), "U" (later writer in the update chain of `param`, which `via` reads and
    writes in place), "W" (writes `param` after `via` read or wrote it: a write hazard).
    """

    rule: str
    via: int | None = None
    param: str | None = None
    models: tuple[str, ...] = ()
    access: str | None = None  # how `via` touches `param` for U/W: "reads", "writes", "reads and writes"

    @property
    def is_seed(self) -> bool:
        return self.rule in ("model", "nondeterministic")

    def describe(self, names: list[str]) -> str:
        """One sentence, e.g. 'reads prompt_emb written by PromptEmbedder (F)'."""
        if self.rule == "model":
            models = ", ".join(self.models)
            verb = "needs" if len(self.models) == 1 else "need"
            return f"calls {models}, which {verb} backward (X0)"
        if self.rule == "nondeterministic":
            return "is non-deterministic, so it must run fresh every epoch (X0)"
        via = names[self.via] if self.via is not None else "?"
        if self.rule == "F":
            return f"reads {self.param} written by {via} (F)"
        if self.rule == "U":
            return f"writes {self.param} later in the update chain that {via} reads and writes in place (U)"
        if self.access == "reads":
            return f"writes {self.param} after {via} read it: write-after-read (W)"
        return f"writes {self.param} after {via} wrote it: write-after-write (W)"

    def to_dict(self, names: list[str]) -> dict:
        data: dict = {"rule": self.rule}
        if self.models:
            data["models"] = list(self.models)
        if self.via is not None:
            data["unit"] = names[self.via]
        if self.param is not None:
            data["param"] = self.param
        if self.access is not None:
            data["access"] = self.access
        return data


def backward_models(trainable_models: Iterable[str] = (), lora_base_model: str | None = None) -> frozenset[str]:
    """B: the trainable models plus the LoRA base model."""
    models = {m.strip() for m in trainable_models if m and m.strip()}
    if lora_base_model and lora_base_model.strip():
        models.add(lora_base_model.strip())
    return frozenset(models)


def seeds(vg: VersionGraph, backward: frozenset[str]) -> dict[int, Reason]:
    """X0: units that call a model needing backward, and every non-deterministic unit.

    Only `unit.models` count: reading the config of a model of B (`unit.configs`) does not seed a
    unit, since the config is fixed for the run (see the module docstring).
    """
    key = frozenset(backward)
    memo = vg.__dict__.setdefault("_seeds_memo", {})  # planning and verifying both ask, with the same B
    if key in memo:
        return dict(memo[key])
    found: dict[int, Reason] = {}
    for i, unit in enumerate(vg.pipeline.units):
        # most units call no model: skip building an empty tuple for each of them
        hit = tuple(m for m in dict.fromkeys(unit.models) if m in backward) if unit.models else ()
        if hit:
            found[i] = Reason("model", models=hit)
        elif not unit.deterministic:
            found[i] = Reason("nondeterministic")
    memo[key] = found
    return dict(found)


# --- the set operators as docs/semantics.md, 'The rules', writes them ----------------------------


def forward_closure(vg: VersionGraph, units: Iterable[int]) -> set[int]:
    """F(X): every unit that reads a version written by a unit of X, transitively."""
    import networkx as nx  # a reference operator: the planner's fast path needs no networkx

    dag = vg.data_dag()
    found: set[int] = set()
    for u in units:
        found |= nx.descendants(dag, u)
    return found


def _accesses(vg: VersionGraph, i: int) -> list[str]:
    unit = vg.pipeline.units[i]
    return list(dict.fromkeys((*unit.inputs, *unit.outputs)))


def update_chain_closure(vg: VersionGraph, units: Iterable[int]) -> set[int]:
    """U(X), DiffSynth-Studio's original rule: if the first unit of X reading p also writes p (and is not
    p's last writer), p's later writers join."""
    members = sorted(set(units))
    first_reader: dict[str, int] = {}
    for i in members:
        for p in vg.pipeline.units[i].inputs:
            first_reader.setdefault(p, i)
    found: set[int] = set()
    for p, a in first_reader.items():
        if p in vg.pipeline.units[a].outputs:
            found.update(vg.writers_after(p, a))
    return found


def write_hazard_closure(vg: VersionGraph, units: Iterable[int]) -> set[int]:
    """W(X): for each p, every unit writing p after the first unit of X that reads or writes p."""
    members = sorted(set(units))
    first_access: dict[str, int] = {}
    for i in members:
        for p in _accesses(vg, i):
            first_access.setdefault(p, i)
    found: set[int] = set()
    for p, a in first_access.items():
        found.update(vg.writers_after(p, a))
    return found


def step(vg: VersionGraph, units: set[int], cache_mode: str = LATEST) -> set[int]:
    """T(X) = X ∪ F(X) ∪ W(X) (latest) or X ∪ F(X) (versioned)."""
    result = set(units) | forward_closure(vg, units)
    if cache_mode == LATEST:
        result |= write_hazard_closure(vg, units)
    return result


def iterate_to_fixed_point(vg: VersionGraph, start: set[int], operator) -> set[int]:
    """Apply `operator` from `start` until nothing changes (at most n rounds: T is monotone)."""
    current = set(start)
    while True:
        following = operator(current)
        if following == current:
            return current
        current = following


def update_chain_train_set(vg: VersionGraph, backward: frozenset[str]) -> set[int]:
    """DiffSynth-Studio's original split: least fixed point of X ∪ F(X) ∪ U(X). Kept as a reference;
    it misses write-after-read and write-after-write hazards (docs/semantics.md, 'Why W and not only
    U')."""
    return iterate_to_fixed_point(
        vg,
        set(seeds(vg, backward)),
        lambda x: x | forward_closure(vg, x) | update_chain_closure(vg, x),
    )


# --- the fixed point, fast and with reasons -------------------------------------------------------


def train_set(vg: VersionGraph, backward: frozenset[str], cache_mode: str = LATEST) -> dict[int, Reason]:
    """TRAIN as {position: reason}, the least fixed point of `step` above X0, in one forward sweep."""
    if cache_mode not in CACHE_MODES:
        raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {cache_mode!r}")
    reasons: list[Reason | None] = [None] * vg.n
    for i, reason in seeds(vg, backward).items():
        reasons[i] = reason
    latest = cache_mode == LATEST
    first_access: set[str] = set()
    units = vg.pipeline.units
    readers_of = vg.readers_of
    writers = vg.writers
    for u in range(vg.n):
        if reasons[u] is None:
            continue
        for reader, params in readers_of[u].items():
            if reasons[reader] is None:
                reasons[reader] = Reason("F", via=u, param=params[0])
        if not latest:
            continue
        unit = units[u]
        inputs, outputs = unit.inputs, unit.outputs
        for p in (*inputs, *outputs):
            if p in first_access:
                continue
            first_access.add(p)
            chain = writers.get(p)
            if not chain or chain[-1] <= u:  # no writer of p after u (vg.writers_after(p, u) is empty)
                continue
            reads, writes = p in inputs, p in outputs
            access = "reads and writes" if reads and writes else ("reads" if reads else "writes")
            rule = "U" if reads and writes else "W"
            for w in chain[bisect_right(chain, u):]:
                if reasons[w] is None:
                    reasons[w] = Reason(rule, via=u, param=p, access=access)
    return {i: r for i, r in enumerate(reasons) if r is not None}

"""The version view of a pipeline: reaching writes, update chains and the unit DAG.

Units are identified by position. For each input of each unit, its *reaching write* is the latest
earlier unit that writes the param (None: the dataset value). That table is the ground truth for
correctness; the DAG is its picture: an edge j -> i carries the params i reads from j's writes.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from .spec import Pipeline

if TYPE_CHECKING:  # networkx is imported by the views that build its graphs: planning needs none (0.3 s of start-up)
    import networkx as nx


@dataclass(frozen=True)
class Read:
    """One read: `reader` (a unit position, or len(units) for the sink) takes `param` from `writer`."""

    reader: int
    param: str
    writer: int | None


class VersionGraph:
    """Reaching-write tables and update chains of one pipeline, with a networkx DiGraph view."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        units = pipeline.units
        self.n = n = len(units)
        self.names = names = [u.name for u in units]
        self.position = {name: i for i, name in enumerate(names)}
        # update chain: every writer of p, in pipeline order
        self.writers: dict[str, list[int]] = {}
        # reaching[i] = {param: writer or None} for each input of unit i
        self.reaching: list[dict[str, int | None]] = []
        # readers_of[j] = units that read a version written by j (with the params), the F edges
        self.readers_of: list[dict[int, list[str]]] = [{} for _ in range(n)]
        # One pass: unit i's reaching writes are complete when it is visited, and readers_of[j] gets
        # its readers in increasing order, as a second pass over `reaching` would add them.
        latest: dict[str, int] = {}
        get = latest.get
        writers = self.writers
        readers_of = self.readers_of
        append_reaching = self.reaching.append
        for i, unit in enumerate(units):
            table = {p: get(p) for p in unit.inputs}
            append_reaching(table)
            for p, j in table.items():
                if j is not None:
                    edges = readers_of[j]
                    if i in edges:
                        edges[i].append(p)
                    else:
                        edges[i] = [p]
            for p in unit.outputs:
                if get(p) != i:  # a param listed twice is one write
                    if p in writers:
                        writers[p].append(i)
                    else:
                        writers[p] = [i]
                    latest[p] = i
        self.last_writer: dict[str, int] = latest

    @classmethod
    def of(cls, pipeline: Pipeline) -> VersionGraph:
        """The pipeline's VersionGraph, built once per pipeline and then shared.

        Planning, verifying, drawing and explaining one pipeline all read the same tables; building
        them is linear in units and reads, which on big pipelines is worth doing once. The graph is
        kept with the pipeline (`Pipeline.derived`), not as a property of it: spec.py then never
        imports this module, whose tables are computed from a Pipeline and so sit above it.
        """
        return pipeline.derived(cls)

    # --- tables -------------------------------------------------------------------------------

    @cached_property
    def dataset_params(self) -> list[str]:
        """Params read before any unit writes them: provided per sample by the dataset."""
        found: dict[str, None] = {}
        for table in self.reaching:
            for p, writer in table.items():
                if writer is None:
                    found.setdefault(p, None)
        if self.pipeline.sink is not None:
            for p in self.pipeline.sink.inputs:
                if p not in self.last_writer:
                    found.setdefault(p, None)
        return list(found)

    def writers_after(self, param: str, position: int) -> list[int]:
        """Writers of `param` strictly after `position`, in order."""
        chain = self.writers.get(param, [])
        return chain[bisect_right(chain, position):]

    def sink_inputs(self) -> list[str]:
        """Params the sink reads: declared, or every param when the pipeline declares no sink."""
        return list(self._sink_inputs)

    @cached_property
    def _sink_inputs(self) -> tuple[str, ...]:
        """sink_inputs() computed once: without a declared sink it is every param of the pipeline, a
        pass over every unit, which planning and verifying would otherwise repeat four times."""
        if self.pipeline.sink is not None:
            return tuple(dict.fromkeys(self.pipeline.sink.inputs))
        return tuple(self.pipeline.params)

    @cached_property
    def _sink_writers(self) -> tuple[int | None, ...]:
        """The last writer of each param of `_sink_inputs` (None: the dataset value), in that order."""
        get = self.last_writer.get
        return tuple(map(get, self._sink_inputs))

    def sink_models(self, backward_models: set[str] | frozenset[str]) -> list[str]:
        """Models the sink calls: declared, or only those that need backward."""
        if self.pipeline.sink is not None:
            return sorted(set(self.pipeline.sink.models))
        return sorted(backward_models)

    def sink_reads(self) -> list[Read]:
        sink = self.n
        return [Read(sink, p, w) for p, w in zip(self._sink_inputs, self._sink_writers)]

    # --- networkx view ------------------------------------------------------------------------

    def to_networkx(self) -> nx.DiGraph:
        """Units as nodes (by position, with name/models/deterministic), reaching-write edges carrying params.

        Update-chain edges between successive writers of a param are added with kind="chain" so
        drawings can show them distinctly; data edges have kind="data".
        """
        import networkx as nx

        g = nx.DiGraph(name=self.pipeline.name)
        for i, unit in enumerate(self.pipeline.units):
            g.add_node(i, name=unit.name, models=list(unit.models), deterministic=unit.deterministic)
        for j, readers in enumerate(self.readers_of):
            for i, params in readers.items():
                g.add_edge(j, i, params=sorted(params), kind="data")
        for p, chain in self.writers.items():
            for a, b in zip(chain, chain[1:]):
                if g.has_edge(a, b):
                    g.edges[a, b].setdefault("chain", []).append(p)
                else:
                    g.add_edge(a, b, params=[], chain=[p], kind="chain")
        return g

    def data_dag(self) -> nx.DiGraph:
        """Only the reaching-write edges: the graph whose descendants are the forward closure F."""
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(range(self.n))
        g.add_edges_from((j, i) for j, readers in enumerate(self.readers_of) for i in readers)
        return g

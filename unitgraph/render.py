"""Pictures and tables of a plan: Graphviz (svg/png/pdf/dot), Mermaid and a rich text table.

Everything is drawn from a `PlanView`: the pipeline's version graph plus the plan's stages, cache
entries and the stage-2 input bindings the backend executes (`entries.bind_inputs`). So the picture
shows what will run, not a re-derivation of it:

- two clusters, `data_process` (stage 1) and `train` (stage 2), and a `cache` cluster between them
  holding one cylinder per cache entry, all on one rank; every value that crosses from stage 1
  into stage 2 goes writer -> entry -> reader along thick amber edges (the cache boundary);
- grey edges carry the params a unit reads from an earlier unit of the same stage (labelled);
  dataset inputs of stage-1 units are listed in the node instead of drawn from a dataset node;
- update chains: a unit that reads a param and writes it again says `↻ updates p`, and a writer
  that overwrites p without reading the previous version gets a dashed edge from it;
- train units are coloured by the rule that put them there (X0 seeds with a double border, F, W,
  U) and say why in their last line; the graph label holds the title, models per stage, the
  `versioned` note and a legend;
- config reads (a unit's `configs`) are a node line `config: dit`, and a stage that reads a
  model's config without loading it says `(config only: dit)` after the models it loads. A config
  is no param, so no edge is drawn for it.

Layout: left to right (rankdir=LR), so depth of data flow runs across and independent units stack
down; that keeps 30+ unit pipelines readable where a top-down layout gets very wide.

Importing this module needs neither torch nor Graphviz: the `graphviz` package is imported when a
Graphviz drawing is asked for, and only svg/png/pdf need the `dot` program.
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .closure import LATEST
from .entries import bind_inputs
from .errors import UnitgraphError
from .graph import VersionGraph
from .plan import versioned_savings_line
from .planfile import Plan, active_pipeline
from .spec import Pipeline

FORMATS = ("svg", "png", "pdf", "dot", "mermaid", "text")
IMAGE_FORMATS = ("svg", "png", "pdf")  # need the Graphviz `dot` program
BINARY_FORMATS = ("png", "pdf")
SUFFIX_FORMATS = {
    ".svg": "svg",
    ".png": "png",
    ".pdf": "pdf",
    ".dot": "dot",
    ".gv": "dot",
    ".mmd": "mermaid",
    ".mermaid": "mermaid",
    ".txt": "text",
    ".text": "text",
}
INSTALL_HINT = (
    "install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; "
    "conda: conda install -c conda-forge graphviz) or use --format dot, mermaid or text"
)
TEXT_WIDTH = 120  # fixed width when the table goes to a file or a pipe, so output is stable


class GraphvizNotFound(UnitgraphError):
    """svg/png/pdf were asked for but the Graphviz `dot` program is not installed."""


# --- colours and rules --------------------------------------------------------------------------

DP_FILL, DP_LINE = "#dbeafe", "#2563eb"
CACHE_FILL, CACHE_LINE = "#fef3c7", "#b45309"
SINK_FILL = "#e5e7eb"
INACTIVE_FILL, INACTIVE_LINE = "#f3f4f6", "#9ca3af"
RULE_STYLE = {  # rule -> (fill colour, legend text)
    "model": ("#fca5a5", "X0 seed: calls a model that needs backward"),
    "nondeterministic": ("#fcd34d", "X0 seed: non-deterministic, runs fresh every step"),
    "F": ("#fdba74", "F: reads a version written by a train unit"),
    "W": ("#d8b4fe", "W: writes a param after a train unit read or wrote it"),
    "U": ("#f9a8d4", "U: continues an update chain a train unit began"),
}
UNKNOWN_FILL = "#fecaca"  # a train unit the plan gives no reason for (a hand-edited plan)
MERMAID_CLASS = {"model": "seed", "nondeterministic": "random", "F": "forward", "W": "hazard", "U": "chain"}


# --- the view -------------------------------------------------------------------------------------


@dataclass
class PlanView:
    """A plan laid over its pipeline: positions, stages, entries, bindings and reasons.

    `pipeline` is the pipeline as loaded; `active` the one the plan splits (without the units the
    plan's `provided` params leave inactive). Positions are positions in `active`.
    """

    pipeline: Pipeline
    plan: Plan
    vg: VersionGraph = field(init=False)
    active: Pipeline = field(init=False)

    def __post_init__(self) -> None:
        self.active = active_pipeline(self.pipeline, self.plan)
        self.vg = VersionGraph.of(self.active)
        unknown = [n for n in (*self.plan.train_units, *self.plan.data_process_units) if n not in self.vg.position]
        if unknown:
            raise UnitgraphError(
                f"plan names unit {unknown[0]!r}, which pipeline {self.pipeline.name!r} does not have",
                source=self.pipeline.source,
            )

    @cached_property
    def inactive(self) -> list[tuple[int, Any, list[str]]]:
        """Units the run leaves out: (position in the loaded pipeline, unit, required params it lacks)."""
        if self.plan.extra.get("provided") is None:
            return []
        from .explain import missing_requirements

        missing = missing_requirements(self.pipeline, self.plan.extra["provided"])
        return [(k, u, missing[u.name]) for k, u in enumerate(self.pipeline.units) if u.name in missing]

    def inactive_line(self, unit: Any, missing: list[str]) -> str:
        return f"not run: requires {', '.join(missing)}"

    @property
    def names(self) -> list[str]:
        return self.vg.names

    @property
    def n(self) -> int:
        return self.vg.n

    @property
    def sink(self) -> int:
        return self.vg.n

    @cached_property
    def train(self) -> set[int]:
        return {self.vg.position[name] for name in self.plan.train_units}

    @cached_property
    def entries(self) -> list[tuple[str, int | None]]:
        """Cache entries with writer positions (None: the dataset value), in plan order."""
        out = []
        for param, writer in self.plan.cache_entries:
            out.append((param, None if writer is None else self.vg.position.get(writer)))
        return out

    @cached_property
    def bindings(self) -> dict[tuple[int, str], tuple[str, int | None]]:
        return bind_inputs(self.vg, self.train, self.entries, self.plan.cache_mode)

    @cached_property
    def entry_readers(self) -> dict[tuple[str, int | None], list[int]]:
        """Who reads each cache entry in stage 2 (positions; len(units) is the sink)."""
        readers: dict[tuple[str, int | None], list[int]] = {e: [] for e in self.entries}
        for (reader, param), (source, writer) in sorted(self.bindings.items()):
            if source == "cache" and (param, writer) in readers:
                readers[(param, writer)].append(reader)
        return readers

    @cached_property
    def rules(self) -> dict[int, str]:
        """Rule that put each train unit there: model, nondeterministic, F, W, U ('' when unknown)."""
        out = {}
        for i in sorted(self.train):
            detail = self.plan.reason_details.get(self.names[i], {})
            out[i] = detail.get("rule", "") if isinstance(detail, dict) else ""
        return out

    def reader_name(self, position: int) -> str:
        return "sink" if position == self.sink else self.names[position]

    def writer_name(self, position: int | None) -> str:
        return "dataset" if position is None else self.names[position]

    def short_reason(self, position: int) -> str:
        """The reason tag drawn in a train unit's node, e.g. 'F: reads noise ← NoiseInitializer'."""
        detail = self.plan.reason_details.get(self.names[position], {})
        if not isinstance(detail, dict):
            return "train"
        rule = detail.get("rule")
        via, param = detail.get("unit", "?"), detail.get("param", "?")
        if rule == "model":
            return f"X0: calls {', '.join(detail.get('models', []))} (backward)"
        if rule == "nondeterministic":
            return "X0: non-deterministic"
        if rule == "F":
            return f"F: reads {param} ← {via}"
        if rule == "U":
            return f"U: continues {via}'s {param} chain"
        if rule == "W":
            verb = "read" if detail.get("access") == "reads" else "wrote"
            return f"W: writes {param} after {via} {verb} it"
        return "train (no reason recorded)"

    def stage_reads(self) -> dict[tuple[int, int], list[str]]:
        """Data edges inside a stage: (writer, reader) -> params, for units (and the sink) of one stage.

        Stage-1 readers read their reaching writes (by C1 those are stage-1 units); stage-2 readers
        use their live bindings. Reads that cross stages go through the cache and are not here,
        except a data_process unit reading a train unit's version, which breaks C1 and is drawn red.
        """
        edges: dict[tuple[int, int], list[str]] = {}
        for i in range(self.n):
            if i in self.train:
                continue
            for p, w in self.vg.reaching[i].items():
                if w is not None:
                    edges.setdefault((w, i), []).append(p)
        for (reader, p), (source, writer) in sorted(self.bindings.items()):
            if source == "live" and writer is not None:
                edges.setdefault((writer, reader), []).append(p)
        return edges

    @cached_property
    def dataset_reads(self) -> dict[int, list[str]]:
        """data_process units that read dataset values: position -> params."""
        out: dict[int, list[str]] = {}
        for i in range(self.n):
            if i in self.train:
                continue
            for p, w in self.vg.reaching[i].items():
                if w is None:
                    out.setdefault(i, []).append(p)
        return out

    def chain_edges(self) -> list[tuple[int, int, str]]:
        """Successive writers (a, b) of each param p: the update chains."""
        out = []
        for p, chain in self.vg.writers.items():
            for a, b in zip(chain, chain[1:]):
                out.append((a, b, p))
        return out

    def in_place(self, position: int) -> list[str]:
        """Params the unit reads and writes again: its links in those params' update chains."""
        unit = self.active.units[position]
        return [p for p in dict.fromkeys(unit.inputs) if p in unit.outputs]

    def node_lines(self, position: int) -> list[str]:
        """The small lines under a unit's name: models, dataset inputs (stage 1), in-place updates, reason."""
        unit = self.active.units[position]
        lines = [", ".join(unit.models)]
        if unit.configs:
            lines.append(_config_line(unit.configs))
        reads = self.dataset_reads.get(position)
        if reads:  # dataset inputs are listed, not drawn: thirty edges from one node are noise
            lines.append("dataset: " + ", ".join(reads))
        updates = self.in_place(position)
        if updates:
            lines.append("↻ updates " + ", ".join(updates))
        if position in self.train:
            lines.append(self.short_reason(position))
        return [line for line in lines if line]

    def missing_reads(self) -> list[tuple[int, str]]:
        return [(r, p) for (r, p), (source, _) in sorted(self.bindings.items()) if source == "missing"]

    def header(self) -> str:
        backward = ", ".join(self.plan.models_require_backward) or "none"
        return f"{self.pipeline.name} · cache mode {self.plan.cache_mode} · models that need backward: {backward}"

    def savings_line(self) -> str | None:
        if self.plan.cache_mode != LATEST:
            return None
        return versioned_savings_line(self.pipeline, self.plan)


def plan_view(pipeline: Pipeline, plan: Plan) -> PlanView:
    return PlanView(pipeline, plan)


def _join_models(models: list[str] | tuple[str, ...]) -> str:
    return ", ".join(models) if models else "none"


def _stage_loads(models: list[str], configs: list[str]) -> str:
    """What a stage loads: its models, then `  (config only: dit)` when it reads configs it does not load."""
    loads = _join_models(models)
    return f"{loads}  (config only: {', '.join(configs)})" if configs else loads


def _config_line(configs: tuple[str, ...]) -> str:
    return "config: " + ", ".join(dict.fromkeys(configs))


def _unit_models(unit: Any) -> str:
    """The units table's models cell: the models a unit calls, then the configs it only reads."""
    models = ", ".join(unit.models)
    if unit.configs:
        return f"{models}; {_config_line(unit.configs)}" if models else _config_line(unit.configs)
    return models or "-"


def _wrap_params(params: list[str], per_line: int = 2, sep: str = "\\n") -> str:
    """Edge label with at most `per_line` params a line, so long labels do not stretch the layout."""
    lines = [", ".join(params[k:k + per_line]) for k in range(0, len(params), per_line)]
    return sep.join(lines)


# --- Graphviz ------------------------------------------------------------------------------------


def _import_graphviz():
    try:
        import graphviz
    except ImportError:  # the package is a dependency; this only happens in a broken install
        raise GraphvizNotFound("the python package 'graphviz' is not installed (pip install graphviz)") from None
    return graphviz


def _html_node(title: str, lines: list[str], bold: bool = True) -> str:
    head = f"<b>{html.escape(title)}</b>" if bold else html.escape(title)
    rest = "".join(f'<br/><font point-size="9">{html.escape(line)}</font>' for line in lines if line)
    return f"<{head}{rest}>"


def _legend_items(view: PlanView) -> list[tuple[str, str, str]]:
    """(kind, colour, text): kind "fill" draws a swatch, "edge" an arrow in that colour."""
    items = [("fill", DP_FILL, "data_process unit (stage 1, once per sample)")]
    present = set(view.rules.values())
    for rule, (fill, text) in RULE_STYLE.items():
        if rule in present or rule in ("model", "F"):
            items.append(("fill", fill, text + (" (double border)" if rule in ("model", "nondeterministic") else "")))
    items.append(("fill", CACHE_FILL, "cache entry: param ← unit (or dataset) whose version is stored"))
    if view.inactive:
        items.append(("fill", INACTIVE_FILL, "inactive: its `requires` are not provided, dropped before the split"))
    items += [
        ("edge", CACHE_LINE, "through the cache, stage 1 → stage 2"),
        ("edge", "#4b5563", "data inside a stage, labelled with its params"),
        ("edge", "#6b7280", "dashed: p overwritten by its next writer (update chain)"),
        ("note", "#111827", "updates p: the unit reads p and writes it again (update chain)"),
    ]
    return items


def _legend_table(view: PlanView, columns: int = 2) -> str:
    items = _legend_items(view)
    rows = -(-len(items) // columns)
    cells = ['<table border="0" cellborder="0" cellspacing="2" cellpadding="2">']
    for r in range(rows):
        cells.append("<tr>")
        for c in range(columns):
            k = c * rows + r
            if k >= len(items):
                cells.append("<td></td><td></td>")
                continue
            kind, colour, text = items[k]
            if kind == "fill":
                swatch = f'<td bgcolor="{colour}" border="1" width="22"> </td>'
            elif kind == "note":
                swatch = "<td>↻</td>"
            else:
                arrow = "╌╌▷" if text.startswith("dashed") else ("━━▶" if colour == CACHE_LINE else "──▶")
                swatch = f'<td><font color="{colour}">{html.escape(arrow)}</font></td>'
            cells.append(f'{swatch}<td align="left"><font point-size="10">{html.escape(text)}</font></td>')
        cells.append("</tr>")
    cells.append("</table>")
    return "".join(cells)


def _title_label(view: PlanView) -> str:
    """Title, models per stage, the versioned note and the legend, as one HTML graph label."""
    plan = view.plan
    lines = [
        f"stage 1 (data_process) loads: {_stage_loads(plan.data_process_models, plan.data_process_configs)}",
        f"stage 2 (train) loads: {_stage_loads(plan.train_models, plan.train_configs)}",
        f"cache: {len(plan.cache_entries)} entries ({plan.cache_mode} mode)",
    ]
    note = view.savings_line()
    if note:
        lines.append(note)
    text = "".join(f'<tr><td align="left">{html.escape(line)}</td></tr>' for line in lines)
    title = (f'<table border="0" cellborder="0" cellspacing="0" cellpadding="1">'
             f'<tr><td align="left"><font point-size="16"><b>{html.escape(view.header())}</b></font></td></tr>'
             f"{text}</table>")
    return (f'<<table border="0" cellborder="0" cellspacing="0" cellpadding="6"><tr>'
            f'<td valign="top">{title}</td><td valign="top">{_legend_table(view)}</td></tr></table>>')


def to_graphviz(pipeline: Pipeline, plan: Plan):
    """The plan as a `graphviz.Digraph` (needs the python package, not the `dot` program)."""
    graphviz = _import_graphviz()
    view = plan_view(pipeline, plan)
    g = graphviz.Digraph(
        name=pipeline.name,
        graph_attr={
            "rankdir": "LR",
            "newrank": "true",
            "compound": "true",
            "fontname": "Helvetica",
            "fontsize": "11",
            "nodesep": "0.2",
            "ranksep": "0.45",
            "labelloc": "t",
            "labeljust": "l",
            "label": _title_label(view),
            "pad": "0.3",
        },
        node_attr={"fontname": "Helvetica", "fontsize": "11", "shape": "box", "style": "rounded,filled",
                   "margin": "0.12,0.05"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9", "color": "#4b5563", "arrowsize": "0.7"},
    )

    def uid(i: int) -> str:
        return "sink" if i == view.sink else f"u{i}"

    entry_ids = {entry: f"c{k}" for k, entry in enumerate(view.entries)}
    dp_positions = [i for i in range(view.n) if i not in view.train]
    tr_positions = [i for i in range(view.n) if i in view.train]
    with g.subgraph(name="cluster_data_process") as c:
        c.attr(label=f"stage 1 · data_process: runs once, loads {_stage_loads(plan.data_process_models, plan.data_process_configs)}",
               style="rounded,filled", fillcolor="#f0f7ff", color=DP_LINE, fontcolor=DP_LINE, fontsize="13")
        for i in dp_positions:
            unit = view.active.units[i]
            c.node(uid(i), label=_html_node(unit.name, view.node_lines(i)), fillcolor=DP_FILL, color=DP_LINE,
                   tooltip=f"{unit.name}: data_process")
    with g.subgraph(name="cluster_cache") as c:
        c.attr(label=f"cache · {len(view.entries)} entries ({plan.cache_mode})", style="rounded,dashed",
               color=CACHE_LINE, fontcolor=CACHE_LINE, fontsize="13", rank="same")
        for (param, writer), node_id in entry_ids.items():
            c.node(node_id, label=_html_node(param, [f"← {view.writer_name(writer)}"], bold=False), shape="cylinder",
                   style="filled", fillcolor=CACHE_FILL, color=CACHE_LINE,
                   tooltip=f"cache entry {param} (version written by {view.writer_name(writer)})")
    with g.subgraph(name="cluster_train") as c:
        c.attr(label=f"stage 2 · train: runs every step, loads {_stage_loads(plan.train_models, plan.train_configs)}",
               style="rounded,filled", fillcolor="#fff5f5", color="#dc2626", fontcolor="#dc2626", fontsize="13")
        for i in tr_positions:
            unit = view.active.units[i]
            rule = view.rules.get(i, "")
            fill = RULE_STYLE.get(rule, (UNKNOWN_FILL, ""))[0]
            seed = rule in ("model", "nondeterministic")
            c.node(uid(i), label=_html_node(unit.name, view.node_lines(i)), fillcolor=fill, color="#7f1d1d" if seed else "#9a3412",
                   peripheries="2" if seed else "1", penwidth="1.5" if seed else "1",
                   tooltip=f"{unit.name}: {plan.reasons.get(unit.name, 'train')}")
        sink_models = view.vg.sink_models(frozenset(plan.models_require_backward))
        c.node("sink", label=_html_node("loss (sink)", [_join_models(sink_models)]), shape="box",
               style="filled,bold", fillcolor=SINK_FILL, color="#111827")

    if view.inactive:  # units the run leaves out, greyed: nothing flows into or out of them
        with g.subgraph(name="cluster_inactive") as c:
            c.attr(label=f"inactive: not run for this dataset (provides {', '.join(view.plan.extra['provided']) or 'nothing'})",
                   style="rounded,dashed", color=INACTIVE_LINE, fontcolor=INACTIVE_LINE, fontsize="13")
            for k, unit, missing in view.inactive:
                c.node(f"x{k}", label=_html_node(unit.name, [", ".join(unit.models), view.inactive_line(unit, missing)]),
                       style="rounded,filled,dashed", fillcolor=INACTIVE_FILL, color=INACTIVE_LINE,
                       fontcolor=INACTIVE_LINE, tooltip=f"{unit.name}: inactive")

    # data inside a stage (and C1 violations, in red)
    for (w, r), params in sorted(view.stage_reads().items()):
        shown = list(params)
        bad = r != view.sink and r not in view.train and w in view.train
        if bad:
            g.edge(uid(w), uid(r), label=_wrap_params(shown) + "\\n(C1 violated)", color="#dc2626",
                   fontcolor="#dc2626", penwidth="2")
        else:
            g.edge(uid(w), uid(r), label=_wrap_params(shown))
    # the cache boundary: writer -> entry -> readers, the entries on one rank between the stages
    for entry, node_id in entry_ids.items():
        param, writer = entry
        if writer is not None:  # a dataset entry is stored at the start of stage 1; its label says so
            g.edge(uid(writer), node_id, color=CACHE_LINE, penwidth="2.2", arrowsize="0.8")
        for reader in view.entry_readers.get(entry, []):
            g.edge(node_id, uid(reader), color=CACHE_LINE, penwidth="2.2", arrowsize="0.8")
    if entry_ids:  # keep stage 2 to the right of the cache even where a train unit reads no entry
        anchor = next(iter(entry_ids.values()))
        fed = {uid(r) for readers in view.entry_readers.values() for r in readers}
        fed |= {uid(r) for (_, r) in view.stage_reads() if r == view.sink or r in view.train}
        for i in [*tr_positions, view.sink]:
            if uid(i) not in fed:
                g.edge(anchor, uid(i), style="invis")
    # update chains: a blind overwrite (the next writer does not read this version) is dashed
    for a, b, p in view.chain_edges():
        if view.vg.reaching[b].get(p) == a:
            continue  # an in-place update: already drawn as the data (or cache) edge, marked ↻
        g.edge(uid(a), uid(b), label=p, style="dashed", color="#6b7280", fontcolor="#6b7280", arrowhead="empty")
    # reads that nothing provides (only in broken plans)
    for k, (reader, p) in enumerate(view.missing_reads()):
        g.node(f"missing{k}", label=f"{p}: nothing provides it", shape="note", style="filled",
               fillcolor="#fecaca", color="#dc2626")
        g.edge(f"missing{k}", uid(reader), color="#dc2626", style="dotted")
    return g


def dot_source(pipeline: Pipeline, plan: Plan) -> str:
    """The DOT text of the drawing; needs no Graphviz program."""
    return to_graphviz(pipeline, plan).source


def dot_available() -> bool:
    """Whether the Graphviz `dot` program can be run."""
    import shutil

    return shutil.which("dot") is not None


def render_image(pipeline: Pipeline, plan: Plan, fmt: str = "svg") -> bytes:
    """svg, png or pdf bytes, drawn by Graphviz `dot`; GraphvizNotFound when it is not installed."""
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"render_image draws {', '.join(IMAGE_FORMATS)}, not {fmt!r}")
    graphviz = _import_graphviz()
    g = to_graphviz(pipeline, plan)
    if fmt == "png":
        g.graph_attr["dpi"] = "110"
    try:
        return g.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise GraphvizNotFound(f"--format {fmt} needs the Graphviz 'dot' program, which is not installed; "
                               f"{INSTALL_HINT}") from None
    except graphviz.CalledProcessError as exc:  # pragma: no cover - a dot crash, not bad user input
        raise UnitgraphError(f"Graphviz dot failed to draw {fmt}: {exc}") from None


# --- Mermaid -------------------------------------------------------------------------------------


# characters Mermaid must not see raw inside a quoted label, as its entity codes (`#quot;` is `&quot;`)
_MERMAID_ENTITIES = {"#": "#35;", "&": "#amp;", '"': "#quot;", "<": "#lt;", ">": "#gt;", "|": "#124;", "`": "#96;"}
# what ends a line for Mermaid's lexer or for Python's splitlines: a line break in a label
_LINE_BREAKS = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")


def _mermaid_text(text: str) -> str:
    """Text safe inside a quoted Mermaid label: entity codes for quotes and markup, `<br/>` for line breaks.

    `#` goes first, so that a name holding `#quot;` shows as written. `style` and `classDef` are
    written with an entity too: Mermaid drops the last `;` of a line holding `style...:...#...;`
    before decoding entities, which would break the last entity of the label.
    """
    text = "".join(_MERMAID_ENTITIES.get(c, c) for c in text)
    text = text.replace("style", "#115;tyle").replace("classDef", "#99;lassDef")
    text = _LINE_BREAKS.sub("<br/>", text)
    return _CONTROL.sub(lambda m: f"#{ord(m.group())};", text)


def _mermaid_comment(text: str) -> str:
    """A `%%` comment stays on its line."""
    return " ".join(_CONTROL.sub(" ", text).split())


def to_mermaid(pipeline: Pipeline, plan: Plan) -> str:
    """A Mermaid flowchart of the plan, for Markdown pages (GitHub renders ```mermaid blocks)."""
    view = plan_view(pipeline, plan)

    def uid(i: int) -> str:
        return "sink" if i == view.sink else f"u{i}"

    def node(node_id: str, title: str, lines: list[str], shape: str = "box") -> str:
        label = "<br/>".join([f"<b>{_mermaid_text(title)}</b>", *(_mermaid_text(x) for x in lines if x)])
        if shape == "cylinder":
            return f'{node_id}[("{label}")]'
        return f'{node_id}["{label}"]'

    entry_ids = {entry: f"c{k}" for k, entry in enumerate(view.entries)}
    out = ["flowchart LR", f"  %% {_mermaid_comment(view.header())}"]
    note = view.savings_line()
    if note:
        out.append(f"  %% {_mermaid_comment(note)}")
    dp_models = _mermaid_text(_stage_loads(plan.data_process_models, plan.data_process_configs))
    out.append(f'  subgraph data_process["stage 1 · data_process: loads {dp_models}"]')
    for i in range(view.n):
        if i not in view.train:
            unit = view.active.units[i]
            out.append("    " + node(uid(i), unit.name, view.node_lines(i)))
    out.append("  end")
    out.append(f'  subgraph cache["cache · {len(view.entries)} entries ({_mermaid_text(plan.cache_mode)})"]')
    for (param, writer), node_id in entry_ids.items():
        out.append("    " + node(node_id, param, [f"← {view.writer_name(writer)}"], "cylinder"))
    out.append("  end")
    out.append(f'  subgraph train["stage 2 · train: loads {_mermaid_text(_stage_loads(plan.train_models, plan.train_configs))}"]')
    for i in range(view.n):
        if i in view.train:
            unit = view.active.units[i]
            out.append("    " + node(uid(i), unit.name, view.node_lines(i)))
    sink_models = view.vg.sink_models(frozenset(plan.models_require_backward))
    out.append("    " + node("sink", "loss (sink)", [", ".join(sink_models)]))
    out.append("  end")
    if view.inactive:
        out.append('  subgraph inactive["inactive: not run for this dataset"]')
        for k, unit, missing in view.inactive:
            out.append("    " + node(f"x{k}", unit.name, [", ".join(unit.models), view.inactive_line(unit, missing)]))
        out.append("  end")

    for (w, r), params in sorted(view.stage_reads().items()):
        label = ", ".join(params)
        if r != view.sink and r not in view.train and w in view.train:
            label += " (C1 violated)"
        out.append(f'  {uid(w)} -->|"{_mermaid_text(label)}"| {uid(r)}')
    for entry, node_id in entry_ids.items():
        writer = entry[1]
        if writer is not None:
            out.append(f"  {uid(writer)} ==> {node_id}")
        for reader in view.entry_readers.get(entry, []):
            out.append(f"  {node_id} ==> {uid(reader)}")
    for a, b, p in view.chain_edges():
        out.append(f'  {uid(a)} -.->|"{_mermaid_text(p)}"| {uid(b)}')

    out.append(f"  classDef dp fill:{DP_FILL},stroke:{DP_LINE}")
    out.append(f"  classDef entry fill:{CACHE_FILL},stroke:{CACHE_LINE}")
    if view.inactive:
        out.append(f"  classDef inactive fill:{INACTIVE_FILL},stroke:{INACTIVE_LINE},color:{INACTIVE_LINE},stroke-dasharray:4 3")
        out.append(f"  class {','.join(f'x{k}' for k, _, _ in view.inactive)} inactive")
    for rule, css in MERMAID_CLASS.items():
        width = ",stroke-width:3px" if rule in ("model", "nondeterministic") else ""
        out.append(f"  classDef {css} fill:{RULE_STYLE[rule][0]},stroke:#7f1d1d{width}")
    dp_ids = [uid(i) for i in range(view.n) if i not in view.train]
    if dp_ids:
        out.append(f"  class {','.join(dp_ids)} dp")
    if entry_ids:
        out.append(f"  class {','.join(entry_ids.values())} entry")
    for rule, css in MERMAID_CLASS.items():
        ids = [uid(i) for i, r in view.rules.items() if r == rule]
        if ids:
            out.append(f"  class {','.join(ids)} {css}")
    cache_links = [k for k, line in enumerate(_link_lines(out)) if "==>" in line]
    if cache_links:
        out.append(f"  linkStyle {','.join(map(str, cache_links))} stroke:{CACHE_LINE},stroke-width:3px")
    return "\n".join(out) + "\n"


def _link_lines(lines: list[str]) -> list[str]:
    """The link statements in order (Mermaid numbers links from 0 for linkStyle)."""
    return [line for line in lines if any(arrow in line for arrow in (" --> ", "-->|", " ==> ", "-.->"))]


# --- text (rich) ---------------------------------------------------------------------------------


def text_renderables(pipeline: Pipeline, plan: Plan) -> list[Any]:
    """Rich renderables: header, units table, cache entries, models per stage, checks, note."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    view = plan_view(pipeline, plan)
    out: list[Any] = [Text(view.header(), style="bold")]
    if plan.extra.get("provided") is not None:
        provided = ", ".join(plan.extra["provided"]) or "nothing"
        inactive = ", ".join(u.name for _, u, _ in view.inactive) or "none"
        out.append(Text(f"dataset provides: {provided} · inactive units: {inactive}", style="dim"))

    cached_by: dict[int | None, list[str]] = {}
    for param, writer in view.entries:
        cached_by.setdefault(writer, []).append(param)

    units = Table(title="units", title_justify="left", box=box.SIMPLE_HEAD, show_lines=False, pad_edge=False)
    units.add_column("#", justify="right", style="dim", no_wrap=True)
    # long block paths (diffusers: `denoise.img2img.prepare_img2img_latents`) fold rather than crush the rest
    units.add_column("unit", overflow="fold", max_width=44, style="bold")
    units.add_column("stage", no_wrap=True)
    units.add_column("models", overflow="fold", min_width=12)
    units.add_column("why", overflow="fold", ratio=1)
    inactive = {k: missing for k, _, missing in view.inactive}
    position = 0
    for k, unit in enumerate(pipeline.units):
        if k in inactive:
            units.add_row(str(k + 1), unit.name, Text("inactive", style="dim"), _unit_models(unit),
                          view.inactive_line(unit, inactive[k]) + " (dropped before the split)", style="dim")
            continue
        i = position
        position += 1
        if i in view.train:
            stage = Text("train", style="bold red")
            why = plan.reasons.get(unit.name, "(no reason recorded)")
        else:
            stage = Text("data_process", style="blue")
            cached = cached_by.get(i, [])
            why = f"stage 1; cached: {', '.join(cached)}" if cached else "stage 1; used inside stage 1 only"
        units.add_row(str(k + 1), unit.name, stage, _unit_models(unit), why)
    out.append(units)

    cache = Table(title=f"cache entries ({len(view.entries)}, {plan.cache_mode} mode)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    cache.add_column("param", no_wrap=True, style="bold")
    cache.add_column("version (writer)", no_wrap=True)
    cache.add_column("read in stage 2 by", overflow="fold", ratio=1)
    for entry in view.entries:
        param, writer = entry
        readers = ", ".join(view.reader_name(r) for r in view.entry_readers.get(entry, [])) or "-"
        cache.add_row(param, view.writer_name(writer), readers)
    out.append(cache)

    models = Text()
    models.append("models loaded per stage\n", style="bold")
    models.append(f"  stage 1 (data_process): {_stage_loads(plan.data_process_models, plan.data_process_configs)}\n")
    models.append(f"  stage 2 (train):        {_stage_loads(plan.train_models, plan.train_configs)}")
    out.append(models)

    checks = Text()
    checks.append("checks: ", style="bold")
    for k, (name, value) in enumerate(plan.checks.items()):
        if k:
            checks.append("   ")
        if value is None:
            checks.append(f"{name} not required ({plan.cache_mode})", style="dim")
        elif value:
            checks.append(f"{name} ok", style="green")
        else:
            checks.append(f"{name} FAILED", style="bold red")
    out.append(checks)

    note = view.savings_line()
    if note:
        out.append(Text(note, style="yellow"))
    return out


def render_text(pipeline: Pipeline, plan: Plan, width: int = TEXT_WIDTH) -> str:
    """The text view as plain text (no colour), at a fixed width so it is the same everywhere."""
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False, force_jupyter=False,
                      highlight=False, emoji=False, legacy_windows=False, soft_wrap=False)
    for item in text_renderables(pipeline, plan):
        console.print(item)
    return buffer.getvalue()


# --- one entry point ------------------------------------------------------------------------------


def format_for_path(path: str | Path) -> str | None:
    """The format a file name asks for by its suffix (None when the suffix says nothing)."""
    return SUFFIX_FORMATS.get(Path(path).suffix.lower())


def render(pipeline: Pipeline, plan: Plan, fmt: str) -> bytes | str:
    """Any format of FORMATS: bytes for svg/png/pdf, text for dot/mermaid/text."""
    if fmt in IMAGE_FORMATS:
        return render_image(pipeline, plan, fmt)
    if fmt == "dot":
        return dot_source(pipeline, plan)
    if fmt == "mermaid":
        return to_mermaid(pipeline, plan)
    if fmt == "text":
        return render_text(pipeline, plan)
    raise ValueError(f"unknown format {fmt!r} (formats: {', '.join(FORMATS)})")


__all__ = [
    "FORMATS",
    "GraphvizNotFound",
    "PlanView",
    "dot_available",
    "dot_source",
    "format_for_path",
    "plan_view",
    "render",
    "render_image",
    "render_text",
    "text_renderables",
    "to_graphviz",
    "to_mermaid",
]

"""How the core's modules import each other (CONTRIBUTING.md, 'Imports in the core').

Two things went wrong there and are checked here so they cannot come back unseen:
- a package attribute hid a submodule of the same name (`unitgraph.split`, the function, over the
  module that computes TRAIN, now `unitgraph.closure`), so `import unitgraph.split as m` gave the
  function;
- import cycles (graph <-> spec, plan <-> verify) were hidden behind imports inside functions. Such
  an import still makes each module depend on the other; it only postpones the failure to the first
  call that takes an unusual path. The cycle test therefore reads every import statement wherever it
  stands (module level, function bodies, `if TYPE_CHECKING:` blocks), not only what runs on import.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import types
from pathlib import Path

import networkx as nx
import pytest

import unitgraph
from unitgraph.graph import VersionGraph
from unitgraph.spec import Pipeline, Sink, Unit

CORE = Path(unitgraph.__file__).resolve().parent
# The torch-free core: the package's own modules, its adapters and examples. (cli and backends are
# installed under the unitgraph name too, but live in other folders and are not the core.)
CORE_FOLDERS = (CORE, CORE / "adapters", CORE / "examples")


def core_sources() -> tuple[dict[str, str], set[str]]:
    """Source text of every core module by dotted name (a package by its __init__.py), and which
    of them are packages."""
    sources, packages = {}, set()
    for folder in CORE_FOLDERS:
        for path in sorted(folder.glob("*.py")):
            parts = path.relative_to(CORE.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
                packages.add(".".join(parts))
            sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources, packages


def import_graph(sources: dict[str, str], packages: set[str] | None = None) -> nx.DiGraph:
    """Edge a -> b when module a has an import statement, anywhere in it, that names module b.

    Relative imports are resolved the way Python does (from a package's own name, or from a
    module's parent); `from package import name` also counts as importing the submodule
    package.name when there is one. Only modules of `sources` are nodes: the parent packages Python
    imports implicitly are left out, since every submodule would otherwise form a "cycle" with the
    package __init__ that imports it. `packages` defaults to the names other names extend.
    """
    if packages is None:
        packages = {name for name in sources if any(other.startswith(name + ".") for other in sources)}
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for name, text in sources.items():
        package = name if name in packages else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(text, filename=name)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                if target in sources:
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def describe(graph: nx.DiGraph, cycle: list[str]) -> str:
    steps = zip(cycle, cycle[1:] + cycle[:1])
    return " -> ".join(f"{a} (line {graph.edges[a, b]['line']})" for a, b in steps) + f" -> {cycle[0]}"


# --- names ---------------------------------------------------------------------------------------


def test_the_closure_module_is_importable_by_its_name():
    import unitgraph.closure as closure

    assert isinstance(closure, types.ModuleType)
    assert closure is importlib.import_module("unitgraph.closure")
    assert callable(closure.train_set) and closure.CACHE_MODES == (closure.LATEST, closure.VERSIONED)


def test_unitgraph_split_is_the_planning_function_and_no_module():
    from unitgraph.plan import split

    assert unitgraph.split is split
    assert not isinstance(unitgraph.split, types.ModuleType)
    assert importlib.util.find_spec("unitgraph.split") is None
    pipeline = Pipeline("tiny", (Unit("Embed", ("prompt",), ("emb",), ("text_encoder",)),), Sink(("emb",), ("dit",)))
    plan = unitgraph.split(pipeline, lora_base_model="dit")
    assert plan.data_process_units == ["Embed"] and plan.checks_pass


# `unitgraph.split` and `unitgraph.verify` are the package's functions; their modules are closure.py and
# soundness.py, so no function hides a module of the same name.
@pytest.mark.parametrize("name", [name for name in sorted(core_sources()[0]) if "." in name])
def test_no_package_attribute_hides_a_submodule(name):
    module = importlib.import_module(name)
    parent, _, child = name.rpartition(".")
    attribute = getattr(importlib.import_module(parent), child)
    assert attribute is module, f"{parent}.{child} is {attribute!r}, which hides the module {name}"


# --- cycles ----------------------------------------------------------------------------------------


def test_the_cycle_finder_sees_imports_inside_functions_and_type_checking_blocks():
    """The test below is only worth something if this finder can fail: give it the hidden kinds."""
    in_function = {
        "pkg": "",
        "pkg.a": "from .b import f\n",
        "pkg.b": "def f():\n    from .a import g\n    return g\n",
    }
    assert list(nx.simple_cycles(import_graph(in_function))) != []
    type_only = {
        "pkg": "",
        "pkg.a": "import pkg.b\n",
        "pkg.sub": "",
        "pkg.sub.b": "",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
    }
    assert [sorted(c) for c in nx.simple_cycles(import_graph(type_only))] == [["pkg.a", "pkg.b"]]
    relative_up = {"pkg": "", "pkg.sub": "from ..c import x\n", "pkg.sub.d": "", "pkg.c": "from .sub import d\n"}
    graph = import_graph(relative_up)
    assert graph.has_edge("pkg.sub", "pkg.c") and graph.has_edge("pkg.c", "pkg.sub.d")
    assert list(nx.simple_cycles(graph)) != []


def test_the_core_modules_import_each_other_without_a_cycle():
    graph = import_graph(*core_sources())
    # the graph is the real one: known edges of each kind are there
    assert {"unitgraph.closure", "unitgraph.planfile", "unitgraph.adapters.diffsynth", "unitgraph.examples"} <= set(graph)
    assert graph.has_edge("unitgraph.graph", "unitgraph.spec")  # from .spec import Pipeline
    assert graph.has_edge("unitgraph.plan", "unitgraph.soundness")  # split() verifies what it made
    assert graph.has_edge("unitgraph.soundness", "unitgraph.planfile")
    assert graph.has_edge("unitgraph.render", "unitgraph.explain")  # an import inside a method
    assert graph.has_edge("unitgraph.adapters.diffsynth", "unitgraph.errors")  # from ..errors
    assert graph.has_edge("unitgraph.examples", "unitgraph.spec")  # absolute
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, "import cycles among the core modules:\n" + "\n".join(describe(graph, c) for c in cycles[:10])


# --- the version graph, now kept by graph.py ------------------------------------------------------


def test_a_pipeline_keeps_its_version_graph_without_changing_what_it_is():
    units = (Unit("A", (), ("x",)), Unit("B", ("x",), ("y",)))
    pipeline, twin = Pipeline("p", units), Pipeline("p", units)
    before = (repr(pipeline), hash(pipeline))
    vg = VersionGraph.of(pipeline)
    assert VersionGraph.of(pipeline) is vg and vg.pipeline is pipeline
    assert VersionGraph.of(twin) is not vg  # equal pipelines from other sources keep their own
    assert (repr(pipeline), hash(pipeline)) == before and pipeline == twin
    assert vg.reaching == VersionGraph(pipeline).reaching


def test_spec_does_not_need_the_graph_module():
    """The declarations are the bottom layer: spec.py names no module that builds on it."""
    graph = import_graph(*core_sources())
    assert not nx.has_path(graph, "unitgraph.spec", "unitgraph.graph")

"""How the diffusion backend's modules import each other: no cycles, and data flowing down through its rooms.

The backend is a few modules that tie a run together above four rooms (models/, data/, cache/, train/) and
the families, all standing on a small foundation of shared vocabulary (CONTRIBUTING.md has the map):

    run        args, choice, config, experts, memory_plan, memory_trace, registry, session, stage1, stage1_key, stages,
               untrained
    above      diffsynth_source/          (DiffSynth's own pipelines run: it reads the run's args; the CLI calls it)
    rooms 2    train/, families/          (each may use the rooms below, never the other)
    rooms 1    models/, data/, cache/     (each uses only itself and the foundation)
    foundation errors, randomness, family, context, flowmatch, ddpm, caption_dropout, masked_loss, report, result,
               tensorfile

An import goes down, or stays inside its own room. An import inside `if TYPE_CHECKING:` (a type for an
annotation: a room's functions take the run's `RunConfig`) carries no run-time dependence, so it may
point up; it still counts for cycles, as in the core's test (tests/test_core_imports.py).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import networkx as nx
import pytest

from test_core_imports import describe, import_graph

REPO = Path(__file__).resolve().parent.parent
BACKEND = REPO / "backends" / "diffusion"
PACKAGE = "unitgraph.backends.diffusion"

FOUNDATION = ("errors", "randomness", "family", "context", "flowmatch", "ddpm", "caption_dropout", "masked_loss",
              "report", "result", "tensorfile", "engine")
RUN = ("args", "choice", "config", "experts", "memory_plan", "memory_trace", "registry", "session", "stage1",
       "stage1_key", "stages", "untrained")
# rank of each room: an import may go to a lower rank, or stay in its own room
ROOMS = {"models": 1, "data": 1, "cache": 1, "train": 2, "families": 2, "diffsynth_source": 4}


def backend_sources() -> tuple[dict[str, str], set[str]]:
    """Source of every backend module by dotted name (a package by its __init__.py), and the packages."""
    sources, packages = {}, set()
    for path in sorted(BACKEND.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(BACKEND).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources, packages


def room(module: str) -> tuple[str, int]:
    """(room, rank) of a backend module: a room folder, the foundation (rank 0) or the run (rank 3)."""
    rel = module[len(PACKAGE):].lstrip(".")
    if not rel:
        return "run", 3
    head = rel.split(".")[0]
    if head in ROOMS:
        return head, ROOMS[head]
    if head in FOUNDATION:
        return "foundation", 0
    if head in RUN:
        return "run", 3
    raise AssertionError(f"{module} is in no room: add it to FOUNDATION, RUN or a room folder (and to CONTRIBUTING.md)")


def type_only_lines(text: str) -> set[int]:
    """Line numbers of the imports inside `if TYPE_CHECKING:` blocks."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        lines.add(sub.lineno)
    return lines


def upward_imports(sources: dict[str, str], packages: set[str]) -> list[str]:
    """Every run-time import that goes up a rank or across to another room of the same rank."""
    graph = import_graph(sources, packages)
    bad = []
    for a, b, data in graph.edges(data=True):
        if data["line"] in type_only_lines(sources[a]):
            continue
        (room_a, rank_a), (room_b, rank_b) = room(a), room(b)
        if room_a == room_b or rank_b < rank_a:
            continue
        bad.append(f"{a} (line {data['line']}) imports {b}: {room_a} may not use {room_b}")
    return sorted(bad)


def test_the_layering_check_can_fail():
    """The checks below are only worth something if they see an upward import, a sideways one, and a cycle."""
    p = PACKAGE
    sources = {
        p: "", f"{p}.errors": "", f"{p}.config": "", f"{p}.cache": "", f"{p}.models": "",
        f"{p}.cache.store": "from ..config import X\n",  # up, at run time
        f"{p}.cache.keys": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..config import X\n",  # fine
        f"{p}.models.hub": "from ..cache.store import S\n",  # sideways between two rank-1 rooms
        f"{p}.models.lora": "from ..errors import BackendError\n",  # down: fine
    }
    packages = {p, f"{p}.cache", f"{p}.models"}
    bad = upward_imports(sources, packages)
    assert len(bad) == 2 and "cache.store" in bad[0] and "models.hub" in bad[1], bad
    with pytest.raises(AssertionError, match="in no room"):
        room(f"{p}.somewhere_new")


def test_the_backend_imports_without_a_cycle():
    graph = import_graph(*backend_sources())
    graph.remove_edges_from(list(nx.selfloop_edges(graph)))  # a package's `from . import units`
    # the graph is the real one: known edges of each kind are there
    assert graph.has_edge(f"{PACKAGE}.stages", f"{PACKAGE}.train.loop")  # module level
    assert graph.has_edge(f"{PACKAGE}.cache.cache", f"{PACKAGE}.cache.location")  # inside a function
    assert graph.has_edge(f"{PACKAGE}.train.loop", f"{PACKAGE}.config")  # type-only
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], "import cycles: " + "; ".join(describe(graph, c) for c in cycles)


def test_imports_flow_down_through_the_rooms():
    assert upward_imports(*backend_sources()) == []


def test_every_backend_module_says_what_it_is_for():
    missing = []
    for name, text in backend_sources()[0].items():
        doc = ast.get_docstring(ast.parse(text))
        if not doc or len(doc.splitlines()[0].split()) < 3:
            missing.append(name)
    assert missing == []


def test_every_package_folder_is_installed():
    """A folder missing from pyproject's package list works in an editable install and is absent from a wheel."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"backends": "unitgraph.backends", "cli": "unitgraph.cli", "unitgraph": "unitgraph"}
    found = set()
    for folder, name in folders.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set()


def test_contributing_maps_every_room_and_top_module():
    text = (REPO / "CONTRIBUTING.md").read_text()
    for name in (*FOUNDATION, *RUN):
        assert re.search(rf"`{name}\.py`", text), name
    for name in ROOMS:
        assert f"`{name}/`" in text, name


def private_imports(source: str) -> list[str]:
    """`from <a backend module> import _name` anywhere in `source` (a module's private name used by another)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            out += [alias.name for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return out


def test_no_module_imports_another_modules_private_names():
    assert private_imports("from .folders import _read_json, shorten\nfrom __future__ import annotations\n") == \
        ["_read_json"]  # the check can fail
    found = {str(path.relative_to(BACKEND)): names for path in sorted(BACKEND.rglob("*.py"))
             if (names := private_imports(path.read_text(encoding="utf-8")))}
    assert found == {}

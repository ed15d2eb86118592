"""`unitgraph inspect`: Graphviz, Mermaid and text views of a plan, and the CLI around them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unitgraph import split
from unitgraph.render import (
    GraphvizNotFound,
    dot_source,
    plan_view,
    render,
    render_image,
    render_text,
    to_mermaid,
)
from unitgraph.spec import Pipeline, Sink, Unit, pipeline_from_dict, read_spec_file

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "unitgraph" / "examples"
SVG = "{http://www.w3.org/2000/svg}"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")


def example(name: str) -> Pipeline:
    return read_spec_file(EXAMPLES / f"{name}.json")


def two_versions() -> Pipeline:
    """Versioned mode caches two versions of p: A's for the train unit T, B's for the sink."""
    return Pipeline(
        "two_versions",
        (
            Unit("A", ("x",), ("p",)),
            Unit("T", ("p",), ("q",), ("te",)),
            Unit("B", ("p",), ("p",)),
        ),
        Sink(("q", "p"), ("dit",)),
    )


def big_pipeline(n: int = 36) -> Pipeline:
    """A wide pipeline like the video ones: a shape check, many encoders, a trained control branch."""
    units = [Unit("ShapeChecker", ("height", "width", "num_frames"), ("height", "width", "num_frames"))]
    models = ["vae", "text_encoder", "image_encoder", "audio_encoder"]
    for i in range(1, n):
        inputs = ["height", "width", f"raw_{i}"]
        if i > 3 and i % 3 == 0:
            inputs.append(f"feat_{i - 2}")
        model = ("controlnet",) if i % 11 == 0 else ((models[i % 4],) if i % 2 else ())
        units.append(Unit(f"Unit{i:02d}", tuple(inputs), (f"feat_{i}",), model, deterministic=i != 17))
    return Pipeline("big", tuple(units), Sink(tuple(f"feat_{i}" for i in range(1, n, 2)), ("dit",)))


CASES = [
    ("qwen_image", dict(lora_base_model="dit")),
    ("qwen_image", dict(trainable_models=["text_encoder"], lora_base_model="dit")),
    ("z_image", dict(lora_base_model="text_encoder")),
    ("z_image", dict(lora_base_model="text_encoder", cache_mode="versioned")),
]


def case_plan(name, kwargs):
    pipeline = example(name)
    return pipeline, split(pipeline, **kwargs)


# --- Graphviz ------------------------------------------------------------------------------------


def svg_nodes(svg: bytes) -> tuple[ET.Element, dict[str, list[str]], set[str]]:
    """Parse an SVG: (root, node id -> texts in that node, cluster titles)."""
    root = ET.fromstring(svg)
    nodes: dict[str, list[str]] = {}
    clusters: set[str] = set()
    for g in root.iter(f"{SVG}g"):
        title = g.find(f"{SVG}title")
        if title is None:
            continue
        texts = ["".join(t.itertext()).strip() for t in g.iter(f"{SVG}text")]
        if g.get("class") == "node":
            nodes[title.text] = texts
        elif g.get("class") == "cluster":
            clusters.add(title.text)
    return root, nodes, clusters


@needs_dot
@pytest.mark.parametrize("name,kwargs", CASES)
def test_svg_has_every_unit_both_clusters_and_every_cache_entry(name, kwargs):
    pipeline, plan = case_plan(name, kwargs)
    _, nodes, clusters = svg_nodes(render_image(pipeline, plan, "svg"))
    assert {"cluster_data_process", "cluster_train", "cluster_cache"} <= clusters
    all_texts = [t for texts in nodes.values() for t in texts]
    for i, unit in enumerate(pipeline.units):
        assert unit.name in nodes[f"u{i}"], unit.name
        assert unit.name in all_texts
    view = plan_view(pipeline, plan)
    assert len(view.entries) == len(plan.cache_entries)
    for k, (param, writer) in enumerate(plan.cache_entries):
        texts = nodes[f"c{k}"]
        assert param in texts
        assert f"← {writer or 'dataset'}" in texts


@needs_dot
def test_svg_versioned_shows_two_versions_of_one_param():
    pipeline = two_versions()
    plan = split(pipeline, lora_base_model="te", cache_mode="versioned")
    assert plan.train_units == ["T"]
    assert plan.cache_entries == [("p", "A"), ("p", "B")]
    _, nodes, _ = svg_nodes(render_image(pipeline, plan, "svg"))
    shown = {(texts[0], texts[1]) for node, texts in nodes.items() if node.startswith("c")}
    assert ("p", "← A") in shown and ("p", "← B") in shown


@needs_dot
def test_svg_marks_seeds_and_pulled_in_units_and_shows_the_note():
    pipeline, plan = case_plan("z_image", dict(lora_base_model="text_encoder"))
    svg = render_image(pipeline, plan, "svg").decode()
    _, nodes, _ = svg_nodes(svg.encode())
    position = {u.name: i for i, u in enumerate(pipeline.units)}
    assert "X0: calls text_encoder (backward)" in nodes[f"u{position['PromptEmbedder']}"]
    assert "W: writes edit_image after PromptEmbedder read it" in nodes[f"u{position['EditImageAutoResize']}"]
    assert "F: reads edit_image ← EditImageAutoResize" in nodes[f"u{position['EditImageEmbedder']}"]
    assert "X0: non-deterministic" in nodes[f"u{position['NoiseInitializer']}"]
    assert "legend" not in nodes  # the legend is part of the graph label, not a node
    assert "versioned would keep siglip, vae out of training" in svg
    assert "W: writes a param after a train unit read or wrote it" in svg  # legend row


@needs_dot
def test_png_and_pdf_are_real_images():
    pipeline, plan = case_plan("qwen_image", dict(lora_base_model="dit"))
    assert render(pipeline, plan, "png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert render(pipeline, plan, "pdf")[:5] == b"%PDF-"


@needs_dot
def test_big_pipeline_renders_every_unit():
    pipeline = big_pipeline()
    plan = split(pipeline, trainable_models=["controlnet"], lora_base_model="dit")
    assert len(pipeline.units) >= 30
    _, nodes, _ = svg_nodes(render_image(pipeline, plan, "svg"))
    for i, unit in enumerate(pipeline.units):
        assert unit.name in nodes[f"u{i}"]


def test_dot_source_needs_no_binary_and_draws_update_chains(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on PATH
    pipeline = Pipeline(
        "chains",
        (
            Unit("Seed", ("a",), ("p",), ("te",)),
            Unit("Overwrite", ("b",), ("p",)),  # blind overwrite of p: a dashed chain edge
            Unit("Update", ("p",), ("p",)),  # in-place update: "↻ updates p"
        ),
        Sink(("p",), ("dit",)),
    )
    plan = split(pipeline, lora_base_model="te")
    source = dot_source(pipeline, plan)
    assert "cluster_data_process" in source and "cluster_train" in source and "cluster_cache" in source
    assert re.search(r"u0 -> u1 \[[^\]]*style=dashed", source)
    assert "↻ updates p" in source
    assert "rankdir=LR" in source


def test_tampered_plan_draws_the_c1_violation():
    pipeline, plan = case_plan("z_image", dict(lora_base_model="text_encoder"))
    plan.train_units.remove("EditImageEmbedder")
    plan.data_process_units.append("EditImageEmbedder")
    source = dot_source(pipeline, plan)
    assert "C1 violated" in source


def test_render_image_reports_missing_graphviz(monkeypatch):
    graphviz = pytest.importorskip("graphviz")

    def missing(*args, **kwargs):
        raise graphviz.ExecutableNotFound(("dot", "-Tsvg"))

    monkeypatch.setattr(graphviz.Digraph, "pipe", missing)
    pipeline, plan = case_plan("qwen_image", dict(lora_base_model="dit"))
    with pytest.raises(GraphvizNotFound) as info:
        render_image(pipeline, plan, "svg")
    assert "apt-get install graphviz" in info.value.one_line()


# --- Mermaid and text ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,kwargs", CASES)
def test_mermaid_has_a_node_per_unit_and_the_cache_edges(name, kwargs):
    pipeline, plan = case_plan(name, kwargs)
    text = to_mermaid(pipeline, plan)
    lines = [line.strip() for line in text.splitlines()]
    assert lines[0] == "flowchart LR"
    for i, unit in enumerate(pipeline.units):
        assert sum(1 for line in lines if line.startswith(f'u{i}["<b>{unit.name}</b>')) == 1, unit.name
    assert 'subgraph data_process["' in text and 'subgraph train["' in text and 'subgraph cache["' in text
    view = plan_view(pipeline, plan)
    position = {u.name: i for i, u in enumerate(pipeline.units)}
    for k, (param, writer) in enumerate(plan.cache_entries):
        assert any(line.startswith(f'c{k}[("<b>{param}</b><br/>← {writer or "dataset"}")]') for line in lines)
        if writer is not None:
            assert f"u{position[writer]} ==> c{k}" in lines
        readers = view.entry_readers[view.entries[k]]
        assert readers, "every cache entry is read in stage 2"
        for r in readers:
            assert f"c{k} ==> {'sink' if r == len(pipeline.units) else f'u{r}'}" in lines


@pytest.mark.parametrize("name,kwargs", CASES)
def test_text_lists_every_unit_entry_models_and_checks(name, kwargs):
    pipeline, plan = case_plan(name, kwargs)
    text = render_text(pipeline, plan)
    for unit in pipeline.units:
        assert re.search(rf"\b{unit.name}\b", text), unit.name
    for param, writer in plan.cache_entries:
        assert re.search(rf"{param}\s+{writer or 'dataset'}", text)
    assert f"stage 1 (data_process): {', '.join(plan.data_process_models) or 'none'}" in text
    assert f"stage 2 (train):        {', '.join(plan.train_models)}" in text
    assert "C1 ok" in text and "equivalence ok" in text
    if plan.cache_mode == "versioned":
        assert "C2 not required (versioned)" in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_text_has_the_versioned_note_only_when_it_applies():
    pipeline = example("z_image")
    latest = render_text(pipeline, split(pipeline, lora_base_model="text_encoder"))
    assert "note: --cache-mode versioned would keep siglip, vae out of training" in latest
    versioned = render_text(pipeline, split(pipeline, lora_base_model="text_encoder", cache_mode="versioned"))
    assert "note:" not in versioned
    qwen = example("qwen_image")
    assert "note:" not in render_text(qwen, split(qwen, lora_base_model="dit"))


# --- the command ---------------------------------------------------------------------------------


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from unitgraph.cli.app import main; main()", *args],
        capture_output=True,
        env=env,
        cwd=cwd,
        timeout=60,
    )


def test_cli_text_is_the_default(tmp_path):
    spec = str(EXAMPLES / "qwen_image.json")
    result = run_cli("inspect", spec, "--lora-base-model", "dit")
    assert result.returncode == 0, result.stderr
    out = result.stdout.decode()
    for unit in example("qwen_image").units:
        assert unit.name in out
    assert "models loaded per stage" in out


@needs_dot
def test_cli_writes_svg_atomically_with_format_from_suffix(tmp_path):
    spec = str(EXAMPLES / "z_image.json")
    target = tmp_path / "z.svg"
    result = run_cli("inspect", spec, "--lora-base-model", "text_encoder", "-o", str(target))
    assert result.returncode == 0, result.stderr
    ET.fromstring(target.read_bytes())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z.svg"]  # no temporary file left behind
    err = result.stderr.decode()
    assert "wrote" in err and "versioned would keep siglip, vae" in err


@needs_dot
def test_cli_svg_to_stdout():
    result = run_cli("inspect", str(EXAMPLES / "qwen_image.json"), "--format", "svg")
    assert result.returncode == 0, result.stderr
    ET.fromstring(result.stdout)


def test_cli_without_dot_binary(tmp_path):
    """svg/png/pdf: exit 2, one line naming how to install Graphviz, no file; dot/mermaid/text still work."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty)}
    spec = str(EXAMPLES / "qwen_image.json")
    for fmt in ("svg", "png", "pdf"):
        target = tmp_path / f"plan.{fmt}"
        result = run_cli("inspect", spec, "--lora-base-model", "dit", "--format", fmt, "-o", str(target), env=env)
        assert result.returncode == 2, result.stderr
        err = result.stderr.decode()
        assert len(err.strip().splitlines()) == 1, err
        assert "apt-get install graphviz" in err and "Traceback" not in err
        assert not target.exists()
    for fmt in ("dot", "mermaid", "text"):
        result = run_cli("inspect", spec, "--lora-base-model", "dit", "--format", fmt, env=env)
        assert result.returncode == 0, result.stderr
        assert "ShapeChecker" in result.stdout.decode()


def test_cli_bad_format_and_unknown_suffix_are_exit_2(tmp_path):
    spec = str(EXAMPLES / "qwen_image.json")
    for args in (("--format", "jpeg"), ("-o", str(tmp_path / "plan.xyz"))):
        result = run_cli("inspect", spec, *args)
        assert result.returncode == 2
        assert len(result.stderr.decode().strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_mermaid_and_dot_files(tmp_path):
    spec = str(EXAMPLES / "qwen_image.json")
    for name, marker in (("plan.mmd", "flowchart LR"), ("plan.dot", "digraph qwen_image"), ("plan.txt", "units")):
        result = run_cli("inspect", spec, "--lora-base-model", "dit", "-o", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        assert marker in (tmp_path / name).read_text(encoding="utf-8")


# --- Mermaid escaping: any name the spec loader accepts ------------------------------------------

# what the spec loader accepts as a name: any string that is not empty or all whitespace. Tokens
# that mean something to Mermaid (quotes, line breaks, entity codes, link and comment syntax) are
# drawn often, next to arbitrary characters.
_TOKENS = st.one_of(
    st.sampled_from(['"', "'", "\n", "\r", "\r\n", "\u2028", "\x85", "\x0b", "\t", "#", "#quot;", "#35;", ";", "|",
                     "<", ">", "<br/>", "&amp;", "`", "[", "]", "(", ")", "{", "}", "%%", "-->", "end", "style:x#1;",
                     "classDef", ":", "\\", " ", "é", "→"]),
    st.characters(blacklist_categories=("Cs",)),
)
_NAMES = st.lists(_TOKENS, min_size=1, max_size=6).map("".join).filter(lambda s: s.strip())

_LABEL = '[^"\\n\\r\\x0b\\x0c\\x1c\\x1d\\x1e\\x85\\u2028\\u2029]*'
_ID = r"[A-Za-z_]\w*"
_STATEMENTS = re.compile("|".join([
    "flowchart LR",
    "  %% [^\\n\\r\\x0b\\x0c\\x1c\\x1d\\x1e\\x85\\u2028\\u2029]*",
    f'  subgraph {_ID}\\["{_LABEL}"\\]',
    f'    {_ID}\\["{_LABEL}"\\]',
    f'    {_ID}\\[\\("{_LABEL}"\\)\\]',
    "  end",
    f'  {_ID} -->\\|"{_LABEL}"\\| {_ID}',
    f'  {_ID} -\\.->\\|"{_LABEL}"\\| {_ID}',
    f"  {_ID} ==> {_ID}",
    r'  classDef \w+ [^\s"]+',
    r"  class [\w,]+ \w+",
    r'  linkStyle [\d,]+ [^\s"]+',
]))


def _mermaid_decoded(label: str) -> str:
    """What Mermaid shows for an escaped label: entity codes decoded, <br/> as a line break."""
    named = {"quot": '"', "lt": "<", "gt": ">", "amp": "&"}
    text = label.replace("<br/>", "\n")
    return re.sub(r"#(\d+|quot|lt|gt|amp);", lambda m: named.get(m[1]) or chr(int(m[1])), text)


@st.composite
def _named_pipelines(draw):
    unit_names = draw(st.lists(_NAMES, min_size=1, max_size=5, unique=True))
    params = draw(st.lists(_NAMES, min_size=1, max_size=5, unique=True))
    models = draw(st.lists(_NAMES, max_size=3, unique=True))
    units = [{"name": name,
              "inputs": draw(st.lists(st.sampled_from(params), max_size=3, unique=True)),
              "outputs": draw(st.lists(st.sampled_from(params), max_size=2, unique=True)),
              "models": draw(st.lists(st.sampled_from(models), max_size=2, unique=True)) if models else [],
              "deterministic": draw(st.booleans())}
             for name in unit_names]
    data = {"name": draw(_NAMES), "units": units}
    if draw(st.booleans()):
        data["sink"] = {"inputs": draw(st.lists(st.sampled_from(params), max_size=3, unique=True)),
                        "models": draw(st.lists(st.sampled_from(models), max_size=2, unique=True)) if models else []}
    pipeline = pipeline_from_dict(data)  # the spec loader accepts these names
    # a trained model is one something calls (named as the CLI would: trainable names are stripped)
    called = [m for m in pipeline.models if m == m.strip()]
    trained = draw(st.lists(st.sampled_from(called), max_size=2, unique=True)) if called else []
    return pipeline, trained, draw(st.sampled_from(["latest", "versioned"]))


@settings(max_examples=150, deadline=None)
@given(_named_pipelines())
def test_mermaid_escapes_any_name_the_spec_loader_accepts(case):
    pipeline, trained, mode = case
    plan = split(pipeline, trained, cache_mode=mode)
    text = to_mermaid(pipeline, plan)
    lines = text[:-1].split("\n")  # Mermaid's lines: a raw line break in a label would make a new one
    for line in lines:
        assert _STATEMENTS.fullmatch(line), repr(line)
    definitions = [re.match(r"    (u\d+)\[\"(.*)\"\]$", line) for line in lines]
    definitions = [m for m in definitions if m]
    assert sorted(m[1] for m in definitions) == sorted(f"u{i}" for i in range(len(pipeline.units)))
    for m in definitions:
        title = re.match(r"<b>(.*?)</b>", m[2])[1]
        assert "<" not in title.replace("<br/>", "") and ">" not in title.replace("<br/>", "")
        name = pipeline.units[int(m[1][1:])].name
        assert _mermaid_decoded(title) == re.sub("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]", "\n", name)

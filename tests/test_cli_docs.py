"""The docs cannot drift: the CLI reference is regenerated, examples and outputs are re-run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import unitgraph
from unitgraph.cli.docgen import generate
from unitgraph.graph import VersionGraph
from unitgraph.plan import plan_from_train_set
from unitgraph.spec import pipeline_from_dict
from unitgraph.closure import backward_models, update_chain_train_set

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def block_after(text: str, marker: str) -> str:
    """The fenced code block that follows an HTML comment marker."""
    match = re.search(re.escape(f"<!-- {marker} -->") + r"\s*```[a-z]*\n(.*?)```", text, re.S)
    assert match, f"no code block after marker {marker!r}"
    return match.group(1)


# --- docs/cli.md -----------------------------------------------------------------------------------


def test_cli_reference_is_generated_from_the_app():
    assert read("cli.md") == generate(), "docs/cli.md is stale: python -m unitgraph.cli.docgen > docs/cli.md"


def test_cli_reference_covers_every_command_and_option():
    from typer.main import get_command

    from unitgraph.cli.app import app

    text = read("cli.md")
    root = get_command(app)
    for name, command in root.commands.items():
        assert f"## `unitgraph {name}`" in text
        for param in command.params:
            for opt in (*param.opts, *param.secondary_opts):
                if opt != "--help" and param.param_type_name == "option":
                    assert f"`{opt}`" in text, opt


def test_docgen_output_does_not_depend_on_the_terminal():
    env = {**os.environ, "COLUMNS": "30", "TERM": "xterm-256color", "FORCE_COLOR": "1"}
    result = subprocess.run([sys.executable, "-m", "unitgraph.cli.docgen"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == generate()
    check = subprocess.run([sys.executable, "-m", "unitgraph.cli.docgen", "--check", str(DOCS / "cli.md")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


# --- docs/semantics.md: the W-versus-U examples -------------------------------------------------------


@pytest.mark.parametrize("name,lora", [("write_after_read", "text_encoder"), ("write_after_write", "dit")])
def test_why_w_examples_behave_as_documented(name, lora):
    text = read("semantics.md")
    pipeline = pipeline_from_dict(json.loads(block_after(text, f"example: {name}")), source=f"semantics.md:{name}")
    vg = VersionGraph(pipeline)
    backward = backward_models((), lora)
    u_plan = plan_from_train_set(vg, backward, update_chain_train_set(vg, backward), "latest")
    documented = block_after(text, f"u-split-violations: {name}").strip().splitlines()
    assert unitgraph.verify(pipeline, u_plan) == documented
    w_plan = unitgraph.split(pipeline, lora_base_model=lora)
    assert unitgraph.verify(pipeline, w_plan) == []
    stated = re.search(rf"<!-- w-train: {name} = (.*?) -->", text).group(1).split(", ")
    assert w_plan.train_units == stated
    assert unitgraph.verify(pipeline, unitgraph.split(pipeline, lora_base_model=lora, cache_mode="versioned")) == []


# --- docs/plan-format.md ------------------------------------------------------------------------------


def test_plan_format_example_is_a_real_plan_and_every_key_is_documented():
    text = read("plan-format.md")
    example = json.loads(re.search(r"## Plan\n.*?```json\n(.*?)```", text, re.S).group(1))
    pipeline = unitgraph.load_pipeline(str(REPO / "unitgraph" / "examples" / "z_image.json"))
    plan = unitgraph.split(pipeline, lora_base_model="text_encoder", cache_mode="versioned")
    assert example == plan.to_dict()

    def keys(value, prefix=""):
        if isinstance(value, dict):
            for k, v in value.items():
                if prefix in ("reasons.", "reason_details."):  # unit names, not keys
                    yield from keys(v, "detail.")
                    continue
                yield prefix + k
                yield from keys(v, f"{k}.")
        elif isinstance(value, list):
            for v in value:
                yield from keys(v, prefix)

    for key in set(keys(plan.to_dict())):
        leaf = key.split(".")[-1]
        assert f"`{leaf}`" in text or f"`{key}`" in text, key
    for detail_key in ("rule", "models", "unit", "param", "access"):
        assert f"| `{detail_key}` |" in text
    assert "cache_mode" in text and "covers `cache_mode`" in text


# --- docs/user-guide.md ------------------------------------------------------------------------------


def test_user_guide_console_examples_are_current():
    text = read("user-guide.md")
    blocks = re.findall(r"```console\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        command, *expected = block.splitlines()
        assert command.startswith("$ unitgraph ")
        args = shlex.split(command[len("$ unitgraph "):])
        result = subprocess.run([sys.executable, "-c", "from unitgraph.cli.app import main; main()", *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == expected, command


def test_docs_links_and_images_resolve():
    for page in (DOCS / name for name in ("user-guide.md", "semantics.md", "plan-format.md", "cli.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


@pytest.mark.parametrize("image,ref,kwargs", [
    ("z_image_latest.svg", "z_image", dict(lora_base_model="text_encoder")),
    ("z_image_versioned.svg", "z_image", dict(lora_base_model="text_encoder", cache_mode="versioned")),
    ("qwen_image_latest.svg", "qwen_image", dict(lora_base_model="dit")),
])
def test_user_guide_pictures_show_the_current_split(image, ref, kwargs):
    assert f"img/{image}" in read("user-guide.md")
    svg = (DOCS / "img" / image).read_bytes()
    ET.fromstring(svg)
    text = svg.decode()
    pipeline = unitgraph.load_pipeline(str(REPO / "unitgraph" / "examples" / f"{ref}.json"))
    plan = unitgraph.split(pipeline, **kwargs)
    for unit in pipeline.units:
        assert f">{unit.name}<" in text
    assert f"stage 2 (train) loads: {', '.join(plan.train_models)}" in text
    assert f"stage 1 (data_process) loads: {', '.join(plan.data_process_models)}" in text
    assert f"cache: {len(plan.cache_entries)} entries" in text

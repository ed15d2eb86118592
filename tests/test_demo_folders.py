"""`unitgraph demo --pipeline NAME`: each pipeline's demo has a folder of its own, so the demos of the README and the
user guide run in any order and again, and a refusal advises only options `demo` has."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clitools import cli, one_error_line

pytest.importorskip("torch")
pytest.importorskip("diffusers")

# the smallest demo the command allows: one image, one epoch, no unsplit comparison, test-size models
SMALL = ["--images", "1", "--resolution", "32", "--num_epochs", "1", "--compare_steps", "0", "--size", "test"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(folder.rglob("*"))}


def demo_options() -> set[str]:
    from typer.main import get_command

    from unitgraph.cli.app import app

    command = get_command(app).commands["demo"]
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


@pytest.mark.slow
def test_two_pipelines_demos_run_one_after_another_each_in_its_own_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "output"
    main, flux = output / "demo", output / "demo-flux"

    code, _, err = cli(capsys, "demo", *SMALL)
    assert code == 0, err
    # the README's commands read these
    assert (main / "models" / "model_index.json").is_file() and (main / "data" / "metadata.csv").is_file()
    assert (main / "train" / "epoch-0.safetensors").is_file()
    first = snapshot(main)

    code, _, err = cli(capsys, "demo", "--pipeline", "flux", *SMALL)
    assert code == 0, err
    assert json.loads((flux / "models" / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert json.loads((flux / "train" / "unitgraph-run.json").read_text())["pipeline"] == "flux"
    assert snapshot(main) == first  # not its models, plan.svg, metadata.csv or run
    assert sorted(p.name for p in output.iterdir()) == ["demo", "demo-flux"]

    # again, in the other order: the first pipeline's demo runs in its folder, the other's is not touched
    second = snapshot(flux)
    code, _, err = cli(capsys, "demo", "--pipeline", "qwen_image", *SMALL)
    assert code == 0, err
    assert snapshot(flux) == second
    assert not [p for p in output.rglob("*") if p.name.endswith(".lock")]

    # one pipeline's demo into another's folder is refused before anything is written, advising demo's own options
    before = snapshot(main)
    code, _, err = cli(capsys, "demo", "--pipeline", "flux", "--output_path", str(main), *SMALL)
    line = one_error_line(code, err, str(main), "pipeline qwen_image", "output/demo-flux")
    assert set(re.findall(r"--[a-z_-]+", line)) <= demo_options(), line
    assert snapshot(main) == before

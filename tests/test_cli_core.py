"""`unitgraph plan` and `unitgraph verify` as a user runs them: exit codes, one-line errors, files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SPEC = {
    "name": "qwen_image",
    "units": [
        {"name": "ShapeChecker", "inputs": ["height", "width"], "outputs": ["height", "width"], "models": []},
        {"name": "PromptEmbedder", "inputs": ["prompt"], "outputs": ["prompt_emb", "prompt_emb_mask"], "models": ["text_encoder"]},
        {"name": "CaptionDropout", "inputs": ["prompt_emb"], "outputs": ["prompt_emb"], "models": [], "deterministic": False},
    ],
    "sink": {"inputs": ["input_latents", "prompt_emb", "prompt_emb_mask", "height", "width"], "models": ["dit"]},
}


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "unitgraph.cli.app", *args],
        capture_output=True, text=True, cwd=cwd, timeout=120,
    )


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SPEC))
    return path


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_plan_to_stdout_and_to_file(spec_file, tmp_path):
    result = run("plan", str(spec_file), "--lora-base-model", "dit")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["train"]["units"] == ["CaptionDropout"]
    out = tmp_path / "out" / "plan.json"
    result = run("plan", str(spec_file), "--lora_base_model", "dit", "--trainable-models", "text_encoder", "-o", str(out))
    assert result.returncode == 0, result.stderr
    written = json.loads(out.read_text())
    assert written["train"]["units"] == ["PromptEmbedder", "CaptionDropout"]
    assert [p.name for p in out.parent.iterdir()] == ["plan.json"], "no temporary files left behind"


def test_yaml_spec_is_accepted(tmp_path):
    path = write(tmp_path, "spec.yaml", textwrap.dedent("""\
        name: tiny
        units:
          - name: Encode
            inputs: [image]
            outputs: [latents]
            models: [vae]
        sink: {inputs: [latents], models: [dit]}
        """))
    result = run("plan", str(path), "--lora-base-model", "dit", "--cache-mode", "versioned")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["cache"]["entries"] == [{"param": "latents", "writer": "Encode"}]


def test_verify_accepts_a_plan_and_catches_a_tampered_one(spec_file, tmp_path):
    plan_path = tmp_path / "plan.json"
    assert run("plan", str(spec_file), "--lora-base-model", "dit", "-o", str(plan_path)).returncode == 0
    ok = run("verify", str(spec_file), str(plan_path))
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")
    plan = json.loads(plan_path.read_text())
    plan["train"]["units"] = []
    plan["data_process"]["units"].append("CaptionDropout")
    bad = write(tmp_path, "bad.json", json.dumps(plan))
    result = run("verify", str(spec_file), str(bad))
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert "seeds: CaptionDropout is non-deterministic, so it must run fresh every epoch (X0) but is in data_process" in lines
    assert "cache: incomplete: stage 2 needs entry (prompt_emb, CaptionDropout), which the plan does not store" in lines


@pytest.mark.parametrize(
    "name, text, fragments",
    [
        ("broken.json", '{"name": "x", "units": [', ["broken.json", "malformed JSON at line 1"]),
        ("broken.yaml", "name: [x\nunits: 1\n", ["broken.yaml", "malformed YAML"]),
        ("unknown.json", json.dumps({"name": "x", "units": [{"name": "A", "input": ["a"]}]}), ["unknown.json", "unit 'A'", "unknown unit key 'input'"]),
        ("toplevel.json", json.dumps({"name": "x", "units": [], "sinks": {}}), ["toplevel.json", "unknown pipeline key 'sinks'"]),
        ("sinkkey.json", json.dumps({"name": "x", "units": [], "sink": {"input": []}}), ["unknown sink key 'input'"]),
        ("dup.json", json.dumps({"name": "x", "units": [{"name": "A"}, {"name": "A"}]}), ["dup.json", "unit 'A'", "duplicate unit name"]),
        ("empty.json", json.dumps({"name": "x", "units": [{"name": ""}]}), ["empty.json", "units[0] needs a non-empty string 'name'"]),
        ("type.json", json.dumps({"name": "x", "units": [{"name": "A", "inputs": "a"}]}), ["unit 'A'", "'inputs' must be a list of strings, got a string"]),
        ("det.json", json.dumps({"name": "x", "units": [{"name": "A", "deterministic": "no"}]}), ["unit 'A'", "'deterministic' must be true or false"]),
        ("list.json", json.dumps([1, 2]), ["a pipeline spec must be a mapping, got a list"]),
        ("noname.json", json.dumps({"units": []}), ["missing key 'name'"]),
    ],
)
def test_bad_specs_exit_2_with_one_line_and_write_nothing(tmp_path, name, text, fragments):
    path = write(tmp_path, name, text)
    out = tmp_path / "plan.json"
    result = run("plan", str(path), "--lora-base-model", "dit", "-o", str(out))
    assert_one_line_error(result, *fragments)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_missing_file_directory_and_unknown_backend(tmp_path, spec_file):
    assert_one_line_error(run("plan", str(tmp_path / "nope.json")), "nope.json: no such file")
    assert_one_line_error(run("plan", str(tmp_path)), "is a directory")
    assert_one_line_error(run("plan", "nosuchbackend:thing"), "unknown backend 'nosuchbackend'")
    assert_one_line_error(run("plan", "examples:nosuchpipeline"), "has no pipeline 'nosuchpipeline'")
    assert_one_line_error(run("plan", str(spec_file), "--cache-mode", "newest"), "--cache-mode")
    assert_one_line_error(run("plan", str(spec_file), "--no-such-flag"), "No such option")
    assert_one_line_error(run("plan", str(spec_file), "--lora-base-model", "dti"), "model 'dti' needs backward")


def test_bad_plan_files_exit_2(spec_file, tmp_path):
    assert_one_line_error(run("verify", str(spec_file), str(write(tmp_path, "p.json", "{"))), "p.json", "malformed JSON")
    assert_one_line_error(run("verify", str(spec_file), str(write(tmp_path, "q.json", '{"format": "other"}'))), "unsupported plan format")
    assert_one_line_error(run("verify", str(spec_file), str(tmp_path / "missing.json")), "missing.json: no such file")


def test_an_existing_output_survives_a_failed_plan(tmp_path, spec_file):
    out = write(tmp_path, "plan.json", "previous content")
    bad = write(tmp_path, "bad.json", "{")
    assert run("plan", str(bad), "-o", str(out)).returncode == 2
    assert out.read_text() == "previous content"


def test_planning_and_viewing_never_import_torch(spec_file):
    code = textwrap.dedent(f"""
        import sys
        from unitgraph.cli.app import main
        for argv in (
            ["plan", {str(spec_file)!r}, "--lora-base-model", "dit"],
            ["plan", "diffusion:qwen_image", "--lora-base-model", "dit"],
            ["inspect", "diffusion:qwen_image", "--lora-base-model", "dit", "--format", "text"],
            ["inspect", "diffusion:qwen_image", "--lora-base-model", "dit", "--format", "mermaid"],
            ["explain", "diffusion:qwen_image", "PromptEncoder", "--lora-base-model", "dit"],
        ):
            try:
                main(argv)
            except SystemExit as exc:
                print("EXIT", exc.code, argv[0], file=sys.stderr)
        heavy = sorted(m for m in ("torch", "diffusers", "transformers", "accelerate", "peft") if m in sys.modules)
        print("HEAVY", heavy, file=sys.stderr)
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert "HEAVY []" in result.stderr, result.stderr
    assert result.stderr.count("EXIT 0 ") == 5, result.stderr


def test_planning_imports_no_networkx(tmp_path):
    """`unitgraph plan` builds no networkx graph (the planner keeps its own tables; networkx is the view that
    drawings and the reference operators build), so it does not pay networkx's ~0.3 s import at start-up."""
    code = textwrap.dedent(f"""
        import sys
        from unitgraph.cli.app import main
        try:
            main(["plan", "diffusion:qwen_image", "--lora-base-model", "dit", "-o", {str(tmp_path / "p.json")!r}])
        except SystemExit as exc:
            print("EXIT", exc.code, file=sys.stderr)
        print("NX", "networkx" in sys.modules, file=sys.stderr)
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert "EXIT 0" in result.stderr and "NX False" in result.stderr, result.stderr

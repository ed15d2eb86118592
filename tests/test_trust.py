"""Nothing run (docs/safety.md, 'Code'; docs/adapters.md, 'What runs: `--trust-remote-code`'): no code
from the working directory, and code that is not an installed package (a saved folder's custom blocks, a
`module:Class` found outside installed packages) runs only with `--trust-remote-code` (`trust_remote_code=True`
from Python)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

import unitgraph as ug
from unitgraph import references
from unitgraph.adapters import AdapterNote, untrusted_location
from unitgraph.cli.app import main
from unitgraph.spec import Pipeline, Unit

# Custom blocks code that leaves a marker file behind when it is imported.
BLOCKS = '''
from pathlib import Path

Path({marker!r}).write_text("ran")

from diffusers.modular_pipelines import InputParam, ModularPipelineBlocks, OutputParam


class LocalBlocks(ModularPipelineBlocks):
    inputs = [InputParam("prompt")]
    intermediate_outputs = [OutputParam("prompt_embeds")]

    def __call__(self, components, state):
        return components, state
'''
COMMANDS = ("plan", "verify", "inspect", "explain", "audit")


def run_main(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def command_args(command: str, ref: str, tmp_path: Path, capsys) -> list[str]:
    """Arguments of one SPEC-taking command for `ref` (verify gets a plan file of a spec of its own)."""
    if command == "verify":
        plan_file = tmp_path / "plan.json"
        if not plan_file.exists():
            spec = {"name": "LocalBlocks", "units": [{"name": "LocalBlocks", "inputs": ["prompt"], "outputs": ["prompt_embeds"]}]}
            (tmp_path / "spec.json").write_text(json.dumps(spec))
            with pytest.raises(SystemExit):
                main(["plan", str(tmp_path / "spec.json"), "-o", str(plan_file)])
            capsys.readouterr()
        return ["verify", ref, str(plan_file)]
    if command == "explain":
        return ["explain", ref, "LocalBlocks"]
    return [command, ref]


@pytest.fixture
def diffusers_modular():
    return pytest.importorskip("diffusers.modular_pipelines")


@pytest.fixture
def cwd_folder(tmp_path, monkeypatch, diffusers_modular) -> Path:
    """The working directory holds a folder named like a real diffusers blocks class, with custom code."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "MARKER"
    folder = tmp_path / "QwenImageAutoBlocks"
    folder.mkdir()
    (folder / "local_blocks.py").write_text(textwrap.dedent(BLOCKS.format(marker=str(marker))))
    (folder / "__init__.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    (folder / "modular_config.json").write_text(
        json.dumps({"auto_map": {"ModularPipelineBlocks": "local_blocks.LocalBlocks"}}))
    return folder


# --- a bare name is diffusers' own class -----------------------------------------------------------


def test_a_bare_name_is_diffusers_class_not_the_folder_in_the_cwd(cwd_folder):
    from unitgraph.adapters.diffusers_modular import load_blocks

    marker = cwd_folder.parent / "MARKER"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blocks = load_blocks("QwenImageAutoBlocks")
        pipeline = ug.load_pipeline("diffusers:QwenImageAutoBlocks", provided=["prompt", "image"])
    assert type(blocks).__module__.startswith("diffusers.") and type(blocks).__name__ == "QwenImageAutoBlocks"
    assert "text_encoder.text_encoder" in [u.name for u in pipeline.units]
    assert not marker.exists()
    notes = [str(w.message) for w in caught if issubclass(w.category, AdapterNote)]
    assert any("the folder QwenImageAutoBlocks in the current directory is not read "
               "(write diffusers:./QwenImageAutoBlocks to read it)" in n for n in notes)


def test_a_bare_name_from_the_command_line_in_that_cwd_runs_nothing(cwd_folder):
    """`python -m` puts the working directory on sys.path: still nothing of it runs."""
    marker = cwd_folder.parent / "MARKER"
    result = subprocess.run([sys.executable, "-m", "unitgraph.cli.app", "inspect", "diffusers:QwenImageAutoBlocks",
                             "--with", "prompt,image", "-f", "mermaid"],
                            capture_output=True, text=True, timeout=180, cwd=cwd_folder.parent)
    assert result.returncode == 0, result.stderr
    assert "text_encoder.text_encoder" in result.stdout
    assert not marker.exists()


def test_an_unknown_bare_name_with_a_folder_of_that_name_says_how_to_name_the_folder(tmp_path, monkeypatch,
                                                                                     diffusers_modular, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "MyBlocks").mkdir()
    code, _, err = run_main(capsys, "plan", "diffusers:MyBlocks")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "has no modular blocks class 'MyBlocks'" in err
    assert "for the folder MyBlocks in the current directory write diffusers:./MyBlocks" in err


# --- a folder written as a path: its custom code runs only with the flag ---------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_reference_is_refused_without_the_flag(cwd_folder, tmp_path, capsys, command):
    marker = tmp_path / "MARKER"
    for ref in ("diffusers:./QwenImageAutoBlocks", f"diffusers:{cwd_folder}"):
        code, out, err = run_main(capsys, *command_args(command, ref, tmp_path, capsys))
        assert code == 2, out + err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert "would run its custom code" in lines[0] and "local_blocks.py" in lines[0]
        assert lines[0].endswith("--trust-remote-code allows it")
        assert not marker.exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_with_the_flag_the_folder_code_runs(cwd_folder, tmp_path, capsys, command):
    marker = tmp_path / "MARKER"
    code, out, err = run_main(capsys, *command_args(command, "diffusers:./QwenImageAutoBlocks", tmp_path, capsys),
                              "--trust-remote-code")
    assert code == 0, out + err
    assert marker.read_text() == "ran"
    if command in ("plan", "inspect", "explain"):
        assert "LocalBlocks" in out


def test_python_callers_pass_trust_remote_code(cwd_folder, tmp_path):
    marker = tmp_path / "MARKER"
    with pytest.raises(ug.SpecError, match="--trust-remote-code allows it"):
        ug.load_pipeline("diffusers:./QwenImageAutoBlocks")
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = ug.load_pipeline("diffusers:./QwenImageAutoBlocks", trust_remote_code=True)
    assert [u.name for u in pipeline.units] == ["LocalBlocks"]
    assert marker.exists()


def test_a_saved_folder_that_names_a_diffusers_class_runs_nothing_and_needs_no_flag(tmp_path, monkeypatch,
                                                                                   diffusers_modular):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "modular_model_index.json").write_text(json.dumps({"_blocks_class_name": "QwenImageAutoBlocks"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = ug.load_pipeline("diffusers:./saved", provided=["prompt", "image"])
    assert "text_encoder.text_encoder" in [u.name for u in pipeline.units]


def test_diffusers_remote_code_switch_wins_over_the_flag(cwd_folder, tmp_path, monkeypatch):
    from diffusers.utils import constants

    monkeypatch.setattr(constants, "DIFFUSERS_DISABLE_REMOTE_CODE", True, raising=False)
    with pytest.raises(ug.SpecError, match="DIFFUSERS_DISABLE_REMOTE_CODE forbids it"):
        ug.load_pipeline("diffusers:./QwenImageAutoBlocks", trust_remote_code=True)
    assert not (tmp_path / "MARKER").exists()


def test_a_config_naming_a_module_outside_the_folder_is_refused(cwd_folder, tmp_path):
    (tmp_path / "outside.py").write_text(f"from pathlib import Path\nPath({str(tmp_path / 'MARKER')!r}).write_text('ran')\n")
    (cwd_folder / "modular_config.json").write_text(json.dumps({"auto_map": {"ModularPipelineBlocks": "../outside.X"}}))
    with pytest.raises(ug.SpecError, match="a module outside the folder"):
        ug.load_pipeline("diffusers:./QwenImageAutoBlocks", trust_remote_code=True)
    assert not (tmp_path / "MARKER").exists()


# --- module:Class ----------------------------------------------------------------------------------


@pytest.fixture
def local_module(tmp_path, monkeypatch, diffusers_modular) -> str:
    monkeypatch.chdir(tmp_path)
    name = f"local_blocks_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(BLOCKS.format(marker=str(tmp_path / "MARKER"))))
    yield name
    sys.modules.pop(name, None)


def test_module_class_outside_installed_packages_needs_the_flag(local_module, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "MARKER"
    ref = f"diffusers:{local_module}:LocalBlocks"
    code, _, err = run_main(capsys, "plan", ref, "--source", ".")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"importing {local_module!r} would run code from {tmp_path / (local_module + '.py')}" in err
    assert "not an installed package; --trust-remote-code allows it" in err
    assert not marker.exists() and local_module not in sys.modules
    # on sys.path (as the working directory is under `python -m`, or through PYTHONPATH): the same
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ug.SpecError, match="not an installed package"):
        ug.load_pipeline(ref)
    assert not marker.exists() and local_module not in sys.modules
    code, out, err = run_main(capsys, "plan", ref, "--source", ".", "--trust-remote-code")
    assert code == 0, err
    assert marker.exists()


def test_module_class_of_an_installed_package_needs_no_flag(diffusers_modular):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = ug.load_pipeline("diffusers:diffusers.modular_pipelines:QwenImageAutoBlocks",
                                    provided=["prompt", "image"])
    assert "text_encoder.text_encoder" in [u.name for u in pipeline.units]


# --- where code comes from -------------------------------------------------------------------------


def test_untrusted_location(tmp_path, monkeypatch):
    assert untrusted_location("json") is None  # the standard library
    assert untrusted_location("sys") is None  # built in
    assert untrusted_location("unitgraph.spec") is None  # an editable install, found in its project folder
    assert untrusted_location("no_such_module_for_unitgraph_tests") is None  # not found: the import says so
    (tmp_path / "shadow_mod_for_unitgraph_tests.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "shadow_pkg_for_unitgraph_tests").mkdir()
    (tmp_path / "shadow_pkg_for_unitgraph_tests" / "__init__.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert untrusted_location("shadow_mod_for_unitgraph_tests") == str(tmp_path / "shadow_mod_for_unitgraph_tests.py")
    assert untrusted_location("shadow_pkg_for_unitgraph_tests.sub") == str(tmp_path / "shadow_pkg_for_unitgraph_tests")
    assert "shadow_pkg_for_unitgraph_tests" not in sys.modules  # located, never imported


# --- the permission reaches the backends -----------------------------------------------------------


def fake_backends(monkeypatch, **targets):
    entries = {name: types.SimpleNamespace(load=lambda target=target: target) for name, target in targets.items()}
    monkeypatch.setattr(references, "available_backends", lambda: entries)


def test_load_pipeline_threads_trust_remote_code_down(monkeypatch):
    seen = {}
    pipeline = Pipeline("p", (Unit("A", ("x",), ("y",)),))

    def declares(name, *, provided=None, source=None, trust_remote_code=False):
        seen["declares"] = trust_remote_code
        return pipeline

    def any_keywords(name, **options):
        seen["any"] = dict(options)
        return pipeline

    def neither(name):
        return pipeline

    fake_backends(monkeypatch, a=types.SimpleNamespace(resolve=declares), b=types.SimpleNamespace(resolve=any_keywords),
                  c=types.SimpleNamespace(resolve=neither))
    ug.load_pipeline("a:x")
    assert seen["declares"] is False  # told when it is withheld too
    ug.load_pipeline("a:x", trust_remote_code=True)
    assert seen["declares"] is True
    ug.load_pipeline("b:x")
    assert seen["any"] == {}  # only when given, like the other options
    ug.load_pipeline("b:x", trust_remote_code=True)
    assert seen["any"] == {"trust_remote_code": True}
    assert ug.load_pipeline("c:x", trust_remote_code=True) is pipeline  # a permission, never required


def test_a_backend_entry_point_whose_module_is_not_installed_needs_the_flag(tmp_path, monkeypatch):
    """Entry points are read from metadata on sys.path, an egg-info in the working directory included."""
    name = f"local_backend_{tmp_path.name.replace('-', '_')}"
    marker = tmp_path / "MARKER"
    (tmp_path / f"{name}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from unitgraph.spec import Pipeline, Unit\nPIPELINES = {'p': lambda: Pipeline('p', (Unit('A', ('x',), ('y',)),))}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    entry = types.SimpleNamespace(module=name, load=lambda: importlib.import_module(name))
    monkeypatch.setattr(references, "available_backends", lambda: {"local": entry})
    try:
        with pytest.raises(ug.SpecError, match=r"backend 'local' would run code from .*; --trust-remote-code allows it"):
            ug.load_pipeline("local:p")
        assert not marker.exists()
        assert ug.load_pipeline("local:p", trust_remote_code=True).name == "p"
        assert marker.exists()
    finally:
        sys.modules.pop(name, None)


def test_installed_backends_need_no_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ug.load_pipeline("examples:z_image").units

"""A model folder unitgraph wrote may later hold a user's files: `tiny-models` (and the demo) write only the files
they wrote, recorded in the folder's marker, and never let a library's clean-up reach the rest (docs/safety.md,
models/own_folder.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import cli, one_error_line

torch = pytest.importorskip("torch")

from unitgraph.backends.diffusion.models.own_folder import STAGING_PREFIX, write_own_folder  # noqa: E402

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def refused(code: int, err: str, *fragments: str) -> str:
    """One error line after diffusers' progress bar of the writing (it wrote into the fresh folder: nothing moved)."""
    assert "Traceback" not in err and "unitgraph: error: " in err, err
    return one_error_line(code, err[err.index("unitgraph: error: "):], *fragments)


def test_test_size_over_its_config_only_folder_keeps_the_weights_the_user_copied_in(tmp_path, capsys):
    folder = tmp_path / "qwen"
    assert cli(capsys, "tiny-models", str(folder), "--size", "real")[0] == 0
    marker = json.loads((folder / "unitgraph_config_only.json").read_text())
    assert "transformer/config.json" in marker["files"] and marker.get("complete", True)
    (folder / WEIGHTS).write_bytes(b"real weights, copied in by the user")
    code, _, err = cli(capsys, "tiny-models", str(folder), "--size", "test")
    refused(code, err, str(folder), WEIGHTS, "did not write")
    assert (folder / WEIGHTS).read_bytes() == b"real weights, copied in by the user"
    assert not list(folder.glob(STAGING_PREFIX + "*"))


def test_another_seed_over_its_own_folder_leaves_the_users_shards_and_changed_files(tmp_path, capsys):
    folder = tmp_path / "qwen"
    assert cli(capsys, "tiny-models", str(folder))[0] == 0
    before = (folder / WEIGHTS).read_bytes()
    shard = folder / "transformer" / "diffusion_pytorch_model-00001-of-00002.safetensors"
    shard.write_bytes(b"a user's shard")  # diffusers' save_pretrained deletes weight files of other names
    assert cli(capsys, "tiny-models", str(folder), "--seed", "1")[0] == 0
    assert shard.read_bytes() == b"a user's shard" and (folder / WEIGHTS).read_bytes() != before
    (folder / WEIGHTS).write_bytes(b"the user's own weights, over the tiny ones")
    code, _, err = cli(capsys, "tiny-models", str(folder), "--seed", "2")
    refused(code, err, WEIGHTS, "changed since unitgraph wrote it")
    assert (folder / WEIGHTS).read_bytes() == b"the user's own weights, over the tiny ones"


def test_files_of_the_earlier_write_are_removed_only_while_unchanged(tmp_path):
    def writes(*names):
        def write(staging):
            for name in names:
                (staging / name).write_text(f"{name} by unitgraph")
            (staging / "unitgraph_tiny.json").write_text("{}")
        return write

    folder = write_own_folder(tmp_path / "m", "unitgraph_tiny.json", writes("a.json", "b.json", "c.json"))
    (folder / "b.json").write_text("edited by the user")
    write_own_folder(folder, "unitgraph_tiny.json", writes("a.json"))
    assert sorted(p.name for p in folder.iterdir()) == ["a.json", "b.json", "unitgraph_tiny.json"]
    assert list(json.loads((folder / "unitgraph_tiny.json").read_text())["files"]) == ["a.json"]


KILLED = """
import os, signal, sys
from pathlib import Path
from unitgraph.backends.diffusion.models.own_folder import write_own_folder

def write(staging):
    (staging / "transformer").mkdir()
    (staging / "transformer" / "part.safetensors").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGKILL)

write_own_folder(Path(sys.argv[1]), "unitgraph_tiny.json", write)
"""


def test_a_killed_tiny_models_is_finished_by_the_same_command(tmp_path, capsys):
    folder = tmp_path / "qwen"
    done = subprocess.run([sys.executable, "-c", KILLED, str(folder)], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert list(folder.glob(STAGING_PREFIX + "*"))  # the kill left its fresh folder (and the incomplete marker)
    assert json.loads((folder / "unitgraph_tiny.json").read_text())["complete"] is False
    assert cli(capsys, "tiny-models", str(folder))[0] == 0
    assert not list(folder.glob(STAGING_PREFIX + "*")) and (folder / WEIGHTS).is_file()
    assert json.loads((folder / "unitgraph_tiny.json").read_text()).get("complete", True) is True
    assert os.path.isfile(folder / "model_index.json")


def test_a_marker_cannot_point_a_removal_outside_the_folder(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep")
    folder = tmp_path / "m"
    folder.mkdir()
    record = {"size": 4, "sha256": "ignored"}
    (folder / "unitgraph_tiny.json").write_text(json.dumps({"files": {"../precious.txt": record,
                                                                      str(outside): record}}))

    def write(staging):
        (staging / "a.json").write_text("{}")
        (staging / "unitgraph_tiny.json").write_text("{}")

    write_own_folder(folder, "unitgraph_tiny.json", write)
    assert outside.read_text() == "keep" and Path(folder / "a.json").is_file()


def test_a_write_that_fails_before_anything_moved_leaves_the_folder_as_it_was(tmp_path):
    def failing(staging):
        (staging / "a.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_own_folder(tmp_path / "new", "unitgraph_tiny.json", failing)
    assert not (tmp_path / "new").exists()

    def write(staging):
        (staging / "a.json").write_text("{}")
        (staging / "unitgraph_tiny.json").write_text('{"size": "test"}')

    folder = write_own_folder(tmp_path / "m", "unitgraph_tiny.json", write)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        write_own_folder(folder, "unitgraph_tiny.json", failing)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before

"""Errors of the file system (and an exhausted memory) are one line in every command (docs/safety.md, "one line"):
cli/app.py turns any OSError or MemoryError no reader caught into the path (`exc.filename`) and the problem, exit 2."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from clitools import cli, one_error_line

from unitgraph.errors import os_error_line


@pytest.mark.parametrize("exc, expected", [
    (PermissionError(errno.EACCES, "Permission denied", "/m/vae/w.safetensors"), "/m/vae/w.safetensors: permission denied"),
    (OSError(errno.ENAMETOOLONG, "File name too long", "out/" + "x" * 300), "file name too long"),
    (OSError(errno.EROFS, "Read-only file system", "/cache/hashes.json"), "/cache/hashes.json: is on a read-only"),
    (OSError(errno.ELOOP, "Too many levels of symbolic links", "a"), "a: is a symlink loop"),
    (OSError(errno.EXDEV, "Invalid cross-device link", "a", None, "b"), "a -> b: Invalid cross-device link"),
    (OSError("no errno at all\nsecond line"), "no errno at all second line (OSError)"),
    (MemoryError(), "out of memory (MemoryError)"),
])
def test_the_line_names_the_path_and_the_problem(exc, expected):
    line = os_error_line(exc)
    assert expected in line and "\n" not in line, line


@pytest.mark.parametrize("exc, fragments", [
    (PermissionError(errno.EACCES, "Permission denied", "/home/other/out/state/step-4"),
     ("/home/other/out/state/step-4", "permission denied")),
    (OSError(errno.EROFS, "Read-only file system", "/ro/cache/hashes.json"), ("/ro/cache/hashes.json", "read-only")),
    (MemoryError(), ("out of memory",)),
])
@pytest.mark.parametrize("command", ["train", "cache repair", "lora convert", "tiny-models"])
def test_every_command_ends_an_os_error_in_one_line(command, exc, fragments, capsys, monkeypatch, tmp_path):
    from unitgraph.backends.diffusion import stage1, stages
    from unitgraph.backends.diffusion.families.qwen_image import tiny
    from unitgraph.backends.diffusion.train import checkpoints

    def raising(*_a, **_k):
        raise exc

    for module, name in ((stages, "run"), (stage1, "repair_cache"), (checkpoints, "convert"), (tiny, "write_tiny_models")):
        monkeypatch.setattr(module, name, raising)
    argv = {"train": ["train", "--task", "sft", "--lora_base_model", "dit"],
            "cache repair": ["cache", "repair", str(tmp_path)],
            "lora convert": ["lora", "convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
                             "--to", "diffusers"],
            "tiny-models": ["tiny-models", str(tmp_path / "tiny"), "--size", "test"]}[command]
    code, _, err = cli(capsys, *argv)
    one_error_line(code, err, *fragments)


def test_an_unreadable_model_file_in_stage1_is_one_line_and_leaves_nothing(tiny, tmp_path, capsys, monkeypatch):
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=0)
    weights = sorted((tiny / "vae").glob("*.safetensors"))[0]  # stage 1 loads the VAE
    real_open = Path.open

    def guarded(self, *a, **k):  # the test runs as root, whom chmod 000 does not stop: the kernel's answer, faked
        if os.fspath(self) == os.fspath(weights):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(self))
        return real_open(self, *a, **k)

    monkeypatch.setattr(Path, "open", guarded)
    real_io_open = open
    monkeypatch.setattr("builtins.open", lambda file, *a, **k: guarded(Path(file), *a, **k)
                        if isinstance(file, (str, Path)) and os.fspath(file) == os.fspath(weights)
                        else real_io_open(file, *a, **k))
    cache = tmp_path / "new" / "cache"
    code, _, err = cli(capsys, "train", "--task", "sft:data_process", "--model_paths", str(tiny),
                       "--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv"),
                       "--lora_base_model", "dit", "--max_pixels", "1024", "--output_path", str(cache), "--no-progress")
    one_error_line(code, err, weights.name, "permission denied")
    assert not (tmp_path / "new").exists()


def test_an_output_path_name_too_long_is_one_line(tmp_path, capsys):
    out = tmp_path / ("x" * 300)
    code, _, err = cli(capsys, "train", "--task", "sft", "--model_paths", str(tmp_path / "models"),
                       "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--output_path", str(out))
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []

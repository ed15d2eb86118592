"""Messages say what happened, so they send the user the right way (docs/safety.md): a run at work is not a run
that stopped, a symlink loop is not a missing path, non-finite outputs from a sample's input name that input. (A
killed `tiny-models` finished by the same command: tests/test_own_files.py.)"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
from clitools import cli, one_error_line

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from unitgraph.backends.diffusion.data.dataset import read_metadata  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.stage1 import check_finite  # noqa: E402
from unitgraph.backends.diffusion.train.outputs import RunFolder  # noqa: E402
from unitgraph.errors import OutputError  # noqa: E402

RUN = {"task": "sft", "pipeline": "qwen_image", "plan_fingerprint": "sha256:0"}


def test_a_second_run_into_a_folder_in_use_is_told_another_run_holds_it(tmp_path):
    out = tmp_path / "out"
    with RunFolder(out).claimed(False, RUN):  # the first run, at work (its marker says "running")
        with pytest.raises(OutputError, match="another unitgraph run is writing into this folder"):
            RunFolder(out).check(False)
        with pytest.raises(OutputError, match="another unitgraph run is writing into this folder"):
            RunFolder(out).check(False, RUN)  # --resume too
    with pytest.raises(OutputError, match="holds a finished run"):
        RunFolder(out).check(False)
    marker = out / "unitgraph-run.json"
    marker.write_text(marker.read_text().replace('"finished"', '"running"'))
    (out / ".unitgraph-run.lock").write_text("")  # a killed run's: nobody holds it
    with pytest.raises(OutputError, match="the run of a process that stopped"):
        RunFolder(out).check(False)


@pytest.fixture
def loop(tmp_path):
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    return tmp_path / "loop_a"


def test_a_symlink_loop_is_named_as_one_not_as_missing(loop, tiny, tmp_path, capsys):
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    with pytest.raises(BackendError, match="metadata file is a symlink loop"):
        read_metadata(loop)
    with pytest.raises(BackendError, match="metadata file does not exist"):
        read_metadata(tmp_path / "nowhere.csv")
    data = write_synthetic_dataset(tmp_path / "data", count=2, size=32, seed=0)
    base = ["train", "--task", "sft", "--lora_base_model", "dit", "--dataset_base_path", str(tmp_path / "data"),
            "--dataset_metadata_path", str(data), "--max_pixels", "1024"]
    for flags in (["--model_paths", str(loop)], ["--model_paths", str(tiny), "--output_path", str(loop)]):
        code, _, err = cli(capsys, *base, *flags)
        line = one_error_line(code, err, "symlink loop")
        assert "does not exist" not in line and "dangling" not in line, line
    code, _, err = cli(capsys, "tiny-models", str(loop))
    one_error_line(code, err, str(loop), "symlink loop")


def unit(*inputs):
    return SimpleNamespace(name="AudioEncoder", models=("audio_vae_encoder",),
                           declaration=SimpleNamespace(inputs=inputs))


def test_non_finite_outputs_from_a_samples_input_name_the_input():
    bad = {"audio_latents": torch.tensor([float("inf"), 1.0])}
    loud = {"input_audio": (np.full((2, 100), 1e30, np.float32), 16000), "num_frames": 9}
    with pytest.raises(BackendError, match=re.escape("from this sample's 'input_audio' (values up to 1e+30)")):
        check_finite(unit("input_audio", "num_frames"), bad, loud)
    nan = {"input_audio": (np.array([[0.0, np.nan]], np.float32), 16000), "num_frames": 9}
    with pytest.raises(BackendError, match=re.escape("'input_audio' (it holds NaN or infinity)")):
        check_finite(unit("input_audio", "num_frames"), bad, nan)
    quiet = {"input_audio": (np.zeros((2, 100), np.float32), 16000), "num_frames": 9}
    with pytest.raises(BackendError, match="a model's weights, or the precision"):
        check_finite(unit("input_audio", "num_frames"), bad, quiet)
    check_finite(unit("input_audio"), {"audio_latents": torch.zeros(2)}, loud)  # finite outputs pass

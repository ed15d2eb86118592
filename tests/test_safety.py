"""Nothing lost, nothing half-made, one line (docs/safety.md): what unitgraph writes where, and what it refuses.

Each test builds the situation a user can get into (a device as -o, a folder that is not unitgraph's,
a second run into a finished folder, a model that fails to load) and checks that the user's files
are untouched, nothing half-made is left behind, and the error is one line with exit code 2.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
from pathlib import Path

import pytest

from clitools import cli, one_error_line as one_line
from unitgraph.atomic import write_text_atomic
from unitgraph.errors import OutputError, UnitgraphError

EXAMPLE = "examples:qwen_image"


# ------------------------------------------------------------------------------------------------
# safe writes (unitgraph/atomic.py)


def test_devices_fifos_and_folders_are_never_written_over(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    for path, kind in (("/dev/null", "a device"), (str(fifo), "a FIFO"), (str(folder), "a directory")):
        before = os.stat(path)
        with pytest.raises(OutputError, match=kind):
            write_text_atomic(path, "x")
        code, _, err = cli(capsys, "plan", EXAMPLE, "--lora-base-model", "dit", "-o", path)
        one_line(code, err, path, kind)
        after = os.stat(path)
        assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "runs" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere" / "plan.json")
    write_text_atomic(dangling, "made")  # the target's folder is created, the link now resolves
    assert dangling.read_text() == "made" and dangling.is_symlink()


def test_full_disk_and_files_in_the_way_are_one_line_and_keep_the_old_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "plan.json"
    out.write_text("the previous plan")

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    code, _, err = cli(capsys, "plan", EXAMPLE, "--lora-base-model", "dit", "-o", str(out))
    one_line(code, err, str(out), "no space left", "previous file")
    assert out.read_text() == "the previous plan" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    monkeypatch.undo()
    code, _, err = cli(capsys, "plan", EXAMPLE, "--lora-base-model", "dit", "-o", str(out / "under-a-file.json"))
    one_line(code, err, "a file is in the way")


# ------------------------------------------------------------------------------------------------
# arguments checked before anything starts


@pytest.mark.parametrize("flags, fragment", [
    (dict(learning_rate=-1e-4), "--learning_rate must be a positive number"),
    (dict(learning_rate=math.nan), "--learning_rate must be a positive number"),
    (dict(weight_decay=-0.1), "--weight_decay must be 0 or a positive number"),
    (dict(lora_alpha=0.0), "--lora_alpha must be a positive number"),
    (dict(lora_target_modules=" , "), "--lora_target_modules ' , ' names nothing"),
    (dict(trainable_models=","), "names nothing"),
    (dict(lora_checkpoint="/no/such/lora.safetensors"), "--lora_checkpoint: no such file"),
])
def test_bad_arguments_are_refused_up_front(flags, fragment):
    from unitgraph.backends.diffusion.args import make_args

    with pytest.raises(UnitgraphError) as exc:
        make_args(lora_base_model="dit", **flags)
    assert fragment in exc.value.one_line()


# ------------------------------------------------------------------------------------------------
# folders: the cache (stage 1) and the run's output folder (stage 2)

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

SIZE = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    folder = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(folder, count=3, size=SIZE, seed=2)
    return folder


def flags(tiny: Path, data: Path, task: str, out: Path, *extra: str) -> list[str]:
    source = ["--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv")]
    if task.endswith(":train"):
        source = ["--dataset_base_path", str(data)]
    return ["train", "--task", task, *source, "--model_paths", str(tiny), "--lora_base_model", "dit",
            "--lora_rank", "4", "--max_pixels", str(SIZE * SIZE), "--output_path", str(out), "--no-progress",
            "--no-plot", *extra]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(folder.rglob("*"))}


def test_stage1_refuses_a_folder_that_is_not_a_cache_and_touches_nothing(tiny, data, tmp_path, capsys):
    mine = tmp_path / "my-folder"
    (mine / "entries").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "plan.json").write_text("my own plan")
    (mine / "draft.tmp").write_text("keep me")
    (mine / ".half.tmp").write_text("keep me too")
    (mine / "entries" / "weights.safetensors").write_bytes(b"not unitgraph's")
    before = snapshot(mine)
    code, _, err = cli(capsys, *flags(tiny, data, "sft:data_process", mine))
    one_line(code, err, str(mine), "not a unitgraph cache", ".half.tmp")  # a user's, even with a temp-like name
    assert snapshot(mine) == before


@pytest.mark.slow
def test_a_stage1_that_fails_its_checks_leaves_the_folder_as_it_was(tiny, data, tmp_path, capsys):
    import shutil

    models = tmp_path / "models"
    shutil.copytree(tiny, models)
    weights = models / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a model that fails to load
    new = tmp_path / "new-cache"
    code, _, err = cli(capsys, *flags(models, data, "sft:data_process", new))
    one_line(code, err, "vae")
    assert not new.exists()
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    code, _, err = cli(capsys, *flags(models, data, "sft:data_process", empty))
    one_line(code, err, "vae")
    assert list(empty.iterdir()) == []


@pytest.mark.slow
def test_the_output_folder_is_claimed_locked_and_never_mixed(tiny, data, tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "run"
    assert cli(capsys, *flags(tiny, data, "sft:data_process", cache))[0] == 0
    code, stdout, err = cli(capsys, *flags(tiny, cache, "sft:train", out, "--save_steps", "1"))
    assert code == 0, err
    first = snapshot(out)
    assert "step-3.safetensors" in first and "unitgraph-run.json" in first
    assert json.loads((out / "unitgraph-run.json").read_text())["status"] == "finished"

    # a re-run is refused: nothing overwritten, nothing mixed
    code, _, err = cli(capsys, *flags(tiny, cache, "sft:train", out))
    one_line(code, err, str(out), "holds a finished run", "--overwrite")
    assert snapshot(out) == first

    # a second run while one writes is refused (the first holds the folder's lock)
    assert not (out / ".unitgraph-run.lock").exists()  # a finished run leaves no lock file
    fd = os.open(out / ".unitgraph-run.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        code, _, err = cli(capsys, *flags(tiny, cache, "sft:train", out, "--overwrite"))
        one_line(code, err, "another unitgraph run is writing into this folder")
    finally:
        os.close(fd)
    assert snapshot(out) == {**first, ".unitgraph-run.lock": b""}  # only the other run's lock file

    # --overwrite moves the old run aside (nothing deleted) and cleans our stale temp files
    (out / ".epoch-0.safetensors.k1ll3d0_.tmp").write_bytes(b"half a checkpoint")  # mkstemp's 8 random
    code, stdout, err = cli(capsys, *flags(tiny, cache, "sft:train", out, "--overwrite"))
    assert code == 0, err
    aside = [p for p in out.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and "replaced:" in stdout
    assert snapshot(aside[0]) == {k: v for k, v in first.items() if not k.startswith(".")}  # all of it, intact
    now = sorted(p.name for p in out.glob("*.safetensors"))
    assert now == ["epoch-0.safetensors"]  # the earlier run's step checkpoints are not beside the new ones
    assert not list(out.glob(".*.tmp")) and not (out / ".unitgraph-run.lock").exists()


def test_the_output_folder_must_be_new_empty_or_unitgraphs(tmp_path):
    from unitgraph.backends.diffusion.train.outputs import RunFolder

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputError, match="not empty and not a unitgraph run folder"):
        RunFolder(theirs).check(overwrite=True)
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        RunFolder(file).check(overwrite=False)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")
    with pytest.raises(OutputError, match="stage-1 cache folder"):
        RunFolder(cache).check(overwrite=False)
    RunFolder(tmp_path / "new").check(overwrite=False)
    (tmp_path / "empty").mkdir()
    RunFolder(tmp_path / "empty").check(overwrite=False)
    assert (theirs / "thesis.tex").read_text() == "years of work"


def test_run_file_names_without_the_marker_and_lone_temp_files_are_someone_elses(tmp_path):
    """An earlier DiffSynth run leaves plan.json, loss.csv and epoch-0.safetensors; a user leaves .notes.tmp or a
    draft whose temp-like name is not for a run file. None of them is unitgraph's without its marker."""
    from unitgraph.backends.diffusion.train.outputs import LOCK, RunFolder

    diffsynth = tmp_path / "diffsynth-run"
    diffsynth.mkdir()
    for name in ("plan.json", "loss.csv", "epoch-0.safetensors"):
        (diffsynth / name).write_text("theirs")
    before = snapshot(diffsynth)
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="not empty and not a unitgraph run folder"):
            RunFolder(diffsynth).check(overwrite=overwrite)
    assert snapshot(diffsynth) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / ".notes.tmp").write_text("mine")
    with pytest.raises(OutputError, match=r"\.notes\.tmp"):
        RunFolder(notes).check(overwrite=False)
    assert (notes / ".notes.tmp").read_text() == "mine"
    lock = tmp_path / "stopped-before-its-marker"
    lock.mkdir()
    (lock / LOCK).write_bytes(b"")  # an empty lock: a run that stopped right after taking the folder
    RunFolder(lock).check(overwrite=False)
    (lock / LOCK).write_text("not our lock")
    with pytest.raises(OutputError, match="not empty"):
        RunFolder(lock).check(overwrite=False)
    fake_cache = tmp_path / "fake-cache-inside"
    (fake_cache / "cache").mkdir(parents=True)
    (fake_cache / "cache" / "manifest.json").write_text('{"format": "someone.else/v1"}')
    with pytest.raises(OutputError, match="cache"):
        RunFolder(fake_cache).check(overwrite=False)


def test_a_marked_run_cleans_only_the_temp_files_of_its_own_files(tmp_path):
    from unitgraph.backends.diffusion.train.outputs import RunFolder

    out = tmp_path / "run"
    with RunFolder(out).claimed(False, {"task": "sft:train", "pipeline": "qwen_image", "plan_fingerprint": "x"}):
        (out / "loss.csv").write_text("step\n")
    (out / ".loss.csv.ab12cd34.tmp").write_text("half a log")
    RunFolder(out).check(overwrite=True)
    with RunFolder(out).claimed(True, {"task": "sft:train", "pipeline": "qwen_image", "plan_fingerprint": "x"}):
        pass
    assert not (out / ".loss.csv.ab12cd34.tmp").exists()
    (out / ".draft.ab12cd34.tmp").write_text("a user's, with a temp-like name")  # not for a run file: kept
    with RunFolder(out).claimed(True, {"task": "sft:train", "pipeline": "qwen_image", "plan_fingerprint": "x"}):
        pass
    assert (out / ".draft.ab12cd34.tmp").read_text() == "a user's, with a temp-like name"


@pytest.mark.slow
def test_stage1_again_on_its_own_cache_leaves_the_users_files(tiny, data, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli(capsys, *flags(tiny, data, "sft:data_process", cache))[0] == 0
    mine = {cache / ".notes.tmp": b"mine", cache / "entries" / "mine.safetensors": b"mine",
            cache / "entries" / ("ab" * 32 + ".safetensors"): b"named like an entry, not one",
            cache / "README.txt": b"what this cache is for"}
    for path, content in mine.items():
        path.write_bytes(content)
    # another setting: every entry is recomputed and the old ones pruned, but only unitgraph's
    code, _, err = cli(capsys, *flags(tiny, data, "sft:data_process", cache, "--seed", "9"))
    assert code == 0, err
    assert {p: p.read_bytes() for p in mine} == mine


@pytest.mark.slow
def test_a_cache_without_samples_trains_nothing_and_says_so(tiny, data, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli(capsys, *flags(tiny, data, "sft:data_process", cache))[0] == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["samples"], manifest["num_samples"] = [], 0
    (cache / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = cli(capsys, *flags(tiny, cache, "sft:train", tmp_path / "run"))
    one_line(code, err, "nothing to train on")
    assert not (tmp_path / "run").exists()


def test_an_extreme_aspect_ratio_is_cropped_before_it_is_resized(monkeypatch):
    from PIL import Image

    from unitgraph.backends.diffusion.context import ImageSize
    from unitgraph.backends.diffusion.families.qwen_image.units import image_to_tensor

    sizes = []
    real = Image.Image.resize

    def resize(self, size, *args, **kwargs):
        sizes.append(size)
        return real(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", resize)
    strip = Image.new("RGB", (20000, 16), (200, 10, 10))
    pixels = image_to_tensor(strip, ImageSize(64, 64), torch.float32)
    assert tuple(pixels.shape) == (1, 3, 1, 64, 64)
    assert max(w * h for w, h in sizes) <= 4 * 64 * 64  # never the 80000 x 64 cover resize
    square = Image.new("RGB", (100, 80), (1, 2, 3))
    sizes.clear()
    assert tuple(image_to_tensor(square, ImageSize(None, None, 64 * 64), torch.float32).shape)[-2:] == (48, 64)


def test_a_malformed_preset_lora_is_one_line(tmp_path):
    from safetensors.torch import save_file

    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.models.lora import merge_preset_lora

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    bad_meta = tmp_path / "meta.safetensors"
    save_file({"0.lora_A.weight": torch.zeros(2, 4), "0.lora_B.weight": torch.zeros(4, 2)}, str(bad_meta),
              metadata={"lora_adapter_metadata": "{not json"})
    with pytest.raises(BackendError, match="is not JSON"):
        merge_preset_lora(model, "m", bad_meta, "transformer")
    bad_shape = tmp_path / "shape.safetensors"
    save_file({"0.lora_A.weight": torch.zeros(2, 3), "0.lora_B.weight": torch.zeros(4, 2)}, str(bad_shape))
    with pytest.raises(BackendError, match="does not fit m"):
        merge_preset_lora(model, "m", bad_shape, "transformer")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(BackendError, match="not a safetensors file"):
        merge_preset_lora(model, "m", garbage, "transformer")


@pytest.mark.slow
def test_a_hand_edited_manifest_of_the_wrong_shape_is_one_line_everywhere(tiny, data, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli(capsys, *flags(tiny, data, "sft:data_process", cache))[0] == 0
    good = json.loads((cache / "manifest.json").read_text())
    for field, value in (("samples", "everything"), ("entries", [1, 2]), ("status", 3), ("samples", [{"index": "0"}])):
        broken = {**good, field: value}
        (cache / "manifest.json").write_text(json.dumps(broken))
        for argv in (("cache", "verify", str(cache)), ("cache", "info", str(cache)), ("cache", "repair", str(cache)),
                     flags(tiny, cache, "sft:train", tmp_path / "run")):
            code, _, err = cli(capsys, *argv)
            one_line(code, err, "manifest.json", "damaged cache manifest", field)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content", ['[{"image": "a.png", "seed": ' + "9" * 5000 + "}]", "[" * 50000 + "]" * 50000,
                                     '[{"image": "a.png", "image": "b.png"}]'])
def test_metadata_for_planning_is_read_by_the_shared_reader(tmp_path, capsys, content):
    meta = tmp_path / "meta.json"
    meta.write_text(content)
    code, _, err = cli(capsys, "plan", EXAMPLE, "--lora-base-model", "dit", "--with-metadata", str(meta))
    one_line(code, err, str(meta))


@pytest.mark.parametrize("content", ["[" * 50000 + "]" * 50000, '{"format": "unitgraph.cache/v2", "status": ' + "1" * 5000 + "}"])
def test_pathological_manifests_are_one_line(tmp_path, capsys, content):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(content)
    for command in ("verify", "info"):
        code, _, err = cli(capsys, "cache", command, str(cache))
        one_line(code, err, "manifest.json")


def test_an_interrupted_validation_image_leaves_no_temp_file_behind(tmp_path):
    from unitgraph.backends.diffusion.train.outputs import RunFolder

    out = tmp_path / "run"
    record = {"task": "sft:train", "pipeline": "qwen_image", "plan_fingerprint": "x"}
    with RunFolder(out).claimed(False, record):
        (out / "samples" / "epoch-0").mkdir(parents=True)
    half = out / "samples" / "epoch-0" / ".0.png.ab12cd34.tmp"
    half.write_bytes(b"half an image")
    note = out / "samples" / "epoch-0" / ".note.tmp"
    note.write_text("kept: not an image's temp file")
    with RunFolder(out).claimed(False, record, resume=True):
        pass
    assert not half.exists() and note.exists()


def test_tiny_models_and_the_demo_never_write_over_a_users_folder(tmp_path, capsys):
    mine = tmp_path / "my-model"
    (mine / "transformer").mkdir(parents=True)
    (mine / "model_index.json").write_text('{"_class_name": "QwenImagePipeline"}')
    (mine / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"years of training")
    before = snapshot(mine)
    code, _, err = cli(capsys, "tiny-models", str(mine))
    one_line(code, err, str(mine), "holds no models unitgraph wrote")
    assert snapshot(mine) == before
    ours = tmp_path / "ours"
    assert cli(capsys, "tiny-models", str(ours))[0] == 0
    assert cli(capsys, "tiny-models", str(ours), "--seed", "1")[0] == 0  # its own folder: written again
    user = tmp_path / "my-demo"
    (user / "data").mkdir(parents=True)
    (user / "data" / "metadata.csv").write_text("image,prompt\nmine.png,my own caption\n")
    before = snapshot(user)
    code, _, err = cli(capsys, "demo", "--output_path", str(user))
    one_line(code, err, str(user), "not a unitgraph demo folder")
    assert snapshot(user) == before
    for flag, value in (("--images", "0"), ("--num_epochs", "0"), ("--size", "huge")):
        code, _, err = cli(capsys, "demo", "--output_path", str(tmp_path / "new-demo"), flag, value)
        one_line(code, err, flag)
        assert not (tmp_path / "new-demo").exists()

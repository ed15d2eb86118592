"""The held-out loss (--validation_dataset): cached by stage 1 apart from the training samples, logged by stage 2.

On test-size Qwen-Image models: the training run with it trains bit-equal losses and weights to the run without;
the held-out loss is the same in two runs of one seed (stage 2 from a cache whose text encoder's folder is gone
included) and changes when the weights do; a resumed run continues validation_loss.csv as the uninterrupted run
wrote it; a flag it cannot serve is one line with nothing written.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.train.held_out import read_held_out_csv  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("held-out")
    write_synthetic_dataset(root / "train", count=3, size=SIZE, seed=1)
    write_synthetic_dataset(root / "held", count=2, size=SIZE, seed=9)
    return root


def argv(models: Path, data: Path, out: Path, task: str, *extra: str) -> list[str]:
    source = (() if task.endswith(":train") else
              ("--dataset_base_path", str(data / "train"), "--dataset_metadata_path", str(data / "train" / "metadata.csv")))
    return ["train", "--task", task, "--model_paths", str(models), "--lora_base_model", "dit", "--lora_rank", "4",
            "--max_pixels", str(SIZE * SIZE), "--learning_rate", "1e-3", "--seed", "3", "--mixed_precision", "no",
            "--num_epochs", "2", "--output_path", str(out), "--no-progress", "--no-plot", *source, *extra]


def held_out(data: Path) -> tuple[str, ...]:
    return ("--validation_dataset", str(data / "held" / "metadata.csv"), "--validation_steps", "2")


def test_the_held_out_loss_changes_nothing_of_the_training_and_is_the_same_run_to_run(tiny, data, tmp_path, capsys):
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "with", "sft:split", *held_out(data)))
    assert code == 0, err
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "without", "sft:split"))
    assert code == 0, err
    la, lb = read_loss_csv(tmp_path / "with" / "loss.csv"), read_loss_csv(tmp_path / "without" / "loss.csv")
    assert la and [(r["loss"], r["timestep"]) for r in la] == [(r["loss"], r["timestep"]) for r in lb]
    wa, wb = (load_file(str(tmp_path / n / "epoch-1.safetensors")) for n in ("with", "without"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = read_held_out_csv(tmp_path / "with" / "validation_loss.csv")
    assert [(r["step"], r["epoch"], r["samples"]) for r in rows] == [(2, 0, 2), (4, 1, 2), (6, 1, 2)]
    assert len({r["loss"] for r in rows}) == 3  # the weights changed between the evaluations, and so did the loss
    assert not (tmp_path / "without" / "validation_loss.csv").exists()
    # stage 1 cached the held-out samples apart: the training samples are the run's, the cache verifies them all
    manifest = json.loads((tmp_path / "with" / "cache" / "manifest.json").read_text())
    assert len(manifest["samples"]) == 3 and [s["row"] for s in manifest["held_out"]] == [1, 2]
    assert "held_out" not in json.loads((tmp_path / "without" / "cache" / "manifest.json").read_text())
    code, out, err = cli(capsys, "cache", "verify", str(tmp_path / "with" / "cache"))
    assert code == 0 and "5 samples" in out, out + err

    # the same seed again, as stage 2 alone from a cache whose text encoder and tokenizer are gone: the same losses
    models = tmp_path / "models"
    shutil.copytree(tiny, models)
    code, _, err = cli(capsys, *argv(models, data, tmp_path / "cache", "sft:data_process", *held_out(data)))
    assert code == 0, err
    for folder in ("text_encoder", "tokenizer"):
        shutil.rmtree(models / folder)
    code, _, err = cli(capsys, *argv(models, data, tmp_path / "stage2", "sft:train", "--dataset_base_path",
                                     str(tmp_path / "cache"), "--validation_steps", "2"))
    assert code == 0, err
    again = read_held_out_csv(tmp_path / "stage2" / "validation_loss.csv")
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]
    # other weights (another learning rate) give another held-out loss from the same samples and draws
    code, _, err = cli(capsys, *argv(models, data, tmp_path / "faster", "sft:train", "--dataset_base_path",
                                     str(tmp_path / "cache"), "--validation_steps", "2", "--learning_rate", "1e-2"))
    assert code == 0, err
    other = read_held_out_csv(tmp_path / "faster" / "validation_loss.csv")
    assert [r["step"] for r in other] == [2, 4, 6] and all(a["loss"] != b["loss"] for a, b in zip(other, rows))


def test_without_validation_steps_it_is_logged_at_each_epochs_end(tiny, data, tmp_path, capsys):
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "out", "sft:split", "--validation_dataset",
                                     str(data / "held" / "metadata.csv")))
    assert code == 0, err
    rows = read_held_out_csv(tmp_path / "out" / "validation_loss.csv")
    assert [(r["step"], r["epoch"]) for r in rows] == [(3, 0), (6, 1)]


def test_what_it_cannot_serve_is_one_line_and_nothing_is_written(tiny, data, tmp_path, capsys):
    cases = [
        (argv(tiny, data, tmp_path / "a", "sft", *held_out(data)), "--task sft:split"),
        (argv(tiny, data, tmp_path / "a", "sft:split", "--validation_dataset", str(data / "held" / "none.csv")),
         "does not exist"),
        (argv(tiny, data, tmp_path / "a", "sft:split", "--validation_dataset", str(data / "held" / "images")),
         "is a metadata file"),
    ]
    for args, fragment in cases:
        code, _, err = cli(capsys, *args)
        one_error_line(code, err, fragment)
        assert not (tmp_path / "a").exists()
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "plain", "sft:data_process"))
    assert code == 0, err
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "b", "sft:train", "--dataset_base_path",
                                     str(tmp_path / "plain"), *held_out(data)))
    one_error_line(code, err, "holds no held-out samples")
    assert not (tmp_path / "b").exists()


def write_json(path: Path, tables: list[dict]) -> Path:
    path.write_text(json.dumps({"datasets": tables}))
    return path


def test_a_dataset_config_table_marked_validation_is_the_held_out_dataset(tiny, data, tmp_path, capsys):
    """`validation = true` in --dataset_config names the held-out samples as --validation_dataset does: the same
    training and the same held-out losses as the flag, the held-out table never trained; what it cannot be is one
    line with nothing written."""
    train = {"name": "train", "base_path": str(data / "train"), "metadata": str(data / "train" / "metadata.csv")}
    held = {"name": "held", "base_path": str(data / "held"), "metadata": str(data / "held" / "metadata.csv"),
            "validation": True}
    config = write_json(tmp_path / "mix.json", [train, held])
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "flag", "sft:split", *held_out(data)))
    assert code == 0, err
    plain = argv(tiny, data, tmp_path / "config", "sft:split", "--validation_steps", "2")
    source = plain.index("--dataset_base_path")
    code, _, err = cli(capsys, *plain[:source], *plain[source + 4:], "--dataset_config", str(config))
    assert code == 0, err
    a, b = (read_loss_csv(tmp_path / n / "loss.csv") for n in ("flag", "config"))
    assert a and [(r["loss"], r["timestep"]) for r in a] == [(r["loss"], r["timestep"]) for r in b]
    ha, hb = (read_held_out_csv(tmp_path / n / "validation_loss.csv") for n in ("flag", "config"))
    assert [(r["step"], r["samples"]) for r in hb] == [(2, 2), (4, 2), (6, 2)]
    assert [r["loss"] for r in ha] == [r["loss"] for r in hb]
    manifest = json.loads((tmp_path / "config" / "cache" / "manifest.json").read_text())
    assert [d["name"] for d in manifest["datasets"]] == ["train"] and len(manifest["held_out"]) == 2

    base = plain[:source] + plain[source + 4:]
    bad = [
        ([train, held, {**held, "name": "again"}], "one held-out dataset at most"),
        ([{**train, "validation": True}], "needs one training dataset at least"),
        ([train, {**held, "repeats": 2}], "takes no `repeats` or `weight`"),
        ([train, {**held, "max_pixels": 256}], "takes no `max_pixels`"),
        ([train, {**held, "validation": "yes"}], "`validation` must be true or false"),
    ]
    for n, (tables, fragment) in enumerate(bad):
        path = write_json(tmp_path / f"bad-{n}.json", tables)
        out = base.index("--output_path") + 1
        code, _, err = cli(capsys, *base[:out], str(tmp_path / "refused"), *base[out + 1:], "--dataset_config",
                           str(path))
        line = one_error_line(code, err, fragment)
        assert str(path) in line
    for extra, task, fragment in ((held_out(data)[:2], "sft:split", "both name held-out samples"),
                                  ((), "sft", "--task sft:split")):
        args = argv(tiny, data, tmp_path / "refused", task, *extra)
        at = args.index("--dataset_base_path")
        code, _, err = cli(capsys, *args[:at], *args[at + 4:], "--dataset_config", str(config))
        one_error_line(code, err, fragment)
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_sigkill_and_resume_continues_the_held_out_log(tiny, data, tmp_path, capsys):
    from test_resume import command, killed_and_resumed

    extra = (*held_out(data)[:2], "--validation_steps", "1", "--save_steps", "1")
    whole = tmp_path / "whole"
    code, _, err = cli(capsys, *argv(tiny, data, whole, "sft:split", *extra))
    assert code == 0, err
    resumed = tmp_path / "resumed"
    kills, printed = killed_and_resumed(command(1) + argv(tiny, data, resumed, "sft:split", *extra), resumed, kills=1,
                                        rng=random.Random(4))
    assert kills == 1 and "resuming from" in printed, printed
    a, b = (read_held_out_csv(p / "validation_loss.csv") for p in (whole, resumed))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-6, rel=0)

"""Several datasets in one run (--dataset_config): the reader, the epoch's mix, and the runs.

The config reader is property-tested (a generated config reads back as written, in TOML and JSON; an edited one is
read or refused in one line naming the file). The runs use test-size Qwen-Image models: two datasets of different
repeats (one by weight, at its own size) train the same losses and weights split and unsplit, bit for bit at fp32,
and after a kill `--resume` continues exactly; a dataset added to a config costs stage 1 its own entries only; a
config of one dataset is the run of `--dataset_base_path`; bad configs are one line with nothing written.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.batching import (CachedItem, Share, expand, mixed_elements,  # noqa: E402
                                                        read_safetensors_header)
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.data.dataset_config import DatasetSpec, read_dataset_config  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("UNITGRAPH_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SIZE = 32


# -- the reader ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """A config folder with two dataset folders and their metadata files (the reader checks they are there)."""
    root = tmp_path_factory.mktemp("config")
    for name in ("one", "two"):
        (root / name).mkdir()
        (root / name / "metadata.csv").write_text("image,prompt\n", encoding="utf-8")
    return root


def toml_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string of these characters is a TOML basic string
    return repr(value)


def write_config(folder: Path, tables: list[dict], suffix: str, name: str = "mix") -> Path:
    path = folder / f"{name}{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"datasets": tables}), encoding="utf-8")
    else:
        path.write_text("".join("[[datasets]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in t.items()) + "\n"
                                for t in tables), encoding="utf-8")
    return path


def outcome(path: Path, **kwargs):
    """The datasets of a config, or the BackendError it raised, checked to be one line naming the file."""
    try:
        return read_dataset_config(path, **kwargs)
    except BackendError as exc:
        line = exc.one_line()
        assert "\n" not in line and str(path) in line and "Traceback" not in line, line
        return exc


names = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True)
table = st.fixed_dictionaries(
    {"base_path": st.sampled_from(["one", "two"])},
    optional={"repeats": st.integers(1, 50), "max_pixels": st.integers(1, 10 ** 7),
              "size": st.tuples(st.integers(1, 64), st.integers(1, 64)),
              "data_file_keys": st.lists(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), min_size=1, max_size=3, unique=True),
              "num_frames": st.integers(0, 30).map(lambda k: 4 * k + 1),
              "weight": st.floats(0.01, 100.0)})


@FUZZ
@given(tables=st.lists(table, min_size=1, max_size=4), dataset_names=st.lists(names, min_size=4, max_size=4, unique=True),
       suffix=st.sampled_from([".toml", ".json"]))
def test_a_generated_config_reads_back_as_written(tables, dataset_names, suffix, folders):
    written, expected = [], []
    for t, name in zip(tables, dataset_names):
        t = dict(t)
        if "repeats" in t and "weight" in t:
            del t["weight"]
        size = t.pop("size", None)
        row = {"name": name, "base_path": t["base_path"], "metadata": f"{t['base_path']}/metadata.csv",
               **{k: v for k, v in t.items() if k != "base_path"}}
        if size is not None:
            row["height"], row["width"] = 16 * size[0], 16 * size[1]
        written.append(row)
        expected.append(DatasetSpec(name=name, base_path=str(folders / t["base_path"]),
                                    metadata=str(folders / t["base_path"] / "metadata.csv"),
                                    repeats=t.get("repeats", 1), weight=t.get("weight"),
                                    max_pixels=t.get("max_pixels"), height=row.get("height"), width=row.get("width"),
                                    data_file_keys=tuple(t["data_file_keys"]) if "data_file_keys" in t else None,
                                    num_frames=t.get("num_frames")))
    path = write_config(folders, written, suffix)
    assert read_dataset_config(path) == tuple(expected)
    # what a manifest records reads back as the same datasets (stage 2 reads them from there)
    from unitgraph.backends.diffusion.data.dataset_config import parse_datasets

    assert parse_datasets({"datasets": [s.record() for s in expected]}, "m", folders) == tuple(expected)


VALID = {"name": "a", "base_path": "one", "metadata": "one/metadata.csv", "repeats": 2}
TOML_PIECES = ["[[datasets]]", "[datasets]", "name", "=", '"', "'", "\n", "repeats = 0", "weight = -1", "nan", "inf",
               "[" * 50, "{", "}", "name = \"a\"\nname = \"b\"", "\x00", "\ufeff", "9" * 5000, "unknown = 1",
               "base_path = \"nowhere\""]


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 500), st.integers(0, 6),
                                st.one_of(st.sampled_from(TOML_PIECES), st.text(max_size=6))), min_size=1, max_size=5),
       suffix=st.sampled_from([".toml", ".json"]))
def test_an_edited_config_is_read_or_refused_in_one_line(edits, suffix, folders):
    path = write_config(folders, [VALID, {**VALID, "name": "b", "base_path": "two", "metadata": "two/metadata.csv"}],
                        suffix, name="edited")
    text = path.read_text(encoding="utf-8")
    for position, deleted, inserted in edits:
        at = position % (len(text) + 1)
        text = text[:at] + inserted + text[at + deleted:]
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    got = outcome(path)
    if not isinstance(got, BackendError):
        assert all(isinstance(s, DatasetSpec) and s.repeats >= 1 and (s.weight is None or s.weight > 0) for s in got)
        assert len({s.name for s in got}) == len(got)


BAD_TABLES = [
    ({"colour": "red"}, "unknown key 'colour'"),
    ({"base_path": "missing"}, "base_path"),
    ({"metadata": "one/none.csv"}, "metadata"),
    ({"metadata": "one/metadata.txt"}, "is not a csv, json or jsonl file"),
    ({"repeats": 0}, "`repeats` must be an integer from 1"),
    ({"repeats": -3}, "`repeats` must be an integer from 1"),
    ({"repeats": 1.5}, "`repeats` must be an integer"),
    ({"repeats": None, "weight": 0}, "`weight` must be a number above 0"),
    ({"repeats": None, "weight": -0.5}, "`weight` must be a number above 0"),
    ({"weight": 0.5}, "give `repeats` or `weight`, not both"),
    ({"height": 64}, "`height` and `width` go together"),
    ({"height": 40, "width": 64}, "multiple of 16"),
    ({"num_frames": 6}, "4k+1"),
    ({"data_file_keys": []}, "names no column"),
    ({"base_path": None}, "`base_path` is required"),
]


@pytest.mark.parametrize("change, fragment", BAD_TABLES, ids=[f[1][:30] for f in BAD_TABLES])
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_bad_dataset_is_one_line_naming_the_file_and_the_dataset(change, fragment, suffix, folders):
    bad = {k: v for k, v in {**VALID, "name": "b", **change}.items() if v is not None}
    got = outcome(write_config(folders, [VALID, bad], suffix, name="bad"))
    assert isinstance(got, BackendError) and fragment in got.one_line() and "dataset 'b'" in got.one_line(), got


def test_duplicate_names_an_unknown_top_key_and_a_duplicate_toml_key_are_refused(folders):
    got = outcome(write_config(folders, [VALID, VALID], ".toml", name="twice"))
    assert isinstance(got, BackendError) and "dataset 'a' is named twice" in got.one_line()
    path = folders / "top.json"
    path.write_text(json.dumps({"datasets": [VALID], "seed": 1}), encoding="utf-8")
    assert "unknown key 'seed'" in outcome(path).one_line()
    path = folders / "dup.toml"
    path.write_text('[[datasets]]\nname = "a"\nname = "b"\n', encoding="utf-8")
    assert "malformed TOML" in outcome(path).one_line()
    path = folders / "mix.yaml"
    path.write_text("datasets: []\n", encoding="utf-8")
    assert ".toml or .json" in outcome(path).one_line()
    # stage 2 reads a config whose folders are gone
    gone = write_config(folders, [{**VALID, "base_path": "gone", "metadata": "gone/m.csv"}], ".toml", name="gone")
    assert isinstance(outcome(gone), BackendError)
    assert outcome(gone, check_files=False)[0].base_path == str(folders / "gone")


# -- the epoch's mix ----------------------------------------------------------------------------------------------

def items(name: str, n: int, start: int = 0) -> list[CachedItem]:
    return [CachedItem(start + i, f"{name}{i}", name) for i in range(n)]


def test_repeats_expand_each_dataset_and_one_dataset_is_the_plain_expansion():
    a, b = items("a", 3), items("b", 2, 3)
    assert mixed_elements(a, [Share("a", 4)], 0, 0) == expand(a, 4)
    got = mixed_elements(a + b, [Share("a", 2), Share("b", 3)], 0, 5)
    assert got == expand(a, 2) + expand(b, 3)


@given(n=st.integers(1, 40), weight=st.floats(0.01, 6.0), seed=st.integers(0, 2 ** 32), epoch=st.integers(0, 50))
@settings(max_examples=60, deadline=None)
def test_a_weight_draws_whole_passes_and_a_seeded_subset(n, weight, seed, epoch):
    group = items("w", n)
    got = mixed_elements(group, [Share("w", weight=weight)], seed, epoch)
    count = max(1, int(weight * n + 0.5))
    whole, rest = divmod(count, n)
    assert len(got) == count == Share("w", weight=weight).draws(n)
    assert got[:whole * n] == expand(group, whole)
    subset = got[whole * n:]
    assert len({e.item for e in subset}) == rest and all(e.repeat == whole for e in subset)
    assert got == mixed_elements(group, [Share("w", weight=weight)], seed, epoch)  # a function of seed and epoch


def test_the_subset_changes_from_epoch_to_epoch_and_ignores_the_other_datasets():
    a, w = items("a", 5), items("w", 10, 5)
    subsets = [tuple(e.item.index for e in mixed_elements(w, [Share("w", weight=0.5)], 3, epoch)) for epoch in range(6)]
    assert len(set(subsets)) > 1 and all(len(s) == 5 for s in subsets)
    with_a = [tuple(e.item.index for e in mixed_elements(a + w, [Share("a", 2), Share("w", weight=0.5)], 3, epoch)
                    if e.item.dataset == "w") for epoch in range(6)]
    assert with_a == subsets


# -- runs ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Three datasets: `a` (3 images of 32 px), `b` (2 of 48 px) and `c` (2 of 32 px), and configs of them."""
    root = tmp_path_factory.mktemp("datasets")
    write_synthetic_dataset(root / "a", count=3, size=SIZE, seed=1)
    write_synthetic_dataset(root / "b", count=2, size=48, seed=2)
    write_synthetic_dataset(root / "c", count=2, size=SIZE, seed=3)
    a = {"name": "a", "base_path": "a", "metadata": "a/metadata.csv", "repeats": 2}
    b = {"name": "b", "base_path": "b", "metadata": "b/metadata.csv", "weight": 1.5, "max_pixels": 256}
    c = {"name": "c", "base_path": "c", "metadata": "c/metadata.csv"}
    write_config(root, [a, b], ".toml", name="mix")
    write_config(root, [a, b, c], ".json", name="more")
    write_config(root, [{**a, "repeats": 1}], ".toml", name="one")
    write_config(root, [a, {**b, "max_pixels": 1024}], ".toml", name="resized")
    write_config(root, [b, a], ".toml", name="swapped")
    return root


def argv(models: Path, out: Path, task: str, *extra: str) -> list[str]:
    return ["train", "--task", task, "--model_paths", str(models), "--lora_base_model", "dit", "--lora_rank", "4",
            "--max_pixels", str(SIZE * SIZE), "--learning_rate", "1e-3", "--seed", "3", "--mixed_precision", "no",
            "--output_path", str(out), "--no-progress", "--no-plot", *extra]


def assert_same_training(a: Path, b: Path) -> None:
    """Bit-equal losses, timesteps and trained weights."""
    la, lb = read_loss_csv(a / "loss.csv"), read_loss_csv(b / "loss.csv")
    assert la and [(r["step"], r["epoch"], r["loss"], r["timestep"]) for r in la] == \
        [(r["step"], r["epoch"], r["loss"], r["timestep"]) for r in lb]
    wa, wb = load_file(str(a / "epoch-1.safetensors")), load_file(str(b / "epoch-1.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_datasets_train_the_same_split_and_unsplit(tiny, data, tmp_path, capsys):
    """`a` twice an epoch, `b` by weight 1.5 at its own size: the unsplit run, :split, and stage 1 then stage 2
    without the config (the cache recorded it) train bit-equal losses and weights at fp32."""
    mix = ("--dataset_config", str(data / "mix.toml"), "--num_epochs", "2")
    for name, task in (("unsplit", "sft"), ("split", "sft:split")):
        code, _, err = cli(capsys, *argv(tiny, tmp_path / name, task, *mix))
        assert code == 0, err
    code, _, err = cli(capsys, *argv(tiny, tmp_path / "cache", "sft:data_process", *mix))
    assert code == 0, err
    code, _, err = cli(capsys, *argv(tiny, tmp_path / "stage2", "sft:train", "--dataset_base_path",
                                     str(tmp_path / "cache"), "--num_epochs", "2"))
    assert code == 0, err
    assert_same_training(tmp_path / "unsplit", tmp_path / "split")
    assert_same_training(tmp_path / "unsplit", tmp_path / "stage2")
    rows = read_loss_csv(tmp_path / "unsplit" / "loss.csv")
    assert len(rows) == 2 * (3 * 2 + 3)  # an epoch: a's 3 samples twice, round(1.5 x 2) draws of b
    # the manifest knows each sample's dataset; b's entries are made at its own size (256 px: 16 x 16)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert [d["name"] for d in manifest["datasets"]] == ["a", "b"]
    assert [(s["dataset"], s["row"]) for s in manifest["samples"]] == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)]
    shapes = {}
    for s in manifest["samples"]:
        header = read_safetensors_header(tmp_path / "cache" / manifest["entries"][s["key"]]["file"])
        shapes.setdefault(s["dataset"], set()).add(tuple(header["input_latents"]["shape"]))
    assert shapes == {"a": {(1, 4, 1, 8, 8)}, "b": {(1, 4, 1, 4, 4)}}  # 32 px and 48 px -> 16 px: 8 x 8, 4 x 4
    # a stage 2 given another config than its cache's is one line, nothing written
    for config, fragment in (("resized", "rebuild them"), ("swapped", "this cache holds a, b"), ("one", "a, b")):
        out = tmp_path / f"refused-{config}"
        code, _, err = cli(capsys, *argv(tiny, out, "sft:train", "--dataset_base_path", str(tmp_path / "cache"),
                                         "--dataset_config", str(data / f"{config}.toml")))
        one_error_line(code, err, fragment)
        assert not out.exists()
    code, _, err = cli(capsys, *argv(tiny, tmp_path / "refused", "sft:train", "--dataset_base_path",
                                     str(tmp_path / "cache"), "--dataset_repeat", "2"))
    one_error_line(code, err, "--dataset_repeat 2", "--dataset_config")


def test_a_config_of_one_dataset_is_the_run_of_its_folder(tiny, data, tmp_path, capsys):
    plain = ("--dataset_base_path", str(data / "a"), "--dataset_metadata_path", str(data / "a" / "metadata.csv"))
    code, _, err = cli(capsys, *argv(tiny, tmp_path / "plain", "sft:split", *plain, "--num_epochs", "2"))
    assert code == 0, err
    code, _, err = cli(capsys, *argv(tiny, tmp_path / "config", "sft:split", "--dataset_config", str(data / "one.toml"),
                                     "--num_epochs", "2"))
    assert code == 0, err
    assert_same_training(tmp_path / "plain", tmp_path / "config")
    keys = [[s["key"] for s in json.loads((tmp_path / n / "cache" / "manifest.json").read_text())["samples"]]
            for n in ("plain", "config")]
    assert keys[0] == keys[1]


def test_a_dataset_added_to_the_config_costs_stage1_its_own_entries(tiny, data, tmp_path, capsys):
    def stage1(config: str):
        return run(make_args(task="sft:data_process", model_paths=str(tiny), lora_base_model="dit",
                             max_pixels=SIZE * SIZE, dataset_config=str(data / config), mixed_precision="no",
                             output_path=str(tmp_path / "cache"), progress=False, plot=False), echo=lambda _: None)

    first = stage1("mix.toml")
    assert first.entries_computed == 5 and first.entries_reused == 0
    added = stage1("more.json")  # c added: only its 2 samples are computed
    assert added.entries_computed == 2 and added.entries_reused == 5
    assert sorted(added.computed_indices) == [5, 6]
    again = stage1("more.json")
    assert again.entries_computed == 0 and again.entries_reused == 7


BAD_RUNS = [
    ([{"name": "a", "base_path": "a", "metadata": "a/metadata.csv", "colour": 1}], "unknown key 'colour'"),
    ([{"name": "a", "base_path": "nowhere", "metadata": "a/metadata.csv"}], "base_path"),
    ([{"name": "a", "base_path": "a", "metadata": "a/none.csv"}], "metadata"),
    ([{"name": "a", "base_path": "a", "metadata": "a/metadata.csv", "repeats": 0}], "`repeats` must be"),
    ([{"name": "a", "base_path": "a", "metadata": "a/metadata.csv", "weight": -1}], "`weight` must be"),
    ([{"name": "a", "base_path": "a", "metadata": "a/metadata.csv"}] * 2, "named twice"),
]


@pytest.mark.parametrize("task", ["sft", "sft:data_process", "sft:split"])
@pytest.mark.parametrize("tables, fragment", BAD_RUNS, ids=[b[1][:20] for b in BAD_RUNS])
def test_a_bad_config_is_one_line_and_nothing_is_written(tables, fragment, task, tiny, data, tmp_path, capsys):
    config = write_config(data, tables, ".toml", name=f"bad-{[b[1] for b in BAD_RUNS].index(fragment)}")
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(tiny, out, task, "--dataset_config", str(config)))
    one_error_line(code, err, fragment, str(config))
    assert not out.exists()


@pytest.mark.parametrize("flags, fragment", [
    (("--dataset_base_path", "X"), "--dataset_base_path"),
    (("--dataset_metadata_path", "X.csv"), "--dataset_metadata_path"),
    (("--dataset_repeat", "2"), "--dataset_repeat"),
])
def test_the_flags_of_one_dataset_go_without_a_config(flags, fragment, tiny, data, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(tiny, out, "sft", "--dataset_config", str(data / "mix.toml"), *flags))
    one_error_line(code, err, fragment, "give")
    assert not out.exists()


@pytest.mark.slow
def test_sigkill_and_resume_with_two_datasets_is_exact(tiny, data, tmp_path, capsys):
    """Killed after a state is saved and resumed: the same losses and weights as the uninterrupted run (the weighted
    dataset's subset is drawn anew each epoch, and resuming draws it again the same); a resume with other repeats is
    another training, refused in one line."""
    from test_resume import command, killed_and_resumed

    extra = ("--dataset_config", str(data / "mix.toml"), "--num_epochs", "2", "--save_steps", "1")
    whole = tmp_path / "whole"
    code, _, err = cli(capsys, *argv(tiny, whole, "sft:split", *extra))
    assert code == 0, err
    resumed = tmp_path / "resumed"
    kills, printed = killed_and_resumed(command(1) + argv(tiny, resumed, "sft:split", *extra), resumed, kills=1,
                                        rng=random.Random(11))
    assert kills == 1 and "resuming from" in printed, printed
    ra, rb = read_loss_csv(whole / "loss.csv"), read_loss_csv(resumed / "loss.csv")
    assert [(r["step"], r["timestep"]) for r in ra] == [(r["step"], r["timestep"]) for r in rb]
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], abs=1e-6, rel=0)
    wa, wb = load_file(str(whole / "epoch-1.safetensors")), load_file(str(resumed / "epoch-1.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)
    changed = data / "changed.toml"
    shutil.copy(data / "mix.toml", changed)
    changed.write_text(changed.read_text().replace("repeats = 2", "repeats = 3"))
    code, _, err = cli(capsys, *argv(tiny, resumed, "sft:split", *extra[:1], str(changed), *extra[2:], "--resume"))
    one_error_line(code, err, "another data", "--dataset_config")


def test_the_dry_run_plans_the_largest_size_a_dataset_trains_at(tiny, data):
    """`b` trains at its own max_pixels (256), `a` at the run's (32 x 32): the plan of the config is the plan of the
    larger setting, stage by stage, and says which dataset it planned; a config whose datasets all train at the run's
    settings plans as the run."""
    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.memory_plan import memory_plan
    from unitgraph.backends.diffusion.session import plan_for

    def plan(**flags):
        cfg = RunConfig.from_args(make_args(task="sft", model_paths=str(tiny), lora_base_model="dit", lora_rank=4,
                                            mixed_precision="no", progress=False, **flags))
        return memory_plan(cfg, plan_for(cfg))

    big = {"name": "big", "base_path": "a", "metadata": "a/metadata.csv", "max_pixels": 64 * 64}
    small = {"name": "a", "base_path": "a", "metadata": "a/metadata.csv"}
    config = write_config(data, [small, big], ".json", name="sizes")
    mixed = plan(dataset_config=str(config), max_pixels=SIZE * SIZE)
    alone = plan(dataset_base_path=str(data / "a"), dataset_metadata_path=str(data / "a" / "metadata.csv"),
                 max_pixels=64 * 64)
    run_size = plan(dataset_base_path=str(data / "a"), dataset_metadata_path=str(data / "a" / "metadata.csv"),
                    max_pixels=SIZE * SIZE)
    for stage in ("data_process", "train", "unsplit"):
        assert mixed["stages"][stage]["peak_bytes"] == alone["stages"][stage]["peak_bytes"], stage
    assert mixed["stages"]["train"]["peak_bytes"] > run_size["stages"]["train"]["peak_bytes"]
    assert any("dataset 'big'" in n and "the largest peak of the 2 sizes" in n for n in mixed["notes"]), mixed["notes"]
    same = plan(dataset_config=str(write_config(data, [small], ".json", name="plain")), max_pixels=SIZE * SIZE)
    assert same["stages"] == run_size["stages"] and not any("--dataset_config" in n for n in same["notes"])

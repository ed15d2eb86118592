"""The dry run (`unitgraph train ... --dry_run`) reads a model folder's configs as the run does, and a hostile one ends
in one line and exit code 2, never a traceback (docs/safety.md, issue #37 kind 1):

- a layer count, head count, head dimension or patch size that is a float, string, null, NaN, boolean, negative or
  huge is refused by the reader the run uses (models/folders.config_size_problem, through check_config_sizes), naming
  config.json; a property test throws such values at it, and a few at the whole dry run;
- sizes that pass each bound alone but multiply past it (heads x head_dim, a patch's elements) are refused there too,
  and the model built from a config is bounded (parameters, a tensor's elements) before anything is traced;
- a model_index.json nested without end is read with the user-file reader's depth bound;
- --max_pixels past the pixels an image may have is planned at that bound; --height x --width past it is refused;
- a --lora_rank the run refuses (train/loop.check_rank) is refused by the dry run in the run's words;
- a config that passes every check and still cannot be traced at the run's size is one line naming the file.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion import memory_plan  # noqa: E402
from unitgraph.backends.diffusion.args import MAX_FRAMES  # noqa: E402
from unitgraph.backends.diffusion.models.folders import (MAX_LAYERS, MAX_WIDTH, ModelLoadError,  # noqa: E402
                                                         check_config_sizes, config_size_problem)
from unitgraph.backends.diffusion.registry import families  # noqa: E402

# the sizes of the test-size Qwen-Image DiT's config.json a hostile tester changed, and what each must be
SIZES = {"num_layers": 0, "num_attention_heads": 1, "attention_head_dim": 1, "patch_size": 1}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FEW = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

bad_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.integers(max_value=-1),
    st.integers(min_value=MAX_WIDTH + 1, max_value=1 << 80),
    st.lists(st.one_of(st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=2)), max_size=3),
)


def dry_run(capsys, folder: Path, *flags: str) -> tuple[int, str, str]:
    return cli(capsys, "train", "--task", "sft:split", "--model_paths", str(folder), "--dataset_base_path", str(folder),
               "--lora_base_model", "dit", "--max_pixels", "4096", "--dry_run", *flags)


def with_config(tiny: Path, where: Path, **changes) -> Path:
    """A copy of the tiny Qwen-Image folder whose DiT config.json has `changes` (NaN written as JSON's NaN literal)."""
    folder = where / "models"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(tiny, folder)
    path = folder / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


def is_size(key: str, value) -> bool:
    """What the reader must accept: a whole number (not a boolean) within the bounds or a list of them (a UNet's
    head dimensions per block), or null for a width."""
    if value is None:
        return key != "num_layers"
    if isinstance(value, list):
        return bool(value) and all(value_ is not None and is_size(key, value_) for value_ in value)
    least = SIZES[key]
    most = MAX_LAYERS if key == "num_layers" else MAX_WIDTH
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


@FAST
@given(key=st.sampled_from(sorted(SIZES)), value=bad_values)
@example(key="num_layers", value=float("nan"))
@example(key="num_layers", value=2.5)
@example(key="attention_head_dim", value="128")
@example(key="num_attention_heads", value=-1)
@example(key="num_layers", value=None)
@example(key="patch_size", value=True)
def test_the_reader_refuses_any_size_that_is_no_size_in_one_line(tiny, key, value):
    config = json.loads((tiny / "transformer" / "config.json").read_text())
    config[key] = value
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / "config.json"
        path.write_text(json.dumps(config))
        if is_size(key, value) and config_size_problem(config) is None:
            check_config_sizes(Path(where))  # accepted: the plan builds it (the CLI test below runs a few)
            return
        with pytest.raises(ModelLoadError) as err:
            check_config_sizes(Path(where))
    line = str(err.value)
    assert "\n" not in line and line.startswith(str(path)), line
    assert key in line or "NaN" in line or "Infinity" in line, line


@FEW
@given(key=st.sampled_from(sorted(SIZES)), value=bad_values | st.integers(0, 8))
@example(key="num_layers", value=-1)  # the message blamed --lora_target_modules
@example(key="num_attention_heads", value=None)  # a null the library would take for "derive it": a TypeError
@example(key="patch_size", value=32)  # passes every bound; a patch larger than the image cannot be traced
def test_the_dry_run_of_a_hostile_config_succeeds_or_is_one_line(tiny, capsys, key, value):
    with tempfile.TemporaryDirectory() as where:
        code, _, err = dry_run(capsys, with_config(tiny, Path(where), **{key: value}))
    if code != 0:
        line = one_error_line(code, err)
        assert "config.json" in line or "--lora_target_modules" in line, line


@pytest.mark.parametrize("key", ["num_layers", "num_attention_heads", "attention_head_dim"])
@pytest.mark.parametrize("value", [2.5, "x", None, math.nan, -1])
def test_a_non_size_in_the_dits_config_is_one_line_naming_it(tiny, tmp_path, capsys, key, value):
    if value is None and key != "num_layers":  # null is a width some libraries derive; building says what fails
        fragments = ["transformer/config.json", "cannot build dit"]
    else:
        fragments = ["transformer/config.json", key if not isinstance(value, float) or value == value else "NaN"]
    code, _, err = dry_run(capsys, with_config(tiny, tmp_path, **{key: value}))
    line = one_error_line(code, err, *fragments)
    assert "--lora_target_modules" not in line


@pytest.mark.parametrize("changes, fragment", [
    ({"num_attention_heads": 3, "attention_head_dim": 60000}, "num_attention_heads 3 x attention_head_dim 60000"),
    ({"patch_size": 200}, "patch_size 200 makes patches of 640000 elements"),
])
def test_sizes_that_multiply_past_the_bound_are_refused_before_building(tiny, tmp_path, capsys, changes, fragment):
    code, _, err = dry_run(capsys, with_config(tiny, tmp_path, **changes))
    one_error_line(code, err, "transformer/config.json", fragment, f"at most {MAX_WIDTH}")


@pytest.mark.parametrize("bound, fragment", [("MAX_PARAMS", "parameters, more than any model has"),
                                             ("MAX_TENSOR_ELEMENTS", "elements, more than any model's tensor")])
def test_the_built_models_size_is_bounded_before_a_trace(tiny, tmp_path, capsys, monkeypatch, bound, fragment):
    monkeypatch.setattr(memory_plan, bound, 1000)  # the test-size models have more: the bound must stop the plan
    code, _, err = dry_run(capsys, tiny)
    one_error_line(code, err, "config.json", fragment)


def test_a_model_index_nested_without_end_is_one_line(tiny, tmp_path, capsys):
    folder = with_config(tiny, tmp_path)
    (folder / "model_index.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, _, err = dry_run(capsys, folder)
    one_error_line(code, err, "model_index.json", "nested deeper than 100 levels")


def test_max_pixels_past_an_images_bound_is_planned_at_the_bound(tiny, capsys):
    from PIL import Image

    code, out, err = dry_run(capsys, tiny, "--max_pixels", str(2**62), "--json")
    assert code == 0, err
    plan = json.loads(out)
    side = math.isqrt(Image.MAX_IMAGE_PIXELS) // 16 * 16
    assert plan["settings"]["size"]["width"] == plan["settings"]["size"]["height"] == side
    assert any("Image.MAX_IMAGE_PIXELS" in note for note in plan["notes"])


def test_height_and_width_past_an_images_bound_are_one_line(tiny, capsys):
    code, _, err = dry_run(capsys, tiny, "--height", str(2**31), "--width", str(2**31))
    one_error_line(code, err, "--height 2147483648 --width 2147483648", "Image.MAX_IMAGE_PIXELS")


def test_a_lora_rank_the_run_refuses_is_refused_in_its_words(tiny, capsys):
    code, _, err = dry_run(capsys, tiny, "--lora_rank", "100000")
    one_error_line(code, err, "--lora_rank 100000 is larger than any layer it targets in dit (at most")


def test_the_released_configs_pass_the_reader(tmp_path):
    """The bounds refuse no released model: every family's published configs (families/*/real.py), every size."""
    checked = 0
    for family in families():
        try:
            real = importlib.import_module(".real", family.package)
        except ModuleNotFoundError:
            continue
        for size in real.RELEASES:
            folder = real.write_real_configs(tmp_path / f"{family.name}-{size}", size=size)
            for path in Path(folder).rglob("config.json"):
                check_config_sizes(path.parent)
                checked += 1
    assert checked >= 20


def test_a_clip_past_the_traced_frames_is_one_line_before_a_trace(tmp_path, capsys):
    from unitgraph.backends.diffusion.families.wan.real import write_real_configs

    folder = write_real_configs(tmp_path / "wan", "real-1.3b")  # config.json files only: nothing is built
    code, _, err = cli(capsys, "train", "--task", "sft:split", "--model_paths", str(folder), "--dataset_base_path",
                       str(folder), "--lora_base_model", "dit", "--num_frames", str(4 * 10**8 + 1), "--dry_run")
    one_error_line(code, err, "--num_frames 400000001", f"at most {MAX_FRAMES} frames")

"""`unitgraph twin FILE`: a pickled model file's safetensors twin (backends/diffusion/models/twin.py), the one place a
pickle is opened, by torch's weights-only loader, because the user asked for it."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.models.twin import write_twin  # noqa: E402

MARKER = Path("/tmp/unitgraph-twin-test-ran-code")


class Payload:
    """A pickle that would run code when unpickled by the full unpickler: creates MARKER."""

    def __reduce__(self):
        return (Path.touch, (MARKER,))


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
SHAPES = st.lists(st.integers(0, 3), max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(NAMES, st.tuples(SHAPES, DTYPES), min_size=1, max_size=5), st.booleans(), st.booleans())
def test_a_state_dict_is_kept_name_by_name_shape_by_shape_bit_for_bit(tmp_path_factory, spec, wrapped, legacy):
    folder = tmp_path_factory.mktemp("twin")
    generator = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shape, generator=generator) * 5).to(dtype) for name, (shape, dtype) in spec.items()}
    path = folder / "model.pth"
    torch.save({"state_dict": state} if wrapped else state, path, _use_new_zipfile_serialization=not legacy)
    target, count = write_twin(path)
    assert target == folder / "model.safetensors" and count == len(state)
    back = load_file(str(target))
    assert list(back) == sorted(state) or set(back) == set(state)
    for name, value in state.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert torch.equal(back[name], value)
    assert _left(folder) == ["model.pth", "model.safetensors"]  # no temporary file left


def test_tied_and_strided_tensors_are_written_as_copies(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    state = {"embed.weight": base, "lm_head.weight": base, "transposed": base.t(), "row": base[1]}
    torch.save(state, tmp_path / "tied.bin")
    target, count = write_twin(tmp_path / "tied.bin")
    back = load_file(str(target))
    assert count == 4 and all(torch.equal(back[k], v) for k, v in state.items())


def test_a_bare_tensor_is_kept_under_the_files_stem(tmp_path):
    value = torch.randn(1, 8, 5)
    torch.save(value, tmp_path / "silence_latent.pt")
    target, _ = write_twin(tmp_path / "silence_latent.pt")
    assert list(load_file(str(target))) == ["silence_latent"]
    assert torch.equal(load_file(str(target))["silence_latent"], value)


def test_the_cli_writes_each_twin_and_names_it(tmp_path, capsys):
    for name in ("a.pth", "b.ckpt"):
        torch.save({"w": torch.ones(2)}, tmp_path / name)
    code, out, err = cli(capsys, "twin", str(tmp_path / "a.pth"), str(tmp_path / "b.ckpt"))
    assert code == 0, err
    assert out.splitlines() == [f"1 tensors of {tmp_path / 'a.pth'} -> {tmp_path / 'a.safetensors'}",
                                f"1 tensors of {tmp_path / 'b.ckpt'} -> {tmp_path / 'b.safetensors'}"]


def test_an_existing_twin_is_never_overwritten(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pth")
    (tmp_path / "m.safetensors").write_bytes(b"the user's own file")
    code, _, err = cli(capsys, "twin", str(tmp_path / "m.pth"))
    one_error_line(code, err, "m.safetensors", "exists already")
    assert (tmp_path / "m.safetensors").read_bytes() == b"the user's own file"


def test_code_in_a_pickle_is_never_run(tmp_path, capsys):
    MARKER.unlink(missing_ok=True)
    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"w": Payload()}))
    code, _, err = cli(capsys, "twin", str(tmp_path / "evil.pth"))
    one_error_line(code, err, "evil.pth", "not a file torch's weights-only loader reads")
    assert not MARKER.exists()
    assert _left(tmp_path) == ["evil.pth"]


@pytest.mark.parametrize("content, problem", [
    (b"", "not a file torch's weights-only loader reads"),
    (b"PK\x03\x04 truncated zip", "not a file torch's weights-only loader reads"),
    ("list", "holds a list, not a state dict or a tensor"),
    ("step", "holds 'step', a int, where a state dict holds tensors only"),
    ("nested", "holds 'block', a dict, where a state dict holds tensors only"),
    ("number key", "holds a key 3 that is not a name"),
    ("empty", "holds no tensor"),
])
def test_a_file_that_is_no_state_dict_is_one_line_and_leaves_nothing(tmp_path, capsys, content, problem):
    path = tmp_path / "bad.pth"
    values = {"list": [torch.ones(1)], "step": {"w": torch.ones(1), "step": 3},
              "nested": {"block": {"w": torch.ones(1)}}, "number key": {3: torch.ones(1)}, "empty": {}}
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(values[content], path)
    code, _, err = cli(capsys, "twin", str(path))
    one_error_line(code, err, "bad.pth", problem)
    assert _left(tmp_path) == ["bad.pth"]


def test_other_files_are_refused(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    code, _, err = cli(capsys, "twin", str(tmp_path / "model.safetensors"))
    one_error_line(code, err, "model.safetensors", "not a pickled model file", ".pth, .pt, .bin, .ckpt")
    code, _, err = cli(capsys, "twin", str(tmp_path / "absent.pth"))
    one_error_line(code, err, "absent.pth", "file not found")
    (tmp_path / "folder.pth").mkdir()
    with pytest.raises(BackendError, match="not a file"):
        write_twin(tmp_path / "folder.pth")

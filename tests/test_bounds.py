"""Inputs that would work without limit have a documented bound, checked before any work (docs/safety.md): metadata
rows (and a file many rows name is looked at once), the demo's size, validation steps; and `lora convert` cleans
what a killed convert of its own left, and folds a LoRA scale in a dtype that holds the result."""

from __future__ import annotations

import json
import os
import time

import pytest
from clitools import cli, one_error_line

torch = pytest.importorskip("torch")

from unitgraph.backends.diffusion.args import MAX_VALIDATION_INFERENCE_STEPS, make_args  # noqa: E402
from unitgraph.backends.diffusion.data import dataset as dataset_module  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import DiffusionDataset, read_metadata, write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402


def test_metadata_past_the_row_bound_is_refused_before_a_sample_is_looked_at(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_module, "MAX_METADATA_ROWS", 10)
    for name, header, row in (("m.csv", "image,prompt\n", "a.png,x\n"), ("m.jsonl", "", '{"image": "a.png"}\n'),
                              ("m.json", None, None)):
        path = tmp_path / name
        if header is None:
            path.write_text(json.dumps([{"image": "a.png"}] * 11))
        else:
            path.write_text(header + row * 11)
        with pytest.raises(BackendError, match=f"{name}: has more than 10 rows, the most a run reads"):
            read_metadata(path)
        if header is None:
            path.write_text(json.dumps([{"image": "a.png"}] * 10))
        else:
            path.write_text(header + row * 10)
        assert len(read_metadata(path)) == 10


def test_a_file_many_rows_name_is_looked_at_once(tmp_path, monkeypatch):
    write_synthetic_dataset(tmp_path, count=2, size=32, seed=0)
    lines = (tmp_path / "metadata.csv").read_text().splitlines()
    (tmp_path / "many.csv").write_text("\n".join([lines[0]] + [lines[1 + i % 2] for i in range(2000)]) + "\n")
    looked = []
    real = dataset_module._not_a_file
    monkeypatch.setattr(dataset_module, "_not_a_file", lambda path: looked.append(path) or real(path))
    data = DiffusionDataset(tmp_path, tmp_path / "many.csv", ["image", "prompt"])
    digests = []
    for i in range(len(data)):
        data.sample_id(i, lambda p: digests.append(p) or "00" * 32)
    assert len(looked) == 2 and len(digests) == 2000  # the stage-1 key memoises digests per file (stage1.py)


@pytest.mark.parametrize("flag, value, fragment", [
    ("--images", str(10 ** 9), "--images must be between 1 and"),
    ("--resolution", str(2 ** 20), "--resolution must be a multiple of 16 between 16 and"),
    ("--num_epochs", str(10 ** 9), "--num_epochs must be between 1 and"),
])
def test_the_demo_is_bounded_before_anything_is_written(flag, value, fragment, tmp_path, capsys):
    code, _, err = cli(capsys, "demo", "--output_path", str(tmp_path / "demo"), flag, value)
    one_error_line(code, err, fragment)
    assert list(tmp_path.iterdir()) == []


def test_validation_inference_steps_are_bounded_at_parse_time():
    with pytest.raises(BackendError, match=f"between 1 and {MAX_VALIDATION_INFERENCE_STEPS}, got 1000000000"):
        make_args(task="sft", lora_base_model="dit", validation_inference_steps=10 ** 9).validate()
    make_args(task="sft", lora_base_model="dit", validation_inference_steps=MAX_VALIDATION_INFERENCE_STEPS).validate()


def lora_file(path, dtype=torch.float16, alpha=4.0, value=1.0):
    from safetensors.torch import save_file

    module = "transformer.transformer_blocks.0.attn.to_q"
    tensors = {f"{module}.lora_A.weight": torch.full((4, 16), value, dtype=dtype),
               f"{module}.lora_B.weight": torch.full((16, 4), 0.5, dtype=dtype)}
    config = {"transformer.r": 4, "transformer.lora_alpha": alpha, "transformer.target_modules": ["to_q"]}
    save_file(tensors, str(path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    return path


def test_a_convert_cleans_what_a_killed_convert_into_the_same_file_left(tmp_path, capsys):
    src = lora_file(tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    old = time.time() - 3600
    leftovers = {name: tmp_path / name for name in (".out.safetensors.k3j9x_2a.tmp", ".notes.tmp",
                                                    ".other.safetensors.k3j9x_2a.tmp")}
    for path in leftovers.values():
        path.write_bytes(b"x" * 100)
        os.utime(path, (old, old))
    fresh = tmp_path / ".out.safetensors.abcdefgh.tmp"  # a convert writing it right now
    fresh.write_bytes(b"being written")
    code, _, err = cli(capsys, "lora", "convert", str(src), str(out), "--to", "diffsynth")
    assert code == 0, err
    assert not leftovers[".out.safetensors.k3j9x_2a.tmp"].exists()
    assert leftovers[".notes.tmp"].exists() and leftovers[".other.safetensors.k3j9x_2a.tmp"].exists() and fresh.exists()


def test_an_fp16_lora_whose_folded_alpha_overflows_converts_in_float32(tmp_path, capsys):
    from unitgraph.backends.diffusion.families.qwen_image import FAMILY
    from unitgraph.backends.diffusion.models.lora import read_lora_file

    src = lora_file(tmp_path / "in.safetensors", alpha=4.0 * 20000.0, value=10.0)  # scale 20000: A x scale = 2e5
    out = tmp_path / "out.safetensors"
    code, _, err = cli(capsys, "lora", "convert", str(src), str(out), "--to", "diffsynth")
    assert code == 0, err
    prefixes = {s.name: s.lora_prefix or s.name for s in FAMILY.slots if s.kind == "model"}
    lora = read_lora_file(out, "dit", prefixes)  # the reader takes the converted file: no inf in it
    a = next(v for k, v in lora.weights.items() if ".lora_A." in k)
    assert a.dtype == torch.float32 and torch.allclose(a, torch.full_like(a, 2e5))
    small = lora_file(tmp_path / "small.safetensors", alpha=8.0, value=1.0)  # fits fp16: stays fp16
    assert cli(capsys, "lora", "convert", str(small), str(tmp_path / "s.safetensors"), "--to", "diffsynth")[0] == 0
    assert all(v.dtype == torch.float16 for v in read_lora_file(tmp_path / "s.safetensors", "dit", prefixes).weights.values())


def test_a_run_refuses_a_fixed_size_past_the_image_bound_and_clips_past_1025_frames(capsys, tmp_path):
    """The run, not only its dry run: --height x --width past PIL's image bound would resize every sample to it
    (gigabytes an image), and --num_frames past MAX_FRAMES reads clips of that many frames; one line, nothing written."""
    from unitgraph.backends.diffusion.args import MAX_FRAMES, image_pixel_limit

    base = ["train", "--task", "sft", "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit",
            "--output_path", str(tmp_path / "out")]
    side = 16 * (int(image_pixel_limit() ** 0.5) // 16 + 16)
    code, _, err = cli(capsys, *base, "--height", str(side), "--width", str(side))
    one_error_line(code, err, f"--height {side} --width {side}", "Image.MAX_IMAGE_PIXELS")
    code, _, err = cli(capsys, *base, "--pipeline", "wan", "--num_frames", str(MAX_FRAMES + 4))
    one_error_line(code, err, f"--num_frames {MAX_FRAMES + 4}", f"at most {MAX_FRAMES}")
    assert not (tmp_path / "out").exists()
    make_args(task="sft", lora_base_model="dit", num_frames=MAX_FRAMES, height=1024, width=1024)  # at the bounds: fine

"""Stage 2 with --batch_size B through the real `stages.run` path, --cache_dtype, and the dropout stream.

A batch of B must give the gradient of B accumulated steps (per-sample randomness stays per sample),
a cache stored in fp16 is half the size and is a different cache, and skipping the seeded dropout
stream for models without dropout changes no number.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from unitgraph.backends.diffusion import stages  # noqa: E402
from unitgraph.backends.diffusion.train import loop as training  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.args import make_args
from unitgraph.backends.diffusion.cache.verify import cache_info  # noqa: E402
from unitgraph.backends.diffusion.cache.entries import read_entry
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.family import SinkCode  # noqa: E402
from unitgraph.backends.diffusion.registry import families  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import draws_dropout, read_loss_csv  # noqa: E402

SIZE = 64
PROMPTS = ["a dog", "a red circle on a blue background", "a cat", "a small white dog running on green grass",
           "a yellow square", "blue sky with white clouds", "a bird"]


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> Path:
    """4 square images: one shape bucket."""
    folder = tmp_path_factory.mktemp("squares")
    write_synthetic_dataset(folder, count=4, size=SIZE, seed=3)
    return folder


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """7 images, 5 of 64 x 64 and 2 of 64 x 32, prompts of different lengths: two buckets."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("mixed")
    (folder / "images").mkdir()
    rows = []
    for i, prompt in enumerate(PROMPTS):
        size = (64, 32) if i in (2, 5) else (64, 64)
        Image.new("RGB", size, (30 * i, 200 - 20 * i, 90)).save(folder / "images" / f"{i}.png")
        rows.append({"image": f"images/{i}.png", "prompt": prompt})
    with (folder / "metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    return folder


def common(tiny: Path, data: Path, **extra):
    kwargs = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny),
                  lora_base_model="dit", lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4,
                  max_pixels=SIZE * SIZE, seed=5, learning_rate=1e-3, progress=False, plot=False,
                  mixed_precision="no")  # batching's tolerances are fp32's: bf16 rounds batched kernels 1e-5 apart
    kwargs.update(extra)
    return kwargs


def quiet(_text: str) -> None:
    pass


def stage1(tiny: Path, data: Path, cache: Path, **extra):
    return run(make_args(task="sft:data_process", output_path=str(cache), **common(tiny, data, **extra)), echo=quiet)


def stage2(tiny: Path, data: Path, cache: Path, out: Path, **extra):
    kwargs = common(tiny, data, **extra)
    kwargs.update(dataset_base_path=str(cache), dataset_metadata_path=None)
    return run(make_args(task="sft:train", output_path=str(out), **kwargs), echo=quiet)


@pytest.fixture(scope="module")
def square_cache(tiny, squares, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("square_cache")
    stage1(tiny, squares, cache)
    return cache


# ------------------------------------------------------------------------------------------------
# arguments (no models)


def test_batch_size_and_cache_dtype_arguments():
    base = dict(lora_base_model="dit")
    assert make_args(task="sft:train", batch_size=4, **base).batch_size == 4
    assert make_args(task="sft:split", batch_size=2, **base).batch_size == 2
    assert make_args(task="sft:data_process", batch_size=2).batch_size == 2  # like --dataset_repeat: no effect on the cache
    with pytest.raises(BackendError, match=r"--batch_size 2 needs stage 2 \(--task sft:split or sft:train\)"):
        make_args(task="sft", batch_size=2, **base)
    with pytest.raises(BackendError, match="--batch_size must be at least 1"):
        make_args(task="sft:train", batch_size=0, **base)
    assert make_args(task="sft:split", cache_dtype="fp16", **base).cache_dtype == "fp16"
    with pytest.raises(BackendError, match="--cache_dtype must be one of bf16, fp16, fp32"):
        make_args(task="sft:split", cache_dtype="int8", **base)
    images_only = {"ConditionImageResizer", "FirstFrame"}  # write PIL images (for a VL or CLIP encoder): --cache_dtype cannot change them
    for unit in (u for family in families() for pipeline in family.pipelines for u in pipeline.units):
        assert ("cache_dtype" in unit.settings) != (unit.name in images_only), unit.name  # the others write float tensors


def test_train_command_exposes_both_spellings():
    import typer

    from unitgraph.cli.app import app

    command = typer.main.get_command(app).commands["train"]
    options = {opt for param in command.params for opt in param.opts}
    for flag in ("--batch_size", "--batch-size", "--cache_dtype", "--cache-dtype", "--dataset_num_workers",
                 "--dataset-num-workers"):
        assert flag in options, flag


# ------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.slow
def test_sft_train_with_batch_size_two_runs_over_shape_buckets(tiny, mixed, tmp_path):
    cache = tmp_path / "cache"
    stage1(tiny, mixed, cache)
    result = stage2(tiny, mixed, cache, tmp_path / "train", batch_size=2, num_epochs=2)
    # 5 squares -> 2 + 2 + 1, 2 wide images -> 2: four micro-batches, four optimizer steps per epoch
    rows = read_loss_csv(tmp_path / "train" / "loss.csv")
    assert result.steps == 8 and [(r["step"], r["epoch"]) for r in rows] == [(s + 1, s // 4) for s in range(8)]
    assert all(r["loss"] > 0 for r in rows)
    weights = load_file(str(tmp_path / "train" / "epoch-1.safetensors"))
    assert weights and all(torch.isfinite(v).all() for v in weights.values())
    # with accumulation: the 4 micro-batches of an epoch make 2 steps; sft:split takes --batch_size too
    split = run(make_args(task="sft:split", output_path=str(tmp_path / "split"), batch_size=2, gradient_accumulation_steps=2,
                          **common(tiny, mixed)), echo=quiet)
    assert split.steps == 2 and len(read_loss_csv(tmp_path / "split" / "loss.csv")) == 2


class _RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps a copy of the gradients of its first step."""

    first_grads: list = []

    def step(self, closure=None):
        if not _RecordingAdamW.first_grads:
            _RecordingAdamW.first_grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                           for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def _first_step_grads(monkeypatch, **run_kwargs):
    _RecordingAdamW.first_grads = []
    with monkeypatch.context() as patch:
        patch.setattr(torch.optim, "AdamW", _RecordingAdamW)
        result = stage2(**run_kwargs)
    return result, list(_RecordingAdamW.first_grads)


@pytest.mark.slow
def test_one_step_at_batch_two_equals_two_accumulated_steps(tiny, squares, square_cache, tmp_path, monkeypatch):
    """Through stages.run: batch_size 2 x 1 micro-step vs batch_size 1 x 2 micro-steps, same seed, same samples."""
    common_kwargs = dict(tiny=tiny, data=squares, cache=square_cache, save_steps=1, num_epochs=1)
    batched, grad_b = _first_step_grads(monkeypatch, out=tmp_path / "b2", batch_size=2, gradient_accumulation_steps=1,
                                        **common_kwargs)
    accumulated, grad_a = _first_step_grads(monkeypatch, out=tmp_path / "b1", batch_size=1, gradient_accumulation_steps=2,
                                            **common_kwargs)
    assert batched.steps == accumulated.steps == 2
    assert grad_b and len(grad_b) == len(grad_a)
    worst = max(float((a - b).abs().max()) for a, b in zip(grad_a, grad_b))
    print(f"max |grad(batch of 2) - grad(2 accumulated steps)| = {worst:.2e}")
    assert worst <= 1e-5
    assert max(float(g.abs().max()) for g in grad_b) > 1e-4  # not trivially zero
    la, lb = read_loss_csv(tmp_path / "b1" / "loss.csv"), read_loss_csv(tmp_path / "b2" / "loss.csv")
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], abs=1e-5)
    wa, wb = load_file(str(tmp_path / "b1" / "step-1.safetensors")), load_file(str(tmp_path / "b2" / "step-1.safetensors"))
    assert set(wa) == set(wb) and wa
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5
    # and the step did change the weights (LoRA B starts at zero)
    assert any(float(wb[k].abs().max()) > 0 for k in wb if "lora_B" in k)


@pytest.mark.slow
def test_dataloader_workers_give_the_same_training(tiny, squares, square_cache, tmp_path):
    kwargs = dict(batch_size=2, num_epochs=1, dataset_repeat=2)
    stage2(tiny, squares, square_cache, tmp_path / "w0", **kwargs)
    stage2(tiny, squares, square_cache, tmp_path / "w1", dataset_num_workers=1, **kwargs)
    la, lb = read_loss_csv(tmp_path / "w0" / "loss.csv"), read_loss_csv(tmp_path / "w1" / "loss.csv")
    assert [r["loss"] for r in la] == [r["loss"] for r in lb] and len(la) == 4
    wa, wb = load_file(str(tmp_path / "w0" / "epoch-0.safetensors")), load_file(str(tmp_path / "w1" / "epoch-0.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_non_finite_loss_in_a_batch_names_its_samples(tiny, squares, square_cache, tmp_path, monkeypatch):
    real_sink = SinkCode.__call__
    calls = []

    def sink(self, ctx, inputs):
        calls.append(int(inputs["input_latents"].shape[0]))
        loss = real_sink(self, ctx, inputs)
        return loss * float("inf") if len(calls) == 2 else loss

    monkeypatch.setattr(SinkCode, "__call__", sink)
    with pytest.raises(BackendError) as exc:
        stage2(tiny, squares, square_cache, tmp_path / "out", batch_size=2)
    message = exc.value.one_line()
    assert calls == [2, 2]
    assert "loss is inf at step 2 (epoch 0) on a batch of 2: sample " in message and message.count("(metadata row") == 2


@pytest.mark.slow
def test_cache_dtype_fp16_halves_the_cache_and_is_another_cache(tiny, squares, square_cache, tmp_path):
    fp32 = cache_info(square_cache)
    cache = tmp_path / "cache"
    shutil_copy(square_cache, cache)
    result = stage1(tiny, squares, cache, cache_dtype="fp16")
    assert result.computed_indices == [0, 1, 2, 3]  # the fp32 entries are not reused
    assert "--cache_dtype fp16 now, --cache_dtype fp32 in the cache" in result.stage1_reason
    fp16 = cache_info(cache)
    assert fp16["settings"]["cache_dtype"] == "float16"
    assert "cache_dtype" not in fp32["settings"]  # the default (the model's dtype) keeps the keys caches had before
    for key in ("input_latents", "prompt_emb"):  # floating tensors: half the bytes
        assert fp16["bytes_per_sample_by_key"][key] * 2 == fp32["bytes_per_sample_by_key"][key] > 0, key
    assert fp16["bytes_per_sample_by_key"]["prompt_emb_mask"] == fp32["bytes_per_sample_by_key"]["prompt_emb_mask"]  # integers
    tensors = lambda info: sum(info["bytes_per_sample_by_key"].values())  # noqa: E731
    assert tensors(fp16) / tensors(fp32) < 0.52
    manifest = json.loads((cache / "manifest.json").read_text())
    values, _ = read_entry(cache / next(iter(manifest["entries"].values()))["file"])
    assert values["input_latents"].dtype == torch.float16 and values["prompt_emb_mask"].dtype == torch.long
    assert manifest["made_with"]["cache_dtype"] == "fp16"  # `cache repair` rebuilds it as fp16

    # stage 2 must be told (the same flags as stage 1), casts back to float32, and trains about the same
    with pytest.raises(BackendError, match=r"--cache_dtype fp32 now, --cache_dtype fp16 in the cache"):
        stage2(tiny, squares, cache, tmp_path / "t_default")
    half = stage2(tiny, squares, cache, tmp_path / "t16", cache_dtype="fp16")
    full = stage2(tiny, squares, square_cache, tmp_path / "t32")
    assert half.steps == full.steps == 4
    assert half.losses == pytest.approx(full.losses, rel=1e-2)
    provider = stages.CacheProvider(families()[0].pipeline("qwen_image"), half.plan, cache)
    assert provider.dtype == torch.float32
    # the same dtype again: everything reused
    assert stage1(tiny, squares, cache, cache_dtype="fp16").computed_indices == []


def shutil_copy(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)


@pytest.mark.slow
def test_skipping_the_dropout_stream_changes_no_number(tiny, squares, tmp_path, monkeypatch):
    """The models here have no dropout, so the stream is skipped; forcing it on gives the same training,
    and unsplit still equals split through the seeded path."""
    assert not draws_dropout({"m": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))})
    assert draws_dropout({"m": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))})
    assert not draws_dropout({"m": torch.nn.Sequential(torch.nn.Dropout(0.1)).eval()})
    extra = dict(num_epochs=1, dataset_repeat=2, gradient_accumulation_steps=2, save_steps=None)
    run(make_args(task="sft:split", output_path=str(tmp_path / "skipped"), **common(tiny, squares, **extra)), echo=quiet)
    monkeypatch.setattr(training, "draws_dropout", lambda _models: True)
    run(make_args(task="sft:split", output_path=str(tmp_path / "seeded"), **common(tiny, squares, **extra)), echo=quiet)
    run(make_args(task="sft", output_path=str(tmp_path / "unsplit"), **common(tiny, squares, **extra)), echo=quiet)
    skipped = read_loss_csv(tmp_path / "skipped" / "loss.csv")
    weights = load_file(str(tmp_path / "skipped" / "epoch-0.safetensors"))
    seeded = read_loss_csv(tmp_path / "seeded" / "loss.csv")
    assert [r["loss"] for r in seeded] == [r["loss"] for r in skipped]  # bit for bit
    assert all(torch.equal(w, weights[k]) for k, w in load_file(str(tmp_path / "seeded" / "epoch-0.safetensors")).items())
    unsplit = read_loss_csv(tmp_path / "unsplit" / "loss.csv")
    assert [r["loss"] for r in unsplit] == pytest.approx([r["loss"] for r in skipped], abs=1e-6, rel=0)
    assert all(torch.allclose(w, weights[k], atol=1e-6, rtol=0)
               for k, w in load_file(str(tmp_path / "unsplit" / "epoch-0.safetensors")).items())

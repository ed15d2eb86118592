"""Validation samples: rendered through each family's diffusers pipeline from stage 1's prompt embeddings, in a
stage 2 whose model folder has no text encoder, without changing what is trained."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from PIL import Image  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.registry import family  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32
PROMPTS = ["a red circle", "a blue square"]


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    models = family("qwen_image").tiny_module().write_tiny_models(root / "models", size="test", seed=0)
    data = root / "data"
    write_synthetic_dataset(data, count=3, size=SIZE, seed=5)
    return models, data, root


def common(models: Path, **extra):
    return dict(model_paths=str(models), lora_base_model="dit", lora_rank=4, max_pixels=SIZE * SIZE, progress=False,
                plot=False, **extra)


@pytest.mark.slow
def test_stage2_renders_samples_without_a_text_encoder_and_trains_the_same(qwen, tmp_path):
    models, data, _ = qwen
    cache = tmp_path / "cache"
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(cache), validation_prompt=PROMPTS, **common(models)), echo=quiet)
    assert (cache / "validation.safetensors").is_file()
    bare = tmp_path / "models"
    shutil.copytree(models, bare)
    shutil.rmtree(bare / "text_encoder")
    shutil.rmtree(bare / "tokenizer")
    train = dict(task="sft:train", dataset_base_path=str(cache), num_epochs=2, **common(bare))
    plain = run(make_args(output_path=str(tmp_path / "plain"), **train), echo=quiet)
    out = tmp_path / "out"
    result = run(make_args(output_path=str(out), validation_prompt=PROMPTS, validation_inference_steps=2, **train),
                 echo=quiet)
    assert [r["loss"] for r in read_loss_csv(out / "loss.csv")] == [r["loss"] for r in read_loss_csv(tmp_path / "plain" / "loss.csv")]
    assert plain.steps == result.steps == 6
    for epoch in (0, 1):
        pngs = [out / "samples" / f"epoch-{epoch}" / f"{k}.png" for k in range(2)]
        sizes = [Image.open(p).size for p in pngs]
        assert sizes == [(SIZE, SIZE)] * 2
        assert Image.open(out / "samples" / f"epoch-{epoch}.png").size == (2 * SIZE, SIZE)  # the contact sheet
    page = (out / "samples.html").read_text()
    assert re.findall(r'src="([^"]+)"', page) == [f"samples/epoch-{e}/{k}.png" for k in range(2) for e in (0, 1)]
    assert all((out / src).is_file() for src in re.findall(r'src="([^"]+)"', page)) and "a blue square" in page
    # samples of the same seed and weights are the same image; trained weights change them
    assert Image.open(out / "samples/epoch-0/0.png").tobytes() != Image.open(out / "samples/epoch-1/0.png").tobytes() \
        or Image.open(out / "samples/epoch-0/1.png").tobytes() != Image.open(out / "samples/epoch-1/1.png").tobytes()
    assert len(result.sample_images) == 4


@pytest.mark.slow
def test_prompts_stage1_did_not_encode_are_one_line_before_training(qwen, tmp_path, capsys):
    models, data, _ = qwen
    cache = tmp_path / "cache"
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(cache), validation_prompt=PROMPTS, **common(models)), echo=quiet)
    code, _, err = cli(capsys, "train", "--task", "sft:train", "--dataset_base_path", str(cache), "--model_paths",
                       str(models), "--lora_base_model", "dit", "--max_pixels", str(SIZE * SIZE), "--output_path",
                       str(tmp_path / "out"), "--validation_prompt", "a green dog", "--no-progress")
    one_error_line(code, err, "validation.safetensors", "run stage 1")
    assert not (tmp_path / "out").exists()
    code, _, err = cli(capsys, "train", "--pipeline", "qwen_image_edit", "--dataset_base_path", str(data),
                       "--validation_prompt", "x", "--lora_base_model", "dit", "--output_path", str(tmp_path / "o2"))
    one_error_line(code, err, "pipeline qwen_image_edit renders from an input image", "--validation_image")
    # a pipeline without a rendering (checked before the models load: the check alone, on the run's settings)
    from types import SimpleNamespace

    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.train.validation import check_supported

    wan = family("wan")
    settings = SimpleNamespace(family=wan, pipeline=wan.pipeline("wan_distill"),
                               validation=SimpleNamespace(prompts=("x",), guidance=None, negative_prompts=(), images=()))
    with pytest.raises(BackendError, match="pipeline wan_distill has no validation rendering yet"):
        check_supported(settings)
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("name, pipeline_class", [("flux", "FluxPipeline"), ("wan", "WanPipeline")])
def test_each_familys_render_matches_its_pipeline(tmp_path, name, pipeline_class):
    """The render module draws what the family's diffusers pipeline draws from the same embeddings and seed."""
    import importlib

    fam = family(name)
    root = fam.tiny_module().write_tiny_models(tmp_path / name, size="test", seed=0)
    pipe = getattr(diffusers, pipeline_class).from_pretrained(str(root))
    pipe.set_progress_bar_config(disable=True)
    render = importlib.import_module(fam.render, fam.package)
    if name == "flux":
        emb, pooled, _ = pipe.encode_prompt("a cat", prompt_2=None, max_sequence_length=512)
        embeds = {"prompt_emb": emb, "pooled_prompt_emb": pooled}
        models = {"dit": pipe.transformer, "vae_encoder": pipe.vae, "scheduler": pipe.scheduler}
        expected = pipe(prompt_embeds=emb, pooled_prompt_embeds=pooled, width=SIZE, height=SIZE, num_inference_steps=2,
                        guidance_scale=render.GUIDANCE, generator=torch.Generator().manual_seed(1)).images[0]
        negative = None  # FLUX.1's guidance is embedded in its DiT: no negative prompt
    else:  # classifier-free guidance at the pipeline's default scale, against the empty prompt as the pipeline uses
        emb = pipe.encode_prompt("a cat", do_classifier_free_guidance=False, max_sequence_length=512)[0]
        embeds = {"prompt_emb": emb}
        negative = {"prompt_emb": pipe.encode_prompt("", do_classifier_free_guidance=False, max_sequence_length=512)[0]}
        models = {"dit": pipe.transformer, "vae": pipe.vae, "scheduler": pipe.scheduler}
        frames = pipe(prompt_embeds=emb, negative_prompt_embeds=negative["prompt_emb"], width=SIZE, height=SIZE,
                      num_frames=render.FRAMES, num_inference_steps=2,  # the pipeline's default guidance
                      generator=torch.Generator().manual_seed(1), output_type="pil").frames[0]
        expected = Image.new("RGB", (SIZE * len(frames), SIZE))
        for i, frame in enumerate(frames):
            expected.paste(frame, (i * SIZE, 0))
    got = render.render(fam.pipelines[0], models, embeds, SIZE, SIZE, 2, torch.Generator().manual_seed(1),
                        negative=negative)
    assert got.size == expected.size and got.tobytes() == expected.tobytes()


@pytest.mark.slow
def test_report_to_tensorboard_logs_what_loss_csv_holds(qwen, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    models, data, _ = qwen
    out = tmp_path / "out"
    result = run(make_args(task="sft", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                           output_path=str(out), report_to="tensorboard", **common(models)), echo=quiet)
    events = list((out / "logs").rglob("events.out.tfevents.*"))
    assert events, list(out.rglob("*"))
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in logged] == list(range(1, result.steps + 1))
    assert [v for _, v in logged] == pytest.approx([r["loss"] for r in read_loss_csv(out / "loss.csv")], rel=1e-6)
    assert {"learning_rate", "step_time_s"} <= set(acc.Tags()["scalars"])
    code, _, err = cli(capsys, "train", "--report_to", "mlflow", "--lora_base_model", "dit", "--dataset_base_path",
                       str(data), "--output_path", str(tmp_path / "x"))
    one_error_line(code, err, "--report_to must be one of none, tensorboard, wandb")

"""Validation samples with guidance (issue 40): --validation_guidance, --validation_negative_prompt and --validation_seed.

A sample is what the family's own diffusers pipeline draws with the same arguments: a split run whose stage 2 has no
text encoder renders, from stage 1's encodings of the prompts and of their negative prompts, the image the pipeline
draws from the prompt texts with its own encoder. The LoRA is trained at a learning rate of 1e-30 (AdamW's first steps
move its zero B matrices by about that, far below float32's resolution of the DiT's activations), so the trained DiT
computes what the folder's does and the pipeline loaded from the folder is the reference. Bad flags are one line
(exit 2) before anything is written."""

from __future__ import annotations

import json
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

SIZE = 32
PROMPTS = ["a red circle", "a blue square"]


def quiet(_text: str) -> None:
    pass


def without_text_encoder(models: Path, into: Path) -> Path:
    """A copy of a pipeline folder with no text encoder and no tokenizer: a stage 2 that needed one would fail."""
    shutil.copytree(models, into)
    for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "processor"):
        shutil.rmtree(into / name, ignore_errors=True)
    return into


def flags(models: Path, **extra):
    return dict(model_paths=str(models), lora_base_model="dit", lora_rank=4, max_pixels=SIZE * SIZE, progress=False,
                plot=False, learning_rate=1e-30, mixed_precision="no", **extra)


def split_run(models: Path, data: Path, tmp: Path, **validation) -> Path:
    """Stage 1 with the full folder, stage 2 (one epoch) with the folder stripped of its text encoder; the output."""
    cache = tmp / "cache"
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(cache), **validation, **flags(models)), echo=quiet)
    bare = without_text_encoder(models, tmp / "bare")
    out = tmp / "out"
    run(make_args(task="sft:train", dataset_base_path=str(cache), output_path=str(out), num_epochs=1,
                  validation_inference_steps=2, **validation, **flags(bare)), echo=quiet)
    return out


def pixels(path: Path) -> bytes:
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("guidance")
    models = family("qwen_image").tiny_module().write_tiny_models(root / "models", size="test", seed=0)
    data = root / "data"
    write_synthetic_dataset(data, count=1, size=SIZE, seed=5)
    return models, data


def test_a_prompt_pipelines_sample_with_guidance_and_negative_prompts_is_its_pipelines_own(qwen, tmp_path):
    """Qwen-Image's true CFG against a negative prompt per prompt, a seed of its own: stage 2 renders, with no text
    encoder, what QwenImagePipeline draws from the texts."""
    models, data = qwen
    negatives = ["blurry", "a red circle"]  # the second is another prompt's text: encoded once, used twice
    out = split_run(models, data, tmp_path, validation_prompt=PROMPTS, validation_negative_prompt=negatives,
                    validation_guidance=3.0, validation_seed=7)
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)
    for k, (prompt, negative) in enumerate(zip(PROMPTS, negatives)):
        expected = pipe(prompt=prompt, negative_prompt=negative, true_cfg_scale=3.0, width=SIZE, height=SIZE,
                        num_inference_steps=2, generator=torch.Generator().manual_seed(7 * 1000 + k)).images[0]
        assert pixels(out / "samples" / "epoch-0" / f"{k}.png") == expected.tobytes()
    # guidance mattered: the same prompt without it is another image
    plain = pipe(prompt=PROMPTS[0], true_cfg_scale=1.0, width=SIZE, height=SIZE, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(7000)).images[0]
    assert plain.tobytes() != pixels(out / "samples" / "epoch-0" / "0.png")


def test_the_default_is_the_pipelines_own_guidance_against_the_empty_prompt(qwen, tmp_path):
    """No guidance flags: true_cfg_scale 4, QwenImagePipeline's default, against the empty prompt; --seed's samples."""
    models, data = qwen
    out = split_run(models, data, tmp_path, validation_prompt=PROMPTS[:1])
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(prompt=PROMPTS[0], negative_prompt="", width=SIZE, height=SIZE, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0)).images[0]
    assert pixels(out / "samples" / "epoch-0" / "0.png") == expected.tobytes()


def test_the_encoded_file_is_keyed_by_the_negative_prompts(qwen, tmp_path):
    """Another negative prompt is another validation.safetensors: stage 2 with a negative prompt stage 1 did not
    encode is one line before anything is written."""
    models, data = qwen
    cache = tmp_path / "cache"
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(cache), validation_prompt=PROMPTS, validation_negative_prompt=["blurry"],
                  **flags(models)), echo=quiet)
    meta = json.loads(__import__("safetensors").safe_open(str(cache / "validation.safetensors"), "pt").metadata()
                      ["unitgraph_validation"])
    assert meta["prompts"] == [*PROMPTS, "blurry"]
    bare = without_text_encoder(models, tmp_path / "bare")
    with pytest.raises(Exception) as raised:
        run(make_args(task="sft:train", dataset_base_path=str(cache), output_path=str(tmp_path / "out"),
                      validation_prompt=PROMPTS, validation_negative_prompt=["ugly"], **flags(bare)), echo=quiet)
    assert "validation.safetensors" in str(raised.value) and "run stage 1" in str(raised.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, fragments", [
    (["--validation_negative_prompt", "a", "--validation_negative_prompt", "b", "--validation_negative_prompt", "c"],
     ["--validation_negative_prompt is given 3 times for 2"]),
    (["--validation_guidance", "-1"], ["--validation_guidance must be a number of at least 0"]),
    (["--validation_guidance", "nan"], ["--validation_guidance must be a number of at least 0"]),
    (["--validation_seed", "-3"], ["--validation_seed must be between 0"]),
])
def test_bad_guidance_flags_are_one_line(qwen, tmp_path, capsys, extra, fragments):
    models, data = qwen
    code, _, err = cli(capsys, "train", "--model_paths", str(models), "--dataset_base_path", str(data),
                       "--lora_base_model", "dit", "--output_path", str(tmp_path / "out"),
                       "--validation_prompt", PROMPTS[0], "--validation_prompt", PROMPTS[1], *extra)
    one_error_line(code, err, *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("--validation_guidance", "2"), ("--validation_negative_prompt", "x"),
                                         ("--validation_seed", "3")])
def test_guidance_flags_without_a_validation_prompt_are_one_line(tmp_path, capsys, flag, value):
    code, _, err = cli(capsys, "train", "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit",
                       "--output_path", str(tmp_path / "out"), flag, value)
    one_error_line(code, err, flag, "give --validation_prompt too")
    assert not (tmp_path / "out").exists()


def test_a_negative_prompt_for_flux1s_embedded_guidance_is_one_line(tmp_path, capsys):
    """FLUX.1 guides with a scale embedded in its distilled DiT: a negative prompt would change nothing."""
    models = family("flux").tiny_module().write_tiny_models(tmp_path / "flux", size="test", seed=0)
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=1, size=SIZE, seed=5)
    code, _, err = cli(capsys, "train", "--model_paths", str(models), "--dataset_base_path", str(data),
                       "--lora_base_model", "dit", "--output_path", str(tmp_path / "out"),
                       "--validation_prompt", "a cat", "--validation_negative_prompt", "a dog")
    one_error_line(code, err, "--validation_negative_prompt", "pipeline flux", "no negative prompt")
    assert not (tmp_path / "out").exists()
    # its guidance scale is taken
    code, _, err = cli(capsys, "train", "--model_paths", str(models), "--dataset_base_path", str(data),
                       "--lora_base_model", "dit", "--output_path", str(tmp_path / "out"), "--dry_run",
                       "--validation_prompt", "a cat", "--validation_guidance", "2.5")
    assert code == 0, err


def test_guidance_for_a_pipeline_that_samples_without_any_is_one_line(qwen, tmp_path, capsys, monkeypatch):
    """A render module that declares no guidance (`guidance(pipeline)` is None) refuses the guidance flags."""
    from unitgraph.backends.diffusion.families.qwen_image import render

    monkeypatch.setattr(render, "guidance", lambda pipeline: None)
    models, data = qwen
    for flag in ("--validation_guidance", "--validation_negative_prompt"):
        code, _, err = cli(capsys, "train", "--model_paths", str(models), "--dataset_base_path", str(data),
                           "--lora_base_model", "dit", "--output_path", str(tmp_path / "out"),
                           "--validation_prompt", "a cat", flag, "2")
        one_error_line(code, err, flag, "samples without guidance")
        assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# edit pipelines: --validation_image, one per prompt


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """Test-size FLUX.2 klein models, an edit dataset, and two validation images (PNG and JPEG)."""
    root = tmp_path_factory.mktemp("klein")
    models = family("flux2").tiny_module().write_tiny_models(root / "models", size="test", seed=0)
    data = root / "data"
    write_synthetic_dataset(data, count=1, size=SIZE, seed=5, images=["edit_image"])
    images = [root / "a.png", root / "b.jpg"]
    Image.new("RGB", (96, 64), (200, 30, 30)).save(images[0])
    Image.linear_gradient("L").resize((64, 64)).convert("RGB").save(images[1])
    return models, data, images


def test_an_edit_pipelines_sample_edits_the_validation_image_as_its_pipeline_does(klein, tmp_path):
    """FLUX.2 klein edit: each prompt's sample edits its own image, with klein's guidance against a negative prompt,
    as Flux2KleinPipeline draws it from the texts and the images (stage 2 without a text encoder)."""
    models, data, images = klein
    out = split_run(models, data, tmp_path, validation_prompt=PROMPTS, validation_image=[str(p) for p in images],
                    validation_negative_prompt=["blurry"], validation_guidance=2.5, extra_inputs="edit_image")
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)
    negative = pipe.encode_prompt("blurry")[0]  # the pipeline takes no negative text, only its embedding
    samples = [pixels(out / "samples" / "epoch-0" / f"{k}.png") for k in range(2)]
    for k, (prompt, path) in enumerate(zip(PROMPTS, images)):
        with Image.open(path) as image:
            expected = pipe(prompt=prompt, image=image.convert("RGB"), negative_prompt_embeds=negative,
                            guidance_scale=2.5, width=SIZE, height=SIZE, num_inference_steps=2,
                            generator=torch.Generator().manual_seed(k)).images[0]
        assert samples[k] == expected.tobytes()
        with Image.open(path) as given, Image.open(out / "samples" / "inputs" / f"{k}.png") as shown:
            assert shown.convert("RGB").tobytes() == given.convert("RGB").tobytes()  # beside its samples on the page
    page = (out / "samples.html").read_text()
    assert page.count('src="samples/inputs/') == 2 and "<th>input</th><th>epoch-0</th>" in page
    # the image mattered: the prompt alone draws another sample
    alone = pipe(prompt=PROMPTS[0], negative_prompt_embeds=negative, guidance_scale=2.5, width=SIZE, height=SIZE,
                 num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert alone.tobytes() != samples[0]


@pytest.mark.parametrize("name, content, fragment", [
    ("missing.png", None, "--validation_image: no such file"),
    ("broken.png", b"\x89PNG\r\n\x1a\n not really", "--validation_image: not a readable image"),
    ("text.jpg", b"hello", "--validation_image: not a readable image"),
])
def test_a_missing_or_unreadable_validation_image_is_one_line(klein, tmp_path, capsys, name, content, fragment):
    models, data, images = klein
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    code, _, err = cli(capsys, "train", "--model_paths", str(models), "--dataset_base_path", str(data),
                       "--dataset_metadata_path", str(data / "metadata.csv"), "--extra_inputs", "edit_image",
                       "--lora_base_model", "dit", "--output_path", str(tmp_path / "out"),
                       "--validation_prompt", PROMPTS[0], "--validation_prompt", PROMPTS[1],
                       "--validation_image", str(images[0]), "--validation_image", str(path))
    line = one_error_line(code, err, fragment)
    assert str(path) in line
    assert not (tmp_path / "out").exists()


def test_a_validation_image_for_a_prompt_only_pipeline_or_of_the_wrong_count_is_one_line(klein, tmp_path, capsys):
    models, data, images = klein
    base = ["train", "--model_paths", str(models), "--dataset_base_path", str(data), "--lora_base_model", "dit",
            "--dataset_metadata_path", str(data / "metadata.csv"), "--output_path", str(tmp_path / "out"),
            "--validation_prompt", PROMPTS[0]]
    code, _, err = cli(capsys, *base, "--validation_image", str(images[0]))  # no edit_image handed over: klein t2i
    one_error_line(code, err, "--validation_image: pipeline flux2_klein renders from the prompt alone")
    code, _, err = cli(capsys, *base, "--extra_inputs", "edit_image", "--validation_image", str(images[0]),
                       "--validation_image", str(images[1]))
    one_error_line(code, err, "--validation_image is given 2 times for 1")
    small = tmp_path / "small.png"
    Image.new("RGB", (48, 80)).save(small)
    code, _, err = cli(capsys, *base, "--extra_inputs", "edit_image", "--validation_image", str(small))
    one_error_line(code, err, str(small), "is 48x80 px", "at least 64 px a side")
    assert not (tmp_path / "out").exists()


def test_a_kontext_sample_edits_its_image_as_flux_kontext_pipeline_does(tmp_path):
    """FLUX.1 Kontext with a validation image renders through FluxKontextPipeline (its reference image sized to one
    of Kontext's resolutions, the sample of the run's area), at its embedded guidance."""
    import importlib

    fam = family("flux")
    root = fam.tiny_module().write_tiny_models(tmp_path / "kontext", size="test", seed=0, pipeline="flux_kontext")
    pipe = diffusers.FluxKontextPipeline.from_pretrained(str(root))
    pipe.set_progress_bar_config(disable=True)
    render = importlib.import_module(fam.render, fam.package)
    emb, pooled, _ = pipe.encode_prompt("make it blue", prompt_2=None, max_sequence_length=512)
    image = Image.linear_gradient("L").resize((40, 24)).convert("RGB")
    models = {"dit": pipe.transformer, "vae_encoder": pipe.vae, "scheduler": pipe.scheduler}
    got = render.render(fam.pipeline("flux_kontext"), models, {"prompt_emb": emb, "pooled_prompt_emb": pooled}, SIZE,
                        SIZE, 2, torch.Generator().manual_seed(3), guidance=2.0, image=image)
    expected = pipe(image=image, prompt="make it blue", width=SIZE, height=SIZE, max_area=SIZE * SIZE,
                    num_inference_steps=2, guidance_scale=2.0, generator=torch.Generator().manual_seed(3)).images[0]
    assert got.size == (SIZE, SIZE) and got.tobytes() == expected.tobytes()
    alone = render.render(fam.pipeline("flux_kontext"), models, {"prompt_emb": emb, "pooled_prompt_emb": pooled},
                          SIZE, SIZE, 2, torch.Generator().manual_seed(3), guidance=2.0)
    assert alone.tobytes() != got.tobytes()  # the image mattered


@pytest.fixture(scope="module")
def wan_i2v(tmp_path_factory):
    """Test-size Wan 2.1 I2V models (a DiT taking CLIP image features), 9-frame clips, and two first frames."""
    root = tmp_path_factory.mktemp("wan-i2v")
    models = family("wan").tiny_module().write_tiny_models(root / "models", size="test", seed=0, pipeline="wan_i2v")
    data = root / "data"
    write_synthetic_dataset(data, count=1, size=SIZE, seed=5, videos=["video"], frames=9)
    images = [root / "first.png", root / "second.png"]
    Image.new("RGB", (48, 48), (200, 30, 30)).save(images[0])
    Image.linear_gradient("L").resize((40, 40)).convert("RGB").save(images[1])
    return models, data, images


def test_an_i2v_sample_starts_from_its_validation_image_as_its_pipeline_does(wan_i2v, tmp_path, capsys, monkeypatch):
    """Wan 2.1 I2V: each prompt's clip starts from its own --validation_image, guided against a negative prompt at
    another scale, as WanImageToVideoPipeline draws it from the texts and the image: stage 2 (no text encoder) loads
    the VAE and the CLIP image encoder only while rendering, and says so. Without an image the run is one line."""
    models, data, images = wan_i2v
    out = split_run(models, data, tmp_path, validation_prompt=PROMPTS, validation_image=[str(p) for p in images],
                    validation_negative_prompt=["blurry"], validation_guidance=3.0, num_frames=5)
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    from unitgraph.backends.diffusion.families.wan import render as wan_render

    # diffusers 0.42's I2V module calls ftfy without the guard its T2V module has (ftfy is not installed here): the
    # T2V module's prompt_clean is the same cleaning with the guard
    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)

    for k, (prompt, path) in enumerate(zip(PROMPTS, images)):
        with Image.open(path) as image:
            frames = pipe(image=image.convert("RGB"), prompt=prompt, negative_prompt="blurry", guidance_scale=3.0,
                          width=SIZE, height=SIZE, num_frames=wan_render.FRAMES, num_inference_steps=2,
                          generator=torch.Generator().manual_seed(k), output_type="pil").frames[0]
        strip = Image.new("RGB", (SIZE * len(frames), SIZE))
        for i, frame in enumerate(frames):
            strip.paste(frame, (i * SIZE, 0))
        assert pixels(out / "samples" / "epoch-0" / f"{k}.png") == strip.tobytes(), k
    code, _, err = cli(capsys, "train", "--model_paths", str(models), "--dataset_base_path", str(data),
                       "--dataset_metadata_path", str(data / "metadata.csv"), "--lora_base_model", "dit",
                       "--output_path", str(tmp_path / "refused"), "--validation_prompt", PROMPTS[0])
    one_error_line(code, err, "pipeline wan_i2v renders from an input image", "--validation_image")
    assert not (tmp_path / "refused").exists()


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory):
    """Test-size Qwen-Image-Edit models, an edit dataset, and two images to edit."""
    root = tmp_path_factory.mktemp("qwen-edit")
    models = family("qwen_image").tiny_module().write_tiny_models(root / "models", size="test", seed=0,
                                                                  pipeline="qwen_image_edit")
    data = root / "data"
    write_synthetic_dataset(data, count=1, size=SIZE, seed=5, images=["edit_image"])
    images = [root / "a.png", root / "b.png"]
    Image.new("RGB", (48, 40), (200, 30, 30)).save(images[0])
    Image.linear_gradient("L").resize((40, 56)).convert("RGB").save(images[1])
    return models, data, images


def test_an_edit_whose_prompt_encoder_reads_the_image_is_its_pipelines_own(qwen_edit, tmp_path, monkeypatch):
    """Qwen-Image-Edit's vision-language encoder reads the image with the prompt: stage 1 encodes the prompt and its
    negative prompt with the prompt's image, and stage 2 (no text encoder, no processor) renders what
    QwenImageEditPipeline draws from the texts and the image, with true CFG at another scale. Another image for the
    same prompt is another encoding: stage 2 given it is refused until stage 1 encodes it. (The pipeline shows its
    encoders the image at 1024x1024's area; both sides of the comparison are lowered to 64x64's, which the tiny VAE
    and VL encoder take in a fraction of the time.)"""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
    from test_conformance import load_diffusers_pipeline

    from unitgraph.backends.diffusion.families.qwen_image import units as qwen_units

    area = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                        lambda target, ratio: area(64 * 64 if target == 1024 * 1024 else target, ratio))
    monkeypatch.setattr(qwen_units, "VAE_IMAGE_AREA", 64 * 64)

    models, data, images = qwen_edit
    flags_ = dict(validation_prompt=PROMPTS[:1], validation_image=[str(images[1])],
                  validation_negative_prompt=["blurry"], validation_guidance=2.5, extra_inputs="edit_image")
    out = split_run(models, data, tmp_path, **flags_)
    qwen = family("qwen_image")
    pipe = load_diffusers_pipeline(qwen, qwen.pipeline("qwen_image_edit"), models)
    pipe.set_progress_bar_config(disable=True)
    with Image.open(images[1]) as image:
        expected = pipe(image=image.convert("RGB"), prompt=PROMPTS[0], negative_prompt="blurry", true_cfg_scale=2.5,
                        width=SIZE, height=SIZE, num_inference_steps=2,
                        generator=torch.Generator().manual_seed(0)).images[0]
    assert pixels(out / "samples" / "epoch-0" / "0.png") == expected.tobytes()
    with Image.open(images[0]) as image:  # the image mattered: another one draws another edit
        elsewhere = pipe(image=image.convert("RGB"), prompt=PROMPTS[0], negative_prompt="blurry", true_cfg_scale=2.5,
                         width=SIZE, height=SIZE, num_inference_steps=2,
                         generator=torch.Generator().manual_seed(0)).images[0]
    assert elsewhere.tobytes() != expected.tobytes()
    # the encodings are keyed by the image's content too: another image is refused by stage 2 in one line
    with pytest.raises(Exception, match="run stage 1"):
        run(make_args(task="sft:train", dataset_base_path=str(tmp_path / "cache"), output_path=str(tmp_path / "o2"),
                      num_epochs=1, validation_inference_steps=2, **{**flags_, "validation_image": [str(images[0])]},
                      **flags(tmp_path / "bare")), echo=quiet)
    assert not (tmp_path / "o2").exists()

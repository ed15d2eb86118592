"""The Qwen-Image-Edit pipelines (qwen_image_edit, qwen_image_edit_plus) against diffusers, their split, the processor.

The conformance suite (test_conformance.py) runs these pipelines end to end; this file checks what is
particular to them: every preprocessing step of the edit images and the VL prompt encoding equal what
diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline compute (bit for bit, on the same tiny
models), a LoRA on the text encoder keeps the edit images' VL preprocessing in stage 1, and the processor
is found where DiffSynth finds it (--processor_path, a pipeline folder, beside the text encoder).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

import unitgraph  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.args import make_args
from unitgraph.backends.diffusion.config import RunConfig  # noqa: E402
from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.families.qwen_image import units as U  # noqa: E402
from unitgraph.backends.diffusion.models.folders import ModelLoadError  # noqa: E402
from unitgraph.backends.diffusion.models.sources import ModelSources
from unitgraph.backends.diffusion.models.loading import ProcessorParts
from unitgraph.backends.diffusion.registry import family  # noqa: E402
from unitgraph.backends.diffusion.models.stage import stage_slots  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402

from test_conformance import load_diffusers_pipeline, write_dataset  # noqa: E402

QWEN = family("qwen_image")
EDIT, PLUS = QWEN.pipeline("qwen_image_edit"), QWEN.pipeline("qwen_image_edit_plus")
SIZE = 32


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """pipeline name -> its test-size tiny folder (QwenImageEditPipeline, QwenImageEditPlusPipeline)."""
    tiny = QWEN.tiny_module()
    return {p.name: tiny.write_tiny_models(tmp_path_factory.mktemp(p.name) / "models", size="test", seed=0, pipeline=p.name)
            for p in (EDIT, PLUS)}


def loaded(root: Path, **where) -> dict:
    return ModelSources(QWEN.slots, str(root), **where).load(["vae", "text_encoder", "tokenizer", "processor"])


def edit_source_images():
    """Edit images of other aspects than the target's (and of each other)."""
    from PIL import Image, ImageDraw

    first = Image.new("RGB", (40, 24), (200, 30, 30))
    ImageDraw.Draw(first).ellipse((4, 4, 20, 20), fill=(20, 40, 220))
    second = Image.new("RGB", (24, 48), (30, 160, 60))
    ImageDraw.Draw(second).rectangle((2, 10, 20, 30), fill=(240, 240, 20))
    return [first, second]


def run_units(pipeline, ctx, state: dict) -> dict:
    """Run the pipeline's deterministic units in order over `state` (no noise, no timesteps)."""
    state = dict(state)
    for unit in pipeline.units:
        if unit.declaration.deterministic and unit.name != "LatentPacker":
            state.update(unit(ctx, {p: state.get(p) for p in unit.inputs}))
    return state


# ------------------------------------------------------------------------------------------------
# against diffusers


def test_templates_and_sizes_are_diffusers():
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_module
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module

    assert plus_module.VAE_IMAGE_SIZE == U.VAE_IMAGE_AREA and plus_module.CONDITION_IMAGE_SIZE == U.CONDITION_IMAGE_AREA
    for area in (U.VAE_IMAGE_AREA, U.CONDITION_IMAGE_AREA, 64 * 64):
        for w, h in ((40, 24), (24, 48), (1000, 1000), (1920, 1080), (333, 777)):
            assert U.edit_dimensions(area, w, h) == plus_module.calculate_dimensions(area, w / h)
            assert U.edit_dimensions(area, w, h) == edit_module.calculate_dimensions(area, w / h)[:2]
    # the VAE sees edit images at 1024x1024 as diffusers does, or at the target size when smaller
    assert U.vae_edit_area(ImageSize()) == 1024 * 1024
    assert U.vae_edit_area(ImageSize(max_pixels=32 * 32)) == 32 * 32
    assert U.vae_edit_area(ImageSize(height=512, width=256)) == 512 * 256
    assert U.vae_edit_area(ImageSize(height=2048, width=2048)) == 1024 * 1024


@pytest.mark.parametrize("pipeline", [EDIT, PLUS], ids=["edit", "plus"])
def test_edit_encoding_matches_diffusers_bit_for_bit(pipeline, folders):
    """From the raw edit image(s) to what the DiT and the VL encoder read, ours equals diffusers' __call__ steps."""
    root = folders[pipeline.name]
    models = loaded(root)
    pipe = load_diffusers_pipeline(QWEN, pipeline, root)
    assert pipe.prompt_template_encode_start_idx == U.EDIT_TEMPLATE_DROP
    sources = edit_source_images() if pipeline is PLUS else edit_source_images()[:1]
    prompt = "turn the circle into a yellow square"
    # diffusers' steps at the VAE area our run uses: 1024x1024 at the default --max_pixels (see above), here
    # 64x64 (the tiny VAE at 1024x1024 takes seconds)
    ctx = UnitContext(models=models, settings=UnitSettings(image_size=ImageSize(max_pixels=64 * 64)))
    area = U.vae_edit_area(ctx.size)
    target = sources[0].resize((64, 32))
    state = run_units(pipeline, ctx, {"image": target, "prompt": prompt,
                                      "edit_image": sources if pipeline is PLUS else sources[0]})

    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    vae_sizes = [calculate_dimensions(area, im.size[0] / im.size[1]) for im in sources]
    if pipeline is PLUS:
        condition = [pipe.image_processor.resize(im, *reversed(calculate_dimensions(U.CONDITION_IMAGE_AREA, im.size[0] / im.size[1])))
                     for im in sources]
        vae_images = [pipe.image_processor.preprocess(im, h, w).unsqueeze(2) for im, (w, h) in zip(sources, vae_sizes)]
        prompt_image = condition
    else:
        (w, h), = vae_sizes
        condition = [pipe.image_processor.resize(sources[0], h, w)]
        vae_images = [pipe.image_processor.preprocess(condition[0], h, w).unsqueeze(2)]
        prompt_image = condition[0]
    # the VL encoder's images, and the VAE's
    assert [c.size for c in state["condition_images"]] == [c.size for c in condition]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(state["condition_images"], condition))
    assert len(state["edit_pixels"]) == len(vae_images)
    assert all(torch.equal(a, b) for a, b in zip(state["edit_pixels"], vae_images))
    # the prompt embedding with the image(s)
    emb, mask = pipe.encode_prompt(prompt, image=prompt_image, device="cpu")
    assert torch.equal(state["prompt_emb"], emb)
    assert mask is None or torch.equal(state["prompt_emb_mask"], mask)
    assert state["prompt_emb_mask"].all() and state["prompt_emb"].shape[1] > len(sources)
    # the edit tokens the DiT reads after the target's, and img_shapes (one entry per image)
    z = pipe.transformer.config.in_channels // 4
    noise = torch.zeros_like(state["latent_mean"])
    packed = U.latent_packer(ctx, {"input_latents": state["latent_mean"], "noise": noise,
                                   "edit_latents": state["edit_latents"]})
    height, width = state["height"], state["width"]
    latents, image_latents = pipe.prepare_latents(vae_images if pipeline is PLUS else vae_images[0], 1, z, height, width,
                                                  torch.float32, "cpu", None, latents=packed["noise"])
    assert torch.equal(packed["edit_latents"], image_latents)
    f = pipe.vae_scale_factor
    assert packed["img_shapes"] == [[(1, height // f // 2, width // f // 2),
                                     *[(1, vh // f // 2, vw // f // 2) for vw, vh in vae_sizes]]]


def test_an_edit_plus_validation_sample_is_the_pipelines_own(folders, monkeypatch):
    """Edit-Plus' validation sample: the prompt and the empty negative prompt encoded with the image as the pipeline
    shows its VL encoder (384x384's area: render.prompt_image_inputs), then render, draw what
    QwenImageEditPlusPipeline draws from the texts and the image at its default true CFG. (The pipeline's VAE area
    is lowered to 64x64 for both draws: it sizes the VAE's image itself in either, and the tiny VAE takes tens of
    seconds at 1024x1024.)"""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
    from PIL import Image

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)

    from unitgraph.backends.diffusion.families.qwen_image import render
    from unitgraph.backends.diffusion.train.validation import encode_prompts, prompt_units

    root = folders[PLUS.name]
    pipe = load_diffusers_pipeline(QWEN, PLUS, root)
    pipe.set_progress_bar_config(disable=True)
    ctx = UnitContext(models=loaded(root), settings=UnitSettings(image_size=ImageSize(SIZE, SIZE)))
    image = edit_source_images()[1]
    beside = [render.prompt_image_inputs(PLUS, image)] * 2
    prompt, negative = encode_prompts(ctx, PLUS, ["a yellow square", ""], prompt_units(PLUS, render.PROMPT_IMAGE_INPUTS),
                                      beside)
    models = {"dit": pipe.transformer, "vae": pipe.vae, "scheduler": pipe.scheduler}
    got = render.render(PLUS, models, prompt, SIZE, SIZE, 2, torch.Generator().manual_seed(1), negative=negative,
                        image=image)
    expected = pipe(image=[image], prompt="a yellow square", negative_prompt="", width=SIZE, height=SIZE,
                    num_inference_steps=2, generator=torch.Generator().manual_seed(1)).images[0]
    assert isinstance(got, Image.Image) and got.tobytes() == expected.tobytes()


def test_the_loss_reads_the_target_tokens_only(folders):
    """The DiT sees target + edit tokens; the loss compares the target tokens alone."""
    from unitgraph.backends.diffusion.families.qwen_image import losses

    root = folders[PLUS.name]
    models = loaded(root)
    models.update(ModelSources(QWEN.slots, str(root)).load(["dit", "scheduler"]))
    ctx = UnitContext(models=models, settings=UnitSettings(image_size=ImageSize(max_pixels=SIZE * SIZE)))
    state = run_units(PLUS, ctx, {"image": edit_source_images()[0].resize((32, 32)), "prompt": "a cat",
                                  "edit_image": edit_source_images()})
    packed = U.latent_packer(ctx, {"input_latents": state["latent_mean"], "noise": torch.randn_like(state["latent_mean"]),
                                   "edit_latents": state["edit_latents"]})
    assert packed["edit_latents"].shape[1] == sum(s[1] * s[2] for s in packed["img_shapes"][0][1:])
    sigma = torch.tensor([0.5])
    pred = losses.predict(ctx, packed["input_latents"], sigma, state["prompt_emb"], state["prompt_emb_mask"],
                          packed["edit_latents"], packed["img_shapes"])
    assert pred.shape == packed["input_latents"].shape
    other = losses.predict(ctx, packed["input_latents"], sigma, state["prompt_emb"], state["prompt_emb_mask"],
                           torch.zeros_like(packed["edit_latents"]), packed["img_shapes"])
    assert not torch.equal(pred, other)  # the edit tokens condition the prediction


def test_edit_image_counts():
    ctx = UnitContext(models={}, settings=UnitSettings(image_size=ImageSize(max_pixels=SIZE * SIZE)))
    one, two = edit_source_images()
    with pytest.raises(BackendError, match="qwen_image_edit takes one edit image per sample, got 2"):
        U.edit_image_resizer(ctx, {"edit_image": [one, two]})
    with pytest.raises(BackendError, match="no edit image"):
        U.condition_images_resizer(ctx, {"edit_image": None})
    # a single edit image (a plain column) is a list of one for the plus pipeline
    assert len(U.edit_images_resizer(ctx, {"edit_image": one})["edit_pixels"]) == 1
    assert len(U.condition_images_resizer(ctx, {"edit_image": [one, two]})["condition_images"]) == 2


# ------------------------------------------------------------------------------------------------
# the split


@pytest.mark.parametrize("pipeline", [EDIT, PLUS], ids=["edit", "plus"])
@pytest.mark.parametrize("cache_mode", ["latest", "versioned"])
def test_text_encoder_lora_keeps_the_vl_preprocessing_in_stage1(pipeline, cache_mode):
    spec = unitgraph.load_pipeline(f"diffusion:{pipeline.name}")
    plan = unitgraph.split(spec, lora_base_model="text_encoder", cache_mode=cache_mode)
    assert plan.train_units == ["EditPromptEncoder", "NoiseInitializer", "LatentPacker", "TimestepSampler"]
    assert plan.data_process_units == ["ShapeChecker", "ImageEncoder", "EditImageResizer", "EditImageEncoder",
                                       "ConditionImageResizer", "PosteriorMean"]
    assert plan.train_models == ["dit", "text_encoder"] and plan.data_process_models == ["vae"]
    assert ("condition_images", "ConditionImageResizer") in plan.cache_entries
    assert ("edit_latents", "EditImageEncoder") in plan.cache_entries
    assert unitgraph.verify(spec, plan) == []
    # the stage that runs the text encoder loads its processor too; no stage loads the VAE twice
    cfg = RunConfig.from_args(make_args(pipeline=pipeline.name, lora_base_model="text_encoder"))
    assert "processor" in stage_slots(cfg, plan.train_models, training=True)
    assert "processor" not in stage_slots(cfg, plan.data_process_models, training=False)
    dit = unitgraph.split(spec, lora_base_model="dit", cache_mode=cache_mode)
    assert dit.train_units == ["NoiseInitializer", "LatentPacker", "TimestepSampler"]
    assert "processor" in stage_slots(cfg, dit.data_process_models, training=False)


def test_the_text_to_image_pipelines_load_no_processor():
    for name in ("qwen_image", "qwen_image_distill"):
        cfg = RunConfig.from_args(make_args(pipeline=name, lora_base_model="dit",
                                            task="direct_distill" if name.endswith("distill") else "sft"))
        assert "processor" not in stage_slots(cfg, cfg.pipeline.spec_pipeline.models, training=True)


# ------------------------------------------------------------------------------------------------
# where the processor comes from


def test_processor_is_found_and_hashed(folders, tmp_path):
    root = folders[EDIT.name]
    found = ModelSources(QWEN.slots, str(root)).resolve("processor")  # the pipeline folder's processor/
    assert found.path == root / "processor" and found.class_name == "Qwen2VLProcessor"
    files = {p.name for p in ModelSources(QWEN.slots, str(root)).files("processor")}
    assert {"preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    # component folders: the processor beside the text encoder, or given itself (classified, not a tokenizer)
    parts = [str(root / sub) for sub in ("transformer", "vae", "text_encoder")]
    assert ModelSources(QWEN.slots, json.dumps(parts)).resolve("processor").path == root / "processor"
    alone = tmp_path / "components"
    for sub in ("transformer", "vae", "text_encoder"):
        shutil.copytree(root / sub, alone / sub)
    with pytest.raises(ModelLoadError, match="pass --processor_path"):
        ModelSources(QWEN.slots, json.dumps([str(alone / s) for s in ("transformer", "vae", "text_encoder")])).resolve("processor")
    given = ModelSources(QWEN.slots, json.dumps([str(alone / "text_encoder"), str(root / "processor")]))
    assert given.resolve("processor").path == root / "processor"
    assert [e.kind for e in given.entries] == ["text_encoder", "processor"]  # not a tokenizer folder
    with pytest.raises(ModelLoadError, match="not a processor folder"):
        ModelSources(QWEN.slots, str(root), processor_path=str(root / "tokenizer")).resolve("processor")
    processor = ModelSources(QWEN.slots, str(root)).load(["processor"])["processor"]
    # transformers builds Qwen2VLProcessor only with torchvision; without it the loader gives its parts
    assert hasattr(processor, "image_processor") and hasattr(processor, "tokenizer")
    assert isinstance(processor, ProcessorParts) or type(processor).__name__ == "Qwen2VLProcessor"


def test_processor_path_trains(folders, tmp_path):
    """--processor_path pointing at a processor folder, with component folders that have none beside them."""
    root = folders[PLUS.name]
    components = tmp_path / "components"
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        shutil.copytree(root / sub, components / sub)
    processor = tmp_path / "elsewhere" / "qwen-edit-processor"
    shutil.copytree(root / "processor", processor)
    data = tmp_path / "data"
    metadata = write_dataset(PLUS, data, count=2, seed=2)
    common = dict(pipeline=PLUS.name, dataset_base_path=str(data), dataset_metadata_path=str(metadata),
                  extra_inputs="edit_image", model_paths=json.dumps([str(components / s) for s in ("transformer", "vae", "text_encoder")]),
                  lora_base_model="text_encoder", lora_rank=4, max_pixels=SIZE * SIZE, progress=False, plot=False)
    with pytest.raises(BackendError, match="pass --processor_path"):  # stage 1 runs the text encoder for a DiT LoRA
        run(make_args(task="sft:data_process", output_path=str(tmp_path / "none"), **dict(common, lora_base_model="dit")),
            echo=quiet)
    result = run(make_args(task="sft:split", output_path=str(tmp_path / "out"), processor_path=str(processor), **common),
                 echo=quiet)
    assert result.steps == 2 and "EditPromptEncoder" in result.plan.train_units
    manifest = json.loads((tmp_path / "out" / "cache" / "manifest.json").read_text())
    assert manifest["made_with"]["processor_path"] == str(processor)
    # the processor's files are part of what stage 1's entries depend on: another processor, other entries
    changed = tmp_path / "changed-processor"
    shutil.copytree(processor, changed)
    config = json.loads((changed / "preprocessor_config.json").read_text())
    config["image_mean"] = [0.5, 0.5, 0.5]
    (changed / "preprocessor_config.json").write_text(json.dumps(config))
    dit = dict(common, lora_base_model="dit")
    first = run(make_args(task="sft:data_process", output_path=str(tmp_path / "c1"), processor_path=str(processor), **dit),
                echo=quiet)
    again = run(make_args(task="sft:data_process", output_path=str(tmp_path / "c1"), processor_path=str(changed), **dit),
                echo=quiet)
    assert first.entries_computed == 2 and again.entries_computed == 2


def test_processor_from_model_ids_as_diffsynth(folders, tmp_path):
    """DiffSynth's Qwen-Image-Edit command gives model ids only; the processor is Qwen/Qwen-Image-Edit's processor/."""
    root = folders[EDIT.name]
    cache = tmp_path / "mscache" / "models"
    shutil.copytree(root, cache / "Qwen--Qwen-Image-Edit" / "snapshots" / "master")
    base = cache / "Qwen--Qwen-Image" / "snapshots" / "master"
    shutil.copytree(root, base, ignore=shutil.ignore_patterns("processor"))
    spec = ("Qwen/Qwen-Image-Edit:transformer/diffusion_pytorch_model*.safetensors,"
            "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors")
    sources = ModelSources(QWEN.slots, model_id_with_origin_paths=spec, cache_dir=tmp_path / "mscache", offline=True)
    assert sources.resolve("processor").path == cache / "Qwen--Qwen-Image-Edit" / "snapshots" / "master" / "processor"
    assert sources.resolve("tokenizer").path == base / "tokenizer"

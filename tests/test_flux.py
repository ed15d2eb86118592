"""The FLUX.1 family beyond the conformance suite: its units compute what diffusers' FluxPipeline and
FluxKontextPipeline compute, DiffSynth's FLUX LoRA command ports, and the split of a T5 LoRA stays sound.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families import flux  # noqa: E402
from unitgraph.backends.diffusion.families.flux import losses, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.models.sources import ModelSources  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402

SIZE = 32
DIFFSYNTH_TARGETS = ",".join(flux.DIFFSYNTH_DIT_TARGETS)


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("flux") / "models", size="test", seed=0)


@pytest.fixture(scope="module")
def pipe(models):
    return diffusers.FluxPipeline.from_pretrained(str(models))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("flux-data")
    write_synthetic_dataset(folder, count=2, size=SIZE, seed=1, images=["kontext_images"])
    return folder


def context(pipe, **settings) -> UnitContext:
    loaded = {"dit": pipe.transformer, "vae_encoder": pipe.vae, "text_encoder_1": pipe.text_encoder,
              "text_encoder_2": pipe.text_encoder_2, "tokenizer_1": pipe.tokenizer, "tokenizer_2": pipe.tokenizer_2,
              "scheduler": pipe.scheduler}
    return UnitContext(models=loaded, settings=UnitSettings(**settings))


def test_tokenizers_are_built_offline_and_reload_the_same(tmp_path):
    clip, t5 = tiny.build_clip_tokenizer(), tiny.build_t5_tokenizer()
    prompt = "a red circle on a blue background"
    assert "red</w>" in clip.tokenize(prompt) and "\u2581circle" in t5.tokenize(prompt)
    assert clip.model_max_length == u.CLIP_MAX_LENGTH
    from transformers import AutoTokenizer

    for name, tok in (("clip", clip), ("t5", t5)):
        tok.save_pretrained(str(tmp_path / name))
        again = AutoTokenizer.from_pretrained(str(tmp_path / name), local_files_only=True)
        assert again(prompt).input_ids == tok(prompt).input_ids


def test_prompt_units_match_the_pipelines_encode_prompt(pipe):
    ctx = context(pipe)
    prompt = "a green square on a white background"
    embeds, pooled, text_ids = pipe.encode_prompt(prompt, prompt_2=None, max_sequence_length=u.T5_SEQUENCE_LENGTH)
    ours_t5 = u.t5_prompt_encoder(ctx, {"prompt": prompt})["prompt_emb"]
    ours_clip = u.clip_prompt_encoder(ctx, {"prompt": prompt})["pooled_prompt_emb"]
    assert torch.equal(ours_t5, embeds) and torch.equal(ours_clip, pooled)
    assert ours_t5.shape == (1, 512, 32) and text_ids.abs().sum() == 0


def test_packing_ids_and_vae_latents_match_the_pipelines(pipe):
    latents = torch.randn(1, 16, 4, 6)
    assert torch.equal(u.pack(latents), pipe._pack_latents(latents, 1, 16, 4, 6))
    assert torch.equal(losses.grid_ids([2, 3], 0.0, latents), pipe._prepare_latent_image_ids(1, 2, 3, "cpu", torch.float32))
    kontext = diffusers.FluxKontextPipeline(**pipe.components)
    pixels = torch.rand(1, 3, SIZE, SIZE) * 2 - 1
    ctx = context(pipe)
    ours = u.kontext_image_encoder(ctx, {"kontext_pixels": [pixels]})
    expected = kontext._pack_latents(kontext._encode_vae_image(pixels, generator=None), 1, 16, 4, 4)
    assert torch.allclose(ours["kontext_latents"], expected, atol=1e-6) and ours["kontext_grids"] == [[[2, 2]]]
    # the cached posterior is in the DiT's latent space: its mean is the pipeline's argmax latents
    mean, _ = u.encode_distribution(ctx, pixels)
    assert torch.allclose(mean, kontext._encode_vae_image(pixels, generator=None), atol=1e-6)


def test_the_losss_transformer_call_is_a_pipeline_denoising_step(pipe):
    """One Euler step of FluxPipeline from sigma 1 to 0 is noise - v: our predict() gives that v."""
    ctx = context(pipe)
    prompt = "a dog"
    embeds, pooled, _ = pipe.encode_prompt(prompt, prompt_2=None, max_sequence_length=u.T5_SEQUENCE_LENGTH)
    noise = u.pack(torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0)))
    guidance = u.guidance_embedder(ctx, {"embedded_guidance": 3.5})["guidance"]
    with torch.no_grad():
        v = losses.predict(ctx, noise, torch.ones(1), embeds, pooled, guidance, [[2, 2]])
        out = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=noise.clone(), height=SIZE, width=SIZE,
                   num_inference_steps=1, guidance_scale=3.5, output_type="latent").images
    assert torch.allclose(out, noise - v, atol=1e-5)
    # the guidance is an input the DiT reads: another value predicts another velocity
    with torch.no_grad():
        other = losses.predict(ctx, noise, torch.ones(1), embeds, pooled, guidance * 2, [[2, 2]])
    assert not torch.allclose(other, v)


def test_the_kontext_loss_reads_the_reference_tokens_after_the_targets(pipe):
    """FluxKontextPipeline's denoising step with a reference image already at the target size."""
    from PIL import Image

    kontext = diffusers.FluxKontextPipeline(**pipe.components)
    ctx = context(pipe, image_size=ImageSize(SIZE, SIZE))
    image = Image.new("RGB", (SIZE, SIZE), (200, 40, 40))
    ref = u.kontext_image_encoder(ctx, u.kontext_shape_checker(ctx, {"kontext_images": image}))
    embeds, pooled, _ = pipe.encode_prompt("a cat", prompt_2=None, max_sequence_length=u.T5_SEQUENCE_LENGTH)
    noise = u.pack(torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1)))
    guidance = torch.tensor([2.5])
    with torch.no_grad():
        v = losses.predict(ctx, noise, torch.ones(1), embeds, pooled, guidance, [[2, 2]],
                           ref["kontext_latents"], ref["kontext_grids"])
        plain = losses.predict(ctx, noise, torch.ones(1), embeds, pooled, guidance, [[2, 2]])
        out = kontext(image=image, prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=noise.clone(),
                      height=SIZE, width=SIZE, max_area=SIZE * SIZE, _auto_resize=False, num_inference_steps=1,
                      guidance_scale=2.5, output_type="latent").images
    assert torch.allclose(out, noise - v, atol=1e-5) and not torch.allclose(v, plain)


def test_diffsynth_names_map_to_diffusers_modules():
    dit = flux.FAMILY.slot("dit")
    assert dit.lora_modules(("a_to_qkv", "b_to_out", "ff_b.0", "norm.linear")) == (
        "to_q", "to_k", "to_v", "to_add_out", "ff_context.net.0.proj", "norm.linear")
    assert dit.lora_targets == dit.lora_modules(flux.DIFFSYNTH_DIT_TARGETS)
    from diffusers import FluxTransformer2DModel

    names = {n for n, _ in FluxTransformer2DModel(**tiny.SIZES["test"]["transformer"]).named_modules()}
    for target in dit.lora_targets:  # every default target names modules of the real class
        assert any(n == target or n.endswith("." + target) for n in names), target


def test_diffsynth_flux_lora_command_ports(models, data, tmp_path, capsys):
    """examples/flux/model_training/lora/FLUX.1-dev.sh with the program name swapped (component folders
    instead of the model ids, tiny sizes): both stages run and every DiffSynth target got a LoRA."""
    components = [str(models / sub) for sub in ("transformer", "text_encoder", "text_encoder_2", "vae")]
    argv = ["train", "--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv"),
            "--max_pixels", str(SIZE * SIZE), "--dataset_repeat", "1", "--model_paths", json.dumps(components),
            "--tokenizer_1_path", str(models / "tokenizer"), "--tokenizer_2_path", str(models / "tokenizer_2"),
            "--learning_rate", "1e-4", "--num_epochs", "1", "--remove_prefix_in_ckpt", "pipe.dit.",
            "--output_path", str(tmp_path / "out"), "--lora_base_model", "dit", "--lora_target_modules", DIFFSYNTH_TARGETS,
            "--lora_rank", "4", "--align_to_opensource_format", "--use_gradient_checkpointing", "--task", "sft:split",
            "--no-progress", "--no-plot"]
    code, out, err = cli(capsys, *argv)
    assert code == 0, err
    assert "align_to_opensource_format" in out + err  # said, not silently ignored
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["pipeline"] == "flux" and plan["train"]["models"] == ["dit"]  # the family came from the DiT folder's class
    # --align_to_opensource_format wrote ComfyUI's layout; read back in diffusers' names
    from unitgraph.backends.diffusion.models.lora import read_lora_file

    assert all(k.startswith("diffusion_model.") for k in load_file(str(tmp_path / "out" / "epoch-0.safetensors")))
    modules = set(read_lora_file(tmp_path / "out" / "epoch-0.safetensors", "dit", flux.FAMILY.lora_prefixes()).modules)
    for part in ("attn.to_q", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff_context.net.2",
                 "norm1.linear", "norm1_context.linear", "single_transformer_blocks.0.norm.linear",
                 "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out"):
        assert any(m.endswith(part) for m in modules), part


def test_a_t5_lora_keeps_clip_and_the_vae_in_stage_1(models, data, tmp_path, capsys):
    """--lora_base_model text_encoder_2: stage 2 loads T5 (and the DiT), never CLIP or the VAE; plan says so."""
    code, _, err = cli(capsys, "plan", "diffusion:flux", "--lora_base_model", "text_encoder_2", "-o", str(tmp_path / "plan.json"))
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert set(plan["train"]["models"]) == {"dit", "text_encoder_2"}
    assert set(plan["data_process"]["models"]) == {"vae_encoder", "text_encoder_1"}
    assert "T5PromptEncoder" in plan["train"]["units"] and "ClipPromptEncoder" in plan["data_process"]["units"]
    code, shown, _ = cli(capsys, "inspect", "diffusion:flux", "--lora_base_model", "text_encoder_2")
    assert code == 0 and re.search(r"stage 1 \(data_process\):\s+text_encoder_1, vae_encoder\n", shown)
    assert re.search(r"stage 2 \(train\):\s+dit, text_encoder_2\n", shown), shown
    # stage 2 runs with CLIP's and the VAE's folders gone
    import shutil

    copy = tmp_path / "models"
    shutil.copytree(models, copy)
    common = dict(pipeline="flux", model_paths=str(copy), lora_base_model="text_encoder_2", lora_rank=4,
                  max_pixels=SIZE * SIZE, progress=False, plot=False)
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(tmp_path / "cache"), **common), echo=quiet)
    shutil.rmtree(copy / "vae")
    shutil.rmtree(copy / "text_encoder")
    result = run(make_args(task="sft:train", dataset_base_path=str(tmp_path / "cache"), output_path=str(tmp_path / "train"),
                           **common), echo=quiet)
    assert result.steps == 2 and set(result.plan.train_models) == {"dit", "text_encoder_2"}
    keys = load_file(str(tmp_path / "train" / "epoch-0.safetensors"))
    assert keys and all(k.startswith("text_encoder_2.") for k in keys)


def test_tokenizer_flags_find_each_tokenizer(models, tmp_path, capsys):
    sources = ModelSources(flux.SLOTS, [str(models / "transformer"), str(models / "text_encoder"),
                                        str(models / "text_encoder_2")],
                           tokenizer_path=str(models / "tokenizer"), tokenizer_2_path=str(models / "tokenizer_2"))
    assert sources.resolve("tokenizer_1").path == models / "tokenizer"
    assert sources.resolve("tokenizer_2").path == models / "tokenizer_2"
    # beside each text encoder's folder, without flags
    beside = ModelSources(flux.SLOTS, [str(models / "text_encoder"), str(models / "text_encoder_2")])
    assert beside.resolve("tokenizer_1").path == models / "tokenizer"
    assert beside.resolve("tokenizer_2").path == models / "tokenizer_2"
    code, _, err = cli(capsys, "train", "--pipeline", "flux", "--tokenizer_path", "a", "--tokenizer_1_path", "b",
                       "--lora_base_model", "dit", "--dataset_base_path", str(tmp_path), "--output_path", str(tmp_path / "o"))
    one_error_line(code, err, "--tokenizer_1_path")


@pytest.fixture()
def ms_cache(models, tmp_path, monkeypatch) -> Path:
    """An offline modelscope cache holding black-forest-labs/FLUX.1-dev in the diffusers layout, plus a
    release single-file checkpoint at its top (as the real repository has)."""
    pytest.importorskip("modelscope")
    monkeypatch.setenv("UNITGRAPH_OFFLINE", "1")
    import shutil

    cache = tmp_path / "mscache"
    snapshot = cache / "models" / "black-forest-labs--FLUX.1-dev" / "snapshots" / "master"
    shutil.copytree(models, snapshot)
    shutil.copy(models / "transformer" / "diffusion_pytorch_model.safetensors", snapshot / "flux1-dev.safetensors")
    return cache


def test_model_ids_resolve_through_the_modelscope_cache(ms_cache):
    origin = flux.FLUX_MODEL
    spec = ",".join(f"{origin}:{sub}" for sub in ("transformer/*.safetensors", "text_encoder/model.safetensors",
                                                  "text_encoder_2/*.safetensors", "vae/*.safetensors"))
    snapshot = ms_cache / "models" / "black-forest-labs--FLUX.1-dev" / "snapshots" / "master"
    sources = ModelSources(flux.SLOTS, model_id_with_origin_paths=spec, cache_dir=ms_cache, offline=True)
    found = sources.resolve_many(["dit", "text_encoder_1", "text_encoder_2", "vae_encoder", "tokenizer_1", "tokenizer_2"])
    assert {slot: source.path for slot, source in found.items()} == {
        "dit": snapshot / "transformer", "text_encoder_1": snapshot / "text_encoder",
        "text_encoder_2": snapshot / "text_encoder_2", "vae_encoder": snapshot / "vae",
        "tokenizer_1": snapshot / "tokenizer", "tokenizer_2": snapshot / "tokenizer_2"}  # DiffSynth's default origins
    loaded = sources.load(["text_encoder_2", "tokenizer_2"])
    assert type(loaded["text_encoder_2"]).__name__ == "T5EncoderModel"


def test_a_release_single_file_checkpoint_is_one_clear_line(ms_cache, data, tmp_path, capsys):
    """DiffSynth's FLUX commands name flux1-dev.safetensors (the release layout): refused in one line that
    says which model id pattern to give instead, before anything is written."""
    code, _, err = cli(capsys, "train", "--pipeline", "flux", "--task", "sft:data_process",
                       "--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv"),
                       "--model_id_with_origin_paths", f"{flux.FLUX_MODEL}:flux1-dev.safetensors",
                       "--modelscope_cache_dir", str(ms_cache), "--lora_base_model", "dit",
                       "--output_path", str(tmp_path / "out"), "--no-progress")
    one_error_line(code, err, "flux1-dev.safetensors", "single-file checkpoint", "FLUX.1-dev:transformer/*.safetensors")
    assert not (tmp_path / "out").exists()


def test_a_clip_lora_loads_with_the_pipelines_load_lora_weights(models, data, tmp_path):
    """A LoRA on text_encoder_1 is written under `text_encoder.`: FluxPipeline.load_lora_weights puts it on
    CLIP exactly (T5 has no diffusers loader: FluxPipeline loads LoRA into transformer and text_encoder)."""
    from peft.utils import get_peft_model_state_dict

    result = run(make_args(task="sft:split", pipeline="flux", dataset_base_path=str(data),
                           dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(models),
                           lora_base_model="text_encoder_1", lora_rank=4, learning_rate=1e-2, max_pixels=SIZE * SIZE,
                           output_path=str(tmp_path / "out"), progress=False, plot=False), echo=quiet)
    saved = load_file(str(result.last_checkpoint))
    assert saved and all(k.startswith("text_encoder.") for k in saved)
    pipe = diffusers.FluxPipeline.from_pretrained(str(models))
    prompt = "a red circle"
    before = pipe.encode_prompt(prompt, prompt_2=None, max_sequence_length=u.T5_SEQUENCE_LENGTH)[1]
    pipe.load_lora_weights(str(result.last_checkpoint))
    adapter = next(iter(pipe.text_encoder.peft_config))
    loaded = get_peft_model_state_dict(pipe.text_encoder, adapter_name=adapter)
    assert len(loaded) == len(saved)
    for name, value in loaded.items():
        assert torch.equal(value, saved[f"text_encoder.{name}"]), name
    after = pipe.encode_prompt(prompt, prompt_2=None, max_sequence_length=u.T5_SEQUENCE_LENGTH)[1]
    assert not torch.allclose(before, after)  # the trained LoRA changes CLIP's pooled embedding


def test_embedded_guidance_is_a_typed_metadata_column(data, tmp_path):
    """csv carries strings: the flux pipeline reads embedded_guidance as a float, and says which row is bad."""
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.data.dataset import DiffusionDataset

    pipeline = flux.FLUX
    rows = (data / "metadata.csv").read_text().splitlines()
    (tmp_path / "m.csv").write_text("\n".join([rows[0] + ",embedded_guidance", rows[1] + ",3.5", rows[2] + ",lots"]))
    ds = DiffusionDataset(data, tmp_path / "m.csv", ["image", "prompt", "embedded_guidance"],
                          optional=pipeline.optional, image_params=pipeline.image_params, param_types=pipeline.param_types)
    assert ds.sample(0)["embedded_guidance"] == 3.5
    with pytest.raises(BackendError, match="row 2: column 'embedded_guidance' must be a finite float"):
        ds.sample(1)
    ctx = UnitContext(models={})
    assert u.guidance_embedder(ctx, {"embedded_guidance": None})["guidance"].tolist() == [u.DEFAULT_GUIDANCE]

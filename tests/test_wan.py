"""The Wan family beyond the conformance suite: video clips as DiffSynth reads them, units that compute what
diffusers' WanPipeline / WanImageToVideoPipeline compute, and a stage 1 that reads the DiT's config but never
its weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("av")

from hypothesis import given, strategies as st  # noqa: E402
from PIL import Image  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.args import make_args
from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import DiffusionDataset, SampleError, write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families import wan  # noqa: E402
from unitgraph.backends.diffusion.families.wan import losses, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.data.video import frames_for, read_clip, write_clip  # noqa: E402

SIZE = 32


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan")
    return {name: tiny.write_tiny_models(root / name, size="test", seed=0, pipeline=name) for name in ("wan", "wan_i2v")}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wan-data")
    write_synthetic_dataset(folder, count=2, size=SIZE, seed=2, videos=["video"], frames=9)
    return folder


def context(pipe, **settings) -> UnitContext:
    names = {"transformer": "dit", "vae": "vae", "text_encoder": "text_encoder", "tokenizer": "tokenizer",
             "image_encoder": "image_encoder", "image_processor": "image_processor"}
    loaded = {slot: getattr(pipe, attr) for attr, slot in names.items() if getattr(pipe, attr, None) is not None}
    return UnitContext(models=loaded, settings=UnitSettings(**settings))


@given(available=st.integers(1, 400), wanted=st.sampled_from([1, 5, 9, 17, 33, 81]))
def test_clip_length_is_the_largest_4k_plus_1_the_file_holds(available, wanted):
    n = frames_for(available, wanted)
    assert n == wanted if available >= wanted else (n - 1) % 4 == 0 and n <= available < n + 4


def test_clips_are_the_files_first_frames(tmp_path):
    frames = [Image.new("RGB", (32, 32), (30 * i, 255 - 30 * i, 0)) for i in range(7)]
    write_clip(tmp_path / "c.mp4", frames)
    clip = read_clip(tmp_path / "c.mp4", 5)
    assert len(clip) == 5 and all(f.size == (32, 32) for f in clip)
    for got, want in zip(clip, frames):  # lossy codec, same order
        assert abs(got.getpixel((16, 16))[0] - want.getpixel((16, 16))[0]) < 12
    assert len(read_clip(tmp_path / "c.mp4", 81)) == 5  # 7 frames hold 5 = 4k+1
    frames[0].save(tmp_path / "still.png")
    assert len(read_clip(tmp_path / "still.png", 81)) == 1  # a still image is a one-frame clip


def test_bad_clips_are_one_line_sample_errors(data, tmp_path):
    folder = tmp_path / "d"
    shutil.copytree(data, folder)
    (folder / "images" / "000_video.mp4").write_bytes(b"\x00not a video" * 20)
    write_clip(folder / "images" / "001_video.mp4", [Image.new("RGB", (8, 8))] * 3)
    ds = DiffusionDataset(folder, folder / "metadata.csv", ["video", "prompt"], required=("video", "prompt"),
                          image_params=(), video_params=("video",), num_frames=5)
    with pytest.raises(SampleError, match=r"row 1: '000_video.mp4' \(column 'video'\) is not a readable video"):
        ds.check(0)
    with pytest.raises(SampleError, match="row 2: video '001_video.mp4' .* is 8x8 px, smaller than 16 px"):
        ds.check(1)
    with pytest.raises(SampleError, match="row 1: video '000_video.mp4'"):
        ds.sample(0)
    # the clip length is part of what stage 1 reads: it is in the sample's key inputs
    other = DiffusionDataset(data, data / "metadata.csv", ["video"], required=("video", "prompt"), image_params=(),
                             video_params=("video",), num_frames=9)
    assert other.key_inputs(0, ["video"])["video"]["num_frames"] == 9
    assert len(other.sample(0)["video"]) == 9


def test_num_frames_must_be_4k_plus_1():
    with pytest.raises(BackendError, match="--num_frames must be 4k\\+1"):
        make_args(pipeline="wan", num_frames=8, lora_base_model="dit").validate()


def test_training_schedule_and_boundaries_are_diffsynths():
    """Shift 5 over 1000 positions; --max_timestep_boundary 0.358 keeps Wan 2.2's high-noise sigmas (>= 0.9)."""
    sigmas = u.TRAINING_SCHEDULE.sigmas()
    assert float(sigmas[0]) == 1.0 and abs(float(sigmas[358]) - 0.9) < 2e-3
    ctx = UnitContext(models={}, settings=UnitSettings(timestep_bounds=(0.0, 0.358)), epoch=0, sample_key="s")
    draws = []
    for i in range(50):
        ctx.sample_key = f"s{i}"
        draws.append(float(u.timestep_sampler(ctx, {})["timestep"]))
    assert min(draws) >= 900.0 - 2 and max(draws) <= 1000.0


def test_prompt_and_latents_match_the_pipelines(models):
    pipe = diffusers.WanPipeline.from_pretrained(str(models["wan"]))
    ctx = context(pipe)
    prompt = "a  red circle &amp; a blue square"
    expected = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    assert torch.equal(u.prompt_encoder(ctx, {"prompt": prompt})["prompt_emb"], expected)
    video = torch.rand(1, 3, 5, SIZE, SIZE) * 2 - 1
    mean, _ = u.encode_distribution(ctx, video)
    z = pipe.vae.encode(video).latent_dist.mean
    stats = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1), torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    assert torch.allclose(mean, (z - stats[0]) / stats[1]) and mean.shape == (1, 4, 2, 4, 4)


def test_the_loss_is_a_pipeline_denoising_step(models):
    """Our predict() is the velocity WanPipeline's transformer call gives (same inputs, same call)."""
    pipe = diffusers.WanPipeline.from_pretrained(str(models["wan"]))
    ctx = context(pipe)
    prompt_emb = pipe.encode_prompt("a dog", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700.0])
    seen = {}

    def capture(module, args, kwargs, output):
        seen["out"] = output[0]

    handle = pipe.transformer.register_forward_hook(capture, with_kwargs=True)
    scheduler = pipe.scheduler
    scheduler.set_timesteps(1)
    with torch.no_grad():
        pipe(prompt_embeds=prompt_emb, latents=latents.clone(), height=SIZE, width=SIZE, num_frames=5,
             num_inference_steps=1, guidance_scale=1.0, output_type="latent")
        first_t = pipe.scheduler.timesteps[0].reshape(1).float()
        ours = losses.predict(ctx, latents, first_t, prompt_emb)
    handle.remove()
    assert torch.allclose(seen["out"], ours, atol=1e-6)
    with torch.no_grad():
        assert not torch.allclose(losses.predict(ctx, latents, t, prompt_emb), ours)


def test_i2v_conditioning_matches_the_pipeline(models):
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(str(models["wan_i2v"]))
    ctx = context(pipe, image_size=ImageSize(SIZE, SIZE))
    frames = [Image.new("RGB", (SIZE, SIZE), (200, 30 * i, 40)) for i in range(5)]
    first = u.first_frame(ctx, {"video": frames})["input_image"]
    shaped = u.video_shape_checker(ctx, {"video": frames})
    ours = u.image_conditioner(ctx, {"video": shaped["video"], "num_frames": 5})["condition"]
    image = pipe.video_processor.preprocess(first, height=SIZE, width=SIZE)
    _, expected = pipe.prepare_latents(image, 1, 4, SIZE, SIZE, 5, torch.float32, "cpu",
                                       latents=torch.zeros(1, 4, 2, 4, 4))
    assert ours.shape == expected.shape == (1, 8, 2, 4, 4) and torch.allclose(ours, expected, atol=1e-5)
    embeds = u.image_embedder(ctx, {"input_image": first})["image_embeds"]
    assert torch.allclose(embeds, pipe.encode_image(first, "cpu"), atol=1e-6)


def test_stage1_reads_the_dits_config_but_never_its_weights(models, data, tmp_path, capsys):
    """wan_i2v's ImageEmbedder asks the DiT's image_dim: stage 1 reads transformer/config.json, not the weights."""
    copy = tmp_path / "models"
    shutil.copytree(models["wan_i2v"], copy)
    (copy / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not weights")
    common = dict(pipeline="wan_i2v", model_paths=str(copy), lora_base_model="dit", lora_rank=4, max_pixels=SIZE * SIZE,
                  num_frames=5, progress=False, plot=False)
    result = run(make_args(task="sft:data_process", dataset_base_path=str(data), output_path=str(tmp_path / "cache"),
                           dataset_metadata_path=str(data / "metadata.csv"), **common), echo=quiet)
    assert result.samples == 2 and result.plan.data_process_configs == ["dit"]
    assert "dit" not in result.plan.data_process_models
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    key = manifest["key_inputs"]
    assert list(key["configs"]["dit"]) == ["config.json"] and "dit" not in key["models"]  # config digested, by name
    code, shown, _ = cli(capsys, "inspect", "diffusion:wan_i2v", "--lora_base_model", "dit")
    assert code == 0 and "(config only: dit)" in shown
    # a DiT without image conditioning (Wan 2.2 style) gives no image embedding, decided from its config alone
    config = json.loads((copy / "transformer" / "config.json").read_text())
    config["image_dim"] = None
    ctx = UnitContext(models={}, config_loader=lambda slot: config)
    assert u.image_embedder(ctx, {"input_image": Image.new("RGB", (SIZE, SIZE))}) == {"image_embeds": None}


def test_diffsynth_wan_lora_command_ports(models, data, tmp_path, capsys):
    """examples/wanvideo/model_training/lora/Wan2.1-I2V-14B-480P.sh with the program name swapped (the tiny
    folder for the model ids): DiffSynth's q,k,v,o,ffn.0,ffn.2 reach diffusers' modules."""
    argv = ["train", "--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv"),
            "--height", str(SIZE), "--width", str(SIZE), "--num_frames", "5", "--dataset_repeat", "1",
            "--model_paths", str(models["wan_i2v"]), "--learning_rate", "1e-4", "--num_epochs", "1",
            "--remove_prefix_in_ckpt", "pipe.dit.", "--output_path", str(tmp_path / "out"), "--lora_base_model", "dit",
            "--lora_target_modules", ",".join(wan.DIFFSYNTH_DIT_TARGETS), "--lora_rank", "4",
            "--extra_inputs", "input_image", "--task", "sft:split", "--no-progress", "--no-plot"]
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["pipeline"] == "wan_i2v" and plan["train"]["models"] == ["dit"]  # chosen by the folder's class
    from safetensors.torch import load_file

    modules = {k.split(".lora_")[0] for k in load_file(str(tmp_path / "out" / "epoch-0.safetensors"))}
    for part in ("attn1.to_q", "attn1.to_out.0", "attn2.to_k", "ffn.net.0.proj", "ffn.net.2"):
        assert any(m.endswith(part) for m in modules), part
    code, _, err = cli(capsys, "train", "--pipeline", "wan", "--num_frames", "6", "--lora_base_model", "dit",
                       "--dataset_base_path", str(data), "--output_path", str(tmp_path / "bad"))
    one_error_line(code, err, "--num_frames must be 4k+1")


def test_model_ids_resolve_through_the_offline_modelscope_cache(models, tmp_path, monkeypatch):
    """`Wan-AI/Wan2.1-T2V-1.3B-Diffusers:transformer/...` through the same offline modelscope resolution."""
    pytest.importorskip("modelscope")
    from unitgraph.backends.diffusion.models.sources import ModelSources

    monkeypatch.setenv("UNITGRAPH_OFFLINE", "1")
    cache = tmp_path / "mscache"
    snapshot = cache / "models" / "Wan-AI--Wan2.1-T2V-1.3B-Diffusers" / "snapshots" / "master"
    shutil.copytree(models["wan"], snapshot)
    spec = ",".join(f"{wan.WAN_MODEL}:{sub}" for sub in ("transformer/*.safetensors", "text_encoder/*.safetensors",
                                                         "vae/*.safetensors"))
    sources = ModelSources(wan.SLOTS, model_id_with_origin_paths=spec, cache_dir=cache, offline=True)
    found = sources.resolve_many(["dit", "text_encoder", "vae", "tokenizer"])
    assert {slot: s.path for slot, s in found.items()} == {
        "dit": snapshot / "transformer", "text_encoder": snapshot / "text_encoder", "vae": snapshot / "vae",
        "tokenizer": snapshot / "tokenizer"}  # the tokenizer from the model id's tokenizer/, as DiffSynth defaults it
    assert type(sources.load(["vae"])["vae"]).__name__ == "AutoencoderKLWan"

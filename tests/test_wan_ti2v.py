"""Wan 2.2 TI2V-5B (`wan_ti2v`): units and loss against diffusers' WanPipeline / WanImageToVideoPipeline with
expand_timesteps and against DiffSynth-Studio's FlowMatchSFTLoss, text-to-video by default and image-to-video from
each clip's first frame with `--extra_inputs input_image`, DiffSynth's TI2V command with models at its paths, the
released configs and a dry run at the release's size.

The tiny TI2V folder has the release's layout (a VAE of 2x2 pixel patches and residual blocks, 16x spatial and 4x
temporal, a DiT of the VAE's latent width, expand_timesteps in model_index.json) at a few thousand parameters.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("av")

from safetensors.torch import load_file, save_file  # noqa: E402

from diffsynth_wheel import wheel_modules  # noqa: E402
from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families import wan  # noqa: E402
from unitgraph.backends.diffusion.families.wan import losses, real, render, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402
from shallow import shallow  # noqa: E402

SIZE = 64  # 4x4 latents of the 16x VAE: 2x2 tokens a latent frame
FRAMES = 5  # two latent frames: the given one and one to train
WHEEL = Path(__file__).resolve().parents[1] / ".venv" / "diffsynth-wheel" / "diffsynth" / "diffusion"


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("ti2v") / "models", size="test", seed=0, pipeline="wan_ti2v")


@pytest.fixture(scope="module")
def pipe(models):
    return diffusers.WanPipeline.from_pretrained(str(models))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ti2v-data")
    write_synthetic_dataset(folder, count=2, size=SIZE, seed=2, videos=["video"], frames=FRAMES)
    return folder


def context(pipe, **settings) -> UnitContext:
    names = {"transformer": "dit", "vae": "vae", "text_encoder": "text_encoder", "tokenizer": "tokenizer"}
    return UnitContext(models={slot: getattr(pipe, attr) for attr, slot in names.items()},
                       settings=UnitSettings(**settings))


def i2v_twin(pipe):
    """diffusers' image-to-video pipeline with expand_timesteps over the same components (TI2V-5B's I2V path)."""
    return diffusers.WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                             scheduler=pipe.scheduler, transformer=pipe.transformer,
                                             expand_timesteps=True)


def clip(n: int = FRAMES):
    from PIL import Image

    return [Image.new("RGB", (SIZE, SIZE), (200, 40 * i, 255 - 40 * i)) for i in range(n)]


# ------------------------------------------------------------------------------------------------
# declarations


def test_the_ti2v_repositories_choose_wan_ti2v_and_the_tiny_folder_is_the_releases_layout(models, pipe):
    for model_id in ("Wan-AI/Wan2.2-TI2V-5B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"):
        assert [r.pipeline for r in wan.REPOS if r.names(model_id)] == ["wan_ti2v"], model_id
    assert wan.FAMILY.diffusers_class("wan_ti2v") == "WanPipeline" and pipe.config.expand_timesteps
    vae = pipe.vae.config
    assert (vae.patch_size, vae.scale_factor_spatial, vae.scale_factor_temporal, vae.is_residual) == (2, 16, 4, True)
    assert pipe.transformer.config.in_channels == pipe.transformer.config.out_channels == vae.z_dim
    assert json.loads((models / "unitgraph_tiny.json").read_text())["ti2v"] is True
    # DiffSynth's module names and LoRA targets, as the family's other pipelines
    assert wan.FAMILY.slot("dit").lora_targets == wan.DIT_LORA_TARGETS


def test_a_folder_setting_expand_timesteps_chooses_wan_ti2v(models, tmp_path):
    from unitgraph.backends.diffusion.config import choose_pipeline

    assert choose_pipeline(make_args(model_paths=str(models), lora_base_model="dit"))[1].name == "wan_ti2v"
    index = json.loads((models / "model_index.json").read_text())
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": False}))
    assert choose_pipeline(make_args(model_paths=str(plain), lora_base_model="dit"))[1].name == "wan"


# ------------------------------------------------------------------------------------------------
# units against the diffusers pipelines


def test_prompt_latents_and_first_frame_match_the_pipelines(pipe):
    ctx = context(pipe, image_size=ImageSize(SIZE, SIZE), derived_inputs=("input_image",))
    prompt = "a  red circle &amp; a blue square"
    expected = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    assert torch.equal(u.prompt_encoder(ctx, {"prompt": prompt})["prompt_emb"], expected)
    shaped = u.ti2v_shape_checker(ctx, {"video": clip()})
    assert shaped["video"].shape == (1, 3, FRAMES, SIZE, SIZE)
    mean, _ = u.encode_distribution(ctx, shaped["video"])
    vae = pipe.vae
    stats = [torch.tensor(getattr(vae.config, k)).view(1, -1, 1, 1, 1) for k in ("latents_mean", "latents_std")]
    z = vae.encode(shaped["video"]).latent_dist.mean
    assert mean.shape == (1, vae.config.z_dim, 2, 4, 4) and torch.allclose(mean, (z - stats[0]) / stats[1], atol=1e-6)
    # the first frame: WanImageToVideoPipeline.prepare_latents with expand_timesteps (the image alone, its VAE mode)
    ours = u.first_frame_latents(ctx, {"video": shaped["video"], "num_frames": FRAMES})["first_frame_latents"]
    i2v = i2v_twin(pipe)
    image = i2v.video_processor.preprocess(clip()[0], height=SIZE, width=SIZE)
    _, condition, mask = i2v.prepare_latents(image, 1, vae.config.z_dim, SIZE, SIZE, FRAMES, torch.float32, "cpu",
                                             latents=torch.zeros(1, vae.config.z_dim, 2, 4, 4))
    assert ours.shape == condition.shape == (1, vae.config.z_dim, 1, 4, 4)
    assert torch.allclose(ours, condition, atol=1e-5)
    assert mask[0, 0, 0].eq(0).all() and mask[0, 0, 1:].eq(1).all()
    # text-to-video (no --extra_inputs input_image): no first frame is given
    plain = context(pipe, image_size=ImageSize(SIZE, SIZE))
    assert u.first_frame_latents(plain, {"video": shaped["video"], "num_frames": FRAMES}) == {"first_frame_latents": None}


def test_sides_are_multiples_of_32_and_image_to_video_needs_a_frame_to_train(pipe):
    from PIL import Image

    from unitgraph.backends.diffusion.errors import BackendError

    ctx = context(pipe, image_size=ImageSize(max_pixels=120 * 90), derived_inputs=("input_image",))
    shaped = u.ti2v_shape_checker(ctx, {"video": [Image.new("RGB", (120, 90))] * 5})
    assert (shaped["width"], shaped["height"]) == (96, 64)
    with pytest.raises(BackendError, match="needs --height and --width multiples of 32"):
        u.ti2v_shape_checker(context(pipe, image_size=ImageSize(80, 112)), {"video": [Image.new("RGB", (120, 90))]})
    one = u.ti2v_shape_checker(ctx, {"video": [Image.new("RGB", (120, 90))]})
    with pytest.raises(BackendError, match="needs clips of 5 frames or more"):
        u.first_frame_latents(ctx, {"video": one["video"], "num_frames": 1})


def _capture(module):
    seen = {}

    def hook(_module, args, kwargs, output):
        seen.update(kwargs, out=output[0])

    return seen, module.register_forward_hook(hook, with_kwargs=True)


def test_the_text_to_video_loss_calls_the_dit_as_the_pipelines_denoising_step(pipe):
    """WanPipeline with expand_timesteps: one timestep per token (all t); our call gives the same velocity."""
    ctx = context(pipe)
    emb = pipe.encode_prompt("a dog", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    latents = torch.randn(1, pipe.vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    seen, handle = _capture(pipe.transformer)
    with torch.no_grad():
        pipe(prompt_embeds=emb, latents=latents.clone(), height=SIZE, width=SIZE, num_frames=FRAMES,
             num_inference_steps=1, guidance_scale=1.0, output_type="latent")
        handle.remove()
        t = pipe.scheduler.timesteps[0].reshape(1).float()
        ours = losses.ti2v_predict(ctx, latents, t, emb)
    assert seen["timestep"].shape == (1, 2 * 2 * 2) and torch.all(seen["timestep"] == t)
    assert torch.allclose(seen["out"], ours, atol=1e-6)


def test_the_image_to_video_loss_calls_the_dit_as_the_pipelines_denoising_step(pipe):
    """WanImageToVideoPipeline with expand_timesteps: the image's latents in place of the first latent frame, whose
    tokens get timestep 0; the same hidden states, timesteps and velocity from our call."""
    ctx = context(pipe, image_size=ImageSize(SIZE, SIZE), derived_inputs=("input_image",))
    i2v = i2v_twin(pipe)
    emb = pipe.encode_prompt("a dog", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    latents = torch.randn(1, pipe.vae.config.z_dim, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    shaped = u.ti2v_shape_checker(ctx, {"video": clip()})
    first = u.first_frame_latents(ctx, {"video": shaped["video"], "num_frames": FRAMES})["first_frame_latents"]
    seen, handle = _capture(pipe.transformer)
    with torch.no_grad():
        i2v(image=clip()[0], prompt_embeds=emb, latents=latents.clone(), height=SIZE, width=SIZE, num_frames=FRAMES,
            num_inference_steps=1, guidance_scale=1.0, output_type="latent")
        handle.remove()
        t = i2v.scheduler.timesteps[0].reshape(1).float()
        ours = losses.ti2v_predict(ctx, latents, t, emb, first)
    assert torch.equal(seen["timestep"], torch.tensor([[0.0] * 4 + [float(t)] * 4]))
    assert torch.allclose(seen["hidden_states"][:, :, :1], first, atol=1e-5)
    assert torch.allclose(seen["out"], ours, atol=1e-5)


def test_render_draws_what_the_pipeline_draws(pipe):
    emb = pipe.encode_prompt("a cat", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    models = {"dit": pipe.transformer, "vae": pipe.vae, "scheduler": pipe.scheduler}
    neg = pipe.encode_prompt("", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    got = render.render(wan.WAN_TI2V, models, {"prompt_emb": emb}, SIZE, SIZE, 2, torch.Generator().manual_seed(1),
                        negative={"prompt_emb": neg})
    frames = pipe(prompt_embeds=emb, negative_prompt_embeds=neg, width=SIZE, height=SIZE, num_frames=render.FRAMES,
                  num_inference_steps=2, generator=torch.Generator().manual_seed(1),  # its default guidance, 5
                  output_type="pil").frames[0]
    assert got.size == (SIZE * render.FRAMES, SIZE)
    assert got.crop((0, 0, SIZE, SIZE)).tobytes() == frames[0].tobytes()
    assert got.crop((SIZE * 4, 0, SIZE * 5, SIZE)).tobytes() == frames[4].tobytes()


def test_render_from_a_first_frame_draws_what_the_image_to_video_pipeline_draws(pipe):
    """--validation_image on TI2V-5B: the sample starts from the image, through WanImageToVideoPipeline with
    expand_timesteps (the image's latents as the first latent frame, clean), as its release renders image-to-video."""
    emb = pipe.encode_prompt("a cat", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    neg = pipe.encode_prompt("", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]
    models = {"dit": pipe.transformer, "vae": pipe.vae, "scheduler": pipe.scheduler}
    image = clip()[0]
    got = render.render(wan.WAN_TI2V, models, {"prompt_emb": emb}, SIZE, SIZE, 2, torch.Generator().manual_seed(1),
                        negative={"prompt_emb": neg}, image=image)
    frames = i2v_twin(pipe)(image=image, prompt_embeds=emb, negative_prompt_embeds=neg, width=SIZE, height=SIZE,
                            num_frames=render.FRAMES, num_inference_steps=2, generator=torch.Generator().manual_seed(1),
                            output_type="pil").frames[0]
    assert got.crop((0, 0, SIZE, SIZE)).tobytes() == frames[0].tobytes()
    assert got.crop((SIZE * 4, 0, SIZE * 5, SIZE)).tobytes() == frames[4].tobytes()
    alone = render.render(wan.WAN_TI2V, models, {"prompt_emb": emb}, SIZE, SIZE, 2, torch.Generator().manual_seed(1),
                          negative={"prompt_emb": neg})
    assert alone.tobytes() != got.tobytes()  # the image mattered


# ------------------------------------------------------------------------------------------------
# the loss against DiffSynth-Studio's



@pytest.fixture(scope="module")
def diffsynth():
    """DiffSynth's flow_match and loss modules from the wheel's files (loss.py's package import stood in for)."""
    with wheel_modules("_ti2v_diffsynth", "flow_match", "loss") as modules:
        yield modules


class _Pipe:
    """What FlowMatchSFTLoss reads of a pipeline: scheduler, dtype, device, the denoiser call."""

    in_iteration_models = ()

    def __init__(self, scheduler, model_fn):
        self.scheduler, self.model_fn = scheduler, model_fn
        self.torch_dtype, self.device = torch.float32, "cpu"


@pytest.mark.parametrize("image", [False, True], ids=["text-to-video", "image-to-video"])
def test_the_loss_is_diffsynths_flow_match_sft_loss_for_ti2v(diffsynth, pipe, image):
    """DiffSynth's FlowMatchSFTLoss around the same DiT, called as DiffSynth's model_fn_wan_video calls a DiT with
    seperated_timestep (a timestep per token, 0 on the given first frame when fuse_vae_embedding_in_latents, one
    scalar otherwise): given DiffSynth's draws, our sink computes the same loss."""
    flow_match, loss = diffsynth
    scheduler = flow_match.FlowMatchScheduler("Wan")
    scheduler.set_timesteps(1000, training=True)
    z = pipe.vae.config.z_dim
    x0 = torch.randn(1, z, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    first = torch.randn(1, z, 1, 4, 4, generator=torch.Generator().manual_seed(4))
    emb = pipe.encode_prompt("a dog", do_classifier_free_guidance=False, max_sequence_length=u.TEXT_LENGTH)[0]

    def model_fn(latents, timestep, context, fuse_vae_embedding_in_latents=False, **_):
        if fuse_vae_embedding_in_latents:  # per frame: h x w / 4 tokens
            tokens = latents.shape[3] * latents.shape[4] // 4
            timestep = torch.cat([torch.zeros(1, tokens), torch.ones(latents.shape[2] - 1, tokens) * timestep]).flatten()[None]
        return pipe.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]

    extra = {"first_frame_latents": first, "fuse_vae_embedding_in_latents": True} if image else {}
    ctx = context(pipe)
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = loss.FlowMatchSFTLoss(_Pipe(scheduler, model_fn), input_latents=x0.clone(), context=emb, **extra)
        torch.manual_seed(seed)  # DiffSynth's draws in its order: the position, then the noise
        index = int(torch.randint(0, 1000, (1,)))
        noise = torch.randn_like(x0)
        timestep = (u.TRAINING_SCHEDULE.sigmas()[index] * 1000).reshape(1)
        inputs = {"input_latents": x0, "noise": noise, "timestep": timestep,
                  "loss_weight": u.TRAINING_SCHEDULE.weights()[index].reshape(1), "prompt_emb": emb,
                  "first_frame_latents": first if image else None}
        with torch.no_grad():
            ours = losses.ti2v_flow_matching_loss(ctx, inputs)
        assert float(ours) == pytest.approx(float(expected), rel=1e-5, abs=1e-7), seed


# ------------------------------------------------------------------------------------------------
# runs


def _flags(models: Path, data: Path, **extra) -> dict:
    flags = dict(pipeline="wan_ti2v", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                 model_paths=str(models), lora_base_model="dit", lora_rank=4, learning_rate=1e-3, height=SIZE,
                 width=SIZE, num_frames=FRAMES, seed=5, progress=False, plot=False)
    return {**flags, **extra}


def test_image_to_video_split_equals_unsplit_and_keeps_its_own_cache(models, data, tmp_path):
    """--extra_inputs input_image: the first frame's latents reach the loss through the cache exactly as unsplit;
    the text-to-video cache of the same data is another (the flag is in the key)."""
    i2v = _flags(models, data, extra_inputs="input_image")
    unsplit = run(make_args(task="sft", output_path=str(tmp_path / "unsplit"), **i2v), echo=quiet)
    split = run(make_args(task="sft:split", output_path=str(tmp_path / "split"), **i2v), echo=quiet)
    assert unsplit.steps == split.steps == 2
    a, b = read_loss_csv(tmp_path / "unsplit" / "loss.csv"), read_loss_csv(tmp_path / "split" / "loss.csv")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-6, rel=0)
    wa, wb = load_file(str(tmp_path / "unsplit" / "epoch-0.safetensors")), load_file(str(tmp_path / "split" / "epoch-0.safetensors"))
    assert set(wa) == set(wb) and all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)
    # stage 1 alone, each way: the entries differ by the first frame's latents
    caches = {}
    for name, extra in (("t2v", {}), ("i2v", {"extra_inputs": "input_image"})):
        out = tmp_path / f"cache-{name}"
        run(make_args(task="sft:data_process", output_path=str(out), **_flags(models, data, **extra)), echo=quiet)
        caches[name] = json.loads((out / "manifest.json").read_text())
    assert caches["i2v"]["key_inputs"]["settings"].get("derived_inputs") == ["input_image"]
    assert "derived_inputs" not in caches["t2v"]["key_inputs"]["settings"]
    # stage 2 of the image-to-video cache without the flag: one line saying what differs
    from unitgraph.backends.diffusion.errors import BackendError

    train = _flags(models, tmp_path / "cache-i2v", dataset_metadata_path=None)
    with pytest.raises(BackendError, match="no derived --extra_inputs now, --extra_inputs input_image in the cache"):
        run(make_args(task="sft:train", output_path=str(tmp_path / "mismatch"), **train), echo=quiet)
    t2v = run(make_args(task="sft:split", output_path=str(tmp_path / "t2v"), **_flags(models, data)), echo=quiet)
    assert read_loss_csv(tmp_path / "t2v" / "loss.csv")[0]["loss"] != pytest.approx(a[0]["loss"], abs=1e-9)
    assert t2v.steps == 2


def test_validation_samples_render_in_a_bf16_run(models, data, tmp_path):
    from PIL import Image

    result = run(make_args(task="sft:split", output_path=str(tmp_path / "out"), validation_prompt=["a red circle"],
                           validation_inference_steps=2, mixed_precision="bf16", **_flags(models, data)), echo=quiet)
    assert result.steps == 2
    sample = Image.open(tmp_path / "out" / "samples" / "epoch-0" / "0.png")
    assert sample.size == (SIZE * render.FRAMES, SIZE)


# DiffSynth-Studio's examples/wanvideo/model_training/lora/Wan2.2-TI2V-5B.sh; --dataset_repeat 100 lowered to 1,
# 480x832 to 64x64, --num_frames 49 to 5
TI2V_COMMAND = """
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.2-TI2V-5B
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.2-TI2V-5B/metadata.csv
  --height 64
  --width 64
  --num_frames 5
  --dataset_repeat 1
  --model_id_with_origin_paths "Wan-AI/Wan2.2-TI2V-5B:diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.2-TI2V-5B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.2-TI2V-5B:Wan2.2_VAE.pth"
  --learning_rate 1e-4
  --num_epochs 5
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Wan2.2-TI2V-5B_lora"
  --lora_base_model "dit"
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2"
  --lora_rank 32
  --extra_inputs "input_image"
"""
TI2V_DIFFUSERS_IDS = ",".join(f"Wan-AI/Wan2.2-TI2V-5B-Diffusers:{sub}/*.safetensors" for sub in ("transformer", "text_encoder", "vae"))


@pytest.mark.slow
def test_diffsynths_ti2v_lora_command_runs_verbatim_with_the_diffusers_paths(models, tmp_path, user_shell):
    """The release files DiffSynth's command names (Wan's own DiT layout, two pickles) are named in one error line
    with the -Diffusers paths; with those, tiny models at DiffSynth's path train wan_ti2v's image-to-video."""
    repo = tmp_path / "models" / "Wan-AI" / "Wan2.2-TI2V-5B"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 24, "num_layers": 1, "in_dim": 48}))
    save_file({"patch_embedding.weight": torch.zeros(24, 48, 1, 2, 2)},
              str(repo / "diffusion_pytorch_model-00001-of-00001.safetensors"))
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.2_VAE.pth"):
        (repo / name).write_bytes(b"\x80\x04 a pickle: never opened")
    write_synthetic_dataset(tmp_path / "data" / "diffsynth_example_dataset" / "wanvideo" / "Wan2.2-TI2V-5B", count=2,
                            size=SIZE, seed=2, videos=["video"], frames=9)
    done = user_shell.train(tmp_path, TI2V_COMMAND)
    line = one_error_line(done.returncode, done.stderr, "3 model files this command names cannot be read",
                          "Wan-AI/Wan2.2-TI2V-5B:Wan2.2_VAE.pth (a pickle, which unitgraph never loads)")
    assert re.search(r'--model_id_with_origin_paths "([^"]+)"', line).group(1) == TI2V_DIFFUSERS_IDS
    shutil.copytree(models, tmp_path / "models" / "Wan-AI" / "Wan2.2-TI2V-5B-Diffusers")
    flags = TI2V_COMMAND.replace(re.search(r'--model_id_with_origin_paths "([^"]+)"', TI2V_COMMAND).group(1),
                                 TI2V_DIFFUSERS_IDS)
    done = user_shell.train(tmp_path, flags)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: wan_ti2v (the model id Wan-AI/Wan2.2-TI2V-5B-Diffusers" in done.stdout, done.stdout[:2000]
    out = tmp_path / "models" / "train" / "Wan2.2-TI2V-5B_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == [f"epoch-{k}.safetensors" for k in range(5)]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["pipeline"] == "wan_ti2v" and "first_frame_latents" in plan["cache"]["params"]
    modules = {k.split(".lora_")[0] for k in load_file(str(out / "epoch-4.safetensors"))}
    for part in ("attn1.to_q", "attn1.to_out.0", "attn2.to_k", "ffn.net.0.proj", "ffn.net.2"):
        assert any(m.endswith(part) for m in modules), part
    pipe = diffusers.WanPipeline.from_pretrained(str(tmp_path / "models" / "Wan-AI" / "Wan2.2-TI2V-5B-Diffusers"))
    pipe.load_lora_weights(str(out / "epoch-4.safetensors"))


# ------------------------------------------------------------------------------------------------
# the released model


def test_the_released_configs_build_to_the_published_sizes(capsys, tmp_path):
    """Wan-AI/Wan2.2-TI2V-5B-Diffusers: the 5B DiT (5.00 B on the meta device), UMT5-XXL's encoder, the z-48 VAE."""
    from unitgraph.backends.diffusion.memory_plan import build_meta
    from unitgraph.backends.diffusion.models.sources import ModelSources

    code, _, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", "wan_ti2v", "--size", "real")
    assert code == 0, err
    assert not list((tmp_path / "real").rglob("*.safetensors"))
    index = json.loads((tmp_path / "real" / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    sources = ModelSources(wan.SLOTS, str(tmp_path / "real"), offline=True)
    published = {"dit": 5.0e9, "text_encoder": 5.68e9}
    counts = {}
    for slot in ("dit", "text_encoder", "vae"):
        model = build_meta(wan.FAMILY.slot(slot), sources.load_config(slot), "bfloat16")
        counts[slot] = sum(p.numel() for p in model.parameters())
    for slot, count in published.items():
        assert abs(counts[slot] - count) < 0.01 * count, (slot, counts[slot])
    assert sources.load_config("vae")["z_dim"] == 48 and sources.load(["scheduler"])["scheduler"].config.flow_shift == 5.0


@pytest.mark.slow
def test_the_dry_run_of_the_released_model_at_704x1280(capsys, tmp_path):
    """TI2V-5B's own resolution, 121 frames: 31 latent frames of 44 x 80 (48 channels), 27 280 DiT tokens."""
    shallow(real.write_real_configs(tmp_path / "real", pipeline="wan_ti2v"))  # 2 blocks: what is checked does not depend on depth
    code, out, err = cli(capsys, "train", "--dry_run", "--json", "--model_paths", str(tmp_path / "real"),
                         "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "704",
                         "--width", "1280", "--num_frames", "121", "--extra_inputs", "input_image")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    assert plan["settings"]["pipeline"] == "wan_ti2v"  # chosen by the folder's expand_timesteps
    assert set(plan["stages"]["train"]["models"]) == {"dit"}
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder", "vae"}
    size = plan["settings"]["size"]
    assert size["latent"] == [48, 31, 44, 80] and size["image_tokens"] == 31 * 22 * 40

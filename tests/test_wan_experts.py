"""Wan 2.2 A14B's two experts: which one a run trains (backends/diffusion/experts.py), on which timesteps, from what
the command names; one stage-1 cache for both; DiffSynth's per-expert commands, models at DiffSynth's paths; I2V
A14B's folder, which has no CLIP image encoder. (tests/test_conformance.py runs the two-expert folders through the
conformance cases: 2-process stage 1, stage 2 without the encoders.)

The tiny two-expert folder is diffusers' WanPipeline with `transformer` (high noise), `transformer_2` (low noise,
other weights) and boundary_ratio 0.875, Wan 2.2 T2V A14B's. With DiffSynth's shift-5 training schedule the 417
noisiest of its 1000 positions have timesteps >= 875: DiffSynth's high-noise command keeps 0..0.417, its low-noise
command 0.417..1, and those are the ranges unitgraph derives from the ratio itself.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("av")

from safetensors.torch import load_file, save_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.config import RunConfig  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.experts import choose_expert  # noqa: E402
from unitgraph.backends.diffusion.families import wan  # noqa: E402
from unitgraph.backends.diffusion.families.wan import tiny  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import position_range  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32
FRAMES = 5


@pytest.fixture(scope="module")
def experts_folder(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("a14b") / "models", size="test", seed=0, experts=True)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clips")
    write_synthetic_dataset(folder, count=2, size=SIZE, seed=2, videos=["video"], frames=FRAMES)
    return folder


def flags(models: Path, data: Path, **extra) -> dict:
    return {"pipeline": "wan", "dataset_base_path": str(data), "dataset_metadata_path": str(data / "metadata.csv"),
            "model_paths": str(models), "lora_base_model": "dit", "lora_rank": 4, "learning_rate": 1e-3, "height": SIZE,
            "width": SIZE, "num_frames": FRAMES, "progress": False, "plot": False, **extra}


def choice(models: Path, data: Path, **extra):
    cfg = RunConfig.from_args(make_args(**flags(models, data, **extra)))
    return cfg.models.expert, cfg.units.timestep_bounds


def test_tiny_models_writes_the_two_expert_layout_on_request(tmp_path, capsys):
    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "a14b"), "--pipeline", "wan", "--experts")
    assert code == 0, err
    index = json.loads((tmp_path / "a14b" / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    for argv in (["--pipeline", "flux"], ["--pipeline", "wan_ti2v"], ["--pipeline", "wan", "--size", "real"]):
        code, _, err = cli(capsys, "tiny-models", str(tmp_path / "no"), *argv, "--experts")
        one_error_line(code, err, "--experts")
        assert not (tmp_path / "no").exists()


def test_the_i2v_experts_folder_goes_without_a_clip_image_encoder(tmp_path, capsys):
    """Wan 2.2 I2V A14B's diffusers folder: image_encoder and image_processor null in model_index.json, a DiT of the
    conditioning channels without image_dim, boundary_ratio 0.9; WanImageToVideoPipeline loads it."""
    code, _, err = cli(capsys, "tiny-models", str(tmp_path / "i2v"), "--pipeline", "wan_i2v", "--experts")
    assert code == 0, err
    index = json.loads((tmp_path / "i2v" / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.9 and index["image_encoder"] == [None, None] == index["image_processor"]
    assert not (tmp_path / "i2v" / "image_encoder").exists()
    dit = json.loads((tmp_path / "i2v" / "transformer" / "config.json").read_text())
    z = json.loads((tmp_path / "i2v" / "vae" / "config.json").read_text())["z_dim"]
    assert dit["image_dim"] is None and dit["in_channels"] == 2 * z + 4
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(str(tmp_path / "i2v"))
    assert pipe.image_encoder is None and pipe.transformer_2 is not None


@pytest.mark.slow
def test_i2v_experts_train_without_an_image_encoder_each_from_one_cache(tmp_path, clips):
    """Stage 1 of an I2V A14B folder loads no image encoder (the folder has none, the DiT takes no image features);
    each expert trains from that cache on timesteps either side of 900, as its unsplit run; a dry run plans it."""
    models = tiny.write_tiny_models(tmp_path / "i2v", size="test", seed=0, pipeline="wan_i2v", experts=True)
    quiet = lambda *_: None  # noqa: E731
    common = flags(models, clips, pipeline="wan_i2v")
    cache = tmp_path / "cache"
    run(make_args(task="sft:data_process", output_path=str(cache), **common), echo=quiet)
    for expert, low, high in (("high_noise", 900, 1000), ("low_noise", 0, 900)):
        run(make_args(task="sft:train", output_path=str(tmp_path / expert), expert=expert,
                      **dict(common, dataset_base_path=str(cache), dataset_metadata_path=None)), echo=quiet)
        run(make_args(task="sft", output_path=str(tmp_path / f"{expert}-unsplit"), expert=expert, **common), echo=quiet)
        rows = read_loss_csv(tmp_path / expert / "loss.csv")
        assert [r["loss"] for r in rows] == pytest.approx(
            [r["loss"] for r in read_loss_csv(tmp_path / f"{expert}-unsplit" / "loss.csv")], abs=1e-6, rel=0)
        assert rows and all(low <= r["timestep"] < high for r in rows), rows
    plan = run(make_args(task="sft", dry_run=True, output_path=str(tmp_path / "dry"), expert="low_noise", **common),
               echo=quiet).memory_plan
    assert "image_encoder" not in plan["stages"]["data_process"]["models"]
    assert set(plan["stages"]["train"]["models"]) == {"dit"}


def test_a_dit_of_image_features_without_an_image_encoder_is_one_line(tmp_path, clips, capsys):
    """A Wan 2.1 I2V DiT (image_dim set) in a folder that declares no image encoder: stage 1 says what is missing."""
    models = tiny.write_tiny_models(tmp_path / "i2v", size="test", seed=0, pipeline="wan_i2v")
    index = json.loads((models / "model_index.json").read_text())
    index.update(image_encoder=[None, None], image_processor=[None, None])
    (models / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(models / "image_encoder")
    code, _, err = cli(capsys, "train", "--pipeline", "wan_i2v", "--task", "sft:data_process", "--model_paths",
                       str(models), "--dataset_base_path", str(clips), "--dataset_metadata_path",
                       str(clips / "metadata.csv"), "--num_frames", str(FRAMES), "--height", str(SIZE), "--width",
                       str(SIZE), "--output_path", str(tmp_path / "cache"), "--no-progress")
    one_error_line(code, err, "image_dim", "no image_encoder", "--model_paths")


def test_the_a14b_released_configs_plan_one_expert_without_a_clip_encoder(capsys, tmp_path):
    """`tiny-models --size real-a14b`: T2V A14B's two experts of one config for wan, I2V A14B's folder (no image
    encoder, a DiT without image features) for wan_i2v; a dry run plans the expert --expert names, at 832x480 x 81."""
    from unitgraph.backends.diffusion.families.wan import real

    for pipeline, ratio in (("wan", 0.875), ("wan_i2v", 0.9)):
        code, _, err = cli(capsys, "tiny-models", str(tmp_path / pipeline), "--pipeline", pipeline, "--size", "real-a14b")
        assert code == 0, err
        index = json.loads((tmp_path / pipeline / "model_index.json").read_text())
        assert index["boundary_ratio"] == ratio and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
        configs = [json.loads((tmp_path / pipeline / sub / "config.json").read_text()) for sub in ("transformer", "transformer_2")]
        assert configs[0] == configs[1] and configs[0]["num_layers"] == 40 and configs[0]["image_dim"] is None
    assert index["image_encoder"] == [None, None] and configs[0]["in_channels"] == 36
    flags = ["train", "--dry_run", "--json", "--pipeline", "wan_i2v", "--model_paths", str(tmp_path / "wan_i2v"),
             "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "480", "--width", "832",
             "--num_frames", "81"]
    code, _, err = cli(capsys, *flags)
    one_error_line(code, err, "--expert")
    code, out, err = cli(capsys, *flags, "--expert", "low_noise")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder", "vae"}
    train = plan["stages"]["train"]["models"]
    base = train["dit"]["params"] - train["dit"]["trainable_params"]  # without the LoRA
    assert set(train) == {"dit"} and abs(base - 14.29e9) < 0.005 * 14.29e9
    assert real.A14B_BOUNDARY == {"wan": 0.875, "wan_i2v": 0.9}


# --------------------------------------------------------------------------------------------
# the choice


def test_the_experts_split_the_schedule_where_diffsynths_commands_do():
    experts = wan.FAMILY.experts
    assert experts.positions(0.875) == 417 and experts.positions(0.9) == 358  # T2V's 0.417, I2V's 0.358
    timesteps = experts.schedule.sigmas() * 1000
    assert float(timesteps[416]) >= 875 > float(timesteps[417])
    assert position_range((0.0, 0.417), 1000) == (0, 417) and position_range((0.417, 1.0), 1000) == (417, 1000)


def test_a_folder_of_two_experts_asks_which_in_one_line(experts_folder, clips, capsys):
    code, _, err = cli(capsys, "train", "--pipeline", "wan", "--model_paths", str(experts_folder), "--dataset_base_path",
                       str(clips), "--lora_base_model", "dit", "--num_frames", str(FRAMES), "--dry_run")
    one_error_line(code, err, f"{experts_folder} holds 2 experts and a run trains one: choose it with --expert "
                              "high_noise|low_noise", "high_noise (transformer/, timesteps >= 875: "
                              "--min_timestep_boundary 0 --max_timestep_boundary 0.417)",
                   "low_noise (transformer_2/, timesteps < 875: --min_timestep_boundary 0.417 --max_timestep_boundary 1)")


def test_the_flag_the_boundaries_or_the_folder_named_choose_and_give_the_experts_timesteps(experts_folder, clips):
    assert choice(experts_folder, clips, expert="low_noise") == ("low_noise", (0.417, 1.0))
    assert choice(experts_folder, clips, expert="high_noise") == ("high_noise", (0.0, 0.417))
    # DiffSynth's boundaries pick the expert whose timesteps hold them; a narrower range is kept as given
    assert choice(experts_folder, clips, max_timestep_boundary=0.417) == ("high_noise", (0.0, 0.417))
    assert choice(experts_folder, clips, min_timestep_boundary=0.417) == ("low_noise", (0.417, 1.0))
    assert choice(experts_folder, clips, min_timestep_boundary=0.5, max_timestep_boundary=0.9) == ("low_noise", (0.5, 0.9))
    # an expert's component folder names it (transformer/ does only beside the other expert)
    components = json.dumps([str(experts_folder / sub) for sub in ("transformer_2", "vae", "text_encoder", "tokenizer")])
    assert choice(components, clips) == ("low_noise", (0.417, 1.0))
    components = json.dumps([str(experts_folder / sub) for sub in ("transformer", "vae", "text_encoder", "tokenizer")])
    assert choice(components, clips) == ("high_noise", (0.0, 0.417))


@pytest.mark.parametrize("extra, message", [
    ({"min_timestep_boundary": 0.3, "max_timestep_boundary": 0.6}, "holds 2 experts and a run trains one"),
    ({"expert": "high_noise", "min_timestep_boundary": 0.5}, "--min_timestep_boundary 0.5 --max_timestep_boundary 1 "
                                                             "leave timesteps outside the high_noise expert's"),
    ({"expert": "middle"}, "--expert 'middle' is not an expert of Wan (experts: high_noise, low_noise)"),
])
def test_choices_that_do_not_add_up_are_one_line(experts_folder, clips, extra, message):
    with pytest.raises(BackendError, match=re.escape(message)):
        choice(experts_folder, clips, **extra)


def test_two_experts_named_and_an_expert_of_a_single_dit_are_refused(experts_folder, clips, tmp_path):
    with pytest.raises(BackendError, match=re.escape(f"names two experts: high_noise ({experts_folder / 'transformer'}) "
                                                     "and low_noise (--expert)")):
        choice(json.dumps([str(experts_folder / "transformer")]), clips, expert="low_noise")
    single = tiny.write_tiny_models(tmp_path / "wan21", size="test", seed=0)
    assert choice(single, clips) == (None, (0.0, 1.0))  # Wan 2.1: no expert, the whole schedule
    assert choice(json.dumps([str(single / "transformer")]), clips) == (None, (0.0, 1.0))
    with pytest.raises(BackendError, match="holds one DiT, not experts"):
        choice(single, clips, expert="low_noise")


def test_model_ids_name_an_expert_by_its_folder_and_know_the_published_ratio():
    args = lambda ids, **kw: make_args(pipeline="wan", dataset_base_path=".", lora_base_model="dit",  # noqa: E731
                                       model_id_with_origin_paths=ids, **kw)
    low = choose_expert(args("Wan-AI/Wan2.2-T2V-A14B-Diffusers:transformer_2/*.safetensors"), wan.FAMILY)
    assert (low.expert, low.bounds) == ("low_noise", (0.417, 1.0)) and "timesteps < 875" in low.line
    high = choose_expert(args("Wan-AI/Wan2.2-I2V-A14B:high_noise_model/diffusion_pytorch_model*.safetensors"), wan.FAMILY)
    assert (high.expert, high.bounds) == ("high_noise", (0.0, 0.358))  # I2V: ratio 0.9
    plain = choose_expert(args("Wan-AI/Wan2.1-T2V-14B-Diffusers:transformer/*.safetensors"), wan.FAMILY)
    assert (plain.expert, plain.bounds, plain.line) == (None, (0.0, 1.0), "")


# --------------------------------------------------------------------------------------------
# training


@pytest.mark.slow
def test_one_stage1_cache_serves_both_experts(experts_folder, clips, tmp_path):
    """Stage 1 runs with no expert chosen; each expert's stage 2 trains from that cache on its own timesteps and
    weights, exactly as its unsplit run; stage 1 asked again with an expert finds every entry made."""
    quiet = lambda *_: None  # noqa: E731
    cache = tmp_path / "cache"
    first = run(make_args(task="sft:data_process", output_path=str(cache), **flags(experts_folder, clips)), echo=quiet)
    assert not first.cache_reused
    stage2 = dict(flags(experts_folder, cache), dataset_metadata_path=None)
    losses = {}
    for expert, low, high in (("high_noise", 875, 1000), ("low_noise", 0, 875)):
        run(make_args(task="sft:train", output_path=str(tmp_path / expert), expert=expert, **stage2), echo=quiet)
        run(make_args(task="sft", output_path=str(tmp_path / f"{expert}-unsplit"), expert=expert,
                      **flags(experts_folder, clips)), echo=quiet)
        rows = read_loss_csv(tmp_path / expert / "loss.csv")
        assert [r["loss"] for r in rows] == pytest.approx(
            [r["loss"] for r in read_loss_csv(tmp_path / f"{expert}-unsplit" / "loss.csv")], abs=1e-6, rel=0)
        assert all(low <= r["timestep"] < high for r in rows), rows
        losses[expert] = [r["loss"] for r in rows]
    assert losses["high_noise"] != losses["low_noise"]
    again = run(make_args(task="sft:data_process", output_path=str(cache), expert="low_noise",
                          **flags(experts_folder, clips)), echo=quiet)
    assert again.cache_reused


@pytest.mark.slow
def test_a_low_noise_lora_loads_into_the_two_expert_pipelines_second_transformer(experts_folder, clips, tmp_path):
    """diffusers' WanPipeline takes an expert's LoRA file as it is, `load_into_transformer_2=True` for the low-noise
    one: fused, it changes transformer_2 by exactly the trained delta and leaves transformer as it was."""
    result = run(make_args(task="sft:split", output_path=str(tmp_path / "out"), expert="low_noise", lora_alpha=8.0,
                           **flags(experts_folder, clips)), echo=lambda *_: None)
    saved = load_file(str(result.last_checkpoint))
    pipe = diffusers.WanPipeline.from_pretrained(str(experts_folder))
    before = {name: {k: v.clone() for k, v in getattr(pipe, name).state_dict().items()}
              for name in ("transformer", "transformer_2")}
    pipe.load_lora_weights(str(result.last_checkpoint), load_into_transformer_2=True)
    pipe.fuse_lora(components=["transformer", "transformer_2"])
    high = {k: v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(v, before["transformer"][k.replace(".base_layer", "")]) for k, v in high.items())
    low = {k.replace(".base_layer", ""): v for k, v in pipe.transformer_2.state_dict().items() if "lora_" not in k}
    name = next(k for k in saved if k.endswith("lora_A.weight"))
    module = name[len("transformer."): -len(".lora_A.weight")]
    delta = (saved[name.replace("lora_A", "lora_B")] @ saved[name]) * (8.0 / 4)
    assert torch.allclose(low[f"{module}.weight"] - before["transformer_2"][f"{module}.weight"], delta, atol=1e-6)


def test_a_sample_of_one_expert_renders_through_both_as_the_two_expert_pipeline_does(experts_folder):
    from PIL import Image

    from unitgraph.backends.diffusion.families.wan import render

    pipe = diffusers.WanPipeline.from_pretrained(str(experts_folder))
    pipe.set_progress_bar_config(disable=True)
    emb = pipe.encode_prompt("a cat", do_classifier_free_guidance=False, max_sequence_length=512)[0]
    neg = pipe.encode_prompt("", do_classifier_free_guidance=False, max_sequence_length=512)[0]
    frames = pipe(prompt_embeds=emb, negative_prompt_embeds=neg, width=SIZE, height=SIZE, num_frames=render.FRAMES,
                  num_inference_steps=4, generator=torch.Generator().manual_seed(1),  # both experts at guidance 5
                  output_type="pil").frames[0]
    expected = Image.new("RGB", (SIZE * len(frames), SIZE))
    for i, frame in enumerate(frames):
        expected.paste(frame, (i * SIZE, 0))
    models = {"dit": pipe.transformer_2, "vae": pipe.vae, "scheduler": pipe.scheduler, "boundary_ratio": 0.875,
              "experts": {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}}
    got = render.render(wan.WAN, models, {"prompt_emb": emb}, SIZE, SIZE, 4, torch.Generator().manual_seed(1),
                        negative={"prompt_emb": neg})
    assert got.tobytes() == expected.tobytes()
    alone = render.render(wan.WAN, {**models, "experts": None, "dit": pipe.transformer_2}, {"prompt_emb": emb}, SIZE,
                          SIZE, 4, torch.Generator().manual_seed(1), negative={"prompt_emb": neg})
    assert alone.tobytes() != expected.tobytes()  # the low-noise expert alone draws something else


@pytest.mark.slow
def test_validation_of_an_expert_run_loads_the_other_expert_for_the_render(experts_folder, clips, tmp_path, monkeypatch):
    from unitgraph.backends.diffusion.families.wan import render

    seen = []
    original = render.render

    def spy(pipeline, models, embeds, *args, **kwargs):
        seen.append({sub: (m is models["dit"], float(next(m.parameters()).float().abs().sum()))
                     for sub, m in models["experts"].items()})
        return original(pipeline, models, embeds, *args, **kwargs)

    monkeypatch.setattr(render, "render", spy)
    result = run(make_args(task="sft:split", output_path=str(tmp_path / "out"), expert="low_noise",
                           validation_prompt=["a red circle"], validation_inference_steps=2,
                           **flags(experts_folder, clips)), echo=lambda *_: None)
    assert result.sample_images and all(p.is_file() for p in result.sample_images)
    high = diffusers.WanTransformer3DModel.from_pretrained(str(experts_folder / "transformer"))
    assert seen and seen[0]["transformer_2"][0] and not seen[0]["transformer"][0]  # the trained one is the run's DiT
    assert seen[0]["transformer"][1] == pytest.approx(float(next(high.parameters()).abs().sum()), rel=1e-2)


# --------------------------------------------------------------------------------------------
# DiffSynth's Wan 2.2 A14B LoRA commands (examples/wanvideo/model_training/lora/Wan2.2-T2V-A14B.sh and
# Wan2.2-I2V-A14B.sh)

# each expert's command verbatim but for the program name and the sizes (480x832 -> 32x32, 49 frames -> 5,
# --dataset_repeat 100 -> 1, --num_epochs 5 -> 1)
DIFFSYNTH = {
    "high_noise": """
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.2-T2V-A14B
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.2-T2V-A14B/metadata.csv
  --height 32
  --width 32
  --num_frames 5
  --dataset_repeat 1
  --model_id_with_origin_paths "Wan-AI/Wan2.2-T2V-A14B:high_noise_model/diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.2-T2V-A14B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.2-T2V-A14B:Wan2.1_VAE.pth"
  --learning_rate 1e-4
  --num_epochs 1
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Wan2.2-T2V-A14B_high_noise_lora"
  --lora_base_model "dit"
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2"
  --lora_rank 32
  --max_timestep_boundary 0.417
  --min_timestep_boundary 0
""",
    "low_noise": """
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.2-T2V-A14B
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.2-T2V-A14B/metadata.csv
  --height 32
  --width 32
  --num_frames 5
  --dataset_repeat 1
  --model_id_with_origin_paths "Wan-AI/Wan2.2-T2V-A14B:low_noise_model/diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.2-T2V-A14B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.2-T2V-A14B:Wan2.1_VAE.pth"
  --learning_rate 1e-4
  --num_epochs 1
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Wan2.2-T2V-A14B_low_noise_lora"
  --lora_base_model "dit"
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2"
  --lora_rank 32
  --max_timestep_boundary 1
  --min_timestep_boundary 0.417
""",
}
# DiffSynth's Wan 2.2 I2V A14B LoRA commands (examples/wanvideo/model_training/lora/Wan2.2-I2V-A14B.sh), changed
# as the T2V ones: their experts meet at timestep 900 (0.358 of DiffSynth's schedule), and they name input_image
DIFFSYNTH_I2V = {
    "high_noise": """
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.2-I2V-A14B
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.2-I2V-A14B/metadata.csv
  --height 32
  --width 32
  --num_frames 5
  --dataset_repeat 1
  --model_id_with_origin_paths "Wan-AI/Wan2.2-I2V-A14B:high_noise_model/diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.2-I2V-A14B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.2-I2V-A14B:Wan2.1_VAE.pth"
  --learning_rate 1e-4
  --num_epochs 1
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Wan2.2-I2V-A14B_high_noise_lora"
  --lora_base_model "dit"
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2"
  --lora_rank 32
  --extra_inputs "input_image"
  --max_timestep_boundary 0.358
  --min_timestep_boundary 0
""",
    "low_noise": """
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.2-I2V-A14B
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.2-I2V-A14B/metadata.csv
  --height 32
  --width 32
  --num_frames 5
  --dataset_repeat 1
  --model_id_with_origin_paths "Wan-AI/Wan2.2-I2V-A14B:low_noise_model/diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.2-I2V-A14B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.2-I2V-A14B:Wan2.1_VAE.pth"
  --learning_rate 1e-4
  --num_epochs 1
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Wan2.2-I2V-A14B_low_noise_lora"
  --lora_base_model "dit"
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2"
  --lora_rank 32
  --extra_inputs "input_image"
  --max_timestep_boundary 1
  --min_timestep_boundary 0.358
""",
}
RELEASE_DIT = {"high_noise": "high_noise_model", "low_noise": "low_noise_model"}
DIFFUSERS_DIT = {"high_noise": "transformer", "low_noise": "transformer_2"}
# variant -> (its commands, the pipeline of its tiny two-expert folder, the timestep where its experts meet)
VARIANTS = {"T2V": (DIFFSYNTH, "wan", 875), "I2V": (DIFFSYNTH_I2V, "wan_i2v", 900)}


def diffsynth_workdir(root: Path, experts_folder: Path, variant: str = "T2V") -> Path:
    """Wan-AI/Wan2.2-<variant>-A14B as DiffSynth downloads it (each expert's DiT in Wan's own layout, the text
    encoder and VAE as .pth pickles), the -Diffusers twin beside it (the tiny two-expert folder), the example clips."""
    repo = root / "models" / "Wan-AI" / f"Wan2.2-{variant}-A14B"
    for folder in RELEASE_DIT.values():
        (repo / folder).mkdir(parents=True)
        (repo / folder / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 16, "num_layers": 1}))
        save_file({"patch_embedding.weight": torch.zeros(16, 16, 1, 2, 2)},
                  str(repo / folder / "diffusion_pytorch_model.safetensors"))
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"):
        (repo / name).write_bytes(b"\x80\x04 a pickle: never opened")
    shutil.copytree(experts_folder, root / "models" / "Wan-AI" / f"Wan2.2-{variant}-A14B-Diffusers")
    write_synthetic_dataset(root / "data" / "diffsynth_example_dataset" / "wanvideo" / f"Wan2.2-{variant}-A14B", count=2,
                            size=SIZE, seed=2, videos=["video"], frames=FRAMES)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_diffsynths_expert_commands_name_the_diffusers_folders_then_train_each_expert(experts_folder, tmp_path,
                                                                                        capsys, monkeypatch, variant):
    commands, pipeline, boundary = VARIANTS[variant]
    folder = experts_folder if pipeline == "wan" else \
        tiny.write_tiny_models(tmp_path / "tiny", size="test", seed=0, pipeline=pipeline, experts=True)
    monkeypatch.chdir(diffsynth_workdir(tmp_path, folder, variant))
    monkeypatch.setenv("UNITGRAPH_OFFLINE", "1")
    release = f"Wan-AI/Wan2.2-{variant}-A14B"
    trained = {}
    for expert, command in commands.items():
        code, _, err = cli(capsys, "train", *shlex.split(command))
        line = one_error_line(code, err, "3 model files this command names cannot be read: ",
                              f"{release}:{RELEASE_DIT[expert]}/diffusion_pytorch_model*.safetensors "
                              "(the dit in its release layout")
        suggested = re.search(r'--model_id_with_origin_paths "([^"]+)"', line).group(1)
        assert suggested == ",".join(f"{release}-Diffusers:{sub}/*.safetensors"
                                     for sub in (DIFFUSERS_DIT[expert], "text_encoder", "vae"))
        given = re.search(r'--model_id_with_origin_paths "([^"]+)"', command).group(1)
        code, out, err = cli(capsys, "train", *shlex.split(command.replace(given, suggested)))
        assert code == 0, err
        assert f"pipeline: {pipeline} " in out
        assert f"expert: {expert} ({release}-Diffusers:{DIFFUSERS_DIT[expert]}/*.safetensors;" in out
        out_folder = Path("models") / "train" / f"Wan2.2-{variant}-A14B_{expert}_lora"
        rows = read_loss_csv(out_folder / "loss.csv")
        assert len(rows) == 2 and all((r["timestep"] >= boundary) == (expert == "high_noise") for r in rows)
        trained[expert] = load_file(str(out_folder / "epoch-0.safetensors"))
    assert set(trained["high_noise"]) == set(trained["low_noise"])
    assert any(not torch.equal(trained["high_noise"][k], trained["low_noise"][k]) for k in trained["high_noise"])

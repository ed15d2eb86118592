"""The Stable Diffusion 1.5 family beyond the conformance suite: its units compute what diffusers'
StableDiffusionPipeline computes, its objective is what DiffSynth-Studio's DDIM scheduler and FlowMatchSFTLoss compute,
its default LoRA targets cover what DiffSynth picks for `--lora_target_modules ""`, and DiffSynth's SD 1.5 LoRA
command ports by swapping the program name.

DiffSynth's own code (its DDIM scheduler, loss, UNet, CLIP text encoder and LoRA target search) is read by path from the
wheel the setup unpacks beside the venv (`diffsynth` itself is not importable: its dependencies are not installed).
"""

from __future__ import annotations

import ast
import inspect
import json
import shutil
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from diffsynth_wheel import load_module, wheel_modules  # noqa: E402
from clitools import cli  # noqa: E402
from unitgraph.backends.diffusion import ddpm  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.config import choose_pipeline  # noqa: E402
from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families import sd15  # noqa: E402
from unitgraph.backends.diffusion.families.sd15 import losses, real, render, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import posterior_mean  # noqa: E402
from unitgraph.backends.diffusion.memory_plan import build_meta  # noqa: E402
from unitgraph.backends.diffusion.models.sources import ModelSources  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32
WHEEL = Path(__file__).resolve().parents[1] / ".venv" / "diffsynth-wheel" / "diffsynth"
needs_wheel = pytest.mark.skipif(not (WHEEL / "diffusion" / "ddim_scheduler.py").is_file(),
                                 reason="the diffsynth wheel is not unpacked (scripts/setup.sh does it)")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("sd15") / "models", size="test", seed=0)


@pytest.fixture(scope="module")
def pipe(models):
    return diffusers.StableDiffusionPipeline.from_pretrained(str(models))


def context(pipe, **kwargs) -> UnitContext:
    loaded = {"unet": pipe.unet, "vae": pipe.vae, "text_encoder": pipe.text_encoder, "tokenizer": pipe.tokenizer,
              "scheduler": pipe.scheduler}
    return UnitContext(models=loaded, **kwargs)


# --------------------------------------------------------------------------------------------
# the units against diffusers' pipeline


def test_the_prompt_unit_is_the_pipelines_encode_prompt(pipe):
    ctx = context(pipe)
    prompts = ["a green square on a white background", "a red circle"]
    for prompt in prompts:
        expected, negative = pipe.encode_prompt(prompt, "cpu", 1, False)
        ours = u.prompt_encoder(ctx, {"prompt": prompt})["prompt_embeds"]
        assert negative is None and ours.shape == (1, 77, 32) and torch.equal(ours, expected)
    # the batched form (stage 1's --data_process_batch_size) gives each prompt its own embeddings
    batched = u.prompt_encoder.run_batch(ctx, [{"prompt": p} for p in prompts])
    for prompt, out in zip(prompts, batched):
        assert torch.allclose(out["prompt_embeds"], pipe.encode_prompt(prompt, "cpu", 1, False)[0], atol=1e-6)


def test_the_latent_is_the_vae_posterior_mean_times_the_scaling_factor(pipe):
    ctx = context(pipe, settings=UnitSettings(image_size=ImageSize(SIZE, SIZE)))
    image = Image.new("RGB", (SIZE, SIZE), (200, 40, 40))
    shaped = u.shape_checker(ctx, {"image": image})
    encoded = u.image_encoder(ctx, shaped)
    latents = posterior_mean(ctx, encoded)["input_latents"]
    with torch.no_grad():
        dist = pipe.vae.encode(shaped["image"]).latent_dist
    scale = pipe.vae.config.scaling_factor
    assert scale == 0.18215 and latents.shape == (1, 4, SIZE // 8, SIZE // 8)
    assert torch.equal(latents, dist.mean * scale)
    # the posterior's spread in the same latent space (--vae_latents sample draws from it)
    assert torch.allclose(encoded["latent_logvar"].exp(), dist.var * scale ** 2, rtol=1e-5)


def test_image_sides_are_multiples_of_32_as_diffsynths_sd_dataset_sizes_them(pipe):
    image = Image.new("RGB", (1000, 700))
    for size, expected in ((ImageSize(max_pixels=1 << 20), (1, 3, 672, 992)), (ImageSize(max_pixels=200 * 140), (1, 3, 128, 192)),
                           (ImageSize(height=48, width=80), (1, 3, 48, 80))):  # --height/--width: as given
        ctx = UnitContext(models={}, settings=UnitSettings(image_size=size))
        assert tuple(u.shape_checker(ctx, {"image": image})["image"].shape) == expected


def test_the_losss_unet_call_is_the_pipelines_denoising_step(pipe):
    """The UNet's output inside StableDiffusionPipeline's loop (caught by a hook) equals losses.predict on the same
    latents, timestep and prompt embeddings: the loss calls the UNet as the pipeline does."""
    ctx = context(pipe)
    embeds = pipe.encode_prompt("a dog", "cpu", 1, False)[0]
    noise = torch.randn(1, 4, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(0))
    seen = []
    handle = pipe.unet.register_forward_hook(lambda module, args, kwargs, out: seen.append((args, out)), with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt_embeds=embeds, latents=noise.clone(), height=SIZE, width=SIZE, num_inference_steps=2,
                 guidance_scale=1.0, output_type="latent")
    finally:
        handle.remove()
    assert len(seen) >= 2  # PNDM's PLMS steps call the UNet once more than the steps
    for (sample, timestep), out in seen:
        assert timestep.dtype == torch.long  # the scheduler's integer timestep
        with torch.no_grad():
            ours = losses.predict(ctx, sample, timestep, embeds)
            batched = losses.predict(ctx, sample, timestep.reshape(1), embeds)  # as a batch of timesteps
        assert torch.equal(ours, out[0]) and torch.equal(batched, out[0])


# --------------------------------------------------------------------------------------------
# the objective against DiffSynth's DDIM scheduler and loss



@pytest.fixture(scope="module")
def diffsynth():
    """DiffSynth's ddim_scheduler and loss modules from the wheel's files (loss.py's one package import, the pipeline
    base class it names in an annotation, stood in for)."""
    with wheel_modules("_diffsynth_sd", "ddim_scheduler", "loss") as modules:
        yield modules


# scheduler configs: SD 1.5's, a v-prediction one, linear betas, and zero terminal SNR (a DDIM config's key)
CONFIGS = {
    "sd15": dict(sd15.SCHEDULER_CONFIG),
    "v_prediction": {**sd15.SCHEDULER_CONFIG, "prediction_type": "v_prediction"},
    "linear": {"beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear"},
    "zero_snr_v": {**sd15.SCHEDULER_CONFIG, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True},
}


def _theirs(ddim, config: dict):
    schedule = ddpm.DdpmSchedule.from_config(config)
    scheduler = ddim.DDIMScheduler(num_train_timesteps=schedule.num_train_timesteps, beta_start=schedule.beta_start,
                                   beta_end=schedule.beta_end, beta_schedule=schedule.beta_schedule,
                                   prediction_type=schedule.prediction_type,
                                   rescale_zero_terminal_snr=schedule.rescale_zero_terminal_snr)
    scheduler.set_timesteps(1000, training=True)  # as DiffSynth's training module sets it up
    return schedule, scheduler


class _Scheduler:
    def __init__(self, config: dict):
        self.config = config


def _ctx(config: dict, unet=None, bounds=(0.0, 1.0), key="s0") -> UnitContext:
    models = {"scheduler": _Scheduler(config), **({"unet": unet} if unet is not None else {})}
    return UnitContext(models=models, settings=UnitSettings(timestep_bounds=bounds, seed=5), epoch=0, sample_key=key)


@needs_wheel
@pytest.mark.parametrize("name", CONFIGS)
def test_alphas_noising_and_target_are_diffsynths_ddim_scheduler(diffsynth, name):
    ddim = diffsynth[0]
    schedule, theirs = _theirs(ddim, CONFIGS[name])
    ours = schedule.alphas_cumprod()
    assert torch.equal(ours, torch.tensor(theirs.alphas_cumprod, dtype=torch.float32))
    assert theirs.timesteps.tolist() == list(range(999, -1, -1))  # position k is timestep 999 - k
    ctx = _ctx(CONFIGS[name])
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(1, 4, 4, 4, generator=g), torch.randn(1, 4, 4, 4, generator=g)
    for t in (0, 1, 255, 257, 500, 998, 999):
        timestep = torch.tensor([t])
        assert torch.allclose(ddpm.noisy_latents(ctx, x0, noise, timestep), theirs.add_noise(x0, noise, timestep),
                              atol=1e-6, rtol=0), (name, t)
        assert torch.allclose(ddpm.training_target(ctx, x0, noise, timestep), theirs.training_target(x0, noise, timestep),
                              atol=1e-6, rtol=0), (name, t)
        assert theirs.training_weight(timestep) == 1.0
    if name == "zero_snr_v":
        assert float(ours[-1]) == 0.0  # the last timestep is pure noise: v is -x0 there
        assert torch.equal(ddpm.training_target(ctx, x0, noise, torch.tensor([999])), -x0)


def test_the_timestep_sampler_draws_integer_timesteps_within_the_bounds():
    config = sd15.SCHEDULER_CONFIG
    drawn = [u.timestep_sampler(_ctx(config, key=f"s{k}"), {}) for k in range(40)]
    assert all(d["loss_weight"] is None and d["timestep"].dtype == torch.long and d["timestep"].shape == (1,)
               for d in drawn)
    assert len({int(d["timestep"]) for d in drawn}) > 30 and all(0 <= int(d["timestep"]) <= 999 for d in drawn)
    # --min/max_timestep_boundary 0.25/0.5 (fractions of the positions from the noisiest): timesteps 749 down to 500
    bounded = [int(u.timestep_sampler(_ctx(config, bounds=(0.25, 0.5), key=f"b{k}"), {})["timestep"]) for k in range(60)]
    assert min(bounded) >= 500 and max(bounded) <= 749 and len(set(bounded)) > 40


class _Pipe:
    """What FlowMatchSFTLoss reads of a pipeline: its scheduler, dtype and device, the UNet and DiffSynth's SD model_fn
    (model_fn_stable_diffusion's call: latents, timestep, encoder_hidden_states)."""

    in_iteration_models = ("unet",)

    def __init__(self, scheduler, unet):
        self.scheduler, self.unet = scheduler, unet
        self.torch_dtype, self.device = torch.float32, "cpu"  # DiffSynth trains SD 1.5 in fp32

    @staticmethod
    def model_fn(unet, latents=None, timestep=None, prompt_embeds=None, **_):
        return unet(latents, timestep, encoder_hidden_states=prompt_embeds, return_dict=False)[0]


@needs_wheel
@pytest.mark.parametrize("name", ["sd15", "v_prediction"])
def test_the_loss_is_diffsynths_flow_match_sft_loss_around_the_same_unet(diffsynth, pipe, name):
    """DiffSynth's FlowMatchSFTLoss on its DDIM scheduler (its draws from torch's global generator) and our sink, given
    the same draws, the same UNet and prompt embeddings, give the same loss."""
    schedule, theirs = _theirs(diffsynth[0], CONFIGS[name])
    x0 = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    embeds = pipe.encode_prompt("a cat", "cpu", 1, False)[0]
    ctx = _ctx(CONFIGS[name], unet=pipe.unet)
    for seed in range(4):
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = diffsynth[1].FlowMatchSFTLoss(_Pipe(theirs, pipe.unet), input_latents=x0.clone(),
                                                     prompt_embeds=embeds)
        torch.manual_seed(seed)  # the same draws, in DiffSynth's order: the position, then the noise
        position = int(torch.randint(0, 1000, (1,)))
        noise = torch.randn_like(x0)
        inputs = {"input_latents": x0, "noise": noise, "timestep": torch.tensor([999 - position]), "loss_weight": None,
                  "prompt_embeds": embeds}
        with torch.no_grad():
            ours = losses.ddpm_loss(ctx, inputs)
        assert float(ours) == pytest.approx(float(expected), rel=1e-5), (name, seed)


def test_a_scheduler_folder_of_another_sampler_keeps_its_objective(tmp_path):
    """The scheduler slot loads as SD 1.5's PNDM class; a DDIM folder's prediction type and zero-terminal-SNR flag (a key
    PNDM does not take) still reach the objective, through the config diffusers keeps for compatible classes."""
    folder = tmp_path / "scheduler"
    diffusers.DDIMScheduler.from_config({**sd15.SCHEDULER_CONFIG, "prediction_type": "v_prediction",
                                         "rescale_betas_zero_snr": True}).save_pretrained(str(folder))
    loaded = ModelSources(sd15.SLOTS, [str(folder)]).load(["scheduler"])["scheduler"]
    schedule = ddpm.DdpmSchedule.from_config(loaded.config)
    assert schedule.prediction_type == "v_prediction" and schedule.rescale_zero_terminal_snr
    # without a folder: SD 1.5's published config
    default = ddpm.DdpmSchedule.from_config(diffusers.PNDMScheduler(**sd15.SCHEDULER_CONFIG).config)
    assert default == ddpm.DdpmSchedule()


# --------------------------------------------------------------------------------------------
# DiffSynth's module names and its LoRA target search


def _auto_detect():
    """DiffSynth's DiffusionTrainingModule.auto_detect_lora_target_modules, taken from training_module.py's source (the
    module itself imports DiffSynth's whole package)."""
    tree = ast.parse((WHEEL / "diffusion" / "training_module.py").read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "auto_detect_lora_target_modules")
    namespace = {"torch": torch}
    exec(compile(ast.Module([node], []), "training_module.py", "exec"), namespace)
    function = namespace["auto_detect_lora_target_modules"]
    holder = types.SimpleNamespace()
    holder.auto_detect_lora_target_modules = lambda *a, **k: function(holder, *a, **k)
    return holder.auto_detect_lora_target_modules


def _matched(names, targets) -> list[str]:
    """The module names peft's target list reaches (a name equal to a target or ending in "." + target)."""
    return [n for n in names if any(n == t or n.endswith("." + t) for t in targets)]


def _linear_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


@needs_wheel
def test_diffsynths_unet_names_its_modules_as_diffusers_and_the_default_targets_cover_its_search():
    dsunet = load_module("_diffsynth_sd_unet", WHEEL / "models" / "stable_diffusion_unet.py")
    accepted = inspect.signature(dsunet.UNet2DConditionModel).parameters
    with torch.device("meta"):
        theirs = dsunet.UNet2DConditionModel(**{k: v for k, v in real.UNET.items() if k in accepted})
        ours = diffusers.UNet2DConditionModel.from_config(real.UNET)
    assert sorted(_linear_names(theirs)) == sorted(_linear_names(ours))  # no name to map: lora_aliases stays empty
    assert not sd15.FAMILY.slot("unet").lora_aliases
    picked = _auto_detect()(theirs)  # what `--lora_target_modules ""` trains in DiffSynth
    default = _matched(_linear_names(ours), sd15.UNET_LORA_TARGETS)
    assert len(picked) == 121 and len(default) == 182 and set(picked) <= set(default)
    extra = set(default) - set(picked)  # the 320-wide outer blocks, and the middle block's q/k/v
    assert all(n.startswith(("down_blocks.0.", "up_blocks.3.")) or
               (n.startswith("mid_block.") and n.rsplit(".", 1)[1] in ("to_q", "to_k", "to_v")) for n in extra)
    # every default target names modules of the tiny test UNet, so the same default trains it
    unet = diffusers.UNet2DConditionModel(**tiny.SIZES["test"]["unet"])
    for target in sd15.UNET_LORA_TARGETS:
        assert _matched(_linear_names(unet), [target]), target


@needs_wheel
def test_the_text_encoder_default_is_diffsynths_search_exactly():
    dsclip = load_module("_diffsynth_sd_clip", WHEEL / "models" / "stable_diffusion_text_encoder.py")
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        theirs = dsclip.SDTextEncoder()
        ours = CLIPTextModel(CLIPTextConfig(**{k: v for k, v in real.CLIP.items() if not k.startswith("_")}))
    # DiffSynth's modules sit under model.text_model., transformers' at the top: the suffixes peft matches agree
    picked = [n.removeprefix("model.text_model.") for n in _auto_detect()(theirs)]
    linear = [n for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(picked) == sorted(_matched(linear, sd15.TEXT_LORA_TARGETS)) and len(picked) == 72


# --------------------------------------------------------------------------------------------
# model ids, released configs, rendering


@pytest.mark.parametrize("model_id", ["AI-ModelScope/stable-diffusion-v1-5", "runwayml/stable-diffusion-v1-5",
                                      "stable-diffusion-v1-5/stable-diffusion-v1-5"])
def test_the_model_ids_choose_the_pipeline(model_id):
    ids = ",".join(f"{model_id}:{sub}" for sub in ("text_encoder/model.safetensors",
                                                    "unet/diffusion_pytorch_model.safetensors",
                                                    "vae/diffusion_pytorch_model.safetensors"))
    family, pipeline = choose_pipeline(make_args(model_id_with_origin_paths=ids, lora_base_model="unet"))
    assert family is sd15.FAMILY and pipeline is sd15.SD15


def test_the_released_configs_build_to_the_published_sizes(capsys, tmp_path):
    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", "sd15", "--size", "real")
    assert code == 0, err
    assert "no weights" in out and not list((tmp_path / "real").rglob("*.safetensors"))
    sources = ModelSources(sd15.SLOTS, str(tmp_path / "real"), offline=True)
    for slot, published in {"unet": 859.52e6, "text_encoder": 123.06e6, "vae": 83.65e6}.items():
        model = build_meta(sd15.FAMILY.slot(slot), sources.load_config(slot), "bfloat16")
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - published) < 0.001 * published, (slot, count)
    scheduler = sources.load(["scheduler"])["scheduler"]
    assert type(scheduler).__name__ == "PNDMScheduler" and ddpm.DdpmSchedule.from_config(scheduler.config) == ddpm.DdpmSchedule()


def test_the_dry_run_plans_the_unet_lora_from_configs(models, capsys):
    code, out, err = cli(capsys, "train", "--model_paths", str(models), "--lora_base_model", "unet", "--max_pixels",
                         str(SIZE * SIZE), "--dataset_base_path", str(models), "--dry_run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["settings"]["size"]["latent"] == [4, SIZE // 8, SIZE // 8] and plan["settings"]["size"]["text_tokens"] == 77
    assert set(plan["stages"]["train"]["models"]) == {"unet"}
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder", "vae"}
    assert plan["stages"]["train"]["models"]["unet"]["trainable_params"] > 0 and plan["stages"]["train"]["activation_bytes"] > 0


def test_a_validation_sample_renders_from_the_prompt_embeddings_alone(pipe):
    """What the pipeline draws from the text, at its default guidance (7.5) against the empty prompt."""
    ctx = context(pipe)
    embeds = u.prompt_encoder(ctx, {"prompt": "a red circle"})
    negative = u.prompt_encoder(ctx, {"prompt": ""})
    models = {"unet": pipe.unet, "vae": pipe.vae, "scheduler": pipe.scheduler}
    got = render.render(sd15.SD15, models, embeds, SIZE, SIZE, 2, torch.Generator().manual_seed(0), negative=negative)
    expected = pipe(prompt="a red circle", width=SIZE, height=SIZE, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0)).images[0]
    assert got.size == (SIZE, SIZE) and got.tobytes() == expected.tobytes()


# --------------------------------------------------------------------------------------------
# DiffSynth's SD 1.5 LoRA command

# examples/stable_diffusion/model_training/lora/stable-diffusion-v1-5.sh; --height/--width 512 lowered to 64,
# --dataset_repeat 50 to 1, --num_epochs 5 to 2
COMMAND = """
  --dataset_base_path data/diffsynth_example_dataset/stable_diffusion/stable-diffusion-v1-5
  --dataset_metadata_path data/diffsynth_example_dataset/stable_diffusion/stable-diffusion-v1-5/metadata.csv
  --height 64
  --width 64
  --dataset_repeat 1
  --model_id_with_origin_paths "AI-ModelScope/stable-diffusion-v1-5:text_encoder/model.safetensors,AI-ModelScope/stable-diffusion-v1-5:unet/diffusion_pytorch_model.safetensors,AI-ModelScope/stable-diffusion-v1-5:vae/diffusion_pytorch_model.safetensors"
  --learning_rate 1e-4
  --num_epochs 2
  --remove_prefix_in_ckpt "pipe.unet."
  --output_path "./models/train/stable-diffusion-v1-5_lora"
  --lora_base_model "unet"
  --lora_target_modules ""
  --lora_rank 32
  --use_gradient_checkpointing
"""


@pytest.mark.slow
def test_diffsynths_sd15_lora_command_ports_by_swapping_the_program_name(models, tmp_path, capsys, user_shell):
    """The tiny models where DiffSynth downloads AI-ModelScope/stable-diffusion-v1-5 (./models/<org>/<name>), the
    example data where its dataset goes; the command as DiffSynth's example gives it, but for the program name and the
    sizes. The empty --lora_target_modules trains the family's defaults; the LoRA loads in diffusers' pipeline, and in
    DiffSynth's layout its own loader (validate_lora's pipe.load_lora(pipe.unet, ...)) fuses the same change."""
    shutil.copytree(models, tmp_path / "models" / "AI-ModelScope" / "stable-diffusion-v1-5")
    write_synthetic_dataset(tmp_path / "data" / "diffsynth_example_dataset" / "stable_diffusion" / "stable-diffusion-v1-5",
                            count=2, size=80, seed=1)
    done = user_shell.train(tmp_path, COMMAND)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: sd15 (the model id AI-ModelScope/stable-diffusion-v1-5)" in done.stdout.splitlines()
    out = tmp_path / "models" / "train" / "stable-diffusion-v1-5_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == ["epoch-0.safetensors", "epoch-1.safetensors"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["pipeline"] == "sd15" and plan["train"]["models"] == ["unet"]
    assert set(plan["data_process"]["models"]) == {"text_encoder", "vae"}
    saved = load_file(str(out / "epoch-1.safetensors"))
    modules = {k.split(".lora_")[0] for k in saved}
    assert all(k.startswith("unet.") for k in saved)
    for target in sd15.UNET_LORA_TARGETS:  # "" trained every default target
        assert any(m.endswith("." + target) for m in modules), target
    assert {k: v.shape for k, v in saved.items() if "lora_A" in k}.popitem()[1][0] == 32  # --lora_rank 32
    rows = (out / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,epoch,loss,timestep,elapsed_s" and len(rows) == 5
    assert all(float(r.split(",")[3]).is_integer() for r in rows[1:])  # DDPM timesteps are integers
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(models))
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    pipe.load_lora_weights(str(out / "epoch-1.safetensors"))
    pipe.fuse_lora()
    fused = {k.replace(".base_layer", ""): v for k, v in pipe.unet.state_dict().items() if "lora_" not in k}
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    assert not torch.equal(fused[name], before[name])
    # DiffSynth's layout, written by `unitgraph lora convert`, fused by DiffSynth's own loader: the same weights
    code, _, err = cli(capsys, "lora", "convert", str(out / "epoch-1.safetensors"), str(tmp_path / "ds.safetensors"),
                       "--to", "diffsynth", "--pipeline", "sd15", "--model", "unet", "--remove_prefix_in_ckpt", "pipe.unet.")
    assert code == 0, err
    if (WHEEL / "utils" / "lora" / "general.py").is_file():
        general = load_module("_diffsynth_sd_lora", WHEEL / "utils" / "lora" / "general.py")
        unet = diffusers.UNet2DConditionModel.from_pretrained(str(models), subfolder="unet")
        general.GeneralLoRALoader().fuse_lora_to_base_model(unet, load_file(str(tmp_path / "ds.safetensors")))
        theirs = unet.state_dict()
        changed = [k for k in theirs if not torch.equal(theirs[k], before[k])]
        assert len(changed) == len(modules) and all(torch.allclose(theirs[k], fused[k], atol=1e-6) for k in theirs)


@pytest.mark.slow
def test_the_demo_runs(tmp_path, capsys):
    code, out, err = cli(capsys, "demo", "--pipeline", "sd15", "--size", "test", "--images", "4", "--resolution", "32",
                         "--num_epochs", "1", "--compare_steps", "0", "--output_path", str(tmp_path / "demo"))
    assert code == 0, err
    assert "stage 2: train (4 steps)" in out and (tmp_path / "demo" / "train" / "epoch-0.safetensors").is_file()


@pytest.mark.slow
def test_an_fp8_unet_trains_split_as_unsplit_through_its_stored_convolutions(models, tmp_path):
    """The UNet's convolutions pass the LoRA's gradient back through fp8 weights (precision._StoredConv): the split run
    equals the unsplit one, and the numbers differ from a bf16 UNet's."""
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=SIZE, seed=1)

    def train(name: str, task: str, **extra) -> list:
        run(make_args(task=task, output_path=str(tmp_path / name), model_paths=str(models), dataset_base_path=str(data),
                      dataset_metadata_path=str(data / "metadata.csv"), lora_base_model="unet", lora_rank=4,
                      max_pixels=SIZE * SIZE, num_epochs=1, learning_rate=1e-3, **extra), echo=lambda _: None)
        (csv,) = (tmp_path / name).rglob("loss.csv")
        return [row["loss"] for row in read_loss_csv(csv)]

    fp8 = train("unsplit", "sft", fp8_models="unet,vae")
    assert len(fp8) == 2 and train("split", "sft:split", fp8_models="unet,vae") == pytest.approx(fp8, abs=1e-6, rel=0)
    assert train("bf16", "sft") != pytest.approx(fp8, abs=1e-6, rel=0)

"""The Z-Image family beyond the conformance suite: its units compute what diffusers' ZImagePipeline computes, its loss
is DiffSynth-Studio's flow-matching objective with its "Z-Image" template (the DiT told 1 - sigma, its output negated),
its default LoRA targets are DiffSynth's example's modules, and DiffSynth's Z-Image LoRA command runs verbatim but for
the program name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from diffsynth_wheel import wheel_modules  # noqa: E402
from clitools import cli  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.choice import choose  # noqa: E402
from unitgraph.backends.diffusion.context import UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.families import z_image  # noqa: E402
from unitgraph.backends.diffusion.families.z_image import losses, omni, real, render, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import latent_sampler, posterior_mean  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from shallow import shallow  # noqa: E402

SIZE = 32
REPO = Path(__file__).resolve().parents[1]
WHEEL = REPO / ".venv" / "diffsynth-wheel" / "diffsynth"
needs_wheel = pytest.mark.skipif(not (WHEEL / "diffusion" / "flow_match.py").is_file(),
                                 reason="the diffsynth wheel is not unpacked")
BASE_REPO = Path("models") / "Tongyi-MAI" / "Z-Image"
TURBO_REPO = Path("models") / "Tongyi-MAI" / "Z-Image-Turbo"
DATA = Path("data") / "diffsynth_example_dataset" / "z_image" / "Z-Image"

# examples/z_image/model_training/lora/Z-Image.sh, the training command verbatim but for the program name
# (`accelerate launch examples/z_image/model_training/train.py` -> `unitgraph train`) and the sizes: --max_pixels
# 1048576 lowered to 1024 (32 x 32), --dataset_repeat 50 to 1, --num_epochs 5 to 2.
DIFFSYNTH_COMMAND = r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/z_image/Z-Image \
  --dataset_metadata_path data/diffsynth_example_dataset/z_image/Z-Image/metadata.csv \
  --max_pixels 1024 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "Tongyi-MAI/Z-Image:transformer/*.safetensors,Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Z-Image_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,w1,w2,w3" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8
"""
DIFFSYNTH_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3")

# examples/z_image/model_training/lora/Z-Image-Omni-Base.sh, its text-to-image command and its image(s)-to-image command
# (commented out there), verbatim but for the program name and the sizes: --max_pixels 1048576 lowered to 4096 (64 x 64:
# diffusers' omni pipeline takes edit images of 64 px and more), --dataset_repeat 50 to 1, --num_epochs 5 to 2.
OMNI_REPO = Path("models") / "Tongyi-MAI" / "Z-Image-Omni-Base"
OMNI_DATA = Path("data") / "diffsynth_example_dataset" / "z_image" / "Z-Image-Omni-Base"
DIFFSYNTH_OMNI_T2I_COMMAND = r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/z_image/Z-Image-Omni-Base \
  --dataset_metadata_path data/diffsynth_example_dataset/z_image/Z-Image-Omni-Base/metadata.csv \
  --max_pixels 4096 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "Tongyi-MAI/Z-Image-Omni-Base:transformer/*.safetensors,Tongyi-MAI/Z-Image-Omni-Base:siglip/model.safetensors,Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Z-Image-Omni-Base_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,w1,w2,w3" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --find_unused_parameters \
  --dataset_num_workers 8
"""
DIFFSYNTH_OMNI_COMMAND = r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/z_image/Z-Image-Omni-Base \
  --dataset_metadata_path data/diffsynth_example_dataset/z_image/Z-Image-Omni-Base/metadata.csv \
  --data_file_keys "image,edit_image" \
  --extra_inputs "edit_image" \
  --max_pixels 4096 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "Tongyi-MAI/Z-Image-Omni-Base:transformer/*.safetensors,Tongyi-MAI/Z-Image-Omni-Base:siglip/model.safetensors,Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Z-Image-Omni-Base_lora_edit" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,w1,w2,w3" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --find_unused_parameters \
  --dataset_num_workers 8
"""


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("z_image") / "models", size="test", seed=0)


@pytest.fixture(scope="module")
def pipe(models):
    pipe = diffusers.ZImagePipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("z_image-data")
    write_synthetic_dataset(folder, count=3, size=SIZE, seed=1)
    return folder


def context(pipe, **settings) -> UnitContext:
    loaded = {"dit": pipe.transformer, "vae_encoder": pipe.vae, "text_encoder": pipe.text_encoder,
              "tokenizer": pipe.tokenizer, "scheduler": pipe.scheduler}
    return UnitContext(models=loaded, settings=UnitSettings(**settings))


# ------------------------------------------------------------------------------------------------
# the plans


def test_the_plans_keep_what_does_not_train_in_stage_1():
    import unitgraph

    pipeline = z_image.Z_IMAGE.spec_pipeline
    lora = unitgraph.split(pipeline, lora_base_model="dit")
    assert lora.data_process_models == ["text_encoder", "vae_encoder"] and lora.train_models == ["dit"]
    assert set(lora.train_units) == {"NoiseInitializer", "TimestepSampler"}
    assert {p for p, _ in lora.cache_entries} == {"input_latents", "prompt_emb", "prompt_emb_mask"}
    text = unitgraph.split(pipeline, lora_base_model="text_encoder")
    assert "PromptEncoder" in text.train_units and text.data_process_models == ["vae_encoder"]
    assert set(text.train_models) == {"dit", "text_encoder"}
    for plan in (lora, text):
        assert unitgraph.verify(pipeline, plan) == []


# ------------------------------------------------------------------------------------------------
# the units against diffusers' ZImagePipeline


def test_the_tiny_chat_template_renders_qwen3s_turn():
    """One user turn and the generation prompt as Qwen3's template renders them; the units ask for thinking enabled
    (no think block), as diffusers and DiffSynth do; disabled, Qwen3 adds an empty think block."""
    tokenizer = tiny.build_tiny_tokenizer()
    assert u.chat_text(tokenizer, "a dog") == "<|im_start|>user\na dog<|im_end|>\n<|im_start|>assistant\n"
    off = tokenizer.apply_chat_template([{"role": "user", "content": "a dog"}], tokenize=False,
                                        add_generation_prompt=True, enable_thinking=False)
    assert off == "<|im_start|>user\na dog<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    tokenizer.chat_template = None
    with pytest.raises(BackendError, match="no chat template"):
        u.chat_text(tokenizer, "a dog")


def test_prompt_units_match_the_pipelines_encode_prompt(pipe):
    ctx = context(pipe)
    prompts = ["a green square on a white background", "a dog"]
    theirs, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False)
    for prompt, expected in zip(prompts, theirs):
        ours = u.prompt_encoder(ctx, {"prompt": prompt})
        assert torch.equal(ours["prompt_emb"][0], expected)
        assert torch.equal(ours["prompt_emb_mask"], torch.ones(1, expected.shape[0], dtype=torch.long))
    # variable length: the template's 8 tokens around each prompt's own, all that the mask keeps
    assert theirs[0].shape[0] > theirs[1].shape[0] == 8 + 2
    # the second-to-last hidden states, not the last
    ids = pipe.tokenizer(u.chat_text(pipe.tokenizer, "a dog"), return_tensors="pt").input_ids
    hidden = pipe.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.allclose(theirs[1], hidden[-2][0], atol=1e-6) and not torch.allclose(theirs[1], hidden[-1][0])
    # the batched form (stage 1's --data_process_batch_size) gives each prompt its own embedding
    batched = u.prompt_encoder.run_batch(ctx, [{"prompt": p} for p in prompts])
    for out, expected in zip(batched, theirs):
        assert torch.allclose(out["prompt_emb"][0], expected, atol=1e-6)


def test_the_latents_are_the_vae_posterior_shifted_and_scaled(pipe, monkeypatch):
    """Our latent is what ZImageImg2ImgPipeline encodes an image to (its prepare_latents, with the noising step left
    out), and what ZImagePipeline's decode undoes; DiffSynth trains on the posterior mean."""
    ctx = dataclasses.replace(context(pipe), epoch=0, sample_key="s")
    pixels = torch.rand(1, 3, SIZE, SIZE) * 2 - 1
    out = u.image_encoder(ctx, {"image": pixels})
    config = pipe.vae.config
    assert (config.scaling_factor, config.shift_factor) == (0.3611, 0.1159)
    posterior = pipe.vae.encode(pixels).latent_dist
    assert torch.equal(out["latent_mean"], (posterior.mean - config.shift_factor) * config.scaling_factor)
    assert torch.equal(posterior_mean(ctx, out)["input_latents"], out["latent_mean"])
    img2img = diffusers.ZImageImg2ImgPipeline(**pipe.components)
    monkeypatch.setattr(img2img.scheduler, "scale_noise", lambda sample, timestep, noise: sample)
    drawn = latent_sampler(ctx, out)["input_latents"]
    theirs = img2img.prepare_latents(pixels, torch.tensor([500.0]), 1, 16, SIZE, SIZE, torch.float32, "cpu",
                                     ctx.rng("latent"))
    assert torch.allclose(drawn, theirs, atol=1e-6) and not torch.allclose(drawn, out["latent_mean"])


def test_shapes_are_multiples_of_16(pipe):
    from PIL import Image

    from unitgraph.backends.diffusion.context import ImageSize

    ctx = context(pipe, image_size=ImageSize(max_pixels=100 * 60))
    shaped = u.shape_checker(ctx, {"image": Image.new("RGB", (100, 60))})
    assert shaped["image"].shape == (1, 3, 48, 96) and (shaped["height"], shaped["width"]) == (48, 96)
    with pytest.raises(BackendError, match="no image"):
        u.shape_checker(ctx, {"image": None})


def test_the_losss_dit_call_is_the_pipelines_denoising_step(pipe):
    """The DiT call the pipeline makes in a denoising step (captured), made again by the loss's predict() from our
    units' embeddings at the scheduler's timestep: the same call (t = (1000 - timestep) / 1000), the same negated
    output."""
    ctx = context(pipe)
    prompt = "a dog"
    embeds, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False)
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append((args, out[0])),
                                                  with_kwargs=True)
    try:
        latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            pipe(prompt_embeds=embeds, latents=latents, height=SIZE, width=SIZE, num_inference_steps=2,
                 guidance_scale=0.0, output_type="latent")
    finally:
        hook.remove()
    (x, t, captions), out = calls[0][0][:3], calls[0][1]
    timestep = pipe.scheduler.timesteps[:1]
    assert float(t) == pytest.approx(1 - float(timestep) / 1000) and float(t) < 0.5  # the clean end is t = 1
    ours = u.prompt_encoder(ctx, {"prompt": prompt})
    assert torch.equal(ours["prompt_emb"][0], captions[0])
    with torch.no_grad():
        pred = losses.predict(ctx, x[0][:, 0][None], timestep, ours["prompt_emb"], ours["prompt_emb_mask"])
    assert torch.equal(pred, -torch.stack([o.float() for o in out]).squeeze(2))


def test_a_batch_of_prompts_of_different_lengths_predicts_each_alone(pipe):
    """The family pads prompt_emb in a batch (family.pad); the loss cuts each back to its mask's tokens."""
    ctx = context(pipe)
    one, two = (u.prompt_encoder(ctx, {"prompt": p}) for p in ("a green square on a white background", "a dog"))
    length = one["prompt_emb"].shape[1]
    pad = length - two["prompt_emb"].shape[1]
    emb = torch.cat([one["prompt_emb"], torch.nn.functional.pad(two["prompt_emb"], (0, 0, 0, pad), value=7.0)])
    mask = torch.cat([one["prompt_emb_mask"], torch.nn.functional.pad(two["prompt_emb_mask"], (0, pad))])
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    timestep = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        both = losses.predict(ctx, latents, timestep, emb, mask)
        alone = [losses.predict(ctx, latents[k:k + 1], timestep[k:k + 1], e, m)
                 for k, (e, m) in enumerate(((one["prompt_emb"], one["prompt_emb_mask"]),
                                             (two["prompt_emb"], two["prompt_emb_mask"])))]
    assert torch.allclose(both, torch.cat(alone), atol=1e-5)


def test_render_draws_what_the_pipeline_draws(pipe):
    ctx = context(pipe)
    embeds = u.prompt_encoder(ctx, {"prompt": "a cat"})
    models = {"dit": pipe.transformer, "vae_encoder": pipe.vae, "scheduler": pipe.scheduler}
    negative = u.prompt_encoder(ctx, {"prompt": ""})  # its guidance is against the empty prompt
    got = render.render(z_image.Z_IMAGE, models, embeds, SIZE, SIZE, 2, torch.Generator().manual_seed(1),
                        negative=negative)
    expected = pipe(prompt="a cat", width=SIZE, height=SIZE, num_inference_steps=2,  # its default guidance, 5
                    generator=torch.Generator().manual_seed(1)).images[0]
    assert got.size == (SIZE, SIZE) and got.tobytes() == expected.tobytes()


# ------------------------------------------------------------------------------------------------
# the objective against DiffSynth-Studio's own code



@pytest.fixture(scope="module")
def diffsynth():
    """DiffSynth's flow_match and loss modules, loaded from the wheel's files (loss.py's one package import stood in for)."""
    with wheel_modules("_z_image_diffsynth", "flow_match", "loss") as modules:
        yield modules


def _scheduler(flow_match):
    scheduler = flow_match.FlowMatchScheduler("Z-Image")
    scheduler.set_timesteps(1000, training=True)  # as DiffSynth's training module sets it up (shift None -> 3)
    return scheduler


@needs_wheel
def test_the_training_schedule_and_weight_are_diffsynths_z_image_template(diffsynth):
    theirs = _scheduler(diffsynth[0])
    schedule = u.TRAINING_SCHEDULE
    assert torch.allclose(schedule.sigmas(), theirs.sigmas.float(), atol=1e-6, rtol=0)
    assert torch.allclose(schedule.weights(), theirs.linear_timesteps_weights.float(), atol=1e-5, rtol=1e-5)
    assert float(schedule.sigmas()[0]) == 1.0 and float(schedule.sigmas()[-1]) == pytest.approx(3e-3 / 1.002, rel=1e-4)


def test_the_timestep_sampler_draws_a_position_of_the_schedule_and_its_weight():
    sigmas, weights = u.TRAINING_SCHEDULE.sigmas(), u.TRAINING_SCHEDULE.weights()
    for k in range(10):
        ctx = UnitContext(models={}, settings=UnitSettings(timestep_bounds=(0.0, 0.25), seed=5), epoch=0,
                          sample_key=f"s{k}")
        out = u.timestep_sampler(ctx, {})
        index = int(torch.argmin((sigmas * 1000 - out["timestep"]).abs()))
        assert index < 250 and float(out["loss_weight"]) == float(weights[index])


def _model_fn(dit, latents=None, timestep=None, prompt_embeds=None, **kwargs):
    """DiffSynth's model_fn_z_image around diffusers' DiT (its own DiT has diffusers' modules): the DiT told
    (1000 - timestep) / 1000, its output negated (the wheel's source says so, checked below)."""
    out = dit([latents.unsqueeze(2)[0]], (1000 - timestep) / 1000, [prompt_embeds], return_dict=False)[0]
    return -torch.stack(list(out)).squeeze(2)


@needs_wheel
def test_diffsynths_model_fn_tells_the_dit_1_minus_sigma_and_negates_it():
    source = (WHEEL / "pipelines" / "z_image.py").read_text(encoding="utf-8")
    assert "timestep = (1000 - timestep) / 1000" in source and "model_output = -model_output" in source
    assert "timestep = 1000 - timestep" in source and "x = -x" in source  # the text-to-image DiT's own path
    converter = (WHEEL / "utils" / "state_dict_converters" / "z_image_dit.py")
    if converter.is_file():  # its DiT reads diffusers' state dict, renaming nothing but a foreign prefix
        assert "replace(\"model.diffusion_model.\", \"\")" in converter.read_text(encoding="utf-8")


@needs_wheel
@pytest.mark.parametrize("position", [0, 371, 999])
def test_the_loss_is_diffsynths_flow_match_sft_loss(pipe, diffsynth, position, monkeypatch):
    """Given the timestep and noise DiffSynth's loss draws, our loss is the value of its FlowMatchSFTLoss with its
    Z-Image template around the same DiT, training weight included."""
    flow_match, loss = diffsynth
    scheduler = _scheduler(flow_match)
    ctx = context(pipe, loss_weighting="diffsynth")
    state = u.prompt_encoder(ctx, {"prompt": "a red circle"})
    x0 = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(2))
    noise = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    theirs_pipe = types.SimpleNamespace(scheduler=scheduler, torch_dtype=torch.float32, device="cpu",
                                        in_iteration_models=("dit",), dit=pipe.transformer, model_fn=_model_fn)
    monkeypatch.setattr(loss.torch, "randint", lambda *a, **k: torch.tensor([position]))
    monkeypatch.setattr(loss.torch, "randn_like", lambda like: noise.clone())
    with torch.no_grad():
        theirs = loss.FlowMatchSFTLoss(theirs_pipe, input_latents=x0, prompt_embeds=state["prompt_emb"][0])
    monkeypatch.undo()
    timestep = scheduler.timesteps[position:position + 1].float()
    weight = u.TRAINING_SCHEDULE.weights()[position:position + 1]
    with torch.no_grad():
        ours = losses.flow_matching_loss(ctx, {"input_latents": x0, "noise": noise, "timestep": timestep,
                                               "loss_weight": weight, **state})
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------------------
# LoRA targets, model ids, released configs


def test_the_default_dit_targets_are_diffsynths_example_modules():
    """Its Z-Image LoRA examples' suffixes, which reach every attention projection and feed-forward matrix of the
    released DiT's main layers and both refiners, and nothing else; no aliases (its DiT has diffusers' names)."""
    from accelerate import init_empty_weights

    config = {k: v for k, v in real.TRANSFORMER.items() if not k.startswith("_")}
    with init_empty_weights():
        dit = diffusers.ZImageTransformer2DModel.from_config(config)
    slot = z_image.FAMILY.slot("dit")
    assert slot.lora_targets == DIFFSYNTH_TARGETS and slot.lora_modules(DIFFSYNTH_TARGETS) == DIFFSYNTH_TARGETS
    reached = [n for n, _ in dit.named_modules() if any(n.endswith("." + s) for s in DIFFSYNTH_TARGETS)]
    blocks = 30 + 2 + 2  # layers, noise_refiner, context_refiner
    assert len(reached) == 7 * blocks
    assert all(isinstance(dict(dit.named_modules())[n], torch.nn.Linear) for n in reached)


@pytest.mark.parametrize("model_id", [z_image.BASE_MODEL, z_image.TURBO_MODEL])
def test_the_model_ids_choose_z_image(model_id):
    ids = ",".join(f"{model_id}:{p}" for p in ("transformer/*.safetensors", "text_encoder/*.safetensors",
                                               "vae/diffusion_pytorch_model.safetensors"))
    chosen = choose(make_args(model_id_with_origin_paths=ids, lora_base_model="dit"))
    assert chosen.line == f"pipeline: z_image (the model id {model_id})"


def test_the_released_configs_build_to_the_published_sizes(capsys, tmp_path):
    """Published: the DiT "6B" (Z-Image's model card; 6.15 B counted), Qwen3-4B "4.0B" (its model card; the base
    model without the tied LM head), FLUX.1's VAE 83.8 M."""
    from unitgraph.backends.diffusion.memory_plan import build_meta
    from unitgraph.backends.diffusion.models.sources import ModelSources

    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", "z_image", "--size", "real")
    assert code == 0, err
    assert "no weights" in out and not list((tmp_path / "real").rglob("*.safetensors"))
    sources = ModelSources(z_image.SLOTS, str(tmp_path / "real"), offline=True)
    published = {"dit": 6.15e9, "text_encoder": 4.02e9, "vae_encoder": 0.0838e9}
    for slot, count in published.items():
        model = build_meta(z_image.FAMILY.slot(slot), sources.load_config(slot), "bfloat16")
        assert abs(sum(p.numel() for p in model.parameters()) - count) < 0.005 * count, slot
    scheduler = sources.load(["scheduler"])["scheduler"]
    assert scheduler.config.shift == 3.0 and not scheduler.config.use_dynamic_shifting


@pytest.mark.slow
def test_the_dry_run_of_the_released_model_at_1024_px(capsys, tmp_path):
    """Stage 2 of a DiT LoRA holds the DiT alone; the latent is FLUX.1's VAE's 16 x 128 x 128, 4096 image tokens."""
    shallow(real.write_real_configs(tmp_path / "real"))  # 2 blocks: what is checked does not depend on depth
    code, out, err = cli(capsys, "train", "--dry_run", "--json", "--model_paths", str(tmp_path / "real"),
                         "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "1024",
                         "--width", "1024")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    assert set(plan["stages"]["train"]["models"]) == {"dit"}
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder", "vae_encoder"}
    assert plan["settings"]["size"]["latent"] == [16, 128, 128]
    assert plan["settings"]["size"]["image_tokens"] == 4096 and plan["settings"]["size"]["text_tokens"] == 512


# ------------------------------------------------------------------------------------------------
# runs


@pytest.mark.slow
def test_validation_samples_render_in_a_bf16_stage_2(models, data, tmp_path):
    from PIL import Image

    common = dict(pipeline="z_image", model_paths=str(models), lora_base_model="dit", lora_rank=4,
                  max_pixels=SIZE * SIZE, progress=False, plot=False, validation_prompt=["a red circle"],
                  mixed_precision="bf16")
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(tmp_path / "cache"), **common), echo=quiet)
    result = run(make_args(task="sft:train", dataset_base_path=str(tmp_path / "cache"), output_path=str(tmp_path / "out"),
                           validation_inference_steps=2, **common), echo=quiet)
    assert result.steps == 3 and Image.open(tmp_path / "out" / "samples" / "epoch-0" / "0.png").size == (SIZE, SIZE)


@pytest.mark.slow
def test_diffsynths_z_image_lora_command_runs_verbatim(models, tmp_path, user_shell):
    """The tiny models where DiffSynth downloads Tongyi-MAI/Z-Image (the DiT) and Tongyi-MAI/Z-Image-Turbo (text
    encoder, VAE and its default tokenizer), its example data where its command reads it; the command run with the
    arguments a shell would hand over (tests/pasted.py). The LoRA sits on every module the targets name, and
    diffusers loads it."""
    shutil.copytree(models, tmp_path / BASE_REPO)
    shutil.copytree(models, tmp_path / TURBO_REPO)
    write_synthetic_dataset(tmp_path / DATA, count=3, size=48, seed=8)
    done = user_shell.script(DIFFSYNTH_COMMAND, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: z_image (the model id Tongyi-MAI/Z-Image)" in done.stdout
    out = tmp_path / "models" / "train" / "Z-Image_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == ["epoch-0.safetensors", "epoch-1.safetensors"]
    keys = load_file(str(out / "epoch-1.safetensors"))
    adapted = {k.split(".lora_")[0].removeprefix("transformer.") for k in keys}
    dit = diffusers.ZImageTransformer2DModel.from_pretrained(str(models / "transformer"))
    expected = {n for n, _ in dit.named_modules() if any(n.endswith("." + s) for s in DIFFSYNTH_TARGETS)}
    assert adapted == expected and len(adapted) == 7 * 3  # one main layer, one noise and one context refiner layer
    pipe = diffusers.ZImagePipeline.from_pretrained(str(tmp_path / BASE_REPO))
    before = pipe.transformer.layers[0].feed_forward.w1.weight.detach().clone()
    pipe.load_lora_weights(str(out / "epoch-1.safetensors"))
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.layers[0].feed_forward.w1.weight, before)


# ------------------------------------------------------------------------------------------------
# z_image_omni: Z-Image-Omni-Base's edit images


@pytest.fixture(scope="module")
def omni_pipe(tmp_path_factory):
    folder = tiny.write_tiny_models(tmp_path_factory.mktemp("z_image_omni") / "models", size="test", seed=0,
                                    pipeline="z_image_omni")
    pipe = diffusers.ZImageOmniPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def omni_context(pipe, **settings) -> UnitContext:
    loaded = {"dit": pipe.transformer, "vae_encoder": pipe.vae, "text_encoder": pipe.text_encoder,
              "tokenizer": pipe.tokenizer, "scheduler": pipe.scheduler, "image_encoder": pipe.siglip,
              "siglip_processor": pipe.siglip_processor}
    return UnitContext(models=loaded, settings=UnitSettings(**settings))


def test_the_omni_plans_follow_the_edit_image_through_the_text_encoder():
    """DiffSynth's split-training example of its update-chain rule: the edit image reaches the text encoder (its place
    in the omni template), so with a LoRA on the text encoder the prompt unit trains in stage 2 on the cached edit
    image, while the VAE and SigLIP embeddings stay in stage 1; with a LoRA on the DiT all of them are stage 1's."""
    import unitgraph

    pipeline = z_image.Z_IMAGE_OMNI.spec_pipeline
    text = unitgraph.split(pipeline, lora_base_model="text_encoder")
    assert "OmniPromptEncoder" in text.train_units and set(text.train_models) == {"dit", "text_encoder"}
    assert {"EditImageResizer", "EditImageEmbedderVAE", "EditImageEmbedderSiglip"} <= set(text.data_process_units)
    assert set(text.data_process_models) == {"vae_encoder", "image_encoder"}
    assert {"edit_image", "prompt"} <= {p for p, _ in text.cache_entries}
    dit = unitgraph.split(pipeline, lora_base_model="dit")
    assert "OmniPromptEncoder" in dit.data_process_units and dit.train_models == ["dit"]
    assert set(dit.data_process_models) == {"text_encoder", "vae_encoder", "image_encoder"}
    assert {p for p, _ in dit.cache_entries} == {"input_latents", "prompt_segments", "edit_latents", "siglip_embeds"}
    for plan in (text, dit):
        assert unitgraph.verify(pipeline, plan) == []


def test_the_omni_units_match_the_omni_pipelines_helpers(omni_pipe):
    from PIL import Image

    ctx = omni_context(omni_pipe)
    edit = Image.new("RGB", (64, 80), (200, 30, 40))
    # the omni template, cut at the image's place, each segment encoded on its own
    theirs = omni_pipe._encode_prompt("a red circle", num_condition_images=1)[0]
    ours = omni.omni_prompt_encoder(ctx, {"prompt": "a red circle", "edit_image": edit})["prompt_segments"][0]
    assert len(ours) == len(theirs) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    none = omni_pipe._encode_prompt("a red circle", num_condition_images=0)[0]
    assert torch.equal(omni.encode_segments(ctx, omni.omni_segments("a red circle", 0))[0], none[0])
    # the edit image as SigLIP2 sees it (an image within 1024 x 1024 px keeps its size)
    resized = omni.edit_image_resizer(ctx, {"edit_image": edit})
    assert resized["edit_pixels"][0].shape == (1, 3, 80, 64) and resized["edit_images"][0].size == (64, 80)
    siglip = omni.edit_image_embedder_siglip(ctx, resized)["siglip_embeds"][0]
    expected = omni_pipe.prepare_siglip_embeds([edit], 1, "cpu", torch.float32)[0]
    assert len(siglip) == 1 and torch.equal(siglip[0], expected[0])
    # the VAE latents (the pipeline encodes in bfloat16: so do we, for the comparison)
    vae = omni_pipe.vae.to(torch.bfloat16)
    try:
        latents = omni.edit_image_embedder_vae(UnitContext(models={"vae_encoder": vae}, settings=UnitSettings(
            dtype="bfloat16")), {"edit_pixels": [p.to(torch.bfloat16) for p in resized["edit_pixels"]]})["edit_latents"][0]
        theirs = omni_pipe.prepare_image_latents([resized["edit_pixels"][0]], 1, "cpu", torch.bfloat16)[0]
    finally:
        omni_pipe.vae.to(torch.float32)
    assert torch.equal(latents[0][0].unsqueeze(1), theirs[0])


def test_the_omni_losss_dit_call_is_the_pipelines_denoising_step(omni_pipe):
    """The transformer call ZImageOmniPipeline makes with one edit image (captured), made again by the omni loss's
    predict() from the same latents, segments and SigLIP features in our params' layout: the same negated output."""
    from PIL import Image

    calls = []
    hook = omni_pipe.transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out[0])),
                                                       with_kwargs=True)
    vae = omni_pipe.vae.to(torch.bfloat16)  # the pipeline encodes the edit images in bfloat16
    try:
        latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            omni_pipe(prompt="a red circle", image=[Image.new("RGB", (64, 80), (200, 30, 40))], latents=latents,
                      height=64, width=64, num_inference_steps=2, guidance_scale=0.0, output_type="latent")
    finally:
        hook.remove()
        vae.to(torch.float32)
    kwargs, out = calls[0]
    (edit, target), = kwargs["x"]
    assert kwargs["image_noise_mask"] == [[0, 1]] and kwargs["siglip_feats"][0][-1] is None
    ctx = omni_context(omni_pipe)
    with torch.no_grad():
        pred = omni.predict(ctx, target[:, 0][None], omni_pipe.scheduler.timesteps[:1], [kwargs["cap_feats"][0]],
                            [[edit[:, 0][None]]], [kwargs["siglip_feats"][0][:-1]])
    assert torch.equal(pred, -torch.stack([o.float() for o in out]).squeeze(2))


def test_an_omni_sample_without_an_edit_image_is_one_line(omni_pipe):
    with pytest.raises(BackendError, match="no edit image"):
        omni.edit_image_resizer(omni_context(omni_pipe), {"edit_image": None})


def test_the_omni_model_id_chooses_by_the_dataset(tmp_path):
    """The Omni model id names both Omni pipelines: text-to-image, or with edit images when the command hands them
    over (DiffSynth's --extra_inputs edit_image)."""
    ids = (f"{z_image.OMNI_MODEL}:transformer/*.safetensors,{z_image.OMNI_MODEL}:siglip/model.safetensors,"
           f"{z_image.TURBO_MODEL}:text_encoder/*.safetensors,{z_image.TURBO_MODEL}:vae/diffusion_pytorch_model.safetensors")
    chosen = choose(make_args(model_id_with_origin_paths=ids, lora_base_model="dit"))
    assert chosen.line == f"pipeline: z_image_omni_t2i (the model id {z_image.OMNI_MODEL})"
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=1, size=16, seed=0, edit=True)
    chosen = choose(make_args(model_id_with_origin_paths=ids, lora_base_model="dit", dataset_base_path=str(data),
                              dataset_metadata_path=str(data / "metadata.csv"), extra_inputs="edit_image"))
    assert chosen.line == f"pipeline: z_image_omni (the model id {z_image.OMNI_MODEL}; the metadata column edit_image)"


def test_the_omni_t2i_prompt_and_dit_call_are_the_pipelines_without_images(omni_pipe):
    """ZImageOmniPipeline without `image` (captured): the omni template's one segment, the noisy target alone, noise
    mask 1 and no SigLIP features; our unit's segments and the t2i loss's predict() make the same call."""
    calls = []
    hook = omni_pipe.transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out[0])),
                                                       with_kwargs=True)
    try:
        latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            omni_pipe(prompt="a red circle", latents=latents, height=64, width=64, num_inference_steps=2,
                      guidance_scale=0.0, output_type="latent")
    finally:
        hook.remove()
    kwargs, out = calls[0]
    (target,), = kwargs["x"]
    assert kwargs["image_noise_mask"] == [[1]] and kwargs["siglip_feats"] == [None]
    ctx = omni_context(omni_pipe)
    segments = omni.omni_t2i_prompt_encoder(ctx, {"prompt": "a red circle"})["prompt_segments"]
    assert len(segments[0]) == 1 and torch.equal(segments[0][0], kwargs["cap_feats"][0][0])
    with torch.no_grad():
        pred = omni.predict(ctx, target[:, 0][None], omni_pipe.scheduler.timesteps[:1], segments)
    assert torch.equal(pred, -torch.stack([o.float() for o in out]).squeeze(2))


def test_the_omni_t2i_render_draws_what_the_pipeline_draws(omni_pipe):
    ctx = omni_context(omni_pipe)
    embeds = omni.omni_t2i_prompt_encoder(ctx, {"prompt": "a cat"})
    models = {"dit": omni_pipe.transformer, "vae_encoder": omni_pipe.vae, "scheduler": omni_pipe.scheduler}
    negative = omni.omni_t2i_prompt_encoder(ctx, {"prompt": ""})
    got = render.render(z_image.Z_IMAGE_OMNI_T2I, models, embeds, 64, 64, 2, torch.Generator().manual_seed(1),
                        negative=negative)
    expected = omni_pipe(prompt="a cat", width=64, height=64, num_inference_steps=2,  # its default guidance, 5
                         generator=torch.Generator().manual_seed(1)).images[0]
    assert got.size == (64, 64) and got.tobytes() == expected.tobytes()


@pytest.mark.slow
def test_the_omni_released_configs_build_and_dry_run(capsys, tmp_path):
    """Z-Image-Omni-Base's folder: the DiT with its SigLIP embedder, the SigLIP2 encoder of 428 M parameters (DiffSynth's
    siglip_vision_model_428m); a DiT LoRA's stage 2 holds the DiT alone, stage 1 the three encoders (two text-to-image)."""
    from unitgraph.backends.diffusion.memory_plan import build_meta
    from unitgraph.backends.diffusion.models.sources import ModelSources

    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", "z_image_omni", "--size", "real")
    assert code == 0 and "ZImageOmniPipeline" in out, err
    sources = ModelSources(z_image.SLOTS, str(tmp_path / "real"), offline=True)
    siglip = build_meta(z_image.FAMILY.slot("image_encoder"), sources.load_config("image_encoder"), "bfloat16")
    assert abs(sum(p.numel() for p in siglip.parameters()) - 0.428e9) < 0.005 * 0.428e9
    dit = build_meta(z_image.FAMILY.slot("dit"), sources.load_config("dit"), "bfloat16")
    assert dit.siglip_embedder is not None
    shallow(tmp_path / "real")  # the dry runs below at 2 blocks: what they check does not depend on depth
    stage1 = {"z_image_omni_t2i": {"text_encoder", "vae_encoder"},  # the folder alone: text-to-image
              "z_image_omni": {"text_encoder", "vae_encoder", "image_encoder"}}
    for pipeline, models in stage1.items():
        code, out, err = cli(capsys, "train", "--dry_run", "--json", "--model_paths", str(tmp_path / "real"),
                             "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "512",
                             "--width", "512", *(["--pipeline", pipeline] if pipeline == "z_image_omni" else []))
        assert code == 0, err
        plan = json.loads(out[out.index("{"):])
        assert plan["settings"]["pipeline"] == pipeline and set(plan["stages"]["train"]["models"]) == {"dit"}
        assert set(plan["stages"]["data_process"]["models"]) == models


@pytest.mark.slow
@pytest.mark.parametrize("edit", [False, True], ids=["t2i", "edit"])
def test_diffsynths_z_image_omni_lora_commands_run_verbatim(tmp_path, user_shell, edit):
    """The tiny Omni-Base folder where DiffSynth downloads Tongyi-MAI/Z-Image-Omni-Base (DiT, SigLIP2 and its processor)
    and Tongyi-MAI/Z-Image-Turbo (text encoder, VAE, tokenizer); its text-to-image command on captioned images trains
    z_image_omni_t2i, its image(s)-to-image command on data with an edit_image column z_image_omni; each LoRA loads in
    ZImageOmniPipeline."""
    folder = tiny.write_tiny_models(tmp_path / "tiny", size="test", seed=0, pipeline="z_image_omni")
    shutil.copytree(folder, tmp_path / OMNI_REPO)
    shutil.copytree(folder, tmp_path / TURBO_REPO)
    write_synthetic_dataset(tmp_path / OMNI_DATA, count=2, size=64, seed=8, edit=edit)
    done = user_shell.script(DIFFSYNTH_OMNI_COMMAND if edit else DIFFSYNTH_OMNI_T2I_COMMAND, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"pipeline: {'z_image_omni' if edit else 'z_image_omni_t2i'} (the model id {z_image.OMNI_MODEL}" in done.stdout
    out = tmp_path / "models" / "train" / ("Z-Image-Omni-Base_lora_edit" if edit else "Z-Image-Omni-Base_lora")
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == ["epoch-0.safetensors", "epoch-1.safetensors"]
    pipe = diffusers.ZImageOmniPipeline.from_pretrained(str(tmp_path / OMNI_REPO))
    before = pipe.transformer.layers[0].attention.to_q.weight.detach().clone()
    pipe.load_lora_weights(str(out / "epoch-1.safetensors"))
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.layers[0].attention.to_q.weight, before)

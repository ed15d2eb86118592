"""The FLUX.2 family beyond the conformance suite: its units compute what diffusers' Flux2KleinPipeline computes, its
loss and training schedule are DiffSynth-Studio's, its default LoRA targets are DiffSynth's example's modules, and
DiffSynth's klein split-training commands run verbatim but for the program name.
"""

from __future__ import annotations

import json
import re
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
from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families import flux2  # noqa: E402
from unitgraph.backends.diffusion.families.flux2 import edit, losses, real, render, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import latent_sampler, posterior_mean  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from shallow import shallow  # noqa: E402

SIZE = 32
REPO = Path(__file__).resolve().parents[1]
WHEEL = REPO / ".venv" / "diffsynth-wheel" / "diffsynth" / "diffusion"
needs_wheel = pytest.mark.skipif(not (WHEEL / "flow_match.py").is_file(), reason="the diffsynth wheel is not unpacked")
KLEIN_REPO = Path("models") / "black-forest-labs" / "FLUX.2-klein-4B"
KLEIN_BASE_REPO = Path("models") / "black-forest-labs" / "FLUX.2-klein-base-4B"
DATA = Path("data") / "example_image_dataset"

_SINGLE_4B = ",".join(f"single_transformer_blocks.{i}.attn.to_out" for i in range(20))
# examples/flux2/model_training/special/split_training/FLUX.2-klein-base-4B_lora.sh, both commands verbatim but for
# the program name (`accelerate launch examples/flux2/model_training/train.py` -> `unitgraph train`) and the sizes:
# --max_pixels 1048576 lowered to 1024 (32 x 32), --dataset_repeat 50 to 1, --num_epochs 5 to 2.
DIFFSYNTH_COMMANDS = r"""
unitgraph train \
  --dataset_base_path data/example_image_dataset \
  --dataset_metadata_path data/example_image_dataset/metadata.csv \
  --max_pixels 1024 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-klein-4B:text_encoder/*.safetensors,black-forest-labs/FLUX.2-klein-4B:vae/diffusion_pytorch_model.safetensors" \
  --tokenizer_path "black-forest-labs/FLUX.2-klein-4B:tokenizer/" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-klein-base-4B_lora_cache" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,to_qkv_mlp_proj,SINGLE" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --task "sft:data_process"

unitgraph train \
  --dataset_base_path "./models/train/FLUX.2-klein-base-4B_lora_cache" \
  --max_pixels 1024 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-klein-base-4B:transformer/*.safetensors" \
  --tokenizer_path "black-forest-labs/FLUX.2-klein-4B:tokenizer/" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-klein-base-4B_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,to_qkv_mlp_proj,SINGLE" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --task "sft:train"
""".replace("SINGLE", _SINGLE_4B)

DEV_REPO = Path("models") / "black-forest-labs" / "FLUX.2-dev"
DEV_DATA = Path("data") / "diffsynth_example_dataset" / "flux2" / "FLUX.2-dev"
_SINGLE_DEV = ",".join(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48))
# examples/flux2/model_training/lora/FLUX.2-dev.sh, both commands verbatim but for the program name and the sizes:
# --max_pixels 1048576 lowered to 1024, --dataset_repeat 50 to 1, --num_epochs 5 to 2.
DEV_COMMANDS = r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/flux2/FLUX.2-dev \
  --dataset_metadata_path data/diffsynth_example_dataset/flux2/FLUX.2-dev/metadata.csv \
  --max_pixels 1024 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-dev:text_encoder/*.safetensors,black-forest-labs/FLUX.2-dev:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-dev-LoRA-splited-cache" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_qkv_mlp_proj,to_out.0,to_add_out,linear_in,linear_out,SINGLE" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8 \
  --task "sft:data_process"

unitgraph train \
  --dataset_base_path "./models/train/FLUX.2-dev-LoRA-splited-cache" \
  --max_pixels 1024 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-dev:transformer/*.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-dev-LoRA-splited" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_qkv_mlp_proj,to_out.0,to_add_out,linear_in,linear_out,SINGLE" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8 \
  --task "sft:train"
""".replace("SINGLE", _SINGLE_DEV)

EDIT_DATA = Path("data") / "diffsynth_example_dataset" / "qwen_image" / "Qwen-Image-Edit-2511"
# examples/flux2/model_training/lora/FLUX.2-klein-4B.sh, its "Edit" command (shipped commented out, as a pattern:
# "# " removed) verbatim but for the program name and the sizes: --max_pixels 1048576 lowered to 1024,
# --dataset_repeat 50 to 1, --num_epochs 5 to 1.
EDIT_COMMAND = r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/qwen_image/Qwen-Image-Edit-2511 \
  --dataset_metadata_path data/diffsynth_example_dataset/qwen_image/Qwen-Image-Edit-2511/metadata.json \
  --data_file_keys "image,edit_image" \
  --extra_inputs "edit_image" \
  --max_pixels 1024 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-klein-4B:text_encoder/*.safetensors,black-forest-labs/FLUX.2-klein-4B:transformer/*.safetensors,black-forest-labs/FLUX.2-klein-4B:vae/diffusion_pytorch_model.safetensors" \
  --tokenizer_path "black-forest-labs/FLUX.2-klein-4B:tokenizer/" \
  --learning_rate 1e-4 \
  --num_epochs 1 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-klein-4B_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,to_qkv_mlp_proj,SINGLE" \
  --lora_rank 32 \
  --use_gradient_checkpointing
""".replace("SINGLE", _SINGLE_4B)


def quiet(_text: str) -> None:
    pass


def diffsynth_targets() -> list[str]:
    return re.search(r'--lora_target_modules "([^"]+)"', DIFFSYNTH_COMMANDS).group(1).split(",")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("flux2") / "models", size="test", seed=0)


@pytest.fixture(scope="module")
def pipe(models):
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def dev_models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("flux2-dev") / "models"
    return tiny.write_tiny_models(folder, size="test", seed=0, pipeline="flux2")


@pytest.fixture(scope="module")
def dev_pipe(dev_models):
    pipe = diffusers.Flux2Pipeline.from_pretrained(str(dev_models))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def context(pipe, **settings) -> UnitContext:
    encoder = "text_encoder" if isinstance(pipe, diffusers.Flux2Pipeline) else "text_encoder_qwen3"
    loaded = {"dit": pipe.transformer, "vae": pipe.vae, encoder: pipe.text_encoder, "tokenizer": pipe.tokenizer,
              "scheduler": pipe.scheduler}
    return UnitContext(models=loaded, settings=UnitSettings(**settings))


def dit_calls(pipeline, **call) -> list:
    """(kwargs, output) of each transformer call the pipeline makes when called with `call` (2 steps, latents out)."""
    calls = []
    hook = pipeline.transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out[0])),
                                                      with_kwargs=True)
    try:
        with torch.no_grad():
            pipeline(height=SIZE, width=SIZE, num_inference_steps=2, output_type="latent",
                     generator=torch.Generator().manual_seed(0), **call)
    finally:
        hook.remove()
    return calls


# ------------------------------------------------------------------------------------------------
# the plan


def test_the_plans_keep_what_does_not_train_in_stage_1():
    import unitgraph

    pipeline = flux2.FLUX2_KLEIN.spec_pipeline
    lora = unitgraph.split(pipeline, lora_base_model="dit")
    assert lora.data_process_models == ["text_encoder_qwen3", "vae"] and lora.train_models == ["dit"]
    assert set(lora.train_units) == {"NoiseInitializer", "LatentPacker", "TimestepSampler"}
    assert {p for p, _ in lora.cache_entries} == {"input_latents", "prompt_emb"}
    text = unitgraph.split(pipeline, lora_base_model="text_encoder_qwen3")
    assert "Qwen3PromptEmbedder" in text.train_units and "vae" not in text.train_models
    assert ("input_latents", "PosteriorMean") in text.cache_entries
    for plan in (lora, text):
        assert unitgraph.verify(pipeline, plan) == []


# ------------------------------------------------------------------------------------------------
# the units against diffusers' Flux2KleinPipeline


def test_the_tiny_tokenizer_formats_a_prompt_as_qwen3s_template(pipe):
    text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "a red cat"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\na red cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids, mask = u.qwen3_token_ids(pipe.tokenizer, ["a red cat"])
    assert ids.shape == mask.shape == (1, u.MAX_SEQUENCE_LENGTH) and 0 < int(mask.sum()) < u.MAX_SEQUENCE_LENGTH
    assert int(ids[0, -1]) == pipe.tokenizer.pad_token_id
    assert pipe.text_encoder.config.num_hidden_layers >= max(u.QWEN3_LAYERS)


def test_the_prompt_unit_matches_the_pipelines_encode_prompt(pipe):
    ctx = context(pipe)
    prompt = "a green square on a white background"
    embeds, text_ids = pipe.encode_prompt(prompt=prompt)
    ours = u.qwen3_prompt_embedder(ctx, {"prompt": prompt})["prompt_emb"]
    hidden = tiny.SIZES["test"]["text"]["hidden_size"]
    assert ours.shape == (1, u.MAX_SEQUENCE_LENGTH, 3 * hidden) and torch.equal(ours, embeds)
    # token by token, the three layers side by side: layer 9's values first
    ids, mask = u.qwen3_token_ids(pipe.tokenizer, [prompt])
    states = pipe.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert torch.equal(ours[..., :hidden], states[9]) and torch.equal(ours[..., 2 * hidden:], states[27])
    # the text ids the loss makes are the pipeline's
    assert torch.equal(losses.text_ids(ours.shape[1], ours).long(), text_ids[0])
    # the batched form (stage 1's --data_process_batch_size) gives each prompt its own embedding
    samples = [{"prompt": prompt}, {"prompt": "a dog"}]
    batched = u.qwen3_prompt_embedder.run_batch(ctx, samples)
    for sample, out in zip(samples, batched):
        alone = u.qwen3_prompt_embedder(ctx, sample)
        assert torch.allclose(out["prompt_emb"], alone["prompt_emb"], atol=1e-6)


def test_the_latents_are_the_pipelines_batch_normalised_patches(pipe):
    ctx = context(pipe, image_size=ImageSize(48, 32))  # --height 48 --width 32: a portrait image
    from PIL import Image

    shaped = u.shape_checker(ctx, {"image": Image.new("RGB", (64, 80), (10, 200, 30))})
    assert shaped["image"].shape == (1, 3, 48, 32)
    pixels = torch.rand(1, 3, 48, 32, generator=torch.Generator().manual_seed(4)) * 2 - 1
    out = u.image_encoder(ctx, {"image": pixels})
    expected = pipe._encode_vae_image(pixels, generator=None)  # the posterior's mode, patchified and normalised
    assert out["latent_mean"].shape == (1, 4 * pipe.vae.config.latent_channels, 3, 2)
    assert torch.allclose(out["latent_mean"], expected, atol=1e-6, rtol=0)
    assert float(pipe.vae.bn.running_var.std()) > 0.1  # the tiny VAE's statistics are not the identity
    # the log-variance is the posterior's, in the same space: a draw of it is the normalised draw of the posterior
    posterior = pipe.vae.encode(pixels).latent_dist
    mean, std = u.batch_norm_stats(pipe.vae, out["latent_mean"])
    assert torch.allclose(out["latent_logvar"].exp().sqrt(), u.patchify(posterior.std) / std, rtol=1e-5)
    assert torch.equal(posterior_mean(ctx, out)["input_latents"], out["latent_mean"])
    assert latent_sampler(UnitContext(models={}, epoch=0, sample_key="s"), out)["input_latents"].shape == expected.shape
    # packing and the image ids are the pipeline's
    packed = u.latent_packer(ctx, {"input_latents": expected, "noise": expected})
    assert torch.equal(packed["input_latents"], pipe._pack_latents(expected)) and packed["latent_grid"] == [[3, 2]]
    ids = losses.image_ids(packed["latent_grid"][0], expected)
    assert torch.equal(ids.long(), pipe._prepare_latent_ids(expected)[0])


def test_the_losss_dit_call_is_the_pipelines_denoising_step(pipe):
    """The transformer call the pipeline makes in a denoising step (captured), made again by the loss's predict()
    from our units' embedding and grid: the same output."""
    ctx = context(pipe)
    prompt = "a dog"
    embeds, _ = pipe.encode_prompt(prompt=prompt)
    kwargs, expected = dit_calls(pipe, prompt_embeds=embeds, guidance_scale=1.0)[1]
    assert kwargs["guidance"] is None and 0 < float(kwargs["timestep"]) < 1
    ours = u.qwen3_prompt_embedder(ctx, {"prompt": prompt})["prompt_emb"]
    grid = [[SIZE // 16, SIZE // 16]]
    with torch.no_grad():
        pred = losses.predict(ctx, kwargs["hidden_states"], kwargs["timestep"], ours, grid)
    assert torch.equal(pred, expected)


def test_a_guidance_distilled_dit_is_told_diffsynths_training_guidance(pipe, monkeypatch):
    """FLUX.2-dev's kind (guidance_embeds): the loss passes guidance 1, as DiffSynth's training does."""
    seen = {}
    dit = types.SimpleNamespace(config=types.SimpleNamespace(guidance_embeds=True))

    def fake(**kwargs):
        seen.update(kwargs)
        return (kwargs["hidden_states"],)

    ctx = UnitContext(models={"dit": fake})
    monkeypatch.setattr(ctx, "raw", lambda name: dit, raising=False)
    monkeypatch.setattr(ctx, "model_dtype", lambda name: torch.float32, raising=False)
    losses.predict(ctx, torch.zeros(1, 4, 8), torch.tensor([0.5]), torch.zeros(1, 3, 6), [[2, 2]])
    assert seen["guidance"].tolist() == [losses.TRAINING_GUIDANCE]


def test_render_draws_what_the_pipeline_draws(pipe):
    ctx = context(pipe)
    embeds = u.qwen3_prompt_embedder(ctx, {"prompt": "a cat"})
    models = {"dit": pipe.transformer, "vae": pipe.vae, "scheduler": pipe.scheduler}
    negative = u.qwen3_prompt_embedder(ctx, {"prompt": ""})  # klein's guidance is against the empty prompt
    got = render.render(flux2.FLUX2_KLEIN, models, embeds, SIZE, SIZE, 2, torch.Generator().manual_seed(1),
                        negative=negative)
    expected = pipe(prompt="a cat", width=SIZE, height=SIZE, num_inference_steps=2,  # its default guidance, 4
                    generator=torch.Generator().manual_seed(1)).images[0]
    assert got.size == (SIZE, SIZE) and got.tobytes() == expected.tobytes()


# ------------------------------------------------------------------------------------------------
# FLUX.2-dev (Flux2Pipeline): the Mistral text encoder and the guidance-embedded DiT


def test_the_mistral_prompt_unit_matches_flux2_pipelines_encode_prompt(dev_pipe):
    ctx = context(dev_pipe)
    prompt = "a red circle [IMG] on a white background"
    embeds, text_ids = dev_pipe.encode_prompt(prompt=prompt)
    ours = u.prompt_embedder(ctx, {"prompt": prompt})["prompt_emb"]
    hidden = tiny.SIZES["test"]["mistral"]["hidden_size"]
    assert ours.shape == (1, u.MAX_SEQUENCE_LENGTH, 3 * hidden) and torch.equal(ours, embeds)
    ids, mask = u.mistral_token_ids(dev_pipe.tokenizer, [prompt])
    text = dev_pipe.tokenizer.decode(ids[0][mask[0].bool()])
    system = f"<s>[SYSTEM_PROMPT]{u.SYSTEM_MESSAGE}[/SYSTEM_PROMPT]"
    assert text == system + "[INST]a red circle  on a white background[/INST]"  # [IMG] dropped
    states = dev_pipe.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert torch.equal(ours[..., :hidden], states[10]) and torch.equal(ours[..., 2 * hidden:], states[30])
    assert torch.equal(losses.text_ids(ours.shape[1], ours).long(), text_ids[0])
    batched = u.prompt_embedder.run_batch(ctx, [{"prompt": prompt}, {"prompt": "a dog"}])
    alone = u.prompt_embedder(ctx, {"prompt": "a dog"})["prompt_emb"]
    assert torch.allclose(batched[1]["prompt_emb"], alone, atol=1e-6)


def test_the_losss_dit_call_is_flux2_pipelines_denoising_step_with_the_training_guidance(dev_pipe):
    """Flux2Pipeline tells the DiT its guidance; the loss tells it DiffSynth's training value, 1: asked for guidance 1,
    the pipeline makes the very call the loss makes."""
    ctx = context(dev_pipe)
    embeds, _ = dev_pipe.encode_prompt(prompt="a dog")
    kwargs, expected = dit_calls(dev_pipe, prompt_embeds=embeds, guidance_scale=losses.TRAINING_GUIDANCE)[0]
    assert dev_pipe.transformer.config.guidance_embeds and kwargs["guidance"].tolist() == [1.0]
    ours = u.prompt_embedder(ctx, {"prompt": "a dog"})["prompt_emb"]
    with torch.no_grad():
        pred = losses.predict(ctx, kwargs["hidden_states"], kwargs["timestep"], ours, [[SIZE // 16, SIZE // 16]])
    assert torch.equal(pred, expected)


def test_flux2_renders_what_its_pipeline_draws(dev_pipe):
    ctx = context(dev_pipe)
    embeds = u.prompt_embedder(ctx, {"prompt": "a cat"})
    models = {"dit": dev_pipe.transformer, "vae": dev_pipe.vae, "scheduler": dev_pipe.scheduler}
    got = render.render(flux2.FLUX2, models, embeds, SIZE, SIZE, 2, torch.Generator().manual_seed(1))
    expected = dev_pipe(prompt="a cat", width=SIZE, height=SIZE, num_inference_steps=2,
                        guidance_scale=render.DEV_GUIDANCE, generator=torch.Generator().manual_seed(1)).images[0]
    assert got.size == (SIZE, SIZE) and got.tobytes() == expected.tobytes()


# ------------------------------------------------------------------------------------------------
# reference images (flux2_klein_edit, flux2_edit) against the pipelines' `image` argument


def noise_image(width: int, height: int, seed: int):
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def edit_tokens(ctx, images) -> dict:
    pixels = edit.edit_image_resizer(ctx, {"edit_image": images})["edit_pixels"]
    return {"edit_pixels": pixels, **edit.edit_image_encoder(ctx, {"edit_pixels": pixels})}


def test_edit_images_are_sized_as_diffsynth_sizes_them_within_the_runs_area():
    """DiffSynth's edit_image_auto_resize: about 1024 x 1024 px with the image's aspect, sides rounded to multiples
    of 32, up as well as down; here capped by the run's own area."""
    from PIL import Image

    assert edit.edit_size(512, 512, ImageSize()) == ImageSize(height=1024, width=1024)
    assert edit.edit_size(3000, 2000, ImageSize()) == ImageSize(height=832, width=1248)
    assert edit.edit_size(200, 100, ImageSize(max_pixels=64 * 64)) == ImageSize(height=32, width=96)
    assert edit.edit_size(40, 40, ImageSize(64, 64)) == ImageSize(height=64, width=64)
    shaped = edit.edit_image_resizer(UnitContext(models={}), {"edit_image": Image.new("RGB", (300, 200))})
    assert [tuple(p.shape) for p in shaped["edit_pixels"]] == [(1, 3, 832, 1248)]
    with pytest.raises(Exception, match="--extra_inputs edit_image"):
        edit.edit_image_resizer(UnitContext(models={}), {"edit_image": None})


def test_the_edit_units_give_the_pipelines_reference_tokens_and_ids(pipe):
    """Two edit images the pipeline keeps at their size (multiples of 32, under the run's area): our pixels, packed
    latents and RoPE ids are Flux2KleinPipeline.prepare_image_latents' (time ids 10 and 20)."""
    ctx = context(pipe, image_size=ImageSize(max_pixels=64 * 32))
    images = [noise_image(32, 32, 1), noise_image(64, 32, 2)]
    out = edit_tokens(ctx, images)
    processed = [pipe.image_processor.preprocess(im, height=im.size[1], width=im.size[0], resize_mode="crop")
                 for im in images]
    for ours, theirs in zip(out["edit_pixels"], processed):
        assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    latents, ids = pipe.prepare_image_latents(processed, batch_size=1, generator=None, device="cpu", dtype=torch.float32)
    assert out["edit_grids"] == [[[2, 2], [2, 4]]] and out["edit_latents"].shape == latents.shape == (1, 12, 4 * pipe.vae.config.latent_channels)
    assert torch.allclose(out["edit_latents"], latents, atol=1e-5, rtol=0)
    assert torch.equal(edit.edit_ids(out["edit_grids"][0], latents).long(), ids[0])
    assert sorted(set(ids[0, :, 0].tolist())) == [10, 20]


@pytest.mark.parametrize("dev", [False, True], ids=["klein", "dev"])
def test_the_edit_losss_dit_call_is_the_pipelines_denoising_step_with_reference_images(pipe, dev_pipe, dev):
    """The DiT call Flux2KleinPipeline / Flux2Pipeline make with `image=[...]` (captured), made again by the loss's
    predict() from our units' prompt embedding and edit tokens: the same output over the target's tokens."""
    pipeline = dev_pipe if dev else pipe
    # (the pipelines refuse reference images under 64 px a side; two at 64 x 64, the run's area)
    ctx = context(pipeline, image_size=ImageSize(max_pixels=64 * 64))
    images = [noise_image(64, 64, 1), noise_image(64, 64, 2)]
    embeds, _ = pipeline.encode_prompt(prompt="a dog")
    kwargs, expected = dit_calls(pipeline, prompt_embeds=embeds, image=images,
                                 guidance_scale=losses.TRAINING_GUIDANCE if dev else 1.0)[1]
    tokens = (SIZE // 16) ** 2
    assert kwargs["hidden_states"].shape[1] == tokens + 2 * 16  # the target's tokens, then the edit images'
    embedder = u.prompt_embedder if dev else u.qwen3_prompt_embedder
    prompt_emb = embedder(ctx, {"prompt": "a dog"})["prompt_emb"]
    out = edit_tokens(ctx, images)
    with torch.no_grad():
        pred = losses.predict(ctx, kwargs["hidden_states"][:, :tokens], kwargs["timestep"], prompt_emb,
                              [[SIZE // 16, SIZE // 16]], reference=out["edit_latents"],
                              reference_ids=edit.edit_ids(out["edit_grids"][0], out["edit_latents"]))
    assert pred.shape == expected[:, :tokens].shape
    assert torch.allclose(pred, expected[:, :tokens], atol=1e-5, rtol=0)


def test_the_edit_pipelines_keep_the_vae_and_the_edit_images_in_stage_1():
    import unitgraph

    for definition in (flux2.FLUX2_KLEIN_EDIT, flux2.FLUX2_EDIT):
        pipeline = definition.spec_pipeline
        plan = unitgraph.split(pipeline, lora_base_model="dit")
        assert plan.train_models == ["dit"] and "vae" in plan.data_process_models
        assert {"EditImageResizer", "EditImageEncoder"} <= set(plan.data_process_units)
        assert {p for p, _ in plan.cache_entries} == {"input_latents", "prompt_emb", "edit_latents", "edit_grids"}
        assert unitgraph.verify(pipeline, plan) == []


def test_the_memory_plan_counts_the_edit_images_tokens(models, capsys, tmp_path):
    """A dry run of the edit pipeline traces the DiT over the target's and one edit image's tokens: more activations
    in stage 2 than text-to-image at the same size, the encoders' stage 1 alike."""
    plans = {}
    for name in ("flux2_klein", "flux2_klein_edit"):
        code, out, err = cli(capsys, "train", "--dry_run", "--json", "--pipeline", name, "--model_paths", str(models),
                             "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "64",
                             "--width", "64")
        assert code == 0, err
        plans[name] = json.loads(out[out.index("{"):])
    edit_plan, plain = plans["flux2_klein_edit"], plans["flux2_klein"]
    assert edit_plan["settings"]["size"]["edit_grid"] == [4, 4] and "edit_grid" not in plain["settings"]["size"]
    assert "16 edit image tokens" in edit_plan["settings"]["size"]["description"]
    assert edit_plan["stages"]["train"]["peak_bytes"] > plain["stages"]["train"]["peak_bytes"]
    assert edit_plan["stages"]["train"]["models"] == plain["stages"]["train"]["models"]


def test_a_diffusers_folder_trains_with_edit_images_when_the_dataset_hands_them_over(models, tmp_path):
    edits = tmp_path / "edits"
    write_synthetic_dataset(edits, count=1, size=16, seed=0, images=["edit_image"])
    common = dict(model_paths=str(models), lora_base_model="dit", dataset_base_path=str(edits),
                  dataset_metadata_path=str(edits / "metadata.csv"))
    assert choose(make_args(**common)).pipeline.name == "flux2_klein"  # the column is there, but not handed over
    chosen = choose(make_args(extra_inputs="edit_image", **common))
    assert chosen.line.startswith("pipeline: flux2_klein_edit (the class Flux2KleinPipeline in ")
    assert chosen.line.endswith("; the metadata column edit_image)")


@pytest.mark.parametrize("model_id, edit_pipeline", [("black-forest-labs/FLUX.2-klein-4B", "flux2_klein_edit"),
                                                     ("black-forest-labs/FLUX.2-dev", "flux2_edit")])
def test_one_checkpoint_trains_with_or_without_edit_images_as_the_dataset_says(model_id, edit_pipeline, tmp_path):
    """The same model ids train text-to-image, or with reference images when the command hands over edit images;
    stage 2 of a cache trains the pipeline the cache was made for."""
    ids, lora = f"{model_id}:transformer/*.safetensors", "dit"
    plain = tmp_path / "plain"
    write_synthetic_dataset(plain, count=1, size=16, seed=0)
    edits = tmp_path / "edits"
    write_synthetic_dataset(edits, count=1, size=16, seed=0, images=["edit_image"])
    assert choose(make_args(model_id_with_origin_paths=ids, lora_base_model=lora, dataset_base_path=str(plain),
                            dataset_metadata_path=str(plain / "metadata.csv"))).pipeline.name == edit_pipeline[:-5]
    chosen = choose(make_args(model_id_with_origin_paths=ids, lora_base_model=lora, dataset_base_path=str(edits),
                              dataset_metadata_path=str(edits / "metadata.csv"), extra_inputs="edit_image"))
    assert chosen.line == f"pipeline: {edit_pipeline} (the model id {model_id}; the metadata column edit_image)"
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"pipeline": edit_pipeline}), encoding="utf-8")
    chosen = choose(make_args(task="sft:train", model_id_with_origin_paths=ids, lora_base_model=lora,
                              dataset_base_path=str(cache)))
    assert chosen.line == f"pipeline: {edit_pipeline} (the model id {model_id}; the cache was made for it)"


def test_each_text_encoder_slot_takes_its_own_class_from_a_text_encoder_folder(models, dev_models):
    """Both encoders live in text_encoder/ of their repositories: the folder's config says which slot it fills, and a
    folder of the other class is one error line naming both."""
    from unitgraph.backends.diffusion.models.folders import ModelLoadError
    from unitgraph.backends.diffusion.models.sources import ModelSources

    klein, dev = ModelSources(flux2.FAMILY, str(models)), ModelSources(flux2.FAMILY, str(dev_models))
    assert klein.resolve("text_encoder_qwen3").class_name == "Qwen3ForCausalLM"
    assert dev.resolve("text_encoder").class_name == "Mistral3ForConditionalGeneration"
    with pytest.raises(ModelLoadError, match="holds a text_encoder_qwen3 .Qwen3ForCausalLM., but text_encoder needs"):
        klein.resolve("text_encoder")
    folders = ModelSources(flux2.FAMILY, [str(models / "text_encoder"), str(dev_models / "text_encoder")])
    assert folders.resolve("text_encoder").path == dev_models / "text_encoder"
    assert folders.resolve("text_encoder_qwen3").path == models / "text_encoder"
    tokenizer = dev.load(["tokenizer"])["tokenizer"]
    assert tokenizer.convert_tokens_to_ids("[SYSTEM_PROMPT]") != tokenizer.unk_token_id


# ------------------------------------------------------------------------------------------------
# the objective against DiffSynth-Studio's own code



@pytest.fixture(scope="module")
def diffsynth():
    """DiffSynth's flow_match and loss modules, loaded from the wheel's files (loss.py's one package import stood
    in for)."""
    with wheel_modules("_flux2_diffsynth", "flow_match", "loss") as modules:
        yield modules


def _training_scheduler(flow_match):
    scheduler = flow_match.FlowMatchScheduler("FLUX.2")
    scheduler.set_timesteps(1000, training=True)  # as DiffSynth's training module sets it up
    return scheduler


@needs_wheel
def test_the_training_schedule_is_diffsynths_flux2_template(diffsynth):
    """DiffSynth trains FLUX.2 on set_timesteps(1000, training=True): no dynamic_shift_len, so mu is its fixed 0.8
    at every image size (its sampler passes the token count, its training does not)."""
    training_module = (WHEEL / "training_module.py").read_text()
    assert "pipe.scheduler.set_timesteps(1000, training=True)" in training_module
    theirs = _training_scheduler(diffsynth[0])
    schedule = u.TRAINING_SCHEDULE
    assert torch.allclose(schedule.sigmas(), theirs.sigmas.float(), atol=1e-6, rtol=0)
    assert torch.allclose(schedule.weights(), theirs.linear_timesteps_weights.float(), atol=1e-5, rtol=1e-5)
    assert float(schedule.sigmas()[0]) == 1.0 and float(schedule.sigmas()[-1]) == pytest.approx(
        2.2255 / (2.2255 + 999), rel=1e-3)
    for index in (0, 1, 137, 500, 998, 999):
        timestep = theirs.timesteps[index:index + 1]
        assert float(theirs.training_weight(timestep)) == pytest.approx(float(schedule.weights()[index]), rel=1e-5, abs=1e-6)
    # with a token count (its sampler's call) the table would differ: training does not pass one
    sampled, _ = diffsynth[0].FlowMatchScheduler.set_timesteps_flux2(1000, dynamic_shift_len=4096)
    assert not torch.allclose(sampled.float(), schedule.sigmas(), atol=1e-3)


def test_the_timestep_sampler_draws_a_position_of_the_schedule_and_its_weight():
    sigmas, weights = u.TRAINING_SCHEDULE.sigmas(), u.TRAINING_SCHEDULE.weights()
    for k in range(10):
        ctx = UnitContext(models={}, settings=UnitSettings(timestep_bounds=(0.0, 0.25), seed=3), epoch=0, sample_key=f"s{k}")
        out = u.timestep_sampler(ctx, {})
        index = int(torch.argmin((sigmas * 1000 - out["timestep"]).abs()))
        assert index < 250 and float(out["loss_weight"]) == float(weights[index])


def _model_fn(dit, latents=None, timestep=None, embedded_guidance=None, prompt_embeds=None, text_ids=None,
              image_ids=None, **kwargs):
    """DiffSynth's model_fn_flux2 (diffsynth/pipelines/flux2_image.py) around diffusers' DiT: the same call (its own
    DiT keeps diffusers' module names; a DiT without a guidance embedding ignores the guidance)."""
    guidance = torch.tensor([embedded_guidance]) if dit.config.guidance_embeds else None
    return dit(hidden_states=latents, timestep=timestep / 1000, guidance=guidance, encoder_hidden_states=prompt_embeds,
               txt_ids=text_ids, img_ids=image_ids, return_dict=False)[0][:, :latents.shape[1]]


@needs_wheel
@pytest.mark.parametrize("position", [0, 371, 999])
def test_the_loss_is_diffsynths_flow_match_sft_loss(pipe, diffsynth, position, monkeypatch):
    """Given the position and noise DiffSynth's loss draws, our loss is its FlowMatchSFTLoss with its FLUX.2 training
    scheduler, around the same DiT and the inputs its units give (the pipeline's ids)."""
    flow_match, loss = diffsynth
    scheduler = _training_scheduler(flow_match)
    ctx = context(pipe)
    prompt_emb = u.qwen3_prompt_embedder(ctx, {"prompt": "a red circle"})["prompt_emb"]
    latents = torch.randn(1, 32, 2, 2, generator=torch.Generator().manual_seed(2))
    x0 = pipe._pack_latents(latents)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    theirs_pipe = types.SimpleNamespace(scheduler=scheduler, torch_dtype=torch.float32, device="cpu",
                                        in_iteration_models=("dit",), dit=pipe.transformer, model_fn=_model_fn)
    monkeypatch.setattr(loss.torch, "randint", lambda *a, **k: torch.tensor([position]))
    monkeypatch.setattr(loss.torch, "randn_like", lambda like: noise.clone())
    with torch.no_grad():
        theirs = loss.FlowMatchSFTLoss(theirs_pipe, input_latents=x0, prompt_embeds=prompt_emb, embedded_guidance=1.0,
                                       text_ids=pipe._prepare_text_ids(prompt_emb),
                                       image_ids=pipe._prepare_latent_ids(latents))
    monkeypatch.undo()
    schedule = u.TRAINING_SCHEDULE
    inputs = {"input_latents": x0, "noise": noise, "timestep": (schedule.sigmas()[position] * 1000).reshape(1),
              "loss_weight": schedule.weights()[position].reshape(1), "prompt_emb": prompt_emb, "latent_grid": [[2, 2]]}
    with torch.no_grad():
        ours = losses.flow_matching_loss(ctx, inputs)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------------------
# LoRA targets, model ids, released configs


def _released_dit():
    from accelerate import init_empty_weights

    config = {k: v for k, v in real.TRANSFORMER.items() if not k.startswith("_")}
    with init_empty_weights():
        return diffusers.Flux2Transformer2DModel.from_config(config)


def test_diffsynths_target_names_are_diffusers_module_names():
    """Each name DiffSynth's FLUX.2 examples list is a module of diffusers' Flux2Transformer2DModel as peft matches it
    (a suffix of a Linear's path): no aliases. The defaults reach the same modules of the released klein-4B DiT as the
    klein example's list, and every adapted module is a Linear."""
    dit = _released_dit()
    modules = dict(dit.named_modules())
    linear = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear)}

    def reached(targets):
        return {n for n in modules if any(n == t or n.endswith("." + t) for t in targets)}

    listed = diffsynth_targets()
    for name in listed:
        assert reached([name]) and reached([name]) <= linear, name
    defaults = flux2.FAMILY.slot("dit").lora_targets
    assert reached(defaults) == reached(listed) <= linear
    assert flux2.FAMILY.slot("dit").lora_modules(tuple(listed)) == tuple(listed)  # no aliases
    # per double block 4 + 4 attention projections and 2 + 2 feed-forward layers, per single block 2
    assert len(reached(listed)) == 5 * 12 + 20 * 2
    single = reached([f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)])
    assert single == {f"single_transformer_blocks.{i}.attn.to_out" for i in range(20)}


@pytest.mark.parametrize("model_id, pipeline", [("black-forest-labs/FLUX.2-klein-4B", "flux2_klein"),
                                                ("black-forest-labs/FLUX.2-klein-base-9B", "flux2_klein"),
                                                ("black-forest-labs/FLUX.2-dev", "flux2")])
def test_the_model_ids_choose_the_pipeline(model_id, pipeline):
    ids = ",".join(f"{model_id}:{p}" for p in ("text_encoder/*.safetensors", "transformer/*.safetensors"))
    chosen = choose(make_args(model_id_with_origin_paths=ids, lora_base_model="dit"))
    assert chosen.line == f"pipeline: {pipeline} (the model id {model_id})"


def test_the_released_configs_build_to_the_published_sizes(capsys, tmp_path):
    from unitgraph.backends.diffusion.memory_plan import build_meta
    from unitgraph.backends.diffusion.models.sources import ModelSources

    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", "flux2_klein", "--size", "real")
    assert code == 0, err
    assert "no weights" in out and not list((tmp_path / "real").rglob("*.safetensors"))
    sources = ModelSources(flux2.SLOTS, str(tmp_path / "real"), offline=True)
    # klein-4B's DiT ("4B": 3.88 B counted), Qwen3-4B (4.02 B, tied embeddings), the FLUX.2 VAE (84 M)
    published = {"dit": 3.88e9, "text_encoder_qwen3": 4.02e9, "vae": 0.0841e9}
    for slot, count in published.items():
        model = build_meta(flux2.FAMILY.slot(slot), sources.load_config(slot), "bfloat16")
        assert abs(sum(p.numel() for p in model.parameters()) - count) < 0.005 * count, slot
    scheduler = sources.load(["scheduler"])["scheduler"]
    assert scheduler.config.use_dynamic_shifting and scheduler.config.time_shift_type == "exponential"
    # FLUX.2-dev: the 32 B DiT and Mistral-Small-3.1's 24 B (language model, Pixtral tower, projector)
    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "dev"), "--pipeline", "flux2", "--size", "real")
    assert code == 0, err
    dev = ModelSources(flux2.SLOTS, str(tmp_path / "dev"), offline=True)
    for slot, count in {"dit": 32.2e9, "text_encoder": 24.0e9, "vae": 0.0841e9}.items():
        model = build_meta(flux2.FAMILY.slot(slot), dev.load_config(slot), "bfloat16")
        assert abs(sum(p.numel() for p in model.parameters()) - count) < 0.005 * count, slot


@pytest.mark.slow
def test_the_dry_run_of_the_released_model_at_1024_px(capsys, tmp_path):
    """Stage 2 of a DiT LoRA holds the DiT alone; the latent is 128 channels over a 64 x 64 grid (4096 tokens)."""
    # the DiT at 2 blocks: what is checked does not depend on depth (the text encoder's hidden layers are read by index)
    shallow(real.write_real_configs(tmp_path / "real"), ("transformer",))
    code, out, err = cli(capsys, "train", "--dry_run", "--json", "--model_paths", str(tmp_path / "real"),
                         "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "1024",
                         "--width", "1024")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    assert set(plan["stages"]["train"]["models"]) == {"dit"}
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder_qwen3", "vae"}
    assert plan["settings"]["size"]["latent"] == [128, 64, 64]
    shallow(real.write_real_configs(tmp_path / "dev", pipeline="flux2"), ("transformer",))
    code, out, err = cli(capsys, "train", "--dry_run", "--json", "--model_paths", str(tmp_path / "dev"),
                         "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "1024",
                         "--width", "1024")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    assert set(plan["stages"]["train"]["models"]) == {"dit"}
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder", "vae"}


# ------------------------------------------------------------------------------------------------
# runs


@pytest.mark.slow
def test_validation_samples_render_in_a_stage_2(models, tmp_path):
    from PIL import Image

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=3, size=SIZE, seed=1)
    common = dict(pipeline="flux2_klein", model_paths=str(models), lora_base_model="dit", lora_rank=4,
                  max_pixels=SIZE * SIZE, progress=False, plot=False, validation_prompt=["a red circle"])
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(tmp_path / "cache"), **common), echo=quiet)
    result = run(make_args(task="sft:train", dataset_base_path=str(tmp_path / "cache"), output_path=str(tmp_path / "out"),
                           validation_inference_steps=2, **common), echo=quiet)
    assert result.steps == 3 and Image.open(tmp_path / "out" / "samples" / "epoch-0" / "0.png").size == (SIZE, SIZE)


@pytest.mark.slow
def test_diffsynths_klein_split_training_commands_run_verbatim(models, tmp_path, user_shell):
    """The tiny models where DiffSynth downloads black-forest-labs/FLUX.2-klein-4B and -base-4B (./models/<org>/<name>),
    the example data where its command reads it; both commands run as a user pastes them (tests/pasted.py): stage 1
    with the text encoder and the VAE, stage 2 with the base DiT alone, from the first's cache."""
    shutil.copytree(models, tmp_path / KLEIN_REPO)
    shutil.copytree(models, tmp_path / KLEIN_BASE_REPO)
    write_synthetic_dataset(tmp_path / DATA, count=3, size=48, seed=8)
    done = user_shell.script(DIFFSYNTH_COMMANDS, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: flux2_klein (the model id black-forest-labs/FLUX.2-klein-4B)" in done.stdout
    assert "pipeline: flux2_klein (the model id black-forest-labs/FLUX.2-klein-base-4B)" in done.stdout
    out = tmp_path / "models" / "train" / "FLUX.2-klein-base-4B_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == ["epoch-0.safetensors", "epoch-1.safetensors"]
    keys = load_file(str(out / "epoch-1.safetensors"))
    adapted = {k.split(".lora_")[0].removeprefix("transformer.") for k in keys}
    present = {n for n, m in diffusers.Flux2Transformer2DModel.from_pretrained(str(models / "transformer")).named_modules()
               if isinstance(m, torch.nn.Linear)}
    reached = {n for n in present if any(n == t or n.endswith("." + t) for t in diffsynth_targets())}
    # the tiny DiT's one double block (4 + 4 attention projections, 2 + 2 feed-forward layers) and one single block (2)
    assert adapted == reached and len(adapted) == 14
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(str(tmp_path / KLEIN_REPO))
    before = pipe.transformer.single_transformer_blocks[0].attn.to_out.weight.detach().clone()
    pipe.load_lora_weights(str(out / "epoch-1.safetensors"))
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.single_transformer_blocks[0].attn.to_out.weight, before)


@pytest.mark.slow
def test_diffsynths_flux2_dev_lora_commands_run_verbatim(dev_models, tmp_path, user_shell):
    """examples/flux2/model_training/lora/FLUX.2-dev.sh: stage 1 with the Mistral text encoder and the VAE (the
    tokenizer from DiffSynth's default, FLUX.2-dev:tokenizer/), stage 2 with the DiT alone from the cache."""
    shutil.copytree(dev_models, tmp_path / DEV_REPO)
    write_synthetic_dataset(tmp_path / DEV_DATA, count=3, size=48, seed=8)
    done = user_shell.script(DEV_COMMANDS, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("pipeline: flux2 (the model id black-forest-labs/FLUX.2-dev)") == 2
    out = tmp_path / "models" / "train" / "FLUX.2-dev-LoRA-splited"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == ["epoch-0.safetensors", "epoch-1.safetensors"]
    keys = load_file(str(out / "epoch-1.safetensors"))
    assert len({k.split(".lora_")[0] for k in keys}) == 14 and all(k.startswith("transformer.") for k in keys)
    pipe = diffusers.Flux2Pipeline.from_pretrained(str(tmp_path / DEV_REPO))
    before = pipe.transformer.transformer_blocks[0].ff.linear_in.weight.detach().clone()
    pipe.load_lora_weights(str(out / "epoch-1.safetensors"))
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.transformer_blocks[0].ff.linear_in.weight, before)


@pytest.mark.slow
def test_diffsynths_klein_edit_command_runs_verbatim(models, tmp_path, user_shell):
    """The edit command DiffSynth's klein LoRA example ships (commented out), on its Qwen-Image-Edit-2511 example
    data's layout (metadata.json naming image and edit_image): it trains flux2_klein_edit, and the LoRA loads into
    Flux2KleinPipeline."""
    shutil.copytree(models, tmp_path / KLEIN_REPO)
    data = tmp_path / EDIT_DATA
    csv_path = write_synthetic_dataset(data, count=2, size=48, seed=8, images=["edit_image"])
    import csv

    with csv_path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    (data / "metadata.json").write_text(json.dumps(rows), encoding="utf-8")
    csv_path.unlink()
    done = user_shell.script(EDIT_COMMAND, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("pipeline: flux2_klein_edit (the model id black-forest-labs/FLUX.2-klein-4B; the metadata column "
            "edit_image)") in done.stdout
    out = tmp_path / "models" / "train" / "FLUX.2-klein-4B_lora" / "epoch-0.safetensors"
    keys = load_file(str(out))
    assert len({k.split(".lora_")[0] for k in keys}) == 14
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(str(tmp_path / KLEIN_REPO))
    before = pipe.transformer.single_transformer_blocks[0].attn.to_out.weight.detach().clone()
    pipe.load_lora_weights(str(out))
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.single_transformer_blocks[0].attn.to_out.weight, before)

"""The LTX-2 family beyond the conformance suite: its units compute what diffusers' LTX2Pipeline computes (Gemma 3's
hidden states through the connectors, the video VAE's normalised latents, the transformer call of a denoising step),
its loss is DiffSynth-Studio's FlowMatchSFTAudioVideoLoss with its "LTX-2" template, its default LoRA targets are
DiffSynth's example's modules, and DiffSynth's LTX-2 commands port.
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
from unitgraph.backends.diffusion.families import ltx2  # noqa: E402
from unitgraph.backends.diffusion.families.ltx2 import losses, render, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import posterior_mean  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from shallow import shallow  # noqa: E402

SIZE = 32
FRAMES = 9
REPO = Path(__file__).resolve().parents[1]
WHEEL = REPO / ".venv" / "diffsynth-wheel" / "diffsynth"
needs_wheel = pytest.mark.skipif(not (WHEEL / "diffusion" / "flow_match.py").is_file(),
                                 reason="the diffsynth wheel is not unpacked")
DIFFSYNTH_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("ltx2") / "models", size="test", seed=0)


@pytest.fixture(scope="module")
def pipe(models):
    pipe = diffusers.LTX2Pipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def context(pipe, **settings) -> UnitContext:
    loaded = {"dit": pipe.transformer, "video_vae_encoder": pipe.vae, "audio_vae_encoder": pipe.audio_vae,
              "text_encoder": pipe.text_encoder, "text_encoder_post_modules": pipe.connectors,
              "tokenizer": pipe.tokenizer, "scheduler": pipe.scheduler}
    return UnitContext(models=loaded, settings=UnitSettings(**settings))


def clip(frames: int = FRAMES, size: int = SIZE) -> list:
    from PIL import Image

    return [Image.new("RGB", (size, size), (20 * k % 255, 90, 200 - 10 * k)) for k in range(frames)]


# ------------------------------------------------------------------------------------------------
# the plans


def test_the_plans_keep_what_does_not_train_in_stage_1():
    import unitgraph

    pipeline = ltx2.LTX2.spec_pipeline
    lora = unitgraph.split(pipeline, lora_base_model="dit")
    assert set(lora.data_process_models) == {"text_encoder", "text_encoder_post_modules", "video_vae_encoder",
                                             "audio_vae_encoder"}
    assert lora.train_models == ["dit"]
    assert set(lora.train_units) == {"NoiseInitializer", "AudioNoiseInitializer", "TimestepSampler"}
    assert {p for p, _ in lora.cache_entries} == {"input_latents", "video_context", "audio_context", "context_mask",
                                                  "audio_latents", "num_frames"}
    text = unitgraph.split(pipeline, lora_base_model="text_encoder")
    assert "PromptEncoder" in text.train_units
    assert set(text.train_models) == {"dit", "text_encoder", "text_encoder_post_modules"}
    for plan in (lora, text):
        assert unitgraph.verify(pipeline, plan) == []


# ------------------------------------------------------------------------------------------------
# the units against diffusers' LTX2Pipeline


def test_the_tiny_tokenizer_is_gemmas_left_padded_layout(pipe):
    tokenizer = pipe.tokenizer
    ids = tokenizer("a red circle").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
    assert len(ids) <= 5  # whole words
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a red circle"


def test_prompt_units_match_the_pipelines_encode_prompt_and_connectors(pipe):
    ctx = context(pipe)
    prompts = ["a green square on a white background", "a dog "]
    embeds, mask, _, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False)
    assert embeds.shape[1] == u.TEXT_LENGTH == 1024
    video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side="left")
    for k, prompt in enumerate(prompts):
        ours = u.prompt_encoder(ctx, {"prompt": prompt})
        assert torch.equal(ours["video_context"][0], video[k]) and torch.equal(ours["audio_context"][0], audio[k])
        assert torch.equal(ours["context_mask"][0], connector_mask[k])
    # Gemma's hidden states of every layer and the embeddings' (layers + 1), left-padded
    hidden, our_mask = u.gemma_hidden_states(ctx, prompts)
    assert torch.equal(hidden, embeds) and torch.equal(our_mask, mask) and int(mask[0, 0]) == 0 == int(mask[1, 0])
    layers = pipe.text_encoder.config.text_config.num_hidden_layers
    assert hidden.shape[-1] == pipe.text_encoder.config.text_config.hidden_size * (layers + 1)
    # the batched form gives each prompt its own contexts
    batched = u.prompt_encoder.run_batch(ctx, [{"prompt": p} for p in prompts])
    for k, out in enumerate(batched):
        assert torch.allclose(out["video_context"][0], video[k], atol=1e-6)


def test_the_latents_are_the_video_vaes_normalised_posterior(pipe):
    """Our latent is the posterior's mode normalised as LTX2Pipeline normalises latents (what its image-to-video
    pipeline does to an encoded image, and its decode undoes); DiffSynth trains on the same."""
    ctx = dataclasses.replace(context(pipe), epoch=0, sample_key="s")
    pixels = torch.rand(1, 3, FRAMES, SIZE, SIZE) * 2 - 1
    out = u.video_encoder(ctx, {"video": pixels})
    posterior = pipe.vae.encode(pixels).latent_dist
    theirs = pipe._normalize_latents(posterior.mode(), pipe.vae.latents_mean, pipe.vae.latents_std,
                                     pipe.vae.config.scaling_factor)
    assert torch.equal(out["latent_mean"], theirs)
    assert torch.equal(posterior_mean(ctx, out)["input_latents"], out["latent_mean"])
    t = pipe.vae_temporal_compression_ratio
    assert out["latent_mean"].shape == (1, pipe.vae.config.latent_channels, (FRAMES - 1) // t + 1,
                                        SIZE // pipe.vae_spatial_compression_ratio, SIZE // pipe.vae_spatial_compression_ratio)


def test_clips_are_cut_to_8k_plus_1_frames_of_sides_multiples_of_32(pipe):
    from unitgraph.backends.diffusion.context import ImageSize

    ctx = context(pipe, image_size=ImageSize(height=64, width=96))
    shaped = u.video_shape_checker(ctx, {"video": clip(frames=12, size=100)})
    assert shaped["video"].shape == (1, 3, 9, 64, 96) and shaped["num_frames"] == 9
    assert (shaped["height"], shaped["width"]) == (64, 96)
    assert [u.frames_kept(n) for n in (1, 5, 9, 16, 17, 121)] == [1, 1, 9, 9, 17, 121]
    with pytest.raises(BackendError, match="no video"):
        u.video_shape_checker(ctx, {"video": None})


def test_the_audio_noise_has_the_pipelines_audio_length(pipe):
    """A clip of F frames at 24 fps has LTX2Pipeline's round(F / 24 x sample rate / hop / 4) audio latents, each token
    audio_in_channels wide (channels x latent mel bins)."""
    ctx = dataclasses.replace(context(pipe), epoch=0, sample_key="s")
    out = u.audio_noise_initializer(ctx, {"num_frames": 121, "audio_latents": None})["audio_noise"]
    latents_per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / pipe.audio_vae_temporal_compression_ratio
    assert out.shape == (1, round(121 / 24.0 * latents_per_second), pipe.transformer.config.audio_in_channels)
    assert out.shape[1] == 126  # LTX-2's 5 s clip: 25 audio latents a second
    mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    assert out.shape[2] == pipe.audio_vae.config.latent_channels * mel


def test_the_losss_dit_call_is_the_pipelines_denoising_step(pipe):
    """The transformer call LTX2Pipeline makes in a denoising step (captured), made again by the loss's predict() from
    our units' contexts and the same latents at the scheduler's timestep: the same video and audio velocities."""
    ctx = context(pipe)
    prompt = "a dog"
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out)),
                                                  with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt=prompt, height=SIZE, width=SIZE, num_frames=FRAMES, frame_rate=24.0, num_inference_steps=2,
                 guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    kwargs, (video_out, audio_out) = calls[0]
    ours = u.prompt_encoder(ctx, {"prompt": prompt})
    assert torch.equal(ours["video_context"], kwargs["encoder_hidden_states"])
    assert torch.equal(ours["audio_context"], kwargs["audio_encoder_hidden_states"])
    f, h, w = kwargs["num_frames"], kwargs["height"], kwargs["width"]
    latents = losses.unpack(kwargs["hidden_states"], (1, pipe.transformer.config.in_channels, f, h, w))
    assert torch.equal(losses.pack(latents), kwargs["hidden_states"])
    assert kwargs["audio_num_frames"] == u.audio_latent_frames(pipe.transformer.config, FRAMES)
    with torch.no_grad():
        video, audio = losses.predict(ctx, latents, kwargs["audio_hidden_states"], kwargs["timestep"],
                                      ours["video_context"], ours["audio_context"], ours["context_mask"])
    assert torch.equal(losses.pack(video), video_out) and torch.equal(audio, audio_out)


def test_render_draws_what_the_pipeline_draws(pipe):
    ctx = context(pipe)
    embeds = u.prompt_encoder(ctx, {"prompt": "a cat"})
    models = {"dit": pipe.transformer, "video_vae_encoder": pipe.vae, "audio_vae_encoder": pipe.audio_vae,
              "vocoder": pipe.vocoder, "scheduler": pipe.scheduler}
    negative = u.prompt_encoder(ctx, {"prompt": ""})  # its guidance is against the empty prompt
    got, sound = render.render(ltx2.LTX2, models, embeds, SIZE, SIZE, 2, torch.Generator().manual_seed(1),
                               negative=negative)
    # the pipeline's classifier-free guidance at its defaults (3 for the video, 7 for the sound), its STG, modality
    # isolation and rescale off
    out = pipe(prompt="a cat", width=SIZE, height=SIZE, num_frames=render.FRAMES, num_inference_steps=2,
               stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
               audio_guidance_rescale=0.0, use_cross_timestep=False, generator=torch.Generator().manual_seed(1))
    frames = out.frames[0]
    # the sound: the pipeline's own waveform (audio VAE, then vocoder), at the vocoder's rate
    assert sound.rate == pipe.vocoder.config.output_sampling_rate and sound.samples.shape == out.audio[0].shape
    assert torch.allclose(sound.samples, out.audio[0].float(), atol=1e-5)
    # without a vocoder (a folder that has none) the frames alone
    alone = render.render(ltx2.LTX2, {k: v for k, v in models.items() if k != "vocoder"}, embeds, SIZE, SIZE, 2,
                          torch.Generator().manual_seed(1), negative=negative)
    assert alone.tobytes() == got.tobytes()
    import numpy as np

    assert got.size == (SIZE * render.FRAMES, SIZE) and len(frames) == render.FRAMES
    expected = np.concatenate([np.asarray(f) for f in frames], axis=1).astype(int)
    diff = np.abs(np.asarray(got).astype(int) - expected)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3  # the same clip (float rounding may move a pixel by 1)


# ------------------------------------------------------------------------------------------------
# sound: read from the mp4 with PyAV, a log-mel spectrogram through the audio VAE


def tone(seconds: float = 1.0, rate: int = 16000, channels: int = 2):
    import numpy as np

    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    wave = 0.3 * np.sin(2 * np.pi * 440.0 * t).astype(np.float32)
    return np.stack([wave * (1.0 - 0.5 * c) for c in range(channels)]), rate


def test_a_clips_sound_track_reads_back_from_the_mp4(tmp_path):
    import numpy as np

    from unitgraph.backends.diffusion.data.audio import read_audio, resample
    from unitgraph.backends.diffusion.data.video import write_clip

    samples, rate = tone()
    path = write_clip(tmp_path / "c.mp4", clip(size=32), audio=(samples, rate))
    got, got_rate = read_audio(path)
    assert got_rate == rate and got.shape[0] == 2 and got.dtype == np.float32
    n = min(got.shape[1], samples.shape[1]) - 2048  # AAC's priming delay and tail aside, the tone is there
    lag = int(np.argmax(np.correlate(got[0, :4096], samples[0, :2048], mode="valid")))
    assert np.corrcoef(got[0, lag:lag + n - 4096], samples[0, :n - 4096])[0, 1] > 0.99
    assert read_audio(write_clip(tmp_path / "silent.mp4", clip(size=32))) is None  # no sound track: no audio
    assert resample(samples, rate, 8000).shape == (2, samples.shape[1] // 2)


def test_the_mel_filters_and_log_mel_are_slaneys():
    """The filters and the log-mel spectrogram DiffSynth's AudioProcessor computes with torchaudio (Slaney scale and
    area norm, a centred 1024-point Hann STFT of magnitudes, log floored at 1e-5), checked against transformers' own
    numpy implementation of the same."""
    import numpy as np
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    ours = u.slaney_mel_filters(513, 64, 16000).numpy()
    theirs = mel_filter_bank(num_frequency_bins=513, num_mel_filters=64, min_frequency=0.0, max_frequency=8000.0,
                             sampling_rate=16000, norm="slaney", mel_scale="slaney")
    assert np.allclose(ours, theirs, atol=1e-6)
    samples, rate = tone(0.5)
    mel = u.log_mel(torch.from_numpy(samples), rate, 160, 64)
    expected = spectrogram(samples[1], window_function(1024, "hann"), frame_length=1024, hop_length=160, power=1.0,
                           center=True, pad_mode="reflect", mel_filters=theirs, mel_floor=1e-5, log_mel="log")
    assert mel.shape == (1, 2, expected.shape[1], 64)
    assert np.allclose(mel[0, 1].numpy(), expected.T, atol=5e-3)  # float32 rounding at the quietest bins


def test_the_sound_is_cut_to_the_clip_stereo_at_the_vaes_rate():
    mono = tone(2.0, rate=8000, channels=1)
    out = u.clip_audio(mono, 25, 16000)  # 25 frames at 24 fps
    assert out.shape == (2, int(25 / 24 * 16000)) and torch.equal(out[0], out[1])
    short = u.clip_audio(tone(0.1), 25, 16000)
    assert short.shape[1] == int(25 / 24 * 16000) and float(short[:, 1600:].abs().max()) == 0.0
    with pytest.raises(BackendError, match="mono or stereo"):
        u.clip_audio(tone(0.1, channels=3), 25, 16000)


def test_the_audio_latents_are_the_pipelines_normalised_packed_latents(pipe):
    """The audio VAE's posterior mode of the clip's log-mel spectrogram, packed into tokens and normalised as
    LTX2Pipeline.prepare_audio_latents normalises given audio latents (with no noise mixed in); None without sound,
    and then the audio noise has the pipeline's length."""
    ctx = dataclasses.replace(context(pipe), epoch=0, sample_key="s")
    track = tone(1.0)
    out = u.audio_encoder(ctx, {"input_audio": track, "num_frames": 25})["audio_latents"]
    config = pipe.audio_vae.config
    mel = u.log_mel(u.clip_audio(track, 25, config.sample_rate), config.sample_rate, config.mel_hop_length,
                    config.mel_bins)
    latents = pipe.audio_vae.encode(mel).latent_dist.mode()
    theirs = pipe.prepare_audio_latents(1, latents.shape[1], latents.shape[2], config.mel_bins, 0.0, torch.float32,
                                        "cpu", None, latents)
    assert torch.equal(out, theirs) and out.shape[2] == pipe.transformer.config.audio_in_channels
    noise = u.audio_noise_initializer(ctx, {"num_frames": 25, "audio_latents": out})["audio_noise"]
    assert noise.shape == out.shape
    assert u.audio_encoder(ctx, {"input_audio": None, "num_frames": 25}) == {"audio_latents": None}


def test_the_dataset_reads_the_input_audio_column(tmp_path):
    from unitgraph.backends.diffusion.data.dataset import DiffusionDataset

    write_synthetic_dataset(tmp_path, count=2, size=SIZE, seed=3, videos=("video",), frames=FRAMES, audio=True)
    dataset = DiffusionDataset(tmp_path, tmp_path / "metadata.csv", ["video", "prompt", "input_audio"],
                               required=("video", "prompt"), optional=("input_audio",), image_params=(),
                               video_params=("video",), num_frames=FRAMES, audio_params=("input_audio",))
    dataset.check(0)
    sample = dataset.sample(0)
    samples, rate = sample["input_audio"]
    assert rate == 16000 and samples.shape[0] == 2 and samples.shape[1] >= 16000 * FRAMES // 8 - 1024
    assert len(sample["video"]) == FRAMES


# ------------------------------------------------------------------------------------------------
# the objective against DiffSynth-Studio's own code



@pytest.fixture(scope="module")
def diffsynth():
    """DiffSynth's flow_match and loss modules, loaded from the wheel's files (loss.py's one package import stood in for)."""
    with wheel_modules("_ltx2_diffsynth", "flow_match", "loss") as modules:
        yield modules


def _scheduler(flow_match):
    scheduler = flow_match.FlowMatchScheduler("LTX-2")
    scheduler.set_timesteps(1000, training=True)  # as DiffSynth's training module sets it up
    return scheduler


@needs_wheel
def test_the_training_schedule_and_weight_are_diffsynths_ltx2_template(diffsynth):
    theirs = _scheduler(diffsynth[0])
    schedule = u.TRAINING_SCHEDULE
    assert torch.allclose(schedule.sigmas(), theirs.sigmas.float(), atol=1e-6, rtol=0)
    assert torch.allclose(schedule.weights(), theirs.linear_timesteps_weights.float(), atol=1e-5, rtol=1e-5)
    assert float(schedule.sigmas()[0]) == pytest.approx(1.0) and float(schedule.sigmas()[-1]) == pytest.approx(0.1, abs=1e-6)


def test_the_timestep_sampler_draws_a_position_of_the_schedule_and_its_weight():
    sigmas, weights = u.TRAINING_SCHEDULE.sigmas(), u.TRAINING_SCHEDULE.weights()
    for k in range(10):
        ctx = UnitContext(models={}, settings=UnitSettings(timestep_bounds=(0.0, 0.25), seed=5), epoch=0,
                          sample_key=f"s{k}")
        out = u.timestep_sampler(ctx, {})
        index = int(torch.argmin((sigmas * 1000 - out["timestep"]).abs()))
        assert index < 250 and float(out["loss_weight"]) == float(weights[index])


def _model_fn(pipe):
    """DiffSynth's model_fn_ltx2 around diffusers' DiT: its video latents (B, C, F, H, W) packed into tokens, its audio
    latents (B, C_a, L, M) packed as (B, L, C_a x M), the timestep over 1000 (its DiT multiplies it back)."""

    def model_fn(dit, video_latents=None, audio_latents=None, video_context=None, audio_context=None,
                 context_mask=None, timestep=None, **kwargs):
        b, c, f, h, w = video_latents.shape
        audio = audio_latents.transpose(1, 2).flatten(2)
        t = (timestep.float() / 1000.0) * 1000.0
        video, audio_out = dit(hidden_states=video_latents.flatten(2).transpose(1, 2), audio_hidden_states=audio,
                               encoder_hidden_states=video_context, audio_encoder_hidden_states=audio_context,
                               timestep=t.expand(b), sigma=t.expand(b), encoder_attention_mask=context_mask,
                               audio_encoder_attention_mask=context_mask, num_frames=f, height=h, width=w,
                               fps=24.0, audio_num_frames=audio.shape[1], return_dict=False)
        return video.transpose(1, 2).reshape(b, c, f, h, w), audio_out.unflatten(2, (audio_latents.shape[1], -1)).transpose(1, 2)

    return model_fn


@needs_wheel
@pytest.mark.parametrize("position", [0, 371, 999])
@pytest.mark.parametrize("with_audio", [False, True])
def test_the_loss_is_diffsynths_audio_video_loss(pipe, diffsynth, position, with_audio, monkeypatch):
    """Given the timestep and noise DiffSynth's loss draws, our loss is the value of its FlowMatchSFTAudioVideoLoss with
    its LTX-2 template around the same DiT: the video term, plus the audio term with the same weight for a clip with
    sound; without sound the audio stream gets the noise DiffSynth's NoiseInitializer draws, and no term."""
    flow_match, loss = diffsynth
    scheduler = _scheduler(flow_match)
    ctx = context(pipe, loss_weighting="diffsynth")
    state = u.prompt_encoder(ctx, {"prompt": "a red circle"})
    channels = pipe.transformer.config.in_channels
    gen = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(1, channels, 5, 4, 4, generator=gen), torch.randn(1, channels, 5, 4, 4, generator=gen)
    mel = pipe.audio_vae.config.mel_bins // 4
    a_channels = pipe.audio_vae.config.latent_channels
    a0, a_noise = torch.randn(1, a_channels, 9, mel, generator=gen), torch.randn(1, a_channels, 9, mel, generator=gen)
    theirs_pipe = types.SimpleNamespace(scheduler=scheduler, torch_dtype=torch.float32, device="cpu",
                                        in_iteration_models=("dit",), dit=pipe.transformer, model_fn=_model_fn(pipe))
    draws = iter([noise, a_noise])
    monkeypatch.setattr(loss.torch, "randint", lambda *a, **k: torch.tensor([position]))
    monkeypatch.setattr(loss.torch, "randn_like", lambda like: next(draws).clone())
    inputs = dict(input_latents=x0, video_context=state["video_context"], audio_context=state["audio_context"],
                  context_mask=state["context_mask"])
    inputs.update(audio_input_latents=a0) if with_audio else inputs.update(audio_latents=a_noise)
    with torch.no_grad():
        theirs = loss.FlowMatchSFTAudioVideoLoss(theirs_pipe, **inputs)
    monkeypatch.undo()
    timestep = scheduler.timesteps[position:position + 1].float()
    weight = u.TRAINING_SCHEDULE.weights()[position:position + 1]
    packed_noise = a_noise.transpose(1, 2).flatten(2)
    params = {"input_latents": x0, "noise": noise, "timestep": timestep, "loss_weight": weight,
              "audio_noise": packed_noise, "audio_latents": a0.transpose(1, 2).flatten(2) if with_audio else None, **state}
    with torch.no_grad():
        ours = losses.flow_matching_loss(ctx, params)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------------------
# LoRA targets, model ids


def test_the_default_dit_targets_are_diffsynths_example_modules(pipe):
    """Its LTX-2 LoRA examples' suffixes reach every attention of the DiT (video and audio self-, cross- and
    audio-video attentions) and nothing else; no aliases (its DiT names them as diffusers' does)."""
    slot = ltx2.FAMILY.slot("dit")
    assert slot.lora_targets == DIFFSYNTH_TARGETS and slot.lora_modules(DIFFSYNTH_TARGETS) == DIFFSYNTH_TARGETS
    modules = dict(pipe.transformer.named_modules())
    reached = [n for n in modules if any(n.endswith("." + s) for s in DIFFSYNTH_TARGETS)]
    attentions = [n for n, m in modules.items() if type(m).__name__ == "LTX2Attention"]
    assert len(reached) == 4 * len(attentions) and all(isinstance(modules[n], torch.nn.Linear) for n in reached)


def test_the_model_ids_choose_ltx2():
    ids = ",".join(f"{ltx2.LTX2_MODEL}:{p}" for p in ("transformer/*.safetensors", "connectors/*.safetensors",
                                                      "vae/*.safetensors"))
    chosen = choose(make_args(model_id_with_origin_paths=ids, lora_base_model="dit"))
    assert chosen.line == f"pipeline: ltx2 (the model id {ltx2.LTX2_MODEL})"


def test_the_released_configs_build_to_the_published_sizes(capsys, tmp_path):
    """Published: LTX-2 "19B" (Lightricks' model card: a 14B video and a 5B audio stream; 18.88 B counted, 5.71 B of
    them audio), Gemma 3 12B "12B" (12.19 B counted with its SigLIP tower, as google/gemma-3-12b-it lists it)."""
    from unitgraph.backends.diffusion.memory_plan import build_meta
    from unitgraph.backends.diffusion.models.sources import ModelSources

    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", "ltx2", "--size", "real")
    assert code == 0, err
    assert "no weights" in out and not list((tmp_path / "real").rglob("*.safetensors"))
    sources = ModelSources(ltx2.SLOTS, str(tmp_path / "real"), offline=True)
    counts = {}
    for slot in ("dit", "text_encoder", "text_encoder_post_modules"):
        model = build_meta(ltx2.FAMILY.slot(slot), sources.load_config(slot), "bfloat16")
        counts[slot] = sum(p.numel() for p in model.parameters())
        if slot == "dit":
            audio = sum(p.numel() for n, p in model.named_parameters() if "audio" in n)
            assert abs(audio - 5.0e9) < 0.15 * 5.0e9 and abs(counts[slot] - audio - 14e9) < 0.07 * 14e9
    assert abs(counts["dit"] - 19e9) < 0.01 * 19e9
    assert abs(counts["text_encoder"] - 12.19e9) < 0.005 * 12.19e9
    scheduler = sources.load(["scheduler"])["scheduler"]
    assert scheduler.config.use_dynamic_shifting and scheduler.config.shift_terminal == 0.1


@pytest.mark.slow
def test_the_dry_run_of_the_released_model_at_768x512(capsys, tmp_path):
    """Stage 2 of a DiT LoRA holds the DiT alone; DiffSynth's 768 x 512 x 121-frame clips are 128 x 16 x 16 x 24 latents
    (6144 video tokens), 126 audio tokens (5 s at 25 a second) and 1024 text tokens."""
    from unitgraph.backends.diffusion.families.ltx2 import real

    shallow(real.write_real_configs(tmp_path / "real"))  # 2 blocks: what is checked does not depend on depth
    code, out, err = cli(capsys, "train", "--dry_run", "--json", "--model_paths", str(tmp_path / "real"),
                         "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--height", "512",
                         "--width", "768", "--num_frames", "121")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    assert set(plan["stages"]["train"]["models"]) == {"dit"}
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder", "text_encoder_post_modules",
                                                            "video_vae_encoder", "audio_vae_encoder"}
    size = plan["settings"]["size"]
    assert size["latent"] == [128, 16, 16, 24] and size["image_tokens"] == 6144
    assert size["audio_tokens"] == 126 and size["text_tokens"] == 1024


# ------------------------------------------------------------------------------------------------
# runs


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ltx2-data")
    write_synthetic_dataset(folder, count=2, size=SIZE, seed=1, videos=("video",), frames=FRAMES)
    return folder


@pytest.mark.slow
def test_validation_samples_render_in_stage_2(models, data, tmp_path):
    from PIL import Image

    common = dict(pipeline="ltx2", model_paths=str(models), lora_base_model="dit", lora_rank=4, height=SIZE, width=SIZE,
                  num_frames=FRAMES, progress=False, plot=False, validation_prompt=["a red circle"])
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(tmp_path / "cache"), **common), echo=quiet)
    result = run(make_args(task="sft:train", dataset_base_path=str(tmp_path / "cache"), output_path=str(tmp_path / "out"),
                           validation_inference_steps=2, **common), echo=quiet)
    assert result.steps == 2
    assert Image.open(tmp_path / "out" / "samples" / "epoch-0" / "0.png").size == (SIZE * render.FRAMES, SIZE)
    # the clip's sound beside its frames, a WAV file samples.html plays
    import wave

    with wave.open(str(tmp_path / "out" / "samples" / "epoch-0" / "0.wav")) as sound:
        vocoder = json.loads((models / "vocoder" / "config.json").read_text())
        assert sound.getsampwidth() == 2 and sound.getframerate() == vocoder.get("output_sampling_rate", 24000)
        assert sound.getnframes() > 0
    page = (tmp_path / "out" / "samples.html").read_text()
    assert '<audio controls src="samples/epoch-0/0.wav">' in page


# ------------------------------------------------------------------------------------------------
# DiffSynth-Studio's LTX-2 commands

LTX2_REPO = Path("models") / "Lightricks" / "LTX-2"
GEMMA_REPO = Path("models") / "google" / "gemma-3-12b-it-qat-q4_0-unquantized"
REPACKAGED = ("DiffSynth-Studio/LTX-2-Repackage:text_encoder_post_modules.safetensors,"
              "DiffSynth-Studio/LTX-2-Repackage:video_vae_encoder.safetensors,"
              "DiffSynth-Studio/LTX-2-Repackage:audio_vae_encoder.safetensors,"
              "google/gemma-3-12b-it-qat-q4_0-unquantized:model-*.safetensors")
DIFFUSERS_LAYOUT = ("Lightricks/LTX-2:connectors/*.safetensors,Lightricks/LTX-2:vae/*.safetensors,"
                    "Lightricks/LTX-2:audio_vae/*.safetensors,google/gemma-3-12b-it-qat-q4_0-unquantized:model-*.safetensors")

# examples/ltx2/model_training/lora/LTX-2-T2AV-noaudio.sh and LTX-2-T2AV-splited.sh, their split training commands
# verbatim but for the program name (`accelerate launch examples/ltx2/model_training/train.py` -> `unitgraph train`)
# and the sizes: --height 512 --width 768 lowered to 32 x 32, --num_frames 121 to 9, --dataset_repeat 100 to 1,
# --num_epochs 5 to 2, --lora_rank 32 to 8 (the tiny DiT's attentions are 16 wide).
DIFFSYNTH_COMMANDS = {
    "noaudio": (r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/ltx2/LTX-2-T2AV-noaudio \
  --dataset_metadata_path data/diffsynth_example_dataset/ltx2/LTX-2-T2AV-noaudio/metadata.csv \
  --height 32 \
  --width 32 \
  --num_frames 9\
  --dataset_repeat 1 \
  --model_id_with_origin_paths "{encoders}" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/LTX2-T2AV-noaudio_lora-splited-cache" \
  --lora_base_model "dit" \
  --lora_target_modules "to_k,to_q,to_v,to_out.0" \
  --lora_rank 8 \
  --use_gradient_checkpointing \
  --task "sft:data_process"
""", r"""
unitgraph train \
  --dataset_base_path ./models/train/LTX2-T2AV-noaudio_lora-splited-cache \
  --height 32 \
  --width 32 \
  --num_frames 9\
  --dataset_repeat 1 \
  --model_id_with_origin_paths "{dit}" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/LTX2-T2AV-noaudio_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_k,to_q,to_v,to_out.0" \
  --lora_rank 8 \
  --use_gradient_checkpointing \
  --task "sft:train"
""", Path("data") / "diffsynth_example_dataset" / "ltx2" / "LTX-2-T2AV-noaudio", "LTX2-T2AV-noaudio_lora"),
    "splited": (r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/ltx2/LTX-2-T2AV-splited \
  --dataset_metadata_path data/diffsynth_example_dataset/ltx2/LTX-2-T2AV-splited/metadata.csv \
  --data_file_keys "video,input_audio" \
  --extra_inputs "input_audio" \
  --height 32 \
  --width 32 \
  --num_frames 9 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "{encoders}" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/LTX2-T2AV_lora-splited-cache" \
  --lora_base_model "dit" \
  --lora_target_modules "to_k,to_q,to_v,to_out.0" \
  --lora_rank 8 \
  --use_gradient_checkpointing \
  --task "sft:data_process"
""", r"""
unitgraph train \
  --dataset_base_path ./models/train/LTX2-T2AV_lora-splited-cache \
  --data_file_keys "video,input_audio" \
  --extra_inputs "input_audio" \
  --height 32 \
  --width 32 \
  --num_frames 9 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "{dit}" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/LTX2-T2AV_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_k,to_q,to_v,to_out.0" \
  --lora_rank 8 \
  --use_gradient_checkpointing \
  --task "sft:train"
""", Path("data") / "diffsynth_example_dataset" / "ltx2" / "LTX-2-T2AV-splited", "LTX2-T2AV_lora"),
}


def _place_models(models: Path, root: Path) -> None:
    """The tiny folder where DiffSynth downloads Lightricks/LTX-2, and its Gemma where it downloads the Gemma 3
    checkpoint: config.json, the tokenizer and the weights in shards named model-*.safetensors at the top."""
    from transformers import Gemma3ForConditionalGeneration

    shutil.copytree(models, root / LTX2_REPO)
    gemma = Gemma3ForConditionalGeneration.from_pretrained(str(models / "text_encoder"))
    gemma.save_pretrained(str(root / GEMMA_REPO), max_shard_size="100KB")
    assert list((root / GEMMA_REPO).glob("model-*.safetensors"))
    for file in (models / "tokenizer").iterdir():
        shutil.copy(file, root / GEMMA_REPO / file.name)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["noaudio", "splited"])
def test_diffsynths_ltx2_split_commands_port(models, tmp_path, script, user_shell):
    """Verbatim, each command names DiffSynth's repackaged single files, which unitgraph does not read: it stops with
    one line naming the diffusers layout of the same components (Lightricks/LTX-2's subfolders, Gemma kept). With
    that layout named instead (and nothing else changed), the tiny models at DiffSynth's paths and its example data
    at its path, both stages run; the LoRA sits on every attention and LTX2Pipeline loads it."""
    data_process, train, data, out_name = DIFFSYNTH_COMMANDS[script]
    _place_models(models, tmp_path)
    write_synthetic_dataset(tmp_path / data, count=2, size=SIZE, seed=8, videos=("video",), frames=FRAMES,
                            audio=script == "splited")
    done = user_shell.script(data_process.format(encoders=REPACKAGED), tmp_path)
    assert done.returncode != 0
    line = done.stderr.strip().splitlines()[-1]
    assert f'name the diffusers layout instead: --model_id_with_origin_paths "{DIFFUSERS_LAYOUT}"' in line
    done = user_shell.script(data_process.format(encoders=DIFFUSERS_LAYOUT), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: ltx2" in done.stdout
    cache = tmp_path / "models" / "train" / f"{out_name}-splited-cache" / "entries"
    entries = list(cache.glob("*.safetensors"))
    assert len(entries) == 2
    for entry in entries:  # the clips' sound went through the audio VAE, for splited only
        assert ("audio_latents" in load_file(str(entry))) == (script == "splited")
    done = user_shell.script(train.format(dit="DiffSynth-Studio/LTX-2-Repackage:transformer.safetensors"), tmp_path)
    assert done.returncode != 0
    assert ('name the diffusers layout instead: --model_id_with_origin_paths "Lightricks/LTX-2:transformer/*.safetensors"'
            in done.stderr.strip().splitlines()[-1])
    done = user_shell.script(train.format(dit="Lightricks/LTX-2:transformer/*.safetensors"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: ltx2" in done.stdout
    out = tmp_path / "models" / "train" / out_name
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == ["epoch-0.safetensors", "epoch-1.safetensors"]
    keys = load_file(str(out / "epoch-1.safetensors"))
    adapted = {k.split(".lora_")[0].removeprefix("transformer.") for k in keys}
    dit = diffusers.LTX2VideoTransformer3DModel.from_pretrained(str(models / "transformer"))
    expected = {n for n, _ in dit.named_modules() if any(n.endswith("." + s) for s in DIFFSYNTH_TARGETS)}
    assert adapted == expected
    pipe = diffusers.LTX2Pipeline.from_pretrained(str(tmp_path / LTX2_REPO))
    before = pipe.transformer.transformer_blocks[0].attn1.to_q.weight.detach().clone()
    pipe.load_lora_weights(str(out / "epoch-1.safetensors"))
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.transformer_blocks[0].attn1.to_q.weight, before)


@pytest.mark.slow
def test_clips_with_sound_train_split_as_unsplit(models, tmp_path):
    """The conformance suite's split == unsplit, for clips with a sound track (the audio VAE in stage 1, the audio term
    in the loss): the same losses and the same LoRA."""
    from unitgraph.backends.diffusion.train.loop import read_loss_csv

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=SIZE, seed=4, videos=("video",), frames=FRAMES, audio=True)
    common = dict(pipeline="ltx2", model_paths=str(models), lora_base_model="dit", lora_rank=4, height=SIZE, width=SIZE,
                  num_frames=FRAMES, progress=False, plot=False, seed=5, learning_rate=1e-3, dataset_base_path=str(data),
                  dataset_metadata_path=str(data / "metadata.csv"), extra_inputs="input_audio",
                  data_file_keys="video,input_audio")
    run(make_args(task="sft", output_path=str(tmp_path / "unsplit"), **common), echo=quiet)
    split = run(make_args(task="sft:split", output_path=str(tmp_path / "split"), **common), echo=quiet)
    assert "AudioEncoder" in split.plan.data_process_units
    a, b = read_loss_csv(tmp_path / "unsplit" / "loss.csv"), read_loss_csv(tmp_path / "split" / "loss.csv")
    assert len(a) == 2 and [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-6, rel=0)
    wa, wb = (load_file(str(tmp_path / k / "epoch-0.safetensors")) for k in ("unsplit", "split"))
    assert set(wa) == set(wb) and all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)

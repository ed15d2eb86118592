"""LTX-2's units: each declaration right above the code that runs it.

Params of the ltx2 pipeline (one sample; tensors carry a batch dimension of 1), as diffusers' LTX2Pipeline computes
them and DiffSynth-Studio's LTX-2 training feeds them:

  dataset    video (a clip: the first --num_frames frames as PIL frames), prompt (str); input_audio (optional,
             DiffSynth's column: a file whose sound track is the clip's, as (samples, rate), None without one)
  shape      video becomes a float tensor (1, 3, F, H, W) in [-1, 1]: F cut to the largest 8k+1 the clip holds (the
             video VAE's temporal factor, DiffSynth's time_division_factor 8), each frame resized to cover the target
             size and centre-cropped to sides that are multiples of 32; height, width, num_frames
  vae        latent_mean, latent_logvar (1, 128, (F-1)/8+1, H/32, W/32): the video VAE's posterior, normalised as
             LTX2Pipeline normalises latents ((z - latents_mean) * scaling_factor / latents_std)
  text       video_context (1, 1024, D_v), audio_context (1, 1024, D_a), context_mask (1, 1024): Gemma 3's hidden
             states of every layer over the stripped prompt, left-padded to 1024 tokens, through the text connectors
             (LTX2Pipeline.encode_prompt and its `connectors` call; DiffSynth's PromptEmbedder with its post modules)
  audio      audio_latents (1, L_a, C_a): the sound cut to the clip's duration, stereo, at the audio VAE's rate, as a
             log-mel spectrogram through the audio VAE (the posterior's mode), packed into tokens and normalised by its
             latents_mean / latents_std as LTX2Pipeline normalises audio latents; None for a clip without sound
  latents    input_latents: the posterior mean (diffusers encodes conditions with the posterior's mode)
  fresh      noise; audio_noise (1, L_a, C_a): like audio_latents, or for a clip without sound the audio stream's
             whole input, pure noise as DiffSynth feeds it (L_a: the clip's duration at FRAME_RATE in audio latents, as
             LTX2Pipeline counts them); timestep and loss_weight: a position of TRAINING_SCHEDULE and its weight (non-deterministic)

Each function is `fn(ctx, **inputs) -> {output: value}` over one sample. torch is imported on first use.
"""

from __future__ import annotations

from typing import Any

from ...data.imaging import image_to_pixels
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, padded_prompts, unit
from ...flowmatch import TrainingSchedule, sample_training_timestep

torch = lazy_module("torch")

MULTIPLE = 32  # frame sides: DiffSynth's height/width_division_factor (the video VAE's spatial factor)
TIME_FACTOR = 8  # clip lengths are 8k+1 frames (DiffSynth's time_division_factor, the VAE's temporal factor)
TEXT_LENGTH = 1024  # LTX2Pipeline's max_sequence_length and DiffSynth's LTXVGemmaTokenizer max_length
FRAME_RATE = 24.0  # DiffSynth's --frame_rate default and LTX2Pipeline's: the video positions and the audio length
# DiffSynth-Studio's "LTX-2" training template (set_timesteps_ltx2 with 1000 steps): the exponential shift of a
# 4096-token sequence (mu = 2.05) over 1000 sigmas from 1 towards 0, stretched so that the last is 0.1
TRAINING_SCHEDULE = TrainingSchedule(mu=2.05, terminal=0.1)

# ------------------------------------------------------------------------------------------------
# shapes


def clip_frames(video: Any) -> list[Any]:
    """A sample's clip as a list of PIL frames (a single image is a one-frame clip)."""
    from PIL import Image

    if video is None:
        raise BackendError("sample has no video (the ltx2 pipeline needs a video column)")
    frames = list(video) if isinstance(video, (list, tuple)) else [video]
    if not frames or not all(isinstance(f, Image.Image) for f in frames):
        raise BackendError("expected a video clip (a list of frames)")
    return frames


def frames_kept(count: int) -> int:
    """The largest 8k+1 <= count: the frames of a clip LTX-2's VAE encodes whole (DiffSynth shortens clips so).

    >>> frames_kept(121), frames_kept(25), frames_kept(24), frames_kept(5)
    (121, 25, 17, 1)
    """
    return max(1, (int(count) - 1) // TIME_FACTOR * TIME_FACTOR + 1)


@unit("VideoShapeChecker", inputs=("video",), outputs=("video", "height", "width", "num_frames"),
      settings=("image_size", "dtype", "cache_dtype"))
def video_shape_checker(ctx, video: Any) -> dict[str, Any]:
    frames = clip_frames(video)
    frames = frames[:frames_kept(len(frames))]
    pixels = torch.stack([image_to_pixels(f, ctx.size, ctx.dtype, MULTIPLE) for f in frames], dim=2)  # (1, 3, F, H, W)
    return {"video": pixels, "height": int(pixels.shape[-2]), "width": int(pixels.shape[-1]),
            "num_frames": int(pixels.shape[2])}


# ------------------------------------------------------------------------------------------------
# video VAE


def latent_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The VAE's per-channel latents_mean and latents_std (buffers of the model) shaped (1, C, 1, 1, 1), and its
    scaling factor."""
    mean = vae.latents_mean.to(like.device, like.dtype).view(1, -1, 1, 1, 1)
    std = vae.latents_std.to(like.device, like.dtype).view(1, -1, 1, 1, 1)
    return mean, std, float(vae.config.scaling_factor)


def encode_distribution(ctx, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The video VAE posterior, normalised as LTX2Pipeline._normalize_latents normalises latents."""
    raw = ctx.raw("video_vae_encoder")
    posterior = ctx.model("video_vae_encoder").encode(ctx.tensor(pixels).to(raw.dtype)).latent_dist
    mean, std, scale = latent_stats(raw, posterior.mean)
    return ((posterior.mean - mean) * scale / std,
            posterior.logvar + 2.0 * torch.log(scale / std))


@unit("VideoEncoder", inputs=("video",), outputs=("latent_mean", "latent_logvar"), models=("video_vae_encoder",),
      settings=("dtype", "cache_dtype"), batch="stack")
def video_encoder(ctx, video: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, video)
    return {"latent_mean": mean, "latent_logvar": logvar}


# ------------------------------------------------------------------------------------------------
# audio VAE

N_FFT = 1024  # DiffSynth's AudioProcessor: a 1024-point STFT of Hann windows, hop and mel bins of the audio VAE


def slaney_mel_filters(n_freqs: int, n_mels: int, sample_rate: int) -> torch.Tensor:
    """(n_freqs, n_mels): triangular filters evenly spaced on the Slaney mel scale from 0 Hz to Nyquist, each
    normalised by its width (Slaney's area normalisation): torchaudio's melscale_fbanks(norm="slaney",
    mel_scale="slaney"), which DiffSynth's MelSpectrogram uses."""
    import math

    f_sp, min_log_hz, min_log_mel, logstep = 200.0 / 3, 1000.0, 15.0, math.log(6.4) / 27.0

    def to_mel(hz: float) -> float:
        return hz / f_sp if hz < min_log_hz else min_log_mel + math.log(hz / min_log_hz) / logstep

    def to_hz(mels: torch.Tensor) -> torch.Tensor:
        linear = f_sp * mels
        log = min_log_hz * torch.exp(logstep * (mels - min_log_mel))
        return torch.where(mels >= min_log_mel, log, linear)

    freqs = torch.linspace(0, sample_rate // 2, n_freqs)
    points = to_hz(torch.linspace(to_mel(0.0), to_mel(sample_rate / 2.0), n_mels + 2))
    widths = points[1:] - points[:-1]
    slopes = points.unsqueeze(0) - freqs.unsqueeze(1)
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    return filters * (2.0 / (points[2:n_mels + 2] - points[:n_mels])).unsqueeze(0)


def log_mel(samples: torch.Tensor, sample_rate: int, hop: int, n_mels: int) -> torch.Tensor:
    """(channels, n) float32 -> (1, channels, frames, n_mels): the log (floor 1e-5) of the magnitude mel spectrogram
    (DiffSynth's AudioProcessor.waveform_to_mel: centred reflect-padded frames, power 1)."""
    window = torch.hann_window(N_FFT, dtype=torch.float32)
    spec = torch.stft(samples.float(), N_FFT, hop_length=hop, win_length=N_FFT, window=window, center=True,
                      pad_mode="reflect", return_complex=True).abs()  # (channels, freqs, frames)
    mel = torch.matmul(spec.transpose(1, 2), slaney_mel_filters(N_FFT // 2 + 1, n_mels, sample_rate))
    return torch.log(torch.clamp(mel, min=1e-5)).unsqueeze(0)


def clip_audio(track: Any, num_frames: int, sample_rate: int) -> torch.Tensor:
    """A sound track as the audio VAE reads it: resampled to its rate, stereo (mono doubled), cut or zero-padded to
    the clip's duration at FRAME_RATE (DiffSynth's LoadAudioWithTorchaudio and convert_to_stereo)."""
    import numpy as np

    from ...data.audio import resample

    samples, rate = track
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 2 or samples.shape[0] not in (1, 2):
        raise BackendError(f"a sound track of shape {tuple(samples.shape)} (mono or stereo expected)")
    # the clip's own seconds are resampled, never the whole track: what it needs at the track's rate and a margin for
    # the resampler's filter (0.1 s, far more than its reach), so the samples kept are those of resampling it whole
    needed = int(np.ceil(int(num_frames) / FRAME_RATE * int(rate))) + int(rate) // 10 + 256
    samples = torch.from_numpy(resample(samples[:, :needed], int(rate), int(sample_rate)).copy())
    if samples.shape[0] == 1:
        samples = samples.repeat(2, 1)
    target = int(int(num_frames) / FRAME_RATE * sample_rate)
    if samples.shape[1] >= target:
        return samples[:, :target]
    return torch.nn.functional.pad(samples, (0, target - samples.shape[1]))


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, L, M) -> (B, L, C x M): LTX2Pipeline._pack_audio_latents (a token per latent audio frame)."""
    return latents.transpose(1, 2).flatten(2, 3)


@unit("AudioEncoder", inputs=("input_audio", "num_frames"), outputs=("audio_latents",), models=("audio_vae_encoder",),
      settings=("dtype", "cache_dtype"))
def audio_encoder(ctx, input_audio: Any, num_frames: int) -> dict[str, Any]:
    """The clip's sound as audio tokens (1, L, C x M): the log-mel spectrogram through the audio VAE (its posterior's
    mode), packed and normalised as LTX2Pipeline normalises audio latents; None for a clip without sound."""
    if input_audio is None:
        return {"audio_latents": None}
    raw = ctx.raw("audio_vae_encoder")
    config = raw.config
    samples = clip_audio(input_audio, num_frames, int(config.sample_rate))
    mel = log_mel(samples, int(config.sample_rate), int(config.mel_hop_length), int(config.mel_bins))
    posterior = ctx.model("audio_vae_encoder").encode(mel.to(ctx.device, raw.dtype)).latent_dist
    packed = pack_audio(posterior.mode())
    mean = raw.latents_mean.to(packed.device, packed.dtype)
    std = raw.latents_std.to(packed.device, packed.dtype)
    return {"audio_latents": ((packed - mean) / std).to(ctx.dtype)}


# ------------------------------------------------------------------------------------------------
# text


def gemma_hidden_states(ctx, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 3's hidden states of every layer (the embeddings' included), stacked on the last axis and flattened
    into one feature axis, over each stripped prompt left-padded to TEXT_LENGTH (LTX2Pipeline._get_gemma_prompt_embeds):
    (n, TEXT_LENGTH, D x (layers + 1)) and the 0/1 attention mask (n, TEXT_LENGTH)."""
    tokenizer = ctx.model("tokenizer")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokens = tokenizer([prompt_text(p).strip() for p in prompts], padding="max_length", max_length=TEXT_LENGTH,
                       truncation=True, add_special_tokens=True, return_tensors="pt")
    ids, mask = tokens.input_ids.to(ctx.device), tokens.attention_mask.to(ctx.device)
    hidden = ctx.model("text_encoder")(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    return torch.stack(hidden, dim=-1).flatten(2, 3), mask


def encode_prompts(ctx, prompts: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The video and audio contexts and their mask: the connectors over Gemma's hidden states (LTX2Pipeline.__call__)."""
    hidden, mask = gemma_hidden_states(ctx, prompts)
    dtype = ctx.model_dtype("text_encoder_post_modules")
    video, audio, context_mask = ctx.model("text_encoder_post_modules")(hidden.to(dtype), mask, padding_side="left")
    return video.to(ctx.dtype), audio.to(ctx.dtype), context_mask


@unit("PromptEncoder", inputs=("prompt",), outputs=("video_context", "audio_context", "context_mask"),
      models=("text_encoder", "text_encoder_post_modules"), settings=("dtype", "cache_dtype"),
      batch=padded_prompts(encode_prompts, "video_context", "audio_context", "context_mask"))
def prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    video, audio, mask = encode_prompts(ctx, [prompt])
    return {"video_context": video, "audio_context": audio, "context_mask": mask}


# ------------------------------------------------------------------------------------------------
# noise, timesteps


def audio_latent_frames(config: Any, num_frames: int, frame_rate: float = FRAME_RATE) -> int:
    """Audio latents of a clip of `num_frames` frames: its duration times the audio latents per second (sample rate
    / hop length / the audio VAE's temporal factor, read from the DiT's config), rounded (LTX2Pipeline.__call__)."""
    per_second = float(config["audio_sampling_rate"]) / float(config["audio_hop_length"]) / float(config["audio_scale_factor"])
    return max(1, round(int(num_frames) / float(frame_rate) * per_second))


@unit("AudioNoiseInitializer", inputs=("num_frames", "audio_latents"), outputs=("audio_noise",), deterministic=False,
      configs=("dit",), settings=("seed", "dtype", "cache_dtype"))
def audio_noise_initializer(ctx, num_frames: int, audio_latents: Any = None) -> dict[str, Any]:
    """Noise of the audio tokens: shaped like the clip's audio latents, or for a clip without sound (the audio stream's
    whole input then, as DiffSynth's NoiseInitializer draws it) (1, L_a, C_a), C_a the DiT's audio_in_channels
    (latent channels x latent mel bins)."""
    if audio_latents is not None:
        shape = tuple(audio_latents.shape)
    else:
        config = ctx.config("dit")
        shape = (1, audio_latent_frames(config, num_frames), int(config["audio_in_channels"]))
    return {"audio_noise": torch.randn(shape, generator=ctx.rng("audio_noise"), dtype=torch.float32).to(ctx.dtype)}


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "loss_weighting", "timestep_sampling", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    return sample_training_timestep(ctx, TRAINING_SCHEDULE)

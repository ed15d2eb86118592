"""LTX-2 at a run's size for the memory plan (memory_plan.py): the loss's inputs and each encoder's call, from configs.

The memory plan traces one step on fake tensors; running the pipeline's own units for that would need what a
config-only folder lacks (tokenizer files, clips), so the shapes the units would produce are made here, from the
VAEs', the connectors' and the DiT's configs, --num_frames and the units' constants. A clip is taken with its sound
(the audio stream's tokens are there either way; with sound the audio VAE also runs in stage 1). torch is imported on
first use.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from ...data.imaging import run_pixels
from ...family import lazy_module
from .units import FRAME_RATE, MULTIPLE, TEXT_LENGTH, audio_latent_frames

torch = lazy_module("torch")

NOTES = ("LTX-2: prompts padded to 1024 tokens, as the units pad them; clips of --num_frames frames (8k+1) with their "
         "sound at 24 fps",)


def _get(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def _factors(vae: Any) -> tuple[int, int]:
    """(spatial, temporal) compression of the video VAE, as its config says or as the class computes them."""
    scaling = list(_get(vae, "spatio_temporal_scaling", (True, True, True, True)))
    spatial = _get(vae, "spatial_compression_ratio") or int(_get(vae, "patch_size", 4)) * 2 ** sum(map(bool, scaling))
    temporal = _get(vae, "temporal_compression_ratio") or int(_get(vae, "patch_size_t", 1)) * 2 ** sum(map(bool, scaling))
    return int(spatial), int(temporal)


def dims(cfg: Any, configs: Mapping[str, Any], text_tokens: Optional[int] = None) -> dict[str, Any]:
    """The sizes one sample has at this run's settings (JSON)."""
    vae, dit = configs["video_vae_encoder"], configs["dit"]
    spatial, temporal = _factors(vae)
    width, height = run_pixels(cfg.units.image_size, max(MULTIPLE, spatial))
    frames = int(cfg.data.num_frames)
    frames = max(1, (frames - 1) // 8 * 8 + 1)
    t, h, w = (frames - 1) // temporal + 1, height // spatial, width // spatial
    audio_tokens = audio_latent_frames(dit, frames)
    out = {"width": width, "height": height, "frames": frames, "latent": [int(_get(vae, "latent_channels", 128)), t, h, w],
           "image_tokens": t * h * w, "audio_tokens": audio_tokens, "text_tokens": int(text_tokens or TEXT_LENGTH)}
    out["description"] = (f"{width}x{height} px x {frames} frames, {out['image_tokens']} video tokens, {audio_tokens} "
                          f"audio tokens, {out['text_tokens']} text tokens")
    return out


def sink_inputs(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int, dtype: Any) -> dict[str, Any]:
    """The loss's inputs for a batch, as stage 2 hands them over (latents, the connectors' contexts, the audio tokens)."""
    z, t, h, w = dims["latent"]
    dit = configs["dit"]
    width, audio_width = int(dit["caption_channels"]), int(dit["audio_in_channels"])
    text, audio = dims["text_tokens"], dims["audio_tokens"]
    return {
        "input_latents": torch.randn(batch, z, t, h, w, dtype=dtype),
        "noise": torch.randn(batch, z, t, h, w, dtype=dtype),
        "timestep": torch.full((batch,), 500.0),
        "loss_weight": torch.ones(batch),
        "video_context": torch.randn(batch, text, width, dtype=dtype),
        "audio_context": torch.randn(batch, text, width, dtype=dtype),
        "context_mask": torch.ones(batch, text, dtype=torch.long),
        "audio_noise": torch.randn(batch, audio, audio_width, dtype=dtype),
        "audio_latents": torch.randn(batch, audio, audio_width, dtype=dtype),
    }


def encoder_calls(cfg: Any, dims: Mapping[str, Any], configs: Mapping[str, Any], batch: int,
                  dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """slot -> a call of that model as its unit makes it for `batch` samples, returning what the unit passes on."""

    def video_vae(model: Any) -> Any:
        clip = torch.randn(batch, 3, dims["frames"], dims["height"], dims["width"], dtype=dtype)
        return model.encode(clip).latent_dist.mean

    def audio_vae(model: Any) -> Any:
        config = configs.get("audio_vae_encoder") or {}
        rate, hop = int(_get(config, "sample_rate", 16000)), int(_get(config, "mel_hop_length", 160))
        samples = int(dims["frames"] / FRAME_RATE * rate)
        mel = torch.randn(batch, 2, samples // hop + 1,  # the STFT's centred frames
                           int(_get(config, "mel_bins", 64)), dtype=dtype)
        return model.encode(mel).latent_dist.mode()

    def text_encoder(model: Any) -> Any:
        ids = torch.zeros(batch, dims["text_tokens"], dtype=torch.long)
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states
        return torch.stack(hidden, dim=-1).flatten(2, 3)

    def connectors(model: Any) -> Any:
        width = int(_get(model.config, "caption_channels", 3840)) * int(_get(model.config, "text_proj_in_factor", 49))
        hidden = torch.randn(batch, dims["text_tokens"], width, dtype=dtype)
        return model(hidden, torch.ones(batch, dims["text_tokens"], dtype=torch.long), padding_side="left")[0]

    return {"video_vae_encoder": video_vae, "audio_vae_encoder": audio_vae, "text_encoder": text_encoder,
            "text_encoder_post_modules": connectors}

"""LTX-2's sink: the joint video and audio flow-matching loss (DiffSynth-Studio's FlowMatchSFTAudioVideoLoss).

The transformer is called as diffusers' LTX2Pipeline calls it in a denoising step: the video latents packed into
tokens (B, F x H x W, C), the audio tokens (B, L_a, C_a), the connectors' video and audio contexts with their mask
for both streams, the timestep on the 0..1000 scale as `timestep` and `sigma`, the latent grid and FRAME_RATE from
which it computes the positions. Both streams are noised at the same timestep and the target of each is noise - x0.
The loss is the video MSE times the timestep's weight, plus, for a clip with sound, the audio MSE times the same
weight (DiffSynth's audio weighting); a clip without sound gives the audio stream pure noise and no audio term.
"""

from __future__ import annotations

from typing import Any

from ...family import lazy_module, sink
from ...flowmatch import flow_matching_mse
from .units import FRAME_RATE

torch = lazy_module("torch")


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, F x H x W, C): LTX2Pipeline._pack_latents with patch sizes 1 (LTX-2's)."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, shape: Any) -> torch.Tensor:
    """(B, F x H x W, C) -> (B, C, F, H, W) of `shape`."""
    return tokens.transpose(1, 2).reshape(shape)


def predict(ctx, latents: torch.Tensor, audio: torch.Tensor, timestep: torch.Tensor, video_context: Any,
            audio_context: Any, context_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's video velocity (B, C, F, H, W) and audio velocity (B, L_a, C_a) at `timestep` (B,)."""
    dit = ctx.model("dit")
    dtype = ctx.model_dtype("dit")
    batch, _, frames, height, width = latents.shape
    t = timestep.to(dtype).reshape(-1).expand(batch)
    mask = ctx.tensor(context_mask)
    video, audio_out = dit(
        hidden_states=pack(latents).to(dtype),
        audio_hidden_states=audio.to(dtype),
        encoder_hidden_states=ctx.tensor(video_context).to(dtype),
        audio_encoder_hidden_states=ctx.tensor(audio_context).to(dtype),
        timestep=t,
        sigma=t,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        fps=FRAME_RATE,
        audio_num_frames=audio.shape[1],
        return_dict=False,
    )
    return unpack(video, latents.shape), audio_out


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "video_context", "audio_context", "context_mask",
              "audio_noise", "audio_latents"),
      models=("dit",))
def flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, video_context, audio_context, context_mask,
                       audio_noise, audio_latents=None):
    """MSE between the predicted video velocity and noise - x0 at x_t = (1 - s) x0 + s noise, s = timestep / 1000,
    times the timestep's loss weight; with the clip's audio latents, the same for the audio stream, added."""
    x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
    t = ctx.tensor(timestep).to(x0.dtype)
    s = (t / 1000.0).view(-1, 1, 1, 1, 1)
    noisy = (1.0 - s) * x0 + s * noise
    audio_noise = ctx.tensor(audio_noise)
    if audio_latents is None:
        audio_in = audio_noise
    else:
        a0 = ctx.tensor(audio_latents).to(audio_noise.dtype)
        sa = s.view(-1, 1, 1).to(a0.dtype)
        audio_in = (1.0 - sa) * a0 + sa * audio_noise
    pred, pred_audio = predict(ctx, noisy, audio_in, t, video_context, audio_context, context_mask)
    weight = ctx.tensor(loss_weight)
    loss = flow_matching_mse(pred, noise - x0, weight)
    if audio_latents is not None:
        loss = loss + flow_matching_mse(pred_audio, audio_noise - a0, weight)
    return loss

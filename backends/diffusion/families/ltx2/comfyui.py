"""LTX-2's denoiser in ComfyUI's LoRA layout: the release checkpoint's names, which ComfyUI's LTX-2 audio-video model
(comfy/ldm/lightricks) uses. diffusers renames only the input projections and the timestep embedders (its
conversion of the release, single_file_utils.convert_ltx2_transformer_to_diffusers, read the other way); every other
module, the blocks' attentions and feed-forwards included, has the same name in both. Nothing is fused.
"""

from __future__ import annotations

from ...models.release_names import ReleaseNames, rule

_EMBEDDERS = (("adaln_single", "time_embed"), ("audio_adaln_single", "audio_time_embed"),
              ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
              ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
              ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
              ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"))

NAMES = ReleaseNames(
    rule("patchify_proj", "proj_in"),
    rule("audio_patchify_proj", "audio_proj_in"),
    *(rule(f"{src}.{{rest}}", f"{dst}.{{rest}}") for src, dst in _EMBEDDERS),
    identity=True, roots=("transformer_blocks", "caption_projection", "audio_caption_projection", "proj_out",
                          "audio_proj_out"),
)

"""Tiny random-weight Wan pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline wan|wan_i2v`).

`write_tiny_models(outdir, size, seed)` writes a diffusers WanPipeline folder (model_index.json,
transformer/, vae/, text_encoder/ (UMT5), tokenizer/, scheduler/) that `WanPipeline.from_pretrained`
loads offline; with `pipeline="wan_i2v"` a WanImageToVideoPipeline folder instead, whose DiT takes the
conditioning channels (in_channels = 2 z + 4) and CLIP image features (image_dim), plus image_encoder/
(CLIPVisionModel) and image_processor/; with `pipeline="wan_ti2v"` Wan 2.2 TI2V-5B's layout: WanPipeline with
expand_timesteps, its VAE patchified 2x2 with residual down/up blocks (4x16x16, as the release's; fewer latent
channels at `test` size, the release's 48 at `demo`) and a DiT of z in and out channels. The T5 tokenizer is built
offline (a Unigram vocabulary).

Sizes:
  * ``test``: 32 px, 5 frames: 2 latent frames of 4x4, 8 DiT tokens; a LoRA step in a few ms.
  * ``demo``: wider and deeper, for clips of 9 frames at 128 px.

The weights are drawn from torch's generator seeded per component: the same seed gives the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny_tokenizers import seeded, t5_tokenizer
from . import SCHEDULER_CONFIG



def _ti2v_vae(base_dim: int, decoder_base_dim: int, z_dim: int) -> dict[str, Any]:
    """The TI2V-5B VAE's layout (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json) at a tiny width: 2x2 pixel patches
    (12 channels in and out), residual blocks, 16x spatial and 4x temporal; latents_mean/std not 0/1, so the
    normalisation is seen in tests."""
    return {"base_dim": base_dim, "decoder_base_dim": decoder_base_dim, "z_dim": z_dim, "dim_mult": [1, 1, 1, 1],
            "num_res_blocks": 1, "attn_scales": [], "temperal_downsample": [False, True, True], "is_residual": True,
            "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
            "scale_factor_temporal": 4, "latents_mean": [round(0.05 * (i % 5) - 0.1, 3) for i in range(z_dim)],
            "latents_std": [round(0.8 + 0.1 * (i % 4), 3) for i in range(z_dim)]}


SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "DiT 2 layers x 2 heads x 12, VAE /8 /4 with z_dim 4, UMT5 d_model 32 x 2 layers",
        "transformer": {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
                        "out_channels": 4, "text_dim": 32, "freq_dim": 32, "ffn_dim": 32, "num_layers": 2,
                        "rope_max_seq_len": 32},
        "i2v": {"image_dim": 16, "added_kv_proj_dim": 24},
        "vae_ti2v": _ti2v_vae(base_dim=8, decoder_base_dim=12, z_dim=8),
        "vae": {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "attn_scales": [],
                "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4},
        "umt5": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8},
        "clip_vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                        "image_size": 32, "patch_size": 4, "projection_dim": 16},
    },
    "demo": {
        "description": "DiT 4 layers x 4 heads x 24, VAE /8 /4 with z_dim 16, UMT5 d_model 128 x 4 layers",
        "transformer": {"patch_size": [1, 2, 2], "num_attention_heads": 4, "attention_head_dim": 24, "in_channels": 16,
                        "out_channels": 16, "text_dim": 128, "freq_dim": 64, "ffn_dim": 256, "num_layers": 4,
                        "rope_max_seq_len": 64},
        "i2v": {"image_dim": 64, "added_kv_proj_dim": 96},
        "vae_ti2v": _ti2v_vae(base_dim=16, decoder_base_dim=24, z_dim=48),
        "vae": {"base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1, "attn_scales": [],
                "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16},
        "umt5": {"d_model": 128, "d_kv": 32, "d_ff": 256, "num_layers": 4, "num_heads": 4,
                 "relative_attention_num_buckets": 16},
        "clip_vision": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "image_size": 64, "patch_size": 8, "projection_dim": 32},
    },
}

_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2, "image_encoder": 3, "transformer_2": 4}
T2V_BOUNDARY_RATIO = 0.875  # Wan 2.2 T2V A14B's model_index.json: timesteps >= 875 go to `transformer`
I2V_BOUNDARY_RATIO = 0.9  # Wan 2.2 I2V A14B's
TI2V_SCHEDULER_CONFIG = dict(SCHEDULER_CONFIG, flow_shift=5.0)  # Wan 2.2 TI2V-5B's sample_shift (wan/configs/wan_ti2v_5B.py)


def build_tiny_components(size: str = "test", seed: int = 0, i2v: bool = False, experts: bool = False,
                          ti2v: bool = False) -> dict[str, Any]:
    """The pipeline's components in memory (keys: diffusers component names). `experts`: Wan 2.2 A14B's layout, a
    second DiT of the same config (`transformer_2`, other weights) for the low-noise steps and the boundary ratio;
    with `i2v` too, Wan 2.2 I2V A14B's: no CLIP image encoder (image_encoder and image_processor None in
    model_index.json), the DiT's image_dim None, the conditioning channels kept.
    `ti2v`: Wan 2.2 TI2V-5B's (the patchified VAE, a DiT of its latent width, expand_timesteps)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r} (sizes: {', '.join(SIZES)})")
    spec = SIZES[size]
    tokenizer = t5_tokenizer()
    te_config = UMT5Config(vocab_size=len(tokenizer), feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **spec["umt5"])
    dit = dict(spec["transformer"], patch_size=tuple(spec["transformer"]["patch_size"]))
    if ti2v and (i2v or experts):
        raise ValueError("the tiny TI2V folder is one WanPipeline with expand_timesteps (no I2V or expert layout)")
    vae = spec["vae_ti2v"] if ti2v else spec["vae"]
    if i2v:
        z = spec["vae"]["z_dim"]
        dit.update(in_channels=2 * z + 4)  # noisy latents, the 4-channel first-frame mask, the image latents
        if not experts:  # Wan 2.1 I2V's CLIP image features; Wan 2.2 I2V A14B takes none
            dit.update(spec["i2v"])
    if ti2v:
        dit.update(in_channels=vae["z_dim"], out_channels=vae["z_dim"])  # the image is fused into the latents
    components: dict[str, Any] = {
        "transformer": seeded(seed + _SEED_OFFSETS["transformer"], lambda: WanTransformer3DModel(**dit)),
        "vae": seeded(seed + _SEED_OFFSETS["vae"], lambda: AutoencoderKLWan(**vae)),
        "text_encoder": seeded(seed + _SEED_OFFSETS["text_encoder"], lambda: UMT5EncoderModel(te_config)),
        "tokenizer": tokenizer,
        "scheduler": UniPCMultistepScheduler(**(TI2V_SCHEDULER_CONFIG if ti2v else SCHEDULER_CONFIG)),
    }
    if ti2v:
        components["expand_timesteps"] = True
    if experts:
        components["transformer_2"] = seeded(seed + _SEED_OFFSETS["transformer_2"], lambda: WanTransformer3DModel(**dit))
        components["boundary_ratio"] = I2V_BOUNDARY_RATIO if i2v else T2V_BOUNDARY_RATIO
    if i2v and experts:
        components.update(image_encoder=None, image_processor=None)
    elif i2v:
        vision = spec["clip_vision"]
        components["image_encoder"] = seeded(seed + _SEED_OFFSETS["image_encoder"], lambda: CLIPVisionModel(CLIPVisionConfig(**vision)))
        side = vision["image_size"]
        components["image_processor"] = CLIPImageProcessorPil(size={"shortest_edge": side},
                                                              crop_size={"height": side, "width": side})
    for name in ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder"):
        if components.get(name) is not None:
            components[name].eval()
    return components


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None, experts: bool = False) -> Path:
    """Write a complete random-weight Wan diffusers pipeline folder for `pipeline` (None: wan; wan_ti2v: TI2V-5B's
    layout); return its path.
    `experts`: Wan 2.2 A14B's two-expert layout (`transformer`, `transformer_2`, `boundary_ratio`): T2V A14B's, or
    I2V A14B's for `wan_i2v` (no CLIP image encoder)."""
    import diffusers

    from . import FAMILY

    class_name = FAMILY.diffusers_class(pipeline)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    ti2v = FAMILY.pipeline_for(pipeline).name == "wan_ti2v"
    components = build_tiny_components(size=size, seed=seed, i2v=class_name == "WanImageToVideoPipeline", experts=experts,
                                       ti2v=ti2v)
    getattr(diffusers, class_name)(**components).save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size], "pipeline_class": class_name, "experts": bool(experts),
            "ti2v": ti2v}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

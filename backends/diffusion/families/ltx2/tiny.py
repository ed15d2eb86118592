"""Tiny random-weight LTX-2 pipelines for tests and demos (`unitgraph tiny-models DIR --pipeline ltx2`).

`write_tiny_models(outdir, size, seed)` writes a diffusers LTX2Pipeline folder (model_index.json, transformer/, vae/,
audio_vae/, vocoder/, text_encoder/ (a Gemma3ForConditionalGeneration with a tiny SigLIP tower), connectors/,
tokenizer/, scheduler/) that `LTX2Pipeline.from_pretrained` loads offline. The Gemma tokenizer is trained here on the
synthetic datasets' words (a BPE with Gemma's "▁" word marks and byte fallback), without a download.

Sizes:
  * ``test``: frames of 32 px, VAE /8 in space and /2 in time with 4 channels: a 9-frame clip is 5 x 4 x 4 latents
    (80 DiT tokens); Gemma 3 with 2 layers of width 32, one connector layer per stream; a LoRA step in milliseconds.
  * ``demo``: wider and deeper, for clips of 9 frames at 64 to 128 px.

The weights are drawn from torch's generator seeded per component: the same seed gives the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny_tokenizers import WORDS, seeded
from . import SCHEDULER_CONFIG

# Gemma's special tokens (pad 0, eos 1, bos 2, unk 3, mask 4) and the image tokens Gemma 3's multimodal config points at
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
_SENTENCES = ("a red circle on a blue background", "a cat sitting on a chair", "a video of a dog moving left",
              "a painting of a yellow square", "a dark image with a bright white triangle")

SIZES: dict[str, dict[str, Any]] = {
    "test": {
        "description": "DiT 2 layers x 2 heads x 8 (audio 2 x 4), VAE /8 /2 with 4 channels, Gemma 3 width 32 x 2 "
                       "layers, connectors 1 layer x 4 heads x 8",
        "gemma": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64,
                  "max_position_embeddings": 2048},
        "vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "image_size": 16, "patch_size": 4},
        "connectors": {"video_connector_num_attention_heads": 4, "video_connector_attention_head_dim": 8,
                       "video_connector_num_layers": 1, "video_connector_num_learnable_registers": 8,
                       "audio_connector_num_attention_heads": 4, "audio_connector_attention_head_dim": 8,
                       "audio_connector_num_layers": 1, "audio_connector_num_learnable_registers": 8,
                       "connector_rope_base_seq_len": 1024},
        "transformer": {"num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16,
                        "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
                        "num_layers": 2},
        "vae": {"latent_channels": 4, "block_out_channels": [8], "decoder_block_out_channels": [8],
                "layers_per_block": [1, 1], "decoder_layers_per_block": [1, 1], "spatio_temporal_scaling": [True],
                "decoder_spatio_temporal_scaling": [True], "decoder_inject_noise": [False, False],
                "downsample_type": ["spatiotemporal"], "upsample_type": ["spatiotemporal"],
                "upsample_residual": [False], "upsample_factor": [1], "patch_size": 4, "patch_size_t": 1},
        "audio_vae": {"base_channels": 4, "ch_mult": [1, 1, 1], "num_res_blocks": 1, "latent_channels": 2, "mel_bins": 8,
                      "resolution": 32},
        "vocoder": {"hidden_channels": 32, "upsample_kernel_sizes": [4, 4], "upsample_factors": [2, 2],
                    "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]]},
    },
    "demo": {
        "description": "DiT 4 layers x 4 heads x 16 (audio 2 x 16), VAE /16 /4 with 16 channels, Gemma 3 width 64 x 4 "
                       "layers, connectors 2 layers x 4 heads x 16",
        "gemma": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 128,
                  "max_position_embeddings": 2048},
        "vision": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "image_size": 16, "patch_size": 4},
        "connectors": {"video_connector_num_attention_heads": 4, "video_connector_attention_head_dim": 16,
                       "video_connector_num_layers": 2, "video_connector_num_learnable_registers": 16,
                       "audio_connector_num_attention_heads": 4, "audio_connector_attention_head_dim": 16,
                       "audio_connector_num_layers": 2, "audio_connector_num_learnable_registers": 16,
                       "connector_rope_base_seq_len": 1024},
        "transformer": {"num_attention_heads": 4, "attention_head_dim": 16, "cross_attention_dim": 64,
                        "audio_num_attention_heads": 2, "audio_attention_head_dim": 16, "audio_cross_attention_dim": 32,
                        "num_layers": 4},
        "vae": {"latent_channels": 16, "block_out_channels": [16, 32], "decoder_block_out_channels": [16, 32],
                "layers_per_block": [1, 1, 1], "decoder_layers_per_block": [1, 1, 1],
                "spatio_temporal_scaling": [True, True], "decoder_spatio_temporal_scaling": [True, True],
                "decoder_inject_noise": [False, False, False], "downsample_type": ["spatiotemporal", "spatiotemporal"],
                "upsample_type": ["spatiotemporal", "spatiotemporal"], "upsample_residual": [False, False],
                "upsample_factor": [1, 1], "patch_size": 4, "patch_size_t": 1},
        "audio_vae": {"base_channels": 16, "ch_mult": [1, 1, 1], "num_res_blocks": 1, "latent_channels": 4, "mel_bins": 16,
                      "resolution": 64},
        "vocoder": {"hidden_channels": 32, "upsample_kernel_sizes": [4, 4], "upsample_factors": [2, 2],
                    "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]]},
    },
}

_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2, "connectors": 3, "audio_vae": 4, "vocoder": 5}


def build_tiny_tokenizer():
    """A GemmaTokenizer trained offline: a BPE over the datasets' words with Gemma's "▁" word marks, its specials
    and the 256 byte-fallback tokens, so that any prompt tokenizes."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import GemmaTokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next", invert=False)
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, show_progress=False, special_tokens=list(SPECIALS))
    bpe.train_from_iterator([" ".join(WORDS), *_SENTENCES, *(" " + w for w in WORDS)], trainer=trainer)
    state = json.loads(bpe.to_str())["model"]
    vocab = dict(state["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=1024, padding_side="left")
    bos = tokenizer.convert_tokens_to_ids("<bos>")  # Gemma's tokenizer starts every text with <bos>
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                                        special_tokens=[("<bos>", bos)])
    return tokenizer


def _text_encoder_config(spec: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    ids = tokenizer.convert_tokens_to_ids
    text = Gemma3TextConfig(vocab_size=len(tokenizer), pad_token_id=ids("<pad>"), eos_token_id=ids("<eos>"),
                            bos_token_id=ids("<bos>"), **spec["gemma"])
    vision = SiglipVisionConfig(**spec["vision"])
    side = spec["vision"]["image_size"] // spec["vision"]["patch_size"]
    return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=(side // 2) ** 2,
                        boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
                        image_token_index=ids("<image_soft_token>"))


def build_tiny_components(size: str = "test", seed: int = 0) -> dict[str, Any]:
    """The pipeline's components in memory (keys: LTX2Pipeline's component names)."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3ForConditionalGeneration

    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r} (sizes: {', '.join(SIZES)})")
    spec = SIZES[size]
    tokenizer = build_tiny_tokenizer()
    te_config = _text_encoder_config(spec, tokenizer)
    width, layers = spec["gemma"]["hidden_size"], spec["gemma"]["num_hidden_layers"]
    audio = dict(spec["audio_vae"], output_channels=2, in_channels=2, attn_resolutions=None, norm_type="pixel",
                 causality_axis="height", dropout=0.0, mid_block_add_attention=False, sample_rate=16000,
                 mel_hop_length=160, is_causal=True)
    audio_tokens = audio["latent_channels"] * (audio["mel_bins"] // 4)  # channels x latent mel bins (/4)
    vae = dict(spec["vae"], in_channels=3, out_channels=3, timestep_conditioning=False, encoder_causal=True,
               decoder_causal=False)
    for key, value in list(vae.items()):
        if isinstance(value, list):
            vae[key] = tuple(value)
    channels = vae["latent_channels"]
    video_vae = seeded(seed + _SEED_OFFSETS["vae"], lambda: AutoencoderKLLTX2Video(**vae))
    spatial, temporal = video_vae.spatial_compression_ratio, video_vae.temporal_compression_ratio
    # the DiT's positions are in pixels and frames: its vae_scale_factors are the VAE's own
    dit = dict(spec["transformer"], in_channels=channels, out_channels=channels, patch_size=1, patch_size_t=1,
               audio_in_channels=audio_tokens, audio_out_channels=audio_tokens, caption_channels=width,
               vae_scale_factors=(temporal, spatial, spatial))
    components: dict[str, Any] = {
        "transformer": seeded(seed + _SEED_OFFSETS["transformer"], lambda: LTX2VideoTransformer3DModel(**dit)),
        "vae": video_vae,
        "audio_vae": seeded(seed + _SEED_OFFSETS["audio_vae"], lambda: AutoencoderKLLTX2Audio(**audio)),
        "vocoder": seeded(seed + _SEED_OFFSETS["vocoder"], lambda: LTX2Vocoder(
            in_channels=audio["output_channels"] * audio["mel_bins"], out_channels=2, leaky_relu_negative_slope=0.1,
            output_sampling_rate=16000, **spec["vocoder"])),
        "text_encoder": seeded(seed + _SEED_OFFSETS["text_encoder"], lambda: Gemma3ForConditionalGeneration(te_config)),
        "tokenizer": tokenizer,
        "connectors": seeded(seed + _SEED_OFFSETS["connectors"], lambda: LTX2TextConnectors(
            caption_channels=width, text_proj_in_factor=layers + 1, **spec["connectors"])),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
    }
    for name in ("transformer", "vae", "audio_vae", "vocoder", "text_encoder", "connectors"):
        components[name].eval()
    return components


def write_tiny_models(outdir, size: str = "test", seed: int = 0, pipeline: Any = None) -> Path:
    """Write a complete random-weight LTX2Pipeline folder; return its path."""
    from diffusers import LTX2Pipeline

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    LTX2Pipeline(**build_tiny_components(size=size, seed=seed)).save_pretrained(str(out), safe_serialization=True)
    info = {"size": size, "seed": int(seed), "config": SIZES[size], "pipeline_class": "LTX2Pipeline"}
    (out / "unitgraph_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out

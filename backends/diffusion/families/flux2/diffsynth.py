"""FLUX.2 [klein] as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:flux2_image`,
backends/diffusion/diffsynth_source): how its example's train.py builds it, and its test-size models in DiffSynth's
`./models` layout.

DiffSynth's Flux2ImagePipeline encodes the prompt with FLUX.2-dev's Mistral encoder or, when the command names one,
with klein's Qwen3 (its `text_encoder_qwen3`, a class DiffSynth shares with another family); klein's examples name
the Qwen3 one. Its two prompt units declare `prompt_emb`/`prompt_emb_mask` but return `prompt_embeds`/`text_ids`:
the plan reads what `process` returns (the diffsynth adapter), so both go to the cache and stage 2 never loads the
encoder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from ...family import DiffSynthPipeline, DiffSynthTokenizer

KLEIN = "black-forest-labs/FLUX.2-klein-4B"
KLEIN_BASE = "black-forest-labs/FLUX.2-klein-base-4B"

PIPELINES = (
    DiffSynthPipeline("flux2_image", "Flux2ImagePipeline", "FLUX.2 (DiffSynth's pipeline)", example="flux2",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", "black-forest-labs/FLUX.2-dev",
                                                     "tokenizer/"),),
                      constants=(("embedded_guidance", 1.0),),
                      # klein 4B's text encoder is Qwen3-4B, which DiffSynth's table knows as Z-Image-Turbo's
                      sized_as=((f"{KLEIN}:text_encoder/*.safetensors",
                                 "Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors"),)),
)

# The text encoder is DiffSynth's Qwen3 class at the smallest size it allows (0.6B, 28 layers of width 1024: the
# prompt unit stacks layers 9, 18 and 27, so the DiT reads 3 x 1024 features). The pipeline draws its noise with 128
# channels (a 2x2 patch of 32 latent channels), which fixes the VAE's latent channels and the DiT's input; the rest
# is test-sized, each model recognised by the config.json beside it.
DIT = {"patch_size": 1, "in_channels": 128, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
       "num_attention_heads": 2, "joint_attention_dim": 3 * 1024, "timestep_guidance_channels": 32, "mlp_ratio": 3.0,
       "axes_dims_rope": [4, 4, 4, 4], "guidance_embeds": False}
VAE = {"block_out_channels": [32, 32, 32, 32], "latent_channels": 32, "layers_per_block": 1, "norm_num_groups": 32}


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0,
                           write_smallest: Optional[Callable[..., Path]] = None) -> dict[str, Any]:
    """FLUX.2 [klein] 4B as DiffSynth's examples download it under `outdir`: klein-4B's text encoder, DiT, VAE and
    tokenizer, and klein-base-4B's DiT (the same test weights; its split-training example trains the base model on
    the cache klein-4B's encoder and VAE made; the text encoder by `write_smallest`, which diffsynth_source/tiny.py
    hands in: the smallest size of DiffSynth's table). Returns the flags naming klein-4B's files as its LoRA example
    does."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    from .tiny import build_tokenizer

    root = Path(outdir) / KLEIN
    build_tokenizer().save_pretrained(str(root / "tokenizer"))
    write_smallest(root / "text_encoder", module, "text_encoder_qwen3", seed + 2)
    torch.manual_seed(seed)
    dit = Flux2Transformer2DModel(**DIT)
    dit.save_pretrained(str(root / "transformer"))
    dit.save_pretrained(str(Path(outdir) / KLEIN_BASE / "transformer"))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(**VAE)
    with torch.no_grad():  # running statistics away from a fresh BatchNorm's 0 and 1, so that they are exercised
        vae.bn.running_mean.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 1.5)
    vae.save_pretrained(str(root / "vae"))
    files = [f"{KLEIN}:text_encoder/*.safetensors", f"{KLEIN}:transformer/*.safetensors",
             f"{KLEIN}:vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(files), "tokenizer_path": str(root / "tokenizer")}

"""Z-Image as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:z_image`, backends/diffusion/diffsynth_source):
how its example's train.py builds it, and its test-size models in DiffSynth's `./models` layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from ...family import DiffSynthPipeline, DiffSynthTokenizer
from ...models.diffsynth_layout import write_released_vae

PIPELINES = (
    DiffSynthPipeline("z_image", "ZImagePipeline", "Z-Image (DiffSynth's pipeline)", example="z_image",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", "Tongyi-MAI/Z-Image-Turbo",
                                                     "tokenizer/"),)),
)


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0,
                           write_smallest: Optional[Callable[..., Path]] = None) -> dict[str, Any]:
    """Z-Image as DiffSynth's example downloads it (Z-Image's DiT, Z-Image-Turbo's text encoder and VAE) under
    `outdir`. DiffSynth's text encoder class fixes its sizes, the smallest being Qwen3 0.6B: written in DiffSynth's
    own layout with random N(0, 0.02) weights in bf16 (1.2 GB), which DiffSynth's table knows by its key hash; the
    VAE's class fixes its sizes too (84 M parameters, bf16), also known by its hash; the DiT is this family's test
    size, recognised by its config.json; the text encoder is written by `write_smallest`, which
    diffsynth_source/tiny.py hands in. Returns the flags naming them."""
    import torch
    from diffusers import ZImageTransformer2DModel

    from .tiny import SIZES, build_tiny_tokenizer

    root = Path(outdir) / "Tongyi-MAI"
    build_tiny_tokenizer().save_pretrained(str(root / "Z-Image-Turbo" / "tokenizer"))
    write_smallest(root / "Z-Image-Turbo" / "text_encoder", module, "text_encoder", seed + 2)
    torch.manual_seed(seed)
    ZImageTransformer2DModel(**{**SIZES["test"]["transformer"], "cap_feat_dim": 1024}).save_pretrained(
        str(root / "Z-Image" / "transformer"))
    write_released_vae(root / "Z-Image-Turbo" / "vae", seed + 1)
    files = ["Tongyi-MAI/Z-Image:transformer/*.safetensors", "Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors",
             "Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(files), "tokenizer_path": str(root / "Z-Image-Turbo" / "tokenizer")}

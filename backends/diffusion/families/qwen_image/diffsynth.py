"""Qwen-Image as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:qwen_image`, backends/diffusion/diffsynth_source):
how its example's train.py builds it, and its test-size models in DiffSynth's `./models` layout.

DiffSynth's QwenImageTextEncoder fixes Qwen2.5-VL 7B's sizes (8.29 B parameters, its vision tower and `lm_head`
included), so the test models hold that encoder as released: random weights in bf16 (16.6 GB) in the release's four
shards and key layout, which DiffSynth's table knows by the release's own key hash. A pipeline holding it takes about
17 GB of memory, so the tests load one at a time (unitgraph's step, then DiffSynth's: measured, at most 17 GB of
the 24 GiB machine in use). The DiT class takes only its number of blocks (one here: 380 M parameters at the
released width of 3072); the VAE is test-sized with the release's 16 latent channels and 8x down, which the
pipeline's noise and the DiT's 64 inputs (a 2x2 patch) fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from ...family import DiffSynthPipeline, DiffSynthTokenizer

MODEL_ID = "Qwen/Qwen-Image"

PIPELINES = (
    # its get_pipeline_inputs sets `edit_image_auto_resize` and `zero_cond_t` (a flag of Qwen-Image-Edit-2511's, off)
    # beyond the image pipelines' inputs; its train.py also hands from_pretrained Qwen-Image-Edit's processor, which
    # only an edit image is read with
    DiffSynthPipeline("qwen_image", "QwenImagePipeline", "Qwen-Image (DiffSynth's pipeline)", example="qwen_image",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", MODEL_ID, "tokenizer/"),),
                      constants=(("edit_image_auto_resize", True), ("zero_cond_t", False)),
                      # DiffSynth 2.1.12's table comments its DiT entry with the text encoder's file pattern and the
                      # text encoder's with the DiT's: the dry run sizes each pattern by the entry its file is
                      sized_as=((f"{MODEL_ID}:transformer/diffusion_pytorch_model*.safetensors",
                                 "md5:0319a1cb19835fb510907dd3367c95ff"),
                                (f"{MODEL_ID}:text_encoder/model*.safetensors", "md5:8004730443f55db63092006dd9f7110e"))),
)

# the DiT's one block; the VAE at test width with the release's latent channels and downsampling
DIT = {"num_layers": 1}
VAE = {"base_dim": 32, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_scales": [],
       "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}


def released_text_encoder_key(key: str) -> str:
    """A key of DiffSynth's QwenImageTextEncoder under the release's name (its state-dict converter's inverse: the
    release keeps the language model under `model.` and the vision tower under `visual.`)."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith("model.visual."):
        return key[len("model."):]
    return key


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0,
                           write_released: Optional[Callable[..., list]] = None) -> dict[str, Any]:
    """Qwen-Image as DiffSynth's LoRA example downloads it under `outdir` (its transformer, text_encoder and vae, and
    the tokenizer its train.py falls back to): the text encoder as released (`write_released`, which
    diffsynth_source/tiny.py hands in: four shards written once a session), the DiT with one block and the VAE
    test-sized, each with the config.json by which unitgraph recognises it. Returns the flags naming them as the
    example does."""
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    from .tiny import build_tiny_tokenizer

    root = Path(outdir) / MODEL_ID
    build_tiny_tokenizer().save_pretrained(str(root / "tokenizer"))
    write_released(root / "text_encoder", module, "text_encoder", seed + 2, released_text_encoder_key, shards=4)
    torch.manual_seed(seed)
    QwenImageTransformer2DModel(**DIT).to(torch.bfloat16).save_pretrained(str(root / "transformer"))
    torch.manual_seed(seed + 1)
    AutoencoderKLQwenImage(**VAE).save_pretrained(str(root / "vae"))
    files = ["transformer/diffusion_pytorch_model*.safetensors", "text_encoder/model*.safetensors",
             "vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(f"{MODEL_ID}:{f}" for f in files)}

"""Wan as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:wan_video`, backends/diffusion/diffsynth_source):
how its example's train.py builds it, and its test-size models in DiffSynth's `./models` layout.

DiffSynth's Wan 2.1 T2V command names `Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth` and
`...:Wan2.1_VAE.pth`; its `from_pretrained` redirects both to DiffSynth's own safetensors copies
(`DiffSynth-Studio/Wan-Series-Converted-Safetensors`), and so does unitgraph (models.py `redirects`), so no pickle is
read. The test-size models are written where those redirects look.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...family import DiffSynthPipeline, DiffSynthTokenizer

MODEL_ID = "Wan-AI/Wan2.1-T2V-1.3B"
CONVERTED = "DiffSynth-Studio/Wan-Series-Converted-Safetensors"

PIPELINES = (
    DiffSynthPipeline("wan_video", "WanVideoPipeline", "Wan 2.1/2.2 video (DiffSynth's pipeline)", example="wanvideo",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", MODEL_ID, "google/umt5-xxl/"),),
                      columns=("video", "prompt"), media="video", frames=(4, 1),
                      constants=(("tiled", False), ("cfg_merge", False), ("vace_scale", 1)), boundaries=True,
                      negative=None, checkpointing=True),
)

# DiffSynth's Wan classes take their sizes in their constructors, except the VAE's (z_dim 16, 127 M parameters,
# which the tests write at that size in bf16: 254 MB, known to DiffSynth's table by its key hash). The DiT and the T5
# encoder are test-sized; each is recognised by the config.json beside it, the DiT's with the release's own keys.
DIT = {"dim": 24, "in_dim": 16, "ffn_dim": 48, "out_dim": 16, "text_dim": 32, "freq_dim": 256, "eps": 1e-6,
       "patch_size": [1, 2, 2], "num_heads": 2, "num_layers": 2, "model_type": "t2v", "text_len": 512}
T5 = {"dim": 32, "dim_attn": 32, "dim_ffn": 64, "num_heads": 4, "num_layers": 2, "num_buckets": 8}


def _random(module: Any, seed: int) -> dict[str, Any]:
    """`module`'s weights drawn N(0, 0.02) (norm scales 1) from `seed`, in bf16 as the releases are."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02, generator=generator)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()}


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0) -> dict[str, Any]:
    """Wan 2.1 T2V as DiffSynth's example downloads it under `outdir`: the DiT in `Wan-AI/Wan2.1-T2V-1.3B/` beside
    its config.json, the umt5 tokenizer in its `google/umt5-xxl/`, the T5 encoder and the VAE in DiffSynth's
    converted copies. Returns the flags naming them as the example does (its .pth names, which are redirected)."""
    import torch
    from diffsynth.models.wan_video_dit import WanModel
    from diffsynth.models.wan_video_text_encoder import WanTextEncoder
    from diffsynth.models.wan_video_vae import WanVideoVAE
    from safetensors.torch import save_file

    from ...models.tiny_tokenizers import t5_tokenizer

    root, converted = Path(outdir) / MODEL_ID, Path(outdir) / CONVERTED
    root.mkdir(parents=True, exist_ok=True)
    converted.mkdir(parents=True, exist_ok=True)
    tokenizer = t5_tokenizer()
    tokenizer.save_pretrained(str(root / "google" / "umt5-xxl"))
    dit_kwargs = {k: v for k, v in DIT.items() if k not in ("model_type", "text_len")}
    dit = WanModel(**{**dit_kwargs, "patch_size": tuple(DIT["patch_size"]), "has_image_input": False})
    save_file(_random(dit, seed), str(root / "diffusion_pytorch_model.safetensors"))
    (root / "config.json").write_text(json.dumps({"_class_name": "WanModel", **DIT}, indent=1) + "\n", encoding="utf-8")
    encoder = WanTextEncoder(vocab=len(tokenizer), **T5)
    save_file(_random(encoder, seed + 1), str(converted / "models_t5_umt5-xxl-enc-bf16.safetensors"))
    (converted / "config.json").write_text(json.dumps({"vocab": len(tokenizer), **T5}, indent=1) + "\n",
                                           encoding="utf-8")
    torch.manual_seed(seed + 2)
    vae = WanVideoVAE()
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in vae.model.state_dict().items()},
              str(converted / "Wan2.1_VAE.safetensors"))
    files = [f"{MODEL_ID}:diffusion_pytorch_model*.safetensors", f"{MODEL_ID}:models_t5_umt5-xxl-enc-bf16.pth",
             f"{MODEL_ID}:Wan2.1_VAE.pth"]
    return {"model_id_with_origin_paths": ",".join(files), "tokenizer_path": str(root / "google" / "umt5-xxl")}

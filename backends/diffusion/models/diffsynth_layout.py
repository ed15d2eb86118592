"""A family's tiny diffusers folder re-laid as DiffSynth-Studio's `./models` holds a download of its release.

DiffSynth's `--model_id_with_origin_paths "org/name:sub/file"` downloads into `./models/org/name/sub/` the files its
patterns name; the release's weights keep their own key layout (a transformers CLIP text encoder's released file
names its keys `text_model.*`, which transformers 5 leaves out when it saves a `CLIPTextModel`). A family whose
DiffSynth pipeline loads its diffusers components (families/<family>/diffsynth.py) writes its test-size models with
`relay`: each component's weights with its release's key prefix, beside its config.json (how unitgraph recognises a
model DiffSynth's hash table does not know), and the tokenizer folders as they are.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["RELEASED_16_CHANNEL_VAE", "relay", "write_released_vae"]

# diffusers' AutoencoderKL as several releases keep their 16-channel VAE (Z-Image-Turbo's vae/, Boogu-Image's): the
# widths and depth those releases fix, no quant convolutions; DiffSynth's table knows its key hash
RELEASED_16_CHANNEL_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "norm_num_groups": 32, "use_quant_conv": False, "use_post_quant_conv": False, "scaling_factor": 0.3611,
    "shift_factor": 0.1159, "sample_size": 1024}


def write_released_vae(folder: Path, seed: int) -> Path:
    """That VAE (84 M parameters) with diffusers' initialisation drawn from `seed`, in bf16, as the release's
    `folder/diffusion_pytorch_model.safetensors` (a download by DiffSynth's pattern holds the weights alone)."""
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    vae = AutoencoderKL(**RELEASED_16_CHANNEL_VAE)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in vae.state_dict().items()},
              str(folder / "diffusion_pytorch_model.safetensors"))
    return folder / "diffusion_pytorch_model.safetensors"


def relay(writer: Callable[[Path], Path], outdir: Path, model_id: str, prefixes: Mapping[str, str]) -> dict[str, Any]:
    """`writer(folder)` writes the tiny diffusers folder; its components go to `outdir/model_id/<sub>/` with
    `prefixes[sub]` before each key that does not start with it. Returns {"model_id_with_origin_paths": the weight
    files as DiffSynth's command names them (the scheduler left out), "tokenizer_path": the first tokenizer}."""
    from safetensors.torch import load_file, save_file

    root = Path(outdir) / model_id
    patterns = []
    with tempfile.TemporaryDirectory(prefix="unitgraph-tiny-") as scratch:
        folder = Path(writer(Path(scratch) / "pipe"))
        for sub in sorted(p.name for p in folder.iterdir() if p.is_dir()):
            src, dest = folder / sub, root / sub
            dest.mkdir(parents=True, exist_ok=True)
            weights = sorted(src.glob("*.safetensors"))
            if not weights:
                for f in src.iterdir():
                    shutil.copy2(f, dest / f.name)
                continue
            prefix = prefixes.get(sub, "")
            for w in weights:
                tensors = {(k if k.startswith(prefix) else prefix + k): v.contiguous() for k, v in load_file(str(w)).items()}
                save_file(tensors, str(dest / w.name))
                patterns.append(f"{model_id}:{sub}/{w.name}")
            shutil.copy2(src / "config.json", dest / "config.json")
    return {"model_id_with_origin_paths": ",".join(patterns), "tokenizer_path": str(root / "tokenizer")}

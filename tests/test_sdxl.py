"""The SDXL family beyond the conformance suite: its units compute what diffusers' StableDiffusionXLPipeline computes,
its loss is DiffSynth-Studio's DDPM objective, its default LoRA targets are DiffSynth's example's modules, and
DiffSynth's SDXL LoRA command runs verbatim but for the program name.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from diffsynth_wheel import load_module, wheel_modules  # noqa: E402
from clitools import cli  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.choice import choose  # noqa: E402
from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.families import sdxl  # noqa: E402
from unitgraph.backends.diffusion.families.sdxl import losses, real, render, tiny, units as u  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import latent_sampler, posterior_mean  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402
from shallow import shallow  # noqa: E402

SIZE = 32
REPO = Path(__file__).resolve().parents[1]
WHEEL = REPO / ".venv" / "diffsynth-wheel" / "diffsynth" / "diffusion"
needs_wheel = pytest.mark.skipif(not (WHEEL / "ddim_scheduler.py").is_file(), reason="the diffsynth wheel is not unpacked")
SDXL_REPO = Path("models") / "stabilityai" / "stable-diffusion-xl-base-1.0"
DATA = Path("data") / "diffsynth_example_dataset" / "stable_diffusion_xl" / "stable-diffusion-xl-base-1.0"

# examples/stable_diffusion_xl/model_training/lora/stable-diffusion-xl-base-1.0.sh, the training command verbatim but
# for the program name (`accelerate launch examples/stable_diffusion_xl/model_training/train.py` -> `unitgraph train`)
# and the sizes: --height/--width 1024 lowered to 32, --dataset_repeat 10 to 1, --num_epochs 5 to 2.
DIFFSYNTH_COMMAND = r"""
unitgraph train \
  --dataset_base_path data/diffsynth_example_dataset/stable_diffusion_xl/stable-diffusion-xl-base-1.0 \
  --dataset_metadata_path data/diffsynth_example_dataset/stable_diffusion_xl/stable-diffusion-xl-base-1.0/metadata.csv \
  --height 32 \
  --width 32 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "stabilityai/stable-diffusion-xl-base-1.0:text_encoder/model.safetensors,stabilityai/stable-diffusion-xl-base-1.0:text_encoder_2/model.safetensors,stabilityai/stable-diffusion-xl-base-1.0:unet/diffusion_pytorch_model.safetensors,stabilityai/stable-diffusion-xl-base-1.0:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 2 \
  --remove_prefix_in_ckpt "pipe.unet." \
  --output_path "./models/train/stable-diffusion-xl-base-1.0_lora" \
  --lora_base_model "unet" \
  --lora_target_modules "mid_block.attentions.0.proj_in,mid_block.attentions.0.proj_out,down_blocks.1.attentions.0.proj_in,down_blocks.1.attentions.0.proj_out,down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k,down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0,down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q,down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_v,down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k,down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_out.0,down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_q,down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_v,down_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj,down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2,down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_k,down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_out.0,down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q,down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_v,down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k,down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_out.0,down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_q,down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_v,down_blocks.1.attentions.0.transformer_blocks.1.ff.net.0.proj,down_blocks.1.attentions.0.transformer_blocks.1.ff.net.2,down_blocks.1.attentions.1.proj_in,down_blocks.1.attentions.1.proj_out,down_blocks.1.attentions.1.transformer_blocks.0.attn1.to_k,down_blocks.1.attentions.1.transformer_blocks.0.attn1.to_out.0,down_blocks.1.attentions.1.transformer_blocks.0.attn1.to_q,down_blocks.1.attentions.1.transformer_blocks.0.attn1.to_v,down_blocks.1.attentions.1.transformer_blocks.0.attn2.to_k,down_blocks.1.attentions.1.transformer_blocks.0.attn2.to_out.0,down_blocks.1.attentions.1.transformer_blocks.0.attn2.to_q,down_blocks.1.attentions.1.transformer_blocks.0.attn2.to_v,down_blocks.1.attentions.1.transformer_blocks.0.ff.net.0.proj,down_blocks.1.attentions.1.transformer_blocks.0.ff.net.2,down_blocks.1.attentions.1.transformer_blocks.1.attn1.to_k,down_blocks.1.attentions.1.transformer_blocks.1.attn1.to_out.0,down_blocks.1.attentions.1.transformer_blocks.1.attn1.to_q,down_blocks.1.attentions.1.transformer_blocks.1.attn1.to_v,down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_k,down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_out.0,down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_q,down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_v,down_blocks.1.attentions.1.transformer_blocks.1.ff.net.0.proj,down_blocks.1.attentions.1.transformer_blocks.1.ff.net.2,down_blocks.2.attentions.0.proj_in,down_blocks.2.attentions.0.proj_out,down_blocks.2.attentions.0.transformer_blocks.0.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.0.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.0.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.0.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.0.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.0.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.0.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.0.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.0.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.0.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.1.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.1.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.1.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.1.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.1.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.1.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.1.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.1.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.1.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.1.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.2.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.2.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.2.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.2.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.2.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.2.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.2.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.2.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.2.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.2.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.3.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.3.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.3.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.3.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.3.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.3.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.3.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.3.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.3.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.3.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.4.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.4.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.4.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.4.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.4.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.4.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.4.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.4.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.4.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.4.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.5.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.5.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.5.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.5.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.5.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.5.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.5.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.5.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.5.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.5.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.6.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.6.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.6.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.6.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.6.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.6.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.6.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.6.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.6.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.6.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.7.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.7.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.7.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.7.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.7.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.7.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.7.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.7.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.7.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.7.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.8.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.8.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.8.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.8.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.8.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.8.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.8.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.8.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.8.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.8.ff.net.2,down_blocks.2.attentions.0.transformer_blocks.9.attn1.to_k,down_blocks.2.attentions.0.transformer_blocks.9.attn1.to_out.0,down_blocks.2.attentions.0.transformer_blocks.9.attn1.to_q,down_blocks.2.attentions.0.transformer_blocks.9.attn1.to_v,down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_k,down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_out.0,down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_q,down_blocks.2.attentions.0.transformer_blocks.9.attn2.to_v,down_blocks.2.attentions.0.transformer_blocks.9.ff.net.0.proj,down_blocks.2.attentions.0.transformer_blocks.9.ff.net.2,down_blocks.2.attentions.1.proj_in,down_blocks.2.attentions.1.proj_out,down_blocks.2.attentions.1.transformer_blocks.0.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.0.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.0.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.0.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.0.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.0.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.0.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.0.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.0.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.0.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.1.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.1.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.1.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.1.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.1.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.1.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.2.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.2.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.2.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.2.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.2.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.2.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.2.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.2.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.2.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.2.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.3.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.3.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.3.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.3.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.3.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.3.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.3.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.3.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.3.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.3.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.4.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.4.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.4.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.4.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.4.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.4.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.4.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.4.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.4.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.4.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.5.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.5.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.5.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.5.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.5.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.5.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.5.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.5.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.5.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.5.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.6.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.6.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.6.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.6.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.6.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.6.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.6.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.6.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.6.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.6.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.7.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.7.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.7.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.7.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.7.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.7.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.7.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.7.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.7.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.7.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.8.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.8.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.8.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.8.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.8.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.8.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.8.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.8.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.8.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.8.ff.net.2,down_blocks.2.attentions.1.transformer_blocks.9.attn1.to_k,down_blocks.2.attentions.1.transformer_blocks.9.attn1.to_out.0,down_blocks.2.attentions.1.transformer_blocks.9.attn1.to_q,down_blocks.2.attentions.1.transformer_blocks.9.attn1.to_v,down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k,down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_out.0,down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_q,down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_v,down_blocks.2.attentions.1.transformer_blocks.9.ff.net.0.proj,down_blocks.2.attentions.1.transformer_blocks.9.ff.net.2,mid_block.attentions.0.transformer_blocks.0.attn1.to_k,mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.0.attn1.to_q,mid_block.attentions.0.transformer_blocks.0.attn1.to_v,mid_block.attentions.0.transformer_blocks.0.attn2.to_k,mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.0.attn2.to_q,mid_block.attentions.0.transformer_blocks.0.attn2.to_v,mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.0.ff.net.2,mid_block.attentions.0.transformer_blocks.1.attn1.to_k,mid_block.attentions.0.transformer_blocks.1.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.1.attn1.to_q,mid_block.attentions.0.transformer_blocks.1.attn1.to_v,mid_block.attentions.0.transformer_blocks.1.attn2.to_k,mid_block.attentions.0.transformer_blocks.1.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.1.attn2.to_q,mid_block.attentions.0.transformer_blocks.1.attn2.to_v,mid_block.attentions.0.transformer_blocks.1.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.1.ff.net.2,mid_block.attentions.0.transformer_blocks.2.attn1.to_k,mid_block.attentions.0.transformer_blocks.2.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.2.attn1.to_q,mid_block.attentions.0.transformer_blocks.2.attn1.to_v,mid_block.attentions.0.transformer_blocks.2.attn2.to_k,mid_block.attentions.0.transformer_blocks.2.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.2.attn2.to_q,mid_block.attentions.0.transformer_blocks.2.attn2.to_v,mid_block.attentions.0.transformer_blocks.2.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.2.ff.net.2,mid_block.attentions.0.transformer_blocks.3.attn1.to_k,mid_block.attentions.0.transformer_blocks.3.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.3.attn1.to_q,mid_block.attentions.0.transformer_blocks.3.attn1.to_v,mid_block.attentions.0.transformer_blocks.3.attn2.to_k,mid_block.attentions.0.transformer_blocks.3.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.3.attn2.to_q,mid_block.attentions.0.transformer_blocks.3.attn2.to_v,mid_block.attentions.0.transformer_blocks.3.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.3.ff.net.2,mid_block.attentions.0.transformer_blocks.4.attn1.to_k,mid_block.attentions.0.transformer_blocks.4.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.4.attn1.to_q,mid_block.attentions.0.transformer_blocks.4.attn1.to_v,mid_block.attentions.0.transformer_blocks.4.attn2.to_k,mid_block.attentions.0.transformer_blocks.4.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.4.attn2.to_q,mid_block.attentions.0.transformer_blocks.4.attn2.to_v,mid_block.attentions.0.transformer_blocks.4.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.4.ff.net.2,mid_block.attentions.0.transformer_blocks.5.attn1.to_k,mid_block.attentions.0.transformer_blocks.5.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.5.attn1.to_q,mid_block.attentions.0.transformer_blocks.5.attn1.to_v,mid_block.attentions.0.transformer_blocks.5.attn2.to_k,mid_block.attentions.0.transformer_blocks.5.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.5.attn2.to_q,mid_block.attentions.0.transformer_blocks.5.attn2.to_v,mid_block.attentions.0.transformer_blocks.5.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.5.ff.net.2,mid_block.attentions.0.transformer_blocks.6.attn1.to_k,mid_block.attentions.0.transformer_blocks.6.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.6.attn1.to_q,mid_block.attentions.0.transformer_blocks.6.attn1.to_v,mid_block.attentions.0.transformer_blocks.6.attn2.to_k,mid_block.attentions.0.transformer_blocks.6.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.6.attn2.to_q,mid_block.attentions.0.transformer_blocks.6.attn2.to_v,mid_block.attentions.0.transformer_blocks.6.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.6.ff.net.2,mid_block.attentions.0.transformer_blocks.7.attn1.to_k,mid_block.attentions.0.transformer_blocks.7.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.7.attn1.to_q,mid_block.attentions.0.transformer_blocks.7.attn1.to_v,mid_block.attentions.0.transformer_blocks.7.attn2.to_k,mid_block.attentions.0.transformer_blocks.7.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.7.attn2.to_q,mid_block.attentions.0.transformer_blocks.7.attn2.to_v,mid_block.attentions.0.transformer_blocks.7.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.7.ff.net.2,mid_block.attentions.0.transformer_blocks.8.attn1.to_k,mid_block.attentions.0.transformer_blocks.8.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.8.attn1.to_q,mid_block.attentions.0.transformer_blocks.8.attn1.to_v,mid_block.attentions.0.transformer_blocks.8.attn2.to_k,mid_block.attentions.0.transformer_blocks.8.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.8.attn2.to_q,mid_block.attentions.0.transformer_blocks.8.attn2.to_v,mid_block.attentions.0.transformer_blocks.8.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.8.ff.net.2,mid_block.attentions.0.transformer_blocks.9.attn1.to_k,mid_block.attentions.0.transformer_blocks.9.attn1.to_out.0,mid_block.attentions.0.transformer_blocks.9.attn1.to_q,mid_block.attentions.0.transformer_blocks.9.attn1.to_v,mid_block.attentions.0.transformer_blocks.9.attn2.to_k,mid_block.attentions.0.transformer_blocks.9.attn2.to_out.0,mid_block.attentions.0.transformer_blocks.9.attn2.to_q,mid_block.attentions.0.transformer_blocks.9.attn2.to_v,mid_block.attentions.0.transformer_blocks.9.ff.net.0.proj,mid_block.attentions.0.transformer_blocks.9.ff.net.2,up_blocks.0.attentions.0.proj_in,up_blocks.0.attentions.0.proj_out,up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.0.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.0.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.0.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.0.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.1.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.1.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.1.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.1.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.1.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.1.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.1.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.1.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.1.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.1.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.2.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.2.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.2.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.2.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.2.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.2.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.2.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.2.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.2.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.2.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.3.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.3.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.3.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.3.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.3.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.3.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.3.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.3.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.3.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.3.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.4.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.4.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.4.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.4.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.4.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.4.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.4.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.4.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.4.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.4.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.5.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.5.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.5.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.5.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.5.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.5.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.5.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.5.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.5.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.5.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.6.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.6.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.6.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.6.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.6.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.6.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.6.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.6.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.6.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.6.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.7.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.7.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.7.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.7.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.7.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.7.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.7.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.7.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.7.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.7.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.8.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.8.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.8.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.8.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.8.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.8.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.8.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.8.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.8.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.8.ff.net.2,up_blocks.0.attentions.0.transformer_blocks.9.attn1.to_k,up_blocks.0.attentions.0.transformer_blocks.9.attn1.to_out.0,up_blocks.0.attentions.0.transformer_blocks.9.attn1.to_q,up_blocks.0.attentions.0.transformer_blocks.9.attn1.to_v,up_blocks.0.attentions.0.transformer_blocks.9.attn2.to_k,up_blocks.0.attentions.0.transformer_blocks.9.attn2.to_out.0,up_blocks.0.attentions.0.transformer_blocks.9.attn2.to_q,up_blocks.0.attentions.0.transformer_blocks.9.attn2.to_v,up_blocks.0.attentions.0.transformer_blocks.9.ff.net.0.proj,up_blocks.0.attentions.0.transformer_blocks.9.ff.net.2,up_blocks.0.attentions.1.proj_in,up_blocks.0.attentions.1.proj_out,up_blocks.0.attentions.1.transformer_blocks.0.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.0.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.0.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.0.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.0.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.0.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.0.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.0.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.0.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.1.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.1.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.1.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.1.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.1.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.1.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.1.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.1.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.1.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.1.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.2.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.2.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.2.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.2.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.2.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.2.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.2.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.2.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.2.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.2.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.3.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.3.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.3.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.3.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.3.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.3.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.3.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.3.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.3.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.3.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.4.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.4.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.4.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.4.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.4.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.4.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.4.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.4.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.4.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.4.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.5.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.5.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.5.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.5.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.5.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.5.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.5.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.5.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.5.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.5.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.6.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.6.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.6.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.6.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.6.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.6.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.6.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.6.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.6.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.6.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.7.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.7.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.7.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.7.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.7.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.7.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.7.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.7.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.7.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.7.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.8.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.8.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.8.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.8.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.8.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.8.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.8.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.8.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.8.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.8.ff.net.2,up_blocks.0.attentions.1.transformer_blocks.9.attn1.to_k,up_blocks.0.attentions.1.transformer_blocks.9.attn1.to_out.0,up_blocks.0.attentions.1.transformer_blocks.9.attn1.to_q,up_blocks.0.attentions.1.transformer_blocks.9.attn1.to_v,up_blocks.0.attentions.1.transformer_blocks.9.attn2.to_k,up_blocks.0.attentions.1.transformer_blocks.9.attn2.to_out.0,up_blocks.0.attentions.1.transformer_blocks.9.attn2.to_q,up_blocks.0.attentions.1.transformer_blocks.9.attn2.to_v,up_blocks.0.attentions.1.transformer_blocks.9.ff.net.0.proj,up_blocks.0.attentions.1.transformer_blocks.9.ff.net.2,up_blocks.0.attentions.2.proj_in,up_blocks.0.attentions.2.proj_out,up_blocks.0.attentions.2.transformer_blocks.0.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.0.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.0.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.0.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.0.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.0.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.1.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.1.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.1.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.1.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.1.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.1.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.1.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.1.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.1.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.1.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.2.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.2.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.2.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.2.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.2.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.2.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.2.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.2.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.2.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.2.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.3.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.3.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.3.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.3.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.3.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.3.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.3.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.3.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.3.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.3.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.4.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.4.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.4.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.4.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.4.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.4.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.4.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.4.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.4.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.4.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.5.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.5.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.5.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.5.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.5.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.5.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.5.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.5.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.5.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.5.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.6.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.6.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.6.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.6.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.6.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.6.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.6.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.6.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.6.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.6.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.7.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.7.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.7.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.7.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.7.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.7.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.7.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.7.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.7.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.7.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.8.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.8.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.8.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.8.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.8.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.8.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.8.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.8.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.8.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.8.ff.net.2,up_blocks.0.attentions.2.transformer_blocks.9.attn1.to_k,up_blocks.0.attentions.2.transformer_blocks.9.attn1.to_out.0,up_blocks.0.attentions.2.transformer_blocks.9.attn1.to_q,up_blocks.0.attentions.2.transformer_blocks.9.attn1.to_v,up_blocks.0.attentions.2.transformer_blocks.9.attn2.to_k,up_blocks.0.attentions.2.transformer_blocks.9.attn2.to_out.0,up_blocks.0.attentions.2.transformer_blocks.9.attn2.to_q,up_blocks.0.attentions.2.transformer_blocks.9.attn2.to_v,up_blocks.0.attentions.2.transformer_blocks.9.ff.net.0.proj,up_blocks.0.attentions.2.transformer_blocks.9.ff.net.2,up_blocks.1.attentions.0.proj_in,up_blocks.1.attentions.0.proj_out,up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k,up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0,up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q,up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_v,up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k,up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_out.0,up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_q,up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_v,up_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj,up_blocks.1.attentions.0.transformer_blocks.0.ff.net.2,up_blocks.1.attentions.0.transformer_blocks.1.attn1.to_k,up_blocks.1.attentions.0.transformer_blocks.1.attn1.to_out.0,up_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q,up_blocks.1.attentions.0.transformer_blocks.1.attn1.to_v,up_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k,up_blocks.1.attentions.0.transformer_blocks.1.attn2.to_out.0,up_blocks.1.attentions.0.transformer_blocks.1.attn2.to_q,up_blocks.1.attentions.0.transformer_blocks.1.attn2.to_v,up_blocks.1.attentions.0.transformer_blocks.1.ff.net.0.proj,up_blocks.1.attentions.0.transformer_blocks.1.ff.net.2,up_blocks.1.attentions.1.proj_in,up_blocks.1.attentions.1.proj_out,up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_k,up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_out.0,up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_q,up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_v,up_blocks.1.attentions.1.transformer_blocks.0.attn2.to_k,up_blocks.1.attentions.1.transformer_blocks.0.attn2.to_out.0,up_blocks.1.attentions.1.transformer_blocks.0.attn2.to_q,up_blocks.1.attentions.1.transformer_blocks.0.attn2.to_v,up_blocks.1.attentions.1.transformer_blocks.0.ff.net.0.proj,up_blocks.1.attentions.1.transformer_blocks.0.ff.net.2,up_blocks.1.attentions.1.transformer_blocks.1.attn1.to_k,up_blocks.1.attentions.1.transformer_blocks.1.attn1.to_out.0,up_blocks.1.attentions.1.transformer_blocks.1.attn1.to_q,up_blocks.1.attentions.1.transformer_blocks.1.attn1.to_v,up_blocks.1.attentions.1.transformer_blocks.1.attn2.to_k,up_blocks.1.attentions.1.transformer_blocks.1.attn2.to_out.0,up_blocks.1.attentions.1.transformer_blocks.1.attn2.to_q,up_blocks.1.attentions.1.transformer_blocks.1.attn2.to_v,up_blocks.1.attentions.1.transformer_blocks.1.ff.net.0.proj,up_blocks.1.attentions.1.transformer_blocks.1.ff.net.2,up_blocks.1.attentions.2.proj_in,up_blocks.1.attentions.2.proj_out,up_blocks.1.attentions.2.transformer_blocks.0.attn1.to_k,up_blocks.1.attentions.2.transformer_blocks.0.attn1.to_out.0,up_blocks.1.attentions.2.transformer_blocks.0.attn1.to_q,up_blocks.1.attentions.2.transformer_blocks.0.attn1.to_v,up_blocks.1.attentions.2.transformer_blocks.0.attn2.to_k,up_blocks.1.attentions.2.transformer_blocks.0.attn2.to_out.0,up_blocks.1.attentions.2.transformer_blocks.0.attn2.to_q,up_blocks.1.attentions.2.transformer_blocks.0.attn2.to_v,up_blocks.1.attentions.2.transformer_blocks.0.ff.net.0.proj,up_blocks.1.attentions.2.transformer_blocks.0.ff.net.2,up_blocks.1.attentions.2.transformer_blocks.1.attn1.to_k,up_blocks.1.attentions.2.transformer_blocks.1.attn1.to_out.0,up_blocks.1.attentions.2.transformer_blocks.1.attn1.to_q,up_blocks.1.attentions.2.transformer_blocks.1.attn1.to_v,up_blocks.1.attentions.2.transformer_blocks.1.attn2.to_k,up_blocks.1.attentions.2.transformer_blocks.1.attn2.to_out.0,up_blocks.1.attentions.2.transformer_blocks.1.attn2.to_q,up_blocks.1.attentions.2.transformer_blocks.1.attn2.to_v,up_blocks.1.attentions.2.transformer_blocks.1.ff.net.0.proj,up_blocks.1.attentions.2.transformer_blocks.1.ff.net.2" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --align_to_opensource_format
"""


def quiet(_text: str) -> None:
    pass


def diffsynth_targets() -> list[str]:
    return re.search(r'--lora_target_modules "([^"]+)"', DIFFSYNTH_COMMAND).group(1).split(",")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tiny.write_tiny_models(tmp_path_factory.mktemp("sdxl") / "models", size="test", seed=0)


@pytest.fixture(scope="module")
def pipe(models):
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(str(models))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sdxl-data")
    write_synthetic_dataset(folder, count=3, size=SIZE, seed=1)
    return folder


def context(pipe, **settings) -> UnitContext:
    loaded = {"unet": pipe.unet, "vae": pipe.vae, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2,
              "tokenizer": pipe.tokenizer, "tokenizer_2": pipe.tokenizer_2, "scheduler": pipe.scheduler}
    return UnitContext(models=loaded, settings=UnitSettings(**settings))


def encode(ctx, prompt: str) -> dict:
    """The prompt units chained as the pipeline chains them."""
    state = {"prompt": prompt}
    for unit in (u.clip_prompt_encoder, u.clip_2_prompt_encoder, u.prompt_embed_joiner):
        state.update(unit(ctx, state))
    return state


# ------------------------------------------------------------------------------------------------
# the plans


def test_the_plans_keep_what_does_not_train_in_stage_1():
    import unitgraph
    from unitgraph.backends.diffusion.flowmatch import with_vae_latents

    pipeline = sdxl.SDXL.spec_pipeline
    lora = unitgraph.split(pipeline, lora_base_model="unet")
    assert lora.data_process_models == ["text_encoder", "text_encoder_2", "vae"] and lora.train_models == ["unet"]
    # DiffSynth's SDXL latent is a posterior draw: the sampler runs in stage 2, the cache holds the posterior
    assert set(lora.train_units) == {"LatentSampler", "NoiseInitializer", "TimestepSampler"}
    assert {p for p, _ in lora.cache_entries} == {"latent_mean", "latent_logvar", "prompt_emb", "pooled_prompt_emb",
                                                  "add_time_ids"}
    # a LoRA on the first encoder: it and the join run in stage 2, the second encoder's outputs are cached
    first = unitgraph.split(pipeline, lora_base_model="text_encoder")
    assert {"ClipPromptEncoder", "PromptEmbedJoiner"} <= set(first.train_units)
    assert "Clip2PromptEncoder" in first.data_process_units and "text_encoder_2" not in first.train_models
    assert {("prompt_emb_2", "Clip2PromptEncoder"), ("pooled_prompt_emb", "Clip2PromptEncoder")} <= set(first.cache_entries)
    # --vae_latents mean: the posterior mean, computed once in stage 1
    mean_def = with_vae_latents(sdxl.SDXL, "mean")
    mean = unitgraph.split(mean_def.spec_pipeline, lora_base_model="unet")
    assert "PosteriorMean" in mean.data_process_units and ("input_latents", "PosteriorMean") in mean.cache_entries
    assert with_vae_latents(sdxl.SDXL, None) is sdxl.SDXL and with_vae_latents(sdxl.SDXL, "sample") is sdxl.SDXL
    for spec, plan in ((pipeline, lora), (pipeline, first), (mean_def.spec_pipeline, mean)):
        assert unitgraph.verify(spec, plan) == []


# ------------------------------------------------------------------------------------------------
# the units against diffusers' StableDiffusionXLPipeline


def test_the_tiny_tokenizers_pad_as_sdxls(pipe):
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == u.CLIP_MAX_LENGTH
    assert pipe.tokenizer.pad_token == "<|endoftext|>" and pipe.tokenizer_2.pad_token == "!"
    ids = u.token_ids(pipe.tokenizer_2, ["a red circle"])
    assert ids.shape == (1, 77) and ids[0, -1] == pipe.tokenizer_2.convert_tokens_to_ids("!")


def test_prompt_units_match_the_pipelines_encode_prompt(pipe):
    ctx = context(pipe)
    prompt = "a green square on a white background"
    embeds, _, pooled, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False)
    ours = encode(ctx, prompt)
    assert torch.equal(ours["prompt_emb"], embeds) and torch.equal(ours["pooled_prompt_emb"], pooled)
    clip, clip_2 = tiny.SIZES["test"]["clip"], tiny.SIZES["test"]["clip_2"]
    assert ours["prompt_emb"].shape == (1, 77, clip["hidden_size"] + clip_2["hidden_size"])
    assert ours["pooled_prompt_emb"].shape == (1, clip_2["projection_dim"])
    # each encoder's part is its own penultimate layer: the first's columns come first
    assert torch.equal(ours["prompt_emb"][..., :clip["hidden_size"]], ours["prompt_emb_1"])
    hidden = pipe.text_encoder(u.token_ids(pipe.tokenizer, [prompt]), output_hidden_states=True).hidden_states
    assert torch.equal(ours["prompt_emb_1"], hidden[-2]) and not torch.equal(ours["prompt_emb_1"], hidden[-1])
    # the batched form (stage 1's --data_process_batch_size) gives each prompt its own embedding
    samples = [{"prompt": prompt}, {"prompt": "a dog"}]
    batched = u.clip_2_prompt_encoder.run_batch(ctx, samples)
    for sample, out in zip(samples, batched):
        alone = u.clip_2_prompt_encoder(ctx, sample)
        assert all(torch.allclose(out[k], alone[k], atol=1e-6) for k in alone)


def test_time_ids_match_the_pipelines(pipe):
    ctx = context(pipe, image_size=ImageSize(48, 32))  # --height 48 --width 32: a portrait image
    from PIL import Image

    shaped = u.shape_checker(ctx, {"image": Image.new("RGB", (64, 80), (10, 200, 30))})
    assert shaped["image"].shape == (1, 3, 48, 32) and (shaped["height"], shaped["width"]) == (48, 32)
    ours = u.add_time_ids_computer(ctx, shaped)["add_time_ids"]
    theirs = pipe._get_add_time_ids((48, 32), (0, 0), (48, 32), dtype=torch.float32,
                                    text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
    assert ours.dtype == torch.long and torch.equal(ours.float(), theirs) and ours.tolist() == [[48, 32, 0, 0, 48, 32]]
    # --max_pixels sizes sides to multiples of 32, as DiffSynth's SDXL dataset does
    free = context(pipe, image_size=ImageSize(max_pixels=100 * 60))
    assert u.shape_checker(free, {"image": Image.new("RGB", (100, 60))})["image"].shape == (1, 3, 32, 96)


def test_the_latents_are_the_vae_posterior_times_the_scaling_factor(pipe):
    ctx = context(pipe)
    pixels = torch.rand(1, 3, SIZE, SIZE) * 2 - 1
    out = u.image_encoder(ctx, {"image": pixels})
    posterior = pipe.vae.encode(pixels).latent_dist
    scale = pipe.vae.config.scaling_factor
    assert scale == 0.13025 and pipe.vae.config.shift_factor is None
    assert torch.equal(out["latent_mean"], posterior.mean * scale)
    assert torch.allclose(out["latent_logvar"].exp().sqrt(), posterior.std * scale, rtol=1e-5)
    assert torch.equal(posterior_mean(ctx, out)["input_latents"], out["latent_mean"])
    # the sampler's draw is DiffSynth's `vae.encode(image).sample() * scaling_factor` given the same noise
    drawing = dataclasses.replace(ctx, epoch=0, sample_key="s")
    drawn = latent_sampler(drawing, out)["input_latents"]
    assert torch.allclose(drawn, posterior.sample(generator=drawing.rng("latent")) * scale, atol=1e-6)
    assert not torch.allclose(drawn, out["latent_mean"])


def test_a_float16_vae_that_asks_for_it_encodes_in_float32(pipe):
    """SDXL's VAE overflows in float16 (force_upcast): at --mixed_precision fp16 it encodes in float32, as the
    pipeline decodes; a bfloat16 VAE is left as it is."""
    pixels = (torch.rand(1, 3, SIZE, SIZE) * 2 - 1).half()  # as the shape checker makes them at fp16
    half = copy.deepcopy(pipe.vae).half()
    expected = copy.deepcopy(half).float().encode(pixels.float()).latent_dist.mean * half.config.scaling_factor
    ctx = UnitContext(models={"vae": half}, settings=UnitSettings(dtype="float16"))
    out = u.image_encoder(ctx, {"image": pixels})
    assert out["latent_mean"].dtype == torch.float32 and torch.equal(out["latent_mean"], expected)
    assert next(half.parameters()).dtype == torch.float32
    brain = copy.deepcopy(pipe.vae).to(torch.bfloat16)
    ctx = UnitContext(models={"vae": brain}, settings=UnitSettings(dtype="bfloat16"))
    assert u.image_encoder(ctx, {"image": pixels.to(torch.bfloat16)})["latent_mean"].dtype == torch.bfloat16
    assert next(brain.parameters()).dtype == torch.bfloat16


def test_the_losss_unet_call_is_the_pipelines_denoising_step(pipe):
    """The UNet call the pipeline makes in a denoising step (captured), made again by the loss's predict() from our
    units' embeddings and ids: the same output."""
    ctx = context(pipe)
    prompt = "a dog"
    embeds, _, pooled, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False)
    calls = []
    hook = pipe.unet.register_forward_hook(lambda m, args, kwargs, out: calls.append((args, kwargs, out[0])),
                                           with_kwargs=True)
    try:
        latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=latents, height=SIZE, width=SIZE,
                 num_inference_steps=2, guidance_scale=1.0, output_type="latent")
    finally:
        hook.remove()
    args, kwargs, expected = calls[0]
    sample, t = args[0], args[1]
    assert float(t) == int(t) and int(t) > 0
    ours = encode(ctx, prompt)
    ids = u.add_time_ids_computer(ctx, {"height": SIZE, "width": SIZE})["add_time_ids"]
    with torch.no_grad():
        pred = losses.predict(ctx, sample, torch.tensor([int(t)]), ours["prompt_emb"], ours["pooled_prompt_emb"], ids)
    assert torch.equal(pred, expected)
    assert torch.equal(kwargs["added_cond_kwargs"]["time_ids"], ids.float())


def test_a_unet_and_text_encoder_2_of_different_models_are_one_line(pipe):
    ctx = context(pipe)
    with pytest.raises(BackendError, match="the UNet expects an added embedding of 64 values"):
        losses.predict(ctx, torch.zeros(1, 4, 4, 4), torch.tensor([10]), torch.zeros(1, 77, 48), torch.zeros(1, 8),
                       torch.zeros(1, 6, dtype=torch.long))


def test_render_draws_what_the_pipeline_draws(pipe):
    ctx = context(pipe)
    state = encode(ctx, "a cat")
    embeds = {k: state[k] for k in ("prompt_emb_1", "prompt_emb_2", "pooled_prompt_emb")}
    models = {"unet": pipe.unet, "vae": pipe.vae, "scheduler": pipe.scheduler}
    got = render.render(sdxl.SDXL, models, embeds, SIZE, SIZE, 2, torch.Generator().manual_seed(1))
    expected = pipe(prompt="a cat", width=SIZE, height=SIZE, num_inference_steps=2, guidance_scale=render.GUIDANCE,
                    generator=torch.Generator().manual_seed(1)).images[0]
    assert got.size == (SIZE, SIZE) and got.tobytes() == expected.tobytes()


# ------------------------------------------------------------------------------------------------
# the objective against DiffSynth-Studio's own code



@pytest.fixture(scope="module")
def diffsynth():
    """DiffSynth's DDIM scheduler and loss modules, loaded from the wheel's files (loss.py's one package import
    stood in for)."""
    with wheel_modules("_sdxl_diffsynth", "ddim_scheduler", "loss") as modules:
        yield modules


def _model_fn(unet, latents=None, timestep=None, prompt_embeds=None, pooled_prompt_embeds=None, add_time_ids=None,
              **kwargs):
    """DiffSynth's model_fn_stable_diffusion_xl, around diffusers' UNet (its own SDXL UNet has diffusers' modules)."""
    added = {"text_embeds": pooled_prompt_embeds, "time_ids": add_time_ids}
    return unet(latents, timestep, encoder_hidden_states=prompt_embeds, added_cond_kwargs=added, return_dict=False)[0]


@needs_wheel
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("position", [0, 371, 999])
def test_the_loss_is_diffsynths_flowmatch_sft_loss_around_its_ddim_scheduler(pipe, diffsynth, prediction, position,
                                                                              monkeypatch):
    """Given the timestep and noise DiffSynth's loss draws, our loss is the value of its FlowMatchSFTLoss with the
    DDIM scheduler its SDXL pipeline trains with (set_timesteps(1000, training=True)), around the same UNet."""
    ddim, loss = diffsynth
    scheduler = ddim.DDIMScheduler(prediction_type=prediction)
    scheduler.set_timesteps(1000, training=True)
    ours_scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config, prediction_type=prediction)
    ctx = UnitContext(models={"unet": pipe.unet, "scheduler": ours_scheduler})
    state = encode(context(pipe), "a red circle")
    ids = u.add_time_ids_computer(ctx, {"height": SIZE, "width": SIZE})["add_time_ids"]
    x0 = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    noise = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    theirs_pipe = types.SimpleNamespace(scheduler=scheduler, torch_dtype=torch.float32, device="cpu",
                                        in_iteration_models=("unet",), unet=pipe.unet, model_fn=_model_fn)
    monkeypatch.setattr(loss.torch, "randint", lambda *a, **k: torch.tensor([position]))
    monkeypatch.setattr(loss.torch, "randn_like", lambda like: noise.clone())
    with torch.no_grad():
        theirs = loss.FlowMatchSFTLoss(theirs_pipe, input_latents=x0, prompt_embeds=state["prompt_emb"],
                                       pooled_prompt_embeds=state["pooled_prompt_emb"], add_time_ids=ids.float())
    monkeypatch.undo()
    t = int(scheduler.timesteps[position])
    assert t == 999 - position
    with torch.no_grad():
        ours = losses.denoising_loss(ctx, {"input_latents": x0, "noise": noise, "timestep": torch.tensor([t]), "loss_weight": None,
                                      "prompt_emb": state["prompt_emb"], "pooled_prompt_emb": state["pooled_prompt_emb"],
                                      "add_time_ids": ids})
    assert float(ours) == pytest.approx(float(theirs), rel=2e-6, abs=1e-7)


def test_timesteps_are_integers_within_the_boundaries(pipe):
    ctx = UnitContext(models={"scheduler": pipe.scheduler}, settings=UnitSettings(timestep_bounds=(0.0, 0.1)), epoch=0,
                      sample_key="s")
    drawn = u.timestep_sampler(ctx, {})
    assert drawn["timestep"].dtype == torch.long and 900 <= int(drawn["timestep"]) <= 999 and drawn["loss_weight"] is None


# ------------------------------------------------------------------------------------------------
# LoRA targets, model ids, released configs


def test_the_default_unet_targets_are_diffsynths_example_modules():
    """The example's 722 full module paths and the default suffixes reach the same modules of the released UNet."""
    from accelerate import init_empty_weights

    config = {k: v for k, v in real.UNET.items() if not k.startswith("_")}
    with init_empty_weights():
        unet = diffusers.UNet2DConditionModel.from_config(config)
    names = {n for n, _ in unet.named_modules()}
    listed = diffsynth_targets()
    assert len(listed) == 722 and set(listed) <= names  # diffusers' names: nothing to map
    suffixes = sdxl.FAMILY.slot("unet").lora_targets
    reached = {n for n in names if any(n == s or n.endswith("." + s) for s in suffixes)}
    assert reached == set(listed)
    assert sdxl.FAMILY.slot("unet").lora_modules(tuple(listed)) == tuple(listed)  # no aliases


def test_a_target_list_that_names_nothing_in_the_unet_is_one_line(pipe):
    from unitgraph.backends.diffusion.models.lora import add_lora

    unet = copy.deepcopy(pipe.unet)
    with pytest.raises(BackendError, match="no such modules in unet"):
        add_lora(unet, "unet", ["down_blocks.2.attentions.1.transformer_blocks.9.attn1.to_k"], 4, None, seed=0)


def test_each_tokenizer_is_found_though_both_are_clip_tokenizers(capsys, tmp_path):
    """A pipeline folder's tokenizer_2/ is tokenizer_2 (model_index.json says so), as is the one beside
    text_encoder_2's folder and --tokenizer_2_path; `tiny-models --pipeline sdxl` writes the folder."""
    from unitgraph.backends.diffusion.models.sources import ModelSources

    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "m"), "--pipeline", "sdxl")
    assert code == 0 and "Stable Diffusion XL" in out, err
    root = tmp_path / "m"
    whole = ModelSources(sdxl.FAMILY, str(root))
    assert {s: whole.resolve(s).path for s in ("tokenizer", "tokenizer_2")} == {
        "tokenizer": root / "tokenizer", "tokenizer_2": root / "tokenizer_2"}
    beside = ModelSources(sdxl.FAMILY, [str(root / "text_encoder"), str(root / "text_encoder_2")])
    assert beside.resolve("tokenizer_2").path == root / "tokenizer_2"
    assert beside.resolve("text_encoder_2").class_name == "CLIPTextModelWithProjection"
    flags = ModelSources(sdxl.FAMILY, [str(root / "unet")], tokenizer_path=str(root / "tokenizer_2"),
                         tokenizer_2_path=str(root / "tokenizer"))
    assert flags.resolve("tokenizer").path == root / "tokenizer_2" and flags.resolve("tokenizer_2").path == root / "tokenizer"
    assert flags.resolve("scheduler").class_name == "EulerDiscreteScheduler"  # beside the UNet's folder
    loaded = whole.load(["tokenizer_2"])["tokenizer_2"]
    assert loaded.pad_token == "!"


@pytest.mark.parametrize("model_id", [sdxl.SDXL_MODEL, "AI-ModelScope/stable-diffusion-xl-base-1.0"])
def test_the_model_ids_choose_sdxl(model_id):
    ids = ",".join(f"{model_id}:{p}" for p in ("text_encoder/model.safetensors", "text_encoder_2/model.safetensors",
                                               "unet/diffusion_pytorch_model.safetensors"))
    chosen = choose(make_args(model_id_with_origin_paths=ids, lora_base_model="unet"))
    assert chosen.line == f"pipeline: sdxl (the model id {model_id})"


def test_the_released_configs_build_to_the_published_sizes(capsys, tmp_path):
    from unitgraph.backends.diffusion.memory_plan import build_meta
    from unitgraph.backends.diffusion.models.sources import ModelSources

    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", "sdxl", "--size", "real")
    assert code == 0, err
    assert "no weights" in out and not list((tmp_path / "real").rglob("*.safetensors"))
    sources = ModelSources(sdxl.SLOTS, str(tmp_path / "real"), offline=True)
    published = {"unet": 2.567e9, "text_encoder_2": 0.695e9, "text_encoder": 0.123e9, "vae": 0.0837e9}
    for slot, count in published.items():
        model = build_meta(sdxl.FAMILY.slot(slot), sources.load_config(slot), "bfloat16")
        assert abs(sum(p.numel() for p in model.parameters()) - count) < 0.005 * count, slot
    assert sources.load(["scheduler"])["scheduler"].config.prediction_type == "epsilon"


@pytest.mark.slow
def test_the_dry_run_of_the_released_model_at_1024_px(capsys, tmp_path):
    """Stage 2 of a UNet LoRA holds the UNet alone; the latent is SDXL's 128 x 128."""
    # 2 blocks a stack: what is checked does not depend on depth
    shallow(real.write_real_configs(tmp_path / "real"), ("unet", "text_encoder", "text_encoder_2"))
    code, out, err = cli(capsys, "train", "--dry_run", "--json", "--model_paths", str(tmp_path / "real"),
                         "--dataset_base_path", str(tmp_path), "--lora_base_model", "unet", "--height", "1024",
                         "--width", "1024")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    assert set(plan["stages"]["train"]["models"]) == {"unet"}
    assert set(plan["stages"]["data_process"]["models"]) == {"text_encoder", "text_encoder_2", "vae"}
    assert plan["settings"]["size"]["latent"] == [4, 128, 128]


# ------------------------------------------------------------------------------------------------
# runs


@pytest.mark.slow
def test_a_text_encoder_2_lora_keeps_clip_and_the_vae_in_stage_1_and_loads_in_diffusers(models, data, tmp_path, capsys):
    code, _, err = cli(capsys, "plan", "diffusion:sdxl", "--lora_base_model", "text_encoder_2", "-o",
                       str(tmp_path / "plan.json"))
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert set(plan["train"]["models"]) == {"unet", "text_encoder_2"}
    assert set(plan["data_process"]["models"]) == {"text_encoder", "vae"}
    assert {"Clip2PromptEncoder", "PromptEmbedJoiner"} <= set(plan["train"]["units"])
    assert "ClipPromptEncoder" in plan["data_process"]["units"]
    result = run(make_args(task="sft:split", pipeline="sdxl", dataset_base_path=str(data),
                           dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(models),
                           lora_base_model="text_encoder_2", lora_rank=4, learning_rate=1e-2, max_pixels=SIZE * SIZE,
                           max_timestep_boundary=0.25, output_path=str(tmp_path / "out"), progress=False, plot=False),
                 echo=quiet)
    rows = read_loss_csv(tmp_path / "out" / "loss.csv")
    assert len(rows) == 3 and all(r["timestep"] == int(r["timestep"]) and r["timestep"] >= 750 for r in rows)
    saved = load_file(str(result.last_checkpoint))
    assert saved and all(k.startswith("text_encoder_2.") for k in saved)
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(str(models))
    before = pipe.encode_prompt("a red circle", do_classifier_free_guidance=False)[2]
    pipe.load_lora_weights(str(result.last_checkpoint))
    from peft.utils import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(pipe.text_encoder_2, adapter_name=next(iter(pipe.text_encoder_2.peft_config)))
    assert len(loaded) == len(saved) and all(torch.equal(v, saved[f"text_encoder_2.{k}"]) for k, v in loaded.items())
    after = pipe.encode_prompt("a red circle", do_classifier_free_guidance=False)[2]
    assert not torch.allclose(before, after)  # the trained LoRA changes the pooled embedding


@pytest.mark.slow
def test_validation_samples_render_in_a_bf16_stage_2(models, data, tmp_path):
    from PIL import Image

    common = dict(pipeline="sdxl", model_paths=str(models), lora_base_model="unet", lora_rank=4, max_pixels=SIZE * SIZE,
                  progress=False, plot=False, validation_prompt=["a red circle"], mixed_precision="bf16")
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  output_path=str(tmp_path / "cache"), **common), echo=quiet)
    result = run(make_args(task="sft:train", dataset_base_path=str(tmp_path / "cache"), output_path=str(tmp_path / "out"),
                           validation_inference_steps=2, **common), echo=quiet)
    assert result.steps == 3 and Image.open(tmp_path / "out" / "samples" / "epoch-0" / "0.png").size == (SIZE, SIZE)


@pytest.mark.slow
def test_diffsynths_sdxl_lora_command_runs_verbatim(models, tmp_path, user_shell):
    """The tiny models where DiffSynth downloads stabilityai/stable-diffusion-xl-base-1.0 (./models/<org>/<name>), its
    example data where its command reads it; the command run as a user pastes it (tests/pasted.py).

    The example names 722 modules of SDXL's UNet by their full paths; a tiny UNet of SDXL's layout has some of them
    (the first block of each attention level). DiffSynth hands the list to peft, which adapts every module the list
    names and skips the names the model lacks: so does unitgraph, and the LoRA sits on exactly the listed modules the
    tiny UNet has (a list naming none of them is one error line, test above)."""
    shutil.copytree(models, tmp_path / SDXL_REPO)
    write_synthetic_dataset(tmp_path / DATA, count=3, size=48, seed=8)
    done = user_shell.script(DIFFSYNTH_COMMAND, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: sdxl (the model id stabilityai/stable-diffusion-xl-base-1.0)" in done.stdout
    assert "--align_to_opensource_format" in done.stdout
    out = tmp_path / "models" / "train" / "stable-diffusion-xl-base-1.0_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == ["epoch-0.safetensors", "epoch-1.safetensors"]
    # --align_to_opensource_format wrote ComfyUI's layout (the UNet's LDM names); read back in diffusers' names
    from unitgraph.backends.diffusion.models.lora import read_lora_file

    assert all(k.startswith("diffusion_model.") for k in load_file(str(out / "epoch-1.safetensors")))
    config = json.loads((models / "unet" / "config.json").read_text())
    adapted = set(read_lora_file(out / "epoch-1.safetensors", "unet", sdxl.FAMILY.lora_prefixes(), config=config).modules)
    present = {n for n, _ in diffusers.UNet2DConditionModel.from_pretrained(str(models / "unet")).named_modules()}
    # 12 modules (8 attention, 2 feed-forward, proj_in, proj_out) in each of down_blocks.1.attentions.0, mid_block's
    # and up_blocks.0.attentions.0 and .1
    assert adapted == set(diffsynth_targets()) & present and len(adapted) == 48
    # converted to diffusers' layout (the file's header tells the UNet's layers per block), diffusers loads it, and it
    # changes the UNet
    done = user_shell.command(["lora", "convert", str(out / "epoch-1.safetensors"), str(tmp_path / "d.safetensors"),
                               "--to", "diffusers", "--pipeline", "sdxl", "--model", "unet"], tmp_path)
    assert done.returncode == 0, done.stderr
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(str(tmp_path / SDXL_REPO))
    block = pipe.unet.down_blocks[1].attentions[0].transformer_blocks[0]
    before = block.attn1.to_q.weight.detach().clone()
    pipe.load_lora_weights(str(tmp_path / "d.safetensors"))
    pipe.fuse_lora()
    assert not torch.equal(block.attn1.to_q.weight, before)
    if not (WHEEL.parent / "utils" / "lora" / "general.py").is_file():
        return
    # in DiffSynth's layout, DiffSynth's loader fuses the same change into a UNet of its module names
    done = user_shell.command(["lora", "convert", str(out / "epoch-1.safetensors"), str(tmp_path / "ds.safetensors"),
                               "--to", "diffsynth", "--pipeline", "sdxl", "--model", "unet",
                               "--remove_prefix_in_ckpt", "pipe.unet."], tmp_path)
    assert done.returncode == 0, done.stderr
    general = load_module("_sdxl_diffsynth_lora_general", WHEEL.parent / "utils" / "lora" / "general.py")
    unet = diffusers.UNet2DConditionModel.from_pretrained(str(models / "unet"))
    general.GeneralLoRALoader().fuse_lora_to_base_model(unet, load_file(str(tmp_path / "ds.safetensors")))
    fused = {n.replace(".base_layer.", "."): p for n, p in pipe.unet.named_parameters() if "lora_" not in n}
    theirs = dict(unet.named_parameters())
    assert set(theirs) == set(fused)
    assert all(torch.allclose(theirs[n], fused[n], atol=1e-6) for n in theirs)

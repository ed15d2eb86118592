"""`unitgraph lora convert IN OUT --to diffusers|diffsynth|comfyui`: a LoRA file in another loader's layout.

diffusers' `load_lora_weights` reads `transformer.<module>.lora_A.weight` with the LoRA config in the
header; DiffSynth-Studio's `pipe.load_lora(pipe.dit, path)` fuses `<module>.lora_A.default.weight`
with the scale folded into A; ComfyUI reads `diffusion_model.<release module>.lora_up.weight` / `lora_down` /
`alpha` in the release checkpoint's module names, a fused module's parts stacked into one exact LoRA
(backends/diffusion/train/checkpoints.py). Any of the three is read. A LoKr or LoHa (LyCORIS' layout) holds no
lora_A/lora_B pairs and is refused in one line: LyCORIS' readers load it as it is.
"""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer


def convert_command(
    source: Annotated[str, typer.Argument(metavar="IN", help="A LoRA safetensors file (any layout).", show_default=False)],
    target: Annotated[str, typer.Argument(metavar="OUT", help="The file to write.", show_default=False)],
    to: Annotated[str, typer.Option("--to", help="diffusers, diffsynth or comfyui.")] = "diffsynth",
    model: Annotated[Optional[str], typer.Option("--model", help="The model the LoRA is on (a model slot: dit, unet, text_encoder, ...; default: the family's denoiser).", show_default=False)] = None,
    pipeline: Annotated[Optional[str], typer.Option("--pipeline", help="The family's pipeline or family (default: the first registered family).")] = None,
    remove_prefix_in_ckpt: Annotated[Optional[str], typer.Option("--remove_prefix_in_ckpt", "--remove-prefix-in-ckpt", help="Strip this prefix from the written keys (DiffSynth's 'pipe.dit.').")] = None,
) -> None:
    """Rewrite a LoRA file in diffusers', DiffSynth-Studio's or ComfyUI's key layout (the in-memory model is the same)."""
    from unitgraph.backends.diffusion import registry
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.train.checkpoints import LAYOUTS, convert

    if to not in LAYOUTS:
        raise BackendError(f"--to must be one of {', '.join(LAYOUTS)}, got {to!r}")
    family = registry.find_pipeline(pipeline)[0] if pipeline else registry.default_family()
    prefixes = family.lora_prefixes()
    model = model or family.model_slots[0]
    if model not in prefixes:
        raise BackendError(f"--model {model!r} is not a model of the {family.title} family (models: {', '.join(prefixes)})")
    if os.path.exists(target) and os.path.exists(source) and os.path.samefile(source, target):
        raise BackendError("OUT is IN: write the converted file elsewhere (the original is never overwritten)", source=target)
    layout, count = convert(source, target, to, model, prefixes, remove_prefix_in_ckpt)
    typer.echo(f"converted {count} LoRA tensors of {model} from the {layout} to the {to} layout -> {target}")


def register(app: typer.Typer) -> None:
    lora_app = typer.Typer(name="lora", help="Convert LoRA files between diffusers', DiffSynth-Studio's and ComfyUI's layouts.",
                           no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    lora_app.command("convert")(convert_command)
    app.add_typer(lora_app, name="lora")

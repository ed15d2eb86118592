"""`unitgraph lora convert IN OUT --to diffusers|diffsynth`: a LoRA file in the other loader's layout.

diffusers' `load_lora_weights` reads `transformer.<module>.lora_A.weight` with the LoRA config in the
header; DiffSynth-Studio's `pipe.load_lora(pipe.dit, path)` fuses `<module>.lora_A.default.weight`
with the scale folded into A (backends/diffusion/train/checkpoints.py). Either layout is read.
"""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer


def convert_command(
    source: Annotated[str, typer.Argument(metavar="IN", help="A LoRA safetensors file (either layout).", show_default=False)],
    target: Annotated[str, typer.Argument(metavar="OUT", help="The file to write.", show_default=False)],
    to: Annotated[str, typer.Option("--to", help="diffusers or diffsynth.")] = "diffsynth",
    model: Annotated[Optional[str], typer.Option("--model", help="The model the LoRA is on (a model slot: dit, unet, text_encoder, ...; default: the family's denoiser).", show_default=False)] = None,
    pipeline: Annotated[Optional[str], typer.Option("--pipeline", help="The family's pipeline or family (default: the first registered family).")] = None,
    remove_prefix_in_ckpt: Annotated[Optional[str], typer.Option("--remove_prefix_in_ckpt", "--remove-prefix-in-ckpt", help="Strip this prefix from the written keys (DiffSynth's 'pipe.dit.').")] = None,
) -> None:
    """Rewrite a LoRA file in diffusers' or DiffSynth-Studio's key layout (the in-memory model is the same)."""
    from unitgraph.backends.diffusion import registry
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.train.checkpoints import convert

    if to not in ("diffusers", "diffsynth"):
        raise BackendError(f"--to must be diffusers or diffsynth, got {to!r}")
    family = registry.find_pipeline(pipeline)[0] if pipeline else registry.default_family()
    prefixes = {s.name: s.lora_prefix or s.name for s in family.slots if s.kind == "model"}
    model = model or family.model_slots[0]
    if model not in prefixes:
        raise BackendError(f"--model {model!r} is not a model of the {family.title} family (models: {', '.join(prefixes)})")
    if os.path.exists(target) and os.path.exists(source) and os.path.samefile(source, target):
        raise BackendError("OUT is IN: write the converted file elsewhere (the original is never overwritten)", source=target)
    layout, count = convert(source, target, to, model, prefixes, remove_prefix_in_ckpt)
    typer.echo(f"converted {count} LoRA tensors of {model} from the {layout} to the {to} layout -> {target}")


def register(app: typer.Typer) -> None:
    lora_app = typer.Typer(name="lora", help="Convert LoRA files between diffusers' and DiffSynth-Studio's layouts.",
                           no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    lora_app.command("convert")(convert_command)
    app.add_typer(lora_app, name="lora")

"""`unitgraph twin FILE`: the safetensors twin of a pickled model file, written once beside it.

A release that keeps a model as a `torch.save` pickle (`transformer.pth`) is read by unitgraph from
`transformer.safetensors` beside it; a run that finds no twin names this command in its one-line error
(backends/diffusion/models/twin.py says what the twin holds and why nothing is unpickled while a run reads models).
"""

from __future__ import annotations

from typing import Annotated

import typer


def twin_command(
    files: Annotated[list[str], typer.Argument(metavar="FILE...", help="Pickled model files (.pth, .pt, .bin, .ckpt).", show_default=False)],
) -> None:
    """Write NAME.safetensors beside each pickled NAME.pth: its tensors, read once by torch's weights-only loader (an existing twin is never overwritten)."""
    from unitgraph.backends.diffusion.models.twin import write_twin

    for file in files:
        target, count = write_twin(file)
        typer.echo(f"{count} tensors of {file} -> {target}")


def register(app: typer.Typer) -> None:
    app.command("twin")(twin_command)

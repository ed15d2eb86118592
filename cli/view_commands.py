"""`unitgraph inspect` (see a split) and `unitgraph explain` (why a unit is in its stage).

The command docstrings keep each paragraph on one line: typer's help (and docs/cli.md, generated
from it by `cli/docgen.py`) keeps line breaks inside a paragraph.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from unitgraph.atomic import write_bytes_atomic, write_text_atomic
from unitgraph.explain import explain
from unitgraph.plan import split, versioned_savings_line
from unitgraph.render import BINARY_FORMATS, FORMATS, SUFFIX_FORMATS, TEXT_WIDTH, render, text_renderables

from .options import (
    CacheMode,
    LoraBaseModel,
    Output,
    Provided,
    Source,
    Spec,
    TrainableModels,
    TrustRemoteCode,
    WithMetadata,
    check_cache_mode,
    load_spec,
    model_list,
    provided_params,
)

Format = Annotated[
    Optional[str],
    typer.Option(
        "--format",
        "-f",
        help=(
            "svg, png, pdf (drawn by Graphviz dot), dot, mermaid or text. "
            "Default: taken from the suffix of -o (.svg .png .pdf .dot .gv .mmd .txt), else text."
        ),
        show_default=False,
    ),
]
UnitName = Annotated[str, typer.Argument(metavar="UNIT", help="The name of a unit of SPEC.", show_default=False)]


def resolve_format(fmt: str | None, output: str | None) -> str:
    """The format to write: --format, else the suffix of -o, else text."""
    if fmt is not None:
        fmt = fmt.strip().lower()
        if fmt not in FORMATS:
            raise typer.BadParameter(f"must be one of {', '.join(FORMATS)}, got {fmt!r}", param_hint="--format")
        return fmt
    if output is None:
        return "text"
    suffix = Path(output).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        shown = f"suffix {suffix!r}" if suffix else "no suffix"
        raise typer.BadParameter(
            f"cannot tell the format of {output!r} ({shown}); pass --format {'|'.join(FORMATS)}",
            param_hint="--format",
        )
    return SUFFIX_FORMATS[suffix]


def inspect_command(
    spec: Spec,
    trainable_models: TrainableModels = "",
    lora_base_model: LoraBaseModel = None,
    cache_mode: CacheMode = "latest",
    with_params: Provided = None,
    with_metadata: WithMetadata = None,
    source: Source = None,
    trust_remote_code: TrustRemoteCode = False,
    fmt: Format = None,
    output: Output = None,
) -> None:
    """Show how SPEC splits: a table of units, stages, reasons and cache entries, or a diagram.

    Without --format the format follows the suffix of -o; with neither, the text table is printed. svg, png and pdf need the Graphviz dot program (dot, mermaid and text do not); without -o they go to stdout, which must not be a terminal for png and pdf.

    With --with (or --with-metadata), units whose `requires` the run does not provide are shown greyed out as inactive.
    """
    fmt = resolve_format(fmt, output)
    mode = check_cache_mode(cache_mode)
    if output is None and fmt in BINARY_FORMATS and sys.stdout.isatty():
        raise typer.BadParameter(f"will not write {fmt} bytes to a terminal; pass -o FILE or redirect stdout",
                                 param_hint="--output")
    provided = provided_params(with_params, with_metadata)
    pipeline = load_spec(spec, provided, source, trust_remote_code)
    plan = split(pipeline, model_list(trainable_models), lora_base_model, mode, provided)

    if fmt == "text" and output is None:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else TEXT_WIDTH, highlight=False, emoji=False)
        for item in text_renderables(pipeline, plan):
            console.print(item)
        return

    content = render(pipeline, plan, fmt)  # GraphvizNotFound (exit 2) before anything is written
    if output is not None:
        if isinstance(content, bytes):
            write_bytes_atomic(output, content)
        else:
            write_text_atomic(output, content)
        typer.echo(f"wrote {output} ({fmt}): {len(plan.train_units)} train, {len(plan.data_process_units)} "
                   f"data_process units, {len(plan.cache_entries)} cache entries", err=True)
    elif isinstance(content, bytes):
        stream = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else sys.stdout
        stream.write(content)
        stream.flush()
    else:
        typer.echo(content, nl=False)
    if fmt != "text":  # the text view has the note in it already
        note = versioned_savings_line(pipeline, plan)
        if note:
            typer.echo(note, err=True)


def explain_command(
    spec: Spec,
    unit: UnitName,
    trainable_models: TrainableModels = "",
    lora_base_model: LoraBaseModel = None,
    cache_mode: CacheMode = "latest",
    with_params: Provided = None,
    with_metadata: WithMetadata = None,
    source: Source = None,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Say why UNIT is in its stage.

    For a train unit: the chain of rules (F, W, U) back to a seed of X0. For a data_process unit: why no rule pulls it into train. For a unit the run leaves inactive (--with): which required params it lacks.
    """
    mode = check_cache_mode(cache_mode)
    provided = provided_params(with_params, with_metadata)
    pipeline = load_spec(spec, provided, source, trust_remote_code)
    typer.echo(explain(pipeline, unit, model_list(trainable_models), lora_base_model, mode, provided).text)


def register(app: typer.Typer) -> None:
    """Add `inspect` and `explain` to the unitgraph app."""
    app.command("inspect")(inspect_command)
    app.command("explain")(explain_command)


__all__ = ["explain_command", "inspect_command", "register", "resolve_format"]

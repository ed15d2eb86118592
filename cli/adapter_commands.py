"""`unitgraph audit`: the hazards the update-chain rule misses, per trainable model.

The command docstring keeps each paragraph on one line (docs/cli.md is generated from it).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from unitgraph.atomic import write_text_atomic
from unitgraph.audit import audit, render_text, text_renderables

from .options import (
    LoraBaseModel,
    Output,
    Provided,
    Source,
    Spec,
    TrustRemoteCode,
    WithMetadata,
    load_spec,
    provided_params,
)

AUDIT_FORMATS = ("text", "json")

AuditFormat = Annotated[
    Optional[str],
    typer.Option("--format", "-f", help="text (a report) or json. Default: json when -o ends in .json, else text.",
                 show_default=False),
]
Models = Annotated[
    Optional[str],
    typer.Option("--models", help="Comma-separated models to audit (default: every model a unit or the sink calls).",
                 show_default=False),
]


def audit_command(
    spec: Spec,
    lora_base_model: LoraBaseModel = None,
    models: Models = None,
    with_params: Provided = None,
    with_metadata: WithMetadata = None,
    source: Source = None,
    trust_remote_code: TrustRemoteCode = False,
    fmt: AuditFormat = None,
    output: Output = None,
) -> None:
    """List, for every model that could be trained, the hazards the update-chain rule misses.

    SPEC `diffsynth:*` audits every pipeline of DiffSynth-Studio in turn (the installed package's, or those of --source, read without importing them), each after its declaration warnings, then one line counting them; a pipeline that cannot be read is a note and the audit goes on.

    Each model is audited alone, with the denoiser (the sink's dit, transformer or unet; or --lora-base-model) as LoRA base. For each: the write-after-read and write-after-write hazards that DiffSynth-Studio's update-chain rule misses (the unit the write-hazard rule moves to train, the param and the unit it conflicts with), the versions the update-chain split would read wrongly (the verifier's simulation), and the models stage 2 loads and the cache entries needed in cache modes latest and versioned.
    """
    if fmt is None:
        fmt = "json" if output is not None and output.lower().endswith(".json") else "text"
    fmt = fmt.strip().lower()
    if fmt not in AUDIT_FORMATS:
        raise typer.BadParameter(f"must be one of {', '.join(AUDIT_FORMATS)}, got {fmt!r}", param_hint="--format")
    provided = provided_params(with_params, with_metadata)
    chosen = None if models is None else [m.strip() for m in models.split(",") if m.strip()]
    if spec.strip() == "diffsynth:*":
        _audit_every_pipeline(source, trust_remote_code, provided, lora_base_model, chosen, fmt, output)
        return
    pipeline = load_spec(spec, provided, source, trust_remote_code)
    result = audit(pipeline, lora_base_model=lora_base_model, provided=provided, models=chosen)
    if fmt == "json":
        content = json.dumps(result.to_dict(), indent=2) + "\n"
    elif output is not None:
        content = render_text(result)
    else:
        from rich.console import Console

        from unitgraph.render import TEXT_WIDTH

        console = Console(width=None if sys.stdout.isatty() else TEXT_WIDTH, highlight=False, emoji=False)
        for item in text_renderables(result):
            console.print(item)
        return
    if output is not None:
        write_text_atomic(output, content)
        typer.echo(f"wrote {output}: {len(result.cases)} configurations, {len(result.cases_with_hazards)} with "
                   f"hazards the update-chain rule misses", err=True)
    else:
        typer.echo(content, nl=False)


def _wheel_modules(source: Optional[str]) -> list[str]:
    """The pipeline modules of DiffSynth-Studio: of `source` (a checkout, its package or its pipelines folder), else of
    the installed package (found without importing it)."""
    import importlib.util
    from pathlib import Path

    from unitgraph.errors import SpecError

    if source is not None:
        root = Path(source)
        folder = next((f for f in (root / "diffsynth" / "pipelines", root / "pipelines", root) if f.is_dir()
                       and any(f.glob("*.py"))), None)
    else:
        found = importlib.util.find_spec("diffsynth")
        places = list(found.submodule_search_locations or []) if found is not None else []
        folder = Path(places[0]) / "pipelines" if places else None
    if folder is None or not folder.is_dir():
        raise SpecError("no DiffSynth-Studio pipelines found; install diffsynth or pass --source PATH",
                        source=source or "diffsynth:*")
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def _audit_every_pipeline(source: Optional[str], trust_remote_code: bool, provided: Optional[list[str]],
                          lora_base_model: Optional[str], chosen: Optional[list[str]], fmt: str,
                          output: Optional[str]) -> None:
    """`unitgraph audit diffsynth:*`: each pipeline of the wheel in turn (its declaration warnings first, on stderr),
    then one line counting them; a pipeline that cannot be read is one line and the audit goes on."""
    from unitgraph.errors import UnitgraphError

    reports: dict[str, object] = {}
    unreadable: dict[str, str] = {}
    for module in _wheel_modules(source):
        reference = f"diffsynth:{module}"
        typer.echo(f"== {reference}", err=True)
        try:
            pipeline = load_spec(reference, provided, source, trust_remote_code)
            reports[module] = audit(pipeline, lora_base_model=lora_base_model, provided=provided, models=chosen)
        except UnitgraphError as exc:
            unreadable[module] = str(exc)
            typer.echo(f"note: {exc}", err=True)
    if fmt == "json":
        data = {"pipelines": {m: r.to_dict() for m, r in reports.items()}, "unreadable": unreadable}  # type: ignore[attr-defined]
        content = json.dumps(data, indent=2) + "\n"
    else:
        content = "".join(f"== diffsynth:{m}\n{render_text(r)}\n" for m, r in reports.items())
    if output is not None:
        write_text_atomic(output, content)
    else:
        typer.echo(content, nl=False)
    hazards = sum(1 for r in reports.values() if r.cases_with_hazards)  # type: ignore[attr-defined]
    typer.echo(f"{len(reports)} pipelines audited, {hazards} with hazards the update-chain rule misses"
               + (f"; {len(unreadable)} not read ({', '.join(unreadable)})" if unreadable else ""), err=True)


def register(app: typer.Typer) -> None:
    """Add `audit` to the unitgraph app."""
    app.command("audit")(audit_command)


__all__ = ["audit_command", "register"]

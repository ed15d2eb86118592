"""Options shared by the planning commands (plan, verify, inspect, explain, audit), declared once."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

from unitgraph.errors import SpecError
from unitgraph.references import load_pipeline
from unitgraph.spec import Pipeline
from unitgraph.closure import CACHE_MODES

Spec = Annotated[str, typer.Argument(help="A spec file (JSON or YAML) or a pipeline reference: diffusion:qwen_image, diffusers:QwenImageAutoBlocks, diffsynth:qwen_image.QwenImagePipeline.", show_default=False)]
TrainableModels = Annotated[
    str,
    typer.Option("--trainable-models", "--trainable_models", help="Comma-separated models trained in full (they need backward)."),
]
LoraBaseModel = Annotated[
    Optional[str],
    typer.Option("--lora-base-model", "--lora_base_model", help="The model LoRA adapters are attached to (it needs backward)."),
]
CacheMode = Annotated[
    str,
    typer.Option("--cache-mode", "--cache_mode", help="latest: cache each param's last stage-1 value; versioned: cache exact versions (smallest train set)."),
]
Provided = Annotated[
    Optional[str],
    typer.Option("--with", help="Comma-separated dataset params this run provides; units whose `requires` are missing are dropped. Default: every unit runs."),
]
WithMetadata = Annotated[
    Optional[str],
    typer.Option("--with-metadata", "--with_metadata", help="A dataset metadata file (.csv, .json or .jsonl): its columns are provided params, added to --with.", show_default=False),
]
Source = Annotated[
    Optional[str],
    typer.Option("--source", help="For diffsynth: references, a DiffSynth-Studio source folder to read statically; for diffusers: module:Class references, the folder to import the module from (its code runs only with --trust-remote-code).", show_default=False),
]
TrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        "--trust_remote_code",
        help=("Allow running code that is not an installed package: a saved diffusers: folder's custom blocks, "
              "a module:Class found outside installed packages (e.g. with --source), an uninstalled diffsynth. "
              "Off by default."),
    ),
]
Output = Annotated[Optional[str], typer.Option("-o", "--output", help="Write to this file (atomically) instead of stdout.")]


def model_list(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def check_cache_mode(mode: str) -> str:
    if mode not in CACHE_MODES:
        raise typer.BadParameter(f"must be one of {', '.join(CACHE_MODES)}, got {mode!r}", param_hint="--cache-mode")
    return mode


def provided_params(text: str | None, metadata: str | None = None) -> list[str] | None:
    """--with and the columns of --with-metadata together; None when neither is given."""
    if text is None and metadata is None:
        return None
    names = model_list(text or "")
    if metadata is not None:
        names += [c for c in metadata_columns(metadata) if c not in names]
    return names


def metadata_columns(path: str | Path) -> list[str]:
    """Columns of a dataset metadata file that hold a value in at least one row (all columns of an empty file).

    .csv: the header row; .json: a list of objects (or one object); .jsonl: one object a line.
    """
    from unitgraph.userfiles import parse_user_csv, parse_user_json, parse_user_jsonl, read_user_text

    path = Path(path)
    where = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json", ".jsonl"):
        raise SpecError(f"cannot tell the format of {path.name!r}: use .csv, .json or .jsonl", source=where)
    text = read_user_text(path, SpecError, "a metadata file")
    if suffix == ".csv":
        fields, rows = parse_user_csv(text, where, SpecError)
        header = [c.strip() for c in fields if c and c.strip()]
    else:
        if suffix == ".json":
            data = parse_user_json(text, where, SpecError)
            rows = data if isinstance(data, list) else [data]
        else:
            rows = parse_user_jsonl(text, where, SpecError)
        if not all(isinstance(r, dict) for r in rows):
            raise SpecError("expected objects (one per sample) whose keys are the columns", source=where)
        header = list(dict.fromkeys(str(k) for r in rows for k in r))
    if not header:
        raise SpecError("no columns found", source=where)
    if not rows:
        return header
    return [c for c in header if any(r.get(c) not in (None, "") for r in rows)]


def load_spec(spec: str, provided: list[str] | None = None, source: str | None = None,
              trust_remote_code: bool = False) -> Pipeline:
    """load_pipeline, printing what adapters note (one line each on stderr) instead of Python warnings."""
    from unitgraph.adapters import AdapterNote, DeclarationWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AdapterNote)
        pipeline = load_pipeline(spec, provided=provided, source=source, trust_remote_code=trust_remote_code)
    for item in caught:
        if issubclass(item.category, AdapterNote):
            prefix = "warning" if issubclass(item.category, DeclarationWarning) else "note"
            typer.echo(f"{prefix}: {' '.join(str(item.message).split())}", err=True)
        else:  # not ours: hand it back to the warnings machinery unchanged
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    return pipeline

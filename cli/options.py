"""Options shared by the planning commands (plan, inspect, explain), declared once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from unitgraph.split import CACHE_MODES

Spec = Annotated[str, typer.Argument(help="A spec file (JSON or YAML) or a backend reference such as diffusion:qwen_image.", show_default=False)]
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
Output = Annotated[Optional[str], typer.Option("-o", "--output", help="Write to this file (atomically) instead of stdout.")]


def model_list(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def check_cache_mode(mode: str) -> str:
    if mode not in CACHE_MODES:
        raise typer.BadParameter(f"must be one of {', '.join(CACHE_MODES)}, got {mode!r}", param_hint="--cache-mode")
    return mode


def provided_params(text: str | None) -> list[str] | None:
    return None if text is None else model_list(text)

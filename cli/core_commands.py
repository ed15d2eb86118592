"""`unitgraph plan` and `unitgraph verify`."""

from __future__ import annotations

from typing import Annotated

import typer

from unitgraph.atomic import write_text_atomic
from unitgraph.plan import read_plan_file, split, versioned_savings_line
from unitgraph.soundness import minimality_note, verify

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


def plan_command(
    spec: Spec,
    trainable_models: TrainableModels = "",
    lora_base_model: LoraBaseModel = None,
    cache_mode: CacheMode = "latest",
    with_params: Provided = None,
    with_metadata: WithMetadata = None,
    source: Source = None,
    trust_remote_code: TrustRemoteCode = False,
    output: Output = None,
) -> None:
    """Split SPEC into data_process and train stages and write the plan as JSON."""
    mode = check_cache_mode(cache_mode)
    provided = provided_params(with_params, with_metadata)
    pipeline = load_spec(spec, provided, source, trust_remote_code)
    plan = split(pipeline, model_list(trainable_models), lora_base_model, mode, provided)
    if plan.violations:  # split() verified it; never write a plan that does not hold (a planner bug)
        for line in plan.violations:
            typer.echo(line, err=True)
        raise typer.Exit(1)
    if output:
        write_text_atomic(output, plan.to_json())
        typer.echo(f"wrote {output}: {len(plan.train_units)} train, {len(plan.data_process_units)} data_process units, "
                   f"{len(plan.cache_entries)} cache entries", err=True)
    else:
        typer.echo(plan.to_json(), nl=False)
    note = versioned_savings_line(pipeline, plan)
    if note:
        typer.echo(note, err=True)


def verify_command(
    spec: Spec,
    plan_file: Annotated[str, typer.Argument(metavar="PLAN", help="A plan file written by `unitgraph plan`.", show_default=False)],
    source: Source = None,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """Check PLAN against SPEC: exit 0 when every check holds, 1 with one line per violation."""
    plan = read_plan_file(plan_file)
    provided = plan.extra.get("provided")  # an adapter may resolve the spec by them, as `plan` did
    pipeline = load_spec(spec, provided, source, trust_remote_code)
    violations = verify(pipeline, plan)
    for line in violations:
        typer.echo(line)
    if violations:
        raise typer.Exit(1)
    typer.echo(f"ok: {plan_file} holds every check for {pipeline.name} ({plan.cache_mode} cache)")
    note = minimality_note(pipeline, plan)
    if note:
        typer.echo(note)

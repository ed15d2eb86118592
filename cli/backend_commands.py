"""`unitgraph train`, `tiny-models`, `demo` and `pipelines`: the diffusion backend's commands.

torch, diffusers and the backend's training code are imported inside the command functions, so
`unitgraph plan` and `unitgraph inspect` start without them.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from unitgraph.backends.diffusion.args import arg_fields


def _option_names(name: str, annotation: Any, default: Any) -> list[str]:
    dashed = name.replace("_", "-")
    if annotation is bool and default is True:
        return [f"--{name}/--no_{name}", f"--{dashed}/--no-{dashed}"] if dashed != name else [f"--{name}/--no-{name}"]
    return [f"--{name}", f"--{dashed}"] if dashed != name else [f"--{name}"]


def _train_signature() -> inspect.Signature:
    params = []
    for name, annotation, default, help_text in arg_fields():
        option = typer.Option(*_option_names(name, annotation, default), help=help_text, show_default=default is not None)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=Annotated[annotation, option]))
    return inspect.Signature(params)


def train_command(**kwargs: Any) -> None:
    """Train with DiffSynth-Studio's flags (both spellings): --task sft, sft:data_process, sft:train, sft:split, direct_distill[...]."""
    from unitgraph.backends.diffusion.args import unchecked_args
    from unitgraph.backends.diffusion.stages import run

    from unitgraph.backends.diffusion.diffsynth_source import run as diffsynth_source

    args, why = diffsynth_source.route(unchecked_args(**kwargs))  # a family not trained is named first
    args = args.validate()
    if diffsynth_source.wanted(args):  # DiffSynth's own pipeline (backends/diffusion/diffsynth_source/)
        result = diffsynth_source.run(args, typer.echo if _is_main() else None, why)
        if result.memory_plan is not None and _is_main():
            from unitgraph.backends.diffusion.diffsynth_source.memory import format_plan

            typer.echo(json.dumps(result.memory_plan, indent=1) if args.json else "\n".join(format_plan(result.memory_plan)))
            return
    else:
        result = run(args)
    if not _is_main():
        return
    if result.memory_plan is not None:  # --dry_run
        from unitgraph.backends.diffusion.memory_plan import format_memory_plan

        typer.echo(json.dumps(result.memory_plan, indent=1) if args.json else "\n".join(format_memory_plan(result.memory_plan)))
        return
    for line in result_lines(result):
        typer.echo(line)


train_command.__signature__ = _train_signature()  # type: ignore[attr-defined]


def _is_main() -> bool:
    return os.environ.get("RANK", "0") in ("", "0")


def result_lines(result: Any) -> list[str]:
    lines = []
    if "data_process" in result.stage_times:
        seconds = result.stage_times["data_process"]
        if result.cache_reused:
            how = f"all {result.entries_reused} {'entry' if result.entries_reused == 1 else 'entries'} reused"
        else:
            how = (f"{result.entries_computed} {'entry' if result.entries_computed == 1 else 'entries'} computed, "
                   f"{result.entries_reused} reused, {seconds:.1f} s")
        lines.append(f"stage 1 (data_process): {result.samples} samples, {how} -> {result.cache_path}")
    skipped = getattr(result, "skipped", None) or []
    if skipped:
        lines.append(f"skipped:    {len(skipped)} samples (warnings above; first: {skipped[0]['reason']})")
    if "train" in result.stage_times:
        step = result.median_step_s
        lines.append(f"{'stage 2 (train)' if result.task.endswith((':train', ':split')) else 'training'}: "
                     f"{result.steps} step{'' if result.steps == 1 else 's'} in {result.stage_times['train']:.1f} s"
                     + (f" ({step * 1000:.0f} ms/step median)" if step else ""))
    held = getattr(result, "held_bytes", None)
    if held:
        from unitgraph.backends.diffusion.cache.verify import human_bytes

        lines.append(f"memory:     the main process holds {human_bytes(held[0])} of weights and {human_bytes(held[1])} "
                     "of optimizer state (its shards under ZeRO / FSDP2; in CPU memory when offloaded)")
    if getattr(result, "replaced", None):
        lines.append(f"replaced:   the earlier run's files were moved to {result.replaced}")
    if result.last_checkpoint:
        lines.append(f"checkpoint: {result.last_checkpoint}")
    if result.loss_csv:
        lines.append(f"loss log:   {result.loss_csv}")
    if result.loss_plot:
        lines.append(f"loss plot:  {result.loss_plot}")
    if result.plan_path:
        lines.append(f"plan:       {result.plan_path}")
    return lines


def _family(pipeline: Optional[str]) -> Any:
    """The family of `--pipeline NAME` (a family or pipeline name), else the first registered one."""
    return _choice(pipeline)[0]


def _choice(pipeline: Optional[str]) -> tuple[Any, Any]:
    """(family, the named pipeline or None when NAME is a family or not given)."""
    from unitgraph.backends.diffusion import registry

    if not pipeline:
        return registry.default_family(), None
    family, chosen = registry.find_pipeline(pipeline)
    return family, chosen if chosen.name == pipeline else None


PipelineOption = Annotated[Optional[str], typer.Option("--pipeline", help="A pipeline or family (see 'unitgraph pipelines'; default: the first registered family).")]
TinyPipelineOption = Annotated[Optional[str], typer.Option("--pipeline", help="A pipeline or family (see 'unitgraph pipelines'; default: the first registered family); diffsynth:MODULE writes the test-size models of DiffSynth's own pipeline in its ./models layout (docs/diffsynth.md).")]


def tiny_models_command(
    outdir: Annotated[str, typer.Argument(metavar="OUTDIR", help="Folder to write the pipeline into.", show_default=False)],
    pipeline: TinyPipelineOption = None,
    size: Annotated[str, typer.Option("--size", help="test (a train step ~10 ms) or demo (~0.15 s at 256 px); real: the released model's config.json files only, no weights (for train --dry_run; Wan also real-1.3b and real-a14b, Wan 2.2 A14B's two experts).")] = "test",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
    experts: Annotated[bool, typer.Option("--experts", help="A denoiser of two experts (Wan 2.2 A14B's layout: transformer/ for high noise, transformer_2/ for low, boundary_ratio; T2V A14B's for wan, I2V A14B's for wan_i2v); train one with --expert.")] = False,
) -> None:
    """Write a random-weight diffusers pipeline folder of a family (it loads with the family's diffusers pipeline class),
    or with --size real the released model's configuration files alone."""
    import importlib

    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.args import check_seed
    from unitgraph.backends.diffusion.models.own_folder import write_own_folder

    if pipeline and pipeline.startswith("diffsynth:"):
        _tiny_diffsynth_models(Path(outdir), pipeline, size, seed)
        return
    family, chosen = _choice(pipeline)
    check_seed(seed)
    if experts and family.experts is None:
        raise BackendError(f"--experts: the {family.title} family's denoiser is a single model")
    if experts and (size.startswith("real") or not family.experts.covers((chosen or family.pipelines[0]).name)):
        names = [p.name for p in family.pipelines if family.experts.covers(p.name)]
        raise BackendError(f"--experts: tiny two-expert folders are written for {' and '.join(names)} at the test "
                           "and demo sizes")
    claim_model_folder(Path(outdir))
    start = time.perf_counter()
    if size.startswith("real"):
        real = importlib.import_module(".real", family.package)  # families/<name>/real.py: the published configs
        if size not in real.RELEASES:
            raise BackendError(f"--size must be one of {', '.join(real.RELEASES)} for {family.title}'s released configs, "
                               f"got {size!r}")
        path = write_own_folder(outdir, MODEL_MARKERS[1], lambda staging: real.write_real_configs(
            staging, size=size, pipeline=chosen.name if chosen else None))
        cls = (chosen.diffusers_pipeline if chosen else None) or family.diffusers_pipelines[0]
        typer.echo(f"wrote the released {family.title} configs ({cls}; config.json files only, no weights) to {path} "
                   f"in {time.perf_counter() - start:.1f} s")
        return
    tiny = family.tiny_module()
    if size not in tiny.SIZES:
        raise BackendError(f"--size must be one of {', '.join([*tiny.SIZES, 'real'])}, got {size!r}")
    path = write_own_folder(outdir, MODEL_MARKERS[0], lambda staging: tiny.write_tiny_models(
        staging, size=size, seed=seed, pipeline=chosen.name if chosen else None, **({"experts": True} if experts else {})))
    cls = (chosen.diffusers_pipeline if chosen else None) or family.diffusers_pipelines[0]
    typer.echo(f"wrote {size}-size {family.title} pipeline ({cls}) to {path} in {time.perf_counter() - start:.1f} s")


def _tiny_diffsynth_models(outdir: Path, pipeline: str, size: str, seed: int) -> None:
    """`tiny-models DIR --pipeline diffsynth:MODULE`: the test-size models of DiffSynth's pipeline in its ./models
    layout (DIR is the base folder DiffSynth looks in), and the command line that trains on them."""
    from unitgraph.backends.diffusion.args import check_seed
    from unitgraph.backends.diffusion.diffsynth_source import EXTRA_HINT, available
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for
    from unitgraph.backends.diffusion.diffsynth_source.tiny import write_tiny_models
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.models.own_folder import write_own_folder

    glue = glue_for(pipeline)
    check_seed(seed)
    if size != "test":
        raise BackendError(f"--size {size}: DiffSynth's pipelines are written at the test size only")
    if not available():
        raise BackendError(f"--pipeline {pipeline} writes models of DiffSynth-Studio's own classes; {EXTRA_HINT}")
    claim_model_folder(outdir)
    start = time.perf_counter()
    flags: dict[str, Any] = {}
    path = write_own_folder(outdir, MODEL_MARKERS[0], lambda staging: flags.update(write_tiny_models(staging, glue.module, seed)))
    typer.echo(f"wrote test-size models of {glue.name} ({glue.class_name}) in DiffSynth's ./models layout to {path} in "
               f"{time.perf_counter() - start:.1f} s; train on them with:")
    typer.echo(f"  DIFFSYNTH_MODEL_BASE_PATH={path} unitgraph train --pipeline {glue.name} --model_id_with_origin_paths "
               f"'{flags['model_id_with_origin_paths']}' --lora_base_model ... --dataset_base_path ...")


MODEL_MARKERS = ("unitgraph_tiny.json", "unitgraph_config_only.json")  # written by write_tiny_models / --size real
DEMO_MARKER = "unitgraph-demo.json"


def claim_model_folder(folder: Path) -> None:
    """tiny-models writes only into a new or empty folder, or one it wrote before (its marker): never over a
    user's model folder (its weights would be replaced by random ones)."""
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.errors import path_missing

    if folder.is_symlink() and not folder.exists():
        raise BackendError(path_missing(folder), source=str(folder))  # a dangling link or a symlink loop
    if folder.exists() and not folder.is_dir():
        raise BackendError("is a file, not a folder; choose another OUTDIR", source=str(folder))
    if folder.is_dir() and any(folder.iterdir()) and not any((folder / m).is_file() for m in MODEL_MARKERS):
        raise BackendError("is not empty and holds no models unitgraph wrote (no unitgraph_tiny.json); it writes "
                           "only into a new, empty or own folder: choose another OUTDIR", source=str(folder))


DEMO_ROOT = Path("output")
DEMO_FOLDER = "demo"


def default_demo_path(pipeline: Any) -> Path:
    """Where `unitgraph demo` goes without --output_path: ./output/demo for the first family's first pipeline (the
    README's demo), ./output/demo-<pipeline> for every other, so each pipeline's demo has a folder of its own."""
    from unitgraph.backends.diffusion import registry

    first = registry.default_family().pipelines[0]
    return DEMO_ROOT / (DEMO_FOLDER if pipeline.name == first.name else f"{DEMO_FOLDER}-{pipeline.name}")


def _json_field(path: Path, key: str) -> Optional[str]:
    """A string field of a small JSON file unitgraph wrote (None when absent or unreadable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def demo_pipeline_of(folder: Path) -> Optional[str]:
    """The pipeline whose demo `folder` holds: its marker says (older demos' markers do not: then their run marker
    or their cache's manifest does), else None."""
    for path in (folder / DEMO_MARKER, folder / "train" / "unitgraph-run.json",
                 folder / "train" / "cache" / "manifest.json", folder / "unsplit" / "unitgraph-run.json"):
        name = _json_field(path, "pipeline")
        if name:
            return name
    return None


def claim_demo_folder(folder: Path, pipeline: Any = None, models_class: Optional[str] = None,
                      explicit: bool = True) -> None:
    """The demo writes only into a new or empty folder, or a demo folder of its own (its marker, or the tiny models
    an earlier demo wrote into it) of the same pipeline, and marks it as its own, naming the pipeline. A demo folder
    of another pipeline is refused: its models, cache and run would not fit (each pipeline's demo has its own folder).
    `models_class`: the diffusers pipeline class the demo's tiny models load with; `explicit`: the folder is the
    --output_path given (else the pipeline's default), which the advice of a refusal takes into account."""
    from unitgraph.atomic import write_text_atomic
    from unitgraph.backends.diffusion.errors import BackendError

    if folder.exists() and not folder.is_dir():
        raise BackendError("is a file, not a folder; choose another --output_path", source=str(folder))
    ours = (folder / DEMO_MARKER).is_file() or any((folder / "models" / m).is_file() for m in MODEL_MARKERS)
    if folder.is_dir() and any(folder.iterdir()) and not ours:
        shown = ", ".join(sorted(p.name for p in folder.iterdir())[:3])
        raise BackendError(f"is not empty and not a unitgraph demo folder (it holds {shown}); the demo writes only "
                           "into a new, empty or own folder: choose another --output_path", source=str(folder))
    name = getattr(pipeline, "name", None)
    if name is not None and folder.is_dir():
        other = demo_pipeline_of(folder)
        found = _json_field(folder / "models" / "model_index.json", "_class_name")
        shown = f"pipeline {other}" if other is not None else None
        if other is None and models_class is not None and found is not None and found != models_class:
            other, shown = found, f"another pipeline (tiny {found} models)"
        if other is not None and other != name:
            default = default_demo_path(pipeline)
            advice = (f"leave out --output_path (the demo of {name} goes to {default}) or choose another one"
                      if explicit and Path(folder) != default else
                      "choose another --output_path, or move this folder aside (an earlier unitgraph put the demos of "
                      "every pipeline into one folder)")
            raise BackendError(f"holds the demo of {shown}, not of {name}; each pipeline's demo has its own folder: "
                               f"{advice}", source=str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    record = {"format": "unitgraph.demo/v1", **({"pipeline": name} if name is not None else {})}
    write_text_atomic(folder / DEMO_MARKER, json.dumps(record) + "\n")


def pipelines_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the registered families: their pipelines and tasks, model slots and default LoRA targets."""
    import json

    from unitgraph.backends.diffusion.registry import families

    rows = [{"family": f.name, "title": f.title, "diffusers_pipeline": f.diffusers_pipelines[0],
             "pipelines": [{"name": p.name, "task": p.task, "description": p.description} for p in f.pipelines],
             "slots": [{"name": s.name, "kind": s.kind, "class": f"{s.library}.{s.class_name}", "subfolder": s.subfolder,
                        "lora_targets": list(s.lora_targets)} for s in f.slots]} for f in families()]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console = Console(width=max(console.width, 150))  # class names are long; a log file should not truncate them
    for row in rows:
        console.rule(f"[bold]{row['title']}[/bold]  family {row['family']}, folders load with {row['diffusers_pipeline']}")
        pipelines = Table(show_header=True, header_style="bold", box=None)
        for column in ("pipeline", "task", "what it trains"):
            pipelines.add_column(column)
        for p in row["pipelines"]:
            pipelines.add_row(p["name"], p["task"], p["description"])
        console.print(pipelines)
        slots = Table(show_header=True, header_style="bold", box=None)
        for column in ("model slot", "kind", "class", "subfolder"):
            slots.add_column(column, no_wrap=True)
        slots.add_column("default LoRA targets", overflow="fold")
        for slot in row["slots"]:
            slots.add_row(slot["name"], slot["kind"], slot["class"], slot["subfolder"] + "/", ", ".join(slot["lora_targets"]))
        console.print(slots)
    from unitgraph.backends.diffusion.diffsynth_source import available
    from unitgraph.backends.diffusion.diffsynth_source.glue import glues

    where = "installed here" if available() else "not installed here: bash scripts/setup_diffsynth.sh"
    console.rule(f"[bold]DiffSynth-Studio's own pipelines[/bold]  (the diffsynth package, {where}; docs/diffsynth.md)")
    own = Table(show_header=True, header_style="bold", box=None)
    for column in ("pipeline", "task", "what it trains"):
        own.add_column(column)
    for glue in glues():
        own.add_row(glue.name, "sft", f"{glue.title}: DiffSynth's {glue.class_name}")
    console.print(own)


# the demo's bounds, checked before anything is written: its data is synthetic and its models tiny, so these cover any
# demo (a 2048 px image is 12 MB decoded; 10^9 images filled the disk, 2^20 px was killed for memory)
DEMO_MAX_IMAGES = 10_000
DEMO_MAX_RESOLUTION = 2048
DEMO_MAX_EPOCHS = 10_000
DEMO_SIZES = ("images", "resolution")  # Family.demo keys that size the demo's data rather than set a run flag


def demo_command(
    output_path: Annotated[Optional[str], typer.Option("--output_path", "--output-path", help="Where everything goes (a folder per pipeline; default: ./output/demo for the first family's first pipeline, ./output/demo-<pipeline> for any other).", show_default=False)] = None,
    images: Annotated[Optional[int], typer.Option("--images", help="Synthetic captioned images (default 32, or the family's demo default).", show_default=False)] = None,
    resolution: Annotated[Optional[int], typer.Option("--resolution", help="Image side in pixels, a multiple of 16 (default 256, or the family's demo default).", show_default=False)] = None,
    num_epochs: Annotated[int, typer.Option("--num_epochs", "--num-epochs", help="Epochs of stage 2.")] = 10,
    compare_steps: Annotated[int, typer.Option("--compare_steps", "--compare-steps", help="Unsplit steps timed for comparison (0: skip).")] = 8,
    size: Annotated[str, typer.Option("--size", help="Tiny model size: demo or test.")] = "demo",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    pipeline: PipelineOption = None,
) -> None:
    """Split training end to end on tiny random-weight models of a family: plan, stage 1, stage 2, results."""
    from rich.console import Console
    from rich.table import Table

    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.args import check_seed, make_args
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    family, chosen = _choice(pipeline)
    demo_flags = {k: v for k, v in dict(family.demo).items() if k not in DEMO_SIZES}  # the rest are run flags
    images = int(dict(family.demo).get("images", 32)) if images is None else images
    resolution = int(dict(family.demo).get("resolution", 256)) if resolution is None else resolution
    if resolution < 16 or resolution % 16 or resolution > DEMO_MAX_RESOLUTION:
        raise BackendError(f"--resolution must be a multiple of 16 between 16 and {DEMO_MAX_RESOLUTION}, got {resolution}")
    for name, value, most in (("--images", images, DEMO_MAX_IMAGES), ("--num_epochs", num_epochs, DEMO_MAX_EPOCHS)):
        if not 1 <= value <= most:
            raise BackendError(f"{name} must be between 1 and {most} (a demo of tiny models), got {value}")
    if not 0 <= compare_steps <= DEMO_MAX_IMAGES:
        raise BackendError(f"--compare_steps must be between 0 and {DEMO_MAX_IMAGES}, got {compare_steps}")
    check_seed(seed)
    console = Console()
    chosen = chosen or family.pipelines[0]
    # the required columns beyond image and prompt (an edit or reference image): mirrored copies of the image
    extras = [c for c in chosen.required if c not in ("image", "prompt", *chosen.video_params)]
    extra_images = [c for c in extras if c in chosen.image_params]
    videos = [c for c in chosen.required if c in chosen.video_params]  # clips of the demo's --num_frames
    frames = int(dict(family.demo).get("num_frames", 5))
    if size not in family.tiny_module().SIZES:
        raise BackendError(f"--size must be one of {', '.join(family.tiny_module().SIZES)}, got {size!r}")
    out = Path(output_path) if output_path else default_demo_path(chosen)
    models_class = chosen.diffusers_pipeline or family.diffusers_pipelines[0]
    claim_demo_folder(out, chosen, models_class, explicit=bool(output_path))
    wall = time.perf_counter()
    models_dir = out / "models"  # the folder is this pipeline's alone
    data_dir = out / "data"
    console.rule(f"[bold]unitgraph demo: split training of a tiny {family.title}")
    _tiny_models(console, family, chosen, models_dir, size, seed)
    metadata = write_synthetic_dataset(data_dir, count=images, size=resolution, seed=seed, images=extra_images, videos=videos, frames=frames,
                                       distill=bool({"seed", "num_inference_steps"} & set(extras)))
    what = f"{frames}-frame clips" if videos else "images"
    console.print(f"dataset: {images} captioned {resolution}x{resolution} {what} -> {metadata}")

    common = dict(dataset_base_path=str(data_dir), dataset_metadata_path=str(metadata), model_paths=str(models_dir),
                  pipeline=chosen.name, lora_base_model=family.model_slots[0], max_pixels=resolution * resolution,
                  seed=seed, **({"extra_inputs": ",".join(extras)} if extras else {}), **demo_flags)
    args = make_args(task="sft:split", output_path=str(out / "train"), num_epochs=num_epochs, overwrite=True, **common)

    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.session import plan_for
    from unitgraph.backends.diffusion.stages import run

    cfg = RunConfig.from_args(args)
    plan = plan_for(cfg)
    _show_plan(console, cfg.pipeline.spec_pipeline, plan, out)

    console.rule("sft:split  (stage 1 fills the cache, stage 2 trains from it)")
    result = run(args, echo=console.print)

    compare = None
    if compare_steps > 0:
        console.rule(f"unsplit sft for comparison ({compare_steps} steps, every unit live each step)")
        subset = _subset_metadata(metadata, compare_steps)
        base = make_args(task="sft", output_path=str(out / "unsplit"), num_epochs=1, overwrite=True,
                         **{**common, "dataset_metadata_path": str(subset)})
        compare = run(base, echo=console.print)

    console.rule("results")
    table = Table(show_header=True, header_style="bold")
    table.add_column("")
    table.add_column("time", justify="right")
    table.add_column("per item", justify="right")
    dp = result.stage_times.get("data_process", 0.0)
    table.add_row("stage 1: data_process" + (" (cache reused)" if result.cache_reused else ""),
                  f"{dp:.1f} s", "" if result.cache_reused else f"{dp / max(1, result.samples) * 1000:.0f} ms/sample")
    table.add_row(f"stage 2: train ({result.steps} steps)", f"{result.stage_times['train']:.1f} s",
                  f"{(result.median_step_s or 0) * 1000:.0f} ms/step")
    if compare is not None:
        table.add_row(f"unsplit sft ({compare.steps} steps)", f"{compare.stage_times['train']:.1f} s",
                      f"{(compare.median_step_s or 0) * 1000:.0f} ms/step")
    console.print(table)
    if compare is not None and result.median_step_s and compare.median_step_s:
        console.print(f"stage 2 steps are {compare.median_step_s / result.median_step_s:.1f}x faster than unsplit steps; "
                      f"stage 2 loaded only: {', '.join(plan.train_models)}")
    if result.losses:
        k = max(1, len(result.losses) // 10)
        first = sum(result.losses[:k]) / k
        last = sum(result.losses[-k:]) / k
        console.print(f"loss: {first:.4f} (first {k} steps) -> {last:.4f} (last {k} steps)")
    console.print(f"LoRA:      {result.last_checkpoint}")
    console.print(f"loss plot: {result.loss_plot}")
    console.print(f"loss log:  {result.loss_csv}")
    console.print(f"plan:      {result.plan_path}")
    console.print(f"cache:     {result.cache_path}")
    console.print(f"[bold]demo done in {time.perf_counter() - wall:.0f} s[/bold]")


def _tiny_models(console: Any, family: Any, pipeline: Any, models_dir: Path, size: str, seed: int) -> None:
    """The demo's tiny models: reused when an earlier demo wrote them (completely) at this size and seed, else written
    (into a fresh folder first, so a failure leaves the old ones; then only unitgraph's own files are replaced)."""
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.models.own_folder import write_own_folder

    info = models_dir / MODEL_MARKERS[0]
    try:
        made = json.loads(info.read_text(encoding="utf-8")) if info.is_file() else None
    except (OSError, ValueError):
        made = None
    if (models_dir / "model_index.json").is_file() and isinstance(made, dict) \
            and made.get("size") == size and made.get("seed") == seed and made.get("complete", True) is not False:
        console.print(f"tiny models: reusing {models_dir}")
        return
    if models_dir.exists() and (models_dir.is_symlink() or not models_dir.is_dir() or (
            any(models_dir.iterdir()) and not any((models_dir / m).is_file() for m in MODEL_MARKERS))):
        raise BackendError("holds models unitgraph did not write (no unitgraph_tiny.json); the demo never writes "
                           "over them: choose another --output_path", source=str(models_dir))
    t = time.perf_counter()
    # the earlier demo's tiny models (their marker says so) at another size or seed: only the files it wrote, unchanged,
    # are replaced (models/own_folder.py)
    write_own_folder(models_dir, MODEL_MARKERS[0], lambda staging: family.tiny_module().write_tiny_models(
        staging, size=size, seed=seed, pipeline=pipeline.name))
    console.print(f"tiny {size}-size models (random weights) -> {models_dir}  [dim]{time.perf_counter() - t:.1f} s[/dim]")


def _subset_metadata(metadata: Path, rows: int) -> Path:
    from unitgraph.atomic import write_text_atomic

    lines = metadata.read_text(encoding="utf-8").splitlines()
    subset = metadata.with_name("metadata_subset.csv")
    write_text_atomic(subset, "\n".join(lines[: rows + 1]) + "\n")
    return subset


def _show_plan(console: Any, pipeline: Any, plan: Any, out: Path) -> None:
    from unitgraph.atomic import write_bytes_atomic, write_text_atomic

    try:
        from unitgraph import render
    except ImportError:  # pragma: no cover - render is part of the core
        render = None
    if render is not None and hasattr(render, "text_renderables"):
        for item in render.text_renderables(pipeline, plan):
            console.print(item)
    else:
        console.print(f"data_process: {', '.join(plan.data_process_units)}  (models: {', '.join(plan.data_process_models)})")
        console.print(f"train:        {', '.join(plan.train_units)}  (models: {', '.join(plan.train_models)})")
        console.print(f"cache:        {', '.join(plan.cache_params)}")
    if render is None:
        return
    try:
        if render.dot_available():
            path = out / "plan.svg"
            write_bytes_atomic(path, render.render_image(pipeline, plan, "svg"))
        else:
            path = out / "plan.mmd"
            write_text_atomic(path, render.to_mermaid(pipeline, plan))
        console.print(f"split diagram: {path}")
    except Exception as exc:  # a drawing is a bonus; never fail the demo over it
        console.print(f"[dim](no diagram: {type(exc).__name__}: {exc})[/dim]")


def register(app: typer.Typer) -> None:
    app.command("train", context_settings={"help_option_names": ["-h", "--help"]})(train_command)
    app.command("tiny-models")(tiny_models_command)
    app.command("demo")(demo_command)
    app.command("pipelines")(pipelines_command)


__all__ = ["register", "result_lines"]

"""`unitgraph cache verify|repair|info DIR`: check, fix and describe a stage-1 cache folder.

`verify` and `info` read only the manifest, the entry files and their headers (no torch); `repair`
re-runs stage 1 with the arguments recorded in the cache, which recomputes exactly the entries that
are missing, damaged or out of date. docs/cache.md describes the cache.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

CacheDir = Annotated[str, typer.Argument(metavar="DIR", help="A cache folder (the one with manifest.json).", show_default=False)]


def _warn(text: str) -> None:
    typer.echo(text, err=True)


def verify_command(folder: CacheDir) -> None:
    """Check every entry of the cache in DIR against its recorded size and sha256: exit 0 when all hold, 1 with one line per problem."""
    from unitgraph.backends.diffusion.cache.cache import Cache
    from unitgraph.backends.diffusion.cache.verify import human_bytes, verify_cache

    problems, stats = verify_cache(folder)
    Cache(folder).warn_unsafe(_warn)
    if problems:
        for line in problems:
            typer.echo(line, err=True)
        typer.echo(f"{len(problems)} problem(s); 'unitgraph cache repair {folder}' recomputes the damaged entries", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {stats['samples']} samples, {stats['entries']} entries, {human_bytes(stats['bytes'])} verified "
               f"in {stats['seconds']:.2f} s" + (f" ({stats['skipped']} samples skipped by stage 1)" if stats["skipped"] else ""))


def repair_command(
    folder: CacheDir,
    dataset_base_path: Annotated[Optional[str], typer.Option("--dataset_base_path", "--dataset-base-path", help="The dataset folder, if it moved since the cache was made.")] = None,
    dataset_metadata_path: Annotated[Optional[str], typer.Option("--dataset_metadata_path", "--dataset-metadata-path", help="The metadata file, if it moved.")] = None,
    model_paths: Annotated[Optional[str], typer.Option("--model_paths", "--model-paths", help="The model folders, if they moved (as for train).")] = None,
    model_id_with_origin_paths: Annotated[Optional[str], typer.Option("--model_id_with_origin_paths", "--model-id-with-origin-paths", help="Model ids, as for train.")] = None,
    tokenizer_path: Annotated[Optional[str], typer.Option("--tokenizer_path", "--tokenizer-path", help="The tokenizer folder, if it moved.")] = None,
    tokenizer_2_path: Annotated[Optional[str], typer.Option("--tokenizer_2_path", "--tokenizer-2-path", help="The second text encoder's tokenizer folder (FLUX's T5), if it moved.")] = None,
    processor_path: Annotated[Optional[str], typer.Option("--processor_path", "--processor-path", help="The processor folder (edit pipelines), if it moved.")] = None,
    modelscope_cache_dir: Annotated[Optional[str], typer.Option("--modelscope_cache_dir", "--modelscope-cache-dir", help="modelscope cache folder.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = False,
) -> None:
    """Recompute the missing, damaged or out-of-date entries of the cache in DIR (stage 1 with the arguments recorded in it)."""
    from unitgraph.backends.diffusion.stage1 import repair_cache

    overrides = {"dataset_base_path": dataset_base_path, "dataset_metadata_path": dataset_metadata_path,
                 "model_paths": model_paths, "model_id_with_origin_paths": model_id_with_origin_paths,
                 "tokenizer_path": tokenizer_path, "tokenizer_2_path": tokenizer_2_path, "processor_path": processor_path,
                 "modelscope_cache_dir": modelscope_cache_dir}
    result = repair_cache(folder, overrides, echo=_warn, progress=progress)
    if result.computed:
        shown = ", ".join(str(i) for i in result.computed[:10]) + (", ..." if len(result.computed) > 10 else "")
        entries = "1 entry" if len(result.computed) == 1 else f"{len(result.computed)} entries"
        kept = "1 valid entry" if result.reused == 1 else f"{result.reused} valid entries"
        typer.echo(f"repaired {folder}: recomputed {entries} (sample{'s' if len(result.computed) > 1 else ''} {shown}); "
                   f"{kept} kept")
    else:
        typer.echo(f"nothing to repair in {folder}: all {result.reused} entries are valid")


def info_command(
    folder: CacheDir,
    as_json: Annotated[bool, typer.Option("--json", help="Print the information as JSON.")] = False,
) -> None:
    """Describe the cache in DIR: samples, bytes (per sample and per entry key), plan, models and settings."""
    from unitgraph.backends.diffusion.cache.verify import cache_info

    info = cache_info(folder)
    if as_json:
        typer.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    for line in info_lines(info):
        typer.echo(line)


def info_lines(info: dict[str, Any]) -> list[str]:
    from unitgraph.backends.diffusion.cache.verify import human_bytes

    dp = info.get("data_process") or {}
    tr = info.get("train") or {}
    lines = [
        f"cache:        {info['folder']}  ({info['status']}, {info['format']})",
        f"pipeline:     {info['pipeline']}  cache mode {info['cache_mode']}, backward {', '.join(info.get('models_require_backward') or [])}",
        f"plan:         {info['plan_fingerprint']}",
        f"data_process: {', '.join(dp.get('units') or [])}  (models: {', '.join(dp.get('models') or []) or 'none'})",
        f"train:        {', '.join(tr.get('units') or []) or '(sink only)'}  (models: {', '.join(tr.get('models') or [])})",
        f"samples:      {info['samples']}" + (f"  ({len(info['skipped'])} skipped by stage 1)" if info["skipped"] else ""),
        f"bytes:        {human_bytes(info['bytes'])} in {info['entries']} entries, "
        f"{human_bytes(info['bytes_per_sample'])} per sample",
        "per sample, by entry key (tensor bytes):",
    ]
    for key, size in info["bytes_per_sample_by_key"].items():
        lines.append(f"  {key:<28} {human_bytes(size)}")
    lines.append("models (sha256 of the files stage 1 read):")
    for slot, files in sorted(info["models"].items()):
        for name, digest in sorted(files.items()):
            lines.append(f"  {slot:<13} {name:<48} {digest[:16]}")
    lines.append("settings:")
    for name, value in sorted(info["settings"].items()):
        lines.append(f"  {name:<15} {json.dumps(value)}")
    made = {k: v for k, v in info["made_with"].items() if v not in (None, "")}
    if made:
        lines.append("made with:")
        for name, value in sorted(made.items()):
            lines.append(f"  --{name:<26} {value}")
    for s in info["skipped"]:
        lines.append(f"skipped sample {s['index']}: {s['reason']}")
    for path in info["unsafe_files"]:
        lines.append(f"warning: ignoring {path} (unitgraph never loads pickle-like files)")
    return lines


def register(app: typer.Typer) -> None:
    cache_app = typer.Typer(name="cache", help="Check, repair and describe stage-1 cache folders.", no_args_is_help=True,
                            add_completion=False, pretty_exceptions_enable=False)
    cache_app.command("verify")(verify_command)
    cache_app.command("repair")(repair_command)
    cache_app.command("info")(info_command)
    app.add_typer(cache_app, name="cache")


__all__ = ["register", "info_lines"]

"""Every benchmark, one after the other, each section of docs/benchmarks.md regenerated in one run.

Each benchmark runs as its own process (nothing else should run on the machine meanwhile: on 2 cores a
second heavy job makes every figure 2-4x slower). With --write, each benchmark replaces its own section
as it finishes, and the run's summary (start, end, machine, versions, the commands and their wall
times) replaces the `run` section at the top of the file; without it, nothing is written.

    python benchmarks/run_all.py [--write] [--only planner,stage1,qwen_image,flux,wan,sd15,sdxl,z_image,flux2_klein,wan_ti2v,ltx2,object_store,thread_overlap,memory_plan,real_size,engines,vae_latents,recipe,datasets,diffsynth_source]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import installed_versions, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- benchmark-run:begin -->", "<!-- benchmark-run:end -->"
VERSIONED = ("torch", "diffusers", "transformers", "peft", "accelerate", "safetensors", "networkx")

# name -> the benchmark's command line (each writes its own section with --write)
COMMANDS: dict[str, list[str]] = {
    "planner": ["benchmarks/planner_scaling.py"],
    "stage1": ["benchmarks/stage1_batching.py"],
    "qwen_image": ["benchmarks/split_vs_unsplit.py", "--pipeline", "qwen_image"],
    "flux": ["benchmarks/split_vs_unsplit.py", "--pipeline", "flux"],
    "wan": ["benchmarks/split_vs_unsplit.py", "--pipeline", "wan"],
    "sd15": ["benchmarks/split_vs_unsplit.py", "--pipeline", "sd15"],
    "sdxl": ["benchmarks/split_vs_unsplit.py", "--pipeline", "sdxl"],
    "z_image": ["benchmarks/split_vs_unsplit.py", "--pipeline", "z_image"],
    "flux2_klein": ["benchmarks/split_vs_unsplit.py", "--pipeline", "flux2_klein"],
    "wan_ti2v": ["benchmarks/split_vs_unsplit.py", "--pipeline", "wan_ti2v"],
    # LTX-2's test-size DiT (16 wide) is narrower than the benchmark's LoRA rank (32): the demo size alone
    "ltx2": ["benchmarks/split_vs_unsplit.py", "--pipeline", "ltx2", "--sizes", "demo"],
    "object_store": ["benchmarks/object_store.py"],
    "thread_overlap": ["benchmarks/thread_overlap.py"],
    "memory_plan": ["benchmarks/memory_plan_table.py"],
    "real_size": ["benchmarks/real_size.py"],
    "engines": ["benchmarks/engines.py"],
    "vae_latents": ["benchmarks/vae_latents.py"],
    "recipe": ["benchmarks/recipe.py"],
    "datasets": ["benchmarks/datasets.py"],
    "diffsynth_source": ["benchmarks/diffsynth_source.py"],
}
# benchmarks run by another environment's interpreter (DiffSynth-Studio's pipelines: scripts/setup_diffsynth.sh)
INTERPRETERS = {"diffsynth_source": ROOT / ".venv-diffsynth" / "bin" / "python"}


def summary(started: str, ended: str, walls: dict[str, float], failed: list[str]) -> str:
    rows = "\n".join(f"| `python {' '.join(COMMANDS[name])} --write` | {walls[name] / 60:.1f} |" for name in walls)
    lines = [
        f"Every table below comes from one run of `python benchmarks/run_all.py --write`, from {started} to {ended} "
        f"(UTC), the benchmarks one after the other with nothing else running, on {os.cpu_count()} CPU cores "
        f"({platform.machine()}), Python {platform.python_version()}, {installed_versions(VERSIONED)}.",
        "",
        "| benchmark | minutes |",
        "|---|---:|",
        rows,
    ]
    if failed:
        lines += ["", "Failed in this run (their sections are from an earlier run): " + ", ".join(failed) + "."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace every section of {DOC.relative_to(ROOT)}")
    parser.add_argument("--only", help="comma-separated subset of: " + ", ".join(COMMANDS))
    args = parser.parse_args(argv)
    names = list(COMMANDS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    walls: dict[str, float] = {}
    failed: list[str] = []
    for name in names:
        python = INTERPRETERS.get(name)
        command = [str(python) if python is not None and python.exists() else sys.executable, *COMMANDS[name]] + (
            ["--write"] if args.write else [])
        print(f"run_all: {name}: {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(command, cwd=ROOT)
        walls[name] = time.perf_counter() - start
        print(f"run_all: {name}: exit {code} after {walls[name] / 60:.1f} min", flush=True)
        if code != 0:
            failed.append(name)
    ended = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    text = summary(started, ended, walls, failed)
    print(text)
    if args.write and set(names) == set(COMMANDS):  # the run's summary only for a run of every benchmark
        write_section(DOC, BEGIN, END, "## This run", text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

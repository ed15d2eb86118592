"""What each recipe feature costs a stage-2 step (docs/objective.md): against the plain step, side by side in one run.

On Qwen-Image's tiny `demo` models (LoRA rank 32 on the DiT, 256 px, 8 samples), stage 2 (`sft:train`) from a
cache made for each configuration: plain; `--caption_dropout 0.5`; `--timestep_sampling logit_normal
--weighting_scheme cosmap`; `--masked_loss` (a mask per sample); `--lora_type dora --use_rslora`; `--lora_type
lokr` and `loha` (at the same rank and targets); `--ema_decay
0.999`; and each optimizer the machine has (`--optimizer adafactor|prodigy|came|schedulefree`). After one uncounted
run, `rounds` rounds run every configuration once, in an order rotated each round; each run's step is the median
of its steps (benchmarks/docsection.step_median), then the median over the rounds, and the table gives each
configuration's step over the plain step of the same rounds.

One process; nothing else should run on the machine meanwhile.

    python benchmarks/recipe.py [--rounds 4] [--write]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import installed_versions, step_median, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- recipe:begin -->", "<!-- recipe:end -->"
TITLE = "## The training recipe: what each feature costs a stage-2 step"
SIDE, SAMPLES, REPEAT = 256, 8, 4

# name -> (the cache it trains from, its flags); the cache's own flags are what stage 1 needs to know
CACHES: dict[str, dict[str, Any]] = {"plain": {}, "dropout": {"caption_dropout": 0.5}, "masked": {"masked_loss": True}}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("plain", {}),
    "--caption_dropout 0.5": ("dropout", {"caption_dropout": 0.5}),
    "--timestep_sampling logit_normal --weighting_scheme cosmap": ("plain", {"timestep_sampling": "logit_normal",
                                                                            "weighting_scheme": "cosmap"}),
    "--masked_loss": ("masked", {"masked_loss": True}),
    "--lora_type dora --use_rslora": ("plain", {"lora_type": "dora", "use_rslora": True}),
    "--lora_type lokr": ("plain", {"lora_type": "lokr"}),
    "--lora_type loha": ("plain", {"lora_type": "loha"}),
    "--ema_decay 0.999": ("plain", {"ema_decay": 0.999}),
    "--optimizer adafactor": ("plain", {"optimizer": "adafactor"}),
    "--optimizer prodigy": ("plain", {"optimizer": "prodigy", "learning_rate": 1.0}),
    "--optimizer came": ("plain", {"optimizer": "came"}),
    "--optimizer schedulefree": ("plain", {"optimizer": "schedulefree"}),
}
LIBRARIES = {"prodigy": "prodigyopt", "came": "came_pytorch", "schedulefree": "schedulefree"}
WHY = {"--lora_type dora --use_rslora": "each step takes the norm of every adapted weight, W + s B A, whole",
       "--lora_type lokr": "each step forms every adapted layer's Kronecker product, as large as its weight",
       "--lora_type loha": "each step forms every adapted layer's two rank-r products, each as large as its weight",
       "--optimizer came": "its factored moments and confidence statistics: several passes over each gradient",
       "--optimizer prodigy": "its estimate of the step size: more state read and written per parameter"}


def _quiet(_text: str) -> None:
    pass


def available(flags: dict[str, Any]) -> bool:
    """Whether this machine has the library a configuration needs, and unitgraph the flag."""
    from unitgraph.backends.diffusion.args import TrainArgs

    known = {f for f in TrainArgs.__dataclass_fields__}
    library = LIBRARIES.get(str(flags.get("optimizer")))
    return set(flags) <= known and (library is None or importlib.util.find_spec(library) is not None)


def _args(models: Path, out: Path, task: str, **extra: Any) -> Any:
    from unitgraph.backends.diffusion.args import make_args

    return make_args(task=task, pipeline="qwen_image", model_paths=str(models), lora_base_model="dit", lora_rank=32,
                     max_pixels=SIDE * SIDE, output_path=str(out), progress=False, plot=False, **extra)


def masked_copy(data: Path, folder: Path) -> Path:
    """The dataset with a mask per sample (data.dataset.add_synthetic_masks)."""
    from unitgraph.backends.diffusion.data.dataset import add_synthetic_masks

    shutil.copytree(data, folder)
    add_synthetic_masks(folder)
    return folder


def measure(rounds: int, root: Path) -> dict[str, list[float]]:
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models
    from unitgraph.backends.diffusion.stages import run

    models = write_tiny_models(root / "models", size="demo", seed=0)
    data = root / "data"
    write_synthetic_dataset(data, count=SAMPLES, size=SIDE, seed=1)
    datasets = {"plain": data, "dropout": data, "masked": masked_copy(data, root / "masked")}
    caches = {}
    for name, flags in CACHES.items():
        caches[name] = root / f"cache-{name}"
        run(_args(models, caches[name], "sft:data_process", dataset_base_path=str(datasets[name]),
                  dataset_metadata_path=str(datasets[name] / "metadata.csv"), **flags), echo=_quiet)
    configs = {name: spec for name, spec in CONFIGS.items() if available(spec[1])}
    run(_args(models, root / "warm-up", "sft:train", dataset_base_path=str(caches["plain"]), dataset_repeat=REPEAT),
        echo=_quiet)  # a process's first training run pays one-off set-up
    steps: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for k in range(rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            cache, flags = configs[name]
            result = run(_args(models, root / f"train-{k}-{len(steps[name])}-{names.index(name)}", "sft:train",
                               dataset_base_path=str(caches[cache]), dataset_repeat=REPEAT, **flags), echo=_quiet)
            steps[name].append(step_median(result.step_times))
    return steps


def render(steps: dict[str, list[float]], rounds: int, started: str, ended: str) -> str:
    import platform

    plain = statistics.median(steps["plain"])
    lines = [
        f"Measured {started} to {ended} (UTC) by `python benchmarks/recipe.py --write` on {platform.machine()} "
        f"({installed_versions(('torch', 'diffusers', 'peft', 'prodigyopt', 'came-pytorch', 'schedulefree'))}): "
        f"Qwen-Image's tiny `demo` models, LoRA rank 32 on the DiT, {SAMPLES} samples of {SIDE} px, stage 2 "
        f"(`sft:train`) with --dataset_repeat {REPEAT}; each run's step is the median of its steps, then the median "
        f"over {rounds} rounds in which every configuration ran once, the order rotated each round.",
        "",
        "| configuration | stage-2 step | against plain |",
        "|---|---:|---:|",
    ]
    for name, times in steps.items():
        step = statistics.median(times)
        lines.append(f"| {name if name == 'plain' else f'`{name}`'} | {step * 1000:.1f} ms | {step / plain:.2f} |")
    costly = [name for name, times in steps.items() if statistics.median(times) / plain > 1.10]
    within = ", ".join(f"`{name}`" for name in steps if name not in costly and name != "plain") or "none"
    above = "; ".join(f"`{name}` ({WHY.get(name, 'its own work per step')})" for name in costly)
    lines += ["", f"Within this shared machine's run-to-run noise of about 10% of the plain step: {within}. "
              + (f"Above it: {above}. " if costly else "")
              + "A configuration missing from the table needs a library this machine does not have, or a flag this "
              "version does not take. The memory each feature holds is in the dry run's table (docs/memory.md)."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of docs/benchmarks.md")
    ns = parser.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="recipe-") as tmp:
        steps = measure(ns.rounds, Path(tmp))
    text = render(steps, ns.rounds, started, time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    print(text)
    if ns.write:
        write_section(DOC, BEGIN, END, TITLE, text)


if __name__ == "__main__":
    main()

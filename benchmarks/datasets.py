"""What several datasets and a held-out loss cost (issue #40): stage 1's reuse when a dataset is added to a
`--dataset_config`, and stage 2's time with `--validation_dataset` against without, side by side in one run.

On Qwen-Image's tiny `demo` models (LoRA rank 32 on the DiT, 256 px), with two datasets `a` and `b` of 8 images each
and 4 held-out images:

* **stage 1, a dataset added**: a cache made from a config of `a` alone, then stage 1 again from the config of `a`
  and `b` into the same cache (what a user adding a dataset runs), against stage 1 of `a` and `b` into a new cache,
  and stage 1 once more with nothing changed. Each gives its computed and reused entries and its time.
* **stage 2, the held-out loss**: stage 2 (`sft:train`; `repeats = 2` each: 32 steps) from a cache that holds
  the held-out entries, with the held-out loss every 8 steps (4 evaluations, of the 4 held-out samples each)
  against the same stage 2 from a cache without them. Each gives its whole time and its median step; the cost of
  one evaluation is the difference over the evaluations.

Each figure is the median over `rounds` rounds (the order of the two stage-2 runs alternating), after one
uncounted stage-2 run (a process's first training run pays one-off set-up). One process; nothing else should run on
the machine meanwhile.

    python benchmarks/datasets.py [--rounds 3] [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import installed_versions, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- datasets:begin -->", "<!-- datasets:end -->"
TITLE = "## Several datasets and a held-out loss: stage 1's reuse and stage 2's cost"
SIDE, SAMPLES, HELD, REPEAT, EVERY = 256, 8, 4, 2, 8
STAGE1 = ("a, then a + b (b added)", "a + b into a new cache", "a + b again (nothing changed)")
STAGE2 = ("without held-out entries", f"held-out loss every {EVERY} steps")


def _quiet(_text: str) -> None:
    pass


def _args(models: Path, out: Path, task: str, **extra: Any) -> Any:
    from unitgraph.backends.diffusion.args import make_args

    return make_args(task=task, pipeline="qwen_image", model_paths=str(models), lora_base_model="dit", lora_rank=32,
                     max_pixels=SIDE * SIDE, output_path=str(out), progress=False, plot=False, **extra)


def write_configs(root: Path) -> dict[str, Path]:
    """Datasets `a` and `b` (REPEAT times an epoch each), the held-out images, and the configs of `a` alone and of
    both (JSON)."""
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    for name, seed in (("a", 1), ("b", 2)):
        write_synthetic_dataset(root / name, count=SAMPLES, size=SIDE, seed=seed)
    write_synthetic_dataset(root / "held", count=HELD, size=SIDE, seed=9)
    tables = {name: {"name": name, "base_path": name, "metadata": f"{name}/metadata.csv", "repeats": REPEAT}
              for name in ("a", "b")}
    configs = {}
    for label, names in (("a", ["a"]), ("ab", ["a", "b"])):
        configs[label] = root / f"{label}.json"
        configs[label].write_text(json.dumps({"datasets": [tables[n] for n in names]}))
    return configs


def stage1(models: Path, cache: Path, config: Path, **extra: Any) -> tuple[float, int, int]:
    """(seconds, entries computed, entries reused) of one stage-1 run."""
    from unitgraph.backends.diffusion.stages import run

    t0 = time.perf_counter()
    result = run(_args(models, cache, "sft:data_process", dataset_config=str(config), **extra), echo=_quiet)
    return time.perf_counter() - t0, result.entries_computed, result.entries_reused


def stage2(models: Path, cache: Path, out: Path, **extra: Any) -> tuple[float, float, int]:
    """(seconds, median step, held-out evaluations) of one stage-2 run."""
    from unitgraph.backends.diffusion.stages import run
    from unitgraph.backends.diffusion.train.held_out import FILE, read_held_out_csv

    t0 = time.perf_counter()
    result = run(_args(models, out, "sft:train", dataset_base_path=str(cache), **extra), echo=_quiet)
    seconds = time.perf_counter() - t0
    evaluations = len(read_held_out_csv(out / FILE)) if (out / FILE).exists() else 0
    return seconds, result.median_step_s, evaluations


def measure(rounds: int, root: Path) -> dict[str, Any]:
    from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models

    models = write_tiny_models(root / "models", size="demo", seed=0)
    configs = write_configs(root)
    held = {"validation_dataset": str(root / "held" / "metadata.csv")}
    caches = {STAGE2[0]: root / "cache-plain", STAGE2[1]: root / "cache-held"}
    stage1(models, caches[STAGE2[0]], configs["ab"])
    stage1(models, caches[STAGE2[1]], configs["ab"], **held)
    stage2(models, caches[STAGE2[0]], root / "warm-up")
    found: dict[str, Any] = {"stage1": {name: [] for name in STAGE1}, "stage2": {name: [] for name in STAGE2}}
    for k in range(rounds):
        grown, fresh = root / f"grown-{k}", root / f"fresh-{k}"
        stage1(models, grown, configs["a"])
        found["stage1"][STAGE1[0]].append(stage1(models, grown, configs["ab"]))
        found["stage1"][STAGE1[1]].append(stage1(models, fresh, configs["ab"]))
        found["stage1"][STAGE1[2]].append(stage1(models, grown, configs["ab"]))
        for name in (STAGE2 if k % 2 == 0 else STAGE2[::-1]):
            extra = {"validation_steps": EVERY} if name == STAGE2[1] else {}
            found["stage2"][name].append(stage2(models, caches[name], root / f"train-{k}-{STAGE2.index(name)}",
                                                **extra))
    return found


def _median(rows: list[tuple], index: int) -> float:
    return statistics.median(row[index] for row in rows)


def render(found: dict[str, Any], rounds: int, started: str, ended: str) -> str:
    import platform

    lines = [
        f"Measured {started} to {ended} (UTC) by `python benchmarks/datasets.py --write` on {platform.machine()} "
        f"({installed_versions(('torch', 'diffusers', 'peft'))}): Qwen-Image's tiny `demo` models, LoRA rank 32 on the "
        f"DiT, {SIDE} px; datasets `a` and `b` of {SAMPLES} images each in a `--dataset_config`, {HELD} held-out "
        f"images; the median of {rounds} rounds.",
        "",
        "| stage 1 | entries computed | entries reused | time | against a new cache |",
        "|---|---:|---:|---:|---:|",
    ]
    fresh = _median(found["stage1"][STAGE1[1]], 0)
    for name in STAGE1:
        rows = found["stage1"][name]
        lines.append(f"| {name} | {_median(rows, 1):.0f} | {_median(rows, 2):.0f} | {_median(rows, 0):.2f} s | "
                     f"{_median(rows, 0) / fresh:.2f} |")
    plain, held = (found["stage2"][name] for name in STAGE2)
    evaluations = _median(held, 2)
    extra = _median(held, 0) - _median(plain, 0)
    lines += [
        "",
        f"| stage 2 ({SAMPLES * 2} samples x {REPEAT}: {SAMPLES * 2 * REPEAT} steps) | whole run | against without | "
        "median step | held-out evaluations |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rows in zip(STAGE2, (plain, held)):
        lines.append(f"| {name} | {_median(rows, 0):.2f} s | {_median(rows, 0) / _median(plain, 0):.2f} | "
                     f"{_median(rows, 1) * 1000:.1f} ms | {_median(rows, 2):.0f} |")
    per = extra / evaluations if evaluations else float("nan")
    lines += ["", f"One evaluation of the {HELD} held-out samples took about {per:.2f} s "
              f"({per / _median(plain, 1):.1f} training steps' time: a forward pass per sample without gradients, "
              "from cached entries, no encoder loaded); the training steps themselves do not change (median step "
              f"{_median(held, 1) * 1000:.1f} ms against {_median(plain, 1) * 1000:.1f} ms). Adding a dataset costs "
              "stage 1 the new dataset's entries only."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of docs/benchmarks.md")
    ns = parser.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="datasets-") as tmp:
        found = measure(ns.rounds, Path(tmp))
    text = render(found, ns.rounds, started, time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    print(text)
    if ns.write:
        write_section(DOC, BEGIN, END, TITLE, text)


if __name__ == "__main__":
    main()

"""Stage 1 at the encoders' batched speed: samples/s of `--data_process_batch_size` 1, 4 and 8 against the limit.

For every family, on its tiny random-weight models and one synthetic data set:

- stage 1 at B = 1, 4, 8: the time of `compute_entries` (decoding, every stage-1 unit, the entry files and
  their journal), samples per second;
- the limit: the same samples' model calls alone (the stage-1 units that call a model, through their batch
  forms at B = 8, on inputs prepared beforehand), samples per second;
- how far batched entries are from unbatched ones (max |a - b| over every tensor).

All in one process, one family after the other, each configuration run `--repeats` times (median), stage 1
and its limit back to back in alternating order.

    python benchmarks/stage1_batching.py [--size demo] [--samples 32] [--repeats 8] [--write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- stage1-batching:begin -->", "<!-- stage1-batching:end -->"
TITLE = "## Stage 1 in batches (`--data_process_batch_size`)"
SIDES = {"qwen_image": 128, "flux": 128, "wan": 64}  # wan: 5-frame clips
BATCHES = (1, 4, 8)


def _args(family: Any, pipeline: Any, models: Path, data: Path, out: Path, batch: int, side: int) -> Any:
    from unitgraph.backends.diffusion.args import make_args

    return make_args(task=f"{pipeline.task}:data_process", pipeline=pipeline.name, dataset_base_path=str(data),
                     dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(models),
                     lora_base_model=family.model_slots[0], max_pixels=side * side, output_path=str(out),
                     progress=False, data_process_batch_size=batch)


PHASES = ("model", "free", "decode", "write")  # where compute_entries' time goes (see timed_stage1)


def timed_stage1(args: Any) -> tuple[float, int, dict[str, float]]:
    """(seconds spent in compute_entries after its models are loaded, samples, seconds by phase) of one stage-1
    run: loading the encoders is paid once per run, whatever the data set's size, and the limit does not count
    it either. The phases: the units that call a model (`model`), the others (`free`), reading and decoding the
    samples (`decode`), and storing the entries (`write`: encoding, checksum, the file written and fsynced, its
    journal line); what is left is the loop's own work."""
    import contextlib

    from unitgraph.backends.diffusion import stage1, stages
    from unitgraph.backends.diffusion.cache import cache

    spent: list[float] = []
    phases = dict.fromkeys(PHASES, 0.0)
    original, original_load = stage1.compute_entries, stage1.load_models
    original_unit, original_decoded, original_add = stage1.run_unit, stage1.decoded_ahead, cache.EntryWriter.add

    inside: list[bool] = []

    def timed(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        inside.append(True)
        try:
            return original(*a, **k)
        finally:
            inside.pop()
            spent.append(time.perf_counter() - start)

    def timed_load(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return original_load(*a, **k)
        finally:
            if inside:  # a load inside compute_entries: taken back out of its time
                spent.append(start - time.perf_counter())

    def timed_unit(unit: Any, *a: Any) -> Any:
        start = time.perf_counter()
        try:
            return original_unit(unit, *a)
        finally:
            phases["model" if unit.models else "free"] += time.perf_counter() - start

    @contextlib.contextmanager
    def timed_decoded(*a: Any) -> Any:
        with original_decoded(*a) as sample:
            def timed_sample(index: int) -> Any:
                start = time.perf_counter()
                try:
                    return sample(index)
                finally:
                    phases["decode"] += time.perf_counter() - start
            yield timed_sample

    def timed_add(writer: Any, *a: Any) -> Any:
        start = time.perf_counter()
        try:
            return original_add(writer, *a)
        finally:
            phases["write"] += time.perf_counter() - start

    stage1.compute_entries, stage1.load_models = timed, timed_load
    stage1.run_unit, stage1.decoded_ahead, cache.EntryWriter.add = timed_unit, timed_decoded, timed_add
    try:
        result = stages.run(args, echo=lambda _t: None)
    finally:
        stage1.compute_entries, stage1.load_models = original, original_load
        stage1.run_unit, stage1.decoded_ahead, cache.EntryWriter.add = original_unit, original_decoded, original_add
    return sum(spent), result.samples, phases


def limit(args: Any, batch: int = 8) -> tuple[float, int, float]:
    """(seconds of the model calls alone, samples, seconds of decoding the samples): every stage-1 unit that
    calls a model, at `batch`, on inputs the model-free units prepared beforehand (not timed); decoding
    (dataset.sample: images read, clips decoded) timed apart, as the part of stage 1 that is no model call."""
    import torch

    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.models.stage import load_models, make_context
    from unitgraph.backends.diffusion.session import make_dataset, plan_for

    cfg = RunConfig.from_args(args)
    plan = plan_for(cfg)
    models = load_models(cfg, plan.data_process_models, training=False, device="cpu")
    ctx = make_context(cfg, models, "cpu")
    dataset = make_dataset(cfg)
    code = cfg.pipeline.unit_code()
    start = time.perf_counter()
    states = [dataset.sample(i) for i in range(len(dataset))]
    decode = time.perf_counter() - start
    seconds = 0.0
    with torch.no_grad():
        for name in plan.data_process_units:
            unit = code[name]
            for first in range(0, len(states), batch):
                chunk = states[first:first + batch]
                start = time.perf_counter()
                outs = unit.run_batch(ctx, chunk)
                if unit.models:
                    seconds += time.perf_counter() - start
                for state, out in zip(chunk, outs):
                    state.update(out)
    return seconds, len(states), decode


def entry_distance(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    worst = 0.0
    for path in (a / "entries").iterdir():
        x, y = load_file(str(path)), load_file(str(b / "entries" / path.name))
        for key in x:
            if x[key].is_floating_point():
                worst = max(worst, float((x[key] - y[key]).abs().max()))
    return worst


def measure(size: str, samples: int, repeats: int, work: Path, only: Optional[list[str]] = None) -> list[dict[str, Any]]:
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.registry import families

    rows = []
    for family in families():
        if only and family.name not in only:
            continue
        pipeline = family.pipelines[0]
        side = SIDES.get(family.name, 64)
        models = family.tiny_module().write_tiny_models(work / family.name / "models", size=size, seed=0,
                                                        pipeline=pipeline.name)
        data = work / family.name / "data"
        videos = [c for c in pipeline.video_params if c in pipeline.required]
        write_synthetic_dataset(data, count=samples, size=side, seed=5, videos=videos)
        row: dict[str, Any] = {"family": family.name, "pipeline": pipeline.name, "side": side, "samples": samples}
        rates: dict[str, list[float]] = {}
        for rep in range(repeats + 1):  # the first round warms up (oneDNN builds its kernels per input shape)
            for batch in BATCHES:
                out = work / family.name / f"cache-{batch}-{rep}"
                # stage 1 and its limit back to back, in alternating order (a process's second run of the
                # same work tends to be the faster one: the order must not favour either side)
                first = rep % 2 == 0
                if first:
                    seconds, n, phases = timed_stage1(_args(family, pipeline, models, data, out, batch, side))
                l_seconds, l_n, decode = limit(_args(family, pipeline, models, data, work / "unused", batch, side), batch)
                if not first:
                    seconds, n, phases = timed_stage1(_args(family, pipeline, models, data, out, batch, side))
                if rep:
                    stage1_rate, limit_rate = n / seconds, l_n / l_seconds
                    rates.setdefault(f"b{batch}", []).append(stage1_rate)
                    rates.setdefault(f"limit{batch}", []).append(limit_rate)
                    # paired: a slow moment of this shared machine slows both; the median of these ratios is
                    # what the target is judged on
                    rates.setdefault(f"ratio{batch}", []).append(stage1_rate / limit_rate)
                    # and against the model calls plus decoding the same samples (what stage 1 cannot skip)
                    rates.setdefault(f"decoded{batch}", []).append(stage1_rate / (l_n / (l_seconds + decode)))
                    rates.setdefault(f"decode_share{batch}", []).append(decode / l_seconds)
                    # ms per sample of each phase of stage 1, and the model calls' against the limit's
                    for phase in PHASES:
                        rates.setdefault(f"{phase}_ms{batch}", []).append(1e3 * phases[phase] / n)
                    rates.setdefault(f"rest_ms{batch}", []).append(1e3 * (seconds - sum(phases.values())) / n)
                    rates.setdefault(f"limit_ms{batch}", []).append(1e3 * l_seconds / l_n)
                    rates.setdefault(f"model_vs_limit{batch}", []).append(phases["model"] / n / (l_seconds / l_n))
        row.update({k: statistics.median(v) for k, v in rates.items()})
        row["distance"] = max(entry_distance(work / family.name / "cache-1-0", work / family.name / f"cache-{b}-0")
                              for b in BATCHES[1:])
        rows.append(row)
    return rows


def report(rows: list[dict[str, Any]], size: str, repeats: int) -> str:
    import importlib.metadata as md

    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/stage1_batching.py --write` (Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, torch {md.version('torch')}); tiny random-weight "
        f"models at `{size}` size, median of {repeats} runs after a warm-up round. samples/s of stage 1's compute (decoding, every "
        "stage-1 unit, the entry files and their journal) at each --data_process_batch_size B, and the limit: the "
        "same samples' model calls alone at the same B, measured back to back with it (in alternating order). "
        "In parentheses, first the median over the rounds of each round's stage 1 / limit, so that a slow moment "
        "of the shared machine, which slows both, cancels out (target 0.9); then the same against the limit "
        "plus decoding the same samples (reading the images, decoding the clips: work stage 1 cannot skip and "
        "the model calls do not include). The last but two column gives decoding's time as a share of the "
        "model calls' at B = 4.",
        "",
        "| family | samples | " + " | ".join(f"B = {b}: stage 1 / limit (ratio; with decoding)" for b in BATCHES)
        + " | decoding / model calls | best stage 1 vs B = 1 | max abs diff to B = 1 |",
        "|---|---|" + "---|" * len(BATCHES) + "---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r[f'b{b}']:.1f} / {r[f'limit{b}']:.1f} ({r[f'ratio{b}']:.2f}; {r[f'decoded{b}']:.2f})"
                           for b in BATCHES)
        best = max(r[f"b{b}"] for b in BATCHES) / r["b1"]
        lines.append(f"| {r['family']} | {r['samples']} x {r['side']}px | {cells} | {r['decode_share4']:.0%} | "
                     f"{best:.2f}x | {r['distance']:.1e} |")
    lines += ["", "Where stage 1's time goes, in ms per sample (median over the rounds): its units that call a model "
              "(and that time against the limit's model calls on the same samples), its model-free units, reading "
              "and decoding the samples, storing the entries (encoding, checksum, each file written, fsynced and "
              "renamed, its journal line appended and fsynced: an entry is durable before it counts as done) and "
              "the loop's own rest:", "",
              "| family | B | model calls (vs limit) | model-free units | decoding | entry writes | rest |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for b in BATCHES:
            if f"model_ms{b}" not in r:
                continue
            lines.append(f"| {r['family']} | {b} | {r[f'model_ms{b}']:.2f} ({r[f'model_vs_limit{b}']:.2f}) | "
                         f"{r[f'free_ms{b}']:.2f} | {r[f'decode_ms{b}']:.2f} | {r[f'write_ms{b}']:.2f} | "
                         f"{r[f'rest_ms{b}']:.2f} |")
    lines += ["", "The prompt encoders' batched entries are bit for bit the unbatched ones (prompts of one token "
              "length, or all padded to a fixed length, go together); the VAEs' batched convolutions round "
              "differently, which the last column measures. So the default stays 1: only unbatched entries keep "
              "split training bit for bit the unsplit run (batched, the losses agree within that rounding)."]
    return "\n".join(lines)


def write_doc(text: str, doc: Path = DOC) -> None:
    write_section(doc, BEGIN, END, TITLE, text)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="demo", choices=["demo", "test"])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=8, help="measured rounds after one warm-up round (even: as many of each order)")
    parser.add_argument("--families", help="comma-separated family names (default: every family)")
    parser.add_argument("--write", action="store_true", help=f"replace the section in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="unitgraph-stage1-batching-") as tmp:
        rows = measure(args.size, args.samples, args.repeats, Path(tmp),
                       args.families.split(",") if args.families else None)
    text = report(rows, args.size, args.repeats)
    print(text)
    if args.write:
        write_doc(text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()

"""Caches on an object store against a local cache, side by side in one run on one machine.

Two measurements, against moto's standalone S3 server on 127.0.0.1 (tests/s3server.py; every request
crosses HTTP and moto's Python, ~5 ms each: a store much slower than the local disk):

1. stage 2's step time training from the bucket (entries streamed, fetched ahead by `stages.ReadAhead`)
   and, for contrast, from the bucket with the read-ahead switched off, both against the same training
   from a local cache, also streamed (entries read as each step needs them, not kept in memory);
2. how many entries per second the two layouts write and read back on the server (`files`: an object per
   entry; `shards`: many entries per object, ranged reads), and the same on the local disk.

    python benchmarks/object_store.py            # print the tables
    python benchmarks/object_store.py --write    # and replace their section in docs/benchmarks.md

Ratios are what to read: both sides of each ratio ran in this process, one after the other.
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
from docsection import installed_versions, step_median, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- object-store:begin -->", "<!-- object-store:end -->"
TITLE = "## Caches on an object store (S3-compatible, local server)"
BUCKET = "bench"


def _server() -> Any:
    sys.path.insert(0, str(ROOT / "tests"))
    from s3server import start_server  # the tests' helper: moto's server on 127.0.0.1

    server = start_server(in_process=False)  # a process of its own, as a remote store would be
    server.make_bucket(BUCKET)
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    os.environ.update(server.env())
    return server


def _cli(*argv: str) -> None:
    from unitgraph.cli.app import main

    try:
        main(list(argv))
    except SystemExit as exc:
        if exc.code:
            raise RuntimeError(f"unitgraph {' '.join(argv[:3])} ... exited with {exc.code}") from None


def _median_step(out: Path) -> float:
    from unitgraph.backends.diffusion.train.loop import read_loss_csv

    rows = read_loss_csv(out / "loss.csv")
    steps = [rows[0]["elapsed_s"]] + [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    return step_median(steps)  # window means: the data work of a run of batches is counted


def stage2_steps(work: Path, samples: int, size: int, epochs: int, repeats: int) -> dict[str, Any]:
    """Median step time of the same training from a local cache and from the bucket (with and without read-ahead)."""
    import torch

    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models

    torch.set_num_threads(1)
    models = write_tiny_models(work / "models", size="test", seed=0)
    data = work / "data"
    write_synthetic_dataset(data, count=samples, size=size, seed=7)
    common = ["--model_paths", str(models), "--lora_base_model", "dit", "--max_pixels", str(size * size), "--seed", "3",
              "--no-progress"]
    url = f"s3://{BUCKET}/steps"
    for where in (str(work / "cache"), url):
        _cli("train", "--task", "sft:data_process", *common, "--dataset_base_path", str(data),
             "--dataset_metadata_path", str(data / "metadata.csv"), "--output_path", where)
    stages.KEEP_IN_MEMORY_BYTES = 0  # both stream: each entry read when its step needs it
    results: dict[str, Any] = {}
    original = stages.ReadAhead.schedule
    runs = [("local", str(work / "cache"), True), ("s3", url, True), ("s3_no_read_ahead", url, False)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for rep in range(repeats):  # interleaved, so a noisy moment of the machine hits every side alike
        for name, where, ahead in runs:
            stages.ReadAhead.schedule = original if ahead else (lambda self, keys: None)
            out = work / f"run-{name}-{rep}"
            _cli("train", "--task", "sft:train", *common, "--dataset_base_path", where, "--lora_rank", "4",
                 "--num_epochs", str(epochs), "--learning_rate", "1e-3", "--output_path", str(out), "--no-plot")
            times[name].append(_median_step(out))
    stages.ReadAhead.schedule = original
    for name, values in times.items():
        results[name] = {"step_s": statistics.median(values), "runs": values}
    results["s3_vs_local"] = results["s3"]["step_s"] / results["local"]["step_s"]
    results["no_read_ahead_vs_local"] = results["s3_no_read_ahead"]["step_s"] / results["local"]["step_s"]
    results["samples"], results["size"], results["epochs"], results["repeats"] = samples, size, epochs, repeats
    return results


def layout_rates(work: Path, entries: int, kib: int) -> dict[str, Any]:
    """Entries/s written (through the cache's writers, journals included) and read back, per layout and store."""
    import torch

    from unitgraph.backends.diffusion.cache.cache import Cache, entry_record

    values = {"latents": torch.randn(kib * 256)}  # kib KiB of float32
    out: dict[str, Any] = {"entries": entries, "kib": kib}
    for store, location in (("local disk", str(work / "rates")), ("S3 server", f"s3://{BUCKET}/rates")):
        for layout in ("files", "shards"):
            cache = Cache(f"{location}-{layout}")
            cache.store.exists()  # the client made and the connection opened before the clock starts
            start = time.perf_counter()
            with cache.writer(0, layout) as writer:
                for i in range(entries):
                    writer.add(f"{i:064x}", values, {"index": i})
            write_s = time.perf_counter() - start
            records = [r for r in map(entry_record, cache.read_journals()) if r is not None]
            assert len(records) == entries, (store, layout, len(records))
            start = time.perf_counter()
            data = {}
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=8) as pool:  # as stage 2's read-ahead reads: 8 at a time
                for record, blob in zip(records, pool.map(cache.entry_data, records)):
                    data[record["key"]] = blob
            read_s = time.perf_counter() - start
            assert all(len(data[r["key"]]) == r["size"] for r in records)
            out[f"{store}/{layout}"] = {"write_per_s": entries / write_s, "read_per_s": entries / read_s,
                                        "objects": len(cache.store.list())}
    return out


def environment() -> str:
    versions = installed_versions(("torch", "s3fs", "fsspec", "botocore", "moto"))
    return f"Python {platform.python_version()}, {os.cpu_count()} CPUs; {versions}"


def report(steps: dict[str, Any], rates: dict[str, Any]) -> str:
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/object_store.py --write` ({environment()}); "
        "moto's standalone server on 127.0.0.1 stands in for the bucket: every request crosses HTTP and moto's "
        "Python, so this store is much slower per request than the local disk.",
        "",
        f"**Stage 2 from the bucket** (tiny Qwen-Image at `test` size, {steps['samples']} samples of "
        f"{steps['size']}x{steps['size']}, {steps['epochs']} epochs, entries streamed on both sides: read when a "
        f"step needs them, not kept in memory; the median of {steps['repeats']} interleaved runs of each):",
        "",
        "| cache | median step | ratio to local |",
        "|---|---|---|",
        f"| local folder | {ms(steps['local']['step_s'])} | 1.00 |",
        f"| s3://, read-ahead ({_read_ahead()} entries, {_read_threads()} GETs at a time) | {ms(steps['s3']['step_s'])} "
        f"| {steps['s3_vs_local']:.2f} |",
        f"| s3://, read-ahead off | {ms(steps['s3_no_read_ahead']['step_s'])} | {steps['no_read_ahead_vs_local']:.2f} |",
        "",
        "A local cache is read in the step (a local read of a small entry takes well under a millisecond); the "
        "bucket's entries arrive ahead of it, so a ratio at or below 1.0 means the read-ahead hid the store's "
        "latency entirely. Run-to-run noise on this shared 2-core machine is about ±15 %.",
        "",
        f"**Entries per second by layout** ({rates['entries']} entries of {rates['kib']} KiB, written through the "
        "cache's writers with their journals, read back 8 at a time):",
        "",
        "| store | layout | objects | written/s | read/s |",
        "|---|---|---|---|---|",
    ]
    for store in ("local disk", "S3 server"):
        for layout in ("files", "shards"):
            r = rates[f"{store}/{layout}"]
            lines.append(f"| {store} | {layout} | {r['objects']} | {r['write_per_s']:.0f} | {r['read_per_s']:.0f} |")
    files, shards = rates["S3 server/files"], rates["S3 server/shards"]
    lines += ["", f"On the server, `shards` writes {shards['write_per_s'] / files['write_per_s']:.1f}x the entries per "
              f"second of `files` with {files['objects'] // max(1, shards['objects'])}x fewer objects; reads are one "
              "ranged GET per entry in both layouts."]
    return "\n".join(lines)


def _read_ahead() -> int:
    from unitgraph.backends.diffusion.stages import READ_AHEAD

    return READ_AHEAD


def _read_threads() -> int:
    from unitgraph.backends.diffusion.stages import READ_THREADS

    return READ_THREADS


def write_doc(text: str, doc: Path = DOC) -> None:
    write_section(doc, BEGIN, END, TITLE, text)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24, help="samples of the stage-2 comparison")
    parser.add_argument("--size", type=int, default=64, help="image side of those samples")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each stage-2 side")
    parser.add_argument("--entries", type=int, default=400, help="entries of the layout comparison")
    parser.add_argument("--kib", type=int, default=16, help="size of each of those entries")
    parser.add_argument("--write", action="store_true", help=f"replace the section in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    server = _server()
    try:
        with tempfile.TemporaryDirectory(prefix="unitgraph-objstore-") as tmp:
            steps = stage2_steps(Path(tmp), args.samples, args.size, args.epochs, args.repeats)
            rates = layout_rates(Path(tmp), args.entries, args.kib)
    finally:
        server.stop()
    text = report(steps, rates)
    print(text)
    if args.write:
        write_doc(text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()

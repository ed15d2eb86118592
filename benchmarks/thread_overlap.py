"""Can a Python thread prepare stage 2's next batch while the training thread is inside backward, on a CPU?

On a GPU the answer is yes and stage 2 does it (backends/diffusion/train/executor.py: a prefetch thread by default with CUDA).
On a CPU-only machine torch trains with one intra-op thread per core it is given, and the second core
of this machine sits idle during a step at `test` size; a thread that prepares the next batch there
during backward would take the data path off the step. This measures whether it can, with a LoRA-sized
stand-in for the step (an MLP of `--layers` linear layers, forward + backward) and a stand-in for the
data path (`--job-us` microseconds of pure Python work, the size of one stage-2 batch at `test` size):

  alone       backward by itself
  busy        backward while another thread runs Python without pause
  job         backward while another thread runs one job, handed over just before backward
  serial      backward, then the same job in the caller (what stage 2 does on the CPU)

`overlap` is the share of the job's time that the `job` configuration hides: (serial - job) / job time.
torch uses one intra-op thread, as in the stage-2 benchmark. Configurations alternate, `--repeats`
rounds, medians.

    python benchmarks/thread_overlap.py [--layers 20] [--job-us 250] [--repeats 200] [--write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- thread-overlap:begin -->", "<!-- thread-overlap:end -->"
TITLE = "## A batch prepared during backward, in a thread (CPU)"


def python_job(microseconds: float) -> Callable[[], int]:
    """A job of pure Python work lasting about `microseconds` (calibrated once): dict and list operations,
    as the data path's bookkeeping is."""
    def work(n: int) -> int:
        table: dict[int, int] = {}
        for i in range(n):
            table[i & 63] = table.get(i & 63, 0) + i
        return len(table)

    n = 1000
    while True:
        start = time.perf_counter()
        work(n)
        took = time.perf_counter() - start
        if took >= 1e-3:
            break
        n *= 2
    iterations = max(1, int(n * microseconds * 1e-6 / took))
    return lambda: work(iterations)


def measure(layers: int, job_us: float, repeats: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(layers)])
    x = torch.randn(64, 256)
    job = python_job(job_us)

    def backward(before: Optional[Callable[[], Any]] = None, after: Optional[Callable[[], Any]] = None) -> float:
        """Seconds of one backward, with `before` and `after` (run right around it) inside the timing."""
        loss = model(x).square().mean()
        start = time.perf_counter()
        if before is not None:
            before()
        loss.backward()
        if after is not None:
            after()
        return time.perf_counter() - start

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    class Helper:
        """One long-lived thread that runs a job each time it is handed one (as a prefetch thread would)."""

        def __init__(self) -> None:
            self.go, self.done = threading.Event(), threading.Event()
            self.thread = threading.Thread(target=self.loop, daemon=True)
            self.thread.start()

        def loop(self) -> None:
            while True:
                self.go.wait()
                self.go.clear()
                if stop.is_set():
                    return
                job()
                self.done.set()

        def hand_over(self) -> None:
            self.done.clear()
            self.go.set()

    helper = Helper()
    run_alone = backward
    run_serial = lambda: backward(after=job)  # noqa: E731
    run_job = lambda: backward(before=helper.hand_over, after=helper.done.wait)  # noqa: E731

    for _ in range(20):  # warm-up
        run_alone(), run_serial(), run_job()
    times: dict[str, list[float]] = {"alone": [], "serial": [], "job": [], "job_only": []}
    for n in range(repeats):
        for name, fn in (("alone", run_alone), ("serial", run_serial), ("job", run_job)):
            times[name].append(fn())
        start = time.perf_counter()
        job()
        times["job_only"].append(time.perf_counter() - start)
    # a thread that never pauses: far fewer rounds (each backward can take a switch interval per GIL hand-off)
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(0.01)
    busy = [backward() for _ in range(max(5, repeats // 20))]
    stop.set()
    spinner.join()
    helper.go.set()
    helper.thread.join()
    result = {name: statistics.median(v) for name, v in times.items()}
    result["busy"] = statistics.median(busy)
    result["overlap"] = (result["serial"] - result["job"]) / result["job_only"]
    result.update(layers=layers, job_us=job_us, repeats=repeats, switch_interval=sys.getswitchinterval())
    return result


def report(r: dict[str, Any]) -> str:
    import importlib.metadata as md

    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/thread_overlap.py --write` (Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, torch {md.version('torch')}, one intra-op thread): "
        f"the backward of an MLP of {r['layers']} linear layers (256 wide, batch 64) and a job of "
        f"{r['job_us']:.0f} us of pure Python work (one stage-2 batch's data path at `test` size), medians of "
        f"{r['repeats']} alternating rounds; the interpreter's switch interval is {r['switch_interval'] * 1e3:.0f} ms.",
        "",
        "| backward alone | while a thread runs Python without pause | with the job on a thread during it "
        "| then the job in the caller | the job alone | share of the job hidden by the thread |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {ms(r['alone'])} ms | {ms(r['busy'])} ms | {ms(r['job'])} ms | {ms(r['serial'])} ms | "
        f"{ms(r['job_only'])} ms | {r['overlap']:.0%} |",
        "",
        "torch's CPU backward releases the GIL for its kernels but, as measured here, needs it again between "
        "them, so a thread running Python beside it makes each hand-off wait for that thread to yield (up to "
        f"a switch interval each): the backward runs {r['busy'] / r['alone']:.0f}x slower, and "
        + (f"a job handed to a thread during backward is not hidden behind it (it costs {-r['overlap']:.0%} of its own "
           "time more than in the caller)" if r["overlap"] <= 0 else
           f"a job handed to a thread during backward is only {r['overlap']:.0%} hidden behind it")
        + ". This is why stage 2 prepares its batches in the training thread on a CPU "
        "(SYNC_RUN at a time) and uses a prefetch thread only with CUDA, where the step runs on the device.",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--job-us", type=float, default=250.0)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--write", action="store_true", help=f"replace the section in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    text = report(measure(args.layers, args.job_us, args.repeats))
    print(text)
    if args.write:
        write_section(DOC, BEGIN, END, TITLE, text)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()

"""Several runs in one 2-process launch: the conformance suite's stage-1 exact-once check, once per family, and
the engines' runs (tests/test_engines.py, launched with an engine's accelerate config).

`accelerate launch --num_processes 2 tests/two_process_stage1.py JOBS.json` runs, in each process, every job of the
file in turn: `unitgraph <argv>` as the command line would, its output written to `<output>.rank<R>.out` and its exit
code to `<output>.rank<R>.code`. A job that fails ends the process (and so the launch): the other process would
wait for it in the next run's collectives. One launch pays the interpreters' start and the imports (~10 s on 2 cores) once for
all families where a launch per family pays it for each; each run still shards its entries over the two processes
exactly as a launch of its own does (the same process group, the same `Accelerator` state).

JOBS.json: a list of {"argv": [...], "output": "<folder the run's --output_path names>"}, each with an optional
"env" ({name: value} set for that job only, as a launch's config would set them).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


def run_job(argv: list[str], output: Path, rank: str) -> int:
    from unitgraph.cli.app import main

    output.parent.mkdir(parents=True, exist_ok=True)
    log = output.parent / f"{output.name}.rank{rank}.out"
    with log.open("w", encoding="utf-8") as handle, contextlib.redirect_stdout(handle), \
            contextlib.redirect_stderr(handle):
        try:
            main([*argv, "--output_path", str(output)])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0) if not isinstance(exc.code, str) else 1
        except Exception as exc:  # the test shows it
            print(f"{type(exc).__name__}: {exc}")
            code = 1
    (output.parent / f"{output.name}.rank{rank}.code").write_text(str(code), encoding="utf-8")
    return code


def main(jobs_file: str) -> None:
    rank = os.environ.get("RANK", "0")
    for job in json.loads(Path(jobs_file).read_text(encoding="utf-8")):
        saved = {name: os.environ.get(name) for name in job.get("env", {})}
        os.environ.update(job.get("env", {}))
        try:
            code = run_job(job["argv"], Path(job["output"]), rank)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if code:
            sys.exit(code)
    leave_cleanly()


def leave_cleanly() -> None:
    """Both processes done, the process group taken down: a process leaving with gloo's threads still up can abort
    ("terminate called without an active exception") after its work, failing the launch for nothing."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

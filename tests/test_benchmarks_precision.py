"""benchmarks/real_size.py and benchmarks/gpu_real_size.py at the test size: the same code paths, in seconds.

The real-size runs take minutes (the CPU one) or a GPU (the other); here their settings, processes, memory
readings and reports are exercised on the tiny test-size models.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_real_size_runs_every_setting_at_the_test_size(tmp_path):
    bench = _module("real_size")
    # fp32 (the unit the report divides by) and the setting with every other kind (fp8 storage, checkpointing): the
    # others are the same code with fewer flags
    only = ["fp32", "bf16 + fp8 + ckpt"]
    rows = bench.measure("test", 2, tmp_path, only=only)
    assert [r["setting"] for r in rows] == only and set(only) <= {s[0] for s in bench.SETTINGS}
    for row in rows:
        assert row["steps"] == 2 and row["step_s"] > 0
        assert row["baseline"] > 0 and row["peak"] >= row["steady"] > 0
        assert row["estimate"] is None or row["estimate"] > 0
    text = bench.report(rows, "test", 2)
    assert text.count("\n| ") == len(rows) + 1
    fp32_line = next(line for line in text.splitlines() if line.startswith("| fp32 | "))
    # fp32 is its own unit; at the test size its steady RSS may not rise above the baseline, and then no ratio is shown
    fp32_above = rows[0]["steady"] - rows[0]["baseline"]
    assert fp32_line.split(" | ")[2] == ("1.00" if fp32_above > 0 else "-")


@pytest.mark.slow
def test_gpu_real_size_runs_on_a_cpu_at_the_test_size(tmp_path, capsys):
    bench = _module("gpu_real_size")
    # DiffSynth's low-VRAM setting, the one launched under accelerate with its ZeRO-3 CPU-offload config: a run is a
    # process of its own (~10 s here), and the other settings are a plain child process with other flags (fp8
    # storage, checkpointing, block swap and the unsplit run each have tests of their own)
    blocks = 2  # the tiny Wan DiT's
    names = [s[0] for s in bench.settings(blocks)]
    assert names == ["bf16", "bf16 + fp8", "bf16 + fp8 + ckpt", "bf16 + ckpt, ZeRO-3 CPU offload (low-VRAM)",
                     "bf16 + fp8 + ckpt + swap 1"]
    assert [s[2] for s in bench.settings(blocks)] == [True, False, True, False, False]  # which also run unsplit
    # at the machine's default precision: bf16 has no kernels on most CPUs (emulated tens of times slower)
    from unitgraph.backends.diffusion.config import default_precision

    rows = bench.measure(["wan"], budget=600, workdir=tmp_path, only=[names[3]], precision=default_precision())
    assert [(r["setting"], r["stage"]) for r in rows] == [(names[3], "stage 2")]
    assert all("error" not in r and r["steps"] == 3 and r["peak"] is None for r in rows), rows
    made_up = {"family": "wan", "setting": "bf16", "stage": "unsplit", "peak": None, "estimate": 3 << 30, "step_s": 1.5}
    assert "| wan | bf16 | unsplit | - | 3.00 | 1.50 |" in bench.table([*rows, made_up])
    late = bench.measure(["wan"], budget=0, workdir=tmp_path / "late", only=names[:1])
    assert late and all(r["error"] == "not run (time budget)" for r in late)


def test_real_size_report_divides_by_fp32_only_when_fp32_rose_above_its_baseline():
    bench = _module("real_size")
    gib = 1 << 30
    row = lambda name, steady: {"setting": name, "baseline": gib, "peak": gib + steady, "steady": gib + steady,  # noqa: E731
                                "step_s": 1.0, "estimate": None}
    cells = lambda text, name: next(x for x in text.splitlines() if x.startswith(f"| {name} | ")).split(" | ")  # noqa: E731
    text = bench.report([row("fp32", 4 * gib), row("bf16", 2 * gib)], "test", 2)
    assert cells(text, "fp32")[2] == "1.00" and cells(text, "bf16")[2] == "0.50"
    text = bench.report([row("fp32", 0), row("bf16", 2 * gib)], "test", 2)
    assert cells(text, "fp32")[2] == "-" and cells(text, "bf16")[2] == "-"


def test_engines_report_compares_each_engine_with_data_parallel_held_bytes():
    bench = _module("engines")
    gib = 1 << 30
    rank = lambda weights, state: {"baseline": gib, "steady": 2 * gib, "held": [weights, state], "step_s": 1.0,  # noqa: E731
                                   "estimate": gib}
    rows = [{"mode": "lora", "engine": "data parallel", "ranks": [rank(4 * gib, 0), rank(4 * gib, 0)]},
            {"mode": "lora", "engine": "FSDP2", "ranks": [rank(2 * gib, 0), rank(gib, 0)]}]
    text = bench.report(rows, "test", 3)
    line = next(x for x in text.splitlines() if x.startswith("| LoRA r32 | FSDP2 |"))
    assert line.split(" | ")[2:4] == ["2.00", "0.50"]  # the larger process's share over data parallel's

"""A real-size denoiser over 2 CPU processes under each engine: Wan 2.1 T2V 1.3B's DiT trained with a LoRA and in full.

The DiT is Wan 2.1 T2V 1.3B's published config with random weights stored bf16 (benchmarks/real_size.py writes
it); full training uses the same widths with 4 of its 30 blocks (1.42 B parameters trained in full need 22.7 GB a
process under data parallel, more than this 24 GiB machine has for two). Stage 1 runs once; each engine then runs
stage 2 (`sft:train`, at the run's default precision on this machine, a few steps on 5-frame 64x64 clips) in one `accelerate launch --num_processes 2` with
an accelerate config of that engine, every process measuring itself:

* *held*: the bytes of weights and optimizer state the process holds after its first step, counted from its own
  tensors (its FSDP2 shards, ZeRO partitions and flat fp32 copies; train/engines.held_bytes), wherever they live;
* *steady RSS*: the process's resident set above its baseline (before the models load), the median over the steps
  after the first (offloaded state counts here too: this machine's "device" is its CPU);
* the median step time, and the dry run's stage-2 per-process peak for the same flags and engine.

    python benchmarks/engines.py [--size real|test] [--steps 3] [--only lora,full] [--write]

`--size test` runs the same code on the tiny test-size DiT (the suite's smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import installed_versions, write_section  # noqa: E402
from real_size import CLIP, RssSampler, real_dit_config, write_models  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- engines:begin -->", "<!-- engines:end -->"
TITLE = "## Engines: a real-size DiT over 2 CPU processes under data parallel, ZeRO-2, ZeRO-3 and FSDP2"
GIB = 1 << 30
FULL_BLOCKS = 4
# (name, accelerate config's engine part)
ENGINES = [
    ("data parallel", "distributed_type: MULTI_GPU\n"),  # torchrun's 2 processes; accelerate makes them CPU DDP
    ("ZeRO-2", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"),
    ("ZeRO-2 + offload", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
                         "  offload_optimizer_device: cpu\n"),
    # with zero3_init_flag, as DiffSynth's ZeRO-3 configs: the trained model is read into its partitions
    ("ZeRO-3", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds_z3.json\n"
               "  zero3_init_flag: true\n"),
    ("ZeRO-3 + offload", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds_z3_offload.json\n"
                         "  zero3_init_flag: true\n"),
    ("FSDP2", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n"),
]
Z3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
Z3_OFFLOAD = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}


def precision() -> str:
    """The run's default precision on this machine (config.default_precision): bf16 where the device has bf16
    kernels, else fp32 ("no"; torch emulates bf16 some 45-60 times slower on a CPU without them)."""
    from unitgraph.backends.diffusion.config import default_precision

    return default_precision()


def config_text(engine: str) -> str:
    body = dict(ENGINES)[engine]
    extra = f"mixed_precision: '{precision()}'\n" if "deepspeed_config_file" not in body else ""
    return body + extra + "num_machines: 1\nnum_processes: 2\nuse_cpu: false\n"


def write_full_models(models: Path, size: str) -> Path:
    """The same folder with a DiT of the real widths and FULL_BLOCKS blocks (test size: the tiny DiT as it is)."""
    import shutil

    folder = models.parent / "full-models"
    shutil.copytree(models, folder, ignore=shutil.ignore_patterns("transformer"))
    if size == "test":
        shutil.copytree(models / "transformer", folder / "transformer")
        return folder
    import torch
    from diffusers import WanTransformer3DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        dit = WanTransformer3DModel(**dict(real_dit_config(), num_layers=FULL_BLOCKS))
    finally:
        torch.set_default_dtype(previous)
    dit.save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


def flags(models: Path, data: Path, mode: str, steps: int) -> dict[str, Any]:
    train = dict(lora_base_model="dit", lora_rank=32) if mode == "lora" else dict(trainable_models="dit")
    return dict(pipeline="wan", model_paths=str(models), dataset_base_path=str(data), height=CLIP["side"],
                width=CLIP["side"], num_frames=CLIP["frames"], mixed_precision=precision(), seed=0, learning_rate=1e-5,
                progress=False, plot=False, dataset_repeat=2 * steps, **train)


def child(models: Path, cache: Path, out: Path, mode: str, steps: int) -> None:
    """One process of a launch: its stage-2 run, measured; rank<R>.json in `out`'s parent."""
    import torch

    torch.set_num_threads(1)
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.train import loop

    args = make_args(task="sft:train", output_path=str(out), **flags(models, cache, mode, steps))
    estimate = None
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        try:
            from unitgraph.backends.diffusion.config import RunConfig
            from unitgraph.backends.diffusion.memory_plan import memory_plan
            from unitgraph.backends.diffusion.session import plan_for

            cfg = RunConfig.from_args(make_args(task="sft:train", output_path=str(out), dry_run=True,
                                                **flags(models, cache, mode, steps)))
            estimate = memory_plan(cfg, plan_for(cfg))["stages"]["train"]["peak_bytes"]
        except Exception as exc:  # noqa: BLE001 - the measurement goes on; the table shows no estimate
            print(f"dry run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    marks: list[float] = []
    real_step = loop.micro_step

    def marked(*a: Any, **k: Any) -> Any:
        marks.append(time.perf_counter())
        return real_step(*a, **k)

    loop.micro_step = marked
    baseline = RssSampler.rss()
    with RssSampler() as sampler:
        result = stages.run(args, echo=lambda _t: None)
        ended = time.perf_counter()
    steady = sampler.between(marks[1], ended) if len(marks) > 1 else sampler.between(marks[0], ended)
    row = {"rank": rank, "baseline": baseline, "steady": int(statistics.median(steady)) if steady else baseline,
           "held": list(result.held_bytes or (0, 0)), "step_s": result.median_step_s, "estimate": estimate}
    (out.parent / f"{out.name}.rank{rank}.json").write_text(json.dumps(row))


def measure(size: str, steps: int, workdir: Path, modes: list[str]) -> list[dict[str, Any]]:
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    lora_models = write_models(workdir / "models", size)
    folders = {"lora": lora_models, "full": write_full_models(lora_models, size)}
    data = workdir / "data"
    write_synthetic_dataset(data, count=1, size=CLIP["side"], seed=0, videos=["video"], frames=CLIP["frames"])
    cache = workdir / "cache"
    stage1 = {k: v for k, v in flags(lora_models, data, "lora", steps).items() if k != "dataset_repeat"}
    stages.run(make_args(task="sft:data_process", output_path=str(cache),
                         dataset_metadata_path=str(data / "metadata.csv"), **stage1), echo=lambda _t: None)
    (workdir / "ds_z3.json").write_text(json.dumps(Z3))
    (workdir / "ds_z3_offload.json").write_text(json.dumps(Z3_OFFLOAD))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env["OMP_NUM_THREADS"] = "1"
    rows = []
    for mode in modes:
        for engine, _ in ENGINES:
            name = f"{mode}-{engine}".replace(" ", "_").replace("+", "")
            config = workdir / f"{name}.yaml"
            config.write_text(config_text(engine))
            out = workdir / name
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
                   "2", "--main_process_port", "0", __file__, "--child", mode, "--models", str(folders[mode]), "--cache", str(cache), "--out",
                   str(out), "--steps", str(steps)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
            if done.returncode != 0:  # the row says so; the other engines are still measured
                error = ("killed (SIGKILL: out of host memory)" if "SIGKILL" in done.stderr
                         else f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
                rows.append({"mode": mode, "engine": engine, "error": error})
                print(f"{name}: {error}\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
                continue
            ranks = [json.loads((workdir / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
            rows.append({"mode": mode, "engine": engine, "ranks": ranks})
            print(f"{name}: {ranks}", file=sys.stderr, flush=True)
    return rows


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def report(rows: list[dict[str, Any]], size: str, steps: int) -> str:
    lines = [
        f"Measured with `python benchmarks/engines.py --size {size} --steps {steps} --write` on {os.cpu_count()} CPU "
        f"cores, 2 processes of 1 thread, {installed_versions(('torch', 'accelerate', 'deepspeed', 'diffusers'))}. "
        "Wan 2.1 T2V 1.3B's DiT with random bf16 weights: LoRA rank 32 on the whole DiT (1.42 B frozen parameters), "
        f"and full training of the same widths with {FULL_BLOCKS} of the 30 blocks; stage 2 at "
        f"{'bf16' if precision() == 'bf16' else 'fp32 (this CPU has no bf16 kernels)'} from one stage-1 "
        f"cache, {CLIP['frames']}-frame {CLIP['side']}x{CLIP['side']} clips, {steps} steps a process. *Held* counts "
        "the process's own tensors after its first step (weights, and the optimizer's moments and fp32 copies), "
        "the larger of the two processes; *x DP* is that over data parallel's. *Steady RSS* is the resident set "
        "above the process's baseline during the steps (offloaded state included: the CPU is this machine's device). "
        "The dry run is stage 2's per-process peak for the same flags under the same engine.",
        "",
        "| training | engine | held: weights + optimizer (GiB) | x DP | steady RSS (GiB) | dry run (GiB) | step (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        group = [r for r in rows if r["mode"] == mode]
        dp = max(sum(x["held"]) for x in group[0]["ranks"]) if "ranks" in group[0] else None
        for r in group:
            what = "LoRA r32" if mode == "lora" else f"full ({FULL_BLOCKS} blocks)"
            if "ranks" not in r:
                lines.append(f"| {what} | {r['engine']} | {r['error']} | - | - | - | - |")
                continue
            held = max(sum(x["held"]) for x in r["ranks"])
            steady = max(x["steady"] - x["baseline"] for x in r["ranks"])
            step = statistics.median(x["step_s"] for x in r["ranks"] if x["step_s"])
            est = r["ranks"][0]["estimate"]
            ratio = f"{held / dp:.2f}" if dp else "-"
            lines.append(f"| {what} | {r['engine']} | {_gib(held)} | {ratio} | {_gib(steady)} | {_gib(est)} | "
                         f"{step:.2f} |")
    lines += ["", "Target (issue #36): at 2 processes the per-process bytes of weights plus trainable state under "
              "ZeRO-3 and FSDP2 are at most 0.55x data parallel's."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("real", "test"), default="real")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="lora,full")
    parser.add_argument("--write", action="store_true", help=f"replace this benchmark's section of {DOC.name}")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child is not None:
        child(opts.models, opts.cache, opts.out, opts.child, opts.steps)
        return 0
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        rows = measure(opts.size, opts.steps, Path(tmp), opts.only.split(","))
    text = report(rows, opts.size, opts.steps)
    print(text)
    if opts.write:
        write_section(DOC, BEGIN, END, TITLE, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A real-size denoiser on this CPU: stage-2 LoRA steps of Wan 2.1 T2V 1.3B at fp32, bf16 and bf16 + fp8 storage.

The DiT is Wan 2.1 T2V 1.3B's published config (1.42 B parameters) with random weights stored in bf16, as a
diffusers `transformer/` folder; the VAE and the text encoder are tiny stand-ins of the right widths (stage 2
never loads them, and stage 1 only has to give the DiT inputs of the real shapes: 16 latent channels, 4096-wide
text embeddings over Wan's 512 text positions). Each setting (precision x gradient checkpointing) trains from
its cache in a process of its own: `sft:train` through `stages.run`, a few LoRA steps on 5-frame 64x64 clips.

Measured per setting: the process's resident memory sampled every 20 ms from /proc (before the models load,
the baseline; during the steps after the first, the steady value; the peak of the steps), the median step time,
and the dry run's stage-2 estimate for the same flags beside the measurement (memory above the baseline).

    python benchmarks/real_size.py [--size real|test] [--steps 3] [--write]

`--size test` runs the same code on the tiny test-size DiT (seconds; the suite's smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import installed_versions, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- real-size:begin -->", "<!-- real-size:end -->"
TITLE = "## A real-size DiT on this CPU: Wan 2.1 T2V 1.3B, stage-2 LoRA at fp32, bf16 and fp8 storage"
# (name, --mixed_precision, --fp8_models, --use_gradient_checkpointing)
SETTINGS = [
    ("fp32", "no", None, False), ("fp32 + ckpt", "no", None, True),
    ("bf16", "bf16", None, False), ("bf16 + ckpt", "bf16", None, True),
    ("bf16 + fp8", "bf16", "dit", False), ("bf16 + fp8 + ckpt", "bf16", "dit", True),
]
CLIP = {"side": 64, "frames": 5}  # 2 latent frames of 8 x 8: 32 image tokens after the 2x2 patches
GIB = 1 << 30


def real_dit_config() -> dict[str, Any]:
    """Wan 2.1 T2V 1.3B's published transformer config (families/wan/real.py), as the class takes it."""
    from unitgraph.backends.diffusion.families.wan.real import TRANSFORMER_1_3B

    config = {k: v for k, v in TRANSFORMER_1_3B.items() if not k.startswith("_")}
    return dict(config, patch_size=tuple(config["patch_size"]))


def write_models(folder: Path, size: str) -> Path:
    """Demo-size tiny Wan models, with the real DiT (random weights, stored bf16) and a text encoder 4096 wide."""
    import torch
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from unitgraph.backends.diffusion.families.wan.tiny import write_tiny_models

    root = write_tiny_models(folder, size="demo", seed=0, pipeline="wan")
    if size == "test":
        return write_tiny_models(folder.parent / "test-models", size="test", seed=0, pipeline="wan")
    config = real_dit_config()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 1.4 B parameters
    try:
        torch.manual_seed(0)
        dit = WanTransformer3DModel(**config)
    finally:
        torch.set_default_dtype(previous)
    dit.save_pretrained(root / "transformer", safe_serialization=True)
    del dit
    te = UMT5EncoderModel.from_pretrained(root / "text_encoder")
    cfg = te.config.to_dict()
    cfg.update(d_model=config["text_dim"], d_kv=64, num_heads=4, d_ff=256, num_layers=1)
    torch.manual_seed(1)
    UMT5EncoderModel(UMT5Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
                     ).save_pretrained(root / "text_encoder")
    return root


def flags(models: Path, data: Path, setting: tuple, steps: int) -> dict[str, Any]:
    _, mixed, fp8, ckpt = setting
    return dict(pipeline="wan", model_paths=str(models), dataset_base_path=str(data), height=CLIP["side"],
                width=CLIP["side"], num_frames=CLIP["frames"], lora_base_model="dit", lora_rank=32,
                mixed_precision=mixed, fp8_models=fp8, use_gradient_checkpointing=ckpt, seed=0,
                learning_rate=1e-4, progress=False, plot=False, dataset_repeat=steps)


class RssSampler:
    """VmRSS of this process every 20 ms, in a thread, with the times of the marks set by the caller."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0  # pragma: no cover - /proc without VmRSS

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.rss()))
            time.sleep(0.02)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[int]:
        return [rss for t, rss in self.samples if start <= t <= end]


def child(models: Path, cache: Path, out: Path, setting_index: int, steps: int) -> dict[str, Any]:
    """One stage-2 run in this process: memory and step times, and the dry run for the same flags."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.session import plan_for
    from unitgraph.backends.diffusion.train import loop

    setting = SETTINGS[setting_index]
    kwargs = flags(models, cache, setting, steps)
    args = make_args(task="sft:train", output_path=str(out), **kwargs)
    estimate = None
    try:
        from unitgraph.backends.diffusion.memory_plan import memory_plan

        cfg = RunConfig.from_args(args)
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
        started = time.perf_counter()
        result = stages.run(args, echo=lambda _t: None)
        ended = time.perf_counter()
    loop.micro_step = real_step
    steps_rss = sampler.between(marks[0], ended) if marks else []
    steady = sampler.between(marks[1], ended) if len(marks) > 1 else steps_rss
    return {"setting": setting[0], "baseline": baseline, "peak": max(steps_rss or [baseline]),
            "load_peak": max(sampler.between(started, marks[0] if marks else ended) or [baseline]),
            "steady": int(statistics.median(steady)) if steady else baseline,
            "step_s": result.median_step_s, "steps": result.steps, "estimate": estimate}


def measure(size: str, steps: int, workdir: Path, only: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """A row per setting (those named in `only`, else all): each a stage-2 run in a process of its own."""
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    models = write_models(workdir / "models", size)
    data = workdir / "data"
    write_synthetic_dataset(data, count=1, size=CLIP["side"], seed=0, videos=["video"], frames=CLIP["frames"])
    caches = {}
    for mixed in ("no", "bf16"):  # the precision is part of the cache key: one cache each
        caches[mixed] = workdir / f"cache-{mixed}"
        stage1 = {k: v for k, v in flags(models, data, ("", mixed, None, False), steps).items() if k != "dataset_repeat"}
        stages.run(make_args(task="sft:data_process", output_path=str(caches[mixed]),
                             dataset_metadata_path=str(data / "metadata.csv"), **stage1), echo=lambda _t: None)
    rows = []
    for index, setting in enumerate(SETTINGS):
        if only is not None and setting[0] not in only:
            continue
        out = workdir / f"train-{index}"
        cmd = [sys.executable, __file__, "--child", str(index), "--models", str(models), "--cache",
               str(caches[setting[1]]), "--out", str(out), "--steps", str(steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        if done.returncode != 0:
            raise RuntimeError(f"{setting[0]} failed: {done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{setting[0]}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def report(rows: list[dict[str, Any]], size: str, steps: int) -> str:
    fp32 = next(r for r in rows if r["setting"] == "fp32")
    above = lambda r, key: r[key] - r["baseline"]  # noqa: E731
    lines = [
        f"Measured with `python benchmarks/real_size.py --size {size} --steps {steps} --write` on {os.cpu_count()} "
        f"CPU cores, {installed_versions(('torch', 'diffusers', 'peft'))}. The DiT is Wan 2.1 T2V 1.3B's published "
        "config with random weights stored bf16; stage 2 (`sft:train`) runs LoRA rank 32 on its default targets over "
        f"{CLIP['frames']}-frame {CLIP['side']}x{CLIP['side']} clips (32 image tokens, 512 text positions), batch 1, "
        "each setting in a process of its own. Memory is the process's resident set (VmRSS, sampled every 20 ms): "
        "*above baseline* subtracts what the process held before loading the model (Python, torch, the libraries). "
        "*Steady* is the median over the steps after the first, *peak* the maximum during the steps; the dry run's "
        "stage-2 peak for the same flags stands beside them.",
        "",
        "| setting | steady above baseline (GiB) | x fp32 | peak above baseline (GiB) | dry run (GiB) | dry run / peak "
        "| step (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        # a tiny model can leave the resident set where it was: no ratio then, rather than a division by zero
        ratio = f"{above(r, 'steady') / above(fp32, 'steady'):.2f}" if above(fp32, "steady") > 0 else "-"
        est = r["estimate"]
        err = f"{est / above(r, 'peak'):.2f}" if est and above(r, "peak") > 0 else "-"
        lines.append(f"| {r['setting']} | {_gib(above(r, 'steady'))} | {ratio} | {_gib(above(r, 'peak'))} | "
                     f"{_gib(est)} | {err} | {r['step_s']:.1f} |")
    base = statistics.median(r["baseline"] for r in rows)
    lines += ["", f"The baseline was {_gib(base)} GiB in every process (median). Targets: bf16 steady <= 0.55x fp32, "
              "bf16 + fp8 <= 0.35x fp32; dry run within 15% of the measured peak."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("real", "test"), default="real")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--write", action="store_true", help=f"replace this benchmark's section of {DOC.name}")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child is not None:
        print(json.dumps(child(opts.models, opts.cache, opts.out, opts.child, opts.steps)))
        return 0
    with tempfile.TemporaryDirectory(prefix="real-size-") as tmp:
        rows = measure(opts.size, opts.steps, Path(tmp))
    text = report(rows, opts.size, opts.steps)
    print(text)
    if opts.write:
        write_section(DOC, BEGIN, END, TITLE, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

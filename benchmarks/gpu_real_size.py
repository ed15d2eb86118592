"""Real-size models on one CUDA device: accelerator memory and step time of stage 2 and the unsplit run, per setting.

For each family (Qwen-Image and FLUX.1-dev at 1024x1024, Wan 2.1 14B at 832x480 x 81 frames), the released
configs (`unitgraph tiny-models DIR --size real`) get random weights, made on the device in bf16 and saved as
the diffusers folder the real loader reads; the tokenizers come from the tiny models (any ids below the real
vocabularies do). One sample; stage 1 once; then each setting in a process of its own:

    bf16 | bf16 + fp8 DiT | + gradient checkpointing | DiffSynth's low-VRAM split setting (ZeRO-3 with CPU offload
    of the weights and the optimizer on one GPU, its deepspeed_zero3_cpuoffload config, checkpointing)
    | + blocks_to_swap (half the DiT's blocks)

for stage 2 (`sft:train` from the cache) and, for the first and the third setting, the unsplit run (`sft`,
every model resident). Each row gives torch.cuda.max_memory_allocated over the steps, the median step time,
and the dry run's estimate for the same flags (`--dry_run`). The whole run stops adding rows after
`--budget` seconds (default 600) and says which it did not reach.

    python benchmarks/gpu_real_size.py [--families qwen_image,flux,wan] [--budget 600] [--out results.json]

Without CUDA it runs the same code at the `test` size on the CPU (peak memory then reads "-"): the suite's
smoke test does that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
# family -> (pipeline, image or clip flags at the real size)
RUNS = {
    "qwen_image": ("qwen_image", {"height": 1024, "width": 1024}),
    "flux": ("flux", {"height": 1024, "width": 1024}),
    "wan": ("wan", {"height": 480, "width": 832, "num_frames": 81}),
}
TEST_SIZE = {"height": 32, "width": 32, "num_frames": 5}


def settings(blocks: int) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, flags, also the unsplit run) per setting; `blocks` = the DiT's transformer blocks."""
    fp8 = {"mixed_precision": "bf16", "fp8_models": "dit"}
    ckpt = {**fp8, "use_gradient_checkpointing": True}
    low_vram = {"mixed_precision": "bf16", "use_gradient_checkpointing": True, LAUNCH: "zero3_cpuoffload"}
    return [
        ("bf16", {"mixed_precision": "bf16"}, True),
        ("bf16 + fp8", fp8, False),
        ("bf16 + fp8 + ckpt", ckpt, True),
        ("bf16 + ckpt, ZeRO-3 CPU offload (low-VRAM)", low_vram, False),
        (f"bf16 + fp8 + ckpt + swap {blocks // 2}", {**ckpt, "blocks_to_swap": blocks // 2}, False),
    ]


LAUNCH = "_launch"  # a setting run under `accelerate launch --config_file` with this config (one process)
# DiffSynth's examples/qwen_image/model_training/special/low_vram_training/ds_z3_cpuoffload.json, in short
ZERO3_CPUOFFLOAD = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": False,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 5e7,
                          "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                          "stage3_max_live_parameters": 1e8, "stage3_max_reuse_distance": 1e8},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def launch_config(name: str, workdir: Path) -> Path:
    """The accelerate config of a launched setting, with its DeepSpeed json beside it."""
    (workdir / f"{name}.json").write_text(json.dumps(ZERO3_CPUOFFLOAD))
    config = workdir / f"{name}.yaml"
    config.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {workdir / name}.json\n"
                      "  zero3_init_flag: true\nnum_machines: 1\nnum_processes: 1\nuse_cpu: false\n")
    return config


def materialize(folder: Path, device: str) -> None:
    """Random weights for every model component of a config-only diffusers folder, saved where the loader reads."""
    import torch

    index = json.loads((folder / "model_index.json").read_text())
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2:
            continue
        sub = folder / name
        config = sub / "config.json"
        if not config.is_file() or any(sub.glob("*.safetensors")):
            continue
        library, class_name = spec
        cls = getattr(__import__(library, fromlist=[class_name]), class_name)
        with torch.device(device):
            torch.set_default_dtype(torch.bfloat16)
            try:
                if library == "diffusers":
                    model = cls.from_config(cls.load_config(str(sub)))
                else:
                    from transformers import AutoConfig

                    model = cls._from_config(AutoConfig.from_pretrained(str(sub)))
            finally:
                torch.set_default_dtype(torch.float32)
        model.save_pretrained(str(sub), safe_serialization=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def model_folder(family: str, pipeline: str, size: str, workdir: Path, device: str) -> Path:
    """The family's folder at `size`: the tiny test models, or the released configs with random weights."""
    from unitgraph.backends.diffusion.registry import family as family_named

    fam = family_named(family)
    tiny = fam.tiny_module().write_tiny_models(workdir / f"{family}-tiny", size="test", seed=0, pipeline=pipeline)
    if size == "test":
        return tiny
    real = workdir / f"{family}-real"
    subprocess.run([sys.executable, "-m", "unitgraph.cli.app", "tiny-models", str(real), "--pipeline", pipeline,
                    "--size", "real"], check=True, capture_output=True)
    for sub in tiny.iterdir():  # tokenizers and processors from the tiny models
        if sub.is_dir() and not (real / sub.name / "config.json").is_file() and not (real / sub.name).exists():
            import shutil

            shutil.copytree(sub, real / sub.name)
    materialize(real, device)
    return real


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: peak accelerator memory, step times and the dry run's estimate."""
    import torch

    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.args import make_args

    cuda = torch.cuda.is_available()
    estimate = None
    try:
        plan = stages.run(make_args(**spec, dry_run=True), echo=lambda _t: None).memory_plan
        estimate = plan["stages"]["train" if spec["task"].endswith(":train") else "unsplit"]["peak_bytes"]
    except Exception as exc:  # noqa: BLE001 - the measurement goes on without an estimate
        print(f"dry run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = stages.run(make_args(**spec), echo=lambda _t: None)
    return {"peak": torch.cuda.max_memory_allocated() if cuda else None, "step_s": result.median_step_s,
            "steps": result.steps, "estimate": estimate}


def run_child(spec: dict[str, Any], workdir: Optional[Path] = None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child"]
    if LAUNCH in spec:  # under accelerate launch with the setting's engine config
        spec = dict(spec)
        config = launch_config(spec.pop(LAUNCH), workdir or Path(spec["output_path"]).parent)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
                   "1", "--main_process_port", "0", __file__, "--child"]
    done = subprocess.run([*command, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": "OOM" if "OutOfMemory" in done.stderr else tail[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(families: list[str], budget: float, workdir: Path, only: Optional[list[str]] = None,
            precision: str = "bf16") -> list[dict[str, Any]]:
    """A row per family, setting (those named in `only`, else all) and run, each run in a process of its own.
    `precision` replaces the settings' bf16 (the suite's smoke test on a CPU without bf16 kernels, where bf16 is
    emulated tens of times slower, runs the same code at "no")."""
    import torch

    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = "real" if device == "cuda" else "test"
    start, rows = time.perf_counter(), []
    for family in families:
        if time.perf_counter() - start > budget:  # not even its models are made
            rows.append({"family": family, "setting": "every setting", "stage": "-", "error": "not run (time budget)"})
            continue
        pipeline, shape = RUNS[family]
        shape = shape if size == "real" else {k: v for k, v in TEST_SIZE.items() if k in shape}
        models = model_folder(family, pipeline, size, workdir, device)
        data = workdir / f"{family}-data"
        videos = ["video"] if "num_frames" in shape else []
        write_synthetic_dataset(data, count=1, size=max(shape["height"], shape["width"]), seed=0, videos=videos,
                                frames=shape.get("num_frames", 5))
        common = dict(pipeline=pipeline, model_paths=str(models), lora_base_model="dit", lora_rank=32, seed=0,
                      progress=False, plot=False, **shape)
        cache = workdir / f"{family}-cache"
        stages.run(make_args(task="sft:data_process", output_path=str(cache), dataset_base_path=str(data),
                             dataset_metadata_path=str(data / "metadata.csv"), mixed_precision=precision, **common),
                   echo=lambda _t: None)
        blocks = json.loads((models / "transformer" / "config.json").read_text()).get("num_layers", 2)
        for name, extra, unsplit in settings(int(blocks)):
            if only is not None and name not in only:
                continue
            runs = [("stage 2", dict(task="sft:train", dataset_base_path=str(cache), dataset_repeat=3))]
            if unsplit:
                runs.append(("unsplit", dict(task="sft", dataset_base_path=str(data), dataset_repeat=3,
                                             dataset_metadata_path=str(data / "metadata.csv"))))
            extra = {**extra, "mixed_precision": precision}
            for stage, task in runs:
                row = {"family": family, "setting": name, "stage": stage}
                if time.perf_counter() - start > budget:
                    rows.append({**row, "error": "not run (time budget)"})
                    continue
                out = workdir / f"out-{len(rows)}"
                rows.append({**row, **run_child({**common, **task, **extra, "output_path": str(out)}, workdir)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    gib = lambda n: "-" if n is None else f"{n / GIB:.2f}"  # noqa: E731
    lines = ["| family | setting | run | max allocated (GiB) | dry run (GiB) | step (s) |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['setting']} | {r['stage']} | {r['error']} | - | - |")
        else:
            step = "-" if r["step_s"] is None else f"{r['step_s']:.2f}"
            lines.append(f"| {r['family']} | {r['setting']} | {r['stage']} | {gib(r['peak'])} | {gib(r['estimate'])} "
                         f"| {step} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(RUNS))
    parser.add_argument("--budget", type=float, default=600.0, help="seconds; later rows are not run")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        print(json.dumps(child(json.loads(opts.child))))
        return 0
    families = [f for f in opts.families.split(",") if f]
    unknown = [f for f in families if f not in RUNS]
    if unknown:
        parser.error(f"unknown families: {', '.join(unknown)} (known: {', '.join(RUNS)})")
    with tempfile.TemporaryDirectory(prefix="gpu-real-size-") as tmp:
        rows = measure(families, opts.budget, Path(tmp))
    print(table(rows))
    if opts.out:
        opts.out.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    steps = [r["step_s"] for r in rows if r.get("step_s")]
    print(f"{len(rows)} rows, median step {statistics.median(steps):.2f} s" if steps else f"{len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What splitting buys on this CPU: unsplit vs stage 2 vs the denoiser alone, memory, batch size, cache size.

For one pipeline's tiny models (`--pipeline`, default qwen_image) at its sizes (`test`, `demo`, and for
Qwen-Image `balanced`, where the frozen encoders cost about as much as a denoiser step), one run measures,
alternating the configurations and repeating them, each configuration in its own process:

  stage1   `sft:data_process` (stages.run): seconds per sample, peak RSS
  unsplit  one `sft` step (stages.run): encoders + denoiser + backward + AdamW, images read each step
  train    one `sft:train` step (stages.run) from the cache, every entry read from disk
  loader   the same step fed by backends/diffusion/train/executor.py in a bare loop (entries read and the
           model-free train units run in the loop, and in a prefetch thread); then samples/s at
           --batch_size 1, 4, 8
  limit    the same denoiser step on sink inputs already in memory: the floor for stage 2; then
           the loss and size of the cache with floating tensors stored as bf16 / fp16 / fp32

plus the whole-process time of `unitgraph plan diffusion:<pipeline> --lora-base-model dit`.
Timings are medians over windows of executor.SYNC_RUN steps of each window's mean (the first window of a
process left out; see step_median) and over repeats; peak RSS
is the process's VmHWM. With --write the results replace the pipeline's split-vs-unsplit section of
docs/benchmarks.md and its plot (docs/img/benchmark_split_vs_unsplit[_<pipeline>].png); both are rendered by
benchmarks/split_vs_unsplit_report.py.

    python benchmarks/split_vs_unsplit.py [--pipeline flux] [--sizes test,demo,balanced] [--repeats 3] [--write] [--workdir DIR]
    python benchmarks/split_vs_unsplit.py --from-results DIR/results.json --write   # re-render only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import step_median  # noqa: E402
from unitgraph.backends.diffusion.train.executor import SYNC_RUN  # noqa: E402  (no torch import: a constant)

# The `balanced` size: demo's VAE at 256 px, a wider text encoder and a 16-layer DiT, chosen so that
# encoding one sample (VAE + text) costs about one DiT LoRA step on this CPU (~0.23 s each).
BALANCED_EXTRA = {
    "description": "DiT 16 layers x 4 heads x 64, VAE /8 z_dim 16 (narrow), text hidden 512 x 8 layers",
    "transformer": {"num_layers": 16, "joint_attention_dim": 512},
    "text": {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
             "num_key_value_heads": 4, "mrope_section": [8, 12, 12]},
}

# Per size: tiny model size, image side, dataset samples, dataset_repeat of the unsplit and stage-2 runs
# (stage 2: enough steps for several windows of SYNC_RUN steps after the first), steps of the batch-size
# sweep for B = 1, 4, 8.
SIZES: dict[str, dict[str, Any]] = {
    "test": {"tiny": "test", "px": 64, "samples": 16, "unsplit_repeat": 2, "train_repeat": 4, "sweep_steps": [24, 10, 6],
             "train_rounds": 6},
    "demo": {"tiny": "demo", "px": 256, "samples": 8, "unsplit_repeat": 1, "train_repeat": 4, "sweep_steps": [6, 3, 2]},
    "balanced": {"tiny": "balanced", "px": 256, "samples": 6, "unsplit_repeat": 1, "train_repeat": 4, "sweep_steps": [4, 2, 1]},
}
# Video pipelines (Wan): clips of 17 frames (5 latent frames), at smaller sides than the image sizes.
VIDEO_SIZES = {"test": {"px": 64, "frames": 17}, "demo": {"px": 128, "frames": 17}}
CHUNK = 8  # the loader configuration alternates with in-memory steps every CHUNK steps (a multiple of SYNC_RUN)
LOADER_CHUNKS = 4  # ... over at least this many chunks of each
CONFIGS = ("stage1", "unsplit", "train", "loader", "limit")
ROUNDED = tuple(size for size, s in SIZES.items() if s.get("train_rounds"))  # sizes whose train runs come in rounds
BATCH_SIZES = (1, 4, 8)
CACHE_DTYPES = ("float32", "bfloat16", "float16")
# LoRA on the family's denoiser (its first model slot: `dit`, a UNet family's `unet`), its default targets
# (DiffSynth's)
LORA = {"lora_rank": 32}
SEED = 0


# ------------------------------------------------------------------------------------------------
# helpers shared by the parent and the child processes


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM)."""
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def median(values: list[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def paths(workdir: Path, size: str) -> dict[str, Path]:
    base = Path(workdir) / size
    return {"base": base, "models": base / "models", "data": base / "data", "cache": base / "cache"}


def load_settings(workdir: Path) -> dict[str, Any]:
    return json.loads((Path(workdir) / "settings.json").read_text())


DEFAULT_PIPELINE = "qwen_image"


def chosen_pipeline(workdir: Path) -> tuple[Any, Any]:
    """(family, pipeline) the run measures (settings.json's `pipeline`)."""
    from unitgraph.backends.diffusion.registry import find_pipeline

    return find_pipeline(load_settings(workdir).get("pipeline", DEFAULT_PIPELINE))


def train_args(workdir: Path, size: str, task: str, output: Path, **extra: Any):
    from unitgraph.backends.diffusion.args import make_args

    settings = load_settings(workdir)
    s = settings["sizes"][size]
    p = paths(workdir, size)
    family, pipeline = chosen_pipeline(workdir)
    extra.setdefault("lora_base_model", family.model_slots[0])
    extras = [c for c in pipeline.required if c not in ("image", "prompt", *pipeline.video_params)]
    if extras:
        extra.setdefault("extra_inputs", ",".join(extras))
    if "frames" in s:
        extra.setdefault("num_frames", s["frames"])
    kwargs = dict(task=task, pipeline=pipeline.name, dataset_base_path=str(p["data"]), dataset_metadata_path=str(p["data"] / "metadata.csv"),
                  model_paths=str(p["models"]), height=s["px"], width=s["px"], seed=SEED, learning_rate=1e-4,
                  output_path=str(output), progress=False, plot=False, mixed_precision="no", **LORA)
    kwargs.update(extra)
    return make_args(**kwargs)


def _quiet(_text: str) -> None:
    pass


# ------------------------------------------------------------------------------------------------
# child processes: one configuration each


def child_prepare(workdir: Path, size: str) -> dict[str, Any]:
    """Models, dataset and the cache the stage-2 configurations train from."""
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.stages import run

    s = load_settings(workdir)["sizes"][size]
    p = paths(workdir, size)
    family, pipeline = chosen_pipeline(workdir)
    tiny = family.tiny_module()
    if s["tiny"] == "balanced" and "balanced" not in tiny.SIZES:  # Qwen-Image's (see BALANCED_EXTRA)
        config = copy.deepcopy(tiny.SIZES["demo"])
        config["description"] = BALANCED_EXTRA["description"]
        for part in ("transformer", "text"):
            config[part].update(BALANCED_EXTRA[part])
        tiny.SIZES["balanced"] = config
    tiny.write_tiny_models(p["models"], size=s["tiny"], seed=SEED, pipeline=pipeline.name)
    images = [c for c in pipeline.image_params if c in pipeline.required and c != "image"]
    videos = [c for c in pipeline.video_params if c in pipeline.required]
    write_synthetic_dataset(p["data"], count=s["samples"], size=s["px"], seed=1, images=images, videos=videos,
                            frames=s.get("frames", 1))
    run(train_args(workdir, size, "sft:data_process", p["cache"]), echo=_quiet)
    return {"description": tiny.SIZES[s["tiny"]]["description"]}


def child_stage1(workdir: Path, size: str, out: Path, rep: int) -> dict[str, Any]:
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.cache import cache

    # Time each sample by the gaps between successive entry writes (Cache.store_entry, wrapped here:
    # production code has no timing hook).
    stamps: list[float] = []
    depth = [0]

    def stamped(original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # one stamp per entry, however the writers nest
                    stamps.append(time.perf_counter())

        return timed

    cache.Cache.store_entry = stamped(cache.Cache.store_entry)
    result = stages.run(train_args(workdir, size, "sft:data_process", out), echo=_quiet)
    total = result.stage_times["data_process"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"per_sample_s": median(gaps) if gaps else total / max(1, result.samples), "total_s": total,
            "samples": result.samples, "rss": peak_rss_bytes(), "method": "entry-write gaps" if gaps else "total / samples"}


def child_unsplit(workdir: Path, size: str, out: Path, rep: int) -> dict[str, Any]:
    from unitgraph.backends.diffusion.stages import run

    s = load_settings(workdir)["sizes"][size]
    result = run(train_args(workdir, size, "sft", out, dataset_repeat=s["unsplit_repeat"]), echo=_quiet)
    return {"step_s": step_median(result.step_times), "steps": result.steps, "rss": peak_rss_bytes()}


def child_train(workdir: Path, size: str, out: Path, rep: int) -> dict[str, Any]:
    """stages.run on `sft:train`, paired with the same steps on inputs in memory in the same process.

    At sizes with a `train_rounds` setting (`test`, whose whole run lasts about half a second, as short
    as a burst of another process's work) the first run only warms the process up (and gives the peak
    RSS); then the in-memory steps and `train_rounds` more runs alternate, L T L T ... L, and each run
    is compared with the mean of the in-memory passes on either side of it (which cancels a slow drift
    of the machine's speed); the ratio is the median of those. Without the setting: one run, then one
    in-memory pass.
    """
    from unitgraph.backends.diffusion import stages

    s = load_settings(workdir)["sizes"][size]
    # Read every entry from disk at every step (as with a cache too big to keep in memory).
    stages.KEEP_IN_MEMORY_BYTES = 0
    args = train_args(workdir, size, "sft:train", out, dataset_base_path=str(paths(workdir, size)["cache"]),
                      dataset_metadata_path=None, dataset_repeat=s["train_repeat"])
    steps: list[int] = []

    def train() -> float:
        shutil.rmtree(out, ignore_errors=True)  # each run trains afresh into the same folder
        result = stages.run(args, echo=_quiet)
        steps.append(result.steps)
        return step_median(result.step_times)

    first = train()
    rss = peak_rss_bytes()  # stages.run alone: before the in-memory stage below loads its own copy
    stage = Stage2(workdir, size, out)
    data = stage.data(batch_size=1, keep_in_memory=True)
    inputs = [b.inputs for b in data.iterate(0, stage.ctx, prefetch=0)]
    limits = [step_median(stage.timed_memory(inputs))]
    rounds = s.get("train_rounds", 0)
    trained = [] if rounds else [first]
    for _ in range(rounds):
        trained.append(train())
        limits.append(step_median(stage.timed_memory(inputs)))
    paired = [statistics.fmean(limits[k:k + 2]) for k in range(len(trained))] if rounds else limits
    ratios = [a / b for a, b in zip(trained, paired)]
    return {"step_s": median(trained), "steps": steps[0], "rss": rss, "paired_limit_s": median(paired),
            "paired_ratio": median(ratios), "round_ratios": ratios, "first_run_ratio": first / limits[0],
            "threads": _threads()}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


class Stage2:
    """Stage 2 set up as stages.run_training sets it up: the DiT with LoRA, AdamW, accelerate."""

    def __init__(self, workdir: Path, size: str, out: Path):
        import torch

        import unitgraph
        from unitgraph.backends.diffusion.config import RunConfig
        from unitgraph.backends.diffusion.models.lora import add_lora
        from unitgraph.backends.diffusion.models.stage import load_models, make_context
        from unitgraph.backends.diffusion.session import make_accelerator
        from unitgraph.backends.diffusion.train.loop import draws_dropout

        self.settings = load_settings(workdir)["sizes"][size]
        self.cache = paths(workdir, size)["cache"]
        self.args = args = train_args(workdir, size, "sft:train", out, dataset_base_path=str(self.cache),
                                      dataset_metadata_path=None, dataset_repeat=self.settings["train_repeat"])
        self.cfg = cfg = RunConfig.from_args(args)
        self.family, self.pipeline = chosen_pipeline(workdir)
        self.denoiser = denoiser = self.family.model_slots[0]
        self.plan = unitgraph.split(self.pipeline.spec_pipeline, lora_base_model=denoiser)
        self.accelerator = make_accelerator(cfg)
        device = self.accelerator.device
        # the DiT and the scheduler, frozen, in eval mode, on the device
        models = load_models(cfg, self.plan.train_models, training=True, device=device)
        dit = models[denoiser]
        add_lora(dit, denoiser, list(cfg.lora.targets), cfg.lora.rank, cfg.lora.alpha, cfg.seed)
        dit.train()
        params = [p for p in dit.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.learning_rate, weight_decay=cfg.optim.weight_decay)
        models[denoiser] = self.accelerator.prepare(dit)
        self.optimizer = self.accelerator.prepare(optimizer)
        self.ctx = make_context(cfg, models, device)
        self.sink = self.pipeline.loss

        self.seeded = draws_dropout(models)  # as training.run_training: the dropout stream only when a model has dropout

    def data(self, batch_size: int = 1, keep_in_memory: bool = False, repeat: Optional[int] = None):
        from unitgraph.backends.diffusion.train.executor import Stage2Data

        return Stage2Data.from_cache(self.pipeline, self.plan, self.cache, seed=self.cfg.seed, batch_size=batch_size,
                                     dataset_repeat=repeat or self.settings["train_repeat"], pad=self.family.pad,
                                     keep_in_memory=keep_in_memory)

    def step(self, inputs: dict[str, Any], epoch: Optional[int] = None, sample_key: Optional[str] = None) -> float:
        """One optimizer step on one (micro-)batch; seeded dropout stream as training.run_training does (when a model has dropout)."""
        import contextlib

        from unitgraph.backends.diffusion.randomness import seeded_global_stream

        seeded = (contextlib.nullcontext() if epoch is None or not self.seeded
                  else seeded_global_stream(self.cfg.seed, "dropout", epoch, sample_key))
        with seeded:
            loss = self.sink(self.ctx, inputs)
            self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def timed_memory(self, inputs: list[dict[str, Any]], epoch: Optional[int] = None,
                     keys: Optional[list[str]] = None) -> list[float]:
        """Step times on sink inputs already in memory (the limit: no seeded dropout stream unless keys are given)."""
        times: list[float] = []
        last = time.perf_counter()
        for n, values in enumerate(inputs):
            self.step(values, epoch, None if keys is None else keys[n])
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times

    def timed_epoch(self, data: Any, epoch: int = 0, max_steps: Optional[int] = None, full_only: bool = False,
                    batches: Optional[list] = None, prefetch: Optional[int] = None) -> list[float]:
        """Step times (end of one step to the end of the next) over one epoch of `data`."""
        times: list[float] = []
        last = time.perf_counter()
        for n, batch in enumerate(data.iterate(epoch, self.ctx, prefetch=prefetch, batches=batches)):
            if max_steps is not None and n >= max_steps:
                break
            self.step(batch.inputs, epoch, batch.sample_keys[0])
            now = time.perf_counter()
            if not full_only or len(batch) == data.batch_size:
                times.append(now - last)
            last = now
        return times


def child_loader(workdir: Path, size: str, out: Path, rep: int) -> dict[str, Any]:
    """Stage 2 through executor.py (Stage2Data), the batches prepared in the loop when asked for, SYNC_RUN at
    a time (`sync`, the CPU default), and up to two batches ahead in a thread (`thread`), alternating every
    CHUNK steps with the same steps from memory; then samples/s at B = 1, 4, 8."""
    stage = Stage2(workdir, size, out)
    # at least LOADER_CHUNKS chunks of each mode (a few samples at the larger sizes: repeat them)
    repeat = max(stage.settings["train_repeat"], -(-LOADER_CHUNKS * CHUNK // stage.settings["samples"]))
    data = stage.data(batch_size=1, repeat=repeat)
    batches = data.batches(0)
    memory = stage.data(batch_size=1, keep_in_memory=True, repeat=repeat)
    inputs = [b.inputs for b in memory.iterate(0, stage.ctx, prefetch=0)]
    times: dict[str, list[float]] = {"sync": [], "thread": [], "limit": []}
    modes = list(times)
    # untimed warm-up of every mode: a process's first steps carry one-off costs (allocations, kernel set-up,
    # the first thread) that would otherwise land on whichever mode happens to go first
    stage.timed_memory(inputs[:2])
    stage.timed_epoch(data, 0, batches=batches[:2], prefetch=0)
    stage.timed_epoch(data, 0, batches=batches[:2], prefetch=2)
    for n, start in enumerate(range(0, len(batches), CHUNK)):
        chunk = batches[start:start + CHUNK]
        for mode in modes[n % 3:] + modes[:n % 3]:
            # each chunk starts cold (a new iterator); the mean of all its steps, every configuration alike
            # (with prefetch=0 the chunk's batches are prepared SYNC_RUN at a time, CHUNK being a multiple)
            if mode == "limit":
                steps = stage.timed_memory(inputs[start:start + CHUNK])
            else:
                steps = stage.timed_epoch(data, 0, batches=chunk, prefetch=0 if mode == "sync" else 2)
            times[mode].append(statistics.fmean(steps))
    rss = peak_rss_bytes()  # before the batch-size sweep: B = 1 is the configuration compared
    t = {mode: median(values) for mode, values in times.items()}
    # samples/s at B = 1, 4, 8 (order rotated per repeat); enough repeats of the data for 1 + steps batches of 8
    s = stage.settings
    repeat = max(s["train_repeat"], -(-BATCH_SIZES[-1] * (1 + max(s["sweep_steps"])) // s["samples"]))
    sweep: dict[str, Optional[float]] = {}
    order = list(range(len(BATCH_SIZES)))
    order = order[rep % len(order):] + order[:rep % len(order)]
    for k in order:
        b = BATCH_SIZES[k]
        step_times = stage.timed_epoch(stage.data(batch_size=b, repeat=repeat), epoch=1 + k,
                                       max_steps=1 + s["sweep_steps"][k], full_only=True)
        t_b = step_median(step_times)
        sweep[str(b)] = None if t_b is None else b / t_b
    return {"step_s": t["sync"], "thread_step_s": t["thread"], "steps": len(times["sync"]), "rss": rss,
            "paired_limit_s": t["limit"], "paired_ratio": t["sync"] / t["limit"],
            "thread_paired_ratio": t["thread"] / t["limit"], "rss_after_sweep": peak_rss_bytes(),
            "samples_per_s": sweep, "threads": _threads()}


def child_limit(workdir: Path, size: str, out: Path, rep: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import save

    stage = Stage2(workdir, size, out)
    data = stage.data(batch_size=1, keep_in_memory=True)
    prepared = [(batch.elements[0], batch.inputs) for batch in data.iterate(0, stage.ctx, prefetch=0)]
    times = stage.timed_memory([inputs for _element, inputs in prepared])
    rss = peak_rss_bytes()

    # Cache dtype: store floating tensors as bf16 / fp16, read them back as float32; same samples, same draws.
    early = data.early_context(stage.ctx)
    seen: dict[str, Any] = {}
    for element, _inputs in prepared:
        seen.setdefault(element.item.sample_id, element)
    dtype_results: dict[str, Any] = {}
    reference: dict[str, float] = {}
    model = stage.ctx.models[stage.denoiser]
    model.eval()
    for name in CACHE_DTYPES:
        dtype = getattr(torch, name)
        losses: dict[str, float] = {}
        sizes: list[int] = []
        for sample_id, element in seen.items():
            raw = data.read(element.item)
            stored = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in raw.items()}
            sizes.append(len(save({k: v.contiguous() for k, v in stored.items() if isinstance(v, torch.Tensor)})))
            restored = {k: v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                        for k, v in stored.items()}
            state = data.prepare(element, 0, early, cached=restored)
            with torch.no_grad():
                losses[sample_id] = float(stage.sink(stage.ctx, data.sink_inputs(state)))
        if name == "float32":
            reference = losses
        rel = [abs(losses[k] - reference[k]) / abs(reference[k]) for k in losses]
        dtype_results[name] = {"tensor_bytes": median(sizes), "loss_rel_median": median(rel), "loss_rel_max": max(rel)}
    return {"step_s": step_median(times), "steps": len(times), "rss": rss, "cache_dtype": dtype_results,
            "threads": _threads()}


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "stage1": child_stage1, "unsplit": child_unsplit, "train": child_train, "loader": child_loader, "limit": child_limit,
}


def child_main(config: str, workdir: Path, size: str, out: Path, rep: int) -> None:
    threads = load_settings(workdir).get("threads")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    run_dir = Path(tempfile.mkdtemp(prefix=f"{config}-", dir=paths(workdir, size)["base"]))
    try:
        if config == "prepare":
            result = child_prepare(workdir, size)
        else:
            result = CHILDREN[config](workdir, size, run_dir / "out", rep)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    out.write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------
# the parent: alternate the configurations, collect, summarise


def spawn(config: str, workdir: Path, size: str, rep: int = 0) -> dict[str, Any]:
    """Run one configuration in a fresh process; its JSON result plus its wall time and maxrss (wait4)."""
    out = Path(workdir) / f"result-{config}-{size}-{rep}.json"
    log = Path(workdir) / f"log-{config}-{size}-{rep}.txt"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", config, "--size", size,
               "--workdir", str(workdir), "--out", str(out), "--rep", str(rep)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
        _pid, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"benchmark child {config} ({size}) failed with exit code {code}:\n{tail}")
    result = json.loads(out.read_text())
    result["wall_s"] = wall
    result["maxrss_wait4"] = int(usage.ru_maxrss) * 1024
    return result


def plan_command(pipeline: str) -> list[str]:
    from unitgraph.backends.diffusion.registry import find_pipeline

    return ["plan", f"diffusion:{pipeline}", "--lora-base-model", find_pipeline(pipeline)[0].model_slots[0]]


def planner_startup(repeats: int, pipeline: str = DEFAULT_PIPELINE) -> list[float]:
    """Seconds for the whole `unitgraph plan diffusion:<pipeline> --lora-base-model dit` process (import to exit)."""
    PLAN_COMMAND = plan_command(pipeline)
    exe = Path(sys.executable).with_name("unitgraph")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "unitgraph.cli.app"]
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            start = time.perf_counter()
            done = subprocess.run(command + PLAN_COMMAND + ["-o", f"{tmp}/plan{i}.json"], capture_output=True, text=True)
            elapsed = time.perf_counter() - start
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                print(f"warning: `unitgraph {' '.join(PLAN_COMMAND)}` failed ({last}); planner start-up not measured",
                      file=sys.stderr)
                return times
            times.append(elapsed)
    return times


def cache_bytes(cache_dir: Path) -> dict[str, Any]:
    """Bytes per sample of the cache: whole entry files, and per cache entry (tensor data by key)."""
    sys.path.insert(0, str(ROOT))
    from unitgraph.backends.diffusion.data.batching import read_safetensors_header

    files = sorted((Path(cache_dir) / "entries").glob("*.safetensors"))
    per_key: dict[str, list[int]] = {}
    header_sizes = []
    for f in files:
        header = read_safetensors_header(f)
        totals: dict[str, int] = {}
        data = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            totals[name.split(".", 1)[0]] = totals.get(name.split(".", 1)[0], 0) + end - start
            data += end - start
        values = json.loads((header.get("__metadata__") or {}).get("unitgraph", "{}")).get("values", {})
        for key in values:
            per_key.setdefault(key, []).append(totals.get(key, 0))
        header_sizes.append(f.stat().st_size - data)
    return {"file": median([f.stat().st_size for f in files]), "header": median(header_sizes),
            "per_key": {k: median(v) for k, v in sorted(per_key.items())}, "entries": len(files)}


def model_bytes(models_dir: Path, family: Any) -> dict[str, int]:
    """Weight bytes per model slot of the family (the denoiser, `dit`, first)."""
    out = {}
    for name in family.model_slots:
        folder = Path(models_dir) / family.slot(name).subfolder
        out[name] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return out


def measure(sizes: list[str], repeats: int, workdir: Path, settings: Optional[dict[str, Any]] = None,
            planner_repeats: int = 6, threads: Optional[int] = 1, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare every size, then run every configuration `repeats` times, alternating; raw results.

    threads: torch intra-op threads in every configuration (None: torch's default).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    from unitgraph.backends.diffusion.registry import find_pipeline

    settings = dict(settings or {"sizes": {s: SIZES[s] for s in sizes}})
    settings.setdefault("threads", threads)
    settings.setdefault("pipeline", DEFAULT_PIPELINE)
    (workdir / "settings.json").write_text(json.dumps(settings, indent=2))
    family, _ = find_pipeline(settings["pipeline"])
    started = time.perf_counter()
    results: dict[str, Any] = {"sizes": {}, "settings": settings}
    for size in sizes:
        paths(workdir, size)["base"].mkdir(parents=True, exist_ok=True)
        prepared = spawn("prepare", workdir, size)
        results["sizes"][size] = {"description": prepared["description"], "runs": {c: [] for c in CONFIGS},
                                  "cache": cache_bytes(paths(workdir, size)["cache"]),
                                  "model_bytes": model_bytes(paths(workdir, size)["models"], family)}
        echo(f"prepared {size} ({prepared['wall_s']:.1f} s)")
    planner: list[float] = []
    for rep in range(repeats):
        for size in sizes:
            order = list(CONFIGS[rep % len(CONFIGS):] + CONFIGS[:rep % len(CONFIGS)])  # rotate: no fixed position
            for config in order:
                result = spawn(config, workdir, size, rep)
                results["sizes"][size]["runs"][config].append(result)
                step = result.get("step_s") or result.get("per_sample_s")
                echo(f"repeat {rep + 1}/{repeats} {size:>8} {config:>7}: {1000 * step:8.1f} ms, "
                     f"peak RSS {result['rss'] / 2**20:6.0f} MB ({result['wall_s']:.1f} s)")
        planner += planner_startup(max(1, planner_repeats // repeats), settings["pipeline"])
    results["planner_startup_s"] = planner
    results["total_s"] = time.perf_counter() - started
    results["environment"] = environment()
    return results


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "diffusers", "transformers", "peft", "accelerate", "safetensors"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "versions": versions}


def _title(settings: dict[str, Any]) -> str:
    from unitgraph.backends.diffusion.registry import find_pipeline

    return find_pipeline(settings.get("pipeline", DEFAULT_PIPELINE))[0].title


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Medians over repeats, ratios against their targets, break-even epochs."""
    rows = []
    for size, data in results["sizes"].items():
        runs = data["runs"]

        def med(config: str, key: str) -> Optional[float]:
            return median([r.get(key) for r in runs[config]])

        row: dict[str, Any] = {"size": size, "description": data["description"], "px": results["settings"]["sizes"][size]["px"],
                               "frames": results["settings"]["sizes"][size].get("frames")}
        for config in ("unsplit", "train", "loader", "limit"):
            row[f"t_{config}"] = med(config, "step_s")
        row["t_stage1"] = med("stage1", "per_sample_s")
        row["stage1_total"] = med("stage1", "total_s")
        for config in CONFIGS:
            row[f"rss_{config}"] = med(config, "rss")

        def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return None if a is None or not b else a / b

        # against the limit: paired in one process (measured right after / alternating), median over repeats
        row["train_vs_limit"] = med("train", "paired_ratio")
        row["train_first_vs_limit"] = med("train", "first_run_ratio")  # with rounds: the warm-up run, not judged
        row["loader_vs_limit"] = med("loader", "paired_ratio")
        row["thread_vs_limit"] = med("loader", "thread_paired_ratio")
        row["loader_overhead_s"] = median([r["step_s"] - r["paired_limit_s"] for r in runs["loader"]
                                           if r.get("step_s") is not None and r.get("paired_limit_s") is not None])
        row["t_thread"] = med("loader", "thread_step_s")
        row["ratio_spread"] = {c: [r.get("paired_ratio") for r in runs[c]] for c in ("train", "loader")}
        row["train_vs_unsplit"] = ratio(row["t_train"], row["t_unsplit"])
        row["loader_vs_unsplit"] = ratio(row["t_loader"], row["t_unsplit"])
        row["rss_train_vs_unsplit"] = ratio(row["rss_train"], row["rss_unsplit"])
        row["rss_train_vs_limit"] = ratio(row["rss_train"], row["rss_limit"])
        row["rss_loader_vs_limit"] = ratio(row["rss_loader"], row["rss_limit"])

        def break_even(t_stage2: Optional[float]) -> Optional[float]:
            if None in (row["t_stage1"], row["t_unsplit"], t_stage2) or row["t_unsplit"] <= t_stage2:
                return None
            return row["t_stage1"] / (row["t_unsplit"] - t_stage2)

        row["break_even_train"] = break_even(row["t_train"])
        row["break_even_loader"] = break_even(row["t_loader"])
        sweeps = [r.get("samples_per_s") or {} for r in runs["loader"]]
        row["samples_per_s"] = {str(b): median([s.get(str(b)) for s in sweeps]) for b in BATCH_SIZES}
        dtypes = [r.get("cache_dtype") or {} for r in runs["limit"]]
        row["cache_dtype"] = {
            name: {key: median([d.get(name, {}).get(key) for d in dtypes]) for key in ("tensor_bytes", "loss_rel_median", "loss_rel_max")}
            for name in CACHE_DTYPES
        }
        row["cache"] = data["cache"]
        row["model_bytes"] = data["model_bytes"]
        rows.append(row)
    return {"rows": rows, "planner_startup_s": median(results.get("planner_startup_s", [])),
            "planner_runs": len(results.get("planner_startup_s", [])), "total_s": results.get("total_s"),
            "environment": results.get("environment", {}), "threads": results["settings"].get("threads"),
            "pipeline": results["settings"].get("pipeline", DEFAULT_PIPELINE), "title": _title(results["settings"]),
            "repeats": max((len(r["runs"]["train"]) for r in results["sizes"].values()), default=0)}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default=DEFAULT_PIPELINE, help="the pipeline whose tiny models are measured")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes (default: test,demo, and balanced for qwen_image)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="replace the split-vs-unsplit section of docs/benchmarks.md")
    parser.add_argument("--workdir", help="keep models, caches and raw results here (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per configuration (0: torch's default)")
    parser.add_argument("--from-results", help="re-render the report from a results.json of an earlier run (no measuring)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, Path(args.workdir), args.size, Path(args.out), args.rep)
        return
    # the report; it imports this file's parameters (as module split_vs_unsplit), so not at the top
    from split_vs_unsplit_report import markdown, plot, section_names, write_doc

    if args.from_results:
        summary = summarize(json.loads(Path(args.from_results).read_text()))
        plot_path = section_names(summary["pipeline"])[3]
        text = markdown(summary, plot_path.name if args.write else None)
        print(text)
        if args.write:
            plot(summary, plot_path)
            write_doc(text, pipeline=summary["pipeline"])
        return
    sys.path.insert(0, str(ROOT))
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.registry import find_pipeline

    try:
        family, pipeline = find_pipeline(args.pipeline)
    except BackendError as exc:
        parser.error(str(exc))
    own = [s for s in SIZES if s in family.tiny_module().SIZES or (s == "balanced" and family.name == "qwen_image")]
    sizes = [s for s in (args.sizes or ",".join(own)).split(",") if s]
    unknown = [s for s in sizes if s not in own]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r} for {pipeline.name} (choose from {', '.join(own)})")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="unitgraph-bench-"))
    plot_path = section_names(pipeline.name)[3]
    try:
        settings = {"sizes": {s: dict(SIZES[s], **(VIDEO_SIZES.get(s, {}) if pipeline.video_params else {}))
                              for s in sizes}, "pipeline": pipeline.name}
        results = measure(sizes, args.repeats, workdir, settings=settings, threads=args.threads or None)
        (workdir / "results.json").write_text(json.dumps(results, indent=2))
        summary = summarize(results)
        text = markdown(summary, plot_path.name if args.write else None)
        print(text)
        if args.write:
            plot(summary, plot_path)
            write_doc(text, pipeline=pipeline.name)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

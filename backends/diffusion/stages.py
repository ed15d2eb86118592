"""The training loops: unsplit (`sft`), stage 1 (`:data_process`), stage 2 (`:train`) and both (`:split`).

Stage 1 follows `unitgraph.runtime.stage1_schedule(plan)`: it runs the plan's data_process units
under no_grad and stores each sample's cache entries. Stage 2 follows `stage2_bindings`: every
input of a train unit and of the sink comes either from a live train output or from a cache
entry. Each stage loads only its plan's models.

All randomness comes from generators derived from --seed (see `randomness.py`), so the unsplit run
and the split run draw the same numbers and end with the same losses and weights.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import io
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from unitgraph.atomic import write_text_atomic
from unitgraph.plan import Plan, split
from unitgraph.runtime import SINK, stage1_schedule, stage2_bindings
from unitgraph.spec import Pipeline

from .args import BackendError, TrainArgs
from .cache import Cache, model_files_digest, read_entry, settings_hash, write_entry
from .data import DiffusionDataset
from .losses import SINKS
from .qwen_image import ImageSize, UnitContext, run_unit
from .randomness import permutation, seeded_global_stream
from .registry import PIPELINES, TASK_PIPELINES

# Dataset columns each task family requires, and those it uses when present.
REQUIRED = {"sft": ("image", "prompt"), "direct_distill": ("image", "prompt", "seed", "num_inference_steps")}
OPTIONAL = {"sft": (), "direct_distill": ("cfg_scale", "negative_prompt")}
KEEP_IN_MEMORY_BYTES = 1 << 30  # stage 2 keeps a cache this small in memory after the first epoch


@dataclass
class RunResult:
    task: str
    output_path: Path
    plan: Plan
    plan_path: Optional[Path] = None
    cache_path: Optional[Path] = None
    cache_reused: bool = False
    loss_csv: Optional[Path] = None
    loss_plot: Optional[Path] = None
    checkpoints: list[Path] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    steps: int = 0
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def median_step_s(self) -> Optional[float]:
        times = self.step_times[1:] or self.step_times  # the first step pays one-off set-up costs
        return statistics.median(times) if times else None

    @property
    def last_checkpoint(self) -> Optional[Path]:
        return self.checkpoints[-1] if self.checkpoints else None


class Reporter:
    """Prints on the main process only."""

    def __init__(self, accelerator: Any, echo: Optional[Callable[[str], None]] = None):
        self.main = accelerator.is_main_process
        self.echo = echo or (lambda text: print(text, flush=True))

    def __call__(self, text: str) -> None:
        if self.main:
            self.echo(text)


# ------------------------------------------------------------------------------------------------
# planning and set-up


def pipeline_for(args: TrainArgs) -> Pipeline:
    return PIPELINES[TASK_PIPELINES[args.family]]()


def plan_for(args: TrainArgs, pipeline: Pipeline) -> Plan:
    models = pipeline.models
    if args.lora_base_model and args.lora_base_model not in models:
        raise BackendError(f"--lora_base_model {args.lora_base_model!r} is not a model of pipeline {pipeline.name} "
                           f"(models: {', '.join(models)})")
    for name in args.trainable():
        if name not in models:
            raise BackendError(f"--trainable_models: {name!r} is not a model of pipeline {pipeline.name} (models: {', '.join(models)})")
    if args.preset_lora_path and (args.preset_lora_model or args.lora_base_model) not in models:
        raise BackendError("--preset_lora_path needs --preset_lora_model (or --lora_base_model) naming a model of the pipeline")
    plan = split(pipeline, trainable_models=args.trainable(), lora_base_model=args.lora_base_model, cache_mode=args.cache_mode)
    if not plan.checks_pass:  # pragma: no cover - the planner proves its plans
        raise RuntimeError(f"planner produced a plan failing its checks: {plan.checks}")
    return plan


def make_accelerator(args: TrainArgs):
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # Qwen-Image's last block computes text-stream outputs nobody reads, so LoRA on txt_* / to_add_out
    # leaves parameters without gradients; DDP then needs find_unused_parameters. DiffSynth's Qwen-Image
    # scripts pass the flag; multi-process runs here turn it on by themselves.
    multi = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=args.find_unused_parameters or multi)]
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no", kwargs_handlers=handlers)


def dataset_params(pipeline: Pipeline) -> list[str]:
    """Params read before any unit writes them (the sink included)."""
    written: set[str] = set()
    out: dict[str, None] = {}
    for unit in pipeline.units:
        for p in unit.inputs:
            if p not in written:
                out.setdefault(p, None)
        written.update(unit.outputs)
    for p in pipeline.sink.inputs if pipeline.sink else ():
        if p not in written:
            out.setdefault(p, None)
    return list(out)


def make_dataset(args: TrainArgs, pipeline: Pipeline) -> DiffusionDataset:
    return DiffusionDataset(
        args.dataset_base_path, args.dataset_metadata_path, dataset_params(pipeline),
        data_file_keys=args.file_keys(), extra_inputs=args.extra_input_names(),
        required=REQUIRED[args.family], optional=OPTIONAL[args.family],
    )


def _slots(models: list[str], need_scheduler: bool) -> list[str]:
    slots = list(models)
    if "text_encoder" in slots:
        slots.append("tokenizer")
    if need_scheduler:
        slots.append("scheduler")
    return slots


def load_models(args: TrainArgs, models: list[str], need_scheduler: bool, device: Any) -> dict[str, Any]:
    from .models import ModelLoadError, load_components

    try:
        loaded = load_components(_slots(models, need_scheduler), model_paths=args.model_paths,
                                 model_id_with_origin_paths=args.model_id_with_origin_paths,
                                 tokenizer_path=args.tokenizer_path, cache_dir=args.modelscope_cache_dir,
                                 torch_dtype=torch.float32)
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None
    for value in loaded.values():
        if isinstance(value, torch.nn.Module):
            value.requires_grad_(False)
            value.eval()
            value.to(device)
    return loaded


def stage1_settings(args: TrainArgs, plan: Plan) -> dict[str, Any]:
    """Everything that changes what stage 1 computes (the dataset is covered per sample by its id)."""
    from .models import ModelLoadError, model_weight_files

    files = {}
    try:
        for slot in _slots(plan.data_process_models, need_scheduler=False):
            files[slot] = model_weight_files(slot, model_paths=args.model_paths,
                                             model_id_with_origin_paths=args.model_id_with_origin_paths,
                                             tokenizer_path=args.tokenizer_path, cache_dir=args.modelscope_cache_dir)
    except ModelLoadError as exc:
        raise BackendError(str(exc)) from None
    return {
        "pipeline": plan.pipeline,
        "plan_fingerprint": plan.fingerprint,
        "data_process_units": plan.data_process_units,
        "image_size": {"height": args.height, "width": args.width, "max_pixels": args.max_pixels},
        "data_file_keys": args.file_keys(),
        "extra_inputs": args.extra_input_names(),
        "dtype": "float32",
        "models": model_files_digest(files),
    }


def make_context(args: TrainArgs, models: dict[str, Any], device: Any) -> UnitContext:
    return UnitContext(models=models, size=ImageSize(args.height, args.width, args.max_pixels), device=device,
                       seed=args.seed, timestep_bounds=(args.min_timestep_boundary, args.max_timestep_boundary))


def _unit_grad(unit: Any, backward: set[str], inputs: dict[str, Any]) -> Any:
    """no_grad for a unit whose models are all frozen and whose inputs carry no gradient (same numbers, less memory)."""
    needs = bool(set(unit.models) & backward) or any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values())
    return contextlib.nullcontext() if needs else torch.no_grad()


def _progress(iterable: Any, total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


# ------------------------------------------------------------------------------------------------
# stage 1


def run_data_process(args: TrainArgs, pipeline: Pipeline, plan: Plan, accelerator: Any, cache_dir: Path,
                     report: Reporter) -> tuple[float, int, bool]:
    """Fill `cache_dir` for `plan`; each sample once, sharded over processes. Returns (seconds, samples, reused)."""
    start = time.perf_counter()
    dataset = make_dataset(args, pipeline)
    n = len(dataset)
    ids = [dataset.sample_id(i) for i in range(n)]
    settings = stage1_settings(args, plan)
    digest = settings_hash(settings)
    cache = Cache(cache_dir)
    if cache.is_complete_for(plan.fingerprint, digest, ids):
        report(f"stage 1: reusing the cache at {cache_dir} ({n} samples)")
        return time.perf_counter() - start, n, True
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        cache.begin(plan, settings, digest)
    accelerator.wait_for_everyone()
    # Each distinct sample goes to exactly one process (no padding, no duplicates).
    unique = list(dict.fromkeys(ids))
    first_index = {sid: ids.index(sid) for sid in unique}
    mine = unique[accelerator.process_index::accelerator.num_processes]
    todo = [first_index[sid] for sid in mine if not cache.entry_path(sid).is_file()]
    if todo:
        models = load_models(args, plan.data_process_models, need_scheduler=False, device=accelerator.device)
        ctx = make_context(args, models, accelerator.device)
        schedule = stage1_schedule(plan)
        units = {u.name: u for u in pipeline.units}
        with torch.no_grad():
            bar = _progress(todo, len(todo), "stage 1 (data_process)", args.progress and accelerator.is_local_main_process)
            for index in bar:
                state = dataset.sample(index)
                values = {key: state.get(param) for param, key in schedule.snapshots_after.get(None, [])}
                for name in schedule.units:
                    state.update(run_unit(units[name], ctx, state))
                    for param, key in schedule.snapshots_after.get(name, []):
                        values[key] = state[param]
                for param, key in schedule.final:
                    values[key] = state.get(param)
                write_entry(cache.entry_path(ids[index]), values, {"sample_id": ids[index], "index": index})
        del models, ctx
        gc.collect()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        cache.finish(plan, settings, digest, [{"index": i, "sample_id": ids[i]} for i in range(n)])
    accelerator.wait_for_everyone()
    return time.perf_counter() - start, n, False


# ------------------------------------------------------------------------------------------------
# sample providers: where a training step's sink inputs come from


@dataclass(frozen=True)
class Item:
    index: int
    sample_id: str


class LiveProvider:
    """The unsplit baseline: every unit runs on the raw sample, every step."""

    def __init__(self, args: TrainArgs, pipeline: Pipeline, plan: Plan):
        self.pipeline = pipeline
        self.dataset = make_dataset(args, pipeline)
        self.items = [Item(i, self.dataset.sample_id(i)) for i in range(len(self.dataset))]
        self.models = sorted(set(pipeline.models) | set(plan.models_require_backward))
        self.backward = set(plan.models_require_backward)

    def sink_inputs(self, item: Item, ctx: UnitContext) -> dict[str, Any]:
        state = self.dataset.sample(item.index)
        for unit in self.pipeline.units:
            with _unit_grad(unit, self.backward, {p: state.get(p) for p in unit.inputs}):
                state.update(run_unit(unit, ctx, state))
        return {p: state.get(p) for p in self.pipeline.sink.inputs}


class CacheProvider:
    """Stage 2: train units and the sink, fed per `stage2_bindings` from live outputs and cache entries."""

    def __init__(self, pipeline: Pipeline, plan: Plan, cache_dir: Path):
        self.pipeline = pipeline
        self.plan = plan
        self.cache = Cache(cache_dir)
        manifest = self.cache.open_for_training(plan)
        self.items = [Item(int(s["index"]), str(s["sample_id"])) for s in manifest["samples"]]
        self.items.sort(key=lambda it: it.index)
        self.models = list(plan.train_models)
        self.backward = set(plan.models_require_backward)
        self.bindings = stage2_bindings(pipeline, plan)
        self.units = [pipeline.units[pipeline.index(name)] for name in plan.train_units]
        self._entries: dict[str, dict[str, Any]] = {}
        size = sum(self.cache.entry_path(it.sample_id).stat().st_size for it in self.items
                   if self.cache.entry_path(it.sample_id).is_file())
        self.keep_in_memory = size <= KEEP_IN_MEMORY_BYTES

    def entry(self, sample_id: str) -> dict[str, Any]:
        if sample_id in self._entries:
            return self._entries[sample_id]
        values, _ = read_entry(self.cache.entry_path(sample_id))
        if self.keep_in_memory:
            self._entries[sample_id] = values
        return values

    def sink_inputs(self, item: Item, ctx: UnitContext) -> dict[str, Any]:
        cached = self.entry(item.sample_id)
        live: dict[tuple[str, str], Any] = {}

        def value(reader: str, param: str) -> Any:
            binding = self.bindings[(reader, param)]
            if binding.source == "live":
                return live[(binding.writer, param)]
            return cached[binding.key]

        for unit in self.units:
            inputs = {p: value(unit.name, p) for p in unit.inputs}
            with _unit_grad(unit, self.backward, inputs):
                out = run_unit(unit, ctx, inputs)
            for p in unit.outputs:
                live[(unit.name, p)] = out[p]
        return {p: value(SINK, p) for p in self.pipeline.sink.inputs}


# ------------------------------------------------------------------------------------------------
# the training loop


def _prepare_models(args: TrainArgs, plan: Plan, models: dict[str, Any], accelerator: Any):
    from .lora import add_lora, load_lora_checkpoint, merge_preset_lora

    if args.preset_lora_path:
        target = args.preset_lora_model or args.lora_base_model
        if target not in models:
            raise BackendError(f"--preset_lora_model {target!r} is not loaded in this stage (stage models: {', '.join(sorted(models))})")
        merge_preset_lora(models[target], target, args.preset_lora_path)
    for slot in args.trainable():
        models[slot].requires_grad_(True)
        models[slot].train()
    lora_config = None
    if args.lora_base_model:
        base = models[args.lora_base_model]
        lora_config = add_lora(base, args.lora_base_model, args.lora_targets(), args.lora_rank, args.lora_alpha, args.seed)
        base.train()
        if args.lora_checkpoint:
            load_lora_checkpoint(base, args.lora_base_model, args.lora_checkpoint)
    if args.use_gradient_checkpointing or args.use_gradient_checkpointing_offload:
        for slot in plan.models_require_backward:
            model = models[slot]
            if hasattr(model, "enable_gradient_checkpointing"):
                model.enable_gradient_checkpointing()
            elif hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for slot in plan.models_require_backward for p in models[slot].parameters() if p.requires_grad]
    if not params:
        raise BackendError("no trainable parameters (check --lora_target_modules / --trainable_models)")
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    wrapped = dict(models)
    for slot in plan.models_require_backward:
        wrapped[slot] = accelerator.prepare(models[slot])
    optimizer = accelerator.prepare(optimizer)
    return wrapped, optimizer, lora_config


def _save(args: TrainArgs, output: Path, name: str, models: dict[str, Any], lora_config: Any, accelerator: Any) -> Path:
    from .lora import checkpoint_state, save_checkpoint

    raw = {slot: accelerator.unwrap_model(m) if isinstance(m, torch.nn.Module) else m for slot, m in models.items()}
    state = checkpoint_state(raw, args.lora_base_model, args.trainable())
    return save_checkpoint(output / name, state, args.lora_base_model, lora_config, args.remove_prefix_in_ckpt)


def write_loss_plot(rows: list[tuple[int, int, float, float]], path: Path, title: str) -> Optional[Path]:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from unitgraph.atomic import write_bytes_atomic

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    steps = [r[0] for r in rows]
    losses = [r[2] for r in rows]
    ax.plot(steps, losses, linewidth=1, label="loss")
    if len(losses) >= 10:
        k = max(2, len(losses) // 20)
        smooth = [sum(losses[max(0, i - k + 1): i + 1]) / len(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, linewidth=2, label=f"mean of {k}")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_bytes_atomic(path, buffer.getvalue())
    return path


def run_training(args: TrainArgs, plan: Plan, provider: Any, accelerator: Any, output: Path, report: Reporter,
                 result: RunResult) -> None:
    """AdamW over the provider's samples; loss.csv, checkpoints, loss plot in `output`."""
    world, rank = accelerator.num_processes, accelerator.process_index
    models = load_models(args, provider.models, need_scheduler=True, device=accelerator.device)
    models, optimizer, lora_config = _prepare_models(args, plan, models, accelerator)
    sink = SINKS[plan.pipeline]
    ctx = make_context(args, models, accelerator.device)
    wrapped = [models[s] for s in plan.models_require_backward if hasattr(models[s], "no_sync")]

    expanded = [(item, r) for item in provider.items for r in range(args.dataset_repeat)]
    accum = args.gradient_accumulation_steps
    per_rank = -(-len(expanded) // world)
    steps_per_epoch = -(-per_rank // accum)
    total_steps = steps_per_epoch * args.num_epochs
    main = accelerator.is_main_process
    loss_csv = output / "loss.csv"
    rows: list[tuple[int, int, float, float]] = []
    if main:
        output.mkdir(parents=True, exist_ok=True)
        loss_csv.write_text("step,epoch,loss,elapsed_s\n", encoding="utf-8")
    step = 0
    t0: Optional[float] = None
    last = None
    bar = _progress(range(total_steps), total_steps, "stage 2 (train)" if isinstance(provider, CacheProvider) else "train",
                    args.progress and accelerator.is_local_main_process)
    for epoch in range(args.num_epochs):
        order = permutation(len(expanded), args.seed, "shuffle", epoch)
        sequence = [expanded[j] for j in order]
        if world > 1:  # DDP needs the same number of steps everywhere: wrap around, like DistributedSampler
            sequence += sequence[: per_rank * world - len(sequence)]
            sequence = sequence[rank::world]
        for begin in range(0, len(sequence), accum):
            group = sequence[begin:begin + accum]
            if t0 is None:
                t0 = time.perf_counter()
            losses = []
            for k, (item, repeat) in enumerate(group):
                ctx.epoch = epoch
                ctx.sample_key = f"{item.index}:{item.sample_id}:{repeat}"
                sync = k == len(group) - 1
                with contextlib.ExitStack() as stack:
                    if not sync and world > 1:
                        for model in wrapped:
                            stack.enter_context(model.no_sync())
                    with seeded_global_stream(args.seed, "dropout", epoch, ctx.sample_key):
                        loss = sink(ctx, **provider.sink_inputs(item, ctx))
                        accelerator.backward(loss / len(group))
                losses.append(loss.detach().float())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_loss = torch.stack(losses).mean()
            if world > 1:
                step_loss = accelerator.reduce(step_loss.to(accelerator.device), reduction="mean")
            now = time.perf_counter()
            row = (step, epoch, float(step_loss), now - t0)
            rows.append(row)
            result.step_times.append(now - (last if last is not None else t0))
            last = now
            if main:
                with loss_csv.open("a", encoding="utf-8", newline="") as handle:
                    csv.writer(handle).writerow([row[0], row[1], repr(row[2]), f"{row[3]:.6f}"])
            bar.update(1)
            bar.set_postfix(loss=f"{row[2]:.4f}", epoch=epoch)
            if args.save_steps and step % args.save_steps == 0:
                accelerator.wait_for_everyone()
                if main:
                    result.checkpoints.append(_save(args, output, f"step-{step}.safetensors", models, lora_config, accelerator))
        accelerator.wait_for_everyone()
        if main:
            result.checkpoints.append(_save(args, output, f"epoch-{epoch}.safetensors", models, lora_config, accelerator))
    bar.close()
    result.steps = step
    result.losses = [r[2] for r in rows]
    result.loss_csv = loss_csv
    if main and args.plot:
        result.loss_plot = write_loss_plot(rows, output / "loss.png", f"{plan.pipeline} · {args.task}")
    accelerator.wait_for_everyone()


# ------------------------------------------------------------------------------------------------
# entry point


def _write_run_files(args: TrainArgs, plan: Plan, output: Path, accelerator: Any) -> Path:
    path = output / "plan.json"
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, plan.to_json())
        write_text_atomic(output / "training_args.json", args.to_json())
    return path


def run(args: TrainArgs, echo: Optional[Callable[[str], None]] = None, accelerator: Any = None) -> RunResult:
    """Execute `args.task`. Bad input raises BackendError (one line)."""
    args.validate()
    if args.fp8_models:
        (echo or print)("note: --fp8_models is ignored (no fp8 training on this backend)")
    pipeline = pipeline_for(args)
    plan = plan_for(args, pipeline)
    accelerator = accelerator or make_accelerator(args)
    report = Reporter(accelerator, echo)
    output = Path(args.output_path)
    result = RunResult(task=args.task, output_path=output, plan=plan)
    stage = args.stage

    if stage == "data_process":
        cache_dir = Path(args.cache_path) if args.cache_path else output
        result.plan_path = _write_run_files(args, plan, cache_dir, accelerator)
        seconds, n, reused = run_data_process(args, pipeline, plan, accelerator, cache_dir, report)
        result.cache_path, result.cache_reused, result.samples = cache_dir, reused, n
        result.stage_times["data_process"] = seconds
        return result

    if stage == "train":
        if not args.dataset_base_path:
            raise BackendError("--dataset_base_path must be the cache folder written by the data_process stage")
        provider: Any = CacheProvider(pipeline, plan, Path(args.dataset_base_path))
        result.cache_path = Path(args.dataset_base_path)
    elif stage == "split":
        cache_dir = Path(args.cache_path) if args.cache_path else output / "cache"
        seconds, n, reused = run_data_process(args, pipeline, plan, accelerator, cache_dir, report)
        result.cache_path, result.cache_reused = cache_dir, reused
        result.stage_times["data_process"] = seconds
        provider = CacheProvider(pipeline, plan, cache_dir)
    else:
        provider = LiveProvider(args, pipeline, plan)
    result.samples = len(provider.items)
    result.plan_path = _write_run_files(args, plan, output, accelerator)
    start = time.perf_counter()
    run_training(args, plan, provider, accelerator, output, report, result)
    result.stage_times["train"] = time.perf_counter() - start
    return result


def read_loss_csv(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8", newline="") as handle:
        return [{"step": int(r["step"]), "epoch": int(r["epoch"]), "loss": float(r["loss"]), "elapsed_s": float(r["elapsed_s"])}
                for r in csv.DictReader(handle)]


def summary_json(result: RunResult) -> str:
    return json.dumps({
        "task": result.task, "samples": result.samples, "steps": result.steps,
        "stage_times_s": result.stage_times, "median_step_s": result.median_step_s,
        "checkpoint": None if result.last_checkpoint is None else str(result.last_checkpoint),
    }, indent=2)

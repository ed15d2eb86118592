"""The training loop: the optimizer (--optimizer, AdamW by default) over micro-batches of sink inputs, the same loop
for the unsplit run and stage 2.

`run_training` takes its batches from a data source (`executor.Stage2Data` for stage 2, `executor.LiveData`
for the unsplit run): both give the same elements in the same seeded order, so with the same
--seed the two runs draw the same numbers and end with the same losses and weights. Each micro-batch
loss is a mean over its samples, weighted by its share of the optimizer step.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from unitgraph.atomic import write_text_atomic
from unitgraph.errors import OutputError
from unitgraph.plan import Plan

from ..data.batching import CachedItem, step_groups
from ..errors import BackendError
from ..randomness import seeded_global_stream
from .checkpoints import checkpoint_state, diffusers_remove_prefix, save_checkpoint
from .engines import base_optimizer, held_bytes, steps_for
from .lr import make_lr_schedule, seek, step as lr_step
from .ema import TrainedEMA, ema_name, optional_swap
from .optimizers import build_optimizer, eval_weights, optimizer_label
from .outputs import RunFolder
from .resume import (
    apply_state,
    check_progress,
    check_state,
    data_identity,
    latest_state,
    must_match,
    prune_states,
    optimizer_tensors,
    rank_file,
    remove_partial_states,
    save_state,
    staging_folder,
    trained_parameters,
)

if TYPE_CHECKING:  # annotations only: the run's configuration sits above the rooms
    from ..config import RunConfig
from ..models.precision import offloaded_activations
from ..models.stage import load_models, make_context
from .validation import empty_prompt_encoding
from .held_out import FILE as HELD_OUT_FILE, HeldOutLog, held_out_loss
from ..report import progress
from ..result import RunResult


def prepare_models(cfg: RunConfig, plan: Plan, models: dict[str, Any], accelerator: Any, report: Any = None,
                   steps: Any = None):
    """Preset LoRA merged, trainable models and the LoRA adapter made trainable, the optimizer (--optimizer); each
    prepared for the run's engine (`steps`, train/engines.py: accelerate's DDP by default)."""
    from ..models.lora import add_lora, load_lora_checkpoint, merge_preset_lora
    from ..models.precision import adapters_to_fp32, enable_checkpointing, place, store_fp8, swap_blocks
    from ..models.shards import deferred

    lora, prefixes = cfg.lora, cfg.prefixes
    if lora.preset_path:
        if lora.preset_model not in models:
            raise BackendError(f"--preset_lora_model {lora.preset_model!r} is not loaded in this stage "
                               f"(stage models: {', '.join(sorted(models))})")
        merge_preset_lora(models[lora.preset_model], lora.preset_model, lora.preset_path, prefixes[lora.preset_model],
                          prefixes=prefixes)
    for slot in cfg.optim.trainable:
        models[slot].requires_grad_(True)
        models[slot].train()
    lora_config = None
    if lora.base_model:
        base = models[lora.base_model]
        check_rank(base, lora.base_model, list(lora.targets), lora.rank)
        lora_config = add_lora(base, lora.base_model, list(lora.targets), lora.rank, lora.alpha, cfg.seed,
                               kind=lora.kind, rslora=lora.rslora)
        adapters_to_fp32(base)  # peft made them in the base's dtype; trained parameters stay fp32
        base.train()
        if lora.checkpoint:
            load_lora_checkpoint(base, lora.base_model, lora.checkpoint, prefixes)
        if lora.base_model in cfg.precision.fp8:
            store_fp8(base, lora.base_model, cfg.precision.compute_dtype)  # after the adapters: they stay fp32
        if cfg.precision.blocks_to_swap:
            if accelerator.num_processes > 1 and accelerator.device.type == "cuda":
                raise BackendError("--blocks_to_swap works in one process (DDP needs every weight on the device); "
                                   "drop it or train with one process per run")
            swap_blocks(base, lora.base_model, cfg.precision.blocks_to_swap, accelerator.device, report)
        if deferred(base) is None:  # a model built without weights gets them in its shards (steps.prepare)
            place(base, accelerator.device)  # all but the swapped weights (models/stage.py kept it in CPU memory)
    if cfg.optim.gradient_checkpointing:
        for slot in plan.models_require_backward:
            enable_checkpointing(models[slot])
    steps = steps or steps_for(accelerator, cfg.engine, cfg.optim.max_grad_norm, cfg.optim.batch_size)

    def optimizer(params: list[Any]) -> Any:  # --optimizer (AdamW by default), train/optimizers.py
        return build_optimizer(cfg.optim.optimizer, cfg.optim.optimizer_args, params, cfg.optim.learning_rate,
                               cfg.optim.weight_decay)

    compute = getattr(torch, cfg.precision.compute_dtype) if cfg.precision.mixed != "no" else None
    wrapped, optimizer = steps.prepare(models, list(plan.models_require_backward), optimizer, compute)
    return wrapped, optimizer, lora_config


def check_rank(model: Any, slot: str, targets: list[str], rank: int) -> None:
    """--lora_rank at most the widest targeted layer's largest side: beyond it no layer can use the rank (the
    adapter's product has rank at most min(in, out)), and a rank of 100000 would only allocate gigabytes a layer."""
    widths = [max(m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith(f".{t}") for t in targets)]
    if widths and rank > max(widths):
        raise BackendError(f"--lora_rank {rank} is larger than any layer it targets in {slot} (at most {max(widths)}, "
                           "the widest side of the targeted layers)")


def save(cfg: RunConfig, output: Path, name: str, models: dict[str, Any], lora_config: Any, accelerator: Any,
         steps: Any = None, tensors: Optional[dict[str, dict[str, Any]]] = None) -> Optional[Path]:
    """Write a checkpoint of what trains (main process). Every process calls it: under a sharded engine each trained
    tensor is gathered whole, one at a time, and kept by the main process only. `tensors` ({slot: {parameter name:
    tensor}}) writes those in place of the trained weights, in the same layout (the moving average, --ema_decay)."""
    steps = steps or steps_for(accelerator, cfg.engine, None)
    if not (accelerator.is_main_process or steps.gathers):
        return None
    slots = [*cfg.optim.trainable, *([cfg.lora.base_model] if cfg.lora.base_model else [])]
    raw = {slot: steps.unwrap(m) for slot, m in models.items()}
    if tensors is None:
        tensors = {slot: steps.trained_tensors(models[slot]) for slot in dict.fromkeys(slots)}
    if not accelerator.is_main_process:
        return None
    state = checkpoint_state(raw, cfg.lora.base_model, cfg.optim.trainable, cfg.prefixes, tensors)
    prefix = cfg.prefixes[cfg.lora.base_model] if cfg.lora.base_model else None
    remove = diffusers_remove_prefix(cfg.output.remove_prefix, cfg.prefixes, cfg.optim.trainable, cfg.output.lora_format)
    return save_checkpoint(output / name, state, prefix, lora_config, remove, cfg.output.lora_format, cfg.prefixes)


class LossLog:
    """loss.csv, written row by row on the main process (each row flushed as it is written): step, epoch, loss, the
    step's mean timestep (sigma x 1000 of the training schedule, before any cast) and the seconds since the start."""

    def __init__(self, path: Path, main: bool, rows: Optional[list[Any]] = None, norms: bool = False):
        """A new log, or with `rows` (a resumed run's rows so far) the log rewritten to exactly those rows; `norms`
        adds the grad_norm column (--max_grad_norm: the gradients' global norm before clipping)."""
        self.path, self.rows, self.norms = path, [], norms
        self._file = self._writer = None
        if main:
            try:
                self._file = path.open("w", encoding="utf-8", newline="")
                self._writer = csv.writer(self._file)
                self._file.write("step,epoch,loss,timestep,elapsed_s" + (",grad_norm" if norms else "") + "\n")
                self._file.flush()
                for row in rows or ():
                    step, epoch, loss, elapsed, timestep = row[:5]
                    norm = row[5] if len(row) > 5 else None
                    self.add(int(step), int(epoch), float(loss), float(elapsed),
                             None if timestep is None else float(timestep), None if norm is None else float(norm))
            except OSError as exc:
                raise OutputError(f"cannot write the loss log ({exc.strerror or exc})", source=str(path)) from None

    def add(self, step: int, epoch: int, loss: float, elapsed: float, timestep: Optional[float] = None,
            norm: Optional[float] = None) -> None:
        """One optimizer step's row; `timestep` is the step's mean timestep (empty for a loss that draws none),
        `norm` the gradients' norm before clipping (with --max_grad_norm)."""
        self.rows.append((step, epoch, loss, elapsed, timestep, *((norm,) if self.norms else ())))
        if self._writer is not None:
            try:
                self._writer.writerow([step, epoch, repr(loss), "" if timestep is None else f"{timestep:.4f}",
                                       f"{elapsed:.6f}", *(("" if norm is None else repr(norm),) if self.norms else ())])
                self._file.flush()
            except OSError as exc:
                raise OutputError(f"cannot write the loss log ({exc.strerror or exc}) at step {step}; the rows and "
                                  "checkpoints written so far are kept", source=str(self.path)) from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def micro_step(cfg: RunConfig, ctx: Any, ready: Any, elements: list[Any], epoch: int, total: int, sync: bool,
               trained: list[Any], accelerator: Any, seeded: bool, check: Any, steps: Any = None) -> Any:
    """Forward and backward of one micro-batch; its loss (detached) and its samples' mean timestep (None for a
    loss that draws none).

    `ready` yields the batch's sink inputs: the units that call models run there, inside the step's
    dropout stream, as the sink does. `check(loss, elements)` stops on a NaN before the weights change.
    """
    keys = [e.sample_key for e in elements]
    steps = steps or steps_for(accelerator, cfg.engine, None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(steps.micro(trained, sync))  # gradients synchronised on the step's last micro-batch
        if seeded:
            stack.enter_context(seeded_global_stream(cfg.seed, "dropout", epoch, *keys))
        # --use_gradient_checkpointing_offload: what autograd keeps for backward is held in CPU memory
        stack.enter_context(offloaded_activations(cfg.precision.checkpoint_offload, accelerator.device))
        batch = next(ready)
        if batch.sample_keys != keys:  # pragma: no cover - iterate() follows the order it was given
            raise RuntimeError(f"stage 2 batches out of order: {batch.sample_keys} instead of {keys}")
        ctx.epoch, ctx.sample_key = epoch, keys[0]
        loss = cfg.pipeline.loss(ctx, batch.inputs)
        check(loss, elements)
        # a micro-batch loss is a mean over its samples: weight it by its share of the step
        # (one micro-batch per step: the loss as it is, value and gradient)
        n = len(elements)
        steps.backward(loss if n == total else loss / total if n == 1 else loss * n / total, trained, sync)
    timestep = batch.inputs.get("timestep")
    return loss.detach().float(), None if timestep is None else timestep.detach().float().mean()


def run_training(cfg: RunConfig, plan: Plan, provider: Any, data: Any, accelerator: Any, output: Path,
                 result: RunResult, stage_name: str, report: Optional[Any] = None) -> None:
    """The optimizer over `data`'s micro-batches; loss.csv, checkpoints and the loss plot in `output`.

    The output folder is claimed (outputs.RunFolder: checked, locked, an earlier run moved aside with
    --overwrite) only once every input has been checked and the models are loaded.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    if not data.batches(0, rank, world):
        raise BackendError(f"nothing to train on: no samples for process {rank} ({len(provider.items)} samples)")
    models = load_models(cfg, provider.models, training=True, device=accelerator.device)
    steps = steps_for(accelerator, cfg.engine, cfg.optim.max_grad_norm, cfg.optim.batch_size)
    models, optimizer, lora_config = prepare_models(cfg, plan, models, accelerator, report, steps)
    if report is not None and steps.note():
        report.note(steps.note())
    # --resume: the state is read and checked whole before the folder is claimed, so a refusal changes nothing
    per_epoch = len(step_groups(data.batches(0, rank, world), cfg.optim.accumulation))
    match = must_match(cfg, plan, world, data=data_identity(provider), steps_per_epoch=per_epoch)
    checked = resume_point(cfg, output, trained_parameters(models, plan.models_require_backward), optimizer, match,
                           per_epoch, accelerator.is_main_process, steps, accelerator.process_index)
    run = (cfg, plan, provider, data, accelerator, output, result, stage_name, models, optimizer, lora_config, match,
           checked, steps)
    if accelerator.is_main_process:
        folder = RunFolder(output)
        record = {"task": cfg.args.task, "pipeline": plan.pipeline, "plan_fingerprint": plan.fingerprint}
        with folder.claimed(cfg.output.overwrite, record, resume=cfg.output.resume is not None):
            result.replaced = folder.replaced
            if report is not None:
                report.flush()  # every check passed: the notes about the flags
            _Run(*run).run()
    else:
        _Run(*run).run()


class _Run:
    """One training run's moving parts, set up once; `run()` is the loop.

    Every process builds one and calls the same methods at the same steps (the collective calls,
    wait_for_everyone and the loss reduction, line up); only the main process writes files.
    """

    def __init__(self, cfg: RunConfig, plan: Plan, provider: Any, data: Any, accelerator: Any, output: Path,
                 result: RunResult, stage_name: str, models: dict[str, Any], optimizer: Any, lora_config: Any,
                 match: dict[str, Any], checked: Any = None, steps: Any = None):
        self.cfg, self.plan, self.provider, self.data, self.acc = cfg, plan, provider, data, accelerator
        self.output, self.result, self.models, self.optimizer, self.lora_config = output, result, models, optimizer, lora_config
        self.world, self.rank, self.main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
        result.plan_path = write_run_files(cfg, plan, output, accelerator)
        self.ctx = make_context(cfg, models, accelerator.device)
        self.ctx.empty_prompt = empty_prompt_encoding(cfg, plan, provider, self.ctx, getattr(data, "dtype", None))
        self.steps = steps or steps_for(accelerator, cfg.engine, cfg.optim.max_grad_norm, cfg.optim.batch_size)
        self.trained = [models[s] for s in plan.models_require_backward]
        # Dropout draws from torch's global stream: each micro-step seeds it from its samples' keys, so the
        # unsplit and the split run draw the same masks. Without any active dropout there is nothing to seed.
        self.seeded = draws_dropout(models)
        self.params = trained_parameters(models, plan.models_require_backward)
        self.match = match
        if self.main:
            remove_partial_states(output)  # a state write a kill interrupted (this run holds the folder's lock)
        accelerator.wait_for_everyone()
        self.start = None
        if checked is not None:
            with self.steps.state_view(optimizer) as view:
                self.start = apply_state(checked, self.params, view, self.steps.scatter, self.steps.restore)
        # --ema_decay: the moving average of the trained weights (train/ema.py), as the state left it when resuming
        o = cfg.optim
        self.ema = (TrainedEMA(self.params, o.ema_decay, o.ema_device or accelerator.device)
                    if o.ema_decay is not None else None)
        if self.ema is not None and checked is not None:
            self.ema.restore(checked.ema, checked.ema_step)
        if self.start is not None:
            result.resumed_from = self.start.path
            if self.main:
                print(f"resuming from {self.start.path} (step {self.start.step}, epoch {self.start.epoch})")
                newest = latest_state(output)  # a kill between a new state and the pruning of the oldest left one
                if newest is not None and Path(self.start.path).resolve() == newest.resolve():  # too many
                    prune_states(output, cfg.output.save_total_limit)
        self.log = LossLog(output / "loss.csv", self.main, rows=self.start.rows if self.start else None,
                           norms=cfg.optim.max_grad_norm is not None)
        per_epoch = len(step_groups(data.batches(0, self.rank, self.world), cfg.optim.accumulation))
        self.bar = progress(None, per_epoch * cfg.optim.num_epochs, stage_name,
                            cfg.output.progress and accelerator.is_local_main_process)
        self.step = self.start.step if self.start else 0
        # --lr_scheduler on the optimizer itself (accelerate's wrapper would step it once per process), at this step
        self.lr = make_lr_schedule(cfg.optim.lr_scheduler, base_optimizer(optimizer),
                                   cfg.optim.lr_warmup_steps, per_epoch * cfg.optim.num_epochs)
        seek(self.lr, self.step)
        self.offset = self.start.elapsed if self.start else 0.0  # elapsed_s continues where the resumed run stopped
        self.t0: Optional[float] = None  # when this process's first step started, less the resumed run's time
        self.last: Optional[float] = None  # when the previous step ended
        self.bar.update(self.step)
        self.tracking = cfg.output.report_to != "none"
        self.held: Optional[tuple[int, int]] = None
        if self.tracking:
            accelerator.init_trackers(cfg.args.wandb_project or f"{plan.pipeline}-{cfg.args.task.replace(':', '-')}",
                                      config={k: v for k, v in vars(cfg.args).items()
                                              if isinstance(v, (int, float, str, bool))})
        self.validator = self._validator()
        # --validation_dataset: the loss on the held-out entries (train/held_out.py), every process computing it
        self.held_out = getattr(provider, "held_out_data", None)
        self.held_out_log = (HeldOutLog(output / HELD_OUT_FILE, self.main, self.start.step if self.start else None)
                             if self.held_out is not None else None)

    def run(self) -> None:
        cfg = self.cfg
        try:
            for epoch in range(cfg.optim.num_epochs):
                groups = step_groups(self.data.batches(epoch, self.rank, self.world), cfg.optim.accumulation)
                done = steps_done(self.start, epoch, len(groups))
                if done >= len(groups):
                    continue  # this epoch was finished before the resumed state
                remaining = [batch for group in groups[done:] for batch in group]
                ready = self.data.iterate(epoch, self.ctx, self.rank, self.world, batches=remaining,
                                          workers=cfg.data.num_workers)
                try:
                    for position, group in enumerate(groups[done:], start=done + 1):
                        self.optimizer_step(epoch, group, ready)
                        # a state is saved after what it covers (the step's checkpoint and samples): a run
                        # killed before it redoes them, one killed after it has them all
                        last_of_epoch = position == len(groups)
                        saving = bool(cfg.output.save_steps) and self.step % cfg.output.save_steps == 0
                        if saving:
                            self.checkpoint(f"step-{self.step}.safetensors")
                        every = cfg.validation.steps or (cfg.output.save_steps if not last_of_epoch else None)
                        if every and self.step % every == 0:  # --validation_steps, else each --save_steps checkpoint
                            self.samples(f"step-{self.step}")
                        if cfg.validation.steps and self.step % cfg.validation.steps == 0:
                            self.held_out_loss(epoch)
                        if saving and not last_of_epoch:  # the epoch's end saves its own state just below
                            self.keep_state(epoch, position)
                finally:
                    ready.close()
                self.checkpoint(f"epoch-{epoch}.safetensors")
                if not cfg.validation.steps:  # and at each epoch's checkpoint
                    self.samples(f"epoch-{epoch}")
                    self.held_out_loss(epoch)
                self.keep_state(epoch, len(groups))
        finally:
            self.log.close()
            if self.held_out_log is not None:
                self.held_out_log.close()
            self.bar.close()
            if self.tracking:
                self.acc.end_training()
        self.finish()

    def optimizer_step(self, epoch: int, group: list[Any], ready: Any) -> None:
        """The micro-batches of one optimizer step (gradients synchronised on the last), the step, its log row."""
        cfg, acc = self.cfg, self.acc
        self.t0 = time.perf_counter() - self.offset if self.t0 is None else self.t0
        total = sum(len(b) for b in group)
        step = self.step

        def check(loss: Any, elements: list[Any]) -> None:
            stop_on_bad_loss(loss, step + 1, epoch, [e.item for e in elements], self.provider, acc, self.result,
                             self.data.batch_size)

        steps = [micro_step(cfg, self.ctx, ready, b, epoch, total, k == len(group) - 1, self.trained, acc,
                            self.seeded, check, self.steps) for k, b in enumerate(group)]
        rate = base_optimizer(self.optimizer).param_groups[0]["lr"]
        norm = self.steps.step(self.optimizer, self.params.values())
        if self.ema is not None:
            self.ema.update(self.params)
        lr_step(self.lr)
        self.step += 1
        loss, now = step_loss([(v, len(b)) for (v, _), b in zip(steps, group)], total, acc), time.perf_counter()
        timestep = step_timestep([(t, len(b)) for (_, t), b in zip(steps, group)], total, acc)
        took = now - (self.last if self.last is not None else self.t0 + self.offset)
        if self.held is None and (cfg.engine.kind != "ddp" or self.world > 1):  # after the first step, when the
            self.held = held_bytes(self.models, self.optimizer)                # optimizer's state exists
            self.result.held_bytes = self.held
        self.log.add(self.step, epoch, loss, now - self.t0, timestep, norm)
        self.result.step_times.append(took)
        if norm is not None:
            self.result.grad_norms.append(norm)
        if self.tracking:
            acc.log({"loss": loss, "learning_rate": rate, "step_time_s": took,
                     **({"grad_norm": norm} if norm is not None else {})}, step=self.step)
        self.last = now
        if not self.bar.disable:  # a plain string: set_postfix's formatting of keyword pairs shows at test size
            self.bar.set_postfix_str(f"loss={loss:.4f}, epoch={epoch}", refresh=False)
        self.bar.update(1)

    def checkpoint(self, name: str) -> None:
        with eval_weights(self.optimizer):  # a schedule-free optimizer's averaged weights
            checkpoint(self.cfg, self.output, name, self.models, self.lora_config, self.acc, self.result, self.steps)
        if self.ema is not None and (self.main or self.steps.gathers):  # beside it: the moving average, whole
            slots = list(dict.fromkeys(self.plan.models_require_backward))
            tensors = self.ema.by_slot(slots, self.steps.full if self.steps.gathers else None)
            if self.main:
                save(self.cfg, self.output, ema_name(name), self.models, self.lora_config, self.acc, self.steps,
                     tensors=tensors)

    def keep_state(self, epoch: int, position: int) -> None:
        """The resumable state after `position` steps of `epoch` (main process), the oldest beyond --save_total_limit pruned."""
        steps = self.steps
        if self.main or steps.gathers or steps.per_rank_state:  # sharded: every process gathers or writes its part
            elapsed = time.perf_counter() - self.t0 if self.t0 is not None else self.offset
            with steps.state_view(self.optimizer) as view:
                ranks = None
                if steps.per_rank_state and self.world > 1:  # each process's optimizer file, then the state
                    ranks = staging_folder(self.output, self.step)
                    if not self.main:
                        save_rank_file(ranks, self.rank, view)
                    self.acc.wait_for_everyone()
                save_state(self.output, self.step, epoch, position, elapsed, self.log.rows, self.params, view,
                           self.match, full=steps.full, write=self.main, ranks=ranks,
                           offset=self.start.offset if self.start else 0, ema=self.ema)
            if self.main:
                prune_states(self.output, self.cfg.output.save_total_limit)
        self.acc.wait_for_everyone()

    def _validator(self) -> Any:
        """The validation renderer (with --validation_prompt), announced in one line: the main process's, and under an
        engine that shards the trained weights (ZeRO-3, FSDP2) every process's, as each forward gathers the layers
        together (the main process alone writes the samples)."""
        cfg = self.cfg
        together = cfg.engine.kind == "fsdp2" or cfg.engine.shards_frozen
        if not cfg.validation.prompts or not (self.main or together):
            return None
        from .validation import Validator

        validator = Validator(cfg, self.plan, self.output, getattr(self.provider, "cache_dir", None),
                              getattr(self.provider, "key_hash", None), write=self.main)
        shown = ", ".join(validator.render_slots) or "nothing more"
        every = f"every {cfg.validation.steps} steps" if cfg.validation.steps else "at each checkpoint"
        if self.main:
            print(f"validation: {len(cfg.validation.prompts)} prompt(s) rendered {every}; loads {shown} only while "
                  "rendering" + ("; every process renders with it, gathering the sharded layers" if together else ""))
        return validator

    def samples(self, name: str) -> None:
        """Validation samples now (every process calls it at the same steps; the main process renders, with the others
        under a sharding engine)."""
        if not self.cfg.validation.prompts:
            return
        with eval_weights(self.optimizer):  # on every process: the weights stay the same on each
            if self.validator is not None:
                with optional_swap(self.ema, self.params, self.cfg.validation.use_ema):  # --validation_use_ema
                    self.result.sample_images.extend(self.validator.render(name, self.models, self.ctx, self.acc))
        self.acc.wait_for_everyone()

    def held_out_loss(self, epoch: int) -> None:
        """The loss on the held-out samples now (--validation_dataset): a row of validation_loss.csv, and the
        trackers' validation_loss."""
        if self.held_out is None:
            return
        value = held_out_loss(self.cfg, self.held_out, self.ctx)
        self.held_out_log.add(self.step, epoch, value, len(self.held_out.items))
        if self.tracking:
            self.acc.log({"validation_loss": value}, step=self.step)

    def finish(self) -> None:
        result, rows = self.result, self.log.rows
        result.steps, result.losses, result.loss_csv = self.step, [r[2] for r in rows], self.log.path
        held = self.held_out_log.rows if self.held_out_log is not None else []
        if self.main and self.cfg.output.plot:
            result.loss_plot = write_loss_plot(rows, self.output / "loss.png", f"{self.plan.pipeline} · {self.cfg.args.task}",
                                               held_out=held)
        self.acc.wait_for_everyone()


def save_rank_file(folder: Path, rank: int, optimizer: Any) -> None:
    """This process's optimizer state (DeepSpeed's partition of it) into the folder the main process moves into the
    training state (resume.save_state)."""
    from safetensors.torch import save as to_bytes

    from unitgraph.atomic import write_bytes_atomic

    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(folder / rank_file(rank), to_bytes(optimizer_tensors(optimizer)))
    except OSError as exc:
        raise OutputError(f"cannot write process {rank}'s optimizer state ({exc.strerror or exc})",
                          source=str(folder)) from None


def steps_done(start: Any, epoch: int, steps: int) -> int:
    """Optimizer steps of `epoch` (of `steps`) a resumed state already made: all of an earlier epoch, its
    position in its own (all of it when the state ends it: made by another number of processes, its count of
    steps may not be this run's), none of a later one (or without a state)."""
    if start is None or epoch > start.epoch:
        return 0
    return start.position if epoch == start.epoch and not start.epoch_done else steps


def resume_point(cfg: RunConfig, output: Path, params: dict[str, Any], optimizer: Any, match: dict[str, Any],
                 per_epoch: int, main: bool = True, steps: Any = None, rank: int = 0) -> Any:
    """--resume: the state to continue from, read and checked whole against this run (nothing restored yet, nothing
    changed), or None to start at step 0 (plain --resume in a folder whose run has not saved a state yet)."""
    if cfg.output.resume is None:
        return None
    path = latest_state(output) if cfg.output.resume == "latest" else Path(cfg.output.resume)
    if path is None:
        made = sorted(p.name for p in output.glob("*.safetensors")) if output.is_dir() else []
        if made:
            raise BackendError(f"--resume: the run here saved checkpoints ({', '.join(made[:3])}) but no training state "
                               "is left (state/ deleted?); continuing from step 0 would train over them: start anew "
                               "with --overwrite, or resume from a state folder", source=str(output))
        if main:
            print(f"note: --resume: no training state in {output} yet; training starts at step 0")
        return None
    if not (path / "state.json").is_file():
        raise BackendError("--resume: not a training state folder (no state.json); states are OUTPUT/state/step-N",
                           source=str(path))
    if steps is None:
        checked = check_state(path, params, optimizer, match)
    else:  # under an engine: its whole shapes, and under DeepSpeed this process's own optimizer file
        with steps.state_view(optimizer) as view:
            checked = check_state(path, steps.check_params(params), view, match,
                                  rank if steps.per_rank_state else 0)
    point = check_progress(path, checked.point, per_epoch, cfg.optim.num_epochs)
    checked = dataclasses.replace(checked, point=point)
    if main and point.processes not in (None, match.get("processes")):  # allowed by check_state
        into = " into this run's shards" if cfg.engine.kind == "fsdp2" else ""
        print(f"note: --resume: the state was made by {point.processes} processes, this run has "
              f"{match.get('processes')}: its weights and {optimizer_label(cfg.optim.optimizer)}'s state are "
              f"restored whole{into}, and from epoch {point.epoch + 1} on each epoch's samples are dealt to "
              f"{match.get('processes')} processes ({per_epoch} steps an epoch, {point.per_epoch} before)")
    return checked


def step_loss(losses: list[tuple[Any, int]], total: int, accelerator: Any) -> float:
    """The optimizer step's loss: the mean over its samples (over every process)."""
    if len(losses) == 1 and accelerator.num_processes == 1:  # one micro-batch (the usual step): its loss as it is
        return float(losses[0][0])
    value = (torch.stack([v for v, _ in losses]).mean() if all(n == 1 for _, n in losses)
             else sum(v * n for v, n in losses) / total)
    if accelerator.num_processes > 1:
        value = accelerator.reduce(value.to(accelerator.device), reduction="mean")
    return float(value)


def step_timestep(timesteps: list[tuple[Any, int]], total: int, accelerator: Any) -> Optional[float]:
    """The optimizer step's mean timestep over its samples (over every process), as loss.csv records it: the
    schedule's sigma x 1000 each sample was trained at; None when the loss draws no timestep."""
    if any(t is None for t, _ in timesteps):
        return None
    value = sum(t * n for t, n in timesteps) / total
    if accelerator.num_processes > 1:
        value = accelerator.reduce(value.to(accelerator.device), reduction="mean")
    return float(value)


def checkpoint(cfg: RunConfig, output: Path, name: str, models: dict[str, Any], lora_config: Any, accelerator: Any,
               result: RunResult, steps: Any = None) -> None:
    accelerator.wait_for_everyone()
    path = save(cfg, output, name, models, lora_config, accelerator, steps)
    if path is not None:
        result.checkpoints.append(path)


def write_run_files(cfg: RunConfig, plan: Plan, output: Path, accelerator: Any) -> Path:
    """plan.json and training_args.json beside the run's outputs (main process)."""
    path = output / "plan.json"
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, plan.to_json())
        write_text_atomic(output / "training_args.json", cfg.args.to_json())
    return path


def read_loss_csv(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8", newline="") as handle:
        return [{"step": int(r["step"]), "epoch": int(r["epoch"]), "loss": float(r["loss"]),
                 "timestep": float(r["timestep"]) if r.get("timestep") else None, "elapsed_s": float(r["elapsed_s"])}
                for r in csv.DictReader(handle)]


def stop_on_bad_loss(loss: torch.Tensor, step: int, epoch: int, items: list[Any], provider: Any, accelerator: Any,
                      result: RunResult, width: int = 1) -> None:
    """A NaN or infinite loss stops training before it reaches the weights, naming the step and the sample(s).

    With several processes every process learns whether any of them saw one (one tiny all-gather
    per micro-step: a flag, the loss and the indices of up to `width` samples), so they all stop
    together instead of waiting on each other in backward.
    """
    value = float(loss.detach().float())
    bad = not math.isfinite(value)
    if accelerator.num_processes > 1:
        indices = [float(it.index) for it in items][:width]
        indices += [-1.0] * (width - len(indices))
        mine = torch.tensor([[float(bad), value if bad else 0.0, *indices]], dtype=torch.float64, device=accelerator.device)
        every = accelerator.gather(mine).cpu().tolist()
        culprits = [(rank, row) for rank, row in enumerate(every) if row[0] > 0]
        if not culprits:
            return
        rank, row = culprits[0]
        value = row[1]
        names = {it.index: it for it in provider.items}
        items = [names.get(int(i), CachedItem(int(i), "")) for i in row[2:] if i >= 0]
        where = f" (process {rank})"
    elif not bad:
        return
    else:
        where = ""
    last = result.checkpoints[-1] if result.checkpoints else None
    if last is None and result.resumed_from is not None:
        kept = f"the run resumed from {result.resumed_from} and its checkpoints are kept"
    else:
        kept = f"the last good checkpoint is kept: {last}" if last else "no checkpoint had been saved yet"
    labels = [provider.label(it) for it in items]
    on = labels[0] if len(labels) == 1 else f"a batch of {len(labels)}: {'; '.join(labels)}"
    raise BackendError(f"loss is {value} at step {step} (epoch {epoch}) on {on}{where}: "
                       f"training stopped before updating the weights; {kept}")


def write_loss_plot(rows: list[tuple[int, int, float, float]], path: Path, title: str,
                    held_out: Any = ()) -> Optional[Path]:
    """loss.png: the training loss by step (and its running mean), with the held-out loss's points
    (--validation_dataset: rows of (step, epoch, loss, samples)) when there are any."""
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
    if held_out:
        ax.plot([r[0] for r in held_out], [r[2] for r in held_out], marker="o", linewidth=1,
                label="held-out (--validation_dataset)")
    if len(losses) >= 10 or held_out:
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_bytes_atomic(path, buffer.getvalue())
    return path


_DROP_NAME = re.compile(r"Drop|dropout|drop_?path")


def draws_dropout(models: dict[str, Any]) -> bool:
    """Whether a training step can draw from torch's global random stream: some model in training mode
    has an active dropout (a dropout module with p > 0, a module of another kind named like one, or a
    positive `*dropout*` / `drop_path*` value in its config). When none has, the seeded dropout stream
    around each micro-step changes no number and is skipped."""
    for model in models.values():
        if not isinstance(model, torch.nn.Module):
            continue
        for module in model.modules():
            if not module.training:
                continue
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                if float(module.p) > 0:
                    return True
            elif _DROP_NAME.search(type(module).__name__):  # DropPath, StochasticDropout, ... (not EmbedRope)
                return True
            config = getattr(module, "config", None)
            if config is not None and _config_dropout(config):
                return True
    return False


def _config_dropout(config: Any, depth: int = 0) -> bool:
    if depth > 4:
        return False
    items = config.items() if isinstance(config, dict) else vars(config).items() if hasattr(config, "__dict__") else ()
    for key, value in items:
        if isinstance(value, (dict,)) or (hasattr(value, "__dict__") and not isinstance(value, (str, bytes, type))
                                          and type(value).__module__.startswith(("transformers", "diffusers"))):
            if _config_dropout(value, depth + 1):
                return True
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
                and ("dropout" in str(key).lower() or "drop_path" in str(key).lower()):
            return True
    return False

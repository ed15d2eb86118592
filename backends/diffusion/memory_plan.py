"""The memory plan of a run (`--dry_run`): what stage 1, stage 2 and the unsplit run hold on the device, from configs.

`memory_plan(cfg, plan)` reads each model's config.json (never its weights) and returns, per stage, the models the
stage loads with their storage dtype and bytes, the trainable state, the activations of one step and the peak;
`format_memory_plan` renders it as a table (GiB, 2 decimals). Nothing is written, nothing is downloaded.

How the estimate is made:

- **Weights.** Each model slot is built from its config.json on the meta device (accelerate's `init_empty_weights`,
  the slot's class) and set up with the very calls a run makes (models/stage.py, train/loop.py): frozen weights
  at the compute dtype, except the modules the library itself keeps in fp32 (diffusers' `_keep_in_fp32_modules`;
  transformers' strict list at bf16, both lists at fp16); a model trained in full at fp32; the LoRA base gets its
  adapter through `models.lora.add_lora` and `precision.adapters_to_fp32`; `--fp8_models` through
  `precision.store_fp8`. The bytes are summed per storage dtype over the built parameters (tied ones once).
- **Trainable state.** Per trained parameter its fp32 value and gradient (8 bytes) and what the optimizer keeps for it
  (`train/optimizers.state_bytes`, from the parameter's shape): AdamW's two moments, 8 bytes, so 16 in all;
  Adafactor's row and column factors, a few bytes a matrix; Prodigy's 16; ... (docs/objective.md, 'Optimizers').
- **EMA.** With --ema_decay, 4 bytes per trained parameter (the moving average's fp32 copy) on the device, or in
  host memory with --ema_device cpu.
- **Activations.** One training step is traced under torch's FakeTensorMode: the built models' parameters become
  fake tensors of the same shapes and dtypes, the family's `memory.py` gives the loss's inputs at the run's size
  (and the encoders' calls), the loss runs as a run calls it (`PipelineDef.loss` under the context's autocast), then
  its backward. A TorchDispatchMode (`StorageLog`) logs every storage created and freed meanwhile; the activations
  are the peak of the live bytes, leaving out the trained parameters' gradients (in the trainable state). Gradient
  checkpointing runs as the run's (`precision.enable_checkpointing`), with its recomputation in the backward;
  fp8 storage runs as `store_fp8` set it up (a Linear or zero-padded convolution layer casts its fp8 weight for each
  product, forward and backward; other Conv and Embedding layers through diffusers' layerwise casting hook, which fake tensors run with
  compute-dtype copies in place of the stored parameters, `trace_layerwise_casting`);
  `--use_gradient_checkpointing_offload` moves every tensor autograd saves off the device (as `save_on_cpu`
  does) and counts it as host bytes. Stage 1's activations are the largest of its encoders' no-grad forwards at
  the run's size, traced the same way; the unsplit run's the larger of those and the step's.
- **Peak** = weights + trainable state + activations (+ what an engine gathers and allocates, below). With
  `--blocks_to_swap N` the frozen Linear weights of the last N blocks of the LoRA base leave the device
  (`precision.swap_blocks`), the largest counted back in flight. The device's own overhead (CUDA context, allocator
  fragmentation, kernels' workspaces) is not in it: allow 0.5-1.5 GiB on a GPU.
- **Per process, under an engine** (`cfg.engine`: `--config_file X --num_processes N`, engine.py). Every figure is
  one process's; what it keeps in host memory is `host_bytes` apart (`host`: weights, trainable state,
  activations). Stage 1 trains nothing and is the same under every engine; a model a training stage does not
  prepare for the backward (a frozen encoder) is whole on every process; the activations are one process's batch.
  The models the engine prepares (`plan.models_require_backward`, as train/loop.py) are counted by
  `engine_share`: ZeRO-1/2 keep every weight whole and split AdamW's state (ZeRO-2 the gradients too; with
  offload_optimizer an fp32 copy of the partition in host memory too); ZeRO-3 splits every weight, frozen base included, in ceil(numel/N)
  partitions but keeps the parameters of at most stage3_param_persistence_threshold elements whole; FSDP2 splits
  each parameter's dim 0 (ceil), its gradient and AdamW's state; offload moves the named parts to host memory.
  Beside the shards a process holds whole weights while layers compute (`gathered_bytes`: ZeRO-3 up to
  stage3_max_live_parameters elements, FSDP2 the root's own, two blocks and one block's gradients) and DeepSpeed
  allocates its gradient bucket (`engine_buffer_bytes`, reduce_bucket_size fp32 elements). DeepSpeed settings
  absent or "auto" are DeepSpeed's defaults.

Measured error (benchmarks/memory_plan_table.py, docs/memory.md; on this CPU, no GPU here): the weights and the
trainable state are exact counts (tests/test_memory_plan.py compares them with the models a run loads). One real
training step of each registered family's demo-size models, its storages logged by the same tracker on real
tensors, creates what the fake trace says to within 0.3 MiB (a CPU kernel's buffer); the heap in use during the
step (glibc's mallinfo2 after every op) exceeds the estimate by 0.2-2.5 % without checkpointing and 3-10 % with it
(a constant 0.5-0.9 MiB of Python and autograd objects on steps of 8-164 MiB), each encoder's forward by under 3 %.
Shapes the families' memory modules assume: text at its longest (512 tokens), a square image of --max_pixels when
no --height/--width is given, one edit or reference image at the target's size, one sampler step for direct
distillation; the Qwen2.5-VL vision tower of the edit pipelines is not traced.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional

from .args import image_pixel_limit
from .config import precision_note
from .errors import BackendError
from .memory_trace import HostSaved, StorageLog, trace_layerwise_casting
from .train.optimizers import optimizer_label

if TYPE_CHECKING:  # annotations only
    from unitgraph.plan import Plan

    from .config import RunConfig

STAGES = ("data_process", "train", "unsplit")
STAGE_TITLES = {"data_process": "stage 1 (data_process)", "train": "stage 2 (train)", "unsplit": "unsplit run"}
TRAINABLE_BYTES_PER_PARAM = 16  # fp32 value 4 + gradient 4 + AdamW exp_avg 4 + exp_avg_sq 4
VALUE_AND_GRAD_BYTES = 8  # a trained parameter's fp32 value and gradient, whatever the optimizer
EMA_BYTES_PER_PARAM = 4  # --ema_decay: the moving average keeps an fp32 copy of each trained parameter
GIB = 1 << 30
# Bounds on what a config.json may make, checked on the meta-device model before a parameter becomes a fake tensor or
# a step is traced (docs/safety.md): released models stay far below (Qwen-Image's DiT: 20 B parameters, its largest
# tensor 3072 x 18432 = 5.7e7 elements); past them a config describes no model any device holds.
MAX_PARAMS = 10**12
MAX_TENSOR_ELEMENTS = 1 << 40


# ------------------------------------------------------------------------------------------------
# models built from their configs


@dataclass
class Built:
    """One model slot as a stage holds it: counted on meta, then its parameters made fake for the traces."""

    slot: str
    role: str  # frozen, lora, full
    model: Any
    bytes_by_dtype: dict[str, int]
    params: int
    trainable_params: int
    swapped_bytes: int = 0
    in_flight_bytes: int = 0
    fp8_params: int = 0
    notes: list[str] = field(default_factory=list)
    trained_bytes: Optional[int] = None  # value, gradient and optimizer state of the trained parameters (None: AdamW's)

    @property
    def trainable_bytes(self) -> int:
        """Bytes of the trained parameters with their gradients and the optimizer's state."""
        return self.trainable_params * TRAINABLE_BYTES_PER_PARAM if self.trained_bytes is None else self.trained_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of its frozen weights on the device (trained parameters are in the trainable state)."""
        return sum(self.bytes_by_dtype.values()) - self.swapped_bytes + self.in_flight_bytes

    @property
    def dtype(self) -> str:
        """The dtype holding most of its frozen bytes (float32 for a model trained in full)."""
        if not self.bytes_by_dtype:
            return "float32"
        return max(self.bytes_by_dtype, key=self.bytes_by_dtype.get)

    def summary(self) -> dict[str, Any]:
        out = {"dtype": self.dtype, "weight_bytes": self.weight_bytes, "role": self.role, "params": self.params,
               "bytes_by_dtype": dict(sorted(self.bytes_by_dtype.items())),
               "trainable_params": self.trainable_params,
               "trainable_bytes": self.trainable_bytes}
        if self.fp8_params:
            out["fp8_params"] = self.fp8_params
        if self.swapped_bytes:
            out["swapped_bytes"] = self.swapped_bytes
            out["in_flight_bytes"] = self.in_flight_bytes
        return out


def model_class(slot: Any) -> Any:
    """The slot's class (`ModelSlot.library` or its `module`, `class_name`)."""
    return getattr(importlib.import_module(slot.module or slot.library), slot.class_name)


@contextlib.contextmanager
def _quiet_libraries():
    """transformers and diffusers warn at length while building models from configs (unused keys, ids outside a
    vocabulary): nothing a memory plan needs."""
    import logging

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    levels = transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()
    disabled = logging.root.manager.disable
    transformers_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()
    logging.disable(max(disabled, logging.WARNING))
    try:
        yield
    finally:
        logging.disable(disabled)
        transformers_logging.set_verbosity(levels[0])
        diffusers_logging.set_verbosity(levels[1])


def build_meta(slot: Any, config: Any, dtype: str) -> Any:
    """A model of the slot's class from its configuration, on the meta device, its parameters in `dtype` as
    `from_pretrained(torch_dtype=dtype)` loads them (the class's keep-in-fp32 modules at fp32; tied weights tied)."""
    import torch
    from accelerate import init_empty_weights

    from .models.loading import keep_in_fp32

    cls = model_class(slot)
    with _quiet_libraries(), init_empty_weights(include_buffers=False):
        if slot.library == "diffusers":
            model = cls.from_config(dict(config))
        else:
            model = cls._from_config(config)
    _tie(model)
    target = getattr(torch, dtype)
    keep = keep_in_fp32(cls, slot.library, target)
    for name, param in model.named_parameters():
        wanted = torch.float32 if keep and any(part in keep for part in name.split(".")) else target
        if param.dtype != wanted:
            param.data = param.data.to(wanted)
    model.requires_grad_(False)
    model.eval()
    return model


def probe_meta(slot: Any, config: Any) -> Any:
    """The slot's model built with every tensor on the meta device, parameters, buffers and constants alike: nothing
    allocated, whatever sizes the config asks for (`build_meta` keeps buffers real, and accelerate creates each
    parameter on the CPU before moving it to meta), so its sizes can be bounded before the model is built."""
    import torch

    cls = model_class(slot)
    with _quiet_libraries(), torch.device("meta"):
        if slot.library == "diffusers":
            return cls.from_config(dict(config))
        return cls._from_config(config)


def _tie(model: Any) -> None:
    """Tie the weights `from_pretrained` ties (a T5 encoder's embed_tokens is its shared embedding)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in tied.items():
        parent_name, _, name = target.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, name, model.get_parameter(source))


def count_bytes(model: Any) -> tuple[dict[str, int], int, int]:
    """({dtype: bytes of frozen parameters}, all parameters, trainable parameters), each parameter once."""
    by_dtype: dict[str, int] = {}
    params = trainable = 0
    for param in model.parameters():
        params += param.numel()
        if param.requires_grad:
            trainable += param.numel()
            continue
        name = str(param.dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + param.numel() * param.element_size()
    return by_dtype, params, trainable


def trained_state_bytes(model: Any, optimizer: str, args: dict[str, Any]) -> Optional[int]:
    """Bytes of the model's trained parameters as a run holds them: each one's fp32 value and gradient and what the
    optimizer keeps for a parameter of its shape (train/optimizers.state_bytes); None for AdamW (16 bytes each)."""
    if optimizer == "adamw":
        return None
    from .train.optimizers import state_bytes

    return sum(VALUE_AND_GRAD_BYTES * p.numel() + state_bytes(optimizer, args, tuple(p.shape))
               for p in model.parameters() if p.requires_grad)


def fakify(model: Any, mode: Any) -> list[Any]:
    """Replace every parameter and buffer of `model` by a fake tensor of its shape and dtype (tied ones stay tied);
    the fake tensors, for the tracker to know."""
    import torch

    made: dict[int, Any] = {}
    with mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in made:
                    fake = torch.empty(tuple(param.shape), dtype=param.dtype)
                    made[id(param)] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
            for name, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                if id(buffer) not in made:
                    made[id(buffer)] = torch.empty(tuple(buffer.shape), dtype=buffer.dtype)
                module._buffers[name] = made[id(buffer)]
    return list(made.values())


# ------------------------------------------------------------------------------------------------
# the plan


class _Planner:
    """One memory plan: the configs, the models built once per role, and the traces."""

    def __init__(self, cfg: RunConfig, plan: Plan, text_tokens: Optional[int]):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        cfg, size_notes = traced_size(cfg)
        self.cfg, self.plan = cfg, plan
        self.memory = family_memory(cfg)
        from .models.stage import declared_absent

        self.absent = declared_absent(cfg, cfg.pipeline.spec().models)  # a stage loads none of these
        self.models = [m for m in cfg.pipeline.spec().models if m not in self.absent]
        self.configs = read_configs(cfg, self.models)
        self.files = config_files(cfg, self.models)
        with self.tracing(self.models, "read the run's sizes from"):
            self.dims = self.memory.dims(cfg, self.configs, text_tokens)
        self.compute = cfg.precision.compute_dtype
        self.dtype = getattr(torch, self.compute)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.built: dict[tuple[str, str, bool], Built] = {}
        self.fakes: dict[tuple[str, str, bool], list[Any]] = {}
        self.inference: dict[tuple[str, str, bool], int] = {}
        self.sink_models = set(cfg.pipeline.loss.declaration.models)
        self.notes: list[str] = list(getattr(self.memory, "NOTES", ())) + size_notes
        self._schedulers: Optional[dict[str, Any]] = None
        self.steps: dict[tuple[str, ...], tuple[int, int]] = {}

    # -- models ---------------------------------------------------------------------------------

    def role(self, slot: str, training: bool) -> str:
        if training and slot in self.cfg.optim.trainable:
            return "full"
        if training and slot == self.cfg.lora.base_model:
            return "lora"
        return "frozen"

    @contextlib.contextmanager
    def tracing(self, slots: Iterable[str], doing: str):
        """What a library or a family's memory module raises while the plan builds or traces models from these configs
        (one that passed the size checks and still describes no model that runs at this size: a patch larger than the
        image, head dimensions the rotary embedding does not split) as one line naming the config files, as the run's
        loader names a folder it cannot load (models/loading.py)."""
        import warnings

        try:
            with warnings.catch_warnings(record=True) as caught:  # a failed trace's warnings only repeat its error
                yield
        except (BackendError, MemoryError):
            raise
        except Exception as exc:
            files = ", ".join(self.files[s] for s in dict.fromkeys(slots) if s in self.files) or "the configs"
            raise BackendError(f"--dry_run: cannot {doing} {files}: {type(exc).__name__}: {_first_line(exc)}") from None
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def model(self, slot: str, training: bool) -> Built:
        """The slot as the stage loads it (models/stage.load_models, then train/loop.prepare_models)."""
        role = self.role(slot, training)
        checkpointing = training and self.cfg.optim.gradient_checkpointing and slot in self.plan.models_require_backward
        key = (slot, role, checkpointing)
        if key not in self.built:
            self.built[key] = self._build(slot, role, checkpointing, training)
            self.fakes[key] = fakify(self.built[key].model, self.mode)
            trace_layerwise_casting(self.built[key].model)
        return self.built[key]

    def _build(self, slot: str, role: str, checkpointing: bool, training: bool) -> Built:
        from .models.lora import add_lora
        from .models.precision import adapters_to_fp32, enable_checkpointing, store_fp8

        cfg = self.cfg
        spec = cfg.family.slot(slot)
        where = self.files.get(slot, slot)
        with self.tracing([slot], f"build {slot} ({spec.class_name}) from"):
            check_model_size(probe_meta(spec, self.configs[slot]), slot, where)  # before a tensor is allocated
            model = build_meta(spec, self.configs[slot], "float32" if role == "full" else self.compute)
        check_model_size(model, slot, where)
        fp8 = slot in cfg.precision.fp8
        if role == "full":
            model.requires_grad_(True)
            model.train()
        elif role == "lora":
            from .train.loop import check_rank

            lora = cfg.lora
            check_rank(model, slot, list(lora.targets), lora.rank)  # the run's own refusal (train/loop.prepare_models)
            with _quiet_libraries():
                add_lora(model, slot, list(lora.targets), lora.rank, lora.alpha, cfg.seed, kind=lora.kind,
                         rslora=lora.rslora)
            adapters_to_fp32(model)
            model.train()
        if fp8 and role != "full":
            store_fp8(model, slot, self.compute)  # after the adapters, as prepare_models does
        if checkpointing:
            enable_checkpointing(model)
        by_dtype, params, trainable = count_bytes(model)
        built = Built(slot, role, model, by_dtype, params, trainable,
                      fp8_params=sum(p.numel() for p in model.parameters() if str(p.dtype) == "torch.float8_e4m3fn"),
                      trained_bytes=trained_state_bytes(model, cfg.optim.optimizer, cfg.optim.optimizer_args))
        if role == "lora" and training and cfg.precision.blocks_to_swap:
            self._swap(built)
        return built

    def _swap(self, built: Built) -> None:
        """--blocks_to_swap N (precision.swap_blocks): the frozen Linear weights of the last N transformer blocks live
        in host memory, each brought to the device, cast to the compute dtype, while its layer runs. An fp8 weight's
        cast copy is in the trace already (the same cast happens without the swap); a weight stored in the compute
        dtype adds its copy, one layer at a time: the largest is counted in flight."""
        import torch

        from .models.precision import transformer_blocks

        count = self.cfg.precision.blocks_to_swap
        blocks = transformer_blocks(built.model)
        if count >= len(blocks):
            raise BackendError(f"--blocks_to_swap {count}: {built.slot} has {len(blocks)} transformer blocks; at most "
                               f"{max(len(blocks) - 1, 0)} can live in CPU memory")
        weights = [module.weight for block in blocks[len(blocks) - count:] for module in block.modules()
                   if type(module) is torch.nn.Linear and not module.weight.requires_grad]
        built.swapped_bytes = sum(w.numel() * w.element_size() for w in weights)
        compute_bytes = self.dtype.itemsize
        built.in_flight_bytes = max((w.numel() * compute_bytes for w in weights if w.dtype != torch.float8_e4m3fn),
                                    default=0)
        built.notes.append(f"--blocks_to_swap {count}: the frozen Linear weights of {count} of {len(blocks)} blocks of "
                           f"{built.slot} in host memory ({gib(built.swapped_bytes)} GiB; with CUDA only), brought to the "
                           "device one layer at a time")

    def schedulers(self) -> dict[str, Any]:
        """The family's schedulers, from their scheduler_config.json or the family's published config (no weights)."""
        from .models.sources import ModelLoadError

        if self._schedulers is None:
            slots = [s.name for s in self.cfg.family.slots if s.kind == "scheduler"]
            try:
                self._schedulers = self.cfg.models.sources(self.cfg.family, offline=True).load(slots)
            except ModelLoadError as exc:
                raise BackendError(f"--dry_run: {exc}") from None
        return self._schedulers

    def known(self) -> list[Any]:
        return [t for fakes in self.fakes.values() for t in fakes]

    def context(self, models: dict[str, Any]) -> Any:
        import torch

        from .context import UnitContext

        return UnitContext(models=models, settings=self.cfg.units, device=torch.device("cpu"))

    # -- traces ---------------------------------------------------------------------------------

    def inference_peak(self, slot: str, training: bool, batch: int) -> int:
        """Activations of the slot's no-grad forward at the run's size (its unit as stage 1 runs it)."""
        import torch

        built = self.model(slot, training)
        key = (slot, built.role, False, batch)
        if key not in self.inference:
            calls = self.memory.encoder_calls(self.cfg, self.dims, self.configs, batch, self.dtype)
            if slot not in calls:
                self.inference[key] = 0
            else:
                ctx = self.context({slot: built.model})
                doing = f"trace {slot}'s forward at {self.dims.get('description', 'this size')} from"
                with self.tracing([slot], doing), self.mode, StorageLog(self.known()) as log, torch.no_grad(), \
                        ctx.autocast():
                    out = calls[slot](built.model)
                    del out
                self.inference[key] = log.peak()
        return self.inference[key]

    def step_peak(self, slots: list[str]) -> tuple[int, int]:
        """(activations, host bytes) of one training step: the units that train a model run forward with grad, then
        the loss, then the backward (gradients of trained parameters left out). Only the models on the backward path
        and the loss's take part, so stage 2 and the unsplit run share one trace."""
        taking_part = tuple(sorted(s for s in slots if s in self.plan.models_require_backward or s in self.sink_models))
        if taking_part not in self.steps:
            slots = list(taking_part)
            with self.tracing(slots, f"trace one training step at {self.dims.get('description', 'this size')} from"):
                self.steps[taking_part] = self._step_peak(slots)
        return self.steps[taking_part]

    def _step_peak(self, slots: list[str]) -> tuple[int, int]:
        cfg = self.cfg
        built = {slot: self.model(slot, True) for slot in slots}
        models: dict[str, Any] = {slot: b.model for slot, b in built.items()}
        models.update(self.schedulers())  # a training stage loads them (models/stage.stage_slots); losses may read them
        batch = cfg.optim.batch_size
        grad_encoders = [s for s in slots if s in self.plan.models_require_backward and s not in self.sink_models]
        calls = self.memory.encoder_calls(cfg, self.dims, self.configs, batch, self.dtype) if grad_encoders else {}
        ctx = self.context(models)
        warm = getattr(self.memory, "warm_context", None)
        if warm is not None:  # what the loss computes from real objects (a scheduler's sigmas), outside fake mode
            warm(cfg, ctx, self.dims)
        offload = HostSaved()
        saved = offload.hooks() if cfg.precision.checkpoint_offload else contextlib.nullcontext()
        with self.mode, StorageLog(self.known()) as log:
            with saved:
                outputs = []
                for slot in grad_encoders:
                    if slot in calls:
                        with ctx.autocast():
                            outputs.append(calls[slot](models[slot]))
                inputs = self.memory.sink_inputs(cfg, self.dims, self.configs, batch, self.dtype)
                inputs.setdefault("loss_mask", None)  # --masked_loss: weights of a negligible size
                loss = cfg.pipeline.loss(ctx, inputs)
                for out in outputs:  # the encoder's output feeds the loss in a run; here it joins the backward
                    loss = loss + out.float().mean() * 0.0
                del inputs, outputs
                loss.backward()
                del loss
        params = [p for model in built.values() for p in model.model.parameters() if p.grad is not None]
        grads = log.serials_of(p.grad for p in params)
        for param in params:
            param.grad = None
        return log.peak(exclude=grads), offload.host_bytes

    # -- stages ---------------------------------------------------------------------------------

    def stage(self, name: str) -> dict[str, Any]:
        cfg, plan = self.cfg, self.plan
        training = name != "data_process"
        if name == "data_process":
            slots = list(plan.data_process_models)
        elif name == "train":
            slots = list(plan.train_models)
        else:
            slots = sorted(set(self.models) | set(plan.models_require_backward), key=self.models.index)
        slots = [s for s in slots if s not in self.absent]
        built = {slot: self.model(slot, training) for slot in slots}
        batch1 = cfg.args.data_process_batch_size or cfg.family.data_process_batch_size
        host = 0
        if training:
            frozen = [s for s in slots if s not in plan.models_require_backward and s not in self.sink_models]
            forwards = {s: self.inference_peak(s, True, 1) for s in frozen}  # the unsplit run: one sample at a time
            step, host = self.step_peak(slots)
        else:
            forwards = {s: self.inference_peak(s, False, batch1) for s in slots}
            step = 0
        inference = max(forwards.values(), default=0)
        activations = max(inference, step)
        engine = cfg.engine
        wrapped = set(plan.models_require_backward) if training else set()  # what the engine prepares (loop.py)
        shares = {slot: engine_share(b, engine, slot in wrapped) for slot, b in built.items()}
        weights = sum(s.weight_bytes for s in shares.values())
        trainable = sum(s.trainable_bytes for s in shares.values()) if training else 0
        gathered = sum(s.gathered_bytes for s in shares.values())
        buffers = engine_buffer_bytes(engine, list(shares.values()))
        host_parts = {"weights": sum(s.host_weight_bytes for s in shares.values()),
                      "trainable": sum(s.host_trainable_bytes for s in shares.values()) if training else 0,
                      "activations": host}
        # --ema_decay: the moving average, an fp32 copy of every trained parameter, on the device or in host memory
        ema = (EMA_BYTES_PER_PARAM * sum(b.trainable_params for b in built.values())
               if training and cfg.optim.ema_decay is not None else 0)
        if engine.kind == "fsdp2":  # each process averages its shards
            ema = math.ceil(ema / max(1, engine.processes))
        ema_device = 0 if cfg.optim.ema_device == "cpu" else ema
        if ema and not ema_device:
            host_parts["ema"] = ema

        def model_summary(slot: str) -> dict[str, Any]:
            b, share = built[slot], shares[slot]
            out = dict(b.summary(), weight_bytes=share.weight_bytes, trainable_bytes=share.trainable_bytes)
            if slot in forwards:
                out["forward_activation_bytes"] = forwards[slot]
            if share.wrapped and engine.kind != "ddp":
                out["engine"] = share.summary(b)
            return out

        out: dict[str, Any] = {
            "peak_bytes": weights + trainable + activations + gathered + buffers + ema_device,
            "weight_bytes": weights,
            "trainable_bytes": trainable,
            "activation_bytes": activations,
            "gathered_bytes": gathered,
            "engine_buffer_bytes": buffers,
            "host_bytes": sum(host_parts.values()),
            "host": host_parts,
            "models": {slot: model_summary(slot) for slot in built},
            "encoder_activation_bytes": inference,
        }
        if ema:
            out["ema_bytes"], out["ema_on_host"] = ema, not ema_device
        if training:
            out["step_activation_bytes"] = step
        return out


# ------------------------------------------------------------------------------------------------
# what one process holds under the run's engine

# DeepSpeed's own defaults for the zero_optimization settings the plan reads (deepspeed/runtime/zero/config.py)
ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "contiguous_gradients": True, "overlap_comm": None,
                 "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9}


@dataclass
class Share:
    """One model as one process holds it under the engine: device bytes of its frozen weights and of its trainable
    state, what moved to host memory, and the whole weights gathered for a layer's compute (in flight)."""

    weight_bytes: int
    trainable_bytes: int
    host_weight_bytes: int = 0
    host_trainable_bytes: int = 0
    gathered_bytes: int = 0
    wrapped: bool = False  # the engine prepares this model (one of plan.models_require_backward)
    sharded: bool = False  # its weights are split over the processes

    def summary(self, built: Built) -> dict[str, Any]:
        whole = sum(built.bytes_by_dtype.values())
        return {"sharded_weights": self.sharded, "whole_weight_bytes": whole,
                "whole_trainable_bytes": built.trainable_bytes,
                "host_weight_bytes": self.host_weight_bytes, "host_trainable_bytes": self.host_trainable_bytes,
                "gathered_bytes": self.gathered_bytes}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def zero_setting(engine: Any, key: str) -> Any:
    """A zero_optimization setting of the engine's DeepSpeed config: its number or flag, else DeepSpeed's default
    ("auto" and absent alike: unitgraph hands DeepSpeed the config with no such key filled in)."""
    zero = (engine.config or {}).get("zero_optimization") or {}
    value = zero.get(key) if isinstance(zero, dict) else None
    default = ZERO_DEFAULTS[key]
    if isinstance(value, bool) or (isinstance(value, (int, float)) and not isinstance(default, bool)):
        return value
    if key == "overlap_comm" and default is None:
        return engine.zero_stage == 3  # DeepSpeed's dynamic default: on for ZeRO-3 only
    return default


def _fsdp2_shard(param: Any, processes: int) -> int:
    """Elements of one FSDP2 shard of a parameter: dim 0 split in `processes` chunks, padded to the largest."""
    shape = tuple(param.shape)
    if not shape:
        return 1
    rest = 1
    for size in shape[1:]:
        rest *= size
    return _ceil_div(shape[0], processes) * rest


def _param_bytes(param: Any) -> int:
    return param.numel() * param.element_size()


def engine_share(built: Built, engine: Any, wrapped: bool) -> Share:
    """What one process of the run holds of `built` (engine.py's rules as train/engines.py applies them):

    - a model the engine does not prepare (a frozen encoder) is whole on every process;
    - data parallel (and DeepSpeed without ZeRO, stage 0): everything whole;
    - DeepSpeed ZeRO-1/2: frozen and trained weights whole; AdamW's state of this process's partition of the
      trained weights (the optimizer steps the weights' own fp32 partition: train/engines.share_fp32_master), and
      under ZeRO-2 the gradient partition; ZeRO-1 keeps whole gradients. offload_optimizer puts an fp32 copy of the
      partition, the state and the gradient partition in host memory;
    - DeepSpeed ZeRO-3: each weight split in ceil(numel/N) partitions, frozen and trained alike, except the
      parameters of at most stage3_param_persistence_threshold elements (1e5 by default), which every process also
      keeps whole; the trained partitions are the optimizer's fp32 values (no copy: train/engines.share_fp32_master),
      their gradients and AdamW's state are partitioned too. offload_param moves the weight partitions to host memory, offload_optimizer the
      gradients, the state and an fp32 copy of the partitions;
    - FSDP2: each parameter's dim 0 split in N chunks (ceil), its gradient and AdamW's state the same;
      fsdp_offload_params moves all of it to host memory, the optimizer step included.
    """
    trained = built.trainable_bytes  # the run's optimizer (under an engine AdamW's 16 bytes a parameter, or under FSDP2
    # schedule-free AdamW's, the same 16: config.check_engine refuses the others)
    n = max(engine.processes, 1)
    if not wrapped or engine.kind == "ddp" or (engine.kind == "deepspeed" and engine.zero_stage == 0):
        return Share(built.weight_bytes, trained, host_weight_bytes=built.swapped_bytes, wrapped=wrapped)
    params = list(built.model.parameters())
    if engine.kind == "deepspeed" and engine.zero_stage < 3:
        part = _ceil_div(built.trainable_params, n)
        weights = grads = 4 * built.trainable_params
        if engine.zero_stage == 2:
            grads = 4 * part
        state = 8 * part  # AdamW's two moments; the optimizer steps the weights' own partition (share_fp32_master)
        if engine.offload_optimizer:
            host = state + (4 + 4) * part  # an fp32 copy of the partition and its gradient, which the CPU step reads
            device = weights + (grads if engine.zero_stage == 1 else 0)
            return Share(built.weight_bytes, device, host_trainable_bytes=host, wrapped=True)
        return Share(built.weight_bytes, weights + grads + state, wrapped=True)
    if engine.kind == "deepspeed":
        threshold = zero_setting(engine, "stage3_param_persistence_threshold")
        frozen_whole = frozen_part = trained_whole = trained_part = 0
        for p in params:
            persistent = p.numel() <= threshold
            part = _ceil_div(p.numel(), n)
            if p.requires_grad:
                trained_part += part
                trained_whole += p.numel() if persistent else 0
            else:
                frozen_part += part * p.element_size()
                frozen_whole += _param_bytes(p) if persistent else 0
        weights_device = frozen_whole + (0 if engine.offload_params else frozen_part)
        trained_device = 4 * trained_whole + (0 if engine.offload_params else 4 * trained_part)
        host_weights = frozen_part if engine.offload_params else 0
        host_trained = 4 * trained_part if engine.offload_params else 0
        if engine.offload_optimizer:
            host_trained += (4 + 4 + 8) * trained_part  # gradients, the fp32 copy, AdamW's state
        else:
            trained_device += (4 + 8) * trained_part
        return Share(weights_device, trained_device, host_weights, host_trained, _zero3_gathered(params, engine),
                     wrapped=True, sharded=True)
    # FSDP2
    frozen = sum(_fsdp2_shard(p, n) * p.element_size() for p in params if not p.requires_grad)
    trained_shards = TRAINABLE_BYTES_PER_PARAM * sum(_fsdp2_shard(p, n) for p in params if p.requires_grad)
    gathered = _fsdp2_gathered(built.model, engine)
    if engine.offload_params:
        return Share(0, 0, frozen, trained_shards, gathered, wrapped=True, sharded=True)
    return Share(frozen, trained_shards, gathered_bytes=gathered, wrapped=True, sharded=True)


def _zero3_gathered(params: list[Any], engine: Any) -> int:
    """Bytes of whole weights ZeRO-3 holds at once beyond its partitions: the parameters fetched for the modules
    running and prefetched, kept while they are reused soon, at most stage3_max_live_parameters elements (1e9 by
    default; a single module larger than that is fetched whole anyway)."""
    threshold = zero_setting(engine, "stage3_param_persistence_threshold")
    live = int(zero_setting(engine, "stage3_max_live_parameters"))
    gathered = [p for p in params if p.numel() > threshold]
    elements = sum(p.numel() for p in gathered)
    if not elements:
        return 0
    size = sum(_param_bytes(p) for p in gathered)
    largest = max(p.numel() for p in gathered)
    return min(size, _ceil_div(size * max(live, largest), elements))


def _fsdp2_gathered(model: Any, engine: Any) -> int:
    """Bytes of whole weights FSDP2 holds at once beyond its shards: the root's own parameters (not resharded after
    the forward), the block computing and the next one prefetched, and one block's whole gradients before they are
    reduce-scattered; with fsdp_reshard_after_forward false every block stays gathered from its forward to its
    backward."""
    from .train.engines import shard_units

    units = shard_units(model, tuple(engine.layer_classes))
    inside: set[int] = set()
    sizes, grads = [], []
    for unit in units:
        ps = [p for p in unit.parameters() if id(p) not in inside]
        inside.update(id(p) for p in ps)
        sizes.append(sum(_param_bytes(p) for p in ps))
        grads.append(sum(4 * p.numel() for p in ps if p.requires_grad))
    rest = [p for p in model.parameters() if id(p) not in inside]
    rest_bytes = sum(_param_bytes(p) for p in rest)
    grads.append(sum(4 * p.numel() for p in rest if p.requires_grad))
    blocks = sum(sizes) if not engine.reshard_after_forward else sum(sorted(sizes, reverse=True)[:2])
    return rest_bytes + blocks + max(grads, default=0)


def engine_buffer_bytes(engine: Any, shares: list[Share]) -> int:
    """DeepSpeed's gradient bucket: reduce_bucket_size elements of fp32 gradients, allocated whole however few the
    trained parameters (two under ZeRO-1/2 with overlap_comm); with contiguous_gradients (on by default, and always
    with optimizer offload)."""
    if engine.kind != "deepspeed" or engine.zero_stage == 0 or not any(s.wrapped for s in shares):
        return 0
    contiguous = zero_setting(engine, "contiguous_gradients") or engine.offload_optimizer
    if not contiguous:
        return 0
    buffers = 2 if engine.zero_stage < 3 and zero_setting(engine, "overlap_comm") else 1
    return int(zero_setting(engine, "reduce_bucket_size")) * 4 * buffers


def family_memory(cfg: RunConfig) -> Any:
    """The family's `memory` module (families/<name>/memory.py: the shapes of its loss's inputs and encoders' calls)."""
    try:
        return importlib.import_module(".memory", cfg.family.package)
    except ModuleNotFoundError:
        raise BackendError(f"--dry_run: family {cfg.family.name} has no memory module "
                           f"(families/{cfg.family.name}/memory.py)") from None


def read_configs(cfg: RunConfig, slots: Iterable[str]) -> dict[str, Any]:
    """Each model slot's configuration from its config.json alone, the sources resolved offline (a model id must be
    in the local cache: a memory plan downloads nothing); one BackendError line naming the folder otherwise."""
    from .models.sources import ModelLoadError

    try:
        sources = cfg.models.sources(cfg.family, offline=True)
        return {slot: sources.load_config(slot) for slot in slots}
    except ModelLoadError as exc:
        raise BackendError(f"--dry_run needs each model's config.json: {exc}") from None


def config_files(cfg: RunConfig, slots: Iterable[str]) -> dict[str, str]:
    """{slot: the config.json (or release single file) its configuration was read from}, for messages."""
    from .models.sources import ModelLoadError

    sources = cfg.models.sources(cfg.family, offline=True)
    out = {}
    for slot in slots:
        try:
            source = sources.resolve(slot)
        except ModelLoadError:
            continue
        if source.path is not None:
            out[slot] = str(source.path if source.single_file is not None else source.path / "config.json")
    return out


def check_model_size(model: Any, slot: str, where: str) -> None:
    """BackendError naming the config when the model it built on the meta device has more than MAX_PARAMS parameters
    or a tensor of more than MAX_TENSOR_ELEMENTS elements: sizes that each pass config_size_problem (models/folders.py)
    can still multiply into terabytes, which no step should be traced with."""
    params = sum(p.numel() for p in model.parameters())  # each parameter once, tied ones too
    largest, name = max(((t.numel(), key) for key, t in [*model.named_parameters(), *model.named_buffers()]),
                        default=(0, ""))
    if params > MAX_PARAMS:
        raise BackendError(f"{where}: {slot} would have {params:.3g} parameters, more than any model has (at most "
                           f"{MAX_PARAMS:.0e}); refusing to plan it")
    if largest > MAX_TENSOR_ELEMENTS:
        raise BackendError(f"{where}: {slot}'s {name} would have {largest:.3g} elements, more than any model's tensor "
                           f"(at most 2^40); refusing to plan it")


def traced_size(cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    """The run's image size as the plan traces it, and a note when it is bounded. The run's image and frame readers
    refuse a file of more than PIL's Image.MAX_IMAGE_PIXELS pixels (data/dataset.open_image, data/video.check_pixels),
    so a --max_pixels above that bound trains images of at most that many pixels: the plan traces those. A fixed
    --height x --width above it, and a clip of more than args.MAX_FRAMES frames, are refused with the other flags
    (TrainArgs.validate), before any plan."""
    from dataclasses import replace

    limit = image_pixel_limit()
    size = cfg.units.image_size
    if (size.height is not None and size.width is not None) or size.max_pixels <= limit:
        return cfg, []
    bounded = replace(cfg, units=replace(cfg.units, image_size=replace(size, max_pixels=limit)))
    return bounded, [f"--max_pixels {size.max_pixels} is more than the {limit} pixels an image may have (PIL's "
                     f"Image.MAX_IMAGE_PIXELS, which the run's image reader refuses beyond): planned at {limit}"]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.splitlines()[0].split())[:300] if text else type(exc).__name__


def settings(cfg: RunConfig, plan: Plan, dims: dict[str, Any]) -> dict[str, Any]:
    """What the plan assumed, as JSON."""
    precision = cfg.precision
    return {
        "pipeline": cfg.pipeline.name,
        "pipeline_choice": cfg.choice,  # "pipeline: NAME (why)" (choice.py)
        "mixed_precision": precision.mixed,
        "compute_dtype": precision.compute_dtype,
        "fp8": list(precision.fp8),
        "gradient_checkpointing": cfg.optim.gradient_checkpointing,
        "checkpoint_offload": precision.checkpoint_offload,
        "blocks_to_swap": precision.blocks_to_swap,
        "batch_size": cfg.optim.batch_size,
        "lora": None if not cfg.lora.base_model else {"base_model": cfg.lora.base_model, "rank": cfg.lora.rank,
                                                     "targets": list(cfg.lora.targets)},
        "trainable_models": list(cfg.optim.trainable),
        "data_process_models": list(plan.data_process_models),
        "train_models": list(plan.train_models),
        "size": dims,
        "engine_source": cfg.engine.source,
        "optimizer": cfg.optim.optimizer,
    }


def memory_plan(cfg: RunConfig, plan: Plan, text_tokens: Optional[int] = None) -> dict[str, Any]:
    """{"stages": {"data_process" | "train" | "unsplit": {"peak_bytes", "models": {slot: {"dtype", "weight_bytes",
    ...}}, "trainable_bytes", "activation_bytes", ...}}, "settings": ..., "notes": [...]} of the run `cfg` plans.

    Reads config.json files only (offline), writes nothing; `text_tokens` overrides the families' longest prompt.
    With a --dataset_config whose datasets give sizes or clip lengths of their own, each stage is planned at every
    distinct setting and the largest peak is kept, its dataset named in a note."""
    variants = dataset_variants(cfg)
    planned = []
    for name, own in variants:
        planner = _Planner(own, plan, text_tokens)
        planned.append((name, planner, {stage: planner.stage(stage) for stage in STAGES}))
    name, planner, stages = max(planned, key=lambda p: max(s.get("peak_bytes", 0) for s in p[2].values()))
    notes = planner.notes + [n for b in planner.built.values() for n in b.notes]
    if len(variants) > 1:
        notes.append(f"planned at the settings of dataset {name!r} (--dataset_config), the largest peak of the "
                     f"{len(variants)} sizes its datasets train at")
    notes += engine_notes(cfg.engine, stages)
    if precision_note(cfg.args, cfg.precision.mixed):  # planned on a machine whose default is not a GPU's
        notes.append("planned at fp32, this CPU's default (it has no bf16 kernels); on a GPU the same flags train in "
                     "bf16: --mixed_precision bf16 plans that")
    notes.append("not included: the device's own overhead (CUDA context, allocator fragmentation, kernel workspaces; "
                 "0.5-1.5 GiB on a GPU)")
    return {"engine": cfg.engine.to_json(), "processes": cfg.engine.processes, "stages": stages,
            "settings": settings(cfg, plan, planner.dims), "notes": list(dict.fromkeys(notes))}


def dataset_variants(cfg: RunConfig) -> list[tuple[Optional[str], RunConfig]]:
    """[(dataset name, the run as that dataset trains)] for each distinct image size and clip length of the run's
    --dataset_config datasets (session.dataset_config: a dataset's own size replaces the run's); [(None, cfg)]
    without a config or when every dataset trains at the run's settings."""
    from .session import dataset_config

    seen: dict[tuple[Any, Any], tuple[Optional[str], RunConfig]] = {}
    for spec in cfg.data.datasets:
        own = dataset_config(cfg, spec)
        seen.setdefault((tuple(sorted(own.units.image_size.key().items())), own.data.num_frames), (spec.name, own))
    return list(seen.values()) if len(seen) > 1 else [(None, cfg)]


def engine_notes(engine: Any, stages: dict[str, Any]) -> list[str]:
    """What the per-process figures assume about the engine, in a few notes."""
    if engine.kind == "ddp" and engine.processes == 1:
        return []
    n = engine.processes
    notes = [f"per process, under {engine.describe()} over {n} process{'es' if n != 1 else ''}: stage 1 trains "
             "nothing and is as without an engine; the models a training stage does not train are whole on every "
             "process; the activations are one process's batch"]
    if engine.kind == "deepspeed":
        if engine.zero_stage in (1, 2):
            notes.append(f"{engine.name} keeps every weight whole on each process; its optimizer steps this "
                         "process's partition of the fp32 trained weights in place" +
                         (", from an fp32 copy of it in host memory" if engine.offload_optimizer else
                          " (no fp32 master copy)"))
        elif engine.zero_stage == 3:
            threshold = zero_setting(engine, "stage3_param_persistence_threshold")
            notes.append(f"{engine.name} keeps the parameters of at most {threshold:g} elements whole on every process "
                         "(stage3_param_persistence_threshold); gathered: at most stage3_max_live_parameters "
                         f"({zero_setting(engine, 'stage3_max_live_parameters'):g}) elements of whole weights at once")
        buffers = max(s.get("engine_buffer_bytes", 0) for s in stages.values())
        if buffers:
            notes.append(f"engine buffers: DeepSpeed's gradient bucket, reduce_bucket_size "
                         f"({zero_setting(engine, 'reduce_bucket_size'):g}) fp32 elements, {gib(buffers)} GiB "
                         "allocated whatever the trained size (lower it in a DeepSpeed config file)")
    if engine.kind == "fsdp2":
        notes.append("FSDP2: gathered = the root's own weights, the block computing and the next prefetched, and one "
                     "block's whole gradients before their reduce-scatter" +
                     ("" if engine.reshard_after_forward else "; fsdp_reshard_after_forward false keeps every block "
                      "gathered from its forward to its backward"))
    return notes


# ------------------------------------------------------------------------------------------------
# the table


def gib(value: int) -> str:
    return f"{value / GIB:.2f}"


def engine_line(plan: dict[str, Any]) -> Optional[str]:
    """'engine: DeepSpeed ZeRO-3 from cfg.yaml, 8 processes; per process (...)', or None for data parallel on one
    process (the plan as it always was)."""
    engine = plan.get("engine")
    processes = int(plan.get("processes") or 1)
    if not engine or (engine.get("kind") == "ddp" and processes == 1):
        return None
    source = (plan.get("settings") or {}).get("engine_source")
    where = f" from {source}" if source else ""
    return (f"engine: {engine['name']}{where}, {processes} process{'es' if processes != 1 else ''}; every figure is "
            "per process, on its device, with what it keeps in host memory apart")


def _model_row(slot: str, model: dict[str, Any], width: int, processes: int, col: int = 14) -> str:
    extra = ""
    share = model.get("engine") or {}
    if share.get("sharded_weights") and share.get("whole_weight_bytes"):
        extra += f"  (this process's shard of {gib(share['whole_weight_bytes'])} GiB)"
    if share.get("host_weight_bytes"):
        extra += f"  ({gib(share['host_weight_bytes'])} GiB in host memory)"
    if model.get("trainable_params"):
        extra += f"  + {model['trainable_params'] / 1e6:.1f} M trained params"
    if model.get("swapped_bytes"):
        extra += f"  ({gib(model['swapped_bytes'])} GiB swapped to host)"
    return f"  {slot:<{width}}  {model['dtype']:<{col}} {gib(model['weight_bytes']):>8} GiB{extra}"


def format_memory_plan(plan: dict[str, Any]) -> list[str]:
    """The plan as lines of text: the engine (when there is one), then per stage its models (dtype, GiB), trainable
    state, activations, what an engine gathers and allocates, host memory and the peak, per process."""
    lines = []
    s = plan.get("settings") or {}
    if s.get("pipeline_choice"):
        lines.append(s["pipeline_choice"])
    engine = engine_line(plan)
    if engine:
        lines.append(engine)
    if s:
        size = s.get("size") or {}
        what = [f"pipeline {s.get('pipeline')}", f"--mixed_precision {s.get('mixed_precision')}"]
        if s.get("fp8"):
            what.append(f"fp8 {','.join(s['fp8'])}")
        if s.get("gradient_checkpointing"):
            what.append("checkpointing" + (" (offload)" if s.get("checkpoint_offload") else ""))
        if s.get("blocks_to_swap"):
            what.append(f"{s['blocks_to_swap']} blocks swapped")
        if s.get("lora"):
            what.append(f"LoRA rank {s['lora']['rank']} on {s['lora']['base_model']}")
        if s.get("trainable_models"):
            what.append(f"trained in full: {','.join(s['trainable_models'])}")
        what.append(f"batch {s.get('batch_size')}")
        if size.get("description"):
            what.append(size["description"])
        lines.append("memory plan: " + ", ".join(what))
    processes = int(plan.get("processes") or 1)
    per = " per process" if engine else ""
    trainable = "fp32 + " + optimizer_label(s.get("optimizer") or "adamw")
    col = max(14, len(trainable))  # the dtype column, wide enough for the optimizer's name
    labels = ["activations"] + (["engine buffers"] if any(st.get("engine_buffer_bytes") for st in
                                                           plan["stages"].values()) else [])
    slots = [slot for st in plan["stages"].values() for slot in st["models"]]
    width = max([len(x) for x in slots + labels] + [10])
    for name in STAGES:
        stage = plan["stages"].get(name)
        if stage is None:
            continue
        lines.append("")
        lines.append(f"{STAGE_TITLES[name]}: peak {gib(stage['peak_bytes'])} GiB{per}")
        for slot, model in stage["models"].items():
            lines.append(_model_row(slot, model, width, processes, col))
        lines.append(f"  {'trainable':<{width}}  {trainable:<{col}} {gib(stage['trainable_bytes']):>8} GiB")
        if stage.get("ema_bytes"):
            where = "(host, fp32)" if stage.get("ema_on_host") else "fp32"
            lines.append(f"  {'ema':<{width}}  {where:<{col}} {gib(stage['ema_bytes']):>8} GiB")
        lines.append(f"  {'activations':<{width}}  {'':<{col}} {gib(stage['activation_bytes']):>8} GiB")
        if stage.get("gathered_bytes"):
            lines.append(f"  {'gathered':<{width}}  {'(in flight)':<{col}} {gib(stage['gathered_bytes']):>8} GiB")
        if stage.get("engine_buffer_bytes"):
            lines.append(f"  {'engine buffers':<{width}}  {'':<{col}} {gib(stage['engine_buffer_bytes']):>8} GiB")
        if stage.get("host_bytes"):
            parts = stage.get("host") or {}
            shown = ", ".join(f"{what} {gib(parts[what])}" for what in ("weights", "trainable", "activations", "ema")
                              if parts.get(what))
            lines.append(f"  {'host':<{width}}  {'(not on device)':<{col}} {gib(stage['host_bytes']):>8} GiB"
                         + (f"  ({shown})" if len([v for v in parts.values() if v]) > 1 else ""))
    notes = plan.get("notes") or []
    if notes:
        lines.append("")
        lines += [f"note: {n}" for n in notes]
    return lines


__all__ = ["build_meta", "format_memory_plan", "memory_plan"]

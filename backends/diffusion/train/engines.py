"""What a training step does differently under each engine (engine.py says which): preparing the trained models
and the optimizer, a micro-step's backward, the optimizer step with --max_grad_norm, and the trained tensors
gathered whole for a checkpoint or a training state.

The loop (`loop.py`) is the same under every engine; it asks the run's `Steps` for these few things.

* **Data parallel** (`Steps`): accelerate's DDP as before; clipping by `accelerator.clip_grad_norm_` after the
  gradients are averaged, so the norm is the global one.
* **FSDP2** (`ShardedSteps`): each trained model's blocks (the classes the accelerate config names, else the
  model's own `_no_split_modules`, the blocks diffusers and transformers declare for device maps, else the
  transformer blocks --blocks_to_swap knows) and then the model are `fully_shard`ed over all processes, so every
  process keeps 1/N of each weight (the frozen base under a LoRA included), of each gradient and of AdamW's state.
  A model built without weights (models/shards.py: a diffusers folder's) gets them after sharding, each process
  reading only its shard's rows from the files.
  Gradient sync is off for all but a step's last micro-batch. `clip_grad_norm_` on the DTensor gradients reduces
  the norm over the shards, so it is the global norm too. Checkpoints and states gather each trained tensor
  whole with `full_tensor()`, one at a time, and keep it on the main process only.
* **DeepSpeed** (`DeepSpeedSteps`): `accelerator.prepare(model, optimizer)` makes the engine with the config
  `engine.deepspeed_config` decides; under ZeRO-3 with zero3_init_flag, a model built without weights is first
  read into its partitions (models/shards.py). The loop keeps the accumulation: each micro-batch's backward goes through
  the engine with its boundary set by hand (the last micro-batch of a step), and the engine steps, clipping to
  its gradient_clipping, at the boundary only. Under ZeRO-3 each trained weight is gathered whole with
  `GatheredParameters` to be saved. A training state holds the trained tensors whole and each process's
  partition of AdamW's state (the torch AdamW DeepSpeed steps over the process's flat fp32 partition) in a file of
  its own; resuming sets the weights, which are that partition (`share_fp32_master`: DeepSpeed's precision is off,
  so its master copy would be the same fp32 values).

Why split equals unsplit under an engine: both runs make the same engine over the same processes with the same
seeded numbers, and the engine's reductions do not depend on where a batch came from.
"""

from __future__ import annotations

import contextlib
from types import MethodType
from typing import Any, Callable, Iterable, Optional

import torch

from ..errors import BackendError

__all__ = ["Steps", "ShardedSteps", "DeepSpeedSteps", "steps_for", "autocast_forward", "base_optimizer",
           "return_freed_weights", "share_fp32_master"]


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_weights() -> bool:
    """Have the C allocator give every large freed block back to the system (glibc: a fixed mmap threshold).

    Why: glibc raises its mmap threshold after a large block is freed, so later blocks of that size come from the heap
    and stay with the process once freed. A sharded engine allocates and frees whole weights all the time (ZeRO-3 and
    FSDP2 gather each layer's weights for its forward and backward and free them after; loading into partitions
    reads each tensor whole): measured on a 1.42 B video DiT under ZeRO-3 over 2 processes, the heap kept growing
    by the gathered layers until the machine's 24 GiB ran out, while with the threshold fixed at 128 KiB the same run
    holds its partitions and one gather. Returns whether the allocator took the setting (False off glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024))
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False


def autocast_forward(model: Any, dtype: Optional[torch.dtype], device: Any) -> None:
    """Run `model`'s forward under autocast in `dtype` with fp32 outputs, as accelerate does to the models it
    prepares under mixed precision (done here for the engines whose models accelerate does not autocast)."""
    if dtype is None or dtype == torch.float32:
        return
    from accelerate.utils import convert_outputs_to_fp32

    kind = getattr(device, "type", None) or str(device).split(":")[0]
    forward = model.forward.__func__ if hasattr(model.forward, "__func__") else model.forward
    casted = torch.autocast(device_type=kind, dtype=dtype)(forward)
    model.forward = MethodType(convert_outputs_to_fp32(casted), model)


def base_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's and DeepSpeed's wrappers (the learning-rate schedule steps it)."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer") and seen < 4:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


class Steps:
    """Data parallel (accelerate's DDP): every process holds every weight."""

    gathers = False  # whether reading a trained tensor whole is a collective call
    per_rank_state = False  # whether each process keeps an optimizer state of its own in a training state
    restore = None  # how the weights are set from a state, when not by `scatter` (DeepSpeed)

    def __init__(self, accelerator: Any, engine: Any, max_grad_norm: Optional[float]):
        self.acc, self.engine, self.max_grad_norm = accelerator, engine, max_grad_norm

    def prepare(self, models: dict[str, Any], slots: list[str], make_optimizer: Callable[[list[Any]], Any],
                compute_dtype: Optional[torch.dtype]) -> tuple[dict[str, Any], Any]:
        optimizer = make_optimizer(_trained(models, slots))
        wrapped = dict(models)
        for slot in slots:
            wrapped[slot] = self.acc.prepare(models[slot], device_placement=[False])  # placed already
        return wrapped, self.acc.prepare(optimizer)

    def micro(self, trained: list[Any], sync: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's forward and backward: gradients synchronised on a step's last only."""
        stack = contextlib.ExitStack()
        if not sync and self.acc.num_processes > 1:
            for model in trained:
                if hasattr(model, "no_sync"):
                    stack.enter_context(self.acc.no_sync(model))
        return stack

    def backward(self, loss: torch.Tensor, model: Any, sync: bool) -> None:
        self.acc.backward(loss)

    def step(self, optimizer: Any, params: Iterable[Any]) -> Optional[float]:
        """Clip (--max_grad_norm) and step; the gradients' global norm before clipping when clipping."""
        norm = None
        if self.max_grad_norm is not None:
            norm = float(self.acc.clip_grad_norm_(list(params), self.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def unwrap(self, model: Any) -> Any:
        return self.acc.unwrap_model(model) if isinstance(model, torch.nn.Module) else model

    def full(self, value: Any) -> torch.Tensor:
        """A trained tensor whole, on the CPU (a collective call when `gathers`)."""
        return value.detach().to("cpu").contiguous().clone()

    def trained_tensors(self, model: Any) -> dict[str, torch.Tensor]:
        """{name: whole tensor} of a model's trained parameters (every process calls it; all get them)."""
        return {name: self.full(p) for name, p in self.unwrap(model).named_parameters() if p.requires_grad}

    def scatter(self, value: torch.Tensor, like: Any) -> torch.Tensor:
        """A whole tensor read from a state, laid out as `like` (a shard of it under FSDP2)."""
        return value.to(like.device, like.dtype)

    def note(self) -> Optional[str]:
        """A line about what the engine did with the models (after `prepare`), or None."""
        return None

    @contextlib.contextmanager
    def state_view(self, optimizer: Any):
        """The torch optimizer whose state a training state holds (accelerate's wrapper unwrapped by resume.py)."""
        yield optimizer

    def check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The trained parameters as a state is checked against them (their whole shapes)."""
        return params


class ShardedSteps(Steps):
    """FSDP2: torch's fully_shard on every trained model (the module docstring)."""

    gathers = True

    @staticmethod
    def find_blocks(model: Any, classes: tuple[str, ...]) -> list[Any]:
        """The modules of `model` sharded one by one before it (shard_units; a caller may give its own rule)."""
        return shard_units(model, classes)

    def prepare(self, models, slots, make_optimizer, compute_dtype):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from ..models.shards import fill_shards, kept_tensors

        return_freed_weights()
        device = self.acc.device
        mesh = init_device_mesh(device.type, (self.acc.num_processes,))
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if self.engine.offload_params else OffloadPolicy()
        self.shards: dict[str, int] = {}
        self.held: dict[str, float] = {}
        self.read: dict[str, float] = {}
        for slot in slots:
            model = models[slot]
            kept_tensors(model)  # a model built without weights (models/shards.py): its few real tensors
            autocast_forward(model, compute_dtype, device)
            blocks = self.find_blocks(model, self.engine.layer_classes)
            if not blocks and self.engine.layer_classes:
                raise BackendError(f"fsdp_transformer_layer_cls_to_wrap names {', '.join(self.engine.layer_classes)}, "
                                   f"and {slot} ({type(model).__name__}) has no module of those classes",
                                   source=self.engine.source)
            for block in blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=self.engine.reshard_after_forward,
                            offload_policy=offload)
            _outputs_not_views(model)
            fully_shard(model, mesh=mesh, reshard_after_forward=self.engine.reshard_after_forward,
                        offload_policy=offload)
            record = fill_shards(model, "cpu" if self.engine.offload_params else device)
            if record is not None:
                self.read[slot] = record.read_bytes / max(record.total_bytes, 1)
            self.shards[slot] = len(blocks)
            self.held[slot] = held_fraction(model)
        return dict(models), make_optimizer(_trained(models, slots))

    def micro(self, trained, sync):
        for model in trained:
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def backward(self, loss, model, sync):
        loss.backward()

    def step(self, optimizer, params):
        norm = None
        if self.max_grad_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(list(params), self.max_grad_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def unwrap(self, model):
        return model

    def full(self, value):
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        return value.detach().to("cpu").contiguous().clone()

    def scatter(self, value, like):
        if hasattr(like, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(value.to(like.dtype), like.device_mesh, like.placements)
        return value.to(like.device, like.dtype)

    def note(self):
        shown = ", ".join(f"{slot} in {n + 1} shard groups ({n} blocks and the rest; this process holds "
                          f"{self.held[slot]:.1%} of its weights" + (f", read {self.read[slot]:.1%} of them from "
                          f"the files" if slot in self.read else ", loaded whole first") + ")"
                          for slot, n in self.shards.items())
        return f"FSDP2: {shown}, over {self.acc.num_processes} processes"


class DeepSpeedSteps(Steps):
    """DeepSpeed ZeRO through accelerate (the module docstring)."""

    def __init__(self, accelerator, engine, max_grad_norm):
        super().__init__(accelerator, engine, max_grad_norm)
        self.gathers = engine.zero_stage == 3
        self.ds_engine: Any = None
        self.loaded: Any = None  # models/shards.py's record when the model was read into its partitions
        self.shared = 0  # the bytes of fp32 master copies share_fp32_master gave back

    def prepare(self, models, slots, make_optimizer, compute_dtype):
        from ..engine import deepspeed_config

        if self.engine.zero_stage == 3:
            return_freed_weights()
        (slot,) = slots  # config.check_engine refuses several trained models under DeepSpeed
        model = models[slot]
        autocast_forward(model, compute_dtype, self.acc.device)
        plugin = self.acc.state.deepspeed_plugin
        config = deepspeed_config(self.engine, self.batch_size, self.max_grad_norm)
        plugin.deepspeed_config.clear()
        plugin.deepspeed_config.update(config)
        if hasattr(plugin, "hf_ds_config"):
            plugin.hf_ds_config.config = plugin.deepspeed_config
        from ..models.shards import partition_skeleton

        self.loaded = partition_skeleton(model, config, self.acc.device)  # a model built without weights
        engine, optimizer = self.acc.prepare(model, make_optimizer(_trained(models, slots)))
        self.ds_engine, self.slot = engine, slot
        self.shared = share_fp32_master(engine.optimizer)
        self.held = held_fraction(engine.module)
        return {**models, slot: engine}, optimizer

    batch_size = 1  # set by steps_for

    def micro(self, trained, sync):
        return contextlib.nullcontext()

    def backward(self, loss, model, sync):
        engine = self.ds_engine
        engine.set_gradient_accumulation_boundary(sync)
        engine.backward(loss)
        engine.step()  # steps the optimizer (and clips) at the boundary only

    def step(self, optimizer, params):
        norm = None
        if self.max_grad_norm is not None:
            value = self.ds_engine.get_global_grad_norm()
            norm = None if value is None else float(value)
        return norm

    def unwrap(self, model):
        return getattr(model, "module", model)

    def trained_tensors(self, model):
        model = self.unwrap(model)
        if self.engine.zero_stage != 3:
            return super().trained_tensors(model)
        import deepspeed

        out = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    out[name] = param.detach().to("cpu").contiguous().clone()
        return out

    per_rank_state = True

    def zero_optimizer(self, optimizer: Any) -> Any:
        """DeepSpeed's ZeRO optimizer under accelerate's wrapper."""
        return getattr(optimizer, "optimizer", optimizer)

    @contextlib.contextmanager
    def state_view(self, optimizer):
        """The torch AdamW DeepSpeed steps over this process's flat fp32 partitions: its moments are this process's
        share of the optimizer state, saved as its own file. ZeRO-3 lists the partitions in the param groups only
        while it steps; they are listed while the state is read or written."""
        zero = self.zero_optimizer(optimizer)
        staged = self.engine.zero_stage == 3 and hasattr(zero, "_set_fp32_optimizer_param_groups")
        if staged:
            zero._set_fp32_optimizer_param_groups()
        try:
            yield zero.optimizer
        finally:
            if staged:
                zero._clear_fp32_optimizer_param_groups()

    def full(self, value):
        if hasattr(value, "ds_tensor"):  # a ZeRO-3 partitioned parameter: gathered by every process
            import deepspeed

            with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
                return value.detach().to("cpu").contiguous().clone()
        return super().full(value)

    def check_params(self, params):
        if self.engine.zero_stage != 3:
            return params
        return {name: torch.empty(tuple(p.ds_shape), dtype=p.dtype, device="meta") if hasattr(p, "ds_shape") else p
                for name, p in params.items()}

    def restore(self, params, weights):
        """The trained weights set from a state's whole tensors (a ZeRO-3 partition from the main process's copy),
        then DeepSpeed's fp32 masters taken from them, as its own checkpoint loading does: the weights are fp32 here
        (DeepSpeed's precision is off), so the masters are exactly the saved ones (the weights' own partitions
        when share_fp32_master shared them: a copy onto itself)."""
        import deepspeed

        for name, param in params.items():
            if hasattr(param, "ds_tensor"):
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if self.acc.is_main_process:
                        param.data.copy_(weights[name].to(param.device, param.dtype))
            else:
                param.data.copy_(weights[name].to(param.device, param.dtype))
        self.ds_engine.optimizer._restore_from_bit16_weights()  # the engine's own: DeepSpeed's ZeRO optimizer

    def note(self):
        shared = (f"its optimizer steps the fp32 weights' own partition (no master copy: {self.shared / 2**30:.2f} "
                  f"GiB less a process)") if self.shared else None
        if self.engine.zero_stage != 3:
            return f"{self.engine.name}: {shared}" if shared else None
        how = ("read into the partitions one tensor at a time" if self.loaded is not None else
               "loaded whole first: zero3_init_flag is off")
        return (f"{self.engine.name}: {self.slot}'s weights partitioned over {self.acc.num_processes} processes "
                f"(this process holds {self.held:.1%} of them, {how})" + (f"; {shared}" if shared else ""))


def share_fp32_master(zero: Any) -> int:
    """Let DeepSpeed's ZeRO optimizer step the weights' own partitions where its fp32 master copies would be the
    same values in the same dtype on the same device; returns the bytes given back.

    Why: unitgraph leaves DeepSpeed's precision off (trained weights stay fp32, as without an engine), so each
    master partition is a clone of weights that are fp32 already: a third more than the weights and AdamW's moments
    need. ZeRO-3 means to share them in that case (stage3.py `_create_fp32_partitions`: "we don't need another copy
    of the weights"), but its test compares the tensor's torch.device with the accelerator's device *name*, a
    string, which is never equal, so it always copies; ZeRO-1/2 always copy. Sharing changes no number: the master
    and the weights hold equal fp32 values from the start, and DeepSpeed's copy of the one into the other after
    each step and after loading becomes a copy onto itself. Skipped for offloaded or swapped optimizer state (on
    another device by design) and for weights in another dtype.
    """
    if getattr(zero, "offload_optimizer", False) or getattr(zero, "cpu_offload", False):
        return 0
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        pairs = list(zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat))
        swapped = getattr(zero, "_swappable_optimizer_subgroup", lambda i: False)
        pairs = [(low, master) if not swapped(i) else (None, master) for i, (low, master) in enumerate(pairs)]
    elif hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        pairs = [(parts[dist_rank], master) for parts, master, dist_rank in
                 zip(zero.parallel_partitioned_bit16_groups, zero.single_partition_of_fp32_groups,
                     _partition_ids(zero))]
    else:
        return 0
    given_back = 0
    for low, master in pairs:
        if low is None or master is low or low.dtype != master.dtype or low.device != master.device \
                or low.shape != master.shape or low.untyped_storage().data_ptr() == \
                master.untyped_storage().data_ptr() or not torch.equal(low, master):
            continue
        given_back += master.numel() * master.element_size()
        master.data = low.data
    if given_back and hasattr(zero, "_link_all_hp_params"):
        zero._link_all_hp_params()  # ZeRO-1/2's per-weight views of the masters, made anew over the shared bytes
    return given_back


def _partition_ids(zero: Any) -> list[int]:
    """This process's partition index in each of a ZeRO-1/2 optimizer's groups."""
    from deepspeed import comm as dist

    return [dist.get_rank(group=group) for group in zero.real_dp_process_group]


def held_fraction(model: Any) -> float:
    """The share of a model's weight elements this process holds: its FSDP2 shards (DTensor local parts) or its
    ZeRO-3 partitions (ds_tensor), else all of them."""
    held = total = 0
    for param in model.parameters():
        if hasattr(param, "ds_numel"):  # DeepSpeed ZeRO-3
            whole, mine = param.ds_numel, param.ds_tensor.numel()
        elif hasattr(param, "to_local"):  # FSDP2
            whole, mine = param.numel(), param.to_local().numel()
        else:
            whole = mine = param.numel()
        held, total = held + mine, total + whole
    return held / total if total else 1.0


def held_bytes(models: dict[str, Any], optimizer: Any) -> tuple[int, int]:
    """(weight bytes, optimizer-state bytes) this process holds in memory for the models and the optimizer: each
    weight's local part (an FSDP2 shard, a ZeRO-3 partition, else the whole tensor) and every tensor the optimizer
    keeps (AdamW's moments; under DeepSpeed its flat partitions and fp32 master copies too), wherever they live (an
    offloaded engine keeps them in CPU memory). What a run prints after its first step, and what the engines
    benchmark compares."""
    seen: set[int] = set()
    stores: set[int] = set()  # the weights' bytes: a master copy sharing them (share_fp32_master) is not counted twice
    weights = 0
    for model in models.values():
        if not isinstance(model, torch.nn.Module):
            continue
        for param in model.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            local = param.ds_tensor if hasattr(param, "ds_tensor") else \
                param.to_local() if hasattr(param, "to_local") else param
            weights += local.numel() * local.element_size()
            if local.device.type != "meta":
                stores.add(local.untyped_storage().data_ptr())
    state = 0
    counted: set[tuple[int, int, int]] = set()

    def add(value: Any) -> None:
        nonlocal state
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            # by where its bytes are (a DTensor's local part is a new object at every call: ids get reused)
            where = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
            if where not in counted and where[0] not in stores and local.numel() > 1:
                counted.add(where)
                state += local.numel() * local.element_size()
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)

    inner, depth = optimizer, 0
    while inner is not None and depth < 4:
        for values in getattr(inner, "state", {}).values() if isinstance(getattr(inner, "state", None), dict) else ():
            for value in values.values():
                add(value)
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            add(getattr(inner, name, None))
        inner, depth = getattr(inner, "optimizer", None), depth + 1
    return weights, state


def steps_for(accelerator: Any, engine: Any, max_grad_norm: Optional[float], batch_size: int = 1) -> Steps:
    """The run's `Steps` for its engine."""
    if engine.kind == "fsdp2":
        if accelerator.num_processes != engine.processes:  # pragma: no cover - the launch sets both
            raise BackendError(f"FSDP2 over {engine.processes} processes, but {accelerator.num_processes} started")
        return ShardedSteps(accelerator, engine, max_grad_norm)
    if engine.kind == "deepspeed":
        steps = DeepSpeedSteps(accelerator, engine, max_grad_norm)
        steps.batch_size = batch_size
        return steps
    return Steps(accelerator, engine, max_grad_norm)


def shard_units(model: Any, classes: tuple[str, ...] = ()) -> list[Any]:
    """The modules FSDP2 shards one by one, outermost first and never one inside another: those of the named
    classes, else of the model's `_no_split_modules` (its blocks), else its transformer blocks."""
    names = set(classes) or set(getattr(model, "_no_split_modules", None) or ())
    found: list[Any] = []
    if names:
        inside: set[int] = set()
        for module in model.modules():
            if id(module) in inside or module is model:
                continue
            if type(module).__name__ in names:
                found.append(module)
                inside.update(id(m) for m in module.modules())
    if not found and not classes:
        from ..models.precision import transformer_blocks

        found = transformer_blocks(model)
    return found


def _outputs_not_views(model: Any) -> None:
    """A sharded root's outputs made their own tensors: FSDP2 hooks the backward of what the root returns, and a
    hook on a view is lost if anything later writes into it in place (torch warns of it at every step). A denoiser
    that returns a slice of a larger tensor (diffusers' output[:, :n]) costs one copy of its output."""

    def own(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone() if value._base is not None else value
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(own(v) for v in value)
        if isinstance(value, list):
            return [own(v) for v in value]
        if isinstance(value, dict):
            for key in list(value.keys()):
                value[key] = own(value[key])
        return value

    forward = model.forward

    def owned(*args: Any, **kwargs: Any) -> Any:
        return own(forward(*args, **kwargs))

    model.forward = owned


def _trained(models: dict[str, Any], slots: list[str]) -> list[Any]:
    params = [p for slot in slots for p in models[slot].parameters() if p.requires_grad]
    if not params:
        raise BackendError("no trainable parameters (check --lora_target_modules / --trainable_models)")
    return params

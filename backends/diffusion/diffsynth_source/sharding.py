"""A DiffSynth pipeline's trained models sharded over the processes of a launch: DeepSpeed ZeRO (a launch with a
deepspeed_config: DiffSynth's full-training configs as shipped) or FSDP2 (an accelerate config with fsdp_version 2).

DiffSynth's runner hands its whole training module to `accelerator.prepare`, frozen models included. Here the
engine takes only the models being trained (the LoRA's base model with its adapters, or the --trainable_models)
in a `Trained` ModuleDict whose forward runs the step it is given; the frozen models stay outside it, whole, as
unitgraph's own families train them (and stage 2's pipeline has no other model). The engines are made by
train/engines.py's `DeepSpeedSteps` and `ShardedSteps`, the ones unitgraph's own loop uses.

* **DeepSpeed ZeRO**: the config's "auto" values decided by the run, DeepSpeed's own precision off, a step's
  accumulation boundary set by hand, the trained weights gathered whole for a checkpoint under ZeRO-3.
* **FSDP2**: each trained model's blocks (the classes the config names with fsdp_transformer_layer_cls_to_wrap,
  else the model's repeated blocks: `pipeline_blocks`) are `fully_shard`ed, then `Trained` with everything else
  of the trained models. DiffSynth's model functions call a DiT's parts directly (its embedders, each block), not
  its forward, so the parts outside the blocks belong to `Trained`'s own shard group, gathered where `Trained`'s
  forward, the whole step, begins. Gradient sync is on for a step's last backward pass only; the optimizer steps
  the shards (DTensors) after it.

**Why a step is the data-parallel step** (world.py): an optimizer step takes the same `processes x
--gradient_accumulation_steps` samples of the epoch's order, each process its share, each sample's draws seeded
from the sample. Both engines average the processes' gradients, so each loss is weighted by processes / samples
in the step before its backward, and the average is the step's mean gradient, as data parallel sums it (with 2
processes the weight and the average are exact powers of two). Both engines gather weights in the forward
(ZeRO-3, FSDP2) or reduce gradients in the backward (DeepSpeed at every pass), collective calls every process must
make, so every process makes the same number of passes a step: where a step's last samples leave a process
without one (an epoch's short last step), it computes a sample of the step again, weighted 0. Split equals unsplit
because both make the same engine over the same processes from the same numbers.

**What changes against data parallel.** A ZeRO optimizer steps an fp32 master copy of its partition of the
trained weights and copies it into them. With fp32 models (the UNet pipelines DiffSynth loads in fp32) that is
the data-parallel step up to the order of sums. With bf16 models (most of DiffSynth's pipelines; its
full-training examples train the DiT itself) it is not: data parallel, like DiffSynth's runner without DeepSpeed,
steps AdamW on the bf16 weights, while under ZeRO the updates accumulate in fp32, as in DiffSynth's own DeepSpeed
runs. FSDP2 steps AdamW elementwise on each process's shard of the weights in their own dtype: the data-parallel
step, in fp32 and in bf16.

**Clipping and the moving average.** --max_grad_norm clips the step's mean gradient as a whole: DeepSpeed at its
accumulation boundary over its partitions (its gradient_clipping), FSDP2 by torch's clip_grad_norm_ over the sharded
gradients (one global norm over every shard). --ema_decay follows the trained weights after each step: under ZeRO-1/2
every process holds them whole again after the step, under FSDP2 each process averages its own shards (gathered whole
for a checkpoint and a training state); ZeRO-3 leaves the weights empty between forwards and is refused (run.py).

**Training states** hold the trained weights whole and, per process, its share of AdamW's moments (and under ZeRO
of the fp32 masters) (state.py: optimizer.safetensors, optimizer-rank<R>.safetensors), so a resumed run continues
from the very same numbers: exact.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import BackendError
from .world import World

__all__ = ["ShardedTraining", "pipeline_blocks"]


def _trained_class() -> type:
    import torch

    class Trained(torch.nn.ModuleDict):
        """The pipeline's models being trained, under one engine; forward runs the step given to it, so the
        engine's hooks (ZeRO-3 and FSDP2 gather weights for the forward) are around every use of them."""

        def forward(self, compute: Callable[..., Any], *args: Any) -> Any:
            return compute(*args)

    return Trained


def pipeline_blocks(trained: Any, classes: tuple[str, ...] = ()) -> list[Any]:
    """The modules FSDP2 shards one by one in the trained models of `trained` (a ModuleDict), outermost first: the
    named `classes` (the config's fsdp_transformer_layer_cls_to_wrap), else per model what unitgraph's own models
    shard (train/engines.shard_units: `_no_split_modules`, else its ModuleLists named for blocks), else each item of
    the model's outermost ModuleLists (DiffSynth's DiTs keep their blocks in lists named `layers`, `blocks`,
    `noise_refiner`, ...). Modules without parameters are left to their parent.

    >>> import torch
    >>> class DiT(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.layers = torch.nn.Linear(2, 2), torch.nn.ModuleList(torch.nn.Linear(2, 2)
    ...                                                                                for _ in range(3))
    >>> len(pipeline_blocks(torch.nn.ModuleDict({"dit": DiT()})))
    3
    """
    import torch

    from ..train.engines import shard_units

    if classes:
        found = shard_units(trained, classes)
    else:
        found = []
        for model in trained.values():
            blocks = shard_units(model)
            if not blocks:
                inside: set[int] = set()
                for module in model.modules():
                    if isinstance(module, torch.nn.ModuleList) and id(module) not in inside:
                        blocks.extend(module)
                        inside.update(id(m) for m in module.modules())
            found.extend(blocks)
    return [block for block in found if any(True for _ in block.parameters())]


class ShardedTraining:
    """The engine around a pipeline's trained models, and what a run asks of it: a step's backward passes and
    optimizer step, the trained weights whole, this process's optimizer state for a training state, and that state
    restored."""

    def __init__(self, world: World, pipe: Any, named: list[tuple[str, Any]],
                 make_optimizer: Callable[[list[Any]], Any], accumulation: int, max_grad_norm: Optional[float] = None):
        from ..engine import check_batches
        from ..train.engines import DeepSpeedSteps, ShardedSteps

        self.world = world
        self.deepspeed = world.engine.kind == "deepspeed"
        models = list(dict.fromkeys(name.split(".")[1] for name, _ in named))  # "pipe.<model>.<...>"
        trained = _trained_class()({model: getattr(pipe, model) for model in models})
        self.models = ", ".join(models)
        if self.deepspeed:
            check_batches(world.engine, 1, accumulation)
            self.steps: Any = DeepSpeedSteps(world.accelerator, world.engine, max_grad_norm)
        else:
            self.steps = ShardedSteps(world.accelerator, world.engine, max_grad_norm)
            self.steps.find_blocks = pipeline_blocks
        wrapped, self.optimizer = self.steps.prepare({self.models: trained}, [self.models], make_optimizer, None)
        self.module = wrapped[self.models]  # DeepSpeed's engine, or `Trained` sharded in place
        # the torch AdamW the learning-rate schedule sets: under ZeRO the one it steps over the flat partitions
        self.base = self.steps.zero_optimizer(self.optimizer).optimizer if self.deepspeed else self.optimizer
        self.params = [p for group in self.base.param_groups for p in group["params"]]

    def note(self) -> str:
        """The engine in a line: where the weights are sharded, the share of them this process holds."""
        if not self.deepspeed:
            blocks = self.steps.shards[self.models]
            return (f"{self.world.describe()}: {self.models} in {blocks + 1} shard groups ({blocks} blocks and the "
                    f"rest), this process holds {self.steps.held[self.models]:.1%} of their weights (loaded whole by "
                    "DiffSynth's loader first)")
        if not self.world.engine.shards_frozen:
            return self.world.describe()
        return (f"{self.world.describe()}: the weights of {self.models} partitioned, this process holds "
                f"{self.steps.held:.1%} of them (loaded whole by DiffSynth's loader first)")

    def step(self, chunk: list[int], loss_of: Callable[[int], Any]) -> list[tuple[int, float]]:
        """This process's share of the step of samples `chunk` (world.py's order: position k on process k mod N),
        each loss's backward through the engine, then the optimizer step: [(position, loss)]."""
        size, rank = self.world.size, self.world.rank
        mine = list(range(rank, len(chunk), size))
        passes = -(-len(chunk) // size)  # every process makes as many passes as the busiest
        out = []
        for k in range(passes):
            at, last = (mine[k] if k < len(mine) else None), k == passes - 1
            with self.steps.micro([self.module], last):
                loss = self.module(loss_of, chunk[at if at is not None else 0])
                weight = size / len(chunk) if at is not None else 0.0  # the engines average over the processes
                self.steps.backward(loss * weight, self.module, last)
            if at is not None:
                out.append((at, float(loss.detach())))
        self.steps.step(self.optimizer, self.params)  # DeepSpeed stepped at the last backward already
        return out

    def within(self, compute: Callable[[], Any]) -> Any:
        """`compute()` inside the engine's forward, without gradients: under ZeRO-3 and FSDP2 the trained models'
        weights are gathered around it as around a step's forward (a validation sample drawn through the whole
        pipeline). A collective call: every process makes it."""
        import torch

        with torch.no_grad():
            return self.module(compute)

    def named(self) -> dict[str, Any]:
        """{pipe.<model>.<name>: parameter} of the trained parameters as the engine holds them (FSDP2 replaced them by
        its shards, DTensors; DeepSpeed keeps them, whole under ZeRO-1/2): what a moving average follows."""
        module = self.steps.unwrap(self.module)
        return {f"pipe.{name}": p for name, p in module.named_parameters() if p.requires_grad}

    def full(self) -> Optional[Callable[[Any], Any]]:
        """What makes a tensor laid out as `named`'s whole on the CPU where they are shards (FSDP2's gather: a
        collective call every process makes in the same order), else None (every process holds them whole)."""
        return self.steps.full if not self.deepspeed else None

    def whole(self) -> dict[str, Any]:
        """{pipe.<model>.<name>: whole tensor on the CPU} of the trained parameters, for the main process, which
        writes them (every process calls it: under ZeRO-3 and FSDP2 a gather; the others get {} under ZeRO-1/2)."""
        if not self.steps.gathers and not self.world.main:
            return {}
        return {f"pipe.{name}": value for name, value in self.steps.trained_tensors(self.module).items()}

    def _masters(self) -> list[Any]:
        if not self.deepspeed:
            return []
        zero = self.steps.zero_optimizer(self.optimizer)
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
            return list(zero.fp32_partitioned_groups_flat)
        return list(getattr(zero, "single_partition_of_fp32_groups", []))

    def optimizer_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(tensors, param groups) of this process's share: AdamW's moments and steps ("<i>.<key>", FSDP2's shards
        as this process holds them) and under ZeRO the fp32 masters ("master.<i>")."""
        from .state import optimizer_tensors

        with self.steps.state_view(self.optimizer) as view:
            tensors, groups = optimizer_tensors(view)
        for i, master in enumerate(self._masters()):
            tensors[f"master.{i}"] = master.detach().to("cpu").contiguous().clone()
        return tensors, groups

    def restore(self, trained: dict[str, Any], tensors: dict[str, Any], groups: list[dict[str, Any]],
                source: str) -> None:
        """The weights set from a state's whole tensors, then this process's masters and AdamW's state from its
        own file (`optimizer_state`'s layout)."""
        from .state import load_optimizer

        refused = BackendError("--resume: the state's optimizer file holds other partitions than this run's",
                               source=source)
        module = self.steps.unwrap(self.module)
        params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        whole = {name: trained[f"pipe.{name}"] for name in params}
        if self.deepspeed:
            self.steps.restore(params, whole)
        else:
            import torch

            with torch.no_grad():
                for name, param in params.items():  # a collective call each, in the same order on every process
                    param.copy_(self.steps.scatter(whole[name], param))
        masters = self._masters()
        if {k for k in tensors if k.startswith("master.")} != {f"master.{i}" for i in range(len(masters))}:
            raise refused
        for i, master in enumerate(masters):
            value = tensors[f"master.{i}"]
            if value.shape != master.shape:
                raise refused
            master.data.copy_(value.to(master.device, master.dtype))
        moments = {k: v for k, v in tensors.items() if not k.startswith("master.")}
        if not self.deepspeed:
            moments = _as_shards(moments, self.params, refused)
        with self.steps.state_view(self.optimizer) as view:
            load_optimizer(view, moments, groups, source)


def _as_shards(tensors: dict[str, Any], params: list[Any], refused: BackendError) -> dict[str, Any]:
    """A process's saved optimizer tensors ("<i>.<key>": its local shards) laid out as parameter i is (a DTensor
    over the same mesh and placements), so AdamW steps them with the sharded weights; a shard of another shape is
    the state of another sharding (`refused`)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in tensors.items():
        index = key.partition(".")[0]
        like = params[int(index)] if index.isdigit() and int(index) < len(params) else None
        if like is None or not isinstance(like, DTensor) or value.dim() == 0:
            out[key] = value  # AdamW's step count, or a state the optimizer's own check refuses
            continue
        if tuple(value.shape) != tuple(like.to_local().shape):
            raise refused
        out[key] = DTensor.from_local(value.to(like.device), like.device_mesh, like.placements,
                                      shape=like.shape, stride=like.stride(), run_check=False)
    return out

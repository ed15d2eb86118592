"""A DiffSynth pipeline's trained model under DeepSpeed ZeRO: a launch with a deepspeed_config (world.py).

DiffSynth's runner hands its whole training module to `accelerator.prepare`, frozen models included. Here the
engine wraps only the models being trained (the LoRA's base model with its adapters, or the --trainable_models)
in a `Trained` ModuleDict whose forward runs the step it is given; the frozen models stay outside it, whole, as
unitgraph's own families train them (and stage 2's pipeline has no other model). The engine is made by
train/engines.DeepSpeedSteps, the one unitgraph's own loop uses: the config's "auto" values decided by the run,
DeepSpeed's own precision off, a step's accumulation boundary set by hand, the trained weights gathered whole
for a checkpoint under ZeRO-3.

**Why a step is the data-parallel step** (world.py): an optimizer step takes the same `processes x
--gradient_accumulation_steps` samples of the epoch's order, each process its share, each sample's draws seeded
from the sample. DeepSpeed averages the processes' gradients, so each loss is weighted by processes / samples in
the step before its backward, and the average is the step's mean gradient, as data parallel sums it. DeepSpeed
reduces gradients in every backward pass, so every process makes the same number of them a step: where a step's
last samples leave a process without one (an epoch's short last step), it computes a sample of the step again,
weighted 0. Split equals unsplit because both make the same engine over the same processes from the same numbers.

**What changes against data parallel.** A ZeRO optimizer steps an fp32 master copy of its partition of the
trained weights and copies it into them. With fp32 models (the UNet pipelines DiffSynth loads in fp32) that is
the data-parallel step up to the order of sums. With bf16 models (most of DiffSynth's pipelines; its
full-training examples train the DiT itself) it is not: data parallel, like DiffSynth's runner without DeepSpeed,
steps AdamW on the bf16 weights, while under ZeRO the updates accumulate in fp32, as in DiffSynth's own DeepSpeed
runs.

**Training states** hold the trained weights whole and, per process, its partition of AdamW's moments and of the
fp32 masters (state.py: optimizer.safetensors, optimizer-rank<R>.safetensors), so a resumed run continues from
the very masters, not from their bf16 roundings: exact.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import BackendError
from .world import World

__all__ = ["ZeroTraining"]


def _trained_class() -> type:
    import torch

    class Trained(torch.nn.ModuleDict):
        """The pipeline's models being trained, under one engine; forward runs the step given to it, so the
        engine's hooks (ZeRO-3 gathers each layer's weights for its forward) are around every use of them."""

        def forward(self, compute: Callable[..., Any], *args: Any) -> Any:
            return compute(*args)

    return Trained


class ZeroTraining:
    """The engine around a pipeline's trained models, and what a run asks of it: a step's backward passes, the
    trained weights whole, this process's optimizer state for a training state, and that state restored."""

    def __init__(self, world: World, pipe: Any, named: list[tuple[str, Any]],
                 make_optimizer: Callable[[list[Any]], Any], accumulation: int):
        from ..engine import check_batches
        from ..train.engines import DeepSpeedSteps

        check_batches(world.engine, 1, accumulation)
        self.world = world
        models = list(dict.fromkeys(name.split(".")[1] for name, _ in named))  # "pipe.<model>.<...>"
        trained = _trained_class()({model: getattr(pipe, model) for model in models})
        self.models = ", ".join(models)
        self.steps = DeepSpeedSteps(world.accelerator, world.engine, None)
        wrapped, self.optimizer = self.steps.prepare({self.models: trained}, [self.models], make_optimizer, None)
        self.engine = wrapped[self.models]
        # the torch AdamW DeepSpeed's ZeRO optimizer steps over the flat partitions: the schedule sets its rate
        self.base = self.steps.zero_optimizer(self.optimizer).optimizer

    def note(self) -> str:
        """The engine in a line: under ZeRO-3, the share of the trained models' weights this process holds."""
        if not self.world.engine.shards_frozen:
            return self.world.describe()
        return (f"{self.world.describe()}: the weights of {self.models} partitioned, this process holds "
                f"{self.steps.held:.1%} of them (loaded whole by DiffSynth's loader first)")

    def step(self, chunk: list[int], loss_of: Callable[[int], Any]) -> list[tuple[int, float]]:
        """This process's share of the step of samples `chunk` (world.py's order: position k on process k mod N),
        each loss's backward through the engine, which steps the optimizer after the last: [(position, loss)]."""
        size, rank = self.world.size, self.world.rank
        mine = list(range(rank, len(chunk), size))
        passes = -(-len(chunk) // size)  # every process makes as many backward passes as the busiest
        out = []
        for k in range(passes):
            at = mine[k] if k < len(mine) else None
            loss = self.engine(loss_of, chunk[at if at is not None else 0])
            weight = size / len(chunk) if at is not None else 0.0  # DeepSpeed averages over the processes
            self.steps.backward(loss * weight, self.engine, k == passes - 1)
            if at is not None:
                out.append((at, float(loss.detach())))
        return out

    def whole(self) -> dict[str, Any]:
        """{pipe.<model>.<name>: whole tensor on the CPU} of the trained parameters, for the main process, which
        writes them (every process calls it: under ZeRO-3 a gather; the others get {} under ZeRO-1/2)."""
        if not self.steps.gathers and not self.world.main:
            return {}
        return {f"pipe.{name}": value for name, value in self.steps.trained_tensors(self.engine).items()}

    def _masters(self) -> list[Any]:
        zero = self.steps.zero_optimizer(self.optimizer)
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
            return list(zero.fp32_partitioned_groups_flat)
        return list(getattr(zero, "single_partition_of_fp32_groups", []))

    def optimizer_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(tensors, param groups) of this process's partition: AdamW's moments and steps ("<i>.<key>") and the
        fp32 masters ("master.<i>")."""
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

        params = {name: p for name, p in self.engine.module.named_parameters() if p.requires_grad}
        self.steps.restore(params, {name: trained[f"pipe.{name}"] for name in params})
        masters = self._masters()
        if {k for k in tensors if k.startswith("master.")} != {f"master.{i}" for i in range(len(masters))}:
            raise BackendError("--resume: the state's optimizer file holds other partitions than this run's",
                               source=source)
        for i, master in enumerate(masters):
            value = tensors[f"master.{i}"]
            if value.shape != master.shape:
                raise BackendError("--resume: the state's optimizer file holds other partitions than this run's",
                                   source=source)
            master.data.copy_(value.to(master.device, master.dtype))
        with self.steps.state_view(self.optimizer) as view:
            load_optimizer(view, {k: v for k, v in tensors.items() if not k.startswith("master.")}, groups, source)

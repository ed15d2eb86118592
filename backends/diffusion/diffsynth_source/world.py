"""The processes `accelerate launch` started for a DiffSynth pipeline, and how they train together: data parallel.

DiffSynth's examples all start with `accelerate launch`, which on a machine of several GPUs starts a process per
GPU. Each process then holds the whole pipeline, as under DiffSynth's own runner (accelerate's DDP), and an
optimizer step takes `processes x --gradient_accumulation_steps` consecutive samples of the epoch's order: each
process computes the losses of its share, the gradients of the step's samples are summed over the processes
(`sum_`), each loss divided by the step's sample count first, so every process steps with the step's mean gradient
and keeps the same weights. That is the gradient one process with `--gradient_accumulation_steps` of the same count
computes, summed in the same order: two processes equal one process accumulating two samples, bit for bit
(tests/test_diffsynth_world.py). A sample's draws are seeded from the sample itself (run.step_seed), not from the
process that computes it. Stage 1 computes each entry on one process (entry i on process i mod N).

Only the main process writes the run's files (checkpoints, training states, loss.csv, samples); the others wait
for it where it claims the output folder and where a run ends.

DeepSpeed ZeRO (an accelerate config with a deepspeed_config section: DiffSynth's full-training examples ship
ZeRO-2, ZeRO-2 with offload and ZeRO-3 ones) shards the trained model's optimizer state, gradients and, at stage
3, its weights over the processes; FSDP2 (fsdp_version 2) shards all three. The World then carries the launch's
engine and what makes it (sharding.py trains under it): DeepSpeed's Accelerator, or for FSDP2 accelerate's
PartialState, whose process group torch's fully_shard uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

__all__ = ["World", "launched"]


@dataclass(frozen=True)
class World:
    """This process's place among the launched ones."""

    size: int = 1
    rank: int = 0
    device: str = "cpu"  # where this process's pipeline lives: its GPU (accelerate's local rank), else the CPU
    engine: Optional[Any] = field(default=None, compare=False)  # engine.Engine of a sharded launch, else None
    accelerator: Optional[Any] = field(default=None, compare=False)  # what makes that engine (its device, processes)

    @property
    def sharded(self) -> bool:
        """Whether the trained models are sharded by an engine, DeepSpeed ZeRO or FSDP2 (sharding.py)."""
        return self.engine is not None and self.engine.kind in ("deepspeed", "fsdp2")

    def describe(self) -> str:
        """The engine in the words a training state records: runs of another engine compute other numbers (data
        parallel over any number of processes is one, as world.py argues)."""
        if not self.sharded:
            return "data parallel"
        return f"{self.engine.describe()} over {self.size} process{'es' if self.size != 1 else ''}"

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every process gets here."""
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def agree(self, ok: bool) -> bool:
        """Whether every process says `ok` (a collective call: each process calls it once at the same place)."""
        if self.size <= 1:
            return ok
        import torch

        return bool(self.sum_(torch.tensor([0.0 if ok else 1.0])).item() == 0)

    def sum_(self, tensor: Any) -> Any:
        """`tensor` summed over the processes, in place (every process gets the sum)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_gradients(self, params: Iterable[Any]) -> None:
        """Each parameter's gradient summed over the processes, in place; a parameter no process has a gradient
        for keeps none (AdamW then skips it, as it does in one process)."""
        if self.size <= 1:
            return
        import torch

        params = list(params)
        held = self.sum_(torch.tensor([float(p.grad is not None) for p in params]))
        for p, count in zip(params, held.tolist()):
            if count == 0:
                continue
            if p.grad is None:  # this process had no sample touching it in this step
                p.grad = torch.zeros_like(p)
            self.sum_(p.grad)


def launched() -> World:
    """The launch's processes (accelerate's environment; one without a launch), their process group started; a
    DeepSpeed launch's engine read and its Accelerator made (engine.py, session.py); an FSDP2 launch's engine read
    (FSDP1 refused in one line there)."""
    import torch

    from ..engine import engine_from_env

    engine = engine_from_env()
    cuda = torch.cuda.is_available()
    if engine.kind == "deepspeed":
        from ..session import deepspeed_accelerator

        accelerator = deepspeed_accelerator(engine, [], {}, engine.processes > 1)
        return World(size=int(accelerator.num_processes), rank=int(accelerator.process_index),
                     device=str(accelerator.device) if cuda else "cpu", engine=engine, accelerator=accelerator)
    if engine.processes <= 1:
        return World(device="cuda" if cuda else "cpu")
    from accelerate import PartialState

    state = PartialState(cpu=not cuda)  # starts the process group (gloo on the CPU, NCCL on GPUs)
    return World(size=int(state.num_processes), rank=int(state.process_index),
                 device=str(state.device) if cuda else "cpu", engine=engine if engine.kind == "fsdp2" else None,
                 accelerator=state if engine.kind == "fsdp2" else None)

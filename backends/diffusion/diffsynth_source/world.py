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
for it where it claims the output folder and where a run ends. DeepSpeed and FSDP2 (from an accelerate config
with a deepspeed_config or fsdp_config, as DiffSynth's full-training examples ship them) shard the model over the
processes, which DiffSynth's pipelines are not trained with here yet: refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import BackendError

__all__ = ["World", "launched"]


@dataclass(frozen=True)
class World:
    """This process's place among the launched ones."""

    size: int = 1
    rank: int = 0
    device: str = "cpu"  # where this process's pipeline lives: its GPU (accelerate's local rank), else the CPU

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every process gets here."""
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

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
    sharding engine refused in one line."""
    import torch

    from ..engine import engine_from_env, requested_sharding

    sharding = requested_sharding()
    if sharding:
        raise BackendError(f"{sharding} from accelerate launch: a DiffSynth pipeline trains data parallel so far "
                           "(each process holding the whole pipeline); launch it with an accelerate config without "
                           "deepspeed_config or fsdp_config")
    engine = engine_from_env()
    cuda = torch.cuda.is_available()
    if engine.processes <= 1:
        return World(device="cuda" if cuda else "cpu")
    from accelerate import PartialState

    state = PartialState(cpu=not cuda)  # starts the process group (gloo on the CPU, NCCL on GPUs)
    return World(size=int(state.num_processes), rank=int(state.process_index),
                 device=str(state.device) if cuda else "cpu")

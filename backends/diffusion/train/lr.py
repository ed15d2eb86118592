"""The learning-rate schedule of a run (--lr_scheduler, --lr_warmup_steps), stepped once per optimizer step.

`diffsynth`, the default, is what DiffSynth-Studio's training runner does: it wraps AdamW in torch's
`ConstantLR` with its defaults, so the first 5 optimizer steps run at a third of the learning rate and
the rest at the learning rate. The other names are diffusers' `get_scheduler` schedules (constant,
constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial) over the run's optimizer steps.

Why a resumed run gets the uninterrupted run's rates: every one of these schedules is stepped once per
optimizer step and never reads the loss, so the rate at step N depends on N alone. `seek` replays the N
steps on a fresh schedule, the same calls in the same order as the uninterrupted run made them, so even
ConstantLR's multiplicative update gives bitwise the same rate; the state records the schedule's settings
(`must_match`) rather than its internals.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["DIFFSYNTH_FACTOR", "DIFFSYNTH_STEPS", "make_lr_schedule", "schedule_needs_total", "seek"]

# torch.optim.lr_scheduler.ConstantLR's defaults, which DiffSynth-Studio's runner leaves as they are
DIFFSYNTH_FACTOR = 1.0 / 3.0
DIFFSYNTH_STEPS = 5
_TOTAL_FREE = ("diffsynth", "constant", "constant_with_warmup")


def schedule_needs_total(name: str) -> bool:
    """Whether the schedule's rates depend on the run's total number of optimizer steps (a decay to the end)."""
    return name not in _TOTAL_FREE


def make_lr_schedule(name: str, optimizer: Any, warmup_steps: int, total_steps: int) -> Any:
    """The torch LR scheduler for `name` on `optimizer` (the optimizer itself, not accelerate's wrapper)."""
    import torch

    if name == "diffsynth":
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=DIFFSYNTH_FACTOR, total_iters=DIFFSYNTH_STEPS)
    from diffusers.optimization import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max(1, total_steps))


def step(schedule: Any) -> None:
    """One optimizer step's advance (torch's warning about a step before the optimizer's does not apply: the
    loop steps the optimizer first; a replay in `seek` has no optimizer step to make)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        schedule.step()


def seek(schedule: Any, steps: int) -> None:
    """Advance a fresh schedule by `steps` optimizer steps (a resumed run's start), as the uninterrupted run did."""
    for _ in range(steps):
        step(schedule)

"""What a run did: one record every stage fills in (the plan, the cache's reuse, losses, checkpoints, times).

`stages.run` returns it; the tests and the benchmarks read it instead of parsing printed lines.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from unitgraph.plan import Plan


@dataclass
class RunResult:
    task: str
    output_path: Path
    plan: Plan
    plan_path: Optional[Path] = None
    cache_path: Optional[Path] = None
    cache_reused: bool = False
    entries_computed: int = 0
    entries_reused: int = 0
    computed_indices: list[int] = field(default_factory=list)  # samples whose entry stage 1 computed
    skipped: list[dict[str, Any]] = field(default_factory=list)  # samples left out: {"index", "reason"}
    stage1_reason: str = ""
    loss_csv: Optional[Path] = None
    loss_plot: Optional[Path] = None
    checkpoints: list[Path] = field(default_factory=list)
    stage_times: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    steps: int = 0
    step_times: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    # (weight bytes, optimizer-state bytes) the process held after its first step (train/engines.held_bytes)
    held_bytes: Optional[tuple[int, int]] = None  # with --max_grad_norm: each step's norm before clipping
    replaced: Optional[Path] = None  # where --overwrite moved an earlier run's files
    resumed_from: Optional[Path] = None  # the training state --resume continued from
    sample_images: list[Path] = field(default_factory=list)  # validation samples written
    losses: list[float] = field(default_factory=list)
    memory_plan: Optional[dict[str, Any]] = None  # --dry_run: what each stage would need (memory_plan.py)

    @property
    def median_step_s(self) -> Optional[float]:
        times = self.step_times[1:] or self.step_times  # the first step pays one-off set-up costs
        return statistics.median(times) if times else None

    @property
    def last_checkpoint(self) -> Optional[Path]:
        return self.checkpoints[-1] if self.checkpoints else None

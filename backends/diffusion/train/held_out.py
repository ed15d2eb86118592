"""The held-out loss (--validation_dataset): the trained model's loss on samples stage 1 cached apart.

Every held-out sample goes through the plan's train units and the loss exactly as a training sample does, from its
cache entry (no encoder), under no_grad, with its draws (noise, timestep, a latent sample) from the purpose path
("sample", HELD_OUT_EPOCH, its key, ...): the same noise and timesteps at every evaluation and in every run of the
same --seed, so two checkpoints compare exactly, and none of the training draws, which derive from integer epochs,
is touched. Torch's global stream (dropout) is forked around it, so the training run's numbers are those of a run
without it. The value is the mean over the held-out samples, written to OUTPUT/validation_loss.csv.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional

from unitgraph.errors import OutputError

from ..randomness import seeded_global_stream

HELD_OUT_EPOCH = "held-out"  # the draws' epoch: a word, never one of the training epochs (0, 1, ...)
FILE = "validation_loss.csv"


def held_out_loss(cfg: Any, data: Any, ctx: Any) -> float:
    """The mean loss over `data`'s samples (a `Stage2Data` of the held-out items, one a batch) with the weights as
    they are; the training context's epoch and sample are restored after."""
    import torch

    saved = ctx.epoch, ctx.sample_key
    total, count = 0.0, 0
    try:
        with torch.no_grad(), seeded_global_stream(cfg.seed, HELD_OUT_EPOCH):
            batches = data.iterate(HELD_OUT_EPOCH, ctx, prefetch=0)
            try:
                for batch in batches:
                    ctx.epoch, ctx.sample_key = HELD_OUT_EPOCH, batch.sample_keys[0]
                    loss = cfg.pipeline.loss(ctx, batch.inputs)
                    total += float(loss.detach().float()) * len(batch)
                    count += len(batch)
            finally:
                batches.close()
    finally:
        ctx.epoch, ctx.sample_key = saved
    return total / max(1, count)


class HeldOutLog:
    """OUTPUT/validation_loss.csv (main process), a row per evaluation: step, epoch, loss, samples. A resumed run
    keeps the rows up to its state's step and rewrites the file from there."""

    def __init__(self, path: Path, main: bool, resumed_step: Optional[int] = None):
        self.path, self.rows = path, []
        self._file = self._writer = None
        kept = read_held_out_csv(path) if resumed_step is not None and path.is_file() else []
        if not main:
            return
        try:
            self._file = path.open("w", encoding="utf-8", newline="")
            self._writer = csv.writer(self._file)
            self._writer.writerow(["step", "epoch", "loss", "samples"])
            for row in kept:
                if resumed_step is not None and row["step"] <= resumed_step:
                    self.add(row["step"], row["epoch"], row["loss"], row["samples"])
            self._file.flush()
        except OSError as exc:
            raise OutputError(f"cannot write the held-out loss log ({exc.strerror or exc})", source=str(path)) from None

    def add(self, step: int, epoch: int, loss: float, samples: int) -> None:
        self.rows.append((step, epoch, loss, samples))
        if self._writer is not None:
            try:
                self._writer.writerow([step, epoch, repr(loss), samples])
                self._file.flush()
            except OSError as exc:
                raise OutputError(f"cannot write the held-out loss log ({exc.strerror or exc}) at step {step}",
                                  source=str(self.path)) from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_held_out_csv(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a validation_loss.csv (a damaged file reads as the rows before the damage)."""
    rows = []
    try:
        with Path(path).open(encoding="utf-8", newline="") as handle:
            for r in csv.DictReader(handle):
                try:
                    rows.append({"step": int(r["step"]), "epoch": int(r["epoch"]), "loss": float(r["loss"]),
                                 "samples": int(r["samples"])})
                except (KeyError, TypeError, ValueError):
                    break
    except (OSError, UnicodeDecodeError, csv.Error):
        return rows
    return rows

"""DiffSynth-Studio's own pipelines as a source of families: its units, its model loader and its loss, run split.

unitgraph's eight families are written over diffusers' classes. DiffSynth-Studio ships many more, each a
`BasePipeline` subclass whose `units` declare what they read, write and call (`PipelineUnit`), and whose training
step its repository's `examples/<family>/model_training/train.py` assembles from the same few parts:

1. a dataset row becomes three dicts (`inputs_shared`, `inputs_posi`, `inputs_nega`): the image, its size, the
   prompt, the empty negative prompt, `cfg_scale` 1 and the pipeline's device (`glue.py` declares this per pipeline);
2. float tensors are moved to the pipeline's dtype, then every unit runs in order through `pipe.unit_runner`;
3. the task's loss (`FlowMatchSFTLoss` for `sft`: a timestep and noise drawn from torch's global stream;
   `DirectDistillLoss` for `direct_distill`: the sample's noise denoised in its steps, no draw) calls
   `pipe.model_fn` with every input.

This package runs those parts as they are (the installed `diffsynth` package's own classes and functions) and
adds what unitgraph adds to its own families: the plan decides which units run once in stage 1 (`plan.py`: the
`diffsynth:` adapter's reading of the pipeline's units, split by the core's fixed point), stage 1 writes each
sample's state after those units to a safetensors entry, and stage 2 restores it and runs the rest (`run.py`).

Why split equals unsplit, and both equal DiffSynth's own step: the only draws of a step come from torch's global
stream, seeded once per step from (--seed, epoch, sample); units the plan puts in stage 1 are deterministic (the
adapter marks a unit that draws as nondeterministic, and the core keeps such a unit, and every unit reading what
it writes, in training), so they take nothing from the stream, and stage 2 draws exactly what the unsplit step
draws after the same seed, in the same order. DiffSynth's step, seeded the same way, draws the same numbers
(tests/test_diffsynth_source.py compares losses and LoRA gradients bit for bit at fp32). What the plan cannot see
is checked while stage 1 runs (`hazards.py`): a unit that draws from the stream, writes a param it does not
declare or touches a model it does not name stops the run in one line naming it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["available", "EXTRA_HINT"]

EXTRA_HINT = ("DiffSynth-Studio is not installed here: install the diffsynth extra beside a torch and torchvision that load "
              "together (bash scripts/setup_diffsynth.sh makes .venv-diffsynth; docs/diffsynth.md)")


def available() -> bool:
    """Whether the `diffsynth` package can be imported here (found, without importing it)."""
    return importlib.util.find_spec("diffsynth") is not None

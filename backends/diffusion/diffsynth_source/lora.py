"""The parts of DiffSynth's `DiffusionTrainingModule` a run borrows, and its LoRA defaults.

DiffSynth's training module is a torch module whose methods need nothing of its own state: `transfer_data_to_device`
(the inputs to the pipeline's device and dtype), `parse_lora_target_modules` (its `""` auto-detection of the linear
layers of a model's block lists), `add_lora_to_model` (peft's `inject_adapter_in_model`, the LoRA upcast to the
pipeline's dtype) and `export_trainable_state_dict`. One empty instance lends them, so a run does each step as
DiffSynth does.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

__all__ = ["DIFFSYNTH_LORA_TARGETS", "DIFFSYNTH_REMOVE_PREFIX", "helper", "target_modules"]

DIFFSYNTH_REMOVE_PREFIX = "pipe.dit."  # DiffSynth's --remove_prefix_in_ckpt default
DIFFSYNTH_LORA_TARGETS = "q,k,v,o,ffn.0,ffn.2"  # DiffSynth's --lora_target_modules default

_HELPER: list[Any] = []


def helper() -> Any:
    """One `DiffusionTrainingModule` (an empty torch module) whose methods the runs borrow."""
    if not _HELPER:
        from diffsynth.diffusion.training_module import DiffusionTrainingModule

        _HELPER.append(DiffusionTrainingModule())
    return _HELPER[0]


def target_modules(model: Any, given: Any) -> list[str]:
    """--lora_target_modules as DiffSynth reads it for `model` (None: its parser's default; "": its auto-detection,
    whose printed line is kept out of the run's output)."""
    raw = DIFFSYNTH_LORA_TARGETS if given is None else given
    with contextlib.redirect_stdout(io.StringIO()):
        return helper().parse_lora_target_modules(model, raw)

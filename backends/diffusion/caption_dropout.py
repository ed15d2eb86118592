"""Caption dropout (`--caption_dropout P`): with probability P a step trains on the empty prompt instead of the
sample's own, drawn per sample and epoch from the sample's `caption_dropout` stream (randomness.py).

The draw is a unit, so the planner places it and the verifier checks the split like any other unit. Which unit
depends on where the prompt is encoded:

* **Frozen prompt encoders** (the usual LoRA on the DiT): `CaptionDropout` runs after the prompt units (the units
  that read only `prompt` and call a model, train/validation.prompt_units). It reads their outputs and writes the
  same params (an update chain): unchanged, or, when the draw says so, the empty prompt's encoding. It is random
  and calls no model, so the fixed point keeps it in stage 2 while the prompt units stay in stage 1. The cache
  holds each sample's real prompt, every epoch draws anew, and stage 2 loads no text encoder.
  The empty prompt's encoding is the prompt units' output for "": the family's own empty-prompt encoding, with
  its prompt template. It is computed once per run, not per sample. The unsplit run computes it with its encoders
  at its start. Stage 1 computes it and stores it beside the cache, sealed and checked like the encoded
  validation prompts (`empty_prompt.safetensors`, cache/encoded_prompts.py). Stage 2 reads it from there, cast
  as the entries are cast. Both runs hand the unit the same tensor, so split == unsplit.
* **Trained prompt encoders** (a text-encoder LoRA, or one trained in full): `PromptDropout` runs before the
  prompt units and empties the prompt text itself, so the empty prompt is encoded live with the current weights,
  as the prompt is. The prompt units are in stage 2 already, because they train.

Both units draw one number from the same stream, so the two variants drop the same samples in the same epochs.
A pipeline that encodes its prompt together with something else (an edit image) has no encoding of the empty
prompt that is the same for every sample; it is refused in one line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from .errors import BackendError
from .family import unit

__all__ = ["CAPTION_DROPOUT", "EMPTY", "check_caption_dropout", "dropped", "encoded_live", "with_caption_dropout"]

EMPTY = ""  # the prompt a dropped caption becomes
CAPTION_DROPOUT = "CaptionDropout"  # the unit after frozen prompt encoders: a plan with it needs the empty prompt


def dropped(ctx: Any) -> bool:
    """Whether this sample's caption is dropped in this epoch: one uniform draw of its `caption_dropout` stream."""
    import torch

    return bool(torch.rand((), generator=ctx.rng("caption_dropout")).item() < ctx.settings.caption_dropout)


def check_caption_dropout(p: float) -> None:
    """A one-line error for a probability outside [0, 1]."""
    if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 <= p <= 1.0):
        raise BackendError(f"--caption_dropout must be a probability between 0 and 1, got {p}")


def _prompt_units(pipeline: Any) -> list[Any]:
    return [u for u in pipeline.units if tuple(u.inputs) == ("prompt",) and u.models]


def encoded_live(pipeline: Any, trained: Iterable[str]) -> bool:
    """Whether the prompt is encoded in training: a model of a prompt unit is trained (a LoRA or in full)."""
    trained = set(trained)
    return any(m in trained for u in _prompt_units(pipeline) for m in u.models)


def with_caption_dropout(pipeline: Any, p: float, trained: Iterable[str]) -> Any:
    """`pipeline` with the dropout unit placed (see the module docstring); unchanged when `p` is 0. A pipeline
    whose prompt is read by a unit together with other inputs is refused in one line."""
    if not p:
        return pipeline
    prompt_units = _prompt_units(pipeline)
    others = [u for u in pipeline.units if "prompt" in u.inputs and u not in prompt_units]
    if not prompt_units or others:
        with_what = ", ".join(i for i in others[0].inputs if i != "prompt") if others else ""
        why = (f"unit {others[0].name} encodes the prompt together with {with_what}" if others
               else "no unit of it encodes the prompt alone")
        raise BackendError(f"--caption_dropout: pipeline {pipeline.name} has no empty-prompt encoding that is the same "
                           f"for every sample ({why}); caption dropout is not supported for it")
    units = list(pipeline.units)
    if encoded_live(pipeline, trained):
        first = min(units.index(u) for u in prompt_units)
        units.insert(first, _prompt_dropout())
    else:
        outputs = tuple(dict.fromkeys(o for u in prompt_units for o in u.outputs))
        last = max(units.index(u) for u in prompt_units)
        units.insert(last + 1, _caption_dropout(outputs))
    return dataclasses.replace(pipeline, units=tuple(units))


def _prompt_dropout() -> Any:
    @unit("PromptDropout", inputs=("prompt",), outputs=("prompt",), deterministic=False,
          settings=("seed", "caption_dropout"))
    def prompt_dropout(ctx: Any, prompt: Any) -> dict[str, Any]:
        return {"prompt": EMPTY if dropped(ctx) else prompt}

    return prompt_dropout


def _caption_dropout(outputs: tuple[str, ...]) -> Any:
    def caption_dropout(ctx: Any, **encoded: Any) -> dict[str, Any]:
        if not dropped(ctx):
            return dict(encoded)
        empty = getattr(ctx, "empty_prompt", None)
        if empty is None:  # the runner sets it wherever this unit runs (train/loop.py)
            raise RuntimeError("CaptionDropout ran without the empty prompt's encoding in its context")
        return {name: empty[name] for name in outputs}

    return unit(CAPTION_DROPOUT, inputs=outputs, outputs=outputs, deterministic=False,
                settings=("seed", "caption_dropout"))(caption_dropout)

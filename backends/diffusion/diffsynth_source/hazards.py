"""Checking, while stage 1 runs, that each DiffSynth unit does only what it declares.

The plan trusts each unit's declaration (`input_params`, `output_params`, `onload_model_names`) and the adapter's
reading of its code (what `process` returns, whether it calls a random function). A unit that does more than that
would make a split differ from the unsplit run without any error, so stage 1 watches each unit it runs:

- **draws**: torch's global random state before and after the unit; a unit that changed it drew numbers the plan
  did not know of (its stage-1 value would be frozen into the cache while the unsplit run draws afresh);
- **writes**: every param of the three input dicts the unit added or replaced must be one of its outputs;
- **models**: a model the stage does not load (its file is given, the plan gives it to another stage) is there as
  its skeleton, built on the meta device from the table entry that recognised its file: a unit may read what it
  is (Ideogram 4's prompt unit reads the DiT's patch size), but calling any of its modules, or computing an output
  from its weights, stops the run; `if pipe.text_encoder is not None:` sees the skeleton, so a unit calling a model
  it does not name is caught rather than skipped. The skeleton's entry is part of stage 1's cache key.

Each is one line naming the unit. What is not caught: in-place changes to a tensor a unit did not declare as an
output, and draws from Python's or NumPy's random modules.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import BackendError

__all__ = ["UnitHazard", "check_unit", "install_skeletons", "state_identities"]


class UnitHazard(BackendError):
    """A unit that does not do what it declares."""


def install_skeletons(pipe: Any, skeletons: dict[str, Any], stage: str) -> None:
    """Put each model's skeleton (built on the meta device: attributes and config, no weights) on the pipeline
    attribute it fills, where the stage loaded nothing; calling any of its modules is a UnitHazard."""

    def refuse(attribute: str) -> Any:
        def hook(_module: Any, _args: Any) -> None:
            raise UnitHazard(f"calls the model {attribute}, which {stage} does not load and the unit does not name in "
                             "its onload_model_names")
        return hook

    for attribute, skeleton in skeletons.items():
        if getattr(pipe, attribute, None) is not None:
            continue
        for module in skeleton.modules():
            module.register_forward_pre_hook(refuse(attribute))
        setattr(pipe, attribute, skeleton)


def state_identities(state: tuple[dict, dict, dict]) -> dict[tuple[int, str], int]:
    """{(dict position, param): id(value)} of the three input dicts."""
    return {(k, name): id(value) for k, part in enumerate(state) for name, value in part.items()}


def check_unit(name: str, outputs: Iterable[str], before: dict[tuple[int, str], int], rng_before: Any,
               state: tuple[dict, dict, dict]) -> None:
    """One line naming the unit when it drew from torch's stream or wrote a param it does not declare."""
    import torch

    if not torch.equal(rng_before, torch.get_rng_state()):
        raise UnitHazard(f"unit {name} draws from torch's random stream but its code does not show it; its output "
                         "cannot be cached (the unsplit run draws afresh every step)")
    allowed = set(outputs)
    for k, part in enumerate(state):
        for param, value in part.items():
            if getattr(value, "is_meta", False):
                raise UnitHazard(f"unit {name} computes {param} from the weights of a model it does not name in its "
                                 "onload_model_names (this stage holds only that model's skeleton)")
    for key, ident in state_identities(state).items():
        if before.get(key) != ident and key[1] not in allowed:
            side = ("inputs_shared", "inputs_posi", "inputs_nega")[key[0]]
            raise UnitHazard(f"unit {name} writes {key[1]} ({side}), which it does not declare as an output; the "
                             "plan cannot see who else reads it")

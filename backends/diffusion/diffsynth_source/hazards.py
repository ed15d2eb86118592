"""Checking, while stage 1 runs, that each DiffSynth unit does only what it declares.

The plan trusts each unit's declaration (`input_params`, `output_params`, `onload_model_names`) and the adapter's
reading of its code (what `process` returns, whether it calls a random function). A unit that does more than that
would make a split differ from the unsplit run without any error, so stage 1 watches each unit it runs:

- **draws**: torch's global random state before and after the unit; a unit that changed it drew numbers the plan
  did not know of (its stage-1 value would be frozen into the cache while the unsplit run draws afresh);
- **writes**: every param of the three input dicts the unit added or replaced must be one of its outputs;
- **models**: a model the stage did not load (its file is given, the plan gives it to another stage) is a stand-in
  on the pipeline that stops the run when touched, so a unit calling a model it does not name is caught rather than
  skipped (`if pipe.text_encoder is not None:` sees the stand-in, not None).

Each is one line naming the unit. What is not caught: in-place changes to a tensor a unit did not declare as an
output, and draws from Python's or NumPy's random modules.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import BackendError

__all__ = ["UnitHazard", "Unloaded", "check_unit", "install_stand_ins", "state_identities"]


class UnitHazard(BackendError):
    """A unit that does not do what it declares."""


class Unloaded:
    """Stands in for a model this stage does not load; any use of it is a UnitHazard."""

    def __init__(self, attribute: str, stage: str):
        object.__setattr__(self, "_attribute", attribute)
        object.__setattr__(self, "_stage", stage)

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        raise UnitHazard(f"uses the model {self._attribute}, which {self._stage} does not load and the unit does not "
                         "name in its onload_model_names")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        self._refuse()

    __call__ = _refuse

    def __bool__(self) -> bool:
        self._refuse()
        return False


def install_stand_ins(pipe: Any, attributes: Iterable[str], stage: str) -> None:
    """Put an `Unloaded` stand-in on each of `attributes` the pipeline holds no model for."""
    for name in attributes:
        if getattr(pipe, name, None) is None:
            getattr(pipe, "_modules", {}).pop(name, None)  # an nn.Module keeps a None child among its modules
            object.__setattr__(pipe, name, Unloaded(name, stage))


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
    for key, ident in state_identities(state).items():
        if before.get(key) != ident and key[1] not in allowed:
            side = ("inputs_shared", "inputs_posi", "inputs_nega")[key[0]]
            raise UnitHazard(f"unit {name} writes {key[1]} ({side}), which it does not declare as an output; the "
                             "plan cannot see who else reads it")

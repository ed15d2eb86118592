"""Caption dropout for a DiffSynth pipeline (`--caption_dropout P`): with probability P a step trains on its sample
with the empty caption, drawn per sample and epoch.

**What a dropped step is.** The sample as the dataset gives it, its prompt replaced by "" before any unit runs:
every unit that reads the prompt (DiffSynth's prompt embedders on their positive side, a take-over unit, a unit
reading it with an edit image) sees "", and nothing else changes. This is the definition for every pipeline of the
path alike; nothing about a particular prompt unit is assumed.

**Why split equals unsplit.** The draw comes from a generator of its own, seeded from (--seed, epoch, sample)
(randomness.py's purpose paths), so both runs drop the same samples in the same epochs and the training stream the
step seeds is untouched. The unsplit run runs stage 1's units on the emptied sample when the draw says so. Stage 1,
asked for caption dropout, runs its units a second time on each sample with the empty caption and stores in the
sample's entry what differs from its own state (`difference`: the prompt units' outputs, or the prompt text itself
where the prompt is encoded in training); stage 2 applies it to the cached state of a dropped step (`applied`).
Stage 1's units are deterministic (hazards.py checks them as they run), so the applied state is the state the
unsplit run computes, value for value; a state from which the empty caption would remove a param is refused, as
the difference could not say it.
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendError
from ..randomness import generator

__all__ = ["EMPTY", "EMPTY_CAPTION", "applied", "difference", "dropped", "emptied"]

EMPTY = ""  # the caption a dropped step trains on
EMPTY_CAPTION = "empty_caption"  # the part of a cache entry holding what the empty caption changes
PARTS = ("inputs_shared", "inputs_posi", "inputs_nega")


def dropped(seed: int, epoch: int, sample_id: str, p: float) -> bool:
    """Whether the caption of `sample_id` is dropped in `epoch`: one uniform draw, seeded from (seed, epoch, sample),
    below `p`.

    >>> dropped(3, 0, "a", 0.0), dropped(3, 0, "a", 1.0)
    (False, True)
    >>> dropped(3, 0, "a", 0.5) == dropped(3, 0, "a", 0.5)
    True
    """
    if p <= 0:
        return False
    import torch

    return bool(torch.rand((), generator=generator(seed, "diffsynth-caption-dropout", epoch, sample_id)).item() < p)


def emptied(state: tuple[dict, dict, dict]) -> tuple[dict, dict, dict]:
    """The inputs of a sample (shared, positive, negative) with its prompt replaced by "" wherever it is given; the
    negative prompt is the pipeline's own and stays."""
    return tuple({**part, "prompt": EMPTY} if "prompt" in part else dict(part) for part in state)  # type: ignore


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    try:
        return bool(a == b)
    except Exception:  # a value without a plain equality: counted as changed, so it is stored
        return False


def difference(state: tuple[dict, dict, dict], empty: tuple[dict, dict, dict], unit_names: str) -> dict[str, dict]:
    """{part: {param: value}} of the params whose value the empty caption changes (or adds), per part of the state
    (`PARTS`); a param it removes is refused in one line (`unit_names`: stage 1's units, for the message)."""
    out = {}
    for name, mine, theirs in zip(PARTS, state, empty):
        gone = sorted(set(mine) - set(theirs))
        if gone:
            raise BackendError(f"--caption_dropout: with the empty caption stage 1's units ({unit_names}) leave out "
                               f"{', '.join(gone)}, which a cached step could not leave out; train without "
                               "--caption_dropout")
        out[name] = {k: v for k, v in theirs.items() if k not in mine or not _same(mine[k], v)}
    return out


def applied(state: tuple[dict, dict, dict], changes: dict[str, dict]) -> tuple[dict, dict, dict]:
    """The cached state of a dropped step: `state` with `difference`'s changes put in."""
    return tuple({**part, **changes.get(name, {})} for name, part in zip(PARTS, state))  # type: ignore

"""Adapters: read pipelines people already declare elsewhere as unitgraph pipelines.

- `diffusers_modular` (`diffusers:` references): diffusers Modular Pipelines blocks.
- `diffsynth` (`diffsynth:` references): DiffSynth-Studio pipeline units.

Both are backends of the `unitgraph.backends` entry-point group that offer `resolve(name, ...)`
(see unitgraph/references.py), and neither imports torch, diffusers or DiffSynth-Studio when it is
imported: the diffusers adapter imports diffusers when it resolves a reference, the DiffSynth
adapter can read a source folder without importing anything. docs/adapters.md describes the
mappings and the decisions behind them.

What an adapter has to tell the user but is not an error (a conservative choice it made, a
declaration mistake it found) is issued as a Python warning of class `AdapterNote` or
`DeclarationWarning`: Python users see ordinary warnings, the command line prints one line each on
stderr (`note: ...`, `warning: ...`).
"""

from __future__ import annotations

import warnings


class AdapterNote(UserWarning):
    """Something an adapter decided that changes the pipeline it produced (printed as `note:`)."""


class DeclarationWarning(AdapterNote):
    """A declaration mistake in the source pipeline that changes its own behaviour (printed as `warning:`)."""


def note(message: str) -> None:
    warnings.warn(message, AdapterNote, stacklevel=3)


def declaration_warning(message: str) -> None:
    warnings.warn(message, DeclarationWarning, stacklevel=3)


def short_list(names, limit: int = 6) -> str:
    """`a, b, c` or `a, b, c and 4 more`, for one-line notes."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


__all__ = ["AdapterNote", "DeclarationWarning", "declaration_warning", "note", "short_list"]

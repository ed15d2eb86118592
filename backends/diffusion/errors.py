"""The backend's one error kind for bad input: a `BackendError` is printed as one line, exit code 2.

It sits at the bottom of the backend's imports so that every room (models, data, cache, train) and
every family can raise it without importing the command line (`args.py`) that users see it through.
"""

from __future__ import annotations

from unitgraph.errors import UnitgraphError


class BackendError(UnitgraphError):
    """Bad input to the diffusion backend: printed as one line, exit code 2."""

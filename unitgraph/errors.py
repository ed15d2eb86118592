"""Errors the command line turns into exit code 2 and one line on stderr.

Every error a user can cause by handing us bad input derives from `UnitgraphError`, so the CLI
can catch exactly those and let real bugs keep their tracebacks.
"""

from __future__ import annotations


class UnitgraphError(Exception):
    """Bad input: printed as one line, exit code 2."""

    def __init__(self, message: str, *, source: str | None = None, unit: str | None = None):
        self.message = message
        self.source = source
        self.unit = unit
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = []
        if self.source:
            parts.append(str(self.source))
        if self.unit:
            parts.append(f"unit {self.unit!r}")
        prefix = ": ".join(parts)
        text = f"{prefix}: {self.message}" if prefix else self.message
        return " ".join(text.split())  # one line, whatever the message contained


class SpecError(UnitgraphError):
    """A pipeline spec that cannot be loaded or is not valid."""


class PlanFileError(UnitgraphError):
    """A plan file that cannot be read as a unitgraph plan."""


class OutputError(UnitgraphError):
    """A file or folder unitgraph was asked to write cannot be written (or is not its to write)."""

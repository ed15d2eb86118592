"""Messages and progress bars: what a run prints, on the main process only, and when.

Bad input is one line (`errors.BackendError`); everything else a run says goes through `Reporter`
(notes held until the run's whole-run checks passed) and `progress` (tqdm on stderr).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional


class Reporter:
    """Prints on the main process only: progress lines and notes on stdout, warnings on stderr
    (unless `echo` takes every line).

    Notes about the flags (`note(text)`) are held until the run has passed its whole-run checks (the
    first progress line, or `flush()`): a run refused for bad input prints its one error line only.
    """

    def __init__(self, accelerator: Any, echo: Optional[Callable[[str], None]] = None):
        self.main = accelerator.is_main_process
        self.echo = echo
        self._held: list[str] = []

    def note(self, text: str) -> None:
        self._held.append(text)

    def flush(self) -> None:
        held, self._held = self._held, []
        for text in held:
            self._print(text)

    def __call__(self, text: str) -> None:
        self.flush()
        self._print(text)

    def _print(self, text: str) -> None:
        if not self.main:
            return
        if self.echo is not None:
            self.echo(text)
        else:
            print(text, file=sys.stderr if text.startswith("warning:") else sys.stdout, flush=True)


def progress(iterable: Any, total: int, desc: str, enabled: bool):
    """A progress bar on stderr; redrawn at most every 15 s when stderr is a log file, not a terminal."""
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True,
                mininterval=0.1 if interactive else 15.0)


def count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"

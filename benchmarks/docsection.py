"""What the benchmarks share: one benchmark's section of docs/benchmarks.md (replaced between its markers, or
appended under its title), the installed versions they name, and how a step time is read off a run's steps."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Optional


def write_section(doc: Path, begin: str, end: str, title: str, text: str) -> None:
    """Put `text` between the `begin` and `end` markers of `doc`, replacing what was there; a new section (with
    `title`) at the end when the markers are not in it yet."""
    section = f"{begin}\n{text}\n{end}"
    content = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    if begin in content:
        content = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, content, flags=re.S)
    else:
        content = content.rstrip("\n") + f"\n\n\n{title}\n\n{section}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(content)


def installed_versions(names: tuple[str, ...]) -> str:
    """`name version, ...` of the installed distributions among `names` (for the machine line of a section)."""
    import importlib.metadata as md

    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def step_median(times: list[float], window: Optional[int] = None) -> Optional[float]:
    """A typical step time: the median over consecutive windows of `window` steps (executor.SYNC_RUN) of
    each window's mean, the first window left out (one-off set-up costs); None without steps.

    Stage 2 on the CPU prepares its batches SYNC_RUN at a time, so one step in each run carries the data
    work of the whole run: the median of single steps would leave that work out, a window of SYNC_RUN
    steps holds exactly one run. Every configuration is timed the same way, the in-memory limit too."""
    if window is None:
        from unitgraph.backends.diffusion.train.executor import SYNC_RUN as window  # a constant: no torch import
    if not times:
        return None
    if len(times) < 2 * window:  # too few steps for windows: the median of single steps, the first left out
        return statistics.median(times[1:] or times)
    rest = times[window:]
    return statistics.median([statistics.fmean(rest[i:i + window]) for i in range(0, len(rest) - window + 1, window)])

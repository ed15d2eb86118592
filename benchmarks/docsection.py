"""One benchmark's section of docs/benchmarks.md: replaced between its markers, or appended under its title."""

from __future__ import annotations

import re
from pathlib import Path


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

"""Reading files a user names, with failures as one-line errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UnitgraphError


def read_user_text(path: str | Path, error: type[UnitgraphError], expected: str) -> str:
    """The file's text, or `error` saying why it cannot be read (`expected` names what it should be)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error("no such file", source=str(path)) from None
    except IsADirectoryError:
        raise error(f"is a directory, expected {expected}", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read: {exc}", source=str(path)) from None


def parse_user_json(text: str, source: str, error: type[UnitgraphError]) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=source) from None

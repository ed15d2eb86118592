"""A sample's prompt, checked where every family's text units read it."""

from __future__ import annotations

from typing import Any

from ..errors import BackendError

__all__ = ["prompt_text"]


def prompt_text(prompt: Any) -> str:
    """The prompt as the tokenizers take it. A metadata file can hand over something else (a JSON number or list, an
    empty cell read as None): that is one line naming the type, before a tokenizer fails on it.

    >>> prompt_text("a red circle")
    'a red circle'
    """
    if not isinstance(prompt, str):
        raise BackendError(f"prompt must be a string, got {type(prompt).__name__}")
    return prompt

"""Where a cache lives, from the user's words: a path, a `file://` URL or `s3://bucket/prefix`, turned into its store.

A URL is checked before anything is opened: an unsupported scheme, credentials in the URL, a missing
bucket or a query string are one line each, and a credential is never echoed (`masked_url`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..errors import BackendError
from .object_store import ObjectStore
from .store import LocalStore, Store

__all__ = ["is_url", "masked_url", "open_store", "bucket_name_problem"]


def is_url(location: str | Path) -> bool:
    """Whether `location` names an object store (`s3://...`) rather than a local path."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def open_store(location: str | Path) -> "Store":
    """The store at `location`: a path or `file://` URL (a local folder) or `s3://bucket/prefix`.

    >>> open_store("/tmp/cache").describe("manifest.json")
    '/tmp/cache/manifest.json'

    Raises BackendError (one line) for an unsupported scheme or a URL carrying credentials.
    """
    if isinstance(location, Path):
        return LocalStore(location)
    text = str(location)
    if "://" not in text:
        return LocalStore(Path(text))
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise BackendError("a cache URL may not hold control characters (a newline pasted into it?)",
                           source=masked_url(text).encode("unicode_escape").decode("ascii"))
    parts = _split(text)
    if parts.scheme == "file":
        return LocalStore(Path(parts.path))
    if parts.scheme not in ("s3", "s3a"):
        raise BackendError(f"unsupported storage scheme {parts.scheme}:// (caches live in a local folder or at "
                           "s3://bucket/prefix)", source=masked_url(text))
    if "@" in parts.netloc:
        raise BackendError("a cache URL must not carry credentials; set them in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                           "or the AWS config files", source=masked_url(text))
    if not parts.netloc:
        raise BackendError("no bucket in the URL (expected s3://bucket/prefix)", source=text)
    if parts.query or parts.fragment:
        raise BackendError("a cache URL takes no query or fragment (expected s3://bucket/prefix; a presigned URL "
                           "does not work here: credentials come from the AWS_* variables or files)", source=masked_url(text))
    problem = bucket_name_problem(parts.netloc)
    if problem:
        raise BackendError(f"bucket name {parts.netloc!r} {problem}", source=masked_url(text))
    return ObjectStore(parts.netloc, parts.path.strip("/"))


def bucket_name_problem(name: str) -> str | None:
    """Why `name` is not an S3 bucket name (the rules AWS states for new buckets), or None."""
    if not 3 <= len(name) <= 63:
        return f"has {len(name)} characters (a bucket name has 3 to 63)"
    if not re.fullmatch(r"[a-z0-9.-]+", name):
        return "may hold only lowercase letters, digits, dots and hyphens"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return "must begin and end with a letter or a digit"
    if ".." in name:
        return "may not hold two dots in a row"
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        return "may not look like an IP address"
    return None


def _split(text: str) -> Any:
    try:
        return urlsplit(text)
    except ValueError as exc:  # e.g. an unclosed '[' (urllib reads it as an IPv6 host)
        raise BackendError(f"not a valid URL ({exc})", source=masked_url(text)) from None


def masked_url(text: str) -> str:
    """A URL for messages: what stands before '@' in its host part and its query string (a presigned URL's
    signature) masked, as credentials are."""
    try:
        parts = urlsplit(text)
    except ValueError:
        return text.split("://", 1)[0] + "://..." if "@" in text or "?" in text else text
    if "@" not in parts.netloc and not parts.query:
        return text
    host = f"***@{parts.netloc.rsplit('@', 1)[1]}" if "@" in parts.netloc else parts.netloc
    return f"{parts.scheme}://{host}{parts.path}" + ("?***" if parts.query else "")

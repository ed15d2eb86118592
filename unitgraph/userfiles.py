"""Reading files a user names, with failures as one-line errors that name the file.

One reader per kind of user file, each a plain function that takes the error class to raise (a
`UnitgraphError` subclass: `SpecError`, `PlanFileError`, the backend's `BackendError`) so that the
caller's one line names the file and the problem, and no input, however hostile, ends in a
traceback:

- `read_user_bytes` / `read_user_text`: a regular file (devices, FIFOs and sockets are refused
  before anything is read from them), at most `max_bytes` (`MAX_FILE_BYTES`, 64 MiB, by default),
  UTF-8 text without NUL bytes; a leading byte-order mark is dropped. Symlinks are followed: a
  spec or dataset reached through one is common, and reading grants nothing the user does not
  already have; the error names the path as the user gave it.
- `parse_user_json`: strict JSON. Nesting deeper than `MAX_DEPTH` (100) levels, integers of more
  than `MAX_INT_DIGITS` (4300, Python's default int-string limit) digits, numbers too large for a
  float, the NaN/Infinity literals Python's json accepts, a key given twice in one object and
  `\\u` escapes of half a surrogate pair are errors; so is nesting too deep for the parser itself.
- `parse_user_yaml`: `yaml.safe_load` with the same limits (duplicate mapping keys, though a key
  merged in with `<<` may still be overridden; `.nan`/`.inf`; integers; half surrogate pairs: a pair
  written as two `\\u` escapes is joined), any value a tag cannot be read as (`!!int x`, a 13th
  month) as an error naming the line, and aliases bounded: an alias that refers to a node
  containing it is an error, and aliases may add at most `MAX_ALIAS_NODES` nodes beyond those
  written out (a "billion laughs" document), counting nesting through aliases against `MAX_DEPTH`.
  The nesting limit is checked while composing, before pyyaml's recursive composer could run out
  of stack.
- `parse_user_jsonl`: one JSON object a line (blank lines skipped), errors naming the line.
- `parse_user_csv`: a header row and rows as dicts. A row with more fields than the header is an
  error naming it (usually an unquoted comma); a row with fewer has its missing fields None, as
  `csv.DictReader` gives them (an empty value); a header that names a column twice is an error; a
  column without a name in the header is dropped, and a value under it is an error; a field past
  csv's `field_size_limit()` is an error.

`read_user_json` and `read_user_yaml` read and parse in one call.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator

from .errors import UnitgraphError

MAX_FILE_BYTES = 64 * 1024 * 1024  # a spec, plan or manifest larger than this is not one
MAX_DEPTH = 100  # levels of nested lists/objects; specs and plans nest 4 deep, manifests a few more
MAX_INT_DIGITS = 4300  # Python's default int-string limit (sys.get_int_max_str_digits), whatever it is set to
MAX_ALIAS_NODES = 1_000_000  # nodes that YAML aliases may add to a document beyond those written out

_O_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_INT_BOUND = 10 ** MAX_INT_DIGITS
_SURROGATE_ESCAPE = re.compile(r"\\[uU]")


class _Refused(Exception):
    """Raised inside a parser's hooks; turned into the caller's error class."""


# ------------------------------------------------------------------------------------------------
# files


@contextlib.contextmanager
def open_user_file(path: str | Path, error: type[UnitgraphError], expected: str) -> Iterator[tuple[int, os.stat_result]]:
    """(descriptor, stat) of a regular file opened for reading, closed on exit; `error` saying why not.

    `expected` names what the file should be ("a spec file"). The file is opened without blocking,
    so a FIFO is refused rather than waited on; symlinks are followed.
    """
    source = str(path)
    try:
        fd = os.open(path, _O_FLAGS)
    except FileNotFoundError:
        raise error("no such file", source=source) from None
    except IsADirectoryError:
        raise error(f"is a directory, expected {expected}", source=source) from None
    except NotADirectoryError:
        raise error("no such file (a folder on its path is a file)", source=source) from None
    except PermissionError:
        if os.path.isdir(path):  # Windows refuses to open a directory this way
            raise error(f"is a directory, expected {expected}", source=source) from None
        raise error("cannot read: permission denied", source=source) from None
    except ValueError:  # an embedded NUL byte in the path
        raise error("is not a valid file name", source=source) from None
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror or exc}", source=source) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"is a directory, expected {expected}", source=source)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"is not a regular file (a device, FIFO or socket), expected {expected}", source=source)
        yield fd, info
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror or exc}", source=source) from None
    finally:
        os.close(fd)


def read_user_bytes(path: str | Path, error: type[UnitgraphError], expected: str,
                    max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, or `error` saying why not (see `open_user_file`)."""
    source = str(path)
    with open_user_file(path, error, expected) as (fd, info):
        if info.st_size > max_bytes:
            raise error(_too_large(info.st_size, max_bytes, expected), source=source)
        chunks, total = [], 0
        while total <= max_bytes:  # st_size may be stale or 0 (/proc): read at most one byte past the limit
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    if total > max_bytes:
        raise error(_too_large(total, max_bytes, expected, at_least=True), source=source)
    return b"".join(chunks)


def read_user_text(path: str | Path, error: type[UnitgraphError], expected: str,
                   max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file's UTF-8 text (a leading byte-order mark dropped), or `error` saying why it cannot be read."""
    return decode_user_text(read_user_bytes(path, error, expected, max_bytes), str(path), error, expected)


def decode_user_text(data: bytes, source: str, error: type[UnitgraphError], expected: str) -> str:
    """`data` as UTF-8 text without NUL bytes (a leading byte-order mark dropped), or `error`."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise error(f"holds a NUL byte at offset {nul}: a binary file, expected {expected}", source=source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}), expected {expected}",
                    source=source) from None
    return text[1:] if text.startswith("\ufeff") else text


def read_user_json(path: str | Path, error: type[UnitgraphError], expected: str,
                   max_bytes: int = MAX_FILE_BYTES) -> Any:
    """read_user_text then parse_user_json."""
    return parse_user_json(read_user_text(path, error, expected, max_bytes), str(path), error)


def read_user_yaml(path: str | Path, error: type[UnitgraphError], expected: str,
                   max_bytes: int = MAX_FILE_BYTES) -> Any:
    """read_user_text then parse_user_yaml."""
    return parse_user_yaml(read_user_text(path, error, expected, max_bytes), str(path), error)


def _too_large(size: int, limit: int, expected: str, at_least: bool = False) -> str:
    more = "more than " if at_least else ""
    return f"is {more}{_bytes(size)}, larger than the {_bytes(limit)} allowed for {expected}"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} bytes"


# ------------------------------------------------------------------------------------------------
# JSON


def parse_user_json(text: str, source: str, error: type[UnitgraphError], max_depth: int = MAX_DEPTH) -> Any:
    """Strict JSON (see the module docstring), or `error` naming the problem and where it is."""
    try:
        return _json_value(text, max_depth)
    except json.JSONDecodeError as exc:
        raise error(f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=source) from None
    except _Refused as exc:
        raise error(str(exc), source=source) from None


def parse_user_jsonl(text: str, source: str, error: type[UnitgraphError], max_depth: int = MAX_DEPTH,
                     max_rows: int | None = None) -> list[dict]:
    """One JSON object a line (JSON Lines; blank lines skipped), or `error` naming the line; reading stops at a row
    past `max_rows`."""
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip(" \t\r"):
            continue
        if max_rows is not None and len(rows) >= max_rows:
            raise error(too_many_rows(max_rows), source=source)
        try:
            value = _json_value(line, max_depth)
        except json.JSONDecodeError as exc:
            raise error(f"line {n}: malformed JSON at column {exc.colno}: {exc.msg}", source=source) from None
        except _Refused as exc:
            raise error(f"line {n}: {exc}", source=source) from None
        if not isinstance(value, dict):
            raise error(f"line {n}: expected a JSON object, got {_json_kind(value)}", source=source)
        rows.append(value)
    return rows


def _json_value(text: str, max_depth: int) -> Any:
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_constant=_constant, parse_float=_float,
                           parse_int=_int)
    except RecursionError:  # the C parser's own limit (about 1000 levels), before ours could be checked
        raise _Refused(f"JSON nested deeper than {max_depth} levels") from None
    if text.count("[") + text.count("{") > max_depth and _depth(value, max_depth + 1) > max_depth:
        raise _Refused(f"JSON nested deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE.search(text):
        _check_surrogates(value)
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {_clip(repr(key), 60)} in a JSON object")
            seen.add(key)
    return obj


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"JSON number {_clip(text)} is too large for a float")
    return value


def _int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"JSON integer with {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _clip(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."


# ------------------------------------------------------------------------------------------------
# walks of parsed JSON (iterative: the data may be nested as deep as the parser's own limit)


def _depth(value: Any, stop: int) -> int:
    """Levels of nested lists and objects in parsed JSON (0 for a scalar), counting no further than `stop`.

    Level by level, keeping only containers: a long list of flat objects costs one pass over their values.
    """
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level and depth < stop:
        depth += 1
        below: list[Any] = []
        for item in level:
            below += [c for c in (item.values() if type(item) is dict else item) if type(c) is dict or type(c) is list]
        level = below
    return depth


def _check_surrogates(value: Any) -> None:
    """Refuse a string (or key) holding half a surrogate pair: it is not text and cannot be written as UTF-8."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise _Refused(f"a string holds \\u{ord(item[exc.start]):04x}, half a surrogate pair, "
                               "which is not a character") from None
        elif isinstance(item, dict):
            if id(item) not in seen:
                seen.add(id(item))
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            if id(item) not in seen:
                seen.add(id(item))
                stack.extend(item)


# ------------------------------------------------------------------------------------------------
# YAML


def parse_user_yaml(text: str, source: str, error: type[UnitgraphError], max_depth: int = MAX_DEPTH,
                    max_alias_nodes: int = MAX_ALIAS_NODES) -> Any:
    """`yaml.safe_load` with limits (see the module docstring), or `error` naming the problem and the line."""
    import yaml

    loader = None
    try:
        loader = _yaml_loader_class()(text)  # the reader checks for unprintable characters here
        loader.limits = (max_depth, max_alias_nodes)
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = ", ".join(part for part in (exc.context, exc.problem) if part) or "not valid YAML"
        raise error(f"malformed YAML{where}: {problem}", source=source) from None
    except yaml.reader.ReaderError as exc:
        what = f"character #x{exc.character:04x}" if isinstance(exc.character, int) else f"byte {exc.character!r}"
        raise error(f"malformed YAML: unacceptable {what} at offset {exc.position}: {exc.reason}", source=source) from None
    except yaml.YAMLError as exc:
        raise error(f"malformed YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                    source=source) from None
    except RecursionError:  # cannot happen with the depth limit below the interpreter's; kept as a last guard
        raise error(f"YAML nested deeper than {max_depth} levels", source=source) from None
    finally:
        if loader is not None:
            loader.dispose()


_LOADER: Any = None


def _yaml_loader_class() -> Any:
    """A SafeLoader that bounds nesting and aliases and refuses duplicate keys (built on first use: yaml
    is imported only when a YAML file is read)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml
    from yaml.constructor import ConstructorError
    from yaml.nodes import MappingNode, ScalarNode, SequenceNode

    merge_tag = "tag:yaml.org,2002:merge"

    class UserYamlLoader(yaml.SafeLoader):
        limits = (MAX_DEPTH, MAX_ALIAS_NODES)

        def __init__(self, stream: str):
            super().__init__(stream)
            self._open_depth = 0  # collections being composed around the current node
            self._open_anchors: set[str] = set()
            self._composed = 0  # distinct nodes so far
            self._size: dict[Any, int] = {}  # node -> nodes it stands for, aliases expanded
            self._levels: dict[Any, int] = {}  # node -> nesting levels, through aliases
            self._own_keys: dict[Any, list] = {}  # mapping node -> its key nodes as written (before merges)

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                if event.anchor in self._open_anchors:
                    raise ConstructorError(None, None, f"alias *{event.anchor} refers to a node that contains it "
                                           "(a recursive structure)", event.start_mark)
                return super().compose_node(parent, index)  # known size: composed once, before
            collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
            max_depth, max_alias_nodes = self.limits
            if collection:
                if self._open_depth >= max_depth:
                    raise ConstructorError(None, None, f"nested deeper than {max_depth} levels", event.start_mark)
                self._open_depth += 1
                if event.anchor is not None:
                    self._open_anchors.add(event.anchor)
            try:
                node = super().compose_node(parent, index)
            finally:
                if collection:
                    self._open_depth -= 1
                    self._open_anchors.discard(event.anchor)
            self._composed += 1
            if isinstance(node, ScalarNode):
                self._size[node], self._levels[node] = 1, 0
                return node
            children = node.value if isinstance(node, SequenceNode) else [n for pair in node.value for n in pair]
            size = 1 + sum(self._size[c] for c in children)
            levels = 1 + max((self._levels[c] for c in children), default=0)
            if size > self._composed + max_alias_nodes:
                raise ConstructorError(None, None, f"aliases expand to more than {max_alias_nodes} extra nodes "
                                       "(a 'billion laughs' document?)", node.start_mark)
            if levels > max_depth:
                raise ConstructorError(None, None, f"nested deeper than {max_depth} levels (through aliases)",
                                       node.start_mark)
            self._size[node], self._levels[node] = size, levels
            if isinstance(node, MappingNode):
                self._own_keys[node] = [key for key, _ in node.value]
            return node

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node in self._own_keys.get(node, ()):
                if key_node.tag == merge_tag:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable: the base class says so
                    continue
                if duplicate:
                    raise ConstructorError(None, None, f"found duplicate key {_clip(repr(key), 60)}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

        def construct_object(self, node: Any, deep: bool = False) -> Any:
            # pyyaml's scalar constructors raise what they meet (ValueError for `!!int x` or a 13th month,
            # KeyError for `!!bool x`, AttributeError for `!!timestamp x`): the document's fault, said in one line
            try:
                return super().construct_object(node, deep=deep)
            except (yaml.YAMLError, RecursionError):
                raise
            except Exception as exc:
                tag = str(node.tag).rsplit(":", 1)[-1]
                shown = f" {_clip(repr(node.value), 40)}" if isinstance(node, ScalarNode) else ""
                detail = f" ({_clip(str(exc), 80)})" if type(exc) is ValueError and str(exc) else ""
                raise ConstructorError(None, None, f"cannot read{shown} as a {tag}{detail}", node.start_mark) from None

        def construct_yaml_int(self, node: Any) -> int:
            raw = self.construct_scalar(node)
            digits = len(raw.replace("_", "").lstrip("+-"))
            if digits > MAX_INT_DIGITS:
                raise ConstructorError(None, None, f"an integer with {digits} digits (at most {MAX_INT_DIGITS})",
                                       node.start_mark)
            value = super().construct_yaml_int(node)
            if abs(value) >= _INT_BOUND:
                raise ConstructorError(None, None, f"an integer of more than {MAX_INT_DIGITS} digits", node.start_mark)
            return value

        def construct_yaml_str(self, node: Any) -> str:
            value = super().construct_yaml_str(node)
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # "\\ud83d\\ude00": pyyaml keeps the two halves of a pair apart
                try:
                    value = value.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
                except UnicodeDecodeError as exc:
                    half = int.from_bytes(exc.object[exc.start:exc.start + 2], "little")
                    raise ConstructorError(None, None, f"a string holds \\u{half:04x}, half a surrogate pair, "
                                           "which is not a character", node.start_mark) from None
            return value

        def construct_yaml_float(self, node: Any) -> float:
            value = super().construct_yaml_float(node)
            if not math.isfinite(value):
                raise ConstructorError(None, None, f"{_clip(self.construct_scalar(node))} is not a finite number",
                                       node.start_mark)
            return value

    UserYamlLoader.add_constructor("tag:yaml.org,2002:int", UserYamlLoader.construct_yaml_int)
    UserYamlLoader.add_constructor("tag:yaml.org,2002:float", UserYamlLoader.construct_yaml_float)
    UserYamlLoader.add_constructor("tag:yaml.org,2002:str", UserYamlLoader.construct_yaml_str)
    _LOADER = UserYamlLoader
    return _LOADER


# ------------------------------------------------------------------------------------------------
# CSV


def too_many_rows(max_rows: int) -> str:
    return (f"has more than {max_rows} rows, the most a run reads: split it into several metadata files (each run "
            "its own cache)")


def parse_user_csv(text: str, source: str, error: type[UnitgraphError],
                   max_rows: int | None = None) -> tuple[list[str], list[dict[str, str | None]]]:
    """(column names, rows) of a CSV text with a header row; `error` naming the row otherwise.

    Blank lines are skipped. Rows are numbered from 1 after the header, as the dataset's messages
    number them, with the line the row ends on. Reading stops at a row past `max_rows`.
    """
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    named: list[int] = []
    rows: list[dict[str, str | None]] = []
    try:
        for fields in reader:
            if not fields:
                continue
            if header is None:
                header = fields
                named = [i for i, name in enumerate(header) if name != ""]
                seen: set[str] = set()
                for i in named:
                    if header[i] in seen:
                        raise error(f"the header names column {header[i]!r} twice", source=source)
                    seen.add(header[i])
                continue
            if max_rows is not None and len(rows) >= max_rows:
                raise error(too_many_rows(max_rows), source=source)
            where = f"row {len(rows) + 1} (line {reader.line_num})"
            if len(fields) > len(header):
                raise error(f"{where} has {len(fields)} fields but the header has {len(header)} columns "
                            "(a field with a comma in it needs quotes)", source=source)
            for i, (name, value) in enumerate(zip(header, fields)):
                if name == "" and value != "":
                    raise error(f"{where} has a value in column {i + 1}, which the header does not name", source=source)
            # a short row: its missing fields are None (no value), as csv.DictReader has always given them
            rows.append({header[i]: fields[i] if i < len(fields) else None for i in named})
    except csv.Error as exc:
        problem = str(exc)
        if "field larger than field limit" in problem:
            problem = f"a field is longer than csv's limit of {csv.field_size_limit()} characters"
        raise error(f"malformed CSV at line {reader.line_num}: {problem}", source=source) from None
    if header is None:
        raise error("empty csv (no header row)", source=source)
    return [header[i] for i in named], rows

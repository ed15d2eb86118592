"""Generate the command-line reference (docs/cli.md) from the typer app itself.

    python -m unitgraph.cli.docgen > docs/cli.md      # regenerate
    python -m unitgraph.cli.docgen --check docs/cli.md  # exit 1 when the file is out of date

The output depends only on the commands and their declared options (names, help, defaults), never
on the terminal width or on rich formatting, so a test can regenerate it and compare byte for byte.
"""

from __future__ import annotations

import inspect
import sys
import typing
from pathlib import Path
from typing import Any

import typer

HEADER = """# Command-line reference

<!-- Generated from the typer app by `python -m unitgraph.cli.docgen > docs/cli.md`.
     Do not edit by hand: tests/test_cli_docs.py regenerates it and fails when it differs. -->
"""

EXIT_CODES = """## Exit codes

| code | meaning |
|---|---|
| 0 | success |
| 1 | the command ran and found a problem (e.g. `verify` found violations; one line each) |
| 2 | bad input: unreadable or malformed file, unknown key, duplicate or unknown unit, bad option; one line on stderr, never a traceback, never a half-written output file |

Every option spelled with dashes also accepts underscores where listed (`--cache-mode`, `--cache_mode`),
so commands written for DiffSynth-Studio's scripts port by swapping the program name.
"""


def _paragraphs(text: str | None) -> list[str]:
    """Docstring paragraphs, each reflowed onto one line (click's \\b markers dropped)."""
    if not text:
        return []
    text = inspect.cleandoc(text)
    out = []
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.splitlines() if line.strip() and line.strip() != "\b"]
        if lines:
            out.append(" ".join(lines))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _value_name(param: Any) -> str:
    """A placeholder for the value an option takes: its metavar, or a name for its type."""
    if getattr(param, "is_flag", False):
        return ""
    if getattr(param, "metavar", None):
        return str(param.metavar)
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) is not None and len(args) == 1:
        annotation = args[0]
    names = {str: "TEXT", int: "INTEGER", float: "FLOAT", Path: "PATH", bool: "BOOLEAN"}
    if annotation in names:
        return names[annotation]
    name = getattr(annotation, "__name__", None)
    return name.upper() if name else "VALUE"


def _default(param: Any) -> str:
    if getattr(param, "required", False):
        return "required"
    if getattr(param, "show_default", True) is False:
        return ""
    default = getattr(param, "default", None)
    if callable(default):
        return "(computed)"
    if default is None or default == "" or default == () or default == []:
        return ""
    if getattr(param, "is_flag", False) and default is False:
        return ""
    if isinstance(default, (list, tuple)):
        default = ",".join(map(str, default))
    return f"`{default}`"


def _argument_name(param: Any) -> str:
    return str(param.metavar) if getattr(param, "metavar", None) else param.name.upper()


def _usage(path: str, command: Any) -> str:
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    pieces = [path]
    if any(p.param_type_name == "option" and p.name != "help" for p in params):
        pieces.append("[OPTIONS]")
    for p in params:
        if p.param_type_name == "argument":
            name = _argument_name(p)
            if getattr(p, "nargs", 1) == -1:
                name += "..."
            pieces.append(name if getattr(p, "required", False) else f"[{name}]")
    if hasattr(command, "commands"):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def _command_section(path: str, command: Any, level: int) -> list[str]:
    out = [f"{'#' * level} `{path}`", "", "```", _usage(path, command), "```", ""]
    for para in _paragraphs(command.help):
        out += [para, ""]
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    options = [p for p in params if p.param_type_name == "option" and p.name != "help"]
    if arguments:
        out += ["| argument | description |", "|---|---|"]
        for p in arguments:
            required = " (required)" if getattr(p, "required", False) else ""
            out.append(f"| `{_argument_name(p)}` | {_cell(getattr(p, 'help', None) or '')}{required} |")
        out.append("")
    if options:
        out += ["| option | value | default | description |", "|---|---|---|---|"]
        for p in options:
            names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            out.append(f"| {names} | {_value_name(p)} | {_default(p)} | {_cell(getattr(p, 'help', None) or '')} |")
        out.append("")
    if hasattr(command, "commands"):
        for name in command.commands:
            sub = command.commands[name]
            if not getattr(sub, "hidden", False):
                out += _command_section(f"{path} {name}", sub, level + 1)
    return out


def generate(app: typer.Typer | None = None) -> str:
    """The Markdown reference of every command of `app` (default: the unitgraph app)."""
    if app is None:
        from .app import app as unitgraph_app

        app = unitgraph_app
    root = typer.main.get_command(app)
    out = [HEADER]
    out += [para + "\n" for para in _paragraphs(root.help)]
    commands = {name: cmd for name, cmd in getattr(root, "commands", {}).items() if not getattr(cmd, "hidden", False)}
    out.append("| command | what it does |")
    out.append("|---|---|")
    for name, cmd in commands.items():
        first = (_paragraphs(cmd.help) or [""])[0]
        out.append(f"| [`unitgraph {name}`](#unitgraph-{name}) | {_cell(first)} |")
    out.append("")
    out.append("Every command takes `--help`.")
    out.append("")
    for name, cmd in commands.items():
        out += _command_section(f"unitgraph {name}", cmd, 2)
    out.append(EXIT_CODES)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    text = generate()
    if argv[:1] == ["--check"] and len(argv) == 2:
        path = Path(argv[1])
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            print(f"{path} is out of date; regenerate: python -m unitgraph.cli.docgen > {path}", file=sys.stderr)
            return 1
        return 0
    if argv:
        print("usage: python -m unitgraph.cli.docgen [--check FILE]", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `unitgraph` command: one typer app; commands live in small modules and are registered here.

`main` runs the app without click's standalone mode so that every kind of bad input, a usage error
as much as an unreadable spec, ends the same way: exit code 2 and one line on stderr.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

try:  # typer >= 0.26 vendors click as typer._click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as click_exceptions

from unitgraph.errors import UnitgraphError, os_error_line

from . import core_commands

app = typer.Typer(
    name="unitgraph",
    help="Plan, prove and draw split training of diffusion pipelines, and run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("plan")(core_commands.plan_command)
app.command("verify")(core_commands.verify_command)


def _register_optional_commands() -> None:
    """Commands from modules that may not exist yet in a partial install are added when present."""
    import importlib

    for module_name in ("view_commands", "backend_commands", "adapter_commands", "cache_commands", "lora_commands",
                        "twin_commands"):
        try:
            module = importlib.import_module(f"{__package__}.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__package__}.{module_name}":
                continue
            raise
        module.register(app)


_register_optional_commands()


def fail(message: str) -> None:
    typer.echo(f"unitgraph: error: {' '.join(str(message).split())}", err=True)
    sys.exit(2)


def bare_resume(argv: list[str], value_options: Optional[set[str]] = None) -> list[str]:
    """`train --resume` with no value means the newest state in --output_path ("latest"); a value is a state folder.

    Only a `--resume` where an option stands counts: the token after an option that takes a value is that value,
    whatever it looks like (`--validation_prompt --resume`, a prompt beginning with `--`), as click reads it.

    >>> bare_resume(["train", "--resume", "--seed", "1"]), bare_resume(["train", "--resume", "out/state/step-4"])
    (['train', '--resume', 'latest', '--seed', '1'], ['train', '--resume', 'out/state/step-4'])
    >>> bare_resume(["train", "--validation_prompt", "--resume"], {"--validation_prompt", "--resume"})
    ['train', '--validation_prompt', '--resume']
    """
    if not argv or argv[0] != "train":
        return argv
    if value_options is None:
        value_options = _value_options("train")
    out, value_next = [], False
    for i, token in enumerate(argv):
        out.append(token)
        if value_next:  # an option's value
            value_next = False
        elif token == "--":  # the end of the options
            return out + argv[i + 1:]
        elif token == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out.append("latest")
        elif token in value_options:
            value_next = True
    return out


def _value_options(name: str) -> set[str]:
    """The spellings of a command's options that take a value (not flags)."""
    command = typer.main.get_command(app)
    sub = getattr(command, "commands", {}).get(name)
    return {spelling for param in getattr(sub, "params", ())
            if getattr(param, "param_type_name", "") == "option" and not getattr(param, "is_flag", False)
            and not getattr(param, "count", False) for spelling in (*param.opts, *param.secondary_opts)}


def main(argv: list[str] | None = None) -> None:
    command = typer.main.get_command(app)
    argv = bare_resume(list(sys.argv[1:] if argv is None else argv))
    try:
        result = command.main(args=argv, prog_name="unitgraph", standalone_mode=False)
    except UnitgraphError as exc:
        fail(exc.one_line())
    except click_exceptions.NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
        sys.exit(0)
    except click_exceptions.UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        fail(f"{where}{exc.format_message()}")
    except (typer.Abort, KeyboardInterrupt):
        interrupted()
    except click_exceptions.ClickException as exc:
        fail(exc.format_message())
    except (OSError, MemoryError) as exc:  # the file system's refusals and an exhausted memory, whichever command
        fail(os_error_line(exc))
    if result == INTERRUPTED:  # typer turns Ctrl-C inside a command into this exit code, silently
        interrupted()
    sys.exit(result if isinstance(result, int) else 0)


INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def interrupted() -> None:
    """Ctrl-C (SIGINT): one line, exit 130. What was written stays consistent (atomic files, journals, states)."""
    typer.echo("unitgraph: interrupted; what was written so far is kept (a training run continues with --resume, "
               "stage 1 computes only what is missing)", err=True)
    sys.exit(INTERRUPTED)


if __name__ == "__main__":
    main()

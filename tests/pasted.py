"""Running a command as a DiffSynth-Studio user pastes it into a shell, inside the test process.

A ported script is a few `unitgraph ...` lines with backslash continuations and quoted values. `run_pasted` hands
the program exactly the arguments bash would (continuations joined as bash joins them, then POSIX quoting) and runs
each command in this process, in the user's environment (none of unitgraph's, DiffSynth's, ModelScope's or the
hub's variables) and working directory. A fresh interpreter per command would add ~5 s of imports each, most of
the port tests' time. A script that needs anything bash does beyond quoting (variables, globs outside quotes,
pipes, redirections) is refused, so the arguments are the ones bash would give; `set -e` and comment lines are
what the ported scripts hold besides, and a script stops at its first failing command, as under `set -e`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from clitools import cli

USER_ENV_PREFIXES = ("UNITGRAPH_", "DIFFSYNTH_", "MODELSCOPE_", "HF_HUB_")
_OPERATORS = set("|&;<>()")


@dataclass
class Ran:
    """One command's exit code and output, as `subprocess.run(..., capture_output=True)` gives them."""

    returncode: int
    stdout: str
    stderr: str


def commands(script: str) -> list[list[str]]:
    """The argument lists of a script's commands (bash's continuation and quoting rules); a ValueError for anything
    more a shell would do."""
    found = []
    for line in script.replace("\\\n", "").splitlines():
        text = line.strip()
        if not text or text.startswith("#") or text == "set -e":
            continue
        if "$" in text or "`" in text:
            raise ValueError(f"a shell expansion in {text[:60]!r}: run it with bash")
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        raw = shlex.shlex(text, posix=False)
        raw.whitespace_split = True
        if any(set(w) <= _OPERATORS for w in words) or any(
                w[0] not in "'\"" and set(w) & set("*?[") for w in raw):
            raise ValueError(f"a shell operator or glob in {text[:60]!r}: run it with bash")
        found.append(words)
    return found


class UserShell:
    """A DiffSynth user's shell, in this process (the `user_shell` fixture): `script` runs pasted commands, `train`
    the arguments of one `unitgraph train` command."""

    def __init__(self, capsys, monkeypatch) -> None:
        self.capsys, self.monkeypatch = capsys, monkeypatch
        import os

        for name in [n for n in os.environ if n.startswith(USER_ENV_PREFIXES)]:
            monkeypatch.delenv(name)

    def command(self, argv: list[str], cwd: Path) -> Ran:
        """`unitgraph <argv>` in `cwd`."""
        self.monkeypatch.chdir(cwd)
        return Ran(*cli(self.capsys, *argv))

    def train(self, cwd: Path, flags: str, *extra: str) -> Ran:
        """`unitgraph train <flags> <extra>` in `cwd`, the flags split as a shell splits them."""
        return self.command(["train", *shlex.split(flags), *extra], cwd)

    def script(self, script: str, cwd: Path) -> Ran:
        """Each `unitgraph` command of `script` in `cwd`, stopping at the first that fails, as `bash -c "set -e ..."`
        does: the last command's exit code, and what they all wrote."""
        ran = Ran(0, "", "")
        for argv in commands(script):
            assert argv[0] == "unitgraph", f"a ported command runs unitgraph, not {argv[0]!r}"
            done = self.command(argv[1:], cwd)
            ran = Ran(done.returncode, ran.stdout + done.stdout, ran.stderr + done.stderr)
            if done.returncode != 0:
                break
        return ran

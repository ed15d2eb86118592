"""Running the `unitgraph` command inside a test process, and the one-line error check (docs/safety.md)."""

from __future__ import annotations

import pytest


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the `unitgraph` command in this process: (exit code, stdout, stderr)."""
    from unitgraph.cli.app import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def one_error_line(code: int, err: str, *fragments: str) -> str:
    """Exit code 2 and exactly one line on stderr, `unitgraph: error: ...`, holding every fragment; the line."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("unitgraph: error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]

#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A worker per core (pytest-xdist), each test file on one worker so its fixtures are made once; `-n 0` runs it
# all in this one process.
exec .venv/bin/python -m pytest -n auto --dist loadfile "$@"

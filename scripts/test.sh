#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (slow end-to-end tests included); then the tests that need
# DiffSynth-Studio itself, in their own environment (scripts/test_diffsynth.sh; UNITGRAPH_SKIP_DIFFSYNTH=1 skips them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A worker per core (pytest-xdist), each test file on one worker so its fixtures are made once; `-n 0` runs it
# all in this one process.
.venv/bin/python -m pytest -n auto --dist loadfile "$@"
if [ "${UNITGRAPH_SKIP_DIFFSYNTH:-}" != 1 ]; then
  options=()  # pytest's options (-q, -x, ...) carry over; test paths named for the main suite do not
  for arg in "$@"; do [[ "$arg" == -* ]] && options+=("$arg"); done
  bash scripts/test_diffsynth.sh "${options[@]}"
fi

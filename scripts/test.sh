#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Set up .venv if needed, then run the main job: `unitgraph demo` on built-in tiny models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/unitgraph demo "$@"

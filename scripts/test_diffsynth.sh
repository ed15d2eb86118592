#!/usr/bin/env bash
# The tests that need DiffSynth-Studio itself, in .venv-diffsynth (scripts/setup_diffsynth.sh): its pipelines trained
# through unitgraph (tests/test_diffsynth_source.py), both sources of a family on the same weights
# (tests/test_diffsynth_both_sources.py), several processes (tests/test_diffsynth_world.py) and the adapter's reading of
# the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_diffsynth.sh
exec .venv-diffsynth/bin/python -m pytest tests/test_diffsynth_source.py tests/test_diffsynth_both_sources.py tests/test_diffsynth_world.py \
  tests/test_adapters_diffsynth.py "$@"

#!/usr/bin/env bash
# Prepare .venv for this checkout: the pinned CPU build of torch first (an unpinned torch would pull a
# multi-GB CUDA build), then unitgraph itself (editable) with the diffusion backend, DeepSpeed and test extras, the
# optimizers of --optimizer (pinned), and Graphviz's `dot` for SVG/PNG/PDF drawings. Re-running is cheap: it
# reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_PIN=${UNITGRAPH_TORCH_PIN:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.setup-stamp 2>/dev/null || true)" != "$stamp" ]; then
  echo "setup: installing $TORCH_PIN and unitgraph[diffusion,dev] into .venv (about a minute)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_PIN"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[diffusion,dev,deepspeed]"
  # --optimizer prodigy, came and schedulefree (the optimizers extra), pinned; torch stays the pinned one
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_PIN" prodigyopt==1.1.2 came-pytorch==0.1.3 \
    schedulefree==1.4.1
  # LyCORIS' own reader of LoKr / LoHa files (the lycoris extra), for the tests of --lora_type lokr|loha: without its
  # dependencies (it pins none of them usefully here; the tests need only its module loader and toml)
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps lycoris-lora==4.1.3 toml==0.10.2 \
    || echo "setup: note: lycoris-lora is not available; the LyCORIS loader tests will be skipped" >&2
  # DiffSynth-Studio's own LoRA loader, for the tests of the diffsynth LoRA layout: unpacked beside the venv's
  # packages (not importable as `diffsynth`: its dependencies are not installed), read by path in the tests.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target .venv/diffsynth-wheel "diffsynth==2.1.12" \
    || echo "setup: note: the diffsynth wheel is not available; the DiffSynth loader tests will be skipped" >&2
  echo "$stamp" > .venv/.setup-stamp
fi

if ! command -v dot >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing graphviz (dot) with apt-get" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
      || echo "setup: warning: could not install graphviz; svg/png/pdf drawings are unavailable" >&2
  else
    echo "setup: note: graphviz's dot is not installed; svg/png/pdf drawings need it (apt-get install graphviz)" >&2
  fi
fi

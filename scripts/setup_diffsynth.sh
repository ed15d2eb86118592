#!/usr/bin/env bash
# Prepare .venv-diffsynth: the second environment for DiffSynth-Studio's own pipelines (--pipeline diffsynth:MODULE).
# `import diffsynth` needs torchvision, and the registry's torchvision for this project's torch 2.13.0 does not load
# beside its CPU build; torch 2.14.1 and torchvision 0.29.1 (x86_64; a CUDA build that runs on the CPU, about 5.5 GB,
# from local disk) or torch 2.9.1 and torchvision 0.24.1 (aarch64) do. unitgraph is installed editable, as in .venv.
# Re-running is cheap: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "$(uname -m)" = aarch64 ]; then
  PINS="torch==2.9.1 torchvision==0.24.1"
  AUDIO="torchaudio==2.9.1"
else
  PINS="torch==2.14.1 torchvision==0.29.1"
  AUDIO="torchaudio==2.11.0"
fi

if [ ! -x .venv-diffsynth/bin/python ]; then
  echo "setup: creating .venv-diffsynth" >&2
  "$PYTHON" -m venv .venv-diffsynth
fi
stamp=$(cat pyproject.toml scripts/setup_diffsynth.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv-diffsynth/.setup-stamp 2>/dev/null || true)" != "$stamp" ]; then
  echo "setup: installing $PINS, diffsynth and unitgraph into .venv-diffsynth (a minute or two)" >&2
  # shellcheck disable=SC2086
  .venv-diffsynth/bin/python -m pip install -q --disable-pip-version-check $PINS
  # shellcheck disable=SC2086
  # (the optimizers extra at scripts/setup.sh's pins: --optimizer schedulefree/prodigy/came on DiffSynth's pipelines)
  .venv-diffsynth/bin/python -m pip install -q --disable-pip-version-check $PINS -e ".[diffusion,dev,diffsynth,deepspeed,optimizers]" \
    prodigyopt==1.1.2 came-pytorch==0.1.3 schedulefree==1.4.1
  # DiffSynth's audio-video pipelines (MOVA) import torchaudio, for its resampler; its newest build pins another
  # torch, so it comes without dependencies (its file reading, which needs a system FFmpeg, is not used: PyAV reads)
  .venv-diffsynth/bin/python -m pip install -q --disable-pip-version-check --no-deps "$AUDIO"
  echo "$stamp" > .venv-diffsynth/.setup-stamp
fi

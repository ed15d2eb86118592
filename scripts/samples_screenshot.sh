#!/usr/bin/env bash
# Make docs/img/samples-page.png: a split run of tiny random-weight Qwen-Image models with two validation
# prompts, then a headless-Chromium screenshot of its OUTPUT/samples.html (apt-get install chromium).
# The models are untrained, so the samples are noise: the picture shows the page, not a result.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python - "$work" <<'PY'
import sys
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models
write_tiny_models(f"{sys.argv[1]}/models", size="demo", seed=0)
write_synthetic_dataset(f"{sys.argv[1]}/data", count=8, size=64, seed=7)
PY
.venv/bin/unitgraph train --task sft:split --model_paths "$work/models" --lora_base_model dit --lora_rank 8 \
  --max_pixels 4096 --num_epochs 3 --learning_rate 1e-3 --seed 3 --no-progress \
  --dataset_base_path "$work/data" --dataset_metadata_path "$work/data/metadata.csv" --output_path "$work/out" \
  --validation_prompt "a red square on a white table" --validation_prompt "a blue circle in the sky" \
  --validation_inference_steps 8
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=900,470 \
  --screenshot="$work/page.png" "file://$work/out/samples.html" 2>/dev/null
mkdir -p docs/img
cp "$work/page.png" docs/img/samples-page.png
echo "wrote docs/img/samples-page.png"

"""Stable Diffusion 1.x as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:stable_diffusion`,
backends/diffusion/diffsynth_source): how its example's train.py builds it, and its test-size models in DiffSynth's
`./models` layout (this family's tiny folder, its text encoder's keys with the release's `text_model.` prefix)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ...family import DiffSynthPipeline, DiffSynthTokenizer

MODEL_ID = "AI-ModelScope/stable-diffusion-v1-5"

PIPELINES = (
    DiffSynthPipeline("stable_diffusion", "StableDiffusionPipeline", "Stable Diffusion 1.x (DiffSynth's pipeline)",
                      dtype="float32", division=32, example="stable_diffusion",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", MODEL_ID, "tokenizer/"),)),
)


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0) -> dict[str, Any]:
    """The family's tiny folder re-laid as DiffSynth's download of SD 1.5 under `outdir`: each component's weights
    (the text encoder's with the release's `text_model.` key prefix) beside its config.json, and the tokenizer.
    Returns the flags naming them."""
    from safetensors.torch import load_file, save_file

    from .tiny import write_tiny_models

    root = Path(outdir) / MODEL_ID
    patterns = []
    with tempfile.TemporaryDirectory(prefix="unitgraph-tiny-") as scratch:
        folder = Path(write_tiny_models(Path(scratch) / "pipe", "test", seed))
        for sub in sorted(p.name for p in folder.iterdir() if p.is_dir()):
            src, dest = folder / sub, root / sub
            dest.mkdir(parents=True, exist_ok=True)
            weights = sorted(src.glob("*.safetensors"))
            if not weights:
                for f in src.iterdir():
                    shutil.copy2(f, dest / f.name)
                continue
            prefix = "text_model." if sub == "text_encoder" else ""
            for w in weights:
                save_file({prefix + k: v.contiguous() for k, v in load_file(str(w)).items()}, str(dest / w.name))
                patterns.append(f"{MODEL_ID}:{sub}/{w.name}")
            shutil.copy2(src / "config.json", dest / "config.json")
    return {"model_id_with_origin_paths": ",".join(patterns), "tokenizer_path": str(root / "tokenizer")}

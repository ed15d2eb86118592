"""Test-sized models of a DiffSynth pipeline, laid out as DiffSynth's `./models` holds a download.

DiffSynth's `--model_id_with_origin_paths "org/name:sub/file.safetensors"` downloads into `./models/org/name/` only
the files its patterns name. The tiny layout here is that folder for the pipeline's example command, with random
weights in the release's own key layout (a transformers CLIP text encoder's keys start with `text_model.`, as in the
released `text_encoder/model.safetensors`) and the component's `config.json` beside its weights, which is how
unitgraph recognises a model DiffSynth's hash table does not know (models.py). The sizes are the unitgraph
family's `test` sizes for the same architecture, so the same tiny weights load in both sources.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import BackendError

__all__ = ["TINY", "write_tiny_models"]


def _family_writer(diffusers_class: str) -> Any:
    """The tiny-model writer of unitgraph's family whose diffusers pipeline class is `diffusers_class`."""
    from .. import registry

    family = next(f for f in registry.families() if diffusers_class in f.diffusers_pipelines)
    return family.tiny_module().write_tiny_models


def _stable_diffusion(outdir: Path, seed: int) -> dict[str, Any]:
    return _from_diffusers_folder(outdir, _family_writer("StableDiffusionPipeline"), seed,
                                  "AI-ModelScope/stable-diffusion-v1-5", {"text_encoder": "text_model."})


def _from_diffusers_folder(outdir: Path, writer: Any, seed: int, model_id: str, prefixes: dict[str, str]) -> dict:
    """The unitgraph family's tiny diffusers folder, re-laid as DiffSynth's download of `model_id`: each component's
    weights with the release's key prefix, its config.json, and the tokenizer folders."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    root = outdir / model_id
    with tempfile.TemporaryDirectory(prefix="unitgraph-tiny-") as scratch:
        folder = Path(writer(Path(scratch) / "pipe", "test", seed))
        patterns = []
        for sub in sorted(p.name for p in folder.iterdir() if p.is_dir()):
            src = folder / sub
            weights = sorted(src.glob("*.safetensors"))
            dest = root / sub
            dest.mkdir(parents=True, exist_ok=True)
            if not weights:
                for f in src.iterdir():
                    shutil.copy2(f, dest / f.name)
                continue
            for w in weights:
                tensors = load_file(str(w))
                prefix = prefixes.get(sub, "")
                save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(dest / w.name))
                patterns.append(f"{model_id}:{sub}/{w.name}")
            shutil.copy2(src / "config.json", dest / "config.json")
    return {"model_id_with_origin_paths": ",".join(p for p in patterns if "/scheduler/" not in p),
            "tokenizer_path": str(root / "tokenizer")}


TINY = {"stable_diffusion": _stable_diffusion}


def write_tiny_models(outdir: "str | Path", module: str, seed: int = 0) -> dict[str, Any]:
    """Write the tiny `./models` of DiffSynth's pipeline `module` under `outdir`; return the flags that name them
    (`model_id_with_origin_paths`, relative to `outdir` as DiffSynth's base folder, and `tokenizer_path`)."""
    if module not in TINY:
        raise BackendError(f"no test-sized models of diffsynth:{module} (written: {', '.join(TINY)})")
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    flags = TINY[module](out, seed)
    (out / "unitgraph_tiny.json").write_text(json.dumps({"pipeline": f"diffsynth:{module}", "seed": seed, **flags},
                                                        indent=1) + "\n", encoding="utf-8")
    return flags

"""Released configs made shallow for the dry-run tests: the same widths, heads, patch sizes and components, with a
couple of blocks where the release has dozens.

The memory plan traces one training step block by block on fake tensors, so its time grows with the depth while what
those tests check (which models each stage holds, the latent and token sizes, that the released classes build) does
not depend on it. The figures at the released depths are docs/memory.md's, made by benchmarks/memory_plan_table.py.
"""

from __future__ import annotations

import json
from pathlib import Path

# the keys that count a component's repeated blocks in diffusers' and transformers' configs (top level, or in a
# multimodal config's text_config); a vision tower's depth is left as released
DEPTH_KEYS = ("num_layers", "num_single_layers", "n_layers", "num_hidden_layers", "num_decoder_layers",
              "max_window_layers")
LIST_DEPTH_KEYS = ("transformer_layers_per_block",)  # a UNet's transformer blocks per resolution (SDXL's 1, 2, 10)


def shallow(folder: Path, components: tuple[str, ...] = ("transformer", "text_encoder"), blocks: int = 2) -> Path:
    """Cap the depth of `components` (subfolders of `folder`) at `blocks`; returns `folder`."""
    for name in components:
        path = Path(folder) / name / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        for part in (config, config.get("text_config")):
            if not isinstance(part, dict):
                continue
            for key in DEPTH_KEYS:
                if isinstance(part.get(key), int) and part[key] > blocks:
                    part[key] = blocks
            for key in LIST_DEPTH_KEYS:
                if isinstance(part.get(key), list):
                    part[key] = [min(n, blocks) if isinstance(n, int) else n for n in part[key]]
            if isinstance(part.get("layer_types"), list):
                part["layer_types"] = part["layer_types"][:blocks]
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return Path(folder)

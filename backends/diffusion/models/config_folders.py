"""Config-only pipeline folders: a released model's configuration files without its weights (`tiny-models --size real`).

A family's `real.py` holds the published config.json of each component of its releases; `write_config_folder`
lays them out as the release's diffusers pipeline folder (model_index.json, `<component>/config.json`,
`scheduler/scheduler_config.json`). No weights and no tokenizer files: the folder is for reading configurations
(the memory plan of `unitgraph train --dry_run`, parameter counts on the meta device), never for loading a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

CONFIG_ONLY_MARKER = "unitgraph_config_only.json"


def write_config_folder(outdir: Any, index: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]],
                        source: str) -> Path:
    """Write `index` as model_index.json and each `files` entry ("<subfolder>/<name>.json" -> its content) beside it,
    plus a marker naming the `source` release; returns the folder."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "model_index.json", index)
    for relative, content in files.items():
        _write(out / relative, content)
    _write(out / CONFIG_ONLY_MARKER, {"source": source, "weights": False,
                                      "note": "configuration files only: for unitgraph train --dry_run, not for loading"})
    return out


def _write(path: Path, content: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(content), indent=2, sort_keys=True) + "\n", encoding="utf-8")

"""Component folders as DiffSynth's download leaves them: weights without a config.json, completed from the
family's released configs.

DiffSynth downloads only the files a `model-id:pattern` names (`org/name:transformer/diffusion_pytorch_model*.safetensors`),
so a DiffSynth user's `./models/org/name/transformer/` holds the weight shards and nothing else: no config.json
and no shard index, which diffusers and transformers both need to load a folder. The configs are facts of the
release, and unitgraph keeps them (each family's `real.py`, what `tiny-models --size real` writes). The one whose
model has exactly the weights' names and shapes (the safetensors headers, read without their tensors) completes
the folder.

How: a folder of unitgraph's own in the process's temporary directory, named as the user's (`.../transformer/`),
holding the chosen config.json, a link to each weight file and, for weights in several files, the shard index the
loaders read. The user's folder is never written to. A stage-1 cache keys the weights by folder name and content,
so a completed folder gives the entries of the whole release folder's weights.

Why the names and shapes decide: two releases of one family differ in some size (a 4B and a 9B, a 1.3B and a
14B release); a config is built on the meta device (no memory) and its parameters compared with the header, so a
config is chosen only when its model loads those weights without a missing or an unexpected tensor. Weights that
match no released config are reported, every such folder in one message (models/sources.py).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .folders import SlotTable

__all__ = ["Completion", "weights_without_config", "complete", "mismatch_problem"]


@dataclass(frozen=True)
class Completion:
    """A folder completed: the user's folder, unitgraph's folder that loads in its place, and the release whose
    config it took."""

    folder: Path
    completed: Path
    release: str
    subfolder: str

    @property
    def note(self) -> str:
        return (f"note: {self.folder} has weights without a config.json (as DiffSynth's download leaves it): read "
                f"with {self.release}'s released {self.subfolder} config, whose model has exactly these weights' names "
                "and shapes")


_DONE: dict[tuple, Completion] = {}  # (folder, files) -> its completion, for this process
_ROOT: list[Path] = []


def weights_without_config(folder: Path) -> list[Path]:
    """The safetensors files of a folder that has no config.json (DiffSynth's download of a component), else []."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / "config.json").is_file():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".safetensors")


def complete(folder: Path, files: list[Path], family: Any, subfolder: str, source: str) -> Optional[Completion]:
    """The completion of `folder` (its weight `files`) with the family's released config for `subfolder` whose
    model the weights fit exactly, or None when none does. Only the headers are read."""
    from .release import header, shapes_of

    folder = Path(folder)
    key = (folder.resolve(), tuple((f.name, f.stat().st_size) for f in files), family.name, subfolder)
    if key in _DONE:
        return _DONE[key]
    weights: dict[str, tuple[int, ...]] = {}
    for path in files:
        weights.update(shapes_of(header(path, source if len(files) == 1 else str(path))))
    renames = family.slot_of_subfolder(subfolder).library == "transformers"
    for release, config, states in released(family, subfolder):
        if any(fits(weights, params, renames) for params in states):
            completion = Completion(folder, _write(folder, files, subfolder, config, weights), release, subfolder)
            _DONE[key] = completion
            return completion
    return None


def fits(weights: dict[str, tuple[int, ...]], params: dict[str, tuple[int, ...]], renames: bool = False) -> bool:
    """Whether a model whose state has `params` ({name: shape}) loads `weights`: the same names and shapes, or, for a
    model whose loader renames a checkpoint's keys as it loads them (`renames`: transformers'), the same shapes, as
    many of each.

    >>> fits({"a.weight": (2, 3)}, {"a.weight": (2, 3)}), fits({"a.weight": (2, 3)}, {"b.weight": (2, 3)})
    (True, False)
    >>> fits({"model.a.weight": (2, 3)}, {"model.lm.a.weight": (2, 3)}, renames=True)
    True
    """
    if weights == params:
        return True
    return renames and Counter(weights.values()) == Counter(params.values())


def mismatch_problem(family: Any, subfolder: str, weights: int) -> str:
    """What a folder whose weights fit no released config is told (models/sources.py gathers every such folder)."""
    releases = sorted({release for release, _, _ in released(family, subfolder)})
    known = f"the released {subfolder} configs of {', '.join(releases)}" if releases else \
        f"any released {family.title} config (it has none for a {subfolder}/ folder)"
    return (f"its {weights} weight tensors (no config.json) fit none of {known}: put the release's "
            f"{subfolder}/config.json beside them")


_RELEASED: dict[tuple[str, str], tuple[tuple[str, str, tuple], ...]] = {}  # (family, subfolder) -> its configs


def _released(family: Any, subfolder: str) -> tuple[tuple[str, str, tuple], ...]:
    if (family.name, subfolder) not in _RELEASED:
        _RELEASED[family.name, subfolder] = _read_released(family, subfolder)
    return _RELEASED[family.name, subfolder]


def _read_released(family: Any, subfolder: str) -> tuple[tuple[str, str, tuple], ...]:
    import importlib

    real = importlib.import_module(".real", family.package)
    slot = family.slot_of_subfolder(subfolder)
    if slot is None:
        return ()
    table = SlotTable(family.slots)
    sharing = table.shared_subfolder.get(subfolder, ())  # two classes in one folder: the config says which
    out: dict[str, tuple[str, str, tuple]] = {}
    with tempfile.TemporaryDirectory(prefix="unitgraph-releases-") as tmp:
        for size in real.RELEASES:
            for pipeline in family.pipelines:
                top = Path(tmp) / f"{size}-{pipeline.name}"
                try:
                    real.write_real_configs(top, size=size, pipeline=pipeline.name)
                except ValueError:  # a size the pipeline has no release at
                    continue
                path = top / subfolder / "config.json"
                text = path.read_text(encoding="utf-8") if path.is_file() else None
                if text is None or text in out:
                    continue
                marker = json.loads((top / "unitgraph_config_only.json").read_text(encoding="utf-8"))
                named = table.of_config(json.loads(text)) if len(sharing) > 1 else None
                own = family.slot(named) if named in sharing else slot
                out[text] = (str(marker.get("source") or family.title), text, _state_shapes(own, path.parent))
    return tuple(out.values())


def released(family: Any, subfolder: str) -> list[tuple[str, dict[str, Any], tuple[dict[str, tuple[int, ...]], ...]]]:
    """(release, config, the {state name: shape} a checkpoint of its model may hold) of each distinct released
    config of the family's `subfolder` component (every size `tiny-models --size real*` writes, every pipeline)."""
    return [(release, json.loads(text), tuple(dict(s) for s in states)) for release, text, states in
            _released(family, subfolder)]


def _state_shapes(slot: Any, folder: Path) -> tuple:
    """The states a checkpoint of the slot's model, built on the meta device from `folder`'s config.json, may hold:
    its whole state dict, and the same without the tensors tied to another (transformers leaves those out of
    some files). Each a sorted tuple of (name, shape)."""
    import importlib

    import torch

    cls = getattr(importlib.import_module(slot.module or slot.library), slot.class_name)
    with torch.device("meta"):  # every tensor on the meta device: nothing allocated
        if slot.library == "transformers":
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
        else:
            model = cls.from_config(cls.load_config(str(folder), local_files_only=True))
    state = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    untied = {name: shape for name, shape in state.items() if name not in tied}
    return tuple(tuple(sorted(s.items())) for s in ((state, untied) if untied != state else (state,)))


def _write(folder: Path, files: list[Path], subfolder: str, config: dict[str, Any],
           weights: dict[str, tuple[int, ...]]) -> Path:
    """unitgraph's folder for `folder`: the config, a link to each weight file, the shard index when several."""
    from .release import header

    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="unitgraph-completed-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    out = _ROOT[0] / str(len(list(_ROOT[0].iterdir()))) / (folder.name or subfolder)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    library_name = "diffusion_pytorch_model" if "_class_name" in config else "model"
    if len(files) == 1:  # under the name the loaders look for
        (out / f"{library_name}.safetensors").symlink_to(files[0].resolve())
        return out
    for path in files:
        (out / path.name).symlink_to(path.resolve())
    if len(files) > 1:
        index_name = f"{library_name}.safetensors.index.json"
        weight_map = {name: path.name for path in files for name in header(path, str(path)).tensors}
        (out / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n",
                                      encoding="utf-8")
    return out

"""Training states of a DiffSynth pipeline's run: what `--resume` needs to continue it exactly.

A state is a folder `OUTPUT/state/step-N/` written at every checkpoint (each epoch's end, and every --save_steps):
the trained parameters by their names (`trained.safetensors`), AdamW's moments and step counts
(`optimizer.safetensors`), and in `state.json` the position (the epoch and the index in its order of the next step,
the global step), the learning-rate schedule's state, the optimizer's groups, the loss rows so far and the settings
that decide what the next steps compute. A step's draws are seeded from (--seed, epoch, sample) and an epoch's order
from (--seed, epoch), so nothing of torch's random state needs keeping: a run continued from a state takes the very
steps the uninterrupted run takes. It is written into a temporary folder and renamed into place, so a kill leaves
the previous state whole; only the newest --save_total_limit states are kept (all with 0). Never pickle: tensors in
safetensors, the rest JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from ..errors import BackendError

__all__ = ["STATE_DIR", "load_state", "newest_state", "prune_states", "save_state", "settings_of"]

STATE_DIR = "state"
FORMAT = "unitgraph.diffsynth-state/v1"


SETTING_NAMES = {"samples_per_step": "samples a step (processes x --gradient_accumulation_steps)"}


def settings_of(args: Any, sample_ids: list[str], samples_per_step: int = 1) -> dict[str, Any]:
    """What a continued run must share with the one that wrote the state (--num_epochs may grow), the samples of an
    optimizer step (processes x --gradient_accumulation_steps) included."""
    import hashlib

    names = ("seed", "learning_rate", "weight_decay", "lora_base_model", "lora_target_modules", "lora_rank",
             "lora_alpha", "trainable_models", "dataset_repeat", "remove_prefix_in_ckpt", "save_steps")
    samples = hashlib.sha256("\n".join(sample_ids).encode("utf-8")).hexdigest()
    return {**{name: getattr(args, name) for name in names}, "samples": samples, "samples_per_step": samples_per_step}


def save_state(output: Path, step: int, position: tuple[int, int], named: list[tuple[str, Any]], optimizer: Any,
               scheduler: Any, rows: list[dict[str, Any]], settings: dict[str, Any], keep: Optional[int]) -> Path:
    """Write the state after global step `step` (next: epoch, index = `position`); drop all but the newest `keep`."""
    from safetensors.torch import save_file

    root = output / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    scratch = Path(tempfile.mkdtemp(prefix=f".step-{step}.", dir=root))
    try:
        save_file({name: p.detach().to("cpu").contiguous() for name, p in named}, str(scratch / "trained.safetensors"))
        saved = optimizer.state_dict()
        moments = {f"{i}.{key}": value.detach().to("cpu").contiguous()
                   for i, state in saved["state"].items() for key, value in state.items()}
        save_file(moments, str(scratch / "optimizer.safetensors"))
        data = {"format": FORMAT, "step": step, "epoch": position[0], "index": position[1], "names": [n for n, _ in named],
                "param_groups": saved["param_groups"], "scheduler": scheduler.state_dict(), "rows": rows,
                "settings": settings}
        (scratch / "state.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)  # a state of this very step, written by an earlier attempt: ours
        os.rename(scratch, final)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    prune_states(output, keep)
    return final


def prune_states(output: Path, keep: Optional[int], resumed: Optional[Path] = None) -> None:
    """Keep the newest `keep` states (--save_total_limit; 0 or None: all): after a new state is whole, and when a run
    resumed from the newest (`resumed`: a kill between a state and this pruning left one too many)."""
    found = sorted(_states(output / STATE_DIR), key=_step)
    if resumed is not None and (not found or Path(resumed).resolve() != found[-1].resolve()):
        return  # resumed from an older state, or from another folder's: the others are left as they are
    if keep:
        for old in found[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _step(folder: Path) -> int:
    return int(folder.name.split("-", 1)[1])


def _states(root: Path) -> list[Path]:
    return [p for p in root.glob("step-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]


def newest_state(output: Path, given: str) -> Path:
    """The state `--resume` names: the newest under OUTPUT/state for "latest", else the folder given."""
    if given != "latest":
        folder = Path(given)
        if not (folder / "state.json").is_file():
            raise BackendError("--resume: not a training state folder (no state.json)", source=str(folder))
        return folder
    found = _states(output / STATE_DIR)
    if not found:
        raise BackendError("--resume: no training state in the output folder yet; start the run without --resume",
                           source=str(output))
    return max(found, key=_step)


def load_state(folder: Path, named: list[tuple[str, Any]], optimizer: Any, scheduler: Any,
               settings: dict[str, Any]) -> tuple[int, tuple[int, int], list[dict[str, Any]]]:
    """Put the state of `folder` into the trained parameters, the optimizer and the schedule; (global step, next
    position, loss rows so far). One line when it is not this run's."""
    import torch
    from safetensors.torch import load_file

    try:
        data = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        trained = load_file(str(folder / "trained.safetensors"))
        moments = load_file(str(folder / "optimizer.safetensors"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BackendError(f"--resume: unreadable training state ({exc})", source=str(folder)) from None
    except Exception as exc:  # safetensors' own errors for a damaged file
        raise BackendError(f"--resume: unreadable training state ({type(exc).__name__}: {exc})", source=str(folder)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BackendError("--resume: not a training state of a DiffSynth pipeline's run", source=str(folder))
    saved = {"samples_per_step": 1, **(data.get("settings") or {})}  # a state from before several a step: one
    for key, value in settings.items():
        if saved.get(key) != value:
            what = SETTING_NAMES.get(key, key)
            raise BackendError(f"--resume: the state was made with {what} {saved.get(key)!r}, this run has "
                               f"{value!r}; a continued run must compute what the first would have", source=str(folder))
    names = [n for n, _ in named]
    if data.get("names") != names or set(trained) != set(names):
        raise BackendError("--resume: the state holds other trained parameters than this run's", source=str(folder))
    with torch.no_grad():
        for name, param in named:
            param.copy_(trained[name])
    state: dict[int, dict[str, Any]] = {}
    for key, value in moments.items():
        index, _, field = key.partition(".")
        state.setdefault(int(index), {})[field] = value
    optimizer.load_state_dict({"state": state, "param_groups": data["param_groups"]})
    scheduler.load_state_dict(data["scheduler"])
    return int(data["step"]), (int(data["epoch"]), int(data["index"])), list(data["rows"])

"""Training state that survives a kill: written at every checkpoint, read by `--resume`.

Why a resumed run is the uninterrupted run. Every random draw of a step is a pure function of
(--seed, epoch, sample key): the epoch's order is `permutation(seed, "shuffle", epoch)`, each sample's
latent, noise and timestep come from `ctx.rng(purpose)` keyed by its sample, the dropout stream of a
micro-step is seeded from its samples' keys, and the LoRA's initial weights from the seed. So there is
no hidden random state to save: what a step computes depends only on the trained weights, the
optimizer's state and *which* step it is. A state therefore holds exactly

  * `trained.safetensors`: every parameter being trained (LoRA and fully trained models), by its
    in-memory name, so it is restored bit for bit;
  * `optimizer.safetensors` + the param groups in `state.json`: AdamW's per-parameter step count and
    moments, in the optimizer's own parameter order;
  * `state.json`: the step, the epoch and how many optimizer steps of that epoch are done, the loss
    rows so far, and what must not change for the continuation to be the same training (plan
    fingerprint, seed, learning rate, batch and accumulation, LoRA settings, process count, ...).

Each state is a folder `OUTPUT/state/step-<N>/`, written into a temporary folder and renamed into
place, so a kill leaves either the whole state or none of it (a leftover temporary folder is removed
on the next start). Nothing is pickled: tensors are safetensors, the rest is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from unitgraph.atomic import write_bytes_atomic, write_text_atomic

from ..cache.keys import sha256_file
from ..errors import BackendError

__all__ = ["ResumePoint", "STATE_DIR", "latest_state", "load_state", "must_match", "prune_states", "remove_partial_states",
           "save_state", "states", "trained_parameters"]

STATE_DIR = "state"
STATE_FORMAT = "unitgraph.train-state/v1"
_TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: after optimizer step `step`, `position` steps into epoch `epoch`."""

    path: Path
    step: int
    epoch: int
    position: int
    elapsed: float
    rows: list[list[Any]]


def must_match(cfg: Any, plan: Any, world: int) -> dict[str, Any]:
    """What a state records of the run and a resumed run must repeat exactly (else it is another training)."""
    o, lora = cfg.optim, cfg.lora
    return {
        "task": cfg.args.task, "pipeline": plan.pipeline, "plan_fingerprint": plan.fingerprint, "seed": cfg.seed,
        "learning_rate": o.learning_rate, "weight_decay": o.weight_decay, "batch_size": o.batch_size,
        "gradient_accumulation_steps": o.accumulation, "dataset_repeat": cfg.data.repeat,
        "trainable_models": list(o.trainable), "lora_base_model": lora.base_model,
        "lora_target_modules": list(lora.targets), "lora_rank": lora.rank, "lora_alpha": lora.alpha,
        "processes": int(world), "settings": cfg.units.key_values(), "fp8_models": list(cfg.precision.fp8),
    }


_FLAGS = {"plan_fingerprint": "the plan (--lora_base_model, --trainable_models, --cache_mode or the pipeline)",
          "processes": "the number of processes",
          "settings": "--max_pixels/--height/--width, --seed, --mixed_precision or the bounds"}


def trained_parameters(models: dict[str, Any], slots: list[str]) -> dict[str, Any]:
    """{"<slot>/<name>": parameter} of every parameter being trained, in the optimizer's order."""
    out = {}
    for slot in slots:
        model = models[slot]
        model = getattr(model, "module", model)
        for name, param in model.named_parameters():
            if param.requires_grad:
                out[f"{slot}/{name}"] = param
    return out


def save_state(output: Path, step: int, epoch: int, position: int, elapsed: float, rows: list[Any],
               params: dict[str, Any], optimizer: Any, match: dict[str, Any]) -> Path:
    """Write the state after `step` into OUTPUT/state/step-<step>/ (whole or not at all); return the folder."""
    import torch
    from safetensors.torch import save

    root = Path(output) / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    temp = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{final.name}-", dir=root))
    try:
        opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer  # accelerate's wrapper
        opt_state = opt.state_dict()
        tensors = {}
        for index, values in opt_state["state"].items():
            for key, value in values.items():
                value = value if isinstance(value, torch.Tensor) else torch.tensor(value)  # AdamW's step, in old torch
                tensors[f"{index}.{key}"] = value.detach().to("cpu").contiguous().clone()
        write_bytes_atomic(temp / "optimizer.safetensors", save(tensors))
        weights = {name: p.detach().to("cpu").contiguous().clone() for name, p in params.items()}
        write_bytes_atomic(temp / "trained.safetensors", save(weights))
        record = {"format": STATE_FORMAT, "step": step, "epoch": epoch, "position": position, "elapsed_s": elapsed,
                  "match": match, "param_groups": opt_state["param_groups"], "loss_rows": [list(r) for r in rows],
                  "files": {name: sha256_file(temp / name) for name in ("optimizer.safetensors", "trained.safetensors")}}
        write_text_atomic(temp / "state.json", json.dumps(record, indent=1, sort_keys=True) + "\n")
        if final.exists():  # the same step saved again (an epoch that ends on a --save_steps step)
            shutil.rmtree(final)
        os.replace(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendError(f"not a readable training state ({type(exc).__name__})", source=str(path)) from None
    if not isinstance(record, dict) or record.get("format") != STATE_FORMAT:
        raise BackendError("not a unitgraph training state", source=str(path))
    return record


def remove_partial_states(output: Path) -> None:
    """Remove the temporary folders of a state write that a kill interrupted (at a run's start, main process)."""
    root = Path(output) / STATE_DIR
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(_TEMP_PREFIX) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)


def states(output: Path) -> list[Path]:
    """The complete states under OUTPUT/state, oldest first (a partial write is never one: it is renamed into
    place only when whole)."""
    root = Path(output) / STATE_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / "state.json").is_file())


def latest_state(output: Path) -> Optional[Path]:
    found = states(output)
    return found[-1] if found else None


def prune_states(output: Path, keep: Optional[int]) -> None:
    """--save_total_limit: keep the newest `keep` states."""
    if not keep:
        return
    for old in states(output)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_state(path: Path, params: dict[str, Any], optimizer: Any, match: dict[str, Any]) -> ResumePoint:
    """Restore trained weights and optimizer state from `path` (checked: its files' digests, and that the run
    repeats what the state records); the point to continue from."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    record = _read(path)
    for key, value in match.items():
        if record["match"].get(key) != value:
            what = _FLAGS.get(key, f"--{key}")
            raise BackendError(f"this state was made with another {key} ({record['match'].get(key)!r}, now {value!r}): "
                               f"resuming would be another training; keep {what} as it was, or start anew with "
                               "--overwrite", source=str(path))
    for name, digest in record["files"].items():
        if not (path / name).is_file() or sha256_file(path / name) != digest:
            raise BackendError(f"{name} does not match the digest in state.json (damaged); resume from an older "
                               "state with --resume PATH", source=str(path))
    weights = load_file(str(path / "trained.safetensors"))
    if set(weights) != set(params):
        missing = sorted(set(params) - set(weights))[:1] or sorted(set(weights) - set(params))[:1]
        raise BackendError(f"the state's trained parameters differ from this run's (e.g. {missing[0]})", source=str(path))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name].to(param.device, param.dtype))
    tensors = load_file(str(path / "optimizer.safetensors"))
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, _, name = key.partition(".")
        state.setdefault(int(index), {})[name] = value
    opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    opt.load_state_dict({"state": state, "param_groups": record["param_groups"]})
    return ResumePoint(path=path, step=int(record["step"]), epoch=int(record["epoch"]), position=int(record["position"]),
                       elapsed=float(record["elapsed_s"]), rows=record["loss_rows"])

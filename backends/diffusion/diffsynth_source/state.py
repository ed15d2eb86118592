"""Training states of a DiffSynth pipeline's run: what `--resume` needs to continue it exactly.

A state is a folder `OUTPUT/state/step-N/` written at every checkpoint (each epoch's end, and every --save_steps):
the trained parameters by their names (`trained.safetensors`), the optimizer's state (`optimizer.safetensors`:
AdamW's moments and step counts, or another --optimizer's), with --ema_decay the moving average (`ema.safetensors`),
and in `state.json` the position (the epoch and the index in its order of the next step,
the global step), the learning-rate schedule's state, the optimizer's groups, the loss rows so far and the settings
that decide what the next steps compute. A step's draws are seeded from (--seed, epoch, sample) and an epoch's order
from (--seed, epoch), so nothing of torch's random state needs keeping: a run continued from a state takes the very
steps the uninterrupted run takes. It is written into a temporary folder and renamed into place, so a kill leaves
the previous state whole; only the newest --save_total_limit states are kept (all with 0). Never pickle: tensors in
safetensors, the rest JSON.

Under DeepSpeed ZeRO and FSDP2 (sharding.py) each process keeps its own share of the optimizer state: the main
process's is optimizer.safetensors, process R's optimizer-rank<R>.safetensors, written by that process into a
staging folder first (`staging_folder`) and moved into the state by the main process before the state is renamed
into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import BackendError

__all__ = ["STATE_DIR", "Loaded", "load_optimizer", "load_state", "newest_state", "optimizer_tensors", "prune_states",
           "rank_file", "save_rank_file", "save_state", "settings_of", "staging_folder"]

STATE_DIR = "state"
EMA_FILE = "ema.safetensors"
# a Python number an optimizer keeps per parameter, by its type's name: (the type, the 0-dim tensor's torch dtype)
NUMBERS = {"bool": (bool, "bool"), "int": (int, "int64"), "float": (float, "float64")}
FORMAT = "unitgraph.diffsynth-state/v1"


SETTING_NAMES = {"samples_per_step": "samples a step (processes x --gradient_accumulation_steps)",
                 "engine": "the engine"}
# the training recipe's settings (a state written before they were recorded had their defaults)
RECIPE = ("optimizer", "optimizer_args", "lr_scheduler", "lr_warmup_steps", "ema_decay", "max_grad_norm",
          "caption_dropout", "loss_weighting", "masked_loss", "masked_loss_unmasked_weight")
DEFAULTS = {"samples_per_step": 1, "engine": "data parallel", "optimizer": "adamw", "optimizer_args": None,
            "lr_scheduler": "diffsynth", "lr_warmup_steps": 0, "ema_decay": None, "max_grad_norm": None,
            "caption_dropout": 0.0, "loss_weighting": "diffsynth", "timestep_sampling": {"scheme": "diffsynth"},
            "masked_loss": False, "masked_loss_unmasked_weight": 0.0}


def settings_of(args: Any, sample_ids: list[str], samples_per_step: int = 1,
                engine: str = "data parallel", fp8: list[str] = ()) -> dict[str, Any]:
    """What a continued run must share with the one that wrote the state (--num_epochs may grow), the samples of an
    optimizer step (processes x --gradient_accumulation_steps), the engine (world.World.describe) and the models the
    step holds in fp8 (`fp8`, --fp8_models) included."""
    import hashlib

    names = ("seed", "learning_rate", "weight_decay", "lora_base_model", "lora_target_modules", "lora_rank",
             "lora_alpha", "trainable_models", "dataset_repeat", "remove_prefix_in_ckpt", "save_steps", *RECIPE)
    samples = hashlib.sha256("\n".join(sample_ids).encode("utf-8")).hexdigest()
    return {**{name: getattr(args, name) for name in names}, "timestep_sampling": args.sampling().key(),
            "samples": samples, "samples_per_step": samples_per_step,
            "engine": engine, **({"fp8_models": list(fp8)} if fp8 else {})}


def rank_file(rank: int) -> str:
    """The optimizer file of process `rank` (the main process's is the one a data-parallel state has)."""
    return "optimizer.safetensors" if rank == 0 else f"optimizer-rank{rank}.safetensors"


def staging_folder(output: Path, step: int) -> Path:
    """Where the other processes put their optimizer files of the state after `step` (a leftover of a killed run is
    overwritten by the next state of that step, and never read: it is not a step-N folder)."""
    return Path(output) / STATE_DIR / f".ranks-step-{step}"


def save_rank_file(folder: Path, rank: int, tensors: dict[str, Any]) -> None:
    """Process `rank`'s optimizer tensors into the staging `folder`, whole or not at all."""
    from safetensors.torch import save

    from unitgraph.atomic import write_bytes_atomic

    folder.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(folder / rank_file(rank), save({k: v.contiguous() for k, v in tensors.items()}))


def optimizer_tensors(optimizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(tensors "<param index>.<key>", param groups) of a torch optimizer's state, on the CPU. A Python number an
    optimizer keeps per parameter (Adafactor's and CAME's step counts) is a 0-dim tensor named "<i>.<key>#int" (or
    #float, #bool), and comes back from `load_optimizer` as the number it was."""
    import torch

    saved = optimizer.state_dict()
    tensors = {}
    for i, state in saved["state"].items():
        for key, value in state.items():
            if isinstance(value, (bool, int, float)):
                kind = type(value).__name__
                tensors[f"{i}.{key}#{kind}"] = torch.tensor(value, dtype=getattr(torch, NUMBERS[kind][1]))
            else:
                tensors[f"{i}.{key}"] = _local(value).detach().to("cpu").contiguous()
    return tensors, saved["param_groups"]


def _local(value: Any) -> Any:
    """This process's part of a tensor: an FSDP2 shard's local tensor (sharding.py), else the tensor."""
    return value.to_local() if hasattr(value, "to_local") else value


def load_optimizer(optimizer: Any, tensors: dict[str, Any], groups: list[dict[str, Any]], source: str) -> None:
    """`optimizer_tensors`' output put back into `optimizer`; one line when it does not fit."""
    state: dict[int, dict[str, Any]] = {}
    try:
        for key, value in tensors.items():
            index, _, field = key.partition(".")
            field, _, kind = field.partition("#")
            state.setdefault(int(index), {})[field] = NUMBERS[kind][0](value.item()) if kind in NUMBERS else value
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, TypeError) as exc:
        raise BackendError(f"--resume: the state's optimizer state does not fit this run's ({exc})",
                           source=source) from None


def save_state(output: Path, step: int, position: tuple[int, int], trained: dict[str, Any],
               optimizer: tuple[dict[str, Any], list[dict[str, Any]]], scheduler: Any, rows: list[dict[str, Any]],
               settings: dict[str, Any], keep: Optional[int], ranks: Optional[Path] = None,
               ema: Optional[tuple[dict[str, Any], int]] = None) -> Path:
    """Write the state after global step `step` (next: epoch, index = `position`): the `trained` tensors by name,
    the main process's `optimizer` (`optimizer_tensors`' pair) and, from the `ranks` staging folder, the other
    processes' optimizer files, and the moving average (`ema`: its tensors by name and the steps it has averaged);
    drop all but the newest `keep`."""
    from safetensors.torch import save_file

    root = output / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    scratch = Path(tempfile.mkdtemp(prefix=f".step-{step}.", dir=root))
    moments, groups = optimizer
    try:
        save_file({name: p.detach().to("cpu").contiguous() for name, p in trained.items()},
                  str(scratch / "trained.safetensors"))
        save_file(moments, str(scratch / rank_file(0)))
        if ema is not None:
            save_file({name: t.detach().to("cpu").contiguous() for name, t in ema[0].items()},
                      str(scratch / EMA_FILE))
        if ranks is not None:
            for file in sorted(ranks.iterdir()):
                os.rename(file, scratch / file.name)
        data = {"format": FORMAT, "step": step, "epoch": position[0], "index": position[1], "names": list(trained),
                "param_groups": groups, "scheduler": scheduler.state_dict(), "rows": rows, "settings": settings,
                **({"ema_step": ema[1]} if ema is not None else {})}
        (scratch / "state.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)  # a state of this very step, written by an earlier attempt: ours
        os.rename(scratch, final)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        if ranks is not None:
            shutil.rmtree(ranks, ignore_errors=True)
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


@dataclass
class Loaded:
    """A training state as read for this process."""

    step: int
    position: tuple[int, int]  # (epoch, index in its order) of the next step
    rows: list[dict[str, Any]]
    trained: dict[str, Any]  # name -> whole tensor
    optimizer: dict[str, Any]  # this process's optimizer tensors (`optimizer_tensors`' layout)
    groups: list[dict[str, Any]]
    scheduler: dict[str, Any]
    ema: Optional[tuple[dict[str, Any], int]] = None  # the moving average's tensors by name, and its step count


def load_state(folder: Path, names: list[str], settings: dict[str, Any], rank: int = 0) -> Loaded:
    """The state of `folder` as process `rank` needs it; one line when it is not this run's."""
    from safetensors.torch import load_file

    try:
        data = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        trained = load_file(str(folder / "trained.safetensors"))
        moments = load_file(str(folder / rank_file(rank)))
    except FileNotFoundError as exc:
        raise BackendError(f"--resume: the training state has no {Path(exc.filename or '?').name}",
                           source=str(folder)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BackendError(f"--resume: unreadable training state ({exc})", source=str(folder)) from None
    except Exception as exc:  # safetensors' own errors for a damaged file
        raise BackendError(f"--resume: unreadable training state ({type(exc).__name__}: {exc})", source=str(folder)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BackendError("--resume: not a training state of a DiffSynth pipeline's run", source=str(folder))
    saved = {**DEFAULTS, **(data.get("settings") or {})}
    for key, value in settings.items():
        if saved.get(key) != value:
            what = SETTING_NAMES.get(key, key)
            raise BackendError(f"--resume: the state was made with {what} {saved.get(key)!r}, this run has "
                               f"{value!r}; a continued run must compute what the first would have", source=str(folder))
    if data.get("names") != names or set(trained) != set(names):
        raise BackendError("--resume: the state holds other trained parameters than this run's", source=str(folder))
    ema = None
    if settings.get("ema_decay") is not None:
        try:
            shadows = load_file(str(folder / EMA_FILE))
        except FileNotFoundError:
            raise BackendError(f"--resume: the training state has no {EMA_FILE}", source=str(folder)) from None
        except Exception as exc:  # safetensors' own errors for a damaged file
            raise BackendError(f"--resume: unreadable training state ({type(exc).__name__}: {exc})",
                               source=str(folder)) from None
        if set(shadows) != set(names):
            raise BackendError("--resume: the state's moving average holds other parameters than this run's",
                               source=str(folder))
        ema = (shadows, int(data.get("ema_step", 0)))
    return Loaded(int(data["step"]), (int(data["epoch"]), int(data["index"])), list(data["rows"]), trained, moments,
                  data["param_groups"], data["scheduler"], ema)

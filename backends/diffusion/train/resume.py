"""Training state that survives a kill: written at every checkpoint, read by `--resume`.

Why a resumed run is the uninterrupted run. Every random draw of a step is a pure function of
(--seed, epoch, sample key): the epoch's order is `permutation(seed, "shuffle", epoch)`, each sample's
latent, noise and timestep come from `ctx.rng(purpose)` keyed by its sample, the dropout stream of a
micro-step is seeded from its samples' keys, and the LoRA's initial weights from the seed. So there is
no hidden random state to save: what a step computes depends only on the trained weights, the
optimizer's state and *which* step it is. A state therefore holds exactly

  * `trained.safetensors`: every parameter being trained (LoRA and fully trained models), by its
    in-memory name, so it is restored bit for bit;
  * `optimizer.safetensors` + the param groups in `state.json`: what the optimizer (--optimizer, AdamW by
    default) keeps per parameter, in its own parameter order: its tensors in the file, its numbers (a step
    count kept as a Python int) in `state.json`'s `optimizer_scalars`; the param groups' values it changes as it
    steps (Prodigy's d, a schedule-free optimizer's weight sum) are restored from the state, the others checked;
  * `ema.safetensors` (with --ema_decay): the moving average of every trained parameter, by the same names,
    and its step count in `state.json` (train/ema.py);
  * `state.json`: the step, the epoch and how many optimizer steps of that epoch are done, the loss
    rows so far, and what must not change for the continuation to be the same training (plan
    fingerprint, seed, learning rate, batch and accumulation, LoRA settings, process count, ...).

Another number of processes: under data parallel and FSDP2 the state holds every tensor whole, so it can be laid
out over any number of processes; what changes is how an epoch's samples are dealt to them. So a state continues on
another number only from the end of an epoch (`_check_new_count`), and the run's steps then count on from it
(`ResumePoint.offset`). A DeepSpeed state, one partition of AdamW's state per process, stays on its number.

Each state is a folder `OUTPUT/state/step-<N>/`, written into a temporary folder and renamed into
place, so a kill leaves either the whole state or none of it (a leftover temporary folder is removed
on the next start). Nothing is pickled: tensors are safetensors, the rest is JSON.

A state is read whole before anything changes (`check_state`): state.json against its schema (every
field's type, the loss rows one per step), the run it records against this one, each file against the
sha256 state.json records, both safetensors headers (a truncated file is named as such), every tensor's
name, shape and dtype against the trained parameters and what the optimizer keeps per parameter
(train/optimizers.state_layout), and the values (finite; step counts and second moments in range). Only a state
that passes is restored (`apply_state`), so a tampered or damaged state is one line naming its file,
with the weights, the optimizer and loss.csv untouched.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from unitgraph.atomic import write_bytes_atomic, write_text_atomic
from unitgraph.userfiles import read_user_json

from ..cache.keys import sha256_file
from ..errors import BackendError
from ..tensorfile import Header, TensorInfo, dtype_code, finite, load_tensors, read_header
from .lr import schedule_needs_total
from .optimizers import COUNT, STEP, evolving_group_keys, state_layout

__all__ = ["CheckedState", "ResumePoint", "STATE_DIR", "apply_state", "check_state", "latest_state", "load_state",
           "must_match", "optimizer_tensors", "prune_states", "rank_file", "remove_partial_states", "reshard_offset",
           "save_state", "staging_folder", "states", "trained_parameters"]

STATE_DIR = "state"
STATE_FORMAT = "unitgraph.train-state/v2"  # v2: loss rows carry the step's timestep
STATE_JSON = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINED_FILE = "trained.safetensors"
STATE_FILES = (OPTIMIZER_FILE, TRAINED_FILE)
EMA_FILE = "ema.safetensors"  # the moving average of the trained weights, with --ema_decay (train/ema.py)
_TEMP_PREFIX = ".tmp-"
_STATE_NAME = re.compile(r"step-([0-9]+)")
_RANK_FILE = re.compile(r"optimizer-rank([1-9][0-9]*)\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_OPTIMIZER_KEY = re.compile(r"(0|[1-9][0-9]*)\.([A-Za-z_][A-Za-z0-9_]*)")
_OLDER = "resume from an older state with --resume PATH, or start anew with --overwrite"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: after optimizer step `step`, `position` steps into epoch `epoch`.

    `offset` is the steps made before the epochs counted at today's steps per epoch (step = offset + epoch x steps
    an epoch + position): 0, unless an earlier resume changed the number of processes at an epoch's end
    (`reshard_offset`). `per_epoch` and `processes` are the state's own; `epoch_done` says its epoch is finished."""

    path: Path
    step: int
    epoch: int
    position: int
    elapsed: float
    rows: list[list[Any]]
    offset: int = 0
    per_epoch: Optional[int] = None
    processes: Optional[int] = None
    epoch_done: bool = False


def must_match(cfg: Any, plan: Any, world: int, data: Optional[str] = None,
               steps_per_epoch: Optional[int] = None) -> dict[str, Any]:
    """What a state records of the run and a resumed run must repeat exactly (else it is another training): every
    setting that changes the numbers, the data (`data_identity`), the steps an epoch has, the preset LoRA (its
    digest), and the validation prompts (their images are named by step)."""
    o, lora, v = cfg.optim, cfg.lora, cfg.validation
    preset = None
    if lora.preset_path:
        try:
            preset = sha256_file(Path(lora.preset_path))
        except OSError as exc:
            raise BackendError(f"--preset_lora_path: cannot read it ({exc.strerror or exc})",
                               source=str(lora.preset_path)) from None
    return {
        "task": cfg.args.task, "pipeline": plan.pipeline, "plan_fingerprint": plan.fingerprint, "seed": cfg.seed,
        "learning_rate": o.learning_rate, "weight_decay": o.weight_decay, "batch_size": o.batch_size,
        "gradient_accumulation_steps": o.accumulation, "dataset_repeat": cfg.data.repeat,
        "trainable_models": list(o.trainable), "lora_base_model": lora.base_model,
        "lora_target_modules": list(lora.targets), "lora_rank": lora.rank, "lora_alpha": lora.alpha,
        # the adapter's kind and scale: another kind holds other tensors, rsLoRA another scale of the same ones
        "lora_type": lora.kind, "use_rslora": bool(lora.rslora),
        "processes": int(world), "settings": cfg.units.key_values(), "fp8_models": list(cfg.precision.fp8),
        "expert": cfg.models.expert,
        "data": data, "steps_per_epoch": steps_per_epoch, "preset_lora": preset,
        "preset_lora_model": lora.preset_model, "validation_prompts": list(v.prompts), "validation_steps": v.steps,
        "lr_scheduler": o.lr_scheduler, "lr_warmup_steps": o.lr_warmup_steps,
        "max_grad_norm": o.max_grad_norm,
        "optimizer": o.optimizer, "optimizer_args": dict(o.optimizer_args), "ema_decay": o.ema_decay,
        # the clips' length where the run reads clips itself (unsplit; stage 2's cache pins it through `data`), else
        # None, as states written before it hold it
        "num_frames": (int(cfg.data.num_frames) if getattr(cfg.pipeline, "video_params", ()) and cfg.stage == ""
                       else None),
        # data parallel is recorded as None, as states written before engines existed hold it
        "engine": None if cfg.engine.kind == "ddp" else cfg.engine.name,
        "lr_schedule_steps": (steps_per_epoch * o.num_epochs if steps_per_epoch is not None
                              and schedule_needs_total(o.lr_scheduler) else None),
    }


def data_identity(provider: Any) -> str:
    """What the run trains on, as one digest: its samples in order (index and content id) and, for stage 2, the
    cache's key (the stage-1 settings and models its entries were made with); with --dataset_config, each sample's
    dataset and each dataset's share of an epoch."""
    shares = getattr(provider, "shares", ())
    items = [[int(item.index), str(item.sample_id), *([item.dataset] if shares else [])] for item in provider.items]
    ident = {"samples": items, "cache": getattr(provider, "key_hash", None)}
    if shares:  # --dataset_config: each sample's dataset and each dataset's repeats or weight (absent without one)
        ident["datasets"] = [[share.name, share.repeats, share.weight] for share in shares]
    text = json.dumps(ident, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_progress(path: Path, point: Any, per_epoch: int, num_epochs: int) -> Any:
    """A state's place in the run adds up: its step is its epochs' steps plus its position in its own, within the
    run's epochs, with one loss row a step (a state claiming epoch 7 of a shorter run is refused). Returns the point
    to continue from: `point`, or, made with another count of steps an epoch (by another number of processes, at an
    epoch's end: `_check_new_count`), with the offset this run's steps count on from (`reshard_offset`)."""
    own = point.per_epoch if point.per_epoch is not None else per_epoch  # the state's steps an epoch
    done = point.offset + point.epoch * own + point.position
    if not (0 <= point.position <= own and point.step == done and len(point.rows) == point.step):
        raise BackendError(f"training state at step {point.step} does not add up (epoch {point.epoch}, position "
                           f"{point.position} of {own} steps an epoch, {len(point.rows)} loss rows); {_OLDER}",
                           source=str(Path(path) / STATE_JSON))
    if point.epoch >= num_epochs:
        raise BackendError(f"training state is at epoch {point.epoch}, beyond this run's --num_epochs {num_epochs}; "
                           "give at least as many epochs as it has made", source=str(Path(path) / STATE_JSON))
    if point.per_epoch not in (None, per_epoch):
        point = replace(point, offset=reshard_offset(point, per_epoch))
    state_root = Path(path).parent
    if state_root.name == STATE_DIR:  # a state of the run in its output folder: what that run made past this one's end
        _check_made_past(state_root.parent, per_epoch, num_epochs, point.offset)
    return point


_CHECKPOINT_NAME = re.compile(r"(epoch|step)-([0-9]+)(?:-ema)?\.safetensors")  # a checkpoint or its EMA file


def reshard_offset(point: ResumePoint, per_epoch: int) -> int:
    """The `offset` of a run resumed on another number of processes from the end of `point`'s epoch: the steps
    made so far, less those `per_epoch` steps an epoch would have made for the same epochs."""
    return point.step - (point.epoch + 1) * per_epoch


def _check_made_past(output: Path, per_epoch: int, num_epochs: int, offset: int = 0) -> None:
    """A resumed run ends at its own --num_epochs: the checkpoints and states a longer run made past that end would
    stay beside its shorter loss.csv, as if this run had made them. Refused, naming them."""
    total = offset + per_epoch * num_epochs
    past = []
    for entry in sorted(output.glob("*.safetensors")):
        match = _CHECKPOINT_NAME.fullmatch(entry.name)
        if match and int(match.group(2)) >= (num_epochs if match.group(1) == "epoch" else total + 1):
            past.append(entry.name)
    root = output / STATE_DIR
    if root.is_dir():
        past += [f"{STATE_DIR}/{p.name}" for p in sorted(root.iterdir())
                 if _STATE_NAME.fullmatch(p.name) and int(_STATE_NAME.fullmatch(p.name).group(1)) > total]
    if past:
        shown = ", ".join(past[:3]) + (", ..." if len(past) > 3 else "")
        raise BackendError(f"--resume: the run here went further than this run's --num_epochs {num_epochs} (step "
                           f"{total}) and made {shown}; continuing it with fewer epochs would leave those beside a "
                           "shorter loss.csv: give its --num_epochs, or start anew (--overwrite, without --resume)",
                           source=str(output))


# what a state made before a must-match value existed holds for it
_ABSENT = {"optimizer": "adamw", "optimizer_args": {}}
# must-match values a state made before they were recorded is not checked against: its adapter's kind is checked by
# its tensors' names (`_check_trained`), as it always was, and its rsLoRA flag cannot be known
_UNRECORDED = frozenset({"lora_type", "use_rslora"})
_FLAGS = {"optimizer": "--optimizer", "optimizer_args": "--optimizer_args", "ema_decay": "--ema_decay",
          "plan_fingerprint": "the plan (--lora_base_model, --trainable_models, --cache_mode or the pipeline)",
          "data": "the data (the dataset's samples, or the cache's entries and the settings they were made with; "
                  "--dataset_config's datasets and their repeats or weights)",
          "steps_per_epoch": "the data and --batch_size / --gradient_accumulation_steps",
          "preset_lora": "--preset_lora_path (the file's content)",
          "num_frames": "--num_frames (the clips' length)",
          "validation_prompts": "--validation_prompt", 
          "processes": "the number of processes",
          "engine": "the engine (the accelerate config's distributed_type and ZeRO stage)",
          "settings": "--max_pixels/--height/--width, --seed, --mixed_precision, --weighting_scheme, --timestep_sampling, "
                       "--snr_gamma, --caption_dropout, --masked_loss_unmasked_weight or the bounds",
          "lr_schedule_steps": "--num_epochs and the steps an epoch has (the --lr_scheduler decays over them)"}


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


def rank_file(rank: int) -> str:
    """The optimizer file of process `rank` in a state whose optimizer state is per process (DeepSpeed's ZeRO
    partitions): the main process's is optimizer.safetensors, the others' optimizer-rank<R>.safetensors."""
    return OPTIMIZER_FILE if rank == 0 else f"optimizer-rank{rank}.safetensors"


def staging_folder(output: Path, step: int) -> Path:
    """Where the other processes put their optimizer files of the state after `step` before the main process moves
    them into it (a leftover is removed at the next start, as any partial state write)."""
    return Path(output) / STATE_DIR / f"{_TEMP_PREFIX}ranks-step-{step:08d}"


def _pieces(values: dict[str, Any]) -> dict[str, Any]:
    """One parameter's state, with the pieces a library nests one level down lifted (bitsandbytes hides its
    quantized tensors from FSDP in a dict; its load_state_dict takes them flat as well)."""
    out = {}
    for key, value in values.items():
        out.update(value if isinstance(value, dict) else {key: value})
    return out


def optimizer_tensors(optimizer: Any, full: Any = None) -> dict[str, Any]:
    """The optimizer's per-parameter tensors as `<parameter index>.<name>` (whole, through `full`)."""
    import torch

    full = full or (lambda value: value.detach().to("cpu").contiguous().clone())
    opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer  # accelerate's wrapper
    tensors = {}
    for index, values in opt.state_dict()["state"].items():
        for key, value in _pieces(values).items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = full(value)
    return tensors


def optimizer_scalars(optimizer: Any) -> dict[str, Any]:
    """The optimizer's per-parameter values that are not tensors (Adafactor's, Prodigy's and CAME's step counts), as
    `<parameter index>.<name>`: numbers for state.json. A value JSON cannot hold exactly is refused."""
    import torch

    opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    out = {}
    for index, values in opt.state_dict()["state"].items():
        for key, value in _pieces(values).items():
            if isinstance(value, torch.Tensor):
                continue
            if not (isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value))):
                raise BackendError(f"the optimizer keeps {key} = {_shown(value)} for parameter {index}, which a "
                                   "training state cannot hold (a finite number is expected)")
            out[f"{index}.{key}"] = value
    return out


def _json_safe(value: Any) -> Any:
    """A param-group value as state.json holds it: a float that JSON has no number for as its name ("inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def save_state(output: Path, step: int, epoch: int, position: int, elapsed: float, rows: list[Any],
               params: dict[str, Any], optimizer: Any, match: dict[str, Any], full: Any = None,
               write: bool = True, ranks: Optional[Path] = None, offset: int = 0,
               ema: Any = None) -> Optional[Path]:
    """Write the state after `step` into OUTPUT/state/step-<step>/ (whole or not at all); return the folder.

    `full(tensor)` gives a tensor whole on the CPU; under FSDP2 it gathers the shards, a call every process makes
    in the same order, and only the process with `write` writes (the others return None). `ranks` is a folder of
    the other processes' optimizer files (`rank_file`), moved into the state and recorded with their digests, when
    each process keeps an optimizer state of its own (DeepSpeed). `ema` (train/ema.TrainedEMA, --ema_decay) adds the
    moving average of the trained weights, `ema.safetensors`, and its step count."""
    import torch
    from safetensors.torch import save

    if full is None:
        def full(value: Any) -> Any:
            return value.detach().to("cpu").contiguous().clone()
    if not write:
        opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        for values in opt.state_dict()["state"].values():
            for value in values.values():
                if isinstance(value, torch.Tensor):
                    full(value)
        for p in params.values():
            full(p)
        if ema is not None:  # the moving average's shards, gathered as the writing process gathers them
            ema.tensors(full)
        return None
    root = Path(output) / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    temp = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{final.name}-", dir=root))
    try:
        opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer  # accelerate's wrapper
        opt_state = opt.state_dict()
        write_bytes_atomic(temp / OPTIMIZER_FILE, save(optimizer_tensors(optimizer, full)))
        weights = {name: full(p) for name, p in params.items()}
        write_bytes_atomic(temp / TRAINED_FILE, save(weights))
        names = list(STATE_FILES)
        if ema is not None:
            write_bytes_atomic(temp / EMA_FILE, save(ema.tensors(full)))
            names.append(EMA_FILE)
        if ranks is not None:
            for file in sorted(Path(ranks).iterdir()):
                if _RANK_FILE.fullmatch(file.name):
                    os.replace(file, temp / file.name)
                    names.append(file.name)
            shutil.rmtree(ranks, ignore_errors=True)
        groups = [{key: _json_safe(value) for key, value in group.items()} for group in opt_state["param_groups"]]
        record = {"format": STATE_FORMAT, "step": step, "epoch": epoch, "position": position, "elapsed_s": elapsed,
                  "match": match, "param_groups": groups, "loss_rows": [list(r) for r in rows],
                  "files": {name: sha256_file(temp / name) for name in names}}
        scalars = optimizer_scalars(optimizer)
        if scalars:  # AdamW keeps none (its step is a tensor)
            record["optimizer_scalars"] = scalars
        if ema is not None:
            record["ema_step"] = ema.step
        if offset:  # a run resumed on another number of processes (ResumePoint.offset)
            record["step_offset"] = offset
        write_text_atomic(temp / STATE_JSON, json.dumps(record, indent=1, sort_keys=True) + "\n")
        if final.exists():  # the same step saved again (an epoch that ends on a --save_steps step)
            shutil.rmtree(final)
        os.replace(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


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
    found = [p for p in root.iterdir() if _STATE_NAME.fullmatch(p.name) and p.is_dir() and (p / STATE_JSON).is_file()]
    return sorted(found, key=lambda p: (int(_STATE_NAME.fullmatch(p.name).group(1)), p.name))  # by step, past 10^8 too


def latest_state(output: Path) -> Optional[Path]:
    found = states(output)
    return found[-1] if found else None


def prune_states(output: Path, keep: Optional[int] = 1) -> None:
    """--save_total_limit: keep the newest `keep` states (0 or None: every state). Called once a new state is whole,
    so the newest, the one --resume continues from, is never among those removed; the default keeps only it, as a
    full fine-tune's state (the trained weights and two AdamW moments) is three times the model."""
    if not keep:
        return
    for old in states(output)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class CheckedState:
    """A training state read whole and checked against this run (`check_state`), ready to be restored."""

    point: ResumePoint
    weights: dict[str, Any]  # trained parameter name -> tensor (shape and dtype of the parameter)
    optimizer_state: dict[int, dict[str, Any]]  # the optimizer's per-parameter state, by its parameter index
    param_groups: list[dict[str, Any]]  # this run's param groups (a state's are checked equal to them), with the
    # values the optimizer changes as it steps from the state
    ema: Optional[dict[str, Any]] = None  # the moving average of each trained parameter (--ema_decay), by name
    ema_step: int = 0  # the optimizer steps it has averaged


def _optimizer(optimizer: Any) -> Any:
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer  # accelerate's wrapper


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    """A JSON number that is a finite float (an integer of 400 digits is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


_FIELDS = {  # state.json: field -> (check, what it must be)
    "step": (_count, "a step count (an integer >= 0)"),
    "epoch": (_count, "an epoch (an integer >= 0)"),
    "position": (_count, "a step count (an integer >= 0)"),
    "elapsed_s": (lambda v: _number(v) and v >= 0, "seconds (a finite number >= 0)"),
    "match": (lambda v: isinstance(v, dict), "an object"),
    "param_groups": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(g, dict) for g in v),
                     "a list of param-group objects"),
    "loss_rows": (lambda v: isinstance(v, list), "a list of rows"),
    "files": (lambda v: isinstance(v, dict), "an object"),
}


def _read_record(path: Path) -> dict[str, Any]:
    """state.json, checked against its schema: every field there with its type, the files with their digests,
    one loss row per step so far (what loss.csv is rewritten to)."""
    source = str(path / STATE_JSON)
    record = read_user_json(path / STATE_JSON, BackendError, "a training state (state.json)", max_bytes=1 << 30)
    if not isinstance(record, dict):
        raise BackendError("not a unitgraph training state (not a JSON object)", source=source)
    fmt = record.get("format")
    if fmt != STATE_FORMAT:
        if isinstance(fmt, str) and fmt.startswith("unitgraph.train-state/"):
            raise BackendError(f"a training state of format {fmt}, not {STATE_FORMAT} (made by another unitgraph "
                               "version); start anew with --overwrite", source=source)
        raise BackendError(f"not a unitgraph training state (expected format {STATE_FORMAT})", source=source)
    for name, (check, what) in _FIELDS.items():
        if name not in record:
            raise BackendError(f"damaged training state: no field {name!r}; {_OLDER}", source=source)
        if not check(record[name]):
            raise BackendError(f"damaged training state: field {name!r} is {_shown(record[name])}, not {what}; {_OLDER}",
                               source=source)
    files = record["files"]
    ranks = sorted(int(m.group(1)) for m in map(_RANK_FILE.fullmatch, files) if m)
    if (set(files) - {rank_file(r) for r in ranks} - {EMA_FILE} != set(STATE_FILES)
            or ranks != list(range(1, len(ranks) + 1))
            or not all(isinstance(v, str) and _SHA256.fullmatch(v) for v in files.values())):
        raise BackendError(f"damaged training state: field 'files' is not the sha256 of {' and '.join(STATE_FILES)}; "
                           f"{_OLDER}", source=source)
    if not isinstance(record.get("optimizer_scalars", {}), dict):
        raise BackendError(f"damaged training state: field 'optimizer_scalars' is {_shown(record['optimizer_scalars'])}, "
                           f"not an object; {_OLDER}", source=source)
    offset = record.get("step_offset", 0)
    if not (isinstance(offset, int) and not isinstance(offset, bool) and offset <= record["step"]):
        raise BackendError(f"damaged training state: field 'step_offset' is {_shown(offset)}, not an integer of at most "
                           f"the state's step {record['step']}; {_OLDER}", source=source)
    rows, step, epoch = record["loss_rows"], record["step"], record["epoch"]
    if len(rows) != step:
        raise BackendError(f"damaged training state: {len(rows)} loss rows for {step} steps; {_OLDER}", source=source)
    last_epoch = 0
    for n, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) in (5, 6) and row[0] == n + 1 and _count(row[0]) and _count(row[1])
                and last_epoch <= row[1] <= epoch and _number(row[2]) and _number(row[3]) and row[3] >= 0
                and (row[4] is None or (_number(row[4]) and 0 <= row[4] <= 1000))
                and (len(row) == 5 or row[5] is None or (_number(row[5]) and row[5] >= 0))):
            raise BackendError(f"damaged training state: loss_rows[{n}] is {_shown(row)}, not [step {n + 1}, epoch "
                               f"(0..{epoch}, in order), loss, elapsed_s, timestep (0..1000 or null)"
                               f"[, grad_norm (>= 0 or null)]]; {_OLDER}",
                               source=source)
        last_epoch = row[1]
    return record


RESHARDABLE = (None, "FSDP2")  # the engines whose states hold every trained tensor and AdamW moment whole


def _check_match(path: Path, record: dict[str, Any], match: dict[str, Any]) -> None:
    """The state's run is this one: every must-match value the same, except the number of processes (and with it
    the steps an epoch has) where `_check_new_count` allows another."""
    skip: set[str] = set()
    if record["match"].get("processes") != match.get("processes") and _check_new_count(path, record, match):
        skip = {"processes", "steps_per_epoch"}
    for key, value in match.items():
        if key in _UNRECORDED and key not in record["match"]:
            continue
        saved = record["match"].get(key, _ABSENT.get(key))
        if key not in skip and saved != value:
            what = _FLAGS.get(key, f"--{key}")
            raise BackendError(f"this state was made with another {key} ({saved!r}, now {value!r}): "
                               f"resuming would be another training; keep {what} as it was, or start anew with "
                               "--overwrite", source=str(path / STATE_JSON))


def _check_new_count(path: Path, record: dict[str, Any], match: dict[str, Any]) -> bool:
    """Whether a state made by another number of processes may continue here (else the usual refusal follows):
    under data parallel or FSDP2, whose states hold every tensor whole (FSDP2 lays them out in this run's shards),
    and only from the end of an epoch, since the order in which an epoch's samples are dealt to the processes
    depends on their number. A DeepSpeed state, or one within an epoch, is refused in one line naming the way on."""
    saved = record["match"]
    made, now = saved.get("processes"), match.get("processes")
    if saved.get("engine") != match.get("engine"):
        return False  # another engine: refused as such
    source = str(path / STATE_JSON)
    if match.get("engine") not in RESHARDABLE:
        raise BackendError(f"this state was made by {made} processes under {match.get('engine')}, now {now}: DeepSpeed "
                           f"keeps each process's partition of AdamW's state, so the state resumes on {made} processes "
                           "only (train on another number under FSDP2 or data parallel, whose states are whole)",
                           source=source)
    per_epoch = saved.get("steps_per_epoch")
    if record["position"] != per_epoch:
        raise BackendError(f"this state was made by {made} processes, now {now}: a state continues on another number of "
                           f"processes only from the end of an epoch (how an epoch's samples are dealt out depends on "
                           f"the number); it is {record['position']} of {per_epoch} steps into epoch {record['epoch']}: "
                           f"resume on {made} processes, or from the state at an epoch's end", source=source)
    return True


def _same(saved: Any, current: Any) -> bool:
    """A param-group value read back from JSON equals the optimizer's own (tuples come back as lists, a float JSON has
    no number for as its name: `_json_safe`)."""
    if isinstance(current, float) and not math.isfinite(current):
        return saved == repr(current)
    if isinstance(current, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_same, saved, current))
    if isinstance(current, bool) or current is None or isinstance(saved, bool) or saved is None:
        return saved is current
    return type(saved) in (int, float, str) and saved == current


def _check_param_groups(path: Path, saved: list[Any], current: list[dict[str, Any]],
                        evolving: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The state's param groups are this run's optimizer's: the same parameters in each, the same settings
    (those a newer torch added may be missing: this run's are used). The values the optimizer changes as it steps
    (`evolving`) are the state's, each a finite number or a flag. Returns the groups to restore: this run's, with
    those values from the state."""
    source = str(path / STATE_JSON)
    if len(saved) != len(current):
        raise BackendError(f"damaged training state: {len(saved)} param groups, this run's optimizer has "
                           f"{len(current)}; {_OLDER}", source=source)
    for n, (theirs, ours) in enumerate(zip(saved, current)):
        if theirs.get("params") != ours["params"]:
            raise BackendError(f"damaged training state: param_groups[{n}] holds other parameters than this run's "
                               f"optimizer ({len(ours['params'])} parameters); {_OLDER}",
                               source=source)
        for key, value in ours.items():
            # the rate itself is the schedule's at the state's step (train/lr.py sets it again from the step)
            if (key not in ("params", "lr", "initial_lr", *evolving) and key in theirs
                    and not _same(theirs[key], value)):
                raise BackendError(f"damaged training state: param_groups[{n}] has {key} {_shown(theirs[key])}, this "
                                   f"run's optimizer {_shown(value)}; {_OLDER}", source=source)
        for key in evolving:
            if key in theirs and not (_number(theirs[key]) or isinstance(theirs[key], bool)):
                raise BackendError(f"damaged training state: param_groups[{n}] has {key} {_shown(theirs[key])}, not a "
                                   f"finite number; {_OLDER}", source=source)
    return [{**ours, **{key: theirs[key] for key in evolving if key in theirs}} for theirs, ours in zip(saved, current)]


def _check_digests(path: Path, record: dict[str, Any]) -> None:
    for name in record["files"]:
        file = path / name
        if not file.is_file():
            raise BackendError(f"damaged training state: the file is missing (or not a regular file); {_OLDER}",
                               source=str(file))
        try:
            digest = sha256_file(file)
        except OSError as exc:
            raise BackendError(f"cannot read: {exc.strerror or exc}", source=str(file)) from None
        if digest != record["files"][name]:
            raise BackendError(f"damaged: does not match the sha256 that state.json records for it; {_OLDER}",
                               source=str(file))


def _check_trained(path: Path, header: Header, params: dict[str, Any]) -> None:
    source = str(path / TRAINED_FILE)
    missing = sorted(set(params) - set(header.tensors))
    extra = sorted(set(header.tensors) - set(params))
    if missing or extra:
        example = (f"{missing[0]} is trained in this run, not in the state" if missing
                   else f"{extra[0]} is in the state, not trained in this run")
        raise BackendError(f"the state's trained parameters differ from this run's ({len(missing)} missing, "
                           f"{len(extra)} unknown; e.g. {example}); check --lora_base_model/--lora_target_modules/"
                           f"--trainable_models, or {_OLDER}", source=source)
    _check_shapes(header, params, source)


def _check_shapes(header: Header, params: dict[str, Any], source: str) -> None:
    """Each tensor of the file (the trained weights, or their moving average) has its parameter's shape and dtype."""
    for name, param in params.items():
        info = header.tensors[name]
        if info.shape != tuple(param.shape) or info.dtype != dtype_code(param.dtype):
            raise BackendError(f"damaged training state: tensor {name} is {info.describe()}, the trained parameter "
                               f"{list(param.shape)} {str(param.dtype).removeprefix('torch.')}; {_OLDER}", source=source)


def _check_optimizer(path: Path, header: Header, opt: Any, file: str = OPTIMIZER_FILE,
                     scalars: Optional[dict[str, Any]] = None) -> dict[int, dict[str, Any]]:
    """Every tensor of optimizer.safetensors, and every number of state.json's optimizer_scalars, is a piece of the
    state the optimizer keeps for one of its parameters (optimizers.state_layout: AdamW's step, first and second
    moments, each moment of the parameter's shape and dtype; Adafactor's row and column factors; ...); each
    parameter's state is whole. Returns {parameter index: {piece: TensorInfo or number}}."""
    source = str(path / file)
    flat = [(p, group) for group in opt.param_groups for p in group["params"]]
    found: dict[int, dict[str, Any]] = {}
    for name, value in [*header.tensors.items(), *(scalars or {}).items()]:
        where = source if isinstance(value, TensorInfo) else str(path / STATE_JSON)
        key = _OPTIMIZER_KEY.fullmatch(name)
        if key is None:
            raise BackendError(f"damaged training state: optimizer piece {name[:60]!r} is not <parameter index>.<state "
                               f"name>; {_OLDER}", source=where)
        index = int(key.group(1))
        if index >= len(flat):
            raise BackendError(f"damaged training state: tensor {name} is for parameter {index}, this run's optimizer "
                               f"has {len(flat)}; {_OLDER}", source=where)
        if key.group(2) in found.get(index, {}):
            raise BackendError(f"damaged training state: {name} is both a tensor and a number; {_OLDER}", source=where)
        found.setdefault(index, {})[key.group(2)] = value
    for index, pieces in sorted(found.items()):
        param, group = flat[index]
        layout = state_layout(opt, tuple(param.shape), group)
        if layout is not None and set(pieces) != set(layout):
            wrong = sorted(set(pieces) - set(layout))
            kind = "tensor" if wrong and isinstance(pieces[wrong[0]], TensorInfo) else "number"
            what = (f"an unknown {kind} {index}.{wrong[0]}" if wrong
                    else f"no {index}.{sorted(set(layout) - set(pieces))[0]}")
            raise BackendError(f"damaged training state: parameter {index} has {what} ({type(opt).__name__} keeps "
                               f"{', '.join(sorted(layout))}); {_OLDER}", source=source)
        for piece, info in pieces.items():
            kind = layout[piece] if layout is not None else None
            if kind == COUNT or not isinstance(info, TensorInfo):
                if kind not in (COUNT, None) or isinstance(info, TensorInfo) or isinstance(info, bool) \
                        or not _number(info) or (kind == COUNT and not isinstance(info, int)):
                    shown = info.describe() if isinstance(info, TensorInfo) else _shown(info)
                    raise BackendError(f"damaged training state: {index}.{piece} is {shown}, not "
                                       + ("a step count in state.json" if kind == COUNT else "a tensor") + f"; {_OLDER}",
                                       source=str(path / STATE_JSON))
            elif kind == STEP:
                if info.shape != () or not info.floating:
                    raise BackendError(f"damaged training state: tensor {index}.step is {info.describe()}, not a "
                                       f"single floating number; {_OLDER}", source=source)
            elif kind is not None and (info.shape not in [tuple(s) for s in kind]
                                       or info.dtype != dtype_code(param.dtype)):
                raise BackendError(f"damaged training state: tensor {index}.{piece} is {info.describe()}, its parameter "
                                   f"{list(param.shape)} {str(param.dtype).removeprefix('torch.')}; {_OLDER}",
                                   source=source)
    return found


def check_state(path: Path, params: dict[str, Any], optimizer: Any, match: dict[str, Any],
                rank: int = 0) -> CheckedState:
    """Read the state in `path` whole and check all of it against this run (see the module docstring); nothing
    is changed. A BackendError naming the file at fault otherwise. `rank` reads that process's own optimizer file
    in a state that keeps one per process (`rank_file`; DeepSpeed)."""
    path = Path(path)
    record = _read_record(path)
    file = rank_file(rank) if any(_RANK_FILE.fullmatch(n) for n in record["files"]) else OPTIMIZER_FILE
    if file not in record["files"]:
        raise BackendError(f"the state has no optimizer file for process {rank} (made with fewer processes); {_OLDER}",
                           source=str(path / STATE_JSON))
    _check_match(path, record, match)
    opt = _optimizer(optimizer)
    groups = _check_param_groups(path, record["param_groups"], opt.state_dict()["param_groups"],
                                 evolving_group_keys(opt))
    _check_digests(path, record)
    trained_header = read_header(path / TRAINED_FILE)
    optimizer_header = read_header(path / file)
    _check_trained(path, trained_header, params)
    pieces = _check_optimizer(path, optimizer_header, opt, file, record.get("optimizer_scalars"))
    weights = load_tensors(path / TRAINED_FILE, trained_header, str(path / TRAINED_FILE))
    bad = next((name for name, tensor in weights.items() if not finite(tensor)), None)
    if bad is not None:
        raise BackendError(f"damaged training state: {bad} holds NaN or infinite values; {_OLDER}",
                           source=str(path / TRAINED_FILE))
    tensors = load_tensors(path / file, optimizer_header, str(path / file))
    state: dict[int, dict[str, Any]] = {}
    for index, names in sorted(pieces.items()):
        for piece, info in names.items():
            if not isinstance(info, TensorInfo):  # a number of state.json (checked in _check_optimizer)
                if piece == "step" and not 0 <= info <= record["step"]:
                    raise BackendError(f"damaged training state: {index}.step is not a step count of "
                                       f"0..{record['step']}; {_OLDER}", source=str(path / STATE_JSON))
                state.setdefault(index, {})[piece] = info
                continue
            value = tensors[f"{index}.{piece}"]
            if piece == "step":
                count = float(value)
                ok = math.isfinite(count) and count == int(count) and 0 <= count <= record["step"]
                what = f"a step count of 0..{record['step']}"
            else:
                ok = finite(value) and (not piece.endswith("_sq") or bool((value >= 0).all()))
                what = "finite" + (" and >= 0" if piece.endswith("_sq") else "")
            if not ok:
                raise BackendError(f"damaged training state: tensor {index}.{piece} is not {what}; {_OLDER}",
                                   source=str(path / file))
            state.setdefault(index, {})[piece] = value
    per_epoch = record["match"].get("steps_per_epoch")
    point = ResumePoint(path=path, step=record["step"], epoch=record["epoch"], position=record["position"],
                        elapsed=float(record["elapsed_s"]), offset=int(record.get("step_offset", 0)),
                        per_epoch=per_epoch if _count(per_epoch) else None, processes=record["match"].get("processes"),
                        epoch_done=record["position"] == per_epoch,
                        rows=[[r[0], r[1], float(r[2]), float(r[3]), None if r[4] is None else float(r[4]),
                               *([None if r[5] is None else float(r[5])] if len(r) > 5 else [])]
                              for r in record["loss_rows"]])
    ema, ema_step = _check_ema(path, record, params) if match.get("ema_decay") is not None else (None, 0)
    return CheckedState(point, weights, state, groups, ema, ema_step)


def _check_ema(path: Path, record: dict[str, Any], params: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The state's moving average (--ema_decay: the match says the state has one): a tensor of each trained
    parameter's name, shape and dtype, finite, and the steps it averaged, one a step."""
    source = str(path / EMA_FILE)
    if EMA_FILE not in record["files"]:
        raise BackendError(f"damaged training state: no {EMA_FILE} though the run kept a moving average "
                           f"(--ema_decay); {_OLDER}", source=str(path / STATE_JSON))
    step = record.get("ema_step")
    if not (_count(step) and step == record["step"]):
        raise BackendError(f"damaged training state: field 'ema_step' is {_shown(step)}, not the state's step "
                           f"{record['step']}; {_OLDER}", source=str(path / STATE_JSON))
    header = read_header(path / EMA_FILE)
    if set(header.tensors) != set(params):
        raise BackendError(f"damaged training state: the moving average holds other parameters than this run trains "
                           f"({len(header.tensors)}, this run {len(params)}); {_OLDER}", source=source)
    _check_shapes(header, params, source)
    tensors = load_tensors(path / EMA_FILE, header, source)
    bad = next((name for name, tensor in tensors.items() if not finite(tensor)), None)
    if bad is not None:
        raise BackendError(f"damaged training state: {bad} holds NaN or infinite values; {_OLDER}", source=source)
    return tensors, step


def apply_state(checked: CheckedState, params: dict[str, Any], optimizer: Any, scatter: Any = None,
                restore: Any = None) -> ResumePoint:
    """Restore a checked state into the trained weights and the optimizer; the point to continue from.

    `scatter(whole, like)` lays a whole tensor out as `like` is (its shard of it under FSDP2); `restore(params,
    weights)`, when given, sets the weights instead (DeepSpeed's partitions and their fp32 copies)."""
    import torch

    scatter = scatter or (lambda value, like: value.to(like.device, like.dtype))
    with torch.no_grad():
        if restore is not None:
            restore(params, checked.weights)
        else:
            for name, param in params.items():
                param.copy_(scatter(checked.weights[name], param))
    opt = _optimizer(optimizer)
    flat = [p for group in opt.param_groups for p in group["params"]]
    state = {index: {piece: (scatter(value, flat[index]) if piece != "step" and isinstance(value, torch.Tensor)
                             and value.shape == flat[index].shape else value) for piece, value in pieces.items()}
             for index, pieces in checked.optimizer_state.items()}
    opt.load_state_dict({"state": state, "param_groups": checked.param_groups})
    return checked.point


def load_state(path: Path, params: dict[str, Any], optimizer: Any, match: dict[str, Any]) -> ResumePoint:
    """Restore trained weights and optimizer state from `path`, all of it checked first (`check_state`: a
    refused state changes nothing); the point to continue from."""
    return apply_state(check_state(path, params, optimizer, match), params, optimizer)

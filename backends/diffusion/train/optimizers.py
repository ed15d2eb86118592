"""The optimizers a run may train with (`--optimizer`, `--optimizer_args`), each from the library that keeps it.

Why a registry of a few names rather than a class path on the command line (DiffSynth's --customized_optimizer):
a name says which library is needed (one line naming it when it is missing), which arguments its constructor takes
(checked against its signature before anything is written), what it keeps per parameter (so a training state is
checked piece by piece and resumed exactly: `state_layout`, `evolving_group_keys`) and how many bytes that is (the
dry run's memory plan: `state_bytes`). AdamW, the default, is torch's own, built exactly as before.

| name         | library (class)                            | kept per trained parameter (fp32)      | bytes  |
|--------------|--------------------------------------------|----------------------------------------|--------|
| adamw        | torch (torch.optim.AdamW)                  | exp_avg, exp_avg_sq                    | 8      |
| adamw8bit    | bitsandbytes (AdamW8bit), CUDA only        | two uint8 moments, an absmax per 256   | 2.03 * |
| adafactor    | transformers (Adafactor)                   | a matrix's row and column factors      | ~0 **  |
| prodigy      | prodigyopt (Prodigy)                       | exp_avg, exp_avg_sq, s, p0             | 16     |
| came         | came_pytorch (CAME)                        | exp_avg, four row and column factors   | ~4 **  |
| schedulefree | schedulefree (AdamWScheduleFree)           | z, exp_avg_sq                          | 8      |

 * 8 for a tensor of fewer than 4096 values (kept in fp32). ** 4 (rows + cols) bytes a matrix per factor (0.126 a
value of a rank-32 LoRA matrix for Adafactor); a vector keeps a whole second moment (Adafactor 4, CAME 8).

The bytes were measured by building each optimizer on a 64 x 32 matrix and a 32-vector and stepping it twice
(bitsandbytes' from its source: it needs CUDA). --optimizer_args is `key=value,key=value`: each value a JSON
literal (1e-3, 0, true, false, null) or a string, a sequence written with colons (betas=0.9:0.999). --learning_rate
and --weight_decay are the rate and the decay of every optimizer, so `lr` and `weight_decay` are not among them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ..errors import BackendError

__all__ = ["OPTIMIZERS", "OptimizerSpec", "build_optimizer", "check_optimizer", "evolving_group_keys",
           "optimizer_label", "name_of", "parse_optimizer_args", "state_bytes", "state_layout", "eval_weights", "COUNT",
           "STEP"]


@dataclass(frozen=True)
class OptimizerSpec:
    """One --optimizer: where its class lives, the package to install, its defaults and what it needs."""

    name: str
    label: str  # as the dry run's table names it
    module: str
    attr: str
    package: str  # pip's name
    defaults: tuple[tuple[str, Any], ...] = ()
    cuda: bool = False  # runs on CUDA devices only
    schedule_free: bool = False  # keeps two weight sequences: optimizer.train() and .eval() around training and saving
    # why it does not train under FSDP2 (None: it does, its state all of its parameters' shapes, sharded as they are)
    not_sharded: Optional[str] = None


OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adamw", "AdamW", "torch.optim", "AdamW", "torch"),
    OptimizerSpec("adamw8bit", "AdamW8bit", "bitsandbytes.optim", "AdamW8bit", "bitsandbytes", cuda=True,
                  not_sharded="its quantized state is not laid out in FSDP2's shards here"),
    OptimizerSpec("adafactor", "Adafactor", "transformers.optimization", "Adafactor", "transformers",
                  defaults=(("relative_step", False), ("scale_parameter", False), ("warmup_init", False)),
                  not_sharded="its step mixes plain tensors with FSDP2's sharded ones (transformers' RuntimeError)"),
    OptimizerSpec("prodigy", "Prodigy", "prodigyopt", "Prodigy", "prodigyopt",
                  not_sharded="its flattened state (s, p0) is not laid out in FSDP2's shards when a state resumes"),
    OptimizerSpec("came", "CAME", "came_pytorch", "CAME", "came-pytorch",
                  not_sharded="its step mixes plain tensors with FSDP2's sharded ones (came-pytorch's RuntimeError)"),
    OptimizerSpec("schedulefree", "ScheduleFree", "schedulefree", "AdamWScheduleFree", "schedulefree",
                  schedule_free=True),
)}
# the settings unitgraph's own flags give every optimizer
OWN_FLAGS = {"lr": "--learning_rate", "weight_decay": "--weight_decay", "params": "the trained parameters"}
# Adafactor's settings that hand the rate to Adafactor itself, which --lr_scheduler would then not drive
SELF_RATED = {"relative_step": True, "warmup_init": True}


def _literal(text: str) -> Any:
    """A JSON literal (numbers, true/false/null; NaN and Infinity are not JSON), or the text as a string; True,
    False and None as Python writes them too."""
    python = {"True": True, "False": False, "None": None}
    if text in python:
        return python[text]

    def refuse(name: str) -> Any:
        raise ValueError(name)

    try:
        value = json.loads(text, parse_constant=refuse)
    except ValueError:
        return text
    return value if isinstance(value, (int, float, bool)) or value is None else text


def parse_optimizer_args(text: Optional[str]) -> dict[str, Any]:
    """--optimizer_args `key=value,key=value` as {key: value} (the module docstring); BackendError on a malformed
    pair, a key given twice, or one of the settings unitgraph's flags give."""
    out: dict[str, Any] = {}
    if text is None or not str(text).strip():
        return out
    for pair in str(text).split(","):
        key, eq, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key.isidentifier() or not value:
            raise BackendError(f"--optimizer_args: {pair.strip()!r} is not key=value (write key=value,key=value; a "
                               "sequence with colons: betas=0.9:0.999)")
        if key in out:
            raise BackendError(f"--optimizer_args: {key} is given twice")
        if key in OWN_FLAGS:
            raise BackendError(f"--optimizer_args: {key} is set by {OWN_FLAGS[key]}, not here")
        out[key] = [_literal(v.strip()) for v in value.split(":")] if ":" in value else _literal(value)
    return out


def _class(spec: OptimizerSpec) -> Any:
    """The optimizer's class, or BackendError naming the package to install."""
    top = spec.module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise BackendError(f"--optimizer {spec.name} needs the {spec.package} package: pip install {spec.package} "
                           f"(or unitgraph's {'adamw8bit' if spec.cuda else 'optimizers'} extra)")
    try:
        return getattr(importlib.import_module(spec.module), spec.attr)
    except (ImportError, AttributeError) as exc:  # pragma: no cover - a broken or too old install
        raise BackendError(f"--optimizer {spec.name}: cannot import {spec.module}.{spec.attr} ({exc}); reinstall "
                           f"{spec.package}") from None


def _settings(spec: OptimizerSpec, args: dict[str, Any], lr: float, weight_decay: float) -> dict[str, Any]:
    """The constructor's keyword arguments: the spec's defaults, the rate and decay, then --optimizer_args."""
    return {**dict(spec.defaults), "lr": lr, "weight_decay": weight_decay, **args}


def check_optimizer(name: str, args_text: Optional[str], cuda: Any = None) -> dict[str, Any]:
    """The run's optimizer settings checked before anything is written: a known name, well-formed arguments that its
    constructor takes, its library installed, a CUDA device for a CUDA-only one (`cuda`: a bool or a function giving
    it; None: a run that trains nothing here, the dry run or stage 1, for which neither the device nor the library
    is needed: the arguments are checked when the library is there); and, all set, the optimizer built on a small
    parameter and stepped once, so a value of the wrong kind is one line too. Returns the parsed arguments."""
    if name not in OPTIMIZERS:
        raise BackendError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    spec, args = OPTIMIZERS[name], parse_optimizer_args(args_text)
    for key, value in SELF_RATED.items():
        if name == "adafactor" and args.get(key) == value:
            raise BackendError(f"--optimizer_args {key}=true: Adafactor would then set its own rate, which "
                               "--learning_rate and --lr_scheduler give here; leave it false")
    if spec.cuda and cuda is not None and not (cuda() if callable(cuda) else cuda):
        raise BackendError(f"--optimizer {name} runs on CUDA devices only ({spec.package}'s 8-bit optimizer) and this "
                           f"run has none: train on a GPU with unitgraph's adamw8bit extra (pip install "
                           f"{spec.package}), or use --optimizer adamw")
    if spec.name == "adamw" and not args:
        return args
    if cuda is None and importlib.util.find_spec(spec.module.split(".")[0]) is None:
        return args  # planned only (the dry run, stage 1): the library is needed where the run trains
    cls = _class(spec)
    taken = inspect.signature(cls.__init__).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in taken.values()):
        unknown = sorted(set(args) - set(taken))
        if unknown:
            known = sorted(k for k in taken if k not in ("self", *OWN_FLAGS))
            raise BackendError(f"--optimizer_args: {spec.label} takes no argument {unknown[0]!r} (it takes "
                               f"{', '.join(known)})")
    if spec.cuda:
        return args  # built on the run's CUDA device only
    import torch

    param = torch.nn.Parameter(torch.ones(2, 2))
    try:
        optimizer = build_optimizer(name, args, [param], 1e-4, 0.0)
        param.grad = torch.full_like(param, 0.5)
        optimizer.step()
    except Exception as exc:  # the library's own message about a value it cannot take
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise BackendError(f"--optimizer_args: {spec.label} refuses them: {type(exc).__name__}: {text[:200]}") from None
    return args


def build_optimizer(name: str, args: dict[str, Any], params: list[Any], lr: float, weight_decay: float) -> Any:
    """The optimizer `name` over `params` at --learning_rate `lr` and --weight_decay, with its --optimizer_args; a
    schedule-free optimizer is put in training mode, as it must be before a step."""
    spec = OPTIMIZERS[name]
    if name == "adamw" and not args:  # exactly as unitgraph always built it
        import torch

        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    optimizer = _class(spec)(params, **_settings(spec, args, lr, weight_decay))
    if spec.schedule_free:
        optimizer.train()
    return optimizer


def optimizer_label(name: str) -> str:
    return OPTIMIZERS[name].label if name in OPTIMIZERS else name


# ------------------------------------------------------------------------------------------------
# what each optimizer keeps: for training states (train/resume.py) and the memory plan

Shape = tuple[int, ...]
COUNT = "count"  # a step count kept as a Python int (JSON in a state)
STEP = "step"  # a step count kept as a 0-dim floating tensor (torch's AdamW)


def _class_name(optimizer: Any) -> str:
    return f"{type(optimizer).__module__.split('.')[0]}.{type(optimizer).__name__}"


_NAMES = {"torch.AdamW": "adamw", "torch.Adam": "adamw", "bitsandbytes.AdamW8bit": "adamw8bit",
          "transformers.Adafactor": "adafactor", "prodigyopt.Prodigy": "prodigy", "came_pytorch.CAME": "came",
          "schedulefree.AdamWScheduleFree": "schedulefree"}


def name_of(optimizer: Any) -> Optional[str]:
    """The --optimizer name of an optimizer object (None for one unitgraph does not build)."""
    return _NAMES.get(_class_name(optimizer))


def _factored(shape: Shape) -> bool:
    return len(shape) >= 2


def _rows_cols(shape: Shape) -> tuple[Shape, Shape]:
    return tuple(shape[:-1]), tuple(shape[:-2]) + tuple(shape[-1:])


def state_layout(optimizer: Any, shape: Shape, group: dict[str, Any]) -> Optional[dict[str, Any]]:
    """What `optimizer` keeps for a parameter of `shape` in `group`: {piece: COUNT | STEP | [allowed shapes]}, or
    None when unknown (bitsandbytes: its quantized pieces are checked as tensors only)."""
    name = name_of(optimizer)
    shape = tuple(shape)
    if name == "adamw":
        return {"step": STEP, "exp_avg": [shape], "exp_avg_sq": [shape],
                **({"max_exp_avg_sq": [shape]} if group.get("amsgrad") else {})}
    if name in ("adafactor", "came"):
        out: dict[str, Any] = {"step": COUNT, "RMS": [()]}
        if name == "came" or group.get("beta1") is not None:
            out["exp_avg"] = [shape]
        if _factored(shape):
            rows, cols = _rows_cols(shape)
            out.update(exp_avg_sq_row=[rows], exp_avg_sq_col=[cols])
            if name == "came":
                out.update(exp_avg_res_row=[rows], exp_avg_res_col=[cols])
        else:
            out["exp_avg_sq"] = [shape]
        return out
    if name == "prodigy":
        sliced = (math.ceil(math.prod(shape) / int(group.get("slice_p", 1))),)
        out = {"step": COUNT, "s": [sliced], "p0": [sliced, ()], "exp_avg_sq": [shape]}  # p0: () for an all-zero start
        if group.get("betas", (0.9,))[0] > 0:
            out["exp_avg"] = [shape]
        return out
    if name == "schedulefree":
        return {"z": [shape], "exp_avg_sq": [shape]}
    return None


# the param-group values an optimizer changes as it steps: restored from a state, not compared with this run's
_EVOLVING = {"prodigy": ("d", "d_max", "d_numerator", "d_denom", "d_hat", "k"),
             "schedulefree": ("k", "weight_sum", "lr_max", "scheduled_lr", "train_mode")}


def evolving_group_keys(optimizer: Any) -> tuple[str, ...]:
    return _EVOLVING.get(name_of(optimizer) or "", ())


def state_bytes(name: str, args: dict[str, Any], shape: Shape) -> int:
    """Bytes of what optimizer `name` keeps for one fp32 parameter of `shape` (the module docstring's table; a step
    count or RMS scalar of a few bytes left out, as for AdamW)."""
    n = math.prod(shape)
    if name in ("adamw", "schedulefree"):
        return 8 * n
    if name == "adamw8bit":
        if n < int(args.get("min_8bit_size", 4096)):
            return 8 * n
        return 2 * n + 2 * 4 * math.ceil(n / 256)
    if name in ("adafactor", "came"):
        first = 4 * n if (name == "came" or args.get("beta1") is not None) else 0
        if _factored(tuple(shape)):
            rows, cols = _rows_cols(tuple(shape))
            return first + 4 * (math.prod(rows) + math.prod(cols)) * (2 if name == "came" else 1)
        return first + 4 * n
    if name == "prodigy":
        betas = args.get("betas") or (0.9,)
        sliced = math.ceil(n / int(args.get("slice_p", 1)))
        return 4 * n + (4 * n if betas[0] > 0 else 0) + 8 * sliced
    raise KeyError(name)


# ------------------------------------------------------------------------------------------------
# schedule-free optimizers: the averaged weights for checkpoints and samples


def _schedule_free(optimizer: Any) -> Any:
    from .engines import base_optimizer

    inner = base_optimizer(optimizer)
    return inner if name_of(inner) == "schedulefree" else None


@contextlib.contextmanager
def eval_weights(optimizer: Any) -> Iterator[None]:
    """Within it a schedule-free optimizer's parameters hold its averaged weights (optimizer.eval()), as a checkpoint
    and a validation sample must show them; after it, the training weights again (optimizer.train(): both runs of a
    comparison, and a resumed run, make the same switches at the same steps). Nothing for any other optimizer."""
    inner = _schedule_free(optimizer)
    if inner is None:
        yield
        return
    inner.eval()
    try:
        yield
    finally:
        inner.train()

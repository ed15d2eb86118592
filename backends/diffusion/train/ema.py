"""The exponential moving average of the trained weights (`--ema_decay`, `--ema_device`, `--validation_use_ema`).

Why not diffusers' `EMAModel` itself: its shadow weights must sit on the parameters' device (its step subtracts one
from the other), so `--ema_device cpu` beside a GPU run does not fit it, and its `state_dict` is a dict for
torch.save. This is the same average, number for number (tests/test_ema.py compares it with `EMAModel(decay=D)` on
the same device): after optimizer step n every trained parameter's shadow s becomes s - (1 - d_n) (s - p), with
diffusers' default decay schedule d_n = min(D, (n' + 1) / (n' + 10)) at n' = n - 1 (0 at the first step: the shadow
starts as the weights after it), kept by name so that it is saved as tensors (safetensors) and its step count as
JSON.

The average is updated after every optimizer step on every process (each holds every trained weight whole after the
step under data parallel and ZeRO-1/2; under FSDP2 each keeps the shadows of its shards, which a state and a
checkpoint gather whole; ZeRO-3 refuses it), saved in each training state (`ema.safetensors`, resumed exactly), written beside each checkpoint as `<checkpoint>-ema.safetensors` in the
checkpoint's own layout, and, with --validation_use_ema, swapped into the models while validation samples render.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

__all__ = ["EMA_SUFFIX", "TrainedEMA", "ema_decay", "ema_name", "optional_swap"]

EMA_SUFFIX = "-ema"  # step-4.safetensors -> step-4-ema.safetensors


def ema_name(checkpoint: str) -> str:
    """The EMA file beside checkpoint `checkpoint` (a file name ending in .safetensors)."""
    stem = checkpoint[: -len(".safetensors")] if checkpoint.endswith(".safetensors") else checkpoint
    return f"{stem}{EMA_SUFFIX}.safetensors"


def ema_decay(decay: float, step: int) -> float:
    """diffusers' EMAModel.get_decay with its defaults (no warm-up power, update_after_step 0, min_decay 0)."""
    n = max(0, step - 1)
    if n <= 0:
        return 0.0
    return max(min((1 + n) / (10 + n), decay), 0.0)


class TrainedEMA:
    """The shadow of every trained parameter ({"<slot>/<name>": tensor}, train/resume.trained_parameters' names) on
    `device`, and the optimizer steps it has averaged."""

    def __init__(self, params: dict[str, Any], decay: float, device: Any):
        self.decay, self.device, self.step = float(decay), torch.device(device), 0
        with torch.no_grad():
            self.shadow = {name: p.detach().to(self.device, copy=True) for name, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, Any]) -> None:
        """After an optimizer step: each shadow moves towards its parameter by 1 - the step's decay."""
        self.step += 1
        one_minus_decay = 1 - ema_decay(self.decay, self.step)
        for name, param in params.items():
            shadow = self.shadow[name]
            value = param.detach()
            if value.device != shadow.device:
                value = value.to(shadow.device)
            shadow.sub_(one_minus_decay * (shadow - value))

    def tensors(self, full: Any = None) -> dict[str, torch.Tensor]:
        """The shadows whole on the CPU, by name (for a training state); `full(tensor)` makes a shard whole (FSDP2's
        gather: every process calls it, in the shadows' order)."""
        if full is None:
            return {name: s.detach().to("cpu").contiguous().clone() for name, s in self.shadow.items()}
        return {name: full(s) for name, s in self.shadow.items()}

    def restore(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Set the shadows and the step count from a checked training state (each process its rows of a sharded
        shadow: it has the parameter's placement)."""
        from ..models.shards import local_rows

        with torch.no_grad():
            for name, value in tensors.items():
                shadow = self.shadow[name]
                local = shadow.to_local() if hasattr(shadow, "to_local") else shadow
                rows = local_rows(shadow, local)
                local.copy_((value if rows is None else value[rows]).to(local.device, local.dtype))
        self.step = int(step)

    def by_slot(self, slots: list[str], full: Any = None) -> dict[str, dict[str, torch.Tensor]]:
        """{slot: {parameter name: shadow}}, as train/checkpoints.checkpoint_state takes trained tensors; `full` as in
        `tensors`."""
        out: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in slots}
        for key, value in self.shadow.items():
            slot, _, name = key.partition("/")
            if slot in out:
                out[slot][name] = value.detach() if full is None else full(value)
        return out

    @contextlib.contextmanager
    def swapped_in(self, params: dict[str, Any]) -> Iterator[None]:
        """The models hold the averaged weights within it (validation samples with --validation_use_ema); the
        trained weights, bit for bit, after it."""
        with torch.no_grad():
            kept = {name: p.detach().clone() for name, p in params.items()}
            for name, p in params.items():
                p.copy_(self.shadow[name].to(p.device, p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(kept[name])


def optional_swap(ema: Optional[TrainedEMA], params: dict[str, Any], use: bool) -> Any:
    """`ema.swapped_in(params)` when `use`, else nothing."""
    return ema.swapped_in(params) if (ema is not None and use) else contextlib.nullcontext()

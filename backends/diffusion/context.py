"""What a unit may use while it runs: loaded models, the settings it declared, randomness per sample.

`UnitSettings` holds every value a unit can read (the names of `family.SETTINGS`), built once from
the flags. `key_values(names)` is what a stage-1 cache key records of them: the settings a unit
declares are exactly what its cached outputs may depend on besides its inputs and model weights.
"""

from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .randomness import generator

DTYPE = "float32"  # the compute dtype of --mixed_precision no (a RunConfig carries the run's own)
CACHE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --cache_dtype values -> torch names


@dataclass(frozen=True)
class ImageSize:
    """--height/--width (fixed) or --max_pixels (scaled down, aspect kept); sides multiples of `multiple`."""

    height: Optional[int] = None
    width: Optional[int] = None
    max_pixels: int = 1024 * 1024

    def target(self, width: int, height: int, multiple: int) -> tuple[int, int]:
        """(width, height) an image of this size is resized to."""
        if self.height is not None and self.width is not None:
            return self.width, self.height
        scale = min(1.0, math.sqrt(self.max_pixels / float(width * height)))
        w = max(multiple, int(width * scale) // multiple * multiple)
        h = max(multiple, int(height * scale) // multiple * multiple)
        return w, h

    def key(self) -> dict[str, Any]:
        if self.height is not None and self.width is not None:
            return {"height": self.height, "width": self.width}  # --max_pixels is then unused
        return {"max_pixels": self.max_pixels}


@dataclass(frozen=True)
class UnitSettings:
    """Every setting a unit can read, by the names units declare (family.SETTINGS)."""

    image_size: ImageSize = field(default_factory=ImageSize)
    seed: int = 0
    timestep_bounds: tuple[float, float] = (0.0, 1.0)
    dtype: str = DTYPE
    cache_dtype: str = DTYPE  # the dtype stage 1 stores floating tensors in
    loss_weighting: str = "diffsynth"  # --weighting_scheme: the timestep sampler's loss weight (flowmatch.py)
    # --timestep_sampling and its parameters: how the timestep sampler draws a position (flowmatch.TimestepSampling)
    timestep_sampling: Any = None
    snr_gamma: Optional[float] = None  # --snr_gamma: Min-SNR weighting of the DDPM families (ddpm.py)
    caption_dropout: float = 0.0  # --caption_dropout: the probability a sample's caption is dropped (caption_dropout.py)
    masked_loss: Optional[float] = None  # with --masked_loss, the weight of what the mask leaves out (masked_loss.py)
    # the pipeline's derived inputs --extra_inputs names: DiffSynth computes such an input (a clip's first frame as
    # `input_image`) only when asked, and what is trained changes with it
    derived_inputs: tuple[str, ...] = ()

    def key_values(self, names: Any = None) -> dict[str, Any]:
        """JSON values of the named settings (all when None), as a cache key records them.

        `cache_dtype` is left out when it is the compute dtype, so caches made before --cache_dtype
        existed keep their keys.
        """
        everything: dict[str, Any] = {"image_size": self.image_size.key(), "dtype": self.dtype, "seed": self.seed,
                                      "timestep_bounds": list(self.timestep_bounds),
                                      "loss_weighting": self.loss_weighting}
        if self.cache_dtype != self.dtype:
            everything["cache_dtype"] = self.cache_dtype
        if self.derived_inputs:  # left out when none is asked for, so keys made before it existed still match
            everything["derived_inputs"] = sorted(self.derived_inputs)
        # each left out at its default, so states and keys made before it existed still match
        if self.timestep_sampling is not None and self.timestep_sampling.scheme != "diffsynth":
            everything["timestep_sampling"] = self.timestep_sampling.key()
        if self.snr_gamma is not None:
            everything["snr_gamma"] = self.snr_gamma
        if self.caption_dropout:
            everything["caption_dropout"] = self.caption_dropout
        if self.masked_loss is not None:
            everything["masked_loss"] = {"unmasked_weight": self.masked_loss}
        wanted = everything if names is None else set(names)
        return {name: everything[name] for name in sorted(wanted) if name in everything}


def describe_setting(name: str, value: Any) -> str:
    """A recorded setting value as the flags that give it, for messages."""
    if name == "image_size" and isinstance(value, dict):
        if "max_pixels" in value:
            return f"--max_pixels {value['max_pixels']}"
        return f"--height {value.get('height')} --width {value.get('width')}"
    if name == "timestep_bounds" and isinstance(value, list) and len(value) == 2:
        return f"--min_timestep_boundary {value[0]} --max_timestep_boundary {value[1]}"
    if name == "seed":
        return f"--seed {value}"
    if name == "loss_weighting":
        return f"--weighting_scheme {value}"
    if name == "timestep_sampling" and isinstance(value, dict):
        return " ".join([f"--timestep_sampling {value.get('scheme')}",
                         *(f"--{k} {v}" for k, v in value.items() if k != "scheme")])
    if name == "snr_gamma":
        return f"--snr_gamma {value}"
    if name == "caption_dropout":
        return f"--caption_dropout {value}"
    if name == "masked_loss" and isinstance(value, dict):
        return f"--masked_loss --masked_loss_unmasked_weight {value.get('unmasked_weight')}"
    if name == "derived_inputs":
        return f"--extra_inputs {','.join(value)}" if value else "no derived --extra_inputs"
    if name == "cache_dtype":
        flags = {v: k for k, v in CACHE_DTYPES.items()}
        return f"--cache_dtype {flags.get(value or DTYPE, value)}"  # absent: the model's dtype
    if name == "fp8_models":
        return f"--fp8_models {','.join(value)}" if value else "no --fp8_models"
    if name == "dtype":
        flags = {"float32": "no", "float16": "fp16", "bfloat16": "bf16"}
        return f"--mixed_precision {flags.get(value, value)}"
    return f"{name} {value}"


@dataclass
class UnitContext:
    """What a unit may use: loaded models by slot, settings, device, and randomness for (seed, epoch, sample).

    `memo` lets a unit keep derived values (a scheduler's sigmas) across samples; a copy of the
    context made for another thread starts with an empty one.
    """

    models: dict[str, Any]
    settings: UnitSettings = field(default_factory=UnitSettings)
    device: Any = "cpu"
    epoch: Optional[int] = None
    sample_key: Optional[str] = None
    memo: dict = field(default_factory=dict)
    # slot -> its configuration, for the models units read the config of without calling (unit `configs`);
    # called at most once per slot and context, only when a unit asks
    config_loader: Optional[Callable[[str], Any]] = None
    # the prompt units' outputs for the empty prompt, which CaptionDropout puts in place of a dropped caption's
    # (caption_dropout.py); set by the training run, None elsewhere
    empty_prompt: Optional[dict] = None

    @property
    def size(self) -> ImageSize:
        return self.settings.image_size

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def timestep_bounds(self) -> tuple[float, float]:
        return self.settings.timestep_bounds

    @property
    def dtype(self) -> Any:
        import torch

        return getattr(torch, self.settings.dtype)

    def autocast(self) -> Any:
        """The autocast every unit and the loss run under (models/precision.py): the compute dtype, or nothing at fp32.
        The same in every stage, so a value computed in stage 1 is the one the unsplit run computes."""
        if self.settings.dtype == "float32":
            return contextlib.nullcontext()
        import torch

        kind = getattr(self.device, "type", None) or str(self.device).split(":")[0]
        return torch.autocast(kind, dtype=getattr(torch, self.settings.dtype))

    def model(self, slot: str) -> Any:
        if slot not in self.models:
            raise RuntimeError(f"model {slot!r} is not loaded in this stage")
        return self.models[slot]

    def config(self, slot: str) -> Any:
        """A model's configuration (dict-like): the loaded model's own, else read from its config.json alone,
        never its weights (for units that declare `configs`)."""
        if slot in self.models:
            return self.raw(slot).config
        key = ("config", slot)
        if key not in self.memo:
            if self.config_loader is None:
                raise RuntimeError(f"the configuration of {slot!r} is not available in this stage")
            self.memo[key] = self.config_loader(slot)
        return self.memo[key]

    def model_dtype(self, slot: str) -> Any:
        """The dtype a model computes in: its first floating parameter's, found once per context; for a model
        stored in fp8 (--fp8_models), the compute dtype its layers are cast to as they run.

        (diffusers' `ModelMixin.dtype` walks every submodule on each call: three calls a step cost a tenth of
        a tiny training step.)"""
        model = self.raw(slot)
        key = ("dtype", slot, id(model))
        if key not in self.memo:
            floating = next((p for p in model.parameters() if p.is_floating_point()), None)
            dtype = floating.dtype if floating is not None else model.dtype
            self.memo[key] = self.dtype if str(dtype).startswith("torch.float8") else dtype
        return self.memo[key]

    def raw(self, slot: str) -> Any:
        """The model itself, unwrapped from DDP (for its config and attributes)."""
        model = self.model(slot)
        return getattr(model, "module", model)

    def rng(self, purpose: str) -> Any:
        """A generator for one draw of this sample in this epoch; only non-deterministic units may ask."""
        if self.epoch is None or self.sample_key is None:
            raise RuntimeError(f"a deterministic stage drew randomness ({purpose}); the unit must be declared non-deterministic")
        return generator(self.seed, "sample", self.epoch, self.sample_key, purpose)

    def tensor(self, value: Any) -> Any:
        to = getattr(value, "to", None)
        return value.to(self.device) if to is not None and hasattr(value, "is_floating_point") else value

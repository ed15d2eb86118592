"""What a model family declares, as plain data plus the functions it runs (no torch here).

A *family* (one model line: its denoiser, encoders and pipelines) is one folder under `families/`. Its `__init__.py`
builds one :class:`Family`: the model slots it loads, the pipelines it trains, the params padded
in a batch, the diffusers pipeline class its folders load with, and where its tiny-model builder
lives. Everything else in the backend (stage 1, the cache, the stage-2 executor, the training loop,
LoRA, checkpoints) reads these declarations and never names a family.

One place per unit: a unit's code is declared right where it is written,

    @unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae",),
          settings=("dtype", "cache_dtype"))
    def image_encoder(ctx, image): ...

so its inputs, outputs, models, determinism, the settings it reads and its function travel together
(like a diffusers ModularPipelineBlock). `UnitCode.declaration` is the `unitgraph.spec.Unit` the
planner reasons about; the planner never calls the function, so planning stays torch-free as long
as family modules import torch lazily (`lazy_module`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Union

from unitgraph.spec import Pipeline, Sink, Unit

__all__ = [
    "DiffSynthPipeline",
    "DiffSynthTokenizer",
    "DiffSynthTensor",
    "Family",
    "Guidance",
    "ModelRepo",
    "ModelSlot",
    "PipelineDef",
    "SETTINGS",
    "SinkCode",
    "Sound",
    "UnitCode",
    "lazy_module",
    "padded_prompts",
    "sink",
    "stacked",
    "unit",
]

# The settings a unit may read from its context (see context.UnitSettings). A unit declares the ones
# it reads; a stage-1 cache key holds exactly the settings of the plan's data_process units.
SETTINGS = ("image_size", "dtype", "cache_dtype", "seed", "timestep_bounds", "loss_weighting", "derived_inputs",
            "timestep_sampling", "snr_gamma", "caption_dropout", "masked_loss")


class _LazyModule(ModuleType):
    """A module imported on first attribute access: family code can say `torch.randn` at module level
    without making `unitgraph plan` import torch."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_target"] = name

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__dict__["_target"])
        return getattr(module, attr)


def lazy_module(name: str) -> ModuleType:
    """`name` as a module object that imports itself when first used."""
    return _LazyModule(name)


# ------------------------------------------------------------------------------------------------
# units and sinks


BatchFn = Callable[[Any, list[dict[str, Any]]], list[dict[str, Any]]]


def _autocast(ctx: Any) -> Any:
    """The context's autocast (the run's compute dtype: the same for a unit in every stage), or none for a bare context."""
    make = getattr(ctx, "autocast", None)
    return make() if make is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class UnitCode:
    """A unit's declaration together with the function that runs it and the settings it reads.

    `fn(ctx, **inputs) -> {output: value}` works on one sample (batch dimension 1); `ctx.model(slot)`
    is the only way to a model, so a stage that did not load a model can never run a unit needing it.
    `batch(ctx, [inputs, ...]) -> [outputs, ...]`, when the unit has one, computes several samples in
    one model call (stage 1's --data_process_batch_size); it must give each sample what `fn` gives it.
    """

    declaration: Unit
    fn: Callable[..., dict[str, Any]] = field(compare=False)
    settings: tuple[str, ...] = ()
    batch: Optional[BatchFn] = field(default=None, compare=False)

    def run_batch(self, ctx: Any, samples: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Outputs of each of `samples` (mappings holding at least the declared inputs): one batched call where
        the unit has a batch form, else one call per sample."""
        if self.batch is None or len(samples) < 2:
            return [self(ctx, s) for s in samples]
        with _autocast(ctx):
            outs = self.batch(ctx, [{p: s[p] for p in self.declaration.inputs} for s in samples])
        if len(outs) != len(samples) or any(set(o) != set(self.declaration.outputs) for o in outs):
            raise RuntimeError(f"unit {self.name}: its batch form did not give each sample its declared outputs")
        return outs

    @property
    def name(self) -> str:
        return self.declaration.name

    @cached_property
    def _output_set(self) -> frozenset[str]:
        """The declared outputs as a set, made once: `__call__` compares every result's keys with it."""
        return frozenset(self.declaration.outputs)

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.declaration.inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.declaration.outputs

    @property
    def models(self) -> tuple[str, ...]:
        return self.declaration.models

    def __call__(self, ctx: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run on `inputs` (a mapping holding at least the declared inputs); check the declared outputs."""
        with _autocast(ctx):
            out = self.fn(ctx, **{p: inputs[p] for p in self.declaration.inputs})
        if out.keys() != self._output_set:
            raise RuntimeError(f"unit {self.name} wrote {sorted(out)}, declared {sorted(self.declaration.outputs)}")
        return out


def unit(name: str, *, inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = (), models: tuple[str, ...] = (),
         deterministic: bool = True, settings: tuple[str, ...] = (), configs: tuple[str, ...] = (),
         batch: "str | BatchFn | None" = None) -> Callable[[Callable[..., dict[str, Any]]], UnitCode]:
    """Declare the decorated function as unit `name` (see the module docstring).

    `configs` are models whose configuration the unit reads (`ctx.config(slot)`) without calling them:
    they do not pull the unit into training when the model needs backward, and a stage that runs it
    reads the model's config.json only.

    `batch`: how the unit computes several samples at once: "stack" (`stacked`: samples whose inputs
    have equal shapes go through `fn` together, concatenated along dim 0, its outputs split again), or a
    function `batch(ctx, [inputs, ...]) -> [outputs, ...]`. None: one sample at a time.

    Raises ValueError at import time for a setting outside SETTINGS, so a typo cannot make a cache
    key miss what a unit reads.
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unit {name}: unknown settings {unknown} (known: {', '.join(SETTINGS)})")

    def wrap(fn: Callable[..., dict[str, Any]]) -> UnitCode:
        extra = {"configs": tuple(configs)} if configs else {}
        declaration = Unit(name, inputs=inputs, outputs=outputs, models=models, deterministic=deterministic, **extra)
        batched = stacked(fn, tuple(outputs)) if batch == "stack" else batch
        if batched is not None and not callable(batched):
            raise ValueError(f"unit {name}: batch must be 'stack', a function or None, got {batch!r}")
        return UnitCode(declaration, fn, tuple(settings), batched)

    return wrap


def _signature(value: Any) -> Any:
    """What must be equal for two samples' input to be stacked: a tensor's shape and dtype, a plain value itself."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return ("tensor", tuple(shape), str(value.dtype), str(getattr(value, "device", "")))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    return ("solo", id(value))  # anything else is never stacked


def padded_prompts(encode: Callable[[Any, list[Any]], Any], *outputs: str) -> BatchFn:
    """The batch form of a prompt unit whose encoder pads every prompt to one fixed length (CLIP's 77 tokens, UMT5's
    512, ...), so that prompts encoded together get what each gets alone: `encode(ctx, prompts)` once on all the
    samples' prompts, its tensor (or tuple of tensors, one per name in `outputs`) split back into rows of 1."""

    def batch(ctx: Any, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        values = encode(ctx, [s["prompt"] for s in samples])
        values = values if isinstance(values, tuple) else (values,)
        return [{o: v[k:k + 1] for o, v in zip(outputs, values)} for k in range(len(samples))]

    return batch


def stacked(fn: Callable[..., dict[str, Any]], outputs: tuple[str, ...]) -> BatchFn:
    """The batch form of a unit whose tensors carry a batch dimension of 1: samples whose inputs have equal
    signatures (`_signature`) are concatenated along dim 0 and go through `fn` in one call; each tensor output
    (of batch size n) is split back into n samples, a None output stays None. A group whose outputs do not
    split so runs one sample at a time. Exact as long as the model's kernels compute each row of a batch as
    they compute it alone: the VAEs' batched convolutions round differently, by a few 1e-6 (docs/benchmarks.md;
    the conformance suite checks every pipeline)."""

    def batch(ctx: Any, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        import torch

        groups: dict[Any, list[int]] = {}
        for k, inputs in enumerate(samples):
            key = tuple((p, _signature(v)) for p, v in sorted(inputs.items()))
            groups.setdefault(key, []).append(k)
        out: list[Optional[dict[str, Any]]] = [None] * len(samples)
        for members in groups.values():
            first = samples[members[0]]
            if len(members) == 1 or not all(getattr(v, "shape", (1,))[:1] == (1,) for v in first.values()
                                              if _signature(v)[0] == "tensor"):
                for k in members:
                    out[k] = fn(ctx, **samples[k])
                continue
            joined = {p: torch.cat([samples[k][p] for k in members]) if _signature(v)[0] == "tensor" else v
                      for p, v in first.items()}
            result = fn(ctx, **joined)
            n = len(members)
            if all(result[o] is None or (isinstance(result[o], torch.Tensor) and result[o].shape[:1] == (n,))
                   for o in outputs):
                for j, k in enumerate(members):
                    out[k] = {o: None if result[o] is None else result[o][j:j + 1] for o in outputs}
            else:
                for k in members:
                    out[k] = fn(ctx, **samples[k])
        return [o for o in out if o is not None]

    return batch


@dataclass(frozen=True)
class SinkCode:
    """The loss: its declaration and `fn(ctx, **inputs) -> scalar loss` over a batch of sink inputs."""

    declaration: Sink
    fn: Callable[..., Any] = field(compare=False)

    def __call__(self, ctx: Any, inputs: Mapping[str, Any]) -> Any:
        with _autocast(ctx):
            return self.fn(ctx, **{p: inputs[p] for p in self.declaration.inputs})


def sink(*, inputs: tuple[str, ...], models: tuple[str, ...]) -> Callable[[Callable[..., Any]], SinkCode]:
    """Declare the decorated function as a pipeline's loss."""

    def wrap(fn: Callable[..., Any]) -> SinkCode:
        return SinkCode(Sink(inputs=inputs, models=models), fn)

    return wrap


# ------------------------------------------------------------------------------------------------
# pipelines, model slots, families


@dataclass(frozen=True)
class PipelineDef:
    """One trainable pipeline of a family: its units in order, its loss and the task it serves.

    `task` is the --task family it runs (`sft`, `direct_distill`); `required` are the metadata
    columns every sample must have, `optional` those used when present; `image_params` are the
    dataset params that name image files (loaded as RGB images, a list of files giving a list);
    `param_types` converts metadata strings (csv carries only strings) for the params that are numbers;
    `video_params` name video files (a clip: the first --num_frames frames, as PIL frames; a still image is
    one frame); `audio_params` name files whose sound track is the input (data/audio.py: (float32 samples
    (channels, n), rate), None for a file without one); `derived_inputs` are --extra_inputs names the pipeline computes itself (DiffSynth's
    `input_image`, a clip's first frame), accepted without a metadata column.
    `diffusers_pipeline` is the diffusers pipeline class its tiny folders load with and its LoRA files
    are checked with (None: the family's first). `companions` are the auxiliary slots (a processor,
    say) a stage loads together with a model for this pipeline, beside the tokenizer a text encoder
    pairs with: {"text_encoder": ("processor",)} loads the processor wherever the text encoder runs.
    `index_marks` are model_index.json entries that tell this pipeline's folders from those of other pipelines of
    the same diffusers class (a release that sets a flag of that class, say): a folder with them chooses it, a
    folder without them the class's unmarked pipelines.
    """

    name: str
    task: str
    units: tuple[UnitCode, ...]
    loss: SinkCode
    description: str = ""
    required: tuple[str, ...] = ("image", "prompt")
    optional: tuple[str, ...] = ()
    image_params: tuple[str, ...] = ("image",)
    param_types: Mapping[str, type] = field(default_factory=dict, hash=False)
    video_params: tuple[str, ...] = ()
    derived_inputs: tuple[str, ...] = ()
    audio_params: tuple[str, ...] = ()
    diffusers_pipeline: Optional[str] = None
    companions: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    index_marks: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @cached_property
    def spec_pipeline(self) -> Pipeline:
        """The planner's view, built once (its version graph is cached on it)."""
        return self.spec()

    def spec(self) -> Pipeline:
        """The planner's view: a new `unitgraph.spec.Pipeline` (validated there)."""
        return Pipeline(name=self.name, units=tuple(u.declaration for u in self.units), sink=self.loss.declaration,
                        source=f"diffusion:{self.name}")

    def unit_code(self) -> dict[str, UnitCode]:
        return {u.name: u for u in self.units}


@dataclass(frozen=True)
class ModelSlot:
    """One component a family loads, named as DiffSynth-Studio's pipeline names it (`dit`, `vae`, ...).

    kind: "model" (weights, may be trained), "tokenizer", "scheduler" or "processor" (a multimodal
    processor folder: preprocessor_config.json beside tokenizer files; a stage loads it as a pipeline's
    companion of a model, see PipelineDef.companions).
    library / class_name: the class `from_pretrained` is called on (e.g. `diffusers.AutoencoderKL`).
    subfolder: its key in a diffusers pipeline folder's model_index.json.
    accepts: further class names that identify a folder of this slot (`_class_name` for diffusers,
    `architectures` for transformers); model_types: transformers `model_type` values that do.
    lora_prefix: the diffusers pipeline attribute its checkpoint keys live under (`transformer`);
    lora_targets: the default --lora_target_modules when it is the LoRA base model.
    lora_aliases: module names of DiffSynth-Studio's own model class (a DiT of its own may fuse q, k and v into
    `a_to_qkv`, say) -> the modules of this slot's class they stand for, so its --lora_target_modules port.
    tokenizer: the tokenizer slot paired with this text encoder (a family may have several such pairs).
    default_config: for a scheduler, the family's published config, used when no folder gives one.
    origin: (model id, pattern) DiffSynth falls back to when only model ids are given (tokenizers, processors).
    single_file: "module:ATTR" (the module relative to the family's package) naming the single-file layout a
    release publishes this component in (one file at the top of the model's repository), imported when a file needs it:
    an object with `description`, `class_name`, `matches(shapes)`, `config(shapes, beside)` (the diffusers
    config.json content) and `convert(tensors)` (the diffusers state dict); see models/release.py.
    comfyui: "module:ATTR" (relative to the family's package) naming the slot's module names in its release
    checkpoint, which ComfyUI's own model classes use (a `models/release_names.ReleaseNames`, or an object with its
    `for_config`): how `--lora_format comfyui` names and stacks a LoRA of this slot (models/lora.py reads it back).
    module: the module the class is imported from when the library does not export it at its top (a model
    class diffusers keeps beside its pipeline, say); None: the library itself.
    optional: a model some releases of the family's pipelines go without (an image encoder whose features only
    some DiTs take): a run that is given none loads none, and the unit that calls it says what is missing when
    the other models need it after all.
    """

    name: str
    library: str
    class_name: str
    subfolder: str
    kind: str = "model"
    accepts: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    lora_prefix: Optional[str] = None
    lora_targets: tuple[str, ...] = ()
    lora_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    tokenizer: Optional[str] = None
    default_config: Optional[Mapping[str, Any]] = None
    origin: Optional[tuple[str, str]] = None
    single_file: Optional[str] = None
    module: Optional[str] = None
    optional: bool = False
    comfyui: Optional[str] = None

    @property
    def class_names(self) -> tuple[str, ...]:
        return (self.class_name, *self.accepts)

    def lora_modules(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """--lora_target_modules as this slot's module names: each DiffSynth alias replaced by what it
        stands for, duplicates dropped, order kept.

        >>> ModelSlot("dit", "diffusers", "X", "x", lora_aliases={"a_to_qkv": ("to_q", "to_k", "to_v")}).lora_modules(
        ...     ("a_to_qkv", "to_q", "proj_out"))
        ('to_q', 'to_k', 'to_v', 'proj_out')
        """
        return tuple(dict.fromkeys(m for t in targets for m in self.lora_aliases.get(t, (t,))))


class LoraPrefixes(dict):
    """slot -> the diffusers prefix its LoRA keys live under, as a plain dict, and the family they are of: the readers
    and writers of LoRA files take it where they may meet a slot's release names (`Family.comfyui_names`)."""

    def __init__(self, prefixes: Mapping[str, str], family: Optional["Family"] = None):
        super().__init__(prefixes)
        self.family = family


@dataclass(frozen=True)
class ModelRepo:
    """Model repositories a family's commands name (DiffSynth's `--model_id_with_origin_paths "org/name:pattern"`).

    ids: the model ids, as fnmatch patterns (`org/Model-T2V-*`); a command naming one trains `pipeline`, or the
    one of several (a tuple: one checkpoint trained with and without reference images) or of all the family's
    pipelines (None) that the dataset's columns decide. release_files: files of the original
    release layout these repositories hold (fnmatch patterns, `models_t5_*.pth`) -> where the diffusers layout
    keeps the same component (`text_encoder/*.safetensors`), in the repository `diffusers_repo` names
    (`{id}`: the same one; `{id}-Diffusers`: its diffusers twin). A message about a file it cannot read names
    that path instead.
    """

    ids: tuple[str, ...]
    pipeline: Union[None, str, tuple[str, ...]] = None
    release_files: Mapping[str, str] = field(default_factory=dict, hash=False)
    diffusers_repo: str = "{id}"

    def names(self, model_id: str) -> bool:
        return any(fnmatch.fnmatchcase(model_id, pattern) for pattern in self.ids)

    @property
    def pipelines(self) -> tuple[str, ...]:
        """The pipelines these ids name (empty: the family only)."""
        if self.pipeline is None:
            return ()
        return (self.pipeline,) if isinstance(self.pipeline, str) else tuple(self.pipeline)

    def diffusers_path(self, model_id: str, pattern: str) -> Optional[str]:
        """'org/name:sub/pattern' of the diffusers layout holding what the release file `pattern` holds, or None."""
        for release, diffusers in self.release_files.items():
            if fnmatch.fnmatchcase(pattern, release):
                return f"{self.diffusers_repo.format(id=model_id)}:{diffusers}"
        return None


@dataclass(frozen=True)
class Experts:
    """A denoiser released as experts over ranges of noise, one pipeline subfolder each, of which a run trains one.

    A two-expert video model's diffusers folders hold `transformer` (the high-noise expert) and `transformer_2` (the low-noise
    one), and `boundary_ratio` in model_index.json: diffusers' pipeline denoises timesteps >= ratio x 1000 with the
    first and the rest with the second. DiffSynth-Studio trains one expert per command, naming its release folder
    (`high_noise_model/`, `low_noise_model/`) and narrowing the drawn timesteps with --min/max_timestep_boundary.

    slot: the model slot the experts fill. subfolders: (expert, pipeline subfolder) pairs, the noisiest expert
    first. release_folders: (expert, folder of the original release). schedule: the family's training schedule
    (a `flowmatch.TrainingSchedule`), through which a boundary ratio becomes positions of the drawn timesteps.
    boundary_key: model_index.json's key of the ratio. published: (model id pattern, ratio) of the releases, for
    commands that name a repository's files rather than its pipeline folder. pipelines: the family's pipelines
    released as experts (empty: every one).
    """

    slot: str
    subfolders: tuple[tuple[str, str], ...]
    release_folders: tuple[tuple[str, str], ...] = ()
    schedule: Any = None
    boundary_key: str = "boundary_ratio"
    published: tuple[tuple[str, float], ...] = ()
    pipelines: tuple[str, ...] = ()

    def covers(self, pipeline: str) -> bool:
        """Whether `pipeline` is released as these experts."""
        return not self.pipelines or pipeline in self.pipelines

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.subfolders)

    def subfolder(self, expert: str) -> str:
        return dict(self.subfolders)[expert]

    def of_subfolder(self, subfolder: str) -> Optional[str]:
        """The expert a pipeline subfolder or a release folder holds, or None."""
        return next((name for name, sub in (*self.subfolders, *self.release_folders) if sub == subfolder), None)

    def positions(self, ratio: float) -> int:
        """How many of the schedule's positions, from the noisiest, have a timestep >= ratio x 1000: the first
        expert's positions (the second's are the rest).

        >>> from unitgraph.backends.diffusion.flowmatch import TrainingSchedule
        >>> Experts("dit", (("high", "transformer"), ("low", "transformer_2")), schedule=TrainingSchedule(shift=5.0)).positions(0.875)
        417
        """
        timesteps = self.schedule.sigmas() * 1000.0
        return int((timesteps >= ratio * 1000.0).sum())


@dataclass(frozen=True)
class Guidance:
    """How a pipeline guides its validation samples, as its family's render module declares it (`guidance(pipeline)`,
    train/validation.py): `default`, the scale its diffusers pipeline's `__call__` defaults to; `negative`, whether it
    guides against a negative prompt (classifier-free guidance: a second pass of the denoiser) or takes none (a scale
    embedded in a distilled DiT); `empty_negative`, whether, with no --validation_negative_prompt, it guides against
    the empty prompt's encoding (stage 1 encodes it), or else against what its pipeline makes without one (zeros, where
    the pipeline's `force_zeros_for_empty_prompt` says so)."""

    default: float
    negative: bool = True
    empty_negative: bool = True


@dataclass(frozen=True)
class Sound:
    """A validation sample's sound track, beside its image: a render module whose pipeline makes sound returns
    `(image, Sound)` (train/validation.py writes it as a WAV file beside the PNG, and samples.html plays it).
    `samples`: a float tensor [channels, samples] in [-1, 1]; `rate`: samples a second."""

    samples: Any
    rate: int


@dataclass(frozen=True)
class DiffSynthTokenizer:
    """A tokenizer folder a DiffSynth pipeline's `from_pretrained` takes: its keyword, the flag that names it, the model
    id and pattern its `train.py` falls back to, and the text encoder (pipeline attribute) it serves: a stage that
    does not load that encoder does not look for the tokenizer. An `encoder` of "": it serves a unit that loads no
    model (HiDream-O1's prompt tokenizer, whose DiT reads the tokens itself): every stage that runs stage 1's units,
    or draws, looks for it; stage 2 from a cache does not."""

    keyword: str
    flag: str
    model_id: str
    pattern: str
    encoder: str = "text_encoder"


@dataclass(frozen=True)
class DiffSynthTensor:
    """A tensor a DiffSynth pipeline's `from_pretrained` reads from a `.pt` file with torch.load (ACE-Step's silence
    latent), which unitgraph reads from the file's safetensors twin instead (it unpickles nothing): the keyword
    `from_pretrained` takes it by (handed None), the flag that names it, the model id and pattern its `train.py` falls
    back to, the pipeline attribute it fills, the dimensions `from_pretrained` swaps, and the models whose stage needs it
    (the stage whose units read it)."""

    keyword: str
    flag: str
    model_id: str
    pattern: str
    attribute: str
    transpose: tuple[int, ...] = ()
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class DiffSynthPipeline:
    """One of DiffSynth-Studio's trainable pipelines, as its example's `train.py` puts it together for training
    (backends/diffusion/diffsynth_source runs it with DiffSynth's own units, loader and loss).

    module / class_name: `diffsynth.pipelines.<module>.<class_name>`. dtype: what its `train.py` builds the pipeline
    in. tokenizers: the tokenizer folders of `from_pretrained`. columns: the metadata columns a sample must have.
    division: the multiple its dataset's ImageCropAndResize rounds sides to. example: its folder under DiffSynth's
    `examples/`. opensource_lora: the converter of its LoRA files to the open-source layout. media: what a sample
    trains on, "image" (its `image` column, one picture), "video" (its `video` column, frames read by DiffSynth's
    video operator: --num_frames, cut to `frames` = (time division, remainder)) or "audio" (its `audio` column, a song
    at `sample_rate`). constants: the inputs its
    `get_pipeline_inputs` sets to fixed values beyond the image pipelines' (a video one's `tiled`, `cfg_merge`,
    `vace_scale`). boundaries: whether it passes --max/--min_timestep_boundary to the loss. negative: the
    `inputs_nega` prompt (None: an empty dict). checkpointing: whether its train.py turns gradient checkpointing on
    whatever the flag says. sized_as: release files known to DiffSynth's table by another repository's example
    (the dry run sizes them from it). attention: a DiffSynth attention function that allows torch only kernels some
    devices lack, tried before a training stage loads anything. loss, audio, frame_rate: an audio-video pipeline's
    loss, sound columns and clip rate (see the fields). A family that trains the same models declares it
    (`Family.diffsynth`), with a writer of its test-size models in DiffSynth's layout; DiffSynth's pipelines of no
    family are listed in diffsynth_source/glue.py.
    """

    module: str
    class_name: str
    title: str
    dtype: str = "bfloat16"
    tokenizers: tuple[DiffSynthTokenizer, ...] = ()
    columns: tuple[str, ...] = ("image", "prompt")
    division: int = 16
    example: str = ""
    # "module:Class.function" of DiffSynth's converter its train.py applies with --align_to_opensource_format ("": none)
    opensource_lora: str = ""
    media: str = "image"
    frames: tuple[int, int] = (4, 1)
    constants: tuple[tuple[str, Any], ...] = ()
    boundaries: bool = False
    negative: Optional[str] = ""
    checkpointing: bool = False
    # release files DiffSynth's table knows only under another repository's example: ("id:pattern" the commands
    # name, "id:pattern" of the example with the same weights' names and shapes, or "md5:HASH" of the table entry
    # the file is), for the dry run without the files; they take precedence over the table's example comments
    sized_as: tuple[tuple[str, str], ...] = ()
    # whether its train.py offers --task direct_distill (DiffSynth's DirectDistillLoss)
    distill: bool = True
    # "module:function" of a DiffSynth attention function that allows torch only some kernels (one DiT asks for cuDNN's
    # alone): tried on the run's device before a training stage loads anything ("": none)
    attention: str = ""
    # "module:function" of the DiffSynth loss its train.py maps `sft` to ("": FlowMatchSFTLoss; an audio-video pipeline
    # trains FlowMatchSFTAudioVideoLoss, its video's and its sound's errors summed)
    loss: str = ""
    # the --data_file_keys columns whose file's sound track is an input (read by DiffSynth's LoadAudioWithTorchaudio,
    # the clip's length at --frame_rate, through PyAV: data/audio.py)
    audio: tuple[str, ...] = ()
    # the latents its units make of that sound, which its loss noises when a sample has them: a run that hands the
    # pipeline a sound column requires a track in every row, so every step's loss overwrites the noise they replace
    # (planning.loss_overwrites' `present`) and stage 1 caches them
    audio_latents: str = ""
    # whether its train.py reads clips at --frame_rate (DiffSynth's video operator with fix_frame_rate: frames sampled
    # at that rate, not the file's own) and hands the pipeline a `frame_rate` (a metadata column, else 24)
    frame_rate: bool = False
    # functions of the pipeline's module its `from_pretrained` applies to a list of its models, assuming each loaded
    # (MOVA's `set_to_torch_norm`): a stage that loads some of them hands the others over as None, which they skip
    on_loaded: tuple[str, ...] = ()
    # whether its `__call__` draws from a first frame (`input_image`: MOVA's video DiT takes the frame's latents beside
    # its own): a validation sample then needs --validation_image
    first_frame: bool = False
    # an audio pipeline's (media "audio": its `audio` column, a song read by DiffSynth's LoadPureAudioWithTorchaudio):
    # the rate its train.py resamples songs to
    sample_rate: int = 0
    # metadata columns its get_pipeline_inputs reads with a default where a row has none (ACE-Step's bpm, keyscale...)
    defaults: tuple[tuple[str, Any], ...] = ()
    # tensors its from_pretrained would unpickle (`DiffSynthTensor`), read from their safetensors twins
    tensors: tuple[DiffSynthTensor, ...] = ()
    # whether its get_pipeline_inputs marks the two sides (`positive`: True in inputs_posi, False in inputs_nega)
    sides: bool = False
    # (unit class, param): a unit whose every draw is under `if PARAM is not None` (ACE-Step's reference-audio unit cuts
    # a reference at random places, Python's random): deterministic in a run that gives no PARAM, so the plan may cache
    # it (stage 1 checks torch's stream as it runs; hazards.py)
    quiet_without: tuple[tuple[str, str], ...] = ()
    # whether it trains and draws edits only (JoyAI-Image: its prompt unit encodes an instruction only beside the picture
    # it edits): a run needs --extra_inputs edit_image (a file column), and a validation sample a --validation_image,
    # handed to its `__call__` as `edit_image`
    edits: bool = False
    # (flag, default) of flags its own train.py adds whose value its get_pipeline_inputs hands the pipeline as the
    # input of the same name (HiDream-O1's --noise_scale, 8.0): stage 1 stores it in each entry and its cache key
    options: tuple[tuple[str, Any], ...] = ()
    # the fewest `division`-sized cells a picture may have (HiDream-O1's prompt unit puts its vision-start token on the
    # picture's first patch and looks at the token after it: a one-patch picture fails inside DiffSynth's unit)
    min_cells: int = 0

    @property
    def name(self) -> str:
        return f"diffsynth:{self.module}"


@dataclass(frozen=True)
class Family:
    """A model family: everything the generic machinery needs to train it.

    diffusers_pipelines: the `_class_name`s of model_index.json that mean this family (the first is
    the class its tiny folders and LoRA files are checked with, unless a pipeline names its own). slots: the
    denoiser first (a scheduler folder is looked for beside it). tiny: the module (relative to the family's
    package) with `SIZES` and `write_tiny_models(outdir, size, seed, pipeline=None)` (the folder for a
    pipeline's diffusers class; None: the family's first pipeline's). pad: params padded
    along dim 1 in a batch, each with its 0/1 mask param. demo: flags the demo trains with (`images` and `resolution`: its data's defaults). render: the module
    (relative to the package) whose `render(pipeline, models, embeds, width, height, steps, generator, guidance=,
    negative=) -> PIL` draws a validation sample with the family's diffusers pipeline (and whose `guidance(pipeline)`
    says how: a `Guidance`, or None); render_models: the models it needs beyond
    the stage's (the VAE, for its decoder), loaded only while rendering. repos: the model repositories its
    commands name (`ModelRepo`), most specific first: how a run tells the family and pipeline from model ids,
    and where a release file's diffusers twin is. experts: a denoiser released as experts over noise levels
    (`Experts`), of which a run trains one (`with_expert`).
    """

    name: str
    title: str
    package: str
    slots: tuple[ModelSlot, ...]
    pipelines: tuple[PipelineDef, ...]
    diffusers_pipelines: tuple[str, ...]
    tiny: str = ".tiny"
    pad: Mapping[str, str] = field(default_factory=dict)
    # stage 1's samples per model call unless --data_process_batch_size says. 1: a convolution's batched CPU
    # kernels round differently (docs/benchmarks.md), and only unbatched entries keep split training bit for bit
    # the unsplit run
    data_process_batch_size: int = 1
    demo: Mapping[str, Any] = field(default_factory=dict)
    render: Optional[str] = None
    # the module (relative to the package) with `PIPELINES`, the family's models as DiffSynth-Studio's own pipelines
    # (`DiffSynthPipeline`s, trained with --pipeline diffsynth:MODULE), and `write_diffsynth_models(outdir, module,
    # seed)`, their test-size models in DiffSynth's ./models layout; None: none
    diffsynth: Optional[str] = None
    render_models: tuple[str, ...] = ()
    repos: tuple[ModelRepo, ...] = ()
    experts: Optional[Experts] = None

    def __post_init__(self) -> None:
        names = [s.name for s in self.slots]
        if len(set(names)) != len(names):
            raise ValueError(f"family {self.name}: duplicate model slots")
        for slot in self.slots:
            if slot.tokenizer is not None and slot.tokenizer not in names:
                raise ValueError(f"family {self.name}: slot {slot.name} pairs with unknown tokenizer {slot.tokenizer}")
        for pipeline in self.pipelines:
            unknown = sorted(set(pipeline.spec().models) - set(names))
            if unknown:
                raise ValueError(f"family {self.name}: pipeline {pipeline.name} calls undeclared models {unknown}")
            for model, aux in pipeline.companions.items():
                unknown = sorted({model, *aux} - set(names))
                if unknown:
                    raise ValueError(f"family {self.name}: pipeline {pipeline.name} has companions of undeclared slots {unknown}")
        pipelines = {p.name for p in self.pipelines}
        for repo in self.repos:
            unknown = sorted(set(repo.pipelines) - pipelines)
            if unknown:
                raise ValueError(f"family {self.name}: model ids {repo.ids} name unknown pipelines {unknown}")

    def with_expert(self, expert: Optional[str]) -> "Family":
        """The family with its expert slot read from `expert`'s subfolder (the family itself for None): the folders
        of a two-expert pipeline then resolve that slot to the chosen expert everywhere models are found."""
        if expert is None:
            return self
        if self.experts is None or expert not in self.experts.names:
            raise ValueError(f"family {self.name} has no expert {expert!r}")
        subfolder = self.experts.subfolder(expert)
        slots = tuple(replace(s, subfolder=subfolder) if s.name == self.experts.slot else s for s in self.slots)
        return replace(self, slots=slots)

    def slot_of_subfolder(self, subfolder: str) -> Optional[ModelSlot]:
        """The model slot a pipeline subfolder holds: a slot's own, or any expert's of the expert slot."""
        own = next((s for s in self.slots if s.subfolder == subfolder and s.kind == "model"), None)
        if own is None and self.experts is not None and subfolder in dict(self.experts.subfolders).values():
            return self.slot(self.experts.slot)
        return own

    def repo(self, model_id: str) -> Optional[ModelRepo]:
        """The first of `repos` whose ids name `model_id`, or None."""
        return next((repo for repo in self.repos if repo.names(model_id)), None)

    def single_file_format(self, slot: str) -> Any:
        """The single-file layout object a slot declares (`ModelSlot.single_file`), imported now; None without one."""
        where = self.slot(slot).single_file
        if where is None:
            return None
        module, _, attr = where.partition(":")
        return getattr(importlib.import_module(module, self.package), attr)

    def comfyui_names(self, slot: str) -> Any:
        """The release module names a slot declares for ComfyUI's layout (`ModelSlot.comfyui`), imported now; None
        without them."""
        where = self.slot(slot).comfyui
        if where is None:
            return None
        module, _, attr = where.partition(":")
        return getattr(importlib.import_module(module, self.package), attr)

    def lora_prefixes(self) -> "LoraPrefixes":
        """Each model slot's checkpoint key prefix (its diffusers pipeline attribute), the denoiser first."""
        return LoraPrefixes({s.name: s.lora_prefix or s.name for s in self.slots if s.kind == "model"}, family=self)

    def slot(self, name: str) -> ModelSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(name)

    @property
    def model_slots(self) -> list[str]:
        """Slots with weights (the names --trainable_models and --lora_base_model take)."""
        return [s.name for s in self.slots if s.kind == "model"]

    @property
    def text_encoders(self) -> list[str]:
        """Model slots paired with a tokenizer."""
        return [s.name for s in self.slots if s.kind == "model" and s.tokenizer is not None]

    def pipeline(self, name: str) -> PipelineDef:
        for pipeline in self.pipelines:
            if pipeline.name == name:
                return pipeline
        raise KeyError(name)

    def pipeline_for(self, pipeline: Any = None) -> PipelineDef:
        """The PipelineDef for a name or a PipelineDef, None meaning the family's first: what the tiny-model and
        config-folder writers take. An unknown name is a ValueError naming the family's pipelines."""
        if pipeline is None:
            return self.pipelines[0]
        name = str(getattr(pipeline, "name", pipeline))
        try:
            return self.pipeline(name)
        except KeyError:
            raise ValueError(f"unknown {self.title} pipeline {name!r} "
                             f"(pipelines: {', '.join(p.name for p in self.pipelines)})") from None

    def diffusers_class(self, pipeline: Any = None) -> str:
        """The diffusers pipeline class a pipeline's folder loads with: its own, else the family's first."""
        return self.pipeline_for(pipeline).diffusers_pipeline or self.diffusers_pipelines[0]

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(p.task for p in self.pipelines))

    def tiny_module(self) -> Any:
        """The family's tiny-model builder (imported on demand: it needs torch)."""
        return importlib.import_module(self.tiny, self.package)

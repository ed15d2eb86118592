"""Validation samples: images (a strip of frames for video) of fixed prompts, rendered at checkpoints.

`--validation_prompt TEXT` (repeatable) renders each prompt, seeded (`--validation_seed`, default `--seed`, and
the prompt's position), through the family's own diffusers pipeline class with the current weights (the LoRA as
it is in memory), into OUTPUT/samples/<checkpoint>/<k>.png, one contact sheet OUTPUT/samples/<checkpoint>.png
per checkpoint, and OUTPUT/samples.html, which shows every checkpoint's samples side by side.

Each sample is guided as its pipeline guides by default (the render module's `guidance(pipeline)`, a
family.Guidance: the scale the diffusers pipeline's `__call__` defaults to, and whether it guides against a
negative prompt); `--validation_guidance` sets the scale and `--validation_negative_prompt` (once for all prompts,
or once per prompt) what it guides against, the empty prompt by default. The negative prompts are encoded as the
prompts are, after them in the same file (`validation_texts`), so the file's key covers them. The edit and
image-to-video pipelines take `--validation_image` (one per prompt: the image to edit, or the clip's first frame),
which the pipeline itself encodes at render time: their render modules list them in IMAGE_PIPELINES, and in
IMAGE_REQUIRED those that cannot render without one (an image-to-video pipeline's first frame).

Split training keeps its promise that stage 2 never loads a frozen text encoder: the prompt units
(the pipeline's units that read only `prompt` and call a model) run on the validation prompts in
stage 1, which stores their outputs beside the cache (`validation.safetensors`, keyed by the
prompts and the cache's key inputs, sealed with a checksum and checked whole before training:
cache/encoded_prompts.py); stage 2 reads them. A prompt unit that is itself trained
(a LoRA on the text encoder) runs at render time instead, with its current weights. The models a
family needs only to render (the VAE's decoder) are loaded while rendering and freed after.

Rendering draws from its own generator, never from torch's global stream, so a run with samples
trains exactly as one without.
"""

from __future__ import annotations

import gc
import html
import importlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Optional

from unitgraph.atomic import write_bytes_atomic, write_text_atomic

from ..cache.encoded_prompts import (
    DIGEST_KEY,
    META_KEY,
    VALIDATION,
    VALIDATION_FILE,
    PromptFile,
    check_against_cache,
    content_digest,
    prompts_key,
    read_encoded,
)
from ..errors import BackendError
from ..family import Guidance
from ..tensorfile import finite, header_of_bytes, load_tensors

__all__ = ["VALIDATION_FILE", "SAMPLES_DIR", "Guidance", "ValidationTexts", "prompt_units", "sample_prompt_units",
           "encode_prompts", "encode_validation", "store_encoded", "load_encoded", "guidance_of", "validation_texts",
           "Validator", "samples_page", "save_wav"]

SAMPLES_DIR = "samples"
SAMPLES_PAGE = "samples.html"
INPUTS_DIR = "inputs"  # the --validation_image files as the page shows them, beside the checkpoints' folders


def prompt_units(pipeline: Any, reads: tuple[str, ...] = ()) -> list[Any]:
    """The units that turn a prompt into what the denoiser reads: they read `prompt` (and nothing else but `reads`:
    what an edit pipeline's prompt encoder reads of its images, which a validation image stands in for) and call a
    model."""
    allowed = {"prompt", *reads}
    return [u for u in pipeline.units if "prompt" in u.inputs and set(u.inputs) <= allowed and u.models]


def image_reads(cfg: Any) -> tuple[str, ...]:
    """What the pipeline's prompt encoder reads of a sample's image beside its prompt (the render module's
    PROMPT_IMAGE_INPUTS: an edit pipeline whose vision-language encoder reads the image), for the pipelines that
    render from a --validation_image; () where the prompt is encoded alone."""
    module = render_module(cfg)
    if module is None or cfg.pipeline.name not in getattr(module, "IMAGE_PIPELINES", ()):
        return ()
    return tuple(getattr(module, "PROMPT_IMAGE_INPUTS", ()))


def sample_prompt_units(cfg: Any) -> list[Any]:
    """The prompt units that encode the validation prompts of this run (prompt_units with the image reads)."""
    return prompt_units(cfg.pipeline, image_reads(cfg))


@dataclass(frozen=True)
class ValidationTexts:
    """What stage 1 encodes for the samples: the prompts, then their distinct negative prompts (`texts`), and for
    each prompt the position of its negative prompt's encoding in `texts` (None: it renders without one).

    Where the prompt encoder reads the sample's image too (image_reads), every text is encoded with its prompt's
    --validation_image (`images`: the image's position for each text; a negative prompt is then one per prompt, as
    the pipeline encodes it with that prompt's image), and `keyed`, what the encoded file is keyed by, names each
    image's content beside its text, so another image is another file."""

    texts: list[str]
    negatives: list[Optional[int]]
    images: Optional[list[int]] = None
    digests: tuple[str, ...] = ()

    @property
    def keyed(self) -> list[str]:
        if self.images is None:
            return list(self.texts)
        return [f"{text}\0image sha256:{self.digests[i]}" for text, i in zip(self.texts, self.images)]


def render_module(cfg: Any) -> Any:
    """The family's render module (families/<family>/render.py), or None when the family has none."""
    return importlib.import_module(cfg.family.render, cfg.family.package) if cfg.family.render else None


def guidance_of(cfg: Any) -> Optional[Guidance]:
    """The pipeline's guidance at render time; None when it renders without any."""
    module = render_module(cfg)
    declared = getattr(module, "guidance", None)
    return declared(cfg.pipeline) if declared is not None else None


def validation_texts(cfg: Any) -> ValidationTexts:
    """The texts to encode: the prompts, and the negative prompts their guidance reads (--validation_negative_prompt,
    once for all or once per prompt; without it the empty prompt, where the pipeline's guidance needs one)."""
    prompts, given = list(cfg.validation.prompts), list(cfg.validation.negative_prompts)
    spec = guidance_of(cfg) if prompts else None
    if spec is None or not spec.negative:
        wanted: list[Optional[str]] = [None] * len(prompts)
    elif given:
        wanted = list(given) if len(given) == len(prompts) else given[:1] * len(prompts)
    else:
        wanted = [""] * len(prompts) if spec.empty_negative else [None] * len(prompts)
    if image_reads(cfg) and prompts:  # each text with its prompt's image: a negative prompt per prompt
        digests = tuple(_file_digest(p) for p in cfg.validation.images)
        negatives = [k for k, n in enumerate(wanted) if n is not None]
        at = {k: len(prompts) + i for i, k in enumerate(negatives)}
        return ValidationTexts(prompts + [wanted[k] for k in negatives], [at.get(k) for k in range(len(prompts))],
                               list(range(len(prompts))) + negatives, digests)
    distinct = list(dict.fromkeys(n for n in wanted if n is not None))
    return ValidationTexts(prompts + distinct, [None if n is None else len(prompts) + distinct.index(n) for n in wanted])


def _file_digest(name: str) -> str:
    """sha256 of a --validation_image file's bytes, read in chunks; a file that cannot be read is one line."""
    import hashlib

    try:
        with open(name, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as exc:
        raise BackendError(f"--validation_image: cannot be read ({exc.strerror or exc})", source=name) from None


def read_validation_images(cfg: Any) -> list[Any]:
    """The --validation_image files as 8-bit RGB images, in the prompts' order; a missing or unreadable file is one
    line naming it."""
    return read_images(cfg.validation.images)


def read_images(names: Iterable[str]) -> list[Any]:
    """`names` (--validation_image files) as 8-bit RGB images, in order; a missing or unreadable file is one line
    naming it."""
    from ..data.dataset import ImageProblem, image_to_rgb, open_image

    images = []
    for name in names:
        path = Path(name)
        if not path.is_file():
            raise BackendError("--validation_image: no such file", source=name)
        try:
            with open_image(path) as image:
                image.load()
                images.append(image_to_rgb(image))
        except ImageProblem as exc:
            raise BackendError(f"--validation_image {exc}", source=name) from None
        except Exception as exc:  # PIL's decoders raise many types for damaged files (struct.error, EOFError, ...)
            text = str(exc).strip().splitlines()
            raise BackendError(f"--validation_image: not a readable image ({text[0] if text else type(exc).__name__})",
                               source=name) from None
    return images


def check_supported(cfg: Any) -> None:
    """A one-line error before any work when --validation_prompt cannot be rendered for this pipeline, or its
    guidance flags do not apply to it."""
    if not cfg.validation.prompts:
        return
    module = render_module(cfg)
    name = cfg.pipeline.name
    if not sample_prompt_units(cfg) or module is None or name not in getattr(module, "PIPELINES", ()):
        raise BackendError(f"--validation_prompt: pipeline {name} has no validation rendering yet "
                           "(it needs more than a prompt, e.g. an edit or first-frame image)")
    spec = guidance_of(cfg)
    if cfg.validation.guidance is not None and spec is None:
        raise BackendError(f"--validation_guidance: pipeline {name} samples without guidance (its diffusers pipeline "
                           "has no guidance scale); drop the flag")
    if cfg.validation.negative_prompts and (spec is None or not spec.negative):
        raise BackendError(f"--validation_negative_prompt: pipeline {name} " + (
            "samples without guidance" if spec is None else "guides with a scale embedded in its distilled DiT, "
            "which reads no negative prompt") + "; drop the flag")
    if name in getattr(module, "IMAGE_REQUIRED", ()) and not cfg.validation.images:
        raise BackendError(f"--validation_prompt: pipeline {name} renders from an input image (the image it edits, or "
                           "the clip's first frame): give --validation_image once per prompt, in their order")
    if cfg.validation.images:
        if name not in getattr(module, "IMAGE_PIPELINES", ()):
            raise BackendError(f"--validation_image: pipeline {name} renders from the prompt alone (an input image is "
                               "read by the edit and image-to-video pipelines that render with one); drop the flag")
        problem = getattr(module, "image_problem", None)  # what the pipeline refuses of an input image
        for path, image in zip(cfg.validation.images, read_validation_images(cfg)):
            said = problem(cfg.pipeline, image) if problem is not None else None
            if said:
                raise BackendError(f"--validation_image {said}", source=path)


def render_slots(cfg: Any, module: Any) -> tuple[str, ...]:
    """The models a sample needs beyond the stage's, loaded only while rendering: the family's (`render_models`: the
    VAE, for its decoder), or what its render module's `render_models(pipeline, config)` says of this pipeline from
    the models' configs (an image encoder that only the DiT's config asks for)."""
    ask = getattr(module, "render_models", None)
    if ask is None:
        return tuple(cfg.family.render_models)
    return tuple(ask(cfg.pipeline, cfg.models.sources(cfg.family).load_config))


def encode_prompts(ctx: Any, pipeline: Any, prompts: list[str], units: Optional[list[Any]] = None,
                   beside: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """The prompt units' outputs for each prompt (one sample each, batch dimension 1); `beside[k]`: what else prompt k's
    units read (an edit pipeline's images: its render module's `prompt_image_inputs`)."""
    import torch

    units = prompt_units(pipeline) if units is None else units
    out = []
    with torch.no_grad():
        for k, prompt in enumerate(prompts):
            given = dict(beside[k]) if beside is not None else {}
            state: dict[str, Any] = {"prompt": prompt, **given}
            for unit in units:
                state.update(unit(ctx, state))
            out.append({name: v for name, v in state.items() if name != "prompt" and name not in given})
    return out


def encode_validation(ctx: Any, cfg: Any, texts: ValidationTexts) -> list[dict[str, Any]]:
    """The encodings of a run's validation texts, each with its prompt's image where the encoder reads it."""
    beside = None
    if texts.images is not None:
        module, images = render_module(cfg), read_validation_images(cfg)
        beside = [module.prompt_image_inputs(cfg.pipeline, images[i]) for i in texts.images]
    return encode_prompts(ctx, cfg.pipeline, texts.texts, sample_prompt_units(cfg), beside)


def _cache(location: Any) -> Any:
    from ..cache.cache import Cache

    return location if isinstance(location, Cache) else Cache(location)


def store_encoded(cache_dir: Any, prompts: list[str], key_hash: str, encoded: list[dict[str, Any]],
                  kind: PromptFile = VALIDATION) -> str:
    """Write encoded prompts (the validation prompts, or `kind`'s) beside the cache's entries, sealed with their checksum (whole: a
    rename or one PUT); where."""
    from safetensors.torch import save

    tensors, none = {}, []
    for i, values in enumerate(encoded):
        for name, value in values.items():
            if value is None:
                none.append(f"{i}.{name}")
            else:
                tensors[f"{i}.{name}"] = value.detach().to("cpu").contiguous().clone()
    meta = {META_KEY: json.dumps({"prompts": prompts, "key": prompts_key(prompts, key_hash), "none": none})}
    cache = _cache(cache_dir)
    shown = cache.describe(kind.name)
    body = save(tensors, metadata=meta)
    sealed = save(tensors, metadata={**meta, DIGEST_KEY: content_digest(header_of_bytes(body, shown), body)})
    read_encoded(sealed, shown, kind)  # the digest covers the tensor table, which the added metadata does not move
    cache.store.write(kind.name, sealed)
    return shown


def load_encoded(cache_dir: Any, prompts: list[str], key_hash: str, manifest: Any = None,
                 kind: PromptFile = VALIDATION) -> list[dict[str, Any]]:
    """The encoded validation prompts (or `kind`'s) stored by stage 1, checked whole (cache/encoded_prompts.py: the checksum,
    these prompts, each output as the cache's entries hold it, finite values); a one-line error naming the file
    when they are missing, stale or damaged. `manifest`: the cache's, when the caller has read it already."""
    cache = _cache(cache_dir)
    shown = cache.describe(kind.name)
    try:
        data = cache.store.read(kind.name)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise BackendError(f"the cache holds no {kind.what}; {kind.hint}", source=cache.location) from None
    except OSError as exc:
        raise BackendError(f"unreadable {kind.what} ({exc.strerror or exc}); {kind.hint}", source=shown) from None
    stored = read_encoded(data, shown, kind)
    if stored.key != prompts_key(prompts, key_hash) or stored.prompts != list(prompts):
        raise BackendError(f"the cache's {kind.what} are for {stored.prompts!r}, not these; {kind.hint}",
                           source=shown)
    manifest = manifest if manifest is not None else cache.read_manifest()
    if manifest is not None:
        check_against_cache(stored, cache, manifest, shown, kind)
    tensors = load_tensors(data, stored.header, shown)
    out: list[dict[str, Any]] = [{} for _ in prompts]
    for i, values in enumerate(stored.values):
        for output, info in values.items():
            value = None if info is None else tensors[f"{i}.{output}"]
            if value is not None and not finite(value):
                raise BackendError(f"the {kind.one} {i} ({prompts[i][:40]!r}) has NaN or infinite "
                                   f"values in {output}; {kind.hint}", source=shown)
            out[i][output] = value
    return out


def empty_prompt_encoding(cfg: Any, plan: Any, provider: Any, ctx: Any, dtype: Any = None) -> Optional[dict[str, Any]]:
    """The prompt units' outputs for the empty prompt, which CaptionDropout puts in place of a dropped caption's
    (caption_dropout.py); None when the plan has no CaptionDropout. Stage 2 reads them from beside the cache
    (checked whole, cast to `dtype` as its entries are); the unsplit run encodes them with its own encoders."""
    from ..cache.encoded_prompts import EMPTY_PROMPT
    from ..caption_dropout import CAPTION_DROPOUT
    from ..data.batching import cast_floating

    if CAPTION_DROPOUT not in plan.train_units:
        return None
    cache_dir = getattr(provider, "cache_dir", None)
    if cache_dir is None:
        return encode_prompts(ctx, cfg.pipeline, [""])[0]
    values = load_encoded(cache_dir, [""], getattr(provider, "key_hash", None) or "", kind=EMPTY_PROMPT)[0]
    return values if dtype is None else {k: cast_floating(v, dtype) for k, v in values.items()}


class Validator:
    """Renders the validation prompts at checkpoints of one run: on the main process, which writes the samples, and
    under an engine that shards the trained weights on every process with it (`write` False on the others)."""

    def __init__(self, cfg: Any, plan: Any, output: Path, cache_dir: Optional[Path], key_hash: Optional[str],
                 write: bool = True):
        self.cfg, self.plan, self.output = cfg, plan, Path(output)
        self.write = write  # False: a process that renders with the main one (a sharded model) but writes nothing
        self.prompts = list(cfg.validation.prompts)
        self.texts = validation_texts(cfg)
        spec = guidance_of(cfg)
        self.guidance = None if spec is None else spec.default if cfg.validation.guidance is None \
            else cfg.validation.guidance
        self.seed = cfg.seed if cfg.validation.seed is None else cfg.validation.seed
        units = sample_prompt_units(cfg)
        live = all(m in plan.train_models for u in units for m in u.models)  # trained text encoders, or unsplit
        self.encoded = None if live or cache_dir is None else load_encoded(cache_dir, self.texts.keyed, key_hash or "")
        self.render_module = render_module(cfg)
        self.render_slots = render_slots(cfg, self.render_module)
        self.images = read_validation_images(cfg)  # the edit images, or first frames, one per prompt
        self.inputs_written = False
        # checkpoints rendered before (a resumed run's): the page keeps showing them, oldest first
        folder = self.output / SAMPLES_DIR
        self.pages: list[str] = sorted((p.name for p in folder.iterdir() if p.is_dir() and p.name != INPUTS_DIR),
                                       key=lambda n: (folder / n).stat().st_mtime) if folder.is_dir() else []

    def render(self, name: str, models: dict[str, Any], ctx: Any, accelerator: Any) -> list[Path]:
        """Render every prompt with the current weights; write the PNGs, the contact sheet and the page."""
        import torch

        raw = {slot: accelerator.unwrap_model(m) if isinstance(m, torch.nn.Module) else m for slot, m in models.items()}
        extra = [s for s in self.render_slots if s not in raw]
        loaded = self.cfg.models.sources(self.cfg.family).load(extra, torch_dtype=torch.float32) if extra else {}
        loaded.update(self._other_experts(torch))
        everything = {**raw, **loaded}
        if self.cfg.models.expert is not None and self.cfg.models.boundary_ratio is not None:
            experts = self.cfg.family.experts
            own = {self.cfg.models.expert: everything[experts.slot]}
            everything["experts"] = {experts.subfolder(n): own.get(n, everything.get(f"expert:{n}")) for n in experts.names}
            everything["boundary_ratio"] = self.cfg.models.boundary_ratio
        embeds = self.encoded if self.encoded is not None else encode_validation(ctx, self.cfg, self.texts)
        width, height = self.cfg.units.image_size.target(1024, 1024, 16)
        modes = {slot: m.training for slot, m in everything.items() if isinstance(m, torch.nn.Module)}
        folder = self.output / SAMPLES_DIR / name
        paths = []
        try:
            for m in everything.values():
                if isinstance(m, torch.nn.Module):
                    m.eval()
            with torch.no_grad():
                for k, values in enumerate(embeds[:len(self.prompts)]):
                    generator = torch.Generator("cpu").manual_seed(self.seed * 1000 + k)
                    negative = self.texts.negatives[k]
                    image = self.render_module.render(self.cfg.pipeline, everything, values, width, height,
                                                      self.cfg.validation.inference_steps, generator,
                                                      guidance=self.guidance,
                                                      negative=None if negative is None else embeds[negative],
                                                      **({"image": self.images[k]} if self.images else {}))
                    image, sound = image if isinstance(image, tuple) else (image, None)
                    if not self.write:
                        continue
                    path = folder / f"{k}.png"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    _save_png(image, path)
                    if sound is not None:  # a clip's sound track, beside its frames
                        save_wav(sound, path.with_suffix(".wav"))
                    paths.append(path)
        finally:
            for slot, training in modes.items():
                everything[slot].train(training)
            loaded.clear()
            gc.collect()
        if self.write:
            self._sheet(name, paths)
            self._page(name)
        return paths

    def _other_experts(self, torch: Any) -> dict[str, Any]:
        """{"expert:NAME": model} of the experts a run does not train, loaded frozen in the compute dtype for the
        time of a render: a sample of a two-expert model is drawn by both, the trained one with its LoRA."""
        models, experts = self.cfg.models, self.cfg.family.experts
        if models.expert is None or experts is None or models.boundary_ratio is None:
            return {}
        dtype = getattr(torch, self.cfg.precision.compute_dtype)
        return {f"expert:{name}": replace(models, expert=name).sources(self.cfg.family).load([experts.slot], torch_dtype=dtype)[experts.slot]
                for name in experts.names if name != models.expert}

    def _sheet(self, name: str, paths: list[Path]) -> None:
        from PIL import Image

        images = [Image.open(p).convert("RGB") for p in paths]
        width, height = sum(i.width for i in images), max(i.height for i in images)
        sheet = Image.new("RGB", (width, height), "white")
        x = 0
        for image in images:
            sheet.paste(image, (x, 0))
            x += image.width
        _save_png(sheet, self.output / SAMPLES_DIR / f"{name}.png")

    def _page(self, name: str) -> None:
        if name in self.pages:
            self.pages.remove(name)
        self.pages.append(name)
        samples_page(self.output, self.plan.pipeline, self.prompts, self.pages, self._inputs())

    def _inputs(self) -> bool:
        """The --validation_image of each prompt as samples/inputs/k.png, beside the samples it gave (the page's first
        column); False without them."""
        if not self.images:
            return False
        if not self.inputs_written:  # once a run (a resumed run's images may be other files)
            for k, image in enumerate(self.images):
                path = self.output / SAMPLES_DIR / INPUTS_DIR / f"{k}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                _save_png(image, path)
            self.inputs_written = True
        return True


def samples_page(output: Path, title: str, prompts: list[str], names: list[str], inputs: bool = False) -> None:
    """OUTPUT/samples.html: a row per prompt, a column per rendering (`names`: the folders under OUTPUT/samples/,
    oldest first), each cell the prompt's sample there (`k.png`, a clip `k.mp4`, and its sound `k.wav`, or a song alone), with the
    --validation_image inputs as the first column when `inputs`."""
    folder = output / SAMPLES_DIR
    head = ("<th>input</th>" if inputs else "") + "".join(f"<th>{html.escape(n)}</th>" for n in names)
    rows = []
    for k, prompt in enumerate(prompts):
        given = f'<td><img src="{SAMPLES_DIR}/{INPUTS_DIR}/{k}.png" alt="input"></td>' if inputs else ""
        cells = []
        for n in names:
            where = f"{SAMPLES_DIR}/{html.escape(n)}/{k}"
            heard = (folder / n / f"{k}.wav").is_file()
            shown = (f'<video controls src="{where}.mp4"></video>' if (folder / n / f"{k}.mp4").is_file()
                     else "" if heard and not (folder / n / f"{k}.png").is_file()  # a song alone
                     else f'<img src="{where}.png" alt="{html.escape(n)}">')
            sound = f'{"<br>" if shown else ""}<audio controls src="{where}.wav"></audio>' if heard else ""
            cells.append(f"<td>{shown}{sound}</td>")
        rows.append(f"<tr><th class=p>{html.escape(prompt)}</th>{given}{''.join(cells)}</tr>")
    page = ("<!doctype html><meta charset=utf-8><title>unitgraph samples</title>"
            "<style>body{font-family:sans-serif}td,th{padding:4px;vertical-align:top}th.p{text-align:left;"
            "max-width:16em}img,video{image-rendering:pixelated;width:160px}</style>"
            f"<h1>{html.escape(title)}: validation samples</h1>"
            f"<table><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>\n")
    write_text_atomic(output / SAMPLES_PAGE, page)


def _save_png(image: Any, path: Path) -> None:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    write_bytes_atomic(path, buffer.getvalue())


def save_wav(sound: Any, path: Path) -> None:
    """A `family.Sound` as a 16-bit PCM WAV file (data/audio.wav_bytes), written whole or not at all."""
    from ..data.audio import wav_bytes

    write_bytes_atomic(path, wav_bytes(sound.samples.detach().float().cpu().numpy(), sound.rate))

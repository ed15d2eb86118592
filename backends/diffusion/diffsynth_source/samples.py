"""Validation samples of a DiffSynth pipeline's run, drawn by the pipeline's own `__call__`.

At each checkpoint (or every `--validation_steps` optimizer steps), each `--validation_prompt` is rendered with the
weights being trained: DiffSynth's `__call__` with the prompt, `--validation_negative_prompt`,
`--validation_guidance` as its `cfg_scale` (its own default without it), `--validation_inference_steps`,
`--validation_seed` (else `--seed`) and the run's `--height`/`--width` (else DiffSynth's defaults), as
`OUTPUT/samples/<checkpoint or step-N>/<k>.png` (a clip as `<k>.mp4`, with its sound track where the pipeline draws
one: MOVA's, at its audio VAE's rate; a song as `<k>.wav`, of the `__call__`'s default length: ACE-Step's 60 s; a
pipeline that starts from a first frame, or edits a picture, is handed prompt k's `--validation_image`);
OUTPUT/samples.html shows every rendering side by side. The whole pipeline draws a sample, so models the stage does not train with (stage 2's text
encoder, or a VAE whose encoding went to stage 1) are loaded while it renders, from the files the command names, and
released after; their files must then be on disk in stage 2 too.
Rendering does not change what is trained: `__call__` takes its noise from its own seeded generator, every training
step seeds torch's stream itself, the scheduler is put back into training mode and the models into train mode.
Under ZeRO-3 and FSDP2, whose processes each hold a shard of the trained weights, every process draws the samples
inside the engine's forward (sharding.ShardedTraining.within), which gathers the weights as for a step, and the
main process writes them.
"""

from __future__ import annotations

import inspect
import io
from pathlib import Path
from typing import Any, Callable

from unitgraph.atomic import write_bytes_atomic

from ..errors import BackendError

__all__ = ["Renderer", "SAMPLES_DIR"]

SAMPLES_DIR = "samples"


class Renderer:
    """Draws the run's validation prompts through `pipe.__call__` (see the module docstring)."""

    def __init__(self, setup: Any, pipe: Any, stage_models: list[str], load: Callable[[list[str]], Any]):
        args = setup.args
        self.title = setup.glue.name
        self.prompts = list(args.validation_prompt or [])
        self.pipe = pipe
        self.missing = sorted(setup.given - set(stage_models))
        self.load = load
        taken = inspect.signature(type(pipe).__call__).parameters
        wanted = {"negative_prompt": args.validation_negative_prompt, "cfg_scale": args.validation_guidance,
                  "height": args.height, "width": args.width,
                  "seed": args.validation_seed if args.validation_seed is not None else args.seed,
                  "num_inference_steps": args.validation_inference_steps, "rand_device": "cpu",
                  "num_frames": args.num_frames if setup.glue.media == "video" else None,
                  **setup.options}  # its own flags (HiDream-O1's noise scale), as its training inputs have them
        self.kwargs = {k: v for k, v in wanted.items() if v is not None and k in taken}
        self.sound = bool(setup.glue.audio)  # `__call__` returns (frames, sound)
        self.rate = setup.glue.sample_rate if setup.glue.media == "audio" else 0  # `__call__` returns a song
        self.tensors = tuple(t.attribute for t in setup.glue.tensors)  # read beside the models it borrows
        self.frames: list[Any] = []
        # the picture a sample starts from (a clip's first frame) or edits, by the keyword `__call__` takes it by
        self.picture = "edit_image" if setup.glue.edits else "input_image"
        if setup.glue.first_frame or setup.glue.edits:  # read now: a missing or damaged file stops the run early
            from ..train.validation import read_images

            self.frames = read_images(args.validation_image or ())
        if "progress_bar_cmd" in taken:
            self.kwargs["progress_bar_cmd"] = lambda iterable, **_kw: iterable

    def __bool__(self) -> bool:
        return bool(self.prompts)

    def page(self, output: Path) -> None:
        """OUTPUT/samples.html over every rendering under OUTPUT/samples/, in the order they were drawn (a resumed
        run's earlier ones included)."""
        from ..train.validation import samples_page

        root = output / SAMPLES_DIR
        names = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: (p.stat().st_mtime_ns, p.name)) \
            if root.is_dir() else []
        samples_page(output, self.title, self.prompts, [p.name for p in names])

    def render(self, folder: Path, write: bool = True) -> list[Path]:
        """Each prompt's sample under `folder`, with the models the stage lacks loaded for the while; without
        `write`, drawn only (a process other than the main one taking part in a sharded engine's forward)."""
        import torch

        pipe = self.pipe
        saved = {name: getattr(pipe, name) for name in self.missing}
        modes = {name: m.training for name, m in pipe.named_children()}
        written = []
        try:
            if self.missing:
                side = self.load(self.missing)
                for name in self.missing:
                    pipe._modules.pop(name, None)
                    setattr(pipe, name, getattr(side, name))
                for name in ("tokenizer", "tokenizer_2", "processor", *self.tensors):
                    if getattr(pipe, name, None) is None and getattr(side, name, None) is not None:
                        setattr(pipe, name, getattr(side, name))
            pipe.eval()
            with torch.random.fork_rng(devices=[]):
                for k, prompt in enumerate(self.prompts):
                    first = {self.picture: self.frames[k]} if self.frames else {}
                    try:
                        image = pipe(prompt=prompt, **self.kwargs, **first)
                    except Exception as exc:  # DiffSynth's own code: one line naming the prompt
                        raise BackendError(f"rendering --validation_prompt {prompt!r} through {type(pipe).__name__} "
                                           f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}") from None
                    if write:
                        folder.mkdir(parents=True, exist_ok=True)
                        written.append(_save(image, folder / str(k), pipe if self.sound else None, self.rate))
        finally:
            for name, value in saved.items():
                pipe._modules.pop(name, None)
                setattr(pipe, name, value)
            for name, module in pipe.named_children():
                module.train(modes.get(name, False))
            pipe.scheduler.set_timesteps(1000, training=True)
        return written


def _save(drawn: Any, stem: Path, sounding: Any = None, rate: int = 0) -> Path:
    """A drawn image as `stem`.png, a drawn video (a list of frames) as `stem`.mp4 (H.264, 16 frames a second,
    written beside and renamed, so no half-written clip is left); with `sounding` (the pipeline, which drew
    (frames, sound)), the clip at 24 frames a second with its sound track (AAC) at the audio VAE's rate; a drawn song
    (a (1, channels, samples) tensor) as `stem`.wav at `rate`."""
    import os

    if rate:
        from ..family import Sound
        from ..train.validation import save_wav

        path = stem.with_suffix(".wav")
        save_wav(Sound(drawn.reshape(-1, drawn.shape[-1]), rate), path)
        return path

    if isinstance(drawn, (list, tuple)):
        from ..data.video import write_clip

        fps, sound = 16, None
        if sounding is not None:
            drawn, samples = drawn
            fps, sound = 24, (samples.float().clamp(-1, 1).numpy(), int(sounding.audio_vae.sample_rate))
        path = stem.with_suffix(".mp4")
        partial = stem.with_name(stem.name + ".partial.mp4")
        try:
            write_clip(partial, list(drawn), fps=fps, audio=sound)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return path
    buffer = io.BytesIO()
    drawn.save(buffer, format="PNG")
    path = stem.with_suffix(".png")
    write_bytes_atomic(path, buffer.getvalue())
    return path

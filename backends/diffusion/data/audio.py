"""Sound tracks, read through PyAV (the wheel that reads the video clips): for pipelines whose dataset names a file
whose sound is an input (DiffSynth-Studio's `input_audio` column, often the clip's own mp4).

`read_audio` gives the whole track as float32 samples (channels, samples) and its sample rate, or None for a file
without a sound track (DiffSynth then trains without audio, as here). `resample` converts a track to another rate
with ffmpeg's resampler. Problems with a file that has a track but cannot be decoded are `VideoProblem`s, said as
the rest of a sentence, as for clips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .video import VideoProblem

__all__ = ["read_audio", "resample", "has_audio"]


def _open(path: Path) -> Any:
    import av

    try:
        return av.open(str(path))
    except Exception as exc:  # av.error.InvalidDataError and friends
        text = str(exc).strip().splitlines()
        raise VideoProblem(f"is not a readable media file ({type(exc).__name__}: {text[0] if text else ''})") from None


def has_audio(path: Path) -> bool:
    """Whether a media file has a sound track (read from its header)."""
    container = _open(path)
    try:
        return bool(container.streams.audio)
    finally:
        container.close()


def _planar(frame: Any, resampler: Any) -> list[Any]:
    return [f.to_ndarray() for f in resampler.resample(frame)]


def read_audio(path: Path) -> Optional[tuple[Any, int]]:
    """(samples, rate): the file's first sound track as float32 (channels, samples) at its own rate; None without one."""
    import av
    import numpy as np

    container = _open(path)
    try:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="fltp")  # planar float, the track's own layout and rate
        chunks: list[Any] = []
        rate = int(stream.codec_context.sample_rate or 0)
        try:
            for frame in container.decode(audio=0):
                rate = int(frame.sample_rate or rate)
                chunks.extend(_planar(frame, resampler))
            chunks.extend(_planar(None, resampler))
        except Exception as exc:
            if not chunks:
                raise VideoProblem(f"has a sound track that cannot be decoded ({type(exc).__name__})") from None
    finally:
        container.close()
    if not chunks or rate <= 0:
        return None
    return np.concatenate(chunks, axis=1).astype(np.float32), rate


def resample(samples: Any, rate: int, target: int) -> Any:
    """float32 (channels, samples) at `rate` -> at `target`, through ffmpeg's resampler (swresample)."""
    import av
    import numpy as np

    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if int(rate) == int(target):
        return samples
    layout = {1: "mono", 2: "stereo"}.get(samples.shape[0])
    if layout is None:
        raise VideoProblem(f"has a sound track of {samples.shape[0]} channels (mono or stereo expected)")
    frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=layout)
    frame.sample_rate = int(rate)
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=int(target))
    out = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
    return np.concatenate(out, axis=1).astype(np.float32) if out else np.zeros((samples.shape[0], 0), np.float32)

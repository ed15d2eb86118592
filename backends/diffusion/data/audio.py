"""Sound tracks, read through PyAV (the wheel that reads the video clips): for pipelines whose dataset names a file
whose sound is an input (DiffSynth-Studio's `input_audio` column, often the clip's own mp4).

`read_audio` gives the track as float32 samples (channels, samples) and its sample rate, or None for a file
without a sound track (DiffSynth then trains without audio, as here). `resample` converts a track to another rate
with ffmpeg's resampler. Problems with a file that has a track but cannot be decoded are `VideoProblem`s, said as
the rest of a sentence, as for clips.

Bounds, checked from the header before a sample is decoded: a sample rate between MIN_SAMPLE_RATE and
MAX_SAMPLE_RATE (a 40 kB WAV whose header says 1 Hz is 11 hours of sound, which resampling to 16 kHz would turn
into gigabytes), mono or stereo. A track is decoded only as far as the clip needs (`seconds`: the dataset passes
`clip_seconds(num_frames)`), never whole: an hour of FLAC costs what its first seconds cost. A track that holds no
sample at all (a WAV of zero samples) is refused, not trained as a clip without sound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .video import VideoProblem

__all__ = ["read_audio", "resample", "has_audio", "probe_audio", "clip_seconds", "wav_bytes", "MIN_SAMPLE_RATE",
           "MAX_SAMPLE_RATE"]

MIN_SAMPLE_RATE = 1_000  # Hz: below any recorded sound track (telephony is 8 kHz)
MAX_SAMPLE_RATE = 384_000  # Hz: the highest rate of studio formats
MAX_CHANNELS = 2  # mono or stereo, as the pipelines read sound (DiffSynth's convert_to_stereo)
MIN_CLIP_FRAME_RATE = 8.0  # fps: the slowest frame rate a pipeline cuts a clip's sound at (LTX-2: 24)


def clip_seconds(num_frames: int) -> float:
    """The most sound a clip of `num_frames` frames needs, in seconds: its length at the slowest frame rate any
    pipeline cuts sound at, and a second for resampling's edge."""
    return max(1, int(num_frames)) / MIN_CLIP_FRAME_RATE + 1.0


def _open(path: Path) -> Any:
    import av

    try:
        return av.open(str(path))
    except Exception as exc:  # av.error.InvalidDataError and friends
        text = str(exc).strip().splitlines()
        raise VideoProblem(f"is not a readable media file ({type(exc).__name__}: {text[0] if text else ''})") from None


def has_audio(path: Path) -> bool:
    """Whether a media file has a sound track (read from its header; a track outside the bounds is a VideoProblem)."""
    return probe_audio(path) is not None


def probe_audio(path: Path) -> Optional[int]:
    """The sample rate of the file's first sound track, from its header (None without one); a rate or a channel count
    outside the bounds is a VideoProblem, before a sample is decoded."""
    container = _open(path)
    try:
        if not container.streams.audio:
            return None
        return _checked_rate(container.streams.audio[0])
    finally:
        container.close()


def _checked_rate(stream: Any) -> int:
    context = stream.codec_context
    rate = _bounded(int(context.sample_rate or 0))
    channels = int(getattr(context, "channels", 0) or 0)
    if channels > MAX_CHANNELS:
        raise VideoProblem(f"has a sound track of {channels} channels (mono or stereo expected)")
    return rate


def _bounded(rate: int) -> int:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise VideoProblem(f"has a sound track at {rate} Hz, outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz (a damaged "
                           "or hand-made header?)")
    return rate


def _planar(frame: Any, resampler: Any) -> list[Any]:
    return [f.to_ndarray() for f in resampler.resample(frame)]


def read_audio(path: Path, seconds: Optional[float] = None) -> Optional[tuple[Any, int]]:
    """(samples, rate): the file's first sound track as float32 (channels, samples) at its own rate, its first
    `seconds` (None: the whole track); None without a track. Decoding stops once `seconds` are read."""
    import av
    import numpy as np

    container = _open(path)
    try:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        rate = _checked_rate(stream)
        wanted = None if seconds is None else max(1, int(np.ceil(float(seconds) * rate)))
        resampler = av.AudioResampler(format="fltp")  # planar float, the track's own layout and rate
        chunks: list[Any] = []
        have = 0
        try:
            for frame in container.decode(audio=0):
                if not chunks and int(frame.sample_rate or rate) != rate:  # HE-AAC: the header says half the rate
                    rate = _bounded(int(frame.sample_rate))
                    wanted = None if seconds is None else max(1, int(np.ceil(float(seconds) * rate)))
                if int(frame.sample_rate or rate) != rate:
                    raise VideoProblem(f"has a sound track whose rate changes ({rate} Hz, then {frame.sample_rate} Hz)")
                for chunk in _planar(frame, resampler):
                    chunks.append(chunk)
                    have += chunk.shape[1]
                if wanted is not None and have >= wanted:
                    break
            else:
                chunks.extend(_planar(None, resampler))
        except VideoProblem:
            raise
        except Exception as exc:
            if not chunks:
                raise VideoProblem(f"has a sound track that cannot be decoded ({type(exc).__name__})") from None
    finally:
        container.close()
    samples = np.concatenate(chunks, axis=1).astype(np.float32) if chunks else np.zeros((1, 0), np.float32)
    if samples.shape[1] == 0:
        raise VideoProblem("has a sound track without a single sample (0 s of sound): remove the track or the file "
                           "from the row")
    if not np.isfinite(samples).all():  # a float WAV can hold them: named here, not blamed on the audio VAE
        raise VideoProblem("has a sound track with non-finite samples (NaN or infinity)")
    if samples.shape[0] > MAX_CHANNELS:
        raise VideoProblem(f"has a sound track of {samples.shape[0]} channels (mono or stereo expected)")
    return (samples if wanted is None else samples[:, :wanted]), rate


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


def wav_bytes(samples: Any, rate: int) -> bytes:
    """float (channels, n) samples as a 16-bit PCM WAV file's bytes (the standard library's writer: every browser
    plays it); samples outside [-1, 1] are clipped, as any 16-bit writer must."""
    import io
    import wave

    import numpy as np

    samples = np.asarray(samples, dtype=np.float32)
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").T.copy()  # frames x channels, interleaved
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(int(samples.shape[0]))
        out.setsampwidth(2)
        out.setframerate(int(rate))
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()

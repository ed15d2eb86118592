"""Video clips as DiffSynth-Studio reads them, through PyAV (ffmpeg's libraries in a wheel: no system ffmpeg).

A clip is the first `num_frames` frames of the file (DiffSynth's LoadVideo: frames sampled from the
video's prefix, at its own frame rate); a file with fewer frames gives the largest 4k+1 it holds, as
DiffSynth shortens it (`frames_for`). A still image in a video column is a one-frame clip.

Problems are `VideoProblem`s, said as the rest of a sentence ("has no video stream"); the dataset
adds the row and the file and skips or stops the sample as it does for images. Decoding stops as soon
as the clip has its frames, so a long video costs only its prefix.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

__all__ = ["VideoProblem", "frames_for", "probe_clip", "read_clip", "write_clip", "STILL_SUFFIXES"]

STILL_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
TIME_FACTOR, TIME_REMAINDER = 4, 1  # clip lengths are 4k+1 frames (the video VAE's temporal factor)


class VideoProblem(Exception):
    """What is wrong with a video file, as the rest of a sentence."""


def frames_for(available: int, wanted: int) -> int:
    """Frames a clip takes: `wanted`, or when the file has fewer, the largest 4k+1 <= available (at least 1).

    >>> frames_for(100, 81), frames_for(20, 81), frames_for(1, 81)
    (81, 17, 1)
    """
    n = min(int(available), int(wanted))
    while n > 1 and n % TIME_FACTOR != TIME_REMAINDER:
        n -= 1
    return max(1, n)


def _open(path: Path) -> Any:
    import av

    try:
        container = av.open(str(path))
    except Exception as exc:  # av.error.InvalidDataError and friends: many types for a damaged file
        raise VideoProblem(f"is not a readable video ({type(exc).__name__}: {_first_line(exc)})") from None
    if not container.streams.video:
        container.close()
        raise VideoProblem("has no video stream")
    return container


def check_pixels(width: int, height: int) -> None:
    """The pixel limit images have (PIL's `Image.MAX_IMAGE_PIXELS`), for a video's frames: refused before decoding."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise VideoProblem(f"has {width}x{height} px frames ({width * height} pixels), more than the {limit} pixels "
                           "an image may have (Image.MAX_IMAGE_PIXELS): a decompression bomb?")


def probe_clip(path: Path) -> tuple[int, int]:
    """(width, height) of a video file without decoding a frame; VideoProblem when it cannot be one."""
    container = _open(path)
    try:
        stream = container.streams.video[0]
        return int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    finally:
        container.close()


def read_clip(path: Path, num_frames: int) -> list[Any]:
    """The clip of a video file: `frames_for(frames in the file, num_frames)` RGB PIL frames from its start."""
    from PIL import Image

    if Path(path).suffix.lower() in STILL_SUFFIXES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below says it in one line
            with Image.open(path) as img:
                check_pixels(*img.size)
                return [img.convert("RGB")]
    container = _open(path)
    frames: list[Any] = []
    try:
        context = container.streams.video[0].codec_context
        check_pixels(int(context.width or 0), int(context.height or 0))
        for frame in container.decode(video=0):
            check_pixels(frame.width, frame.height)  # a stream may change size midway: each frame before converting
            frames.append(frame.to_image().convert("RGB"))
            if len(frames) >= num_frames:
                break
    except VideoProblem:
        raise
    except Exception as exc:  # a stream damaged after its first frames
        if not frames:
            raise VideoProblem(f"cannot be decoded ({type(exc).__name__}: {_first_line(exc)})") from None
    finally:
        container.close()
    if not frames:
        raise VideoProblem("has no frames")
    return frames[: frames_for(len(frames), num_frames)]


def write_clip(path: Path, frames: Sequence[Any], fps: int = 8, audio: Any = None) -> Path:
    """Write RGB PIL frames (even sides) as an H.264 mp4 (yuv420p): the synthetic datasets' clips. `audio`:
    (float32 samples (channels, n), rate), a sound track written beside the frames (AAC)."""
    import av
    import numpy as np

    path = Path(path)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "12"}
        sound = None
        if audio is not None:  # every stream is added before the first packet is written
            samples, rate = np.ascontiguousarray(audio[0], dtype=np.float32), int(audio[1])
            sound = container.add_stream("aac", rate=rate, layout="stereo" if samples.shape[0] == 2 else "mono")
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.asarray(image.convert("RGB")), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            track = av.AudioFrame.from_ndarray(samples, format="fltp", layout=sound.layout.name)
            track.sample_rate, track.pts = rate, 0
            for packet in [*sound.encode(track), *sound.encode(None)]:
                container.mux(packet)
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The sound-track reader (backends/diffusion/data/audio.py) is a reader of user files: whatever a file holds, it
gives float32 samples within the documented bounds or one VideoProblem, decodes only what the clip needs, and
refuses a track without samples (docs/safety.md)."""

from __future__ import annotations

import io
import math
import wave
from pathlib import Path

import pytest

pytest.importorskip("av")
np = pytest.importorskip("numpy")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from unitgraph.backends.diffusion.data import audio  # noqa: E402
from unitgraph.backends.diffusion.data.audio import (MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, clip_seconds,  # noqa: E402
                                                     read_audio)
from unitgraph.backends.diffusion.data.video import VideoProblem  # noqa: E402

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def wav_bytes(rate: int, channels: int, frames: int, seed: int = 0) -> bytes:
    values = np.random.default_rng(seed).integers(-3000, 3000, size=frames * channels, dtype=np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(values.tobytes())
    return buffer.getvalue()


def write(tmp_path: Path, data: bytes, name: str = "s.wav") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@FAST
@given(rate=st.one_of(st.integers(1, 2 * MAX_SAMPLE_RATE), st.sampled_from([MIN_SAMPLE_RATE - 1, MIN_SAMPLE_RATE,
                                                                            16000, MAX_SAMPLE_RATE, MAX_SAMPLE_RATE + 1])),
       channels=st.integers(1, 3), frames=st.integers(0, 3000), seconds=st.floats(0.001, 2.0))
def test_a_wav_gives_bounded_samples_or_one_problem(tmp_path_factory, rate, channels, frames, seconds):
    path = write(tmp_path_factory.mktemp("wav"), wav_bytes(rate, channels, frames))
    good = MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE and channels <= 2 and frames > 0
    try:
        samples, got_rate = read_audio(path, seconds=seconds)
    except VideoProblem as exc:
        assert not good, exc
        return
    assert good and got_rate == rate
    assert samples.dtype == np.float32 and samples.shape[0] == channels
    assert 0 < samples.shape[1] <= min(frames, math.ceil(seconds * rate)) and np.isfinite(samples).all()


@FAST
@given(data=st.binary(max_size=400), cut=st.integers(0, 200))
def test_damaged_files_are_one_problem_never_another_error(tmp_path_factory, data, cut):
    folder = tmp_path_factory.mktemp("junk")
    whole = wav_bytes(16000, 2, 100)
    for blob in (data, whole[:cut] + data, whole[:44] + data):  # junk, a truncated header, a header over junk
        path = write(folder, blob)
        try:
            got = read_audio(path, seconds=0.5)
        except VideoProblem:
            continue
        assert got is None or (got[0].shape[1] > 0 and MIN_SAMPLE_RATE <= got[1] <= MAX_SAMPLE_RATE)


def test_a_one_hertz_header_is_refused_before_anything_is_decoded(tmp_path, monkeypatch):
    path = write(tmp_path, wav_bytes(1, 1, 20000))  # 40 kB that say 20000 s of sound
    monkeypatch.setattr(audio, "_planar", lambda *_a: pytest.fail("decoded"))
    with pytest.raises(VideoProblem, match=f"at 1 Hz, outside {MIN_SAMPLE_RATE}"):
        audio.probe_audio(path)
    with pytest.raises(VideoProblem, match="at 1 Hz"):
        read_audio(path, seconds=1.0)


def test_only_the_seconds_the_clip_needs_are_decoded(tmp_path, monkeypatch):
    path = write(tmp_path, wav_bytes(48000, 1, 48000 * 30))  # 30 s
    decoded = []
    real = audio._planar
    monkeypatch.setattr(audio, "_planar", lambda frame, r: decoded.append(1) or real(frame, r))
    samples, rate = read_audio(path, seconds=0.5)
    assert samples.shape == (1, 24000) and rate == 48000
    assert len(decoded) * 4608 < 48000 * 2  # frames of at most a few thousand samples: about a second, not 30


def test_a_track_without_samples_is_refused_not_trained_as_silence(tmp_path):
    from unitgraph.backends.diffusion.data.dataset import DiffusionDataset, SampleError

    write(tmp_path, wav_bytes(16000, 2, 0), "empty.wav")
    (tmp_path / "metadata.csv").write_text("input_audio,prompt\nempty.wav,a sound\n")
    with pytest.raises(VideoProblem, match="without a single sample"):
        read_audio(tmp_path / "empty.wav", seconds=1.0)
    dataset = DiffusionDataset(tmp_path, tmp_path / "metadata.csv", ["input_audio", "prompt"],
                               data_file_keys=["input_audio"], required=("input_audio", "prompt"), image_params=(),
                               audio_params=("input_audio",), num_frames=9)
    with pytest.raises(SampleError, match="row 1: 'empty.wav' .* without a single sample"):
        dataset.sample(0)


def test_the_clip_is_cut_before_it_is_resampled_with_the_same_samples():
    torch = pytest.importorskip("torch")
    from unitgraph.backends.diffusion.data.audio import resample
    from unitgraph.backends.diffusion.families.ltx2.units import FRAME_RATE, clip_audio

    rate, seconds = 44100, 5.0
    t = np.arange(int(rate * seconds), dtype=np.float32) / rate
    track = np.stack([np.sin(2 * np.pi * 330 * t), 0.5 * np.cos(2 * np.pi * 220 * t)]).astype(np.float32)
    got = clip_audio((track, rate), 9, 16000)
    whole = torch.from_numpy(resample(track, rate, 16000).copy())[:, :int(9 / FRAME_RATE * 16000)]
    assert got.shape == whole.shape and torch.allclose(got, whole, atol=1e-6)
    assert clip_seconds(9) >= 9 / FRAME_RATE  # the dataset reads at least what the unit cuts

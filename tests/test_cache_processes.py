"""A cache you can trust across processes (docs/cache.md, 'Crash safety and resume'): SIGKILL and resume.
(Exact-once sharding over 2 processes is checked per pipeline by the conformance suite, 2-process training by
test_diffusion_backend.)

Each test runs the real `unitgraph train` command in subprocesses, so they are marked slow (they run in CI too).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

from unitgraph.backends.diffusion.cache.cache import Cache  # noqa: E402
from unitgraph.backends.diffusion.cache.entries import read_entry
from unitgraph.backends.diffusion.cache.verify import verify_cache
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402

VENV_BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}


def stage1_argv(tiny: Path, data: Path, out: Path, size: int) -> list[str]:
    return ["train", "--task", "sft:data_process", "--dataset_base_path", str(data),
            "--dataset_metadata_path", str(data / "metadata.csv"), "--model_paths", str(tiny), "--lora_base_model", "dit",
            "--max_pixels", str(size * size), "--output_path", str(out), "--no-progress"]


def entries(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((cache / "entries").iterdir())}


def assert_sound(cache: Path, count: int) -> dict:
    """Every entry verifies and every sample appears exactly once, with exactly one entry file each."""
    problems, stats = verify_cache(cache)
    assert problems == [], problems
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert [s["index"] for s in manifest["samples"]] == list(range(count))
    keys = [s["key"] for s in manifest["samples"]]
    assert len(set(keys)) == count and sorted(f"{k}.safetensors" for k in keys) == sorted(entries(cache))
    assert sorted(read_entry(cache / "entries" / f"{k}.safetensors")[1]["index"] for k in keys) == list(range(count))
    assert not list(cache.rglob("*.tmp")) and not (cache / "journal").exists()
    return manifest


@pytest.mark.slow
def test_sigkill_stage1_at_random_moments_then_resume(tiny, tmp_path):
    count, size = 20, 128  # ~0.05-0.1 s of VAE work per sample: kills land while entries are being written
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=count, size=size, seed=11)
    cache = tmp_path / "cache"
    argv = [str(VENV_BIN / "unitgraph"), *stage1_argv(tiny, data, cache, size)]
    rng = random.Random(5)
    kills = 0
    for attempt in range(2):  # each attempt is killed: 20 samples outlast two kills after 1-2 entries
        before = len(list(cache.glob("entries/*.safetensors")))
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
        # wait until this run has written a few new entries (or has ended), then kill it at a random moment
        target = before + rng.randint(1, 2)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if len(list(cache.glob("entries/*.safetensors"))) >= target:
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=60)
        # whatever moment it died at, the manifest lists only complete entries
        manifest = json.loads((cache / "manifest.json").read_text())
        cache_obj = Cache(cache)
        for record in manifest["entries"].values():
            assert cache_obj.check_entry(record) is None
        for record in cache_obj.read_journals():
            assert cache_obj.check_entry(record) is None
    assert kills >= 2
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reused" in done.stdout
    manifest = assert_sound(cache, count)
    # the resumed cache is bit for bit the one an uninterrupted run makes
    clean = tmp_path / "clean"
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the killed processes ran (OMP_NUM_THREADS=1): bit for bit the same arithmetic
    try:
        _stage1_in_process(tiny, data, clean, size)
    finally:
        torch.set_num_threads(threads)
    assert entries(clean) == entries(cache)
    assert json.loads((clean / "manifest.json").read_text())["samples"] == manifest["samples"]


def _stage1_in_process(tiny: Path, data: Path, clean: Path, size: int) -> None:
    run(make_args(task="sft:data_process", dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  model_paths=str(tiny), lora_base_model="dit", max_pixels=size * size, output_path=str(clean),
                  progress=False), echo=lambda _text: None)

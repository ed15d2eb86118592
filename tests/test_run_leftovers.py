"""What a run leaves behind (docs/safety.md): a failed run no folder it created and nothing it wrote when it made
nothing of value, a finished run no lock file, and the lock files removed without breaking the lock."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from clitools import cli, one_error_line

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from unitgraph.backends.diffusion.cache.store import release_flock, take_flock  # noqa: E402

SIZE = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    folder = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(folder, count=2, size=SIZE, seed=2)
    return folder


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """Metadata whose only row names a missing image: every sample is skipped, the run stops."""
    folder = tmp_path_factory.mktemp("bad")
    (folder / "metadata.csv").write_text("image,prompt\nmissing.png,a cat\n")
    return folder


def flags(tiny: Path, data: Path, task: str, out: Path, *extra: str) -> list[str]:
    source = ["--dataset_base_path", str(data)]
    if not task.endswith(":train"):
        source += ["--dataset_metadata_path", str(data / "metadata.csv")]
    return ["train", "--task", task, *source, "--model_paths", str(tiny), "--lora_base_model", "dit",
            "--lora_rank", "2", "--max_pixels", str(SIZE * SIZE), "--output_path", str(out), "--no-progress",
            "--no-plot", *extra]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(folder.rglob("*"))}


def locks(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.endswith(".lock"))


# --- a failed run ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["sft", "sft:split", "sft:data_process"])
def test_a_run_that_fails_on_bad_metadata_leaves_no_folder_and_a_users_folder_as_it_was(tiny, bad, tmp_path, capsys,
                                                                                         task):
    new = tmp_path / "new" / "deeper" / "out"  # its parents are new too
    code, _, err = cli(capsys, *flags(tiny, bad, task, new))
    one_error_line(code, err, "no usable samples")
    assert list(tmp_path.iterdir()) == []

    mine = tmp_path / "mine"  # an empty folder the user made
    mine.mkdir()
    code, _, err = cli(capsys, *flags(tiny, bad, task, mine))
    one_error_line(code, err, "no usable samples")
    assert list(mine.iterdir()) == []


def test_a_stage1_that_fails_leaves_no_cache_folder_nor_its_parents(tiny, bad, tmp_path, capsys):
    out, cache = tmp_path / "run", tmp_path / "caches" / "a" / "cache"
    code, _, err = cli(capsys, *flags(tiny, bad, "sft:split", out, "--cache_path", str(cache)))
    one_error_line(code, err, "no usable samples")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def fails_at_step(monkeypatch):
    """Make training stop with a one-line error at optimizer step `n` (set `.n`; 1: before any step is made)."""
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.train import loop

    real = loop._Run.optimizer_step

    class Stop:
        n = 1

    def optimizer_step(self, *args, **kwargs):
        if self.step + 1 >= Stop.n:
            raise BackendError(f"a failure at step {self.step + 1}")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loop._Run, "optimizer_step", optimizer_step)
    return Stop


@pytest.mark.slow
def test_a_run_that_fails_before_its_first_step_leaves_no_trace(tiny, data, tmp_path, capsys, fails_at_step):
    new = tmp_path / "new"
    code, _, err = cli(capsys, *flags(tiny, data, "sft", new))
    one_error_line(code, err, "a failure at step 1")
    assert not new.exists()

    # :split keeps the cache stage 1 made (reused by the next run), and nothing of the run
    split = tmp_path / "split"
    code, _, err = cli(capsys, *flags(tiny, data, "sft:split", split))
    one_error_line(code, err, "a failure at step 1")
    assert sorted(p.name for p in split.iterdir()) == ["cache"] and (split / "cache" / "manifest.json").is_file()
    assert locks(split) == []

    # --overwrite over a finished run: the earlier run's files are moved back, exactly as they were
    fails_at_step.n = 10 ** 9
    done = tmp_path / "done"
    code, _, err = cli(capsys, *flags(tiny, data, "sft", done))
    assert code == 0, err
    before = snapshot(done)
    fails_at_step.n = 1
    code, _, err = cli(capsys, *flags(tiny, data, "sft", done, "--overwrite"))
    one_error_line(code, err, "a failure at step 1")
    assert snapshot(done) == before

    # a run that made a step keeps what it made (its loss rows), to look at or --resume
    fails_at_step.n = 2
    code, _, err = cli(capsys, *flags(tiny, data, "sft", tmp_path / "later"))
    one_error_line(code, err, "a failure at step 2")
    assert len((tmp_path / "later" / "loss.csv").read_text().splitlines()) == 2


# --- lock files ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_lock_file_remains_after_a_finished_stage1_and_a_finished_run(tiny, data, tmp_path, capsys):
    cache, run, split = tmp_path / "cache", tmp_path / "run", tmp_path / "split"
    assert cli(capsys, *flags(tiny, data, "sft:data_process", cache))[0] == 0
    assert cli(capsys, *flags(tiny, cache, "sft:train", run))[0] == 0
    assert cli(capsys, *flags(tiny, data, "sft:split", split))[0] == 0
    assert (cache / "manifest.json").is_file() and (run / "unitgraph-run.json").is_file()
    assert (split / "cache" / "manifest.json").is_file()
    assert locks(tmp_path) == []
    # a lock file left by a killed run is taken over and removed too
    (cache / ".lock").write_bytes(b"")
    (run / ".unitgraph-run.lock").write_bytes(b"")
    assert cli(capsys, *flags(tiny, data, "sft:data_process", cache))[0] == 0
    assert cli(capsys, *flags(tiny, cache, "sft:train", run, "--overwrite"))[0] == 0
    assert locks(tmp_path) == []


def test_a_lock_file_removed_between_open_and_lock_is_not_a_lock(tmp_path, monkeypatch):
    """The race of removing a lock file: B opens the file, A (the holder) removes it and unlocks, C creates a new
    file and locks it, B's lock on the old file succeeds. B must see that the path now names another file and
    take the lock on that one, which C holds: B is refused instead of running beside C."""
    import fcntl

    from unitgraph.backends.diffusion.cache import store

    path = tmp_path / ".lock"
    a = take_flock(path)
    held: dict[str, int] = {}
    real = fcntl.flock

    def flock(fd: int, op: int) -> None:
        if "c" not in held:  # B has opened the old file: now A is done and C comes
            release_flock(a, path)
            monkeypatch.setattr(fcntl, "flock", real)
            held["c"] = take_flock(path)
            monkeypatch.setattr(fcntl, "flock", flock)
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(BlockingIOError):
        store.take_flock(path)  # B
    monkeypatch.setattr(fcntl, "flock", real)
    assert path.is_file() and os.fstat(held["c"]).st_ino == path.stat().st_ino
    release_flock(held["c"], path)
    assert not path.exists()


def _count_under_lock(path: str, counter: str, rounds: int) -> None:
    import time

    done = 0
    while done < rounds:
        try:
            fd = take_flock(Path(path))
        except BlockingIOError:
            time.sleep(0.0005)
            continue
        try:
            value = int(Path(counter).read_text())
            time.sleep(0.0002)  # a lost update shows if two processes were ever inside at once
            Path(counter).write_text(str(value + 1))
        finally:
            release_flock(fd, Path(path))
        done += 1


def test_processes_that_remove_the_lock_file_each_time_still_exclude_each_other(tmp_path):
    path, counter = tmp_path / ".lock", tmp_path / "counter"
    counter.write_text("0")
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_count_under_lock, args=(str(path), str(counter), 150)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    assert int(counter.read_text()) == 4 * 150
    assert not path.exists()

"""Object-store locations refused up front, in one line that never echoes a secret (docs/safety.md)."""

from __future__ import annotations

import os
import re

import pytest

from clitools import cli, one_error_line
from unitgraph.backends.diffusion.cache.location import masked_url, bucket_name_problem, open_store
from unitgraph.backends.diffusion.errors import BackendError


@pytest.mark.parametrize("url, fragment", [
    ("s3://bucket/new\nline", "control characters"),
    ("s3://bucket/tab\there", "control characters"),
    ("s3://Bucket_Name/x", "may hold only lowercase letters, digits, dots and hyphens"),
    ("s3://ab/x", "has 2 characters (a bucket name has 3 to 63)"),
    ("s3://-bucket/x", "must begin and end with a letter or a digit"),
    ("s3://my..bucket/x", "two dots in a row"),
    ("s3://192.168.1.1/x", "like an IP address"),
    ("s3://bucket/x?X-Amz-Signature=abc123secret", "presigned URL"),
])
def test_bad_locations_are_one_line_naming_the_problem(url, fragment):
    with pytest.raises(BackendError, match=re.escape(fragment)) as info:
        open_store(url)
    text = str(info.value)
    assert "\n" not in text and "abc123secret" not in text


def test_secrets_are_masked_in_messages():
    assert masked_url("s3://key:secret@bucket/p") == "s3://***@bucket/p"
    assert masked_url("s3://bucket/p?X-Amz-Credential=AKIA&X-Amz-Signature=deadbeef") == "s3://bucket/p?***"
    assert masked_url("s3://bucket/p") == "s3://bucket/p"
    assert bucket_name_problem("my-bucket.data") is None


def test_a_training_run_into_an_object_store_is_refused_before_anything_is_written(tiny, tmp_path, capsys,
                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "train", "--task", "sft:train", "--model_paths", str(tiny), "--lora_base_model", "dit",
                       "--dataset_base_path", str(tmp_path / "cache"),
                       "--output_path", "s3://bucket/run?X-Amz-Signature=abc123secret", "--no-progress")
    line = one_error_line(code, err, "--output_path of a training run is a local folder")
    assert "abc123secret" not in line
    assert os.listdir(tmp_path) == []  # no ./s3:/... folder


@pytest.mark.slow
def test_a_complete_cache_serves_read_only_and_an_incomplete_one_says_what_it_needs(tiny, tmp_path, monkeypatch):
    """As root nothing here is read-only by permission: the store's writes fail as a read-only mount makes them."""
    import errno
    import shutil

    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.cache.store import LocalStore
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.stages import run

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=3, size=32, seed=1)
    common = dict(model_paths=str(tiny), dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  lora_base_model="dit", lora_rank=4, max_pixels=1024, progress=False, plot=False)
    cache = tmp_path / "cache"
    run(make_args(task="sft:data_process", output_path=str(cache), **common), echo=lambda _t: None)
    partial = tmp_path / "partial"
    shutil.copytree(cache, partial)
    entry = next((partial / "entries").iterdir())
    entry.unlink()

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(LocalStore, "locked", read_only)
    monkeypatch.setattr(LocalStore, "write", read_only)
    monkeypatch.setattr(LocalStore, "create", read_only)
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    result = run(make_args(task="sft:split", output_path=str(tmp_path / "run"), cache_path=str(cache), **common),
                 echo=lambda _t: None)
    assert result.cache_reused and result.steps == 3
    assert {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before
    with pytest.raises(BackendError, match="the cache folder is read-only and needs 1 entry to compute"):
        run(make_args(task="sft:split", output_path=str(tmp_path / "run2"), cache_path=str(partial), **common),
            echo=lambda _t: None)

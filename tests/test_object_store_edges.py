"""Object-store locations refused up front, in one line that never echoes a secret (docs/safety.md)."""

from __future__ import annotations

import os
import re

import pytest

from clitools import cli, one_error_line
from unitgraph.backends.diffusion.cache.location import _safe, bucket_name_problem, open_store
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
    assert _safe("s3://key:secret@bucket/p") == "s3://***@bucket/p"
    assert _safe("s3://bucket/p?X-Amz-Credential=AKIA&X-Amz-Signature=deadbeef") == "s3://bucket/p?***"
    assert _safe("s3://bucket/p") == "s3://bucket/p"
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

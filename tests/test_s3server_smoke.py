"""The local S3 server helper (tests/s3server.py): fsspec/s3fs reach it through the environment
alone, in this process and in a child, and S3's conditional create refuses an existing object."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


BUCKET = "cache"


def test_fsspec_round_trip_with_only_environment_variables(s3):
    import fsspec

    assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint
    data = bytes(range(256)) * 40
    with fsspec.open(f"s3://{BUCKET}/a/b.bin", "wb") as f:  # no endpoint, key or region in code
        f.write(data)
    with fsspec.open(f"s3://{BUCKET}/a/b.bin", "rb") as f:
        assert f.read() == data

    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    assert fs.ls(f"{BUCKET}/a") == [f"{BUCKET}/a/b.bin"]
    assert fs.info(f"{BUCKET}/a/b.bin")["size"] == len(data)
    assert fs.cat_file(f"{BUCKET}/a/b.bin", start=10, end=20) == data[10:20]
    # ...and the object really is on the server, not somewhere else.
    stored = s3.client().get_object(Bucket=BUCKET, Key="a/b.bin")["Body"].read()
    assert stored == data
    fs.rm(f"{BUCKET}/a/b.bin")
    assert not fs.exists(f"{BUCKET}/a/b.bin")


def test_conditional_create_refuses_an_existing_object(s3):
    import botocore.exceptions
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    path = f"{BUCKET}/entries/one"
    fs.pipe_file(path, b"first", mode="create")  # PutObject with If-None-Match: *
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    with pytest.raises(FileExistsError):
        with fs.open(path, "xb") as f:
            f.write(b"third")
    assert fs.cat_file(path) == b"first"

    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3.client().put_object(Bucket=BUCKET, Key="entries/one", Body=b"fourth", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert fs.cat_file(path) == b"first"


def test_child_process_reaches_the_server_through_env(s3):
    s3.client().put_object(Bucket=BUCKET, Key="from-parent", Body=b"hello")
    child = textwrap.dedent(
        f"""
        import fsspec
        with fsspec.open("s3://{BUCKET}/from-parent", "rb") as f:
            assert f.read() == b"hello"
        fsspec.filesystem("s3").pipe_file("{BUCKET}/from-child", b"world", mode="create")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3.env()
    result = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert s3.client().get_object(Bucket=BUCKET, Key="from-child")["Body"].read() == b"world"

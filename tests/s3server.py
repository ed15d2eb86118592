"""A local S3-compatible server for tests: moto's standalone server on 127.0.0.1.

Not a test file. Tests use it from a session-scoped fixture and point every client at it through
the environment only, the way a real deployment configures an S3-compatible store::

    import pytest
    from s3server import start_server

    @pytest.fixture(scope="session")
    def s3_server():
        server = start_server()          # skips the test when moto[server] is not installed
        yield server
        server.stop()

    @pytest.fixture
    def s3(s3_server, monkeypatch):
        s3_server.reset()                # every test starts with no buckets
        s3_server.apply(monkeypatch)     # AWS_* variables -> this server, nothing else
        s3_server.make_bucket("cache")
        return s3_server

With those variables set, ``fsspec.open("s3://cache/key", "wb")`` and ``s3fs.S3FileSystem()``
reach the server with no endpoint in code: botocore reads ``AWS_ENDPOINT_URL`` itself. A child
process gets the same view from ``env={**os.environ, **server.env()}``.

The server is ``moto.server.ThreadedMotoServer`` (a werkzeug server in a daemon thread of the
test process) when that class exists, otherwise a ``moto_server`` subprocess. Both bind
127.0.0.1 only. Install with ``pip install 'moto[server]'``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HOST = "127.0.0.1"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

SKIP_REASON = "moto's standalone S3 server is not installed: pip install 'moto[server]'"

# Variables that would send requests elsewhere or change how botocore resolves credentials,
# region or endpoint (AWS_PROFILE, AWS_REGION, AWS_ENDPOINT_URL_S3,
# AWS_IGNORE_CONFIGURED_ENDPOINT_URLS, AWS_SESSION_TOKEN, ...). `apply` removes every AWS_*
# variable that `env` does not set, and the proxy variables (a proxy would carry 127.0.0.1
# traffic off this machine).
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


class S3Server:
    """A running local S3 server. Create it with `start_server`."""

    def __init__(self, endpoint: str, stopper) -> None:
        self.endpoint = endpoint
        """``http://127.0.0.1:PORT``"""
        self._stopper = stopper

    # -- configuration -----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment a process needs to use this server through botocore/s3fs/fsspec,
        and nothing else."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def apply(self, monkeypatch) -> None:
        """Set `env()` with pytest's ``monkeypatch`` and remove the other AWS_* and proxy
        variables for the test's duration. Clients made afterwards use this server.

        s3fs keeps one filesystem instance per set of arguments (``fsspec.filesystem("s3")``
        returns the same object again), and that instance keeps its credentials and endpoint.
        Tests that change the environment should build theirs with ``skip_instance_cache=True``
        or call ``s3fs.S3FileSystem.clear_instance_cache()``.
        """
        wanted = self.env()
        for name in list(os.environ):
            if (name.startswith("AWS_") and name not in wanted) or name in _PROXY_VARIABLES:
                monkeypatch.delenv(name, raising=False)
        for name, value in wanted.items():
            monkeypatch.setenv(name, value)

    # -- state ---------------------------------------------------------------------------------

    def client(self):
        """A boto3 S3 client for this server, configured explicitly (not from the environment),
        for setting up and inspecting state behind the code under test."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name``. Creating a bucket that already exists is a no-op."""
        from botocore.exceptions import ClientError

        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise

    def reset(self) -> None:
        """Drop every bucket and object (moto's ``/moto-api/reset``; a few milliseconds)."""
        self._post("/moto-api/reset", b"")

    def _post(self, path: str, body: bytes) -> bytes:
        # text/plain: with a form content type, moto's Flask app would not see the body.
        request = urllib.request.Request(
            self.endpoint + path, data=body, method="POST", headers={"Content-Type": "text/plain"}
        )
        with _direct_opener().open(request, timeout=10) as response:
            return response.read()

    # -- lifetime ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the server (about half a second). Calling it again does nothing."""
        stopper, self._stopper = self._stopper, None
        if stopper is not None:
            stopper()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"S3Server({self.endpoint!r})"


def start_server(in_process: bool = True) -> S3Server:
    """Start moto's standalone server on 127.0.0.1 with a free port and return it.

    `in_process=False` runs it as a `moto_server` process of its own (the benchmark's choice: the
    server then does not share the measured process's interpreter lock). Skips the calling test
    (``pytest.skip``) when moto's server is not installed.
    """
    try:
        import moto  # noqa: F401
    except ImportError:
        pytest.skip(SKIP_REASON)
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:  # an older moto, or one installed without the [server] extra
        ThreadedMotoServer = None

    if ThreadedMotoServer is not None and in_process:
        _quiet_request_log()
        server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
        server.start()
        _, port = server.get_host_and_port()  # port 0: the OS picked a free one, no race
        return S3Server(f"http://{HOST}:{port}", server.stop)
    return _start_subprocess()


def _start_subprocess() -> S3Server:
    executable = Path(sys.executable).with_name("moto_server")
    command = str(executable) if executable.exists() else shutil.which("moto_server")
    if command is None:
        pytest.skip(SKIP_REASON)
    with socket.socket() as probe:  # a free port; another process could take it before moto does
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [command, "-H", HOST, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def stop() -> None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    server = S3Server(f"http://{HOST}:{port}", stop)
    deadline = time.monotonic() + 20
    while True:
        try:
            with _direct_opener().open(server.endpoint + "/moto-api/data.json", timeout=1):
                return server
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"moto_server exited with code {process.returncode}") from None
            if time.monotonic() > deadline:
                stop()
                raise RuntimeError(f"moto_server did not answer on {server.endpoint}") from None
            time.sleep(0.05)


def _direct_opener() -> urllib.request.OpenerDirector:
    """urllib without proxies: requests to 127.0.0.1 must stay on this machine."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _quiet_request_log() -> None:
    """werkzeug logs one line per request to stderr unless its logger has a level."""
    logger = logging.getLogger("werkzeug")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)

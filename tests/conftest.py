"""Shared fixtures: a real S3 server (SeaweedFS `weed mini` on loopback) for remote storage."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tools.seaweed import SeaweedServer

BUCKET = "hsstore"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One server for the session; a test that stops it must start it again."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), buckets=(BUCKET,))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh dataset URL on the server, with the standard variables set (child processes
    inherit them)."""
    if s3_server.proc is None or s3_server.proc.poll() is not None:
        s3_server.start()
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/ds"

"""Shared fixtures: real object-store servers on loopback for remote storage. S3 is SeaweedFS
`weed mini`, GCS is fake-gcs-server (behind tools/fake_gcs.py's gateway), Azure Blob is
Azurite; each starts on first use and serves the whole session."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tools.azurite import AzuriteServer
from tools.fake_gcs import FakeGcsServer
from tools.seaweed import SeaweedServer

BUCKET = "hsstore"
Server = SeaweedServer | FakeGcsServer | AzuriteServer


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One server for the session; a test that stops it must start it again."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), buckets=(BUCKET,))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGcsServer]:
    server = FakeGcsServer(tmp_path_factory.mktemp("fake-gcs"), buckets=(BUCKET,))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def az_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    server = AzuriteServer(tmp_path_factory.mktemp("azurite"), containers=(BUCKET,))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _use(server: Server, scheme: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh dataset URL on a running ``server``, with its standard variables set (child
    processes inherit them)."""
    if not server.running:
        server.start()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return f"{scheme}://{BUCKET}/{uuid.uuid4().hex}/ds"


@pytest.fixture
def s3_url(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> str:
    return _use(s3_server, "s3", monkeypatch)


@dataclass(frozen=True)
class Remote:
    """One object store under test: its server, a fresh dataset URL on it, and the variables
    that name its secret and its endpoint (for tests that break them)."""

    scheme: str
    server: Server
    url: str
    secret_var: str | None  # None: the emulator checks no credentials
    endpoint_var: str
    bucket_word: str


_VARS = {
    "s3": ("AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "bucket"),
    "gs": (None, "GOOGLE_BASE_URL", "bucket"),  # the base URL overrides the key's endpoint
    "az": ("AZURE_STORAGE_ACCOUNT_KEY", "AZURITE_BLOB_STORAGE_URL", "container"),
}


REMOTES = ("s3", "gs", "az")


@pytest.fixture
def remote_of(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], Remote]:
    """``remote_of("gs")``: a fresh dataset on that service (for a module's own params)."""

    def make(scheme: str) -> Remote:
        server = request.getfixturevalue(f"{scheme}_server")
        return Remote(scheme, server, _use(server, scheme, monkeypatch), *_VARS[scheme])

    return make


@pytest.fixture(params=REMOTES)
def remote(request: pytest.FixtureRequest, remote_of: Callable[[str], Remote]) -> Remote:
    """The same test on S3, GCS and Azure Blob."""
    return remote_of(request.param)


@pytest.fixture
def remote_url(remote: Remote) -> str:
    return remote.url

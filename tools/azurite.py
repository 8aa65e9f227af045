"""A throwaway Azure Blob server on loopback: Azurite (the npm package ``azurite``, which
scripts/install.sh puts in .cache/azurite).

Azurite checks Shared Key signatures against its well-known development account
(``devstoreaccount1``), so a wrong key is refused as it would be by Azure. obstore reaches it
with ``AZURE_STORAGE_USE_EMULATOR`` and ``AZURITE_BLOB_STORAGE_URL``. Data lives on disk in
the working folder, so a stopped server starts again with the same blobs.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import http.client
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tools.ports import free_port

ACCOUNT = "devstoreaccount1"
# Azurite's published development key (the same in every installation).
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_INSTALLED = Path(__file__).resolve().parents[1] / ".cache/azurite/node_modules/.bin/azurite-blob"


def azurite_binary() -> str:
    """Azurite's blob service, from the project's npm cache or the PATH."""
    found = str(_INSTALLED) if _INSTALLED.exists() else shutil.which("azurite-blob")
    if not found:
        raise RuntimeError("azurite is missing: run scripts/install.sh (npm install azurite)")
    return found


class AzuriteServer:
    """``azurite-blob`` in ``workdir``; ``start()``/``stop()`` may be called repeatedly."""

    def __init__(self, workdir: str | os.PathLike[str], containers: tuple[str, ...] = ("hsstore",)):
        self.workdir = Path(workdir)
        self.containers = containers
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def env(self, **override: str) -> dict[str, str]:
        """The standard variables obstore reads to reach this server."""
        env = {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint,
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY,
        }
        env.update(override)
        return env

    def start(self, timeout_s: float = 60.0) -> None:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        cmd = [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port)]
        cmd += ["--location", str(data), "--silent", "--disableTelemetry"]
        out = open(self.workdir / "azurite.out", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"azurite exited with {self.proc.returncode}; see azurite.out")
            try:
                for container in self.containers:
                    self.create_container(container)
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"azurite did not answer within {timeout_s}s")

    def create_container(self, name: str) -> None:
        """Create Container, signed with the account key (an existing one is kept)."""
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
        canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        # Shared Key: verb, eleven empty standard headers, x-ms-* headers, resource (the
        # emulator's path-style resource names the account twice).
        to_sign = (
            "PUT\n" + "\n" * 11 + canonical + f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        )
        key = base64.b64decode(ACCOUNT_KEY)
        mac = hmac.new(key, to_sign.encode(), hashlib.sha256).digest()
        headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(mac).decode()}"
        headers["Content-Length"] = "0"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("PUT", f"/{ACCOUNT}/{name}?restype=container", headers=headers)
            resp = conn.getresponse()
            resp.read()
        finally:
            conn.close()
        if resp.status not in (201, 409):  # 409: there from before a restart
            raise RuntimeError(f"azurite refused to create container {name}: HTTP {resp.status}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> AzuriteServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

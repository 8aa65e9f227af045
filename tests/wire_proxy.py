"""A loopback HTTP/1.1 proxy in front of a real S3 server that misbehaves like a network.

For a request a rule picks, it forwards the request, lets the server act on it and read its
whole answer, then: ``drop`` closes the client's connection without the answer (a lost
reply), ``reset`` does the same with a TCP reset, ``stall`` holds the answer back for a while
before sending it. obstore's own retries then run for real, which is part of what the commit
protocol must get right (a resent conditional create is answered 412).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable

Rule = Callable[[str, str], str | None]  # (method, path) -> None | "drop" | "reset" | "stall"


def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    del buf[:end]
    return head


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def _read_body(sock: socket.socket, buf: bytearray, head: bytes, *, no_body: bool) -> bytes:
    if no_body:
        return b""
    length = _header(head, b"content-length")
    if length is not None:
        return _read_exact(sock, buf, int(length))
    if (_header(head, b"transfer-encoding") or b"").lower() == b"chunked":
        out = bytearray()
        while True:
            while b"\r\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed mid-chunk")
                buf += chunk
            end = buf.index(b"\r\n") + 2
            size_line = bytes(buf[:end])
            del buf[:end]
            size = int(size_line.split(b";")[0], 16)
            data = _read_exact(sock, buf, size + 2)
            out += size_line + data
            if size == 0:
                return bytes(out)
    return b""


class WireProxy:
    def __init__(self, upstream: str, rule: Rule, *, stall_s: float = 1.0):
        host, _, port = upstream.split("://", 1)[-1].partition(":")
        self.upstream = (host, int(port.rstrip("/")))
        self.rule = rule
        self.stall_s = stall_s
        self.acted: list[tuple[str, str, str]] = []  # (action, method, path)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)
        cbuf, sbuf = bytearray(), bytearray()
        try:
            while True:
                head = _read_head(client, cbuf)
                if head is None:
                    return
                method, path = head.split(b" ", 2)[:2]
                body = _read_body(client, cbuf, head, no_body=False)
                server.sendall(head + body)
                rhead = _read_head(server, sbuf)
                if rhead is None:
                    return
                status = int(rhead.split(b" ", 2)[1])
                rbody = _read_body(
                    server, sbuf, rhead, no_body=method == b"HEAD" or status in (204, 304)
                )
                action = self.rule(method.decode(), path.decode())
                if action is not None:
                    self.acted.append((action, method.decode(), path.decode()))
                if action == "drop":
                    return  # the server acted; the client never hears of it
                if action == "reset":
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if action == "stall":
                    time.sleep(self.stall_s)
                client.sendall(rhead + rbody)
        except (OSError, ValueError, IndexError):
            return
        finally:
            client.close()
            server.close()


def once(action: str, method: str, path_part: str) -> Rule:
    """A rule that acts on the first request of ``method`` whose path contains ``path_part``
    (percent-decoded: GCS's XML API sends an object name's ``/`` and ``.`` encoded)."""
    done = threading.Event()

    def rule(m: str, path: str) -> str | None:
        if done.is_set() or m != method or path_part not in urllib.parse.unquote(path):
            return None
        done.set()
        return action

    return rule

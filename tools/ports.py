"""TCP ports on the loopback interface that nothing listens on, for the servers and ranks that
the tests and benchmarks start."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports: each socket stays bound until all are chosen, so none repeats."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]

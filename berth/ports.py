"""Free TCP ports on 127.0.0.1, for the child servers a benchmark or a check starts."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports. Each socket stays bound until all are chosen: closed one by
    one, the kernel may hand the same port out twice (a server's --port and --admin-port once
    matched that way)."""
    with contextlib.ExitStack() as sockets:
        ports = []
        for _ in range(count):
            sock = sockets.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]

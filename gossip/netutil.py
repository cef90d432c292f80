"""Small network helpers shared by the launcher, benchmarks and tests."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago.

    All probe sockets stay open until every port is chosen, so the ports are distinct.
    """
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports

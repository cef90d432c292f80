"""Small network helpers shared by the launcher, benchmarks and tests."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from gossip.errors import TransportError

# Ports below this are the defaults of too many well-known services.
FIRST_PORT = 10_000
# A pool smaller than this (an ephemeral range that leaves little room) is not worth rotating.
MIN_POOL = 1_000
# Where the kernel's ephemeral range is not readable: the IANA dynamic range, the default of
# macOS, Windows and the BSDs.
DEFAULT_EPHEMERAL = (49_152, 65_535)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and binds to port 0 (inclusive)."""
    try:
        low, high = map(int, path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def port_pool(ephemeral: tuple[int, int]) -> range | None:
    """The ports to hand out: the larger side outside the ephemeral range, or None if neither
    side has room."""
    low, high = ephemeral
    pool = max(range(FIRST_PORT, low), range(max(high + 1, FIRST_PORT), 65_536), key=len)
    return pool if len(pool) >= MIN_POOL else None


class PortPicker:
    """Hands out ports from ``pool``, each verified free by binding it, in turn from a cursor.

    A port the kernel chooses for a bind to port 0 is an ephemeral one: an outgoing
    connection (libzmq's connects, anyone's) may take it before the peer binds it. Ports
    outside the ephemeral range are only ever taken by an explicit bind. The cursor starts at
    a random place (other processes pick from the same pool) and only moves forward, so two
    calls in one process return the same port only after the whole pool went round.
    """

    def __init__(self, pool: Sequence[int], start: int | None = None):
        self.pool = pool
        self._next = random.randrange(len(pool)) if start is None else start
        self._lock = threading.Lock()

    def take(self, count: int, host: str = "127.0.0.1") -> list[int]:
        """``count`` distinct ports free on ``host`` now; TransportError if the pool has fewer."""
        with self._lock, ExitStack() as stack:
            ports: list[int] = []
            for _ in range(len(self.pool)):
                if len(ports) == count:
                    break
                port = self.pool[self._next]
                self._next = (self._next + 1) % len(self.pool)
                sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                try:  # without SO_REUSEADDR: a port in TIME_WAIT is skipped too
                    sock.bind((host, port))
                except OSError:
                    continue
                ports.append(port)
            if len(ports) < count:
                raise TransportError(f"only {len(ports)} of {count} ports free on {host} among "
                                     f"{len(self.pool)} from {self.pool[0]} to "
                                     f"{self.pool[-1]}")
            return ports


def _kernel_chosen_ports(count: int, host: str) -> list[int]:
    """Ports the kernel picks (ephemeral ones): the fallback where no other range is left.
    All probe sockets stay open until every port is chosen, so the ports are distinct."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


_pool = port_pool(ephemeral_port_range())
_picker = PortPicker(_pool) if _pool is not None else None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on ``host`` a moment ago, outside the kernel's
    ephemeral range (so no outgoing connection takes one before it is bound), and none
    returned earlier by this process until a pool of thousands went round (PortPicker)."""
    if _picker is None:
        return _kernel_chosen_ports(count, host)
    return _picker.take(count, host)


"""How many of torch's intra-op threads the communication path may use.

torch runs a large elementwise op (over 32,768 elements) as an OpenMP parallel region, and a
region ends only when every one of its threads has run its share. When several peers share a
machine's cores, each process with its own pool (four processes of two threads on two
cores), a region keeps waiting for a thread the scheduler gave to another process: per-message
work that takes 0.1 ms alone then takes milliseconds. Measured with four library peers on two
cores and torch's default threads: a dpsgd round of 20,011 float32 took 32 ms instead of 2.5
ms, one of 1M float32 100 ms instead of 17 ms.

The communication path (a strategy's round: the transport's copies and checks, the
accumulations) is memory-bound and cut into per-message pieces, so it gains little from more
threads even on an idle machine. ``Peer`` therefore runs it with at most
``cores // peers on this machine`` threads (at least one): never more threads than cores,
whatever the user's model does meanwhile.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def peers_on_this_machine(topology, rank: int) -> int:
    """How many of ``topology``'s peers listen on the same host as ``rank`` (itself included):
    the same host name, or loopback addresses on both."""
    own = topology.peers[rank].host
    return sum(1 for peer in topology.peers if _same_host(peer.host, own))


def communication_threads(local_peers: int, cores: int | None = None) -> int:
    """Intra-op threads for one of ``local_peers`` peers sharing ``cores`` cores: its share of
    the cores, at least one, at most torch's current setting."""
    share = (cores or available_cores()) // max(local_peers, 1)
    return max(1, min(torch.get_num_threads(), share))


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the body with torch's intra-op threads set to ``count`` in this thread.

    OpenMP keeps the setting per thread, so other threads of the process keep theirs (a
    thread that first uses torch while the body runs starts with ``count``).
    Switching costs well under a microsecond.
    """
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _same_host(a: str, b: str) -> bool:
    return a == b or (_loopback(a) and _loopback(b))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

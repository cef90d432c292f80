"""P peers as threads of the test process, on topologies at free local ports, running
strategy rounds over ZeroMQ or loopback.

Every helper opens Peers as context managers, so each test leaves no socket behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gossip.ports import free_ports
from gossip.peer import Peer
from gossip.topology import Topology
from gossip.transport import LoopbackHub, ZmqTransport

TOPOLOGIES = Path(__file__).resolve().parents[2] / "topologies"  # the shipped files


def run_in_threads(size: int, fn: Callable[[int], Any], timeout: float = 30.0) -> list:
    """Run ``fn(rank)`` for every rank in its own thread and return the results by rank.

    Re-raises the earliest exception of any thread (noting its rank) once every thread has
    ended, and fails instead of hanging when a thread is still running after ``timeout``.
    """
    results: list[Any] = [None] * size
    errors: list[tuple[float, int, BaseException]] = []
    compute_threads = torch.get_num_threads()

    def main(rank: int) -> None:
        try:
            # A new thread takes torch's process-wide last setting, which another peer's
            # communication scope may hold at that moment; peers in processes all start alike.
            torch.set_num_threads(compute_threads)
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append((time.monotonic(), rank, exc))

    threads = [threading.Thread(target=main, args=(rank,), name=f"peer-{rank}", daemon=True)
               for rank in range(size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if errors:
        _, rank, exc = min(errors, key=lambda error: error[0])
        exc.add_note(f"(raised first, by rank {rank} of {size}"
                     + (f"; still running: {', '.join(stuck)})" if stuck else ")"))
        raise exc
    if stuck:
        pytest.fail(f"{', '.join(stuck)} did not finish within {timeout:g} s")
    return results


def run_on_transports(topology: Topology, setup: Callable[[int, ZmqTransport], None],
                      work: Callable[[int, ZmqTransport], None], *,
                      timeout: float = 10.0) -> None:
    """Every rank a thread with its own ZmqTransport: ``setup(rank, transport)`` once every
    address is bound (no reconnect delay; a strategy made there accepts its kinds before any
    payload can arrive), then ``work(rank, transport)`` once every rank's setup is done.
    Transports close only after every rank's work ended. The first error is re-raised, the
    others' waits broken."""
    size = topology.size
    opened, ready = threading.Barrier(size, timeout=20), threading.Barrier(size, timeout=20)
    done = threading.Barrier(size, timeout=60)

    def main(rank: int) -> None:
        transport = ZmqTransport.for_topology(rank, topology, timeout=timeout).open()
        try:
            opened.wait()
            setup(rank, transport)
            ready.wait()
            work(rank, transport)
        except BaseException:
            for barrier in (opened, ready, done):
                barrier.abort()
            raise
        finally:
            try:
                done.wait()
            except threading.BrokenBarrierError:
                pass
            transport.close(linger=1.0)

    run_in_threads(size, main, timeout=90)


def make_local_topology(kind: str, n: int | None = None, **params) -> Topology:
    """A generated topology (or, for a name like ``irregular-7``, the shipped file
    topologies/NAME.yaml) with every peer on 127.0.0.1 at a currently free port."""
    shipped = TOPOLOGIES / f"{kind}.yaml"
    if shipped.exists():
        topology = Topology.from_yaml(shipped).relocated(host="127.0.0.1")
    else:
        topology = Topology.generate(kind, n, host="127.0.0.1", **params)
    return topology.relocated(ports=free_ports(topology.size))


def open_peer(rank: int, topology: Topology, strategy: str, *, hub: LoopbackHub | None = None,
              timeout: float = 10.0, **options) -> Peer:
    """A Peer over ZeroMQ, or over ``hub`` when given; use it as a context manager."""
    transport = hub.transport(rank, timeout=timeout) if hub is not None else None
    return Peer(rank, topology, strategy, timeout=timeout, transport=transport, **options)


# Peer options that are its ZeroMQ transport's (see Peer.__enter__).
TRANSPORT_OPTIONS = ("local_ipc", "dead_after", "key_file")


@contextmanager
def peer_once_all_bound(rank: int, topology: Topology, strategy: str,
                        all_bound: threading.Barrier, *, hub: LoopbackHub | None = None,
                        timeout: float = 10.0, **options) -> Iterator[Peer]:
    """An open Peer, as open_peer's, that connects to the others only once every rank has
    bound its address (``all_bound`` is a barrier of all ranks).

    A Peer connects to its neighbours as it opens, and a connect to an address not bound yet
    is retried only after ZeroMQ's 100 ms reconnect interval, which would dominate the run
    time of most tests; so the transport is bound first and handed to the Peer. Other tests
    cover peers starting in any order.
    """
    if hub is not None:
        with open_peer(rank, topology, strategy, hub=hub, timeout=timeout, **options) as peer:
            all_bound.wait()
            yield peer
        return
    own = {key: options.pop(key) for key in TRANSPORT_OPTIONS if key in options}
    transport = ZmqTransport.for_topology(rank, topology, timeout=timeout, **own).open()
    try:
        all_bound.wait()
    except BaseException:
        transport.close()
        raise
    with Peer(rank, topology, strategy, timeout=timeout, transport=transport, **options) as peer:
        yield peer


@dataclass
class Rounds:
    """What ``run_rounds`` saw: ``results[round, rank]`` and each peer's final stats."""

    results: torch.Tensor
    stats: list[dict]


def run_rounds_on_peers(topology: Topology, strategy: str, data: torch.Tensor, *,
                        loopback: bool = False, inplace: bool = False, timeout: float = 10.0,
                        **options) -> Rounds:
    """Every peer synchronizes ``data[round, rank]`` (a fresh copy) for each round in turn.

    Peers connect once all have bound their sockets (peer_once_all_bound).
    With ``inplace`` the result is written into the input (``out=x``). Checks that each
    result has the input's shape and dtype (and storage, in place), and that once all peers
    closed cleanly every byte and message sent was received and none was rejected.
    """
    n_rounds, size = data.shape[:2]
    assert size == topology.size
    hub = LoopbackHub(size) if loopback else None
    results = torch.empty_like(data)
    stats: list[dict] = [{}] * size
    all_bound = threading.Barrier(size, timeout=timeout)

    def peer_main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, strategy, all_bound, hub=hub, timeout=timeout,
                                 **options) as peer:
            for round in range(n_rounds):
                x = data[round, rank].clone()
                y = peer.synchronize(x, round, out=x if inplace else None)
                assert y.shape == x.shape and y.dtype == x.dtype
                if inplace:
                    assert y.data_ptr() == x.data_ptr(), "out=x did not write in place"
                results[round, rank] = y
        stats[rank] = peer.stats

    run_in_threads(size, peer_main, timeout=3 * timeout)
    assert_balanced(stats)
    return Rounds(results, stats)


def iterate_on_peers(topology: Topology, strategy: str, x0: torch.Tensor, rounds: int, *,
                     loopback: bool = True, timeout: float = 10.0,
                     **options) -> tuple[torch.Tensor, list]:
    """Every peer feeds its result back in as its next input for ``rounds`` rounds,
    starting from ``x0[rank]``; returns the final ``x[rank]`` stacked and each peer's
    strategy (for its state, e.g. CHOCO's public copies)."""
    size = topology.size
    hub = LoopbackHub(size) if loopback else None
    final, strategies = [None] * size, [None] * size
    all_bound = threading.Barrier(size, timeout=timeout)

    def peer_main(rank: int) -> None:
        with peer_once_all_bound(rank, topology, strategy, all_bound, hub=hub, timeout=timeout,
                                 **options) as peer:
            x = x0[rank].clone()
            for round in range(rounds):
                x = peer.synchronize(x, round, out=x)
            final[rank], strategies[rank] = x, peer.strategy

    run_in_threads(size, peer_main, timeout=120)
    return torch.stack(final), strategies


def assert_balanced(stats: list[dict]) -> None:
    """After a clean shutdown of all peers, everything sent was received, nothing rejected."""
    total = {key: sum(s[key] for s in stats) for key in stats[0] if key != "by_kind"}
    assert total["bytes_sent"] == total["bytes_recv"], stats
    assert total["messages_sent"] == total["messages_recv"], stats
    assert total["messages_rejected"] == 0, stats

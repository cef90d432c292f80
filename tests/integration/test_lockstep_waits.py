"""A lockstep receive waits as long as the peer it waits for is alive (busy is not dead), and
gives up on a deadlock, a cycle of peers each waiting for the next, named in one line.
Real ZeroMQ peers on loopback, as threads; timeouts far below the waits they must outlast."""

from __future__ import annotations

import subprocess
import sys
import time

import msgpack
import pytest
import torch

from gossip.errors import GossipError, PeerTimeout
from gossip.ports import free_ports
from gossip.transport import Message, ZmqTransport
from gossip.transport.waits import PROBE
from support import Neighbour, run_in_threads

TIMEOUT = 0.3  # each wait below lasts several of these


def transports(size: int) -> list[ZmqTransport]:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(size)]
    opened = [ZmqTransport(rank, endpoints, timeout=TIMEOUT).open() for rank in range(size)]
    for t in opened:  # links up both ways, as a strategy's first round leaves them
        for r in range(size):
            if r != t.rank:
                t.send(r, Message("hello", 0))
    for t in opened:
        for r in range(size):
            if r != t.rank:
                t.recv(src=r, kind="hello", round=0)
    return opened


def msg(round: int = 0) -> Message:
    return Message("gossip", round, buffers=(torch.arange(3.0),))


def test_a_lockstep_wait_outlasts_the_timeout_while_a_chain_ends_at_a_computing_peer():
    """0 waits for 1, 1 waits for 2, 2 computes for ten timeouts, then each sends on: a
    'no gossip within 0.3 s; it is alive, busy' failure before, now the chain completes."""
    peers = transports(3)
    try:
        def main(rank):
            t = peers[rank]
            if rank == 2:
                time.sleep(10 * TIMEOUT)  # computing: reads nothing, probes wait for it
            else:
                t.recv(src=rank + 1, kind="gossip", round=0)
            if rank > 0:
                t.send(rank - 1, msg())
            return t.waits.probes
        probes = run_in_threads(3, main, timeout=60)
        assert probes[0] >= 2 and probes[1] >= 2  # they did wait past their timeout
    finally:
        for t in peers:
            t.close()


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_cycle_of_waits_is_a_deadlock_named_in_one_line(size):
    """Each peer waits for its left neighbour, which waits for its own: nobody computes, so
    no heartbeat can tell; before, each gave up after --timeout calling the other busy."""
    peers = transports(size)
    try:
        def main(rank):
            try:
                peers[rank].recv(src=(rank - 1) % size, kind="gossip", round=4)
            except GossipError as exc:
                return str(exc)
            finally:  # as a peer does: its goodbye ends the waits on it
                peers[rank].shutdown(timeout=10)
            return "received"
        errors = run_in_threads(size, main, timeout=60)
    finally:
        for t in peers:
            t.close()
    found = [e for e in errors if "deadlock" in e]
    assert found, errors  # one closes the cycle; the others may hear of it as a goodbye
    assert all(e in found or "left the run" in e for e in errors), errors
    for error in found:
        assert "\n" not in error and "round 4" in error
        assert error.count("waits for") == size, error  # the whole cycle, once round


def test_a_wait_with_its_own_timeout_and_a_peer_never_linked_still_time_out():
    """Windows (recv with a timeout of its own) poll; a peer with no link may be dead: a
    lockstep wait gives it dead_after to start, then times out."""
    peers = transports(2)
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    start = time.monotonic()  # it starts connecting when it opens
    lonely = ZmqTransport(0, endpoints, timeout=TIMEOUT, dead_after=1.0).open()
    try:
        with pytest.raises(PeerTimeout, match="within 0.2 s"):
            peers[0].recv(src=1, kind="gossip", round=0, timeout=0.2)
        with pytest.raises(PeerTimeout, match="within 0.3 s"):
            lonely.recv(src=1, kind="gossip", round=0)
        assert 1.0 <= time.monotonic() - start < 10
    finally:
        for t in (*peers, lonely):
            t.close()


def test_a_lockstep_wait_outlasts_the_timeout_for_a_peer_still_starting():
    """Peers start seconds apart (a loaded machine, torch's import): a wait on a peer whose
    link has not come up yet goes on for dead_after, not only --timeout. Before, a launch
    with --timeout 1 failed 'no start from peer 0 for round 0 within 1 s' under load."""
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    early = ZmqTransport(1, endpoints, timeout=TIMEOUT, dead_after=5.0).open()
    late = None
    try:
        def main(rank):
            nonlocal late
            if rank == 1:
                return early.recv(src=0, kind="gossip", round=0).round
            time.sleep(6 * TIMEOUT)  # still importing torch, say
            late = ZmqTransport(0, endpoints, timeout=TIMEOUT).open()
            late.send(1, msg())
            return None
        assert run_in_threads(2, main, timeout=60)[1] == 0
    finally:
        for t in (early, late):
            if t is not None:
                t.close()


def test_a_malformed_probe_is_rejected_and_the_wait_goes_on():
    """Anyone may send bytes: a probe with a bogus path is logged and dropped; a rejection
    in a wait ends its patience (the message waited for may be the one rejected). A
    neighbour (a raw outbox at rank 2's endpoint) sends it, claiming to be rank 1."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
    neighbour = Neighbour(endpoints[2])
    peers = [ZmqTransport(rank, endpoints, timeout=TIMEOUT).open() for rank in range(2)]
    try:
        peers[0].connect([1])
        neighbour.send(0, [msgpack.packb({"v": 1, "kind": PROBE, "round": -1, "src": 1,
                                          "meta": {"initiator": 0, "wait": 1, "heard": 0,
                                                   "path": ["x"]}, "tensors": []})])
        with pytest.raises(PeerTimeout, match="1 message.* rejected"):
            peers[0].recv(src=1, kind="gossip", round=0)
        assert "malformed wait.probe" in peers[0].stats.rejections[0]
    finally:
        neighbour.close()
        for t in peers:
            t.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    ["--strategy", "local", "--option", "inner=dpsgd", "--option", "period=4"],
    ["--strategy", "ring-allreduce"],
])
def test_a_slower_peer_with_a_timeout_shorter_than_its_steps_trains_to_the_end(strategy,
                                                                                tmp_path):
    """The issue's run: peer 1 computes twice as long as the others, each of its local periods
    lasting longer than --timeout 1; peers 0 and 2 died 'busy, not dead' in round 7."""
    run = subprocess.run(
        [sys.executable, "-m", "gossip", "launch", "--peers", "3", *strategy,
         "--compute-delay", "0.3", "--slowdown", "1:2", "--timeout", "1", "--rounds", "8",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "deadlock" not in run.stderr

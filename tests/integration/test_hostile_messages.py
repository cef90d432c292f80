"""Hostile input that is well-formed enough to pass the header checks, or hostile by volume:
a stranger's control message, a message of a million frames. Real ZeroMQ peers on loopback.
"""

from __future__ import annotations

import contextlib
import threading
import time
import tracemalloc

import msgpack
import pytest
import torch
import zmq

from gossip.errors import PeerTimeout
from gossip.ports import free_ports
from gossip.peer import Peer
from gossip.topology import Topology
from gossip.transport import ZmqTransport
from support import read_until


def stranger_send(endpoint: str, parts: list, queued: threading.Event | None = None) -> None:
    """Push one multipart message to ``endpoint`` as nobody of the topology, queued until
    the peer there binds (``queued`` is set once it is)."""
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoint)
        push.send_multipart(parts)
        if queued is not None:
            queued.set()
        push.close(linger=10_000)  # delivered once the peer is up
    finally:
        ctx.term()


def header(**fields) -> bytes:
    return msgpack.packb({"v": 1, "round": 0, "meta": {}, "tensors": [], **fields})


def test_a_rejected_control_message_changes_nothing(run_peers):
    """A stranger's malformed ctl.gone claiming to come from peer 2 made rank 0 of a line
    0-1-2 count peer 2 a contact: it waited for its goodbye at exit and declared it dead."""
    line = Topology.from_dict({"peers": [{"rank": r, "host": "127.0.0.1", "port": p}
                                         for r, p in enumerate(free_ports(3))],
                               "edges": [[0, 1], [1, 2]]})
    queued = threading.Event()
    sender = threading.Thread(target=stranger_send, args=(line.address(0), [header(
        kind="ctl.gone", src=2, meta={"rank": "x"})], queued))
    sender.start()
    assert queued.wait(10), "the stranger's message was never queued"  # before rank 0 starts
    closing = [0.0] * 3

    def main(rank: int):
        peer = Peer(rank, line, "dpsgd", timeout=10, dead_after=1)
        with peer:
            deadline = time.monotonic() + 20
            while rank == 0 and not any("ctl.gone" in why for why in
                                        peer.transport.stats.rejections):  # it came first
                assert time.monotonic() < deadline, "the stranger's message never came"
                with contextlib.suppress(PeerTimeout):  # reads; a neighbour's message is kept
                    peer.transport.recv(kind="gossip", round=-1, timeout=0.05)
            x = torch.full((5,), float(rank))
            for round in range(3):
                peer.synchronize(x, round, out=x)
            start = time.monotonic()
        closing[rank] = time.monotonic() - start
        return peer

    peers = run_peers(3, main, timeout=30)
    sender.join(10)
    zero = peers[0]
    reasons = list(zero.transport.stats.rejections)
    assert any("ctl.gone from peer 2: bad meta: rank='x'" in why for why in reasons), reasons
    # The only other rejection there may be: the stranger hanging up without a goodbye.
    assert all("ctl.gone" in why or "without a goodbye" in why for why in reasons), reasons
    assert zero.transport.contacts == {1}  # not 2: the message was rejected
    assert zero.lost_peers == {} and all(p.lost_peers == {} for p in peers)
    assert closing[0] < 8.0, closing  # no wait (10 s) for a goodbye that never comes


def test_a_message_of_too_many_frames_is_dropped_unread_in_constant_memory():
    """One message of 200,000 empty frames (400 kB on the wire) took seconds and hundreds of
    MB to assemble before the header check refused it. 50,000 make the point (assembled, they
    would take 10 MB, five times the bound) in a quarter of the time."""
    (port,) = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    with ZmqTransport(0, [endpoint, "tcp://127.0.0.1:1"], timeout=5) as transport:
        stranger_send(endpoint, [header(kind="gossip", src=1)] + [b""] * 50_000)
        tracemalloc.start()
        try:
            read_until(transport, lambda: transport.stats.messages_rejected,
                       "the message of 50,001 frames to be rejected")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert transport.stats.messages_rejected == 1
        assert "message of 50001 frames, more than the 66" in transport.stats.rejections[0]
        assert transport.stats.by_kind["<rejected>"]["bytes_recv"] == len(header(
            kind="gossip", src=1))
    assert peak < 2 << 20, peak  # assembled: ~200 bytes of Python objects per frame

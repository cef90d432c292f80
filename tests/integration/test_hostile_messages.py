"""Hostile input that is well-formed enough to pass the header checks, or hostile by volume:
a stranger's control message, a neighbour's malformed one, messages of a million frames.
Real ZeroMQ peers on loopback; what can reach a peer is support/hostile.py's.
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
from gossip.transport import Message
from support import Neighbour, read_until, stranger_send


def header(**fields) -> bytes:
    return msgpack.packb({"v": 1, "round": 0, "meta": {}, "tensors": [], **fields})


def test_a_rejected_control_message_changes_nothing(run_peers):
    """A stranger's malformed ctl.gone claiming to come from peer 2 made rank 0 of a line
    0-1-2 count peer 2 a contact: it waited for its goodbye at exit and declared it dead.
    A stranger can only write into a peer's outbox now, which takes nothing but hellos."""
    line = Topology.from_dict({"peers": [{"rank": r, "host": "127.0.0.1", "port": p}
                                         for r, p in enumerate(free_ports(3))],
                               "edges": [[0, 1], [1, 2]]})
    queued = threading.Event()

    def strange() -> None:
        queued.set()
        stranger_send(line.address(0), [header(kind="ctl.gone", src=2, meta={"rank": "x"})])

    sender = threading.Thread(target=strange)
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
    assert any("unexpected message kind 'ctl.gone'" in why for why in reasons), reasons
    # The only other rejection there may be: the stranger hanging up without a goodbye.
    assert all("ctl.gone" in why or "without a goodbye" in why for why in reasons), reasons
    assert zero.transport.contacts == {1}  # not 2: the message was rejected
    assert zero.lost_peers == {} and all(p.lost_peers == {} for p in peers)
    assert closing[0] < 8.0, closing  # no wait (10 s) for a goodbye that never comes


def test_a_neighbours_malformed_control_message_is_rejected_and_changes_nothing():
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
    neighbour = Neighbour(endpoints[1])
    try:
        with ZmqTransport(0, endpoints, timeout=5) as transport:
            neighbour.send(0, [header(kind="ctl.gone", src=2, meta={"rank": "x"})])
            neighbour.send(0, [header(kind="gossip", src=1)])
            assert transport.recv(src=1, kind="gossip").round == 0  # and the peer goes on
            assert transport.stats.messages_rejected == 1
            assert "ctl.gone from peer 2: bad meta: rank='x'" in transport.stats.rejections[0]
            assert transport.contacts == {1}  # not 2: the message was rejected
    finally:
        neighbour.close()


def test_a_message_of_too_many_frames_is_dropped_unread_in_constant_memory():
    """One message of 200,000 empty frames (400 kB on the wire) took seconds and hundreds of
    MB to assemble before the header check refused it. 50,000 make the point (assembled, they
    would take 10 MB, five times the bound) in a quarter of the time. A neighbour sends it
    (a stranger's lands in the outbox: the next test)."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    neighbour = Neighbour(endpoints[1])
    with ZmqTransport(0, endpoints, timeout=5) as transport:
        neighbour.send(0, [header(kind="gossip", src=1)] + [b""] * 50_000)
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
    neighbour.close()
    assert peak < 2 << 20, peak  # assembled: ~200 bytes of Python objects per frame


def test_a_strangers_flood_into_the_outbox_is_rejected_and_a_peer_still_connects():
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    with ZmqTransport(0, endpoints, timeout=5) as transport:
        stranger_send(endpoints[0], [header(kind="gossip", src=1)] + [b""] * 50_000)
        read_until(transport, lambda: transport.stats.messages_rejected,
                   "the stranger's flood to be rejected")
        assert "message of 50002 frames on this peer's outbox" in transport.stats.rejections[0]
        with ZmqTransport(1, endpoints, timeout=5) as sender:  # its hello still gets in
            sender.send(0, Message("gossip", 4, buffers=(torch.ones(2),)))
            assert transport.recv(src=1).round == 4


def test_a_flood_from_one_neighbour_holds_up_another_by_a_bounded_slice_only():
    """One message of 1,000,000 empty frames (2 MB) held every receive of a peer about 1 s
    (2.5 s loaded): libzmq yields a message's frames until its last once its first is read,
    and each costs ~1 µs from Python. Each sender has a receiving socket of its own now, read
    FRAMES_PER_TURN frames per turn: the other neighbour's 100 messages, queued behind the
    flood, are all read before the flood's end, i.e. after at most 101 slices of it (by
    construction, not a wall-clock bound). The flood is then rejected and the peer goes on."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
    flooder, other = Neighbour(endpoints[1]), Neighbour(endpoints[2])
    try:
        with ZmqTransport(0, endpoints, timeout=20) as transport:
            flooder.send(0, [header(kind="gossip", src=1)] + [b""] * 1_000_000)
            for round in range(100):
                other.send(0, [header(kind="gossip", src=2, round=round)])
            time.sleep(1.0)  # both are in this peer's sockets before it reads either
            start = time.monotonic()
            for round in range(100):
                assert transport.recv(src=2, round=round).round == round
                assert transport.stats.messages_rejected == 0, "the flood was read whole first"
            served = time.monotonic() - start
            read_until(transport, lambda: transport.stats.messages_rejected,
                       "the flood to be rejected", timeout=60)
            assert "message of 1000001 frames, more than the 66" in \
                transport.stats.rejections[0]
            other.send(0, [header(kind="gossip", src=2, round=100)])
            assert transport.recv(src=2, round=100).round == 100  # it goes on
            print(f"100 messages served in {served:.3f} s while the flood was read")
    finally:
        flooder.close()
        other.close()

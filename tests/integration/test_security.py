"""CURVE: a keyed cluster lets in its own peers only, each only as itself.

A running cluster (peers as threads, real ZeroMQ) is attacked by a plaintext peer, a peer
with a key the topology does not list, a client that has a wrong server key, and a member
whose key is valid but who claims to be another rank. None gets a message in: every round
still equals the oracle, and the target counts and names every attempt.
"""

from __future__ import annotations

import re
import threading
from contextlib import suppress

import pytest
import torch
import zmq

from gossip import keys
from gossip.errors import PeerTimeout
from gossip.keys import CurveKeys
from gossip.ports import free_ports
from gossip.peer import Peer
from gossip.transport import Message, ZmqTransport, codec
from support import peer_once_all_bound, read_until

ROUNDS = 12
PLAINTEXT = "does not use CURVE|closed during the handshake"  # whichever side noticed first
ATTACKS = {
    "plaintext peer": PLAINTEXT,
    "unknown key": "is not in the topology",
    "wrong server key": "does not decrypt",
    "impersonation": "claims to come from peer 1 but was sent with peer 2's key",
}


@pytest.fixture
def keyed_ring(tmp_path, local_topology):
    keys.generate(tmp_path / "keys", range(3))
    return local_topology("ring", 3).with_keys(tmp_path / "keys")


def poisoned(round: int, src: int = 1) -> list[bytes]:
    """Frames of a well-formed gossip message for round ``round`` claiming to come from ``src``."""
    header, frames = codec.encode(Message("gossip", round, buffers=(torch.full((8,), 1e6),)), src)
    return [header] + [f.numpy().tobytes() for f in frames]


def impostor(topology, rank: int, *, keyed: bool) -> ZmqTransport:
    """A transport posing as ``rank`` from another port: plaintext, or with a fresh keypair
    the topology does not list."""
    endpoints = [topology.address(r) for r in range(topology.size)]
    # Its own port, and none of the other honest peers' (its sockets would knock at every
    # outbox): the attack is on rank 0.
    for other in range(1, topology.size):
        endpoints[other] = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    forged = None
    if keyed:
        public, secret = (k.decode() for k in zmq.curve_keypair())
        peers = [p.public_key for p in topology.peers]
        peers[rank] = public
        forged = CurveKeys(rank, secret, tuple(peers))
    return ZmqTransport(rank, endpoints, keys=forged, timeout=0.1).open()


def attack(topology, queued: threading.Event, stop: threading.Event) -> None:
    """Send poisoned messages for every round to rank 0 in every way we know (``queued`` is
    set once all are), and keep the connections (refused ones retry every 100 ms) until
    ``stop``."""
    ctx = zmq.Context()
    sockets = []
    honest_keys = keys.for_rank(topology, 2)
    wrong_server = zmq.curve_keypair()[0]
    for server_key, client in [(topology.peers[0].public_key.encode(), honest_keys),
                               (wrong_server, honest_keys)]:
        sock = ctx.socket(zmq.DEALER)  # what can write into rank 0's outbox
        sock.linger = 0
        sock.setsockopt(zmq.ROUTING_ID, b"1")  # posing as rank 1's receiving socket
        sock.curve_serverkey = server_key
        sock.curve_publickey = client.public.encode()
        sock.curve_secretkey = client.secret.encode()
        sock.connect(topology.address(0))
        sockets.append(sock)
    fakes = [impostor(topology, 1, keyed=False), impostor(topology, 1, keyed=True)]
    try:
        for sock in sockets:  # rank 2's real key claiming rank 1; a wrong server key
            sock.send(codec.encode(Message("hello", -1, meta={
                "endpoint": topology.address(1)}), 1)[0])
        for round in range(ROUNDS):
            for sock in sockets:  # an outbox takes hellos only
                sock.send_multipart(poisoned(round))
            for fake in fakes:  # queued until a handshake succeeds, which never happens;
                # once libzmq refused the handshake it may drop the queue and fail the send
                with suppress(PeerTimeout):
                    fake.send(0, Message("gossip", round, buffers=(torch.full((8,), 1e6),)))
        queued.set()
        stop.wait(30.0)
    finally:
        for fake in fakes:
            fake.close()
        ctx.destroy(linger=0)


def test_strangers_and_impostors_get_nothing_into_a_running_cluster(keyed_ring, reasons,
                                                                    run_peers, make_data, oracle):
    data = make_data(ROUNDS, 3, (8,), torch.float32)
    results = torch.empty_like(data)
    bound = threading.Barrier(3, timeout=10)
    queued, stop = threading.Event(), threading.Event()
    attacker = threading.Thread(target=attack, args=(keyed_ring, queued, stop), daemon=True)
    stats = [None] * 3

    def peer_main(rank: int) -> None:
        with peer_once_all_bound(rank, keyed_ring, "dpsgd", bound, timeout=10.0) as peer:
            if rank == 0:  # the poison queues up before the honest messages
                attacker.start()
                assert queued.wait(10.0), "the attacker never got its poison out"
            for round in range(ROUNDS):
                results[round, rank] = peer.synchronize(data[round, rank].clone(), round)
            if rank == 0:  # keep reading until every kind of attack was seen and refused
                read_until(peer.transport,
                           lambda: all(reasons.seen(why) for why in ATTACKS.values()),
                           "every kind of attack to be refused")
                stop.set()
                attacker.join(10.0)
                assert not len(peer.transport.inbox), "a poisoned message got in"
        stats[rank] = peer.stats

    try:
        run_peers(3, peer_main, timeout=60.0)
    finally:
        stop.set()
    oracle.assert_mixed(keyed_ring, results, data)
    for what, why in ATTACKS.items():
        assert reasons.seen(why), f"{what} not refused: {reasons.reasons[:5]}"
    gossip = stats[0]["by_kind"]["gossip"]
    assert gossip["messages_recv"] == 2 * ROUNDS  # exactly the two neighbours' messages
    assert stats[0]["messages_rejected"] == len(reasons.reasons)
    for rank in (1, 2):
        assert stats[rank]["messages_rejected"] == 0


def test_keyed_and_plaintext_peers_cannot_talk(keyed_ring, reasons):
    endpoints = [keyed_ring.address(r) for r in range(3)]
    with ZmqTransport.for_topology(0, keyed_ring, timeout=5.0) as keyed, \
            ZmqTransport(1, endpoints, timeout=5.0) as plain:
        plain.send(0, Message("gossip", 0, buffers=(torch.ones(2),)))
        keyed.send(1, Message("gossip", 0, buffers=(torch.ones(2),)))
        read_until(keyed, lambda: keyed.stats.messages_rejected, "the plaintext peer's refusal")
        assert re.search(PLAINTEXT, keyed.stats.rejections[0]), keyed.stats.rejections
        with pytest.raises(PeerTimeout):  # the keyed client's handshake gets no answer
            plain.recv(timeout=0.2)
        assert keyed.stats.messages_recv == plain.stats.messages_recv == 0


def test_ipc_twin_is_keyed_too(keyed_ring):
    with ZmqTransport.for_topology(0, keyed_ring, timeout=5.0) as target:
        assert target._ipc_path is not None
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(f"ipc://{target._ipc_path}")
            sock.send_multipart(poisoned(0))
            read_until(target, lambda: target.stats.messages_rejected,
                       "the plaintext ipc client's refusal")
            assert re.search(PLAINTEXT, target.stats.rejections[0]), target.stats.rejections
        finally:
            ctx.destroy(linger=0)
        with ZmqTransport.for_topology(1, keyed_ring, timeout=5.0) as sender:
            sender.send(0, Message("gossip", 3, buffers=(torch.ones(2),)))  # over ipc
            assert target.recv(src=1).round == 3


def test_ring_allreduce_forwards_decrypted_pieces_on_a_keyed_ring(tmp_path, local_topology,
                                                                   run_rounds, make_data,
                                                                   oracle):
    """Ring pieces are sent on as the frames they arrived in; with CURVE those are the
    decrypted messages, re-encrypted for the next hop, and carry their sender's identity."""
    keys.generate(tmp_path / "keys", range(5))
    topology = local_topology("ring", 5).with_keys(tmp_path / "keys")
    n = 5 * (codec.ZERO_COPY_MIN_BYTES // 4) + 3  # large frames, not divisible by P
    data = make_data(2, 5, (n,), torch.float32, seed=11)
    run = run_rounds(topology, "ring-allreduce", data, inplace=True)
    oracle.assert_mean_everywhere(run.results, data)

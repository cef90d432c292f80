"""Transports: matching, out-of-order buffering, rejection of bad messages, timeouts, counters.

Each test runs on ZeroMQ (real sockets on 127.0.0.1) and, where it applies, on the
in-process LoopbackTransport. Raw frames are injected past the sender's transport with a
bare zmq PUSH socket, or straight into the loopback queue.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from gossip.errors import PeerTimeout, TransportError
from gossip.ports import free_ports
from gossip.transport import LoopbackHub, Message, ZmqTransport, codec, monitor
from gossip.transport.stats import REJECTED
from gossip.transport.endpoints import local_ipc
from support import Neighbour, read_until, wait_until

# Tests that send through Transport.send also run with TCP between the ZeroMQ peers;
# receive-only tests inject raw frames, which go over TCP anyway.
SENDING_KINDS = ["zmq", "zmq-tcp", "loopback"]
KINDS = ["zmq", "loopback"]


class Network:
    """``size`` transports of one kind that can reach each other; closed by the fixture.

    Kinds: "zmq" (peers on 127.0.0.1 talk over their ipc twin sockets), "zmq-tcp" (TCP
    only) and "loopback".
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.transports: list = []
        self._ctx = zmq.Context()
        self._neighbour: Neighbour | None = None

    def open(self, size: int, timeout: float = 5.0, **kwargs) -> list:
        if self.kind.startswith("zmq"):
            # One rank more, held by a raw outbox: what ``inject`` sends comes from there.
            self.endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(size + 1)]
            self._neighbour = Neighbour(self.endpoints[size], self._ctx)
            kwargs.setdefault("local_ipc", self.kind == "zmq")
            self.transports = [ZmqTransport(rank, self.endpoints, timeout=timeout, **kwargs)
                               .open() for rank in range(size)]
        else:
            self.hub = LoopbackHub(size)
            self.transports = [self.hub.transport(rank, timeout=timeout, **kwargs)
                               for rank in range(size)]
        return self.transports

    def inject(self, dst: int, frames: list) -> None:
        """Deliver raw frames to ``dst`` as if a (hostile or broken) peer had sent them."""
        if self.kind == "loopback":
            self.hub.queues[dst].put([bytearray(f) for f in frames])
            return
        self._neighbour.send(dst, frames)

    def close(self) -> None:
        for transport in self.transports:
            transport.close()
        if self._neighbour is not None:
            self._neighbour.sock.close(linger=0)
        self._ctx.destroy(linger=0)


@pytest.fixture
def network(request):
    net = Network(request.param)
    yield net
    net.close()


def raw(msg: Message, src: int) -> list[bytes]:
    """The frames ``msg`` from ``src`` becomes on the wire."""
    header, frames = codec.encode(msg, src)
    return [header] + [f.numpy().tobytes() for f in frames]


def header(**fields) -> bytes:
    """A valid header for one float32 tensor of 2 elements, with ``fields`` overridden."""
    base = {"v": 1, "kind": "gossip", "round": 0, "src": 1, "meta": {},
            "tensors": [{"dtype": "float32", "shape": [2]}]}
    return msgpack.packb({**base, **fields})


def tensor_msg(kind: str = "gossip", round: int = 0, value: float = 0.0, n: int = 3) -> Message:
    return Message(kind, round, meta={"value": value}, buffers=(torch.full((n,), value),))


# -- matching and buffering ---------------------------------------------------------------


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_later_round_arriving_first_waits_in_the_buffer(network):
    t0, t1 = network.open(2)
    t1.send(0, tensor_msg(round=2, value=2.0))
    t1.send(0, tensor_msg(round=1, value=1.0))
    first = t0.recv(src=1, kind="gossip", round=1)
    assert (first.round, first.src, first.meta["value"]) == (1, 1, 1.0)
    assert torch.equal(first.buffers[0], torch.full((3,), 1.0))
    second = t0.recv(src=1, kind="gossip", round=2, timeout=0.1)  # already buffered
    assert torch.equal(second.buffers[0], torch.full((3,), 2.0))
    with pytest.raises(PeerTimeout):
        t0.recv(timeout=0.1)


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_recv_matches_source_and_kind(network):
    t0, t1, t2 = network.open(3, kinds=["a", "b"])
    t1.send(0, tensor_msg("a", value=1.0))
    t2.send(0, tensor_msg("a", value=2.0))
    t2.send(0, tensor_msg("b", value=3.0))
    assert t0.recv(src=2, kind="b").meta["value"] == 3.0
    assert t0.recv(src=1).meta["value"] == 1.0
    last = t0.recv(kind="a")
    assert (last.src, last.meta["value"]) == (2, 2.0)
    assert t0.stats.messages_recv == 3 and t0.stats.messages_rejected == 0


TENSORS = {
    "strided": torch.arange(10.0)[::2],
    "transposed": torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),
    "scalar": torch.tensor(7, dtype=torch.int32),
    "empty": torch.empty(0, 5),
    "bool": torch.tensor([True, False, True]),
    "bfloat16": torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
    "zero-copy": torch.randn(codec.ZERO_COPY_MIN_BYTES // 4 + 3),
}


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_tensors_round_trip_with_shape_dtype_and_values(network):
    t0, t1 = network.open(2)
    names = list(TENSORS)
    t1.send(0, Message("gossip", 5, meta={"names": names, "x": [1, 2.5]},
                       buffers=tuple(TENSORS.values())))
    msg = t0.recv(src=1)
    assert (msg.kind, msg.round, msg.src, msg.meta) == (
        "gossip", 5, 1, {"names": names, "x": [1, 2.5]})
    for name, got in zip(names, msg.buffers, strict=True):
        sent = TENSORS[name]
        assert got.dtype == sent.dtype and got.shape == sent.shape, name
        assert torch.equal(got, sent), name


@pytest.mark.parametrize("n", [0, 5, codec.ZERO_COPY_MIN_BYTES])
@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_counters_are_exact(network, n):
    t0, t1 = network.open(2)
    msg = Message("gossip", 3, meta={"n": n}, buffers=(torch.ones(n, dtype=torch.float64),))
    size = len(codec.encode(msg, 1)[0]) + 8 * n
    t1.send(0, msg)
    t1.send(0, msg)
    t0.recv(round=3)
    t0.recv(round=3)
    sent, recv = t1.stats.by_kind["gossip"], t0.stats.by_kind["gossip"]
    assert (sent["bytes_sent"], sent["messages_sent"]) == (2 * size, 2)
    assert (recv["bytes_recv"], recv["messages_recv"]) == (2 * size, 2)
    # Besides, only a shared-memory offer (a large tensor, peers on one machine), and the
    # totals are exact sums.
    offer = t1.stats.by_kind.get("shm.offer", {"bytes_sent": 0, "messages_sent": 0})
    assert set(t1.stats.by_kind) <= {"gossip", "shm.offer"}
    assert (t1.stats.bytes_sent, t1.stats.messages_sent) == \
        (2 * size + offer["bytes_sent"], 2 + offer["messages_sent"])
    assert (t0.stats.bytes_recv, t0.stats.messages_recv) == \
        (2 * size + offer["bytes_sent"], 2 + offer["messages_sent"])
    assert t0.stats.snapshot()["wait_s"] >= 0.0


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_counters_by_kind_add_up_to_the_totals(network):
    t0, t1 = network.open(2, kinds=["a", "b"])
    sizes = {}
    for kind, n in [("a", 3), ("b", 10), ("a", 0)]:
        msg = Message(kind, 0, buffers=(torch.ones(n),))
        sizes[kind] = sizes.get(kind, 0) + len(codec.encode(msg, 1)[0]) + 4 * n
        t1.send(0, msg)
    network.inject(0, [b"\xc1 not msgpack"])  # rejected: its bytes count too
    for kind in ("a", "b", "a"):
        t0.recv(kind=kind)
    sent, recv = t1.stats.snapshot()["by_kind"], t0.stats.snapshot()["by_kind"]
    assert {k: (v["bytes_sent"], v["messages_sent"]) for k, v in sent.items()} == {
        "a": (sizes["a"], 2), "b": (sizes["b"], 1)}
    assert {k: recv[k]["bytes_recv"] for k in "ab"} == sizes
    assert (recv["a"]["messages_recv"], recv["b"]["messages_recv"]) == (2, 1)
    for stats in (t0.stats, t1.stats):
        for counter in ("bytes_sent", "bytes_recv", "messages_sent", "messages_recv"):
            assert sum(v[counter] for v in stats.by_kind.values()) == getattr(stats, counter)


@pytest.mark.parametrize("network", KINDS, indirect=True)
def test_rejected_bytes_are_counted_apart_from_every_kind(network):
    t0, _ = network.open(2, kinds=["gossip"])
    frames = [header(kind="other"), b"\0" * 8]
    network.inject(0, frames)
    network.inject(0, raw(tensor_msg(), src=1))
    t0.recv()
    by_kind = t0.stats.snapshot()["by_kind"]
    assert by_kind[REJECTED] == {"bytes_sent": 0, "bytes_recv": sum(map(len, frames)),
                                 "messages_sent": 0, "messages_recv": 0}
    assert sum(v["bytes_recv"] for v in by_kind.values()) == t0.stats.bytes_recv
    assert t0.stats.messages_rejected == 1


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_tracked_send_may_be_overwritten_after_wait(network):
    t0, t1 = network.open(2)
    x = torch.arange(codec.ZERO_COPY_MIN_BYTES, dtype=torch.float32)  # sent zero-copy
    t1.send(0, Message("gossip", 0, buffers=(x,)), track=True).wait(5.0)
    x.fill_(-1.0)
    assert torch.equal(t0.recv().buffers[0], torch.arange(codec.ZERO_COPY_MIN_BYTES,
                                                          dtype=torch.float32))


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_forwarded_buffer_changed_in_place_arrives_changed(network):
    """A received buffer sent on goes out as its own frame (ZeroMQ: by reference): what
    arrives is its memory as it was at the send, with the forwarder's header."""
    t0, t1, t2 = network.open(3)
    x = torch.arange(codec.ZERO_COPY_MIN_BYTES, dtype=torch.float32)  # a zero-copy frame
    t0.send(1, Message("gossip", 0, meta={"hop": 0}, buffers=(x,)))
    got = t1.recv(src=0)
    got.buffers[0].mul_(2)
    t1.send(2, replace(got, meta={"hop": 1}))
    final = t2.recv()
    assert (final.src, final.meta) == (1, {"hop": 1})
    assert torch.equal(final.buffers[0], 2 * x)
    assert (t1.stats.by_kind["gossip"]["bytes_sent"] == t2.stats.by_kind["gossip"]["bytes_recv"]
            == t0.stats.by_kind["gossip"]["bytes_sent"])


def test_only_a_received_buffers_own_memory_goes_out_as_its_frame():
    frames = raw(Message("gossip", 0, buffers=(torch.arange(8.0), torch.arange(4.0))), 1)
    msg = codec.decode([bytearray(f) for f in frames])
    (_, _, frame_a), (_, _, frame_b) = msg.wire
    a, b = msg.buffers
    outgoing = [codec.host_bytes(t) for t in (b, a.add_(1), a[:4], a.clone(), torch.empty(0))]
    assert codec.received_frames(msg, outgoing) == [frame_b, frame_a, None, None, None]
    fresh = Message("gossip", 0, buffers=(a,))  # built anew: it arrived in no frame
    assert codec.received_frames(fresh, outgoing[:1]) == [None]


# -- rejection ------------------------------------------------------------------------------

MALFORMED = {
    "not msgpack": ([b"\xc1\x00garbage"], "not valid msgpack"),
    "wrong version": ([header(v=2), b"\0" * 8], "version 2"),
    "bad dtype": ([header(tensors=[{"dtype": "complex64", "shape": [2]}]), b"\0" * 16],
                  "dtype 'complex64' not allowed"),
    "frame count": ([header()], "1 tensors but 0 frames"),
    "short frame": ([header(), b"\0" * 7], "needs 8 bytes, frame has 7"),
    "kind not accepted": ([header(kind="other"), b"\0" * 8], "unexpected message kind 'other'"),
    # Regression: an unhashable dtype used to raise TypeError out of recv().
    "list as dtype": ([header(tensors=[{"dtype": ["float32"], "shape": [2]}]), b"\0" * 8],
                      "dtype ['float32'] not allowed"),
    "src not a peer": ([header(src=7), b"\0" * 8], "src 7 is not a peer (ranks 0.."),
    "NaN": ([header(), torch.tensor([1.0, float("nan")]).numpy().tobytes()],
            "gossip round 0 from peer 1: tensor 0 (float32) holds NaN or Inf"),
    "-Inf": ([header(tensors=[{"dtype": "float16", "shape": [2]}]),
              torch.tensor([float("-inf"), 0], dtype=torch.float16).numpy().tobytes()],
             "tensor 0 (float16) holds NaN or Inf"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("network", KINDS, indirect=True)
def test_malformed_message_is_rejected_and_the_next_one_received(network, case):
    frames, reason = MALFORMED[case]
    t0, _ = network.open(2, kinds=["gossip"])
    network.inject(0, frames)
    network.inject(0, raw(tensor_msg(value=4.0), src=1))
    msg = t0.recv(src=1, kind="gossip", round=0)
    assert msg.meta["value"] == 4.0
    assert t0.stats.messages_rejected == 1 and t0.stats.messages_recv == 1
    assert reason in t0.stats.rejections[0]
    assert t0.stats.bytes_recv == sum(map(len, frames)) + sum(map(len, raw(tensor_msg(), 1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=str)
def test_nonfinite_check_is_exact(dtype):
    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)  # its sum would overflow
    assert not codec.has_nonfinite(big) and not codec.has_nonfinite(-big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = big.clone()
        poisoned[637] = bad
        assert codec.has_nonfinite(poisoned), bad
        assert codec.has_nonfinite(torch.tensor(bad, dtype=dtype))  # 0-dim
    assert not codec.has_nonfinite(torch.empty(0, dtype=dtype))
    assert not codec.has_nonfinite(torch.tensor([-5, 2**31 - 1], dtype=torch.int32))


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_nonfinite_values_pass_only_when_the_check_is_off(network):
    t0, t1 = network.open(2, reject_nonfinite=False)
    poisoned = torch.tensor([1.0, float("nan"), float("inf")])
    t1.send(0, Message("gossip", 0, buffers=(poisoned,)))
    got = t0.recv().buffers[0]
    assert torch.equal(got.isnan(), poisoned.isnan()) and got[2] == float("inf")


@pytest.mark.parametrize("network", KINDS, indirect=True)
def test_timeout_says_what_was_rejected_meanwhile(network):
    t0, _ = network.open(2)
    network.inject(0, [header(), torch.tensor([float("nan"), 0.0]).numpy().tobytes()])
    with pytest.raises(PeerTimeout, match=r"within 0.3 s; 1 message\(s\) rejected meanwhile, "
                                          r"the last: gossip round 0 from peer 1: .*NaN"):
        t0.recv(src=1, timeout=0.3)


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_message_over_the_size_limit_is_rejected(network):
    t0, t1 = network.open(2, max_message_bytes=1000)
    t1.send(0, Message("gossip", 0, buffers=(torch.zeros(150), torch.zeros(150))))
    t1.send(0, tensor_msg(round=1))
    assert t0.recv().round == 1
    assert t0.stats.messages_rejected == 1
    assert "size limit of 1000 bytes" in t0.stats.rejections[0]


@pytest.mark.parametrize("local_ipc", [True, False], ids=["ipc", "tcp"])
def test_single_frame_over_the_size_limit_is_counted_as_rejected(local_ipc):
    net = Network("zmq")
    try:
        t0, t1 = net.open(2, max_message_bytes=1000, local_ipc=local_ipc)
        t1.send(0, Message("gossip", 0, buffers=(torch.zeros(300),)))
        read_until(t0, lambda: t0.stats.messages_rejected, "the oversized message's rejection")
        assert t0.stats.messages_rejected == 1
        reason = t0.stats.rejections[0]
        assert "ZMQ_MAXMSGSIZE" in reason and "last heard from" not in reason, reason
    finally:
        net.close()


def test_oversized_frame_names_the_peer_last_heard_on_that_connection():
    net = Network("zmq")
    try:
        t0, t1 = net.open(2, max_message_bytes=1000)
        t1.send(0, tensor_msg(round=1))
        assert t0.recv().round == 1
        t1.send(0, Message("gossip", 2, buffers=(torch.zeros(300),)))
        read_until(t0, lambda: t0.stats.messages_rejected, "the oversized message's rejection")
        assert "connection to peer 1" in t0.stats.rejections[0]  # its own socket here
    finally:
        net.close()


@pytest.mark.parametrize("local_ipc", [True, False], ids=["ipc", "tcp"])
def test_a_neighbour_that_crashed_is_not_called_an_oversized_frame(local_ipc):
    """A crash closes both directions at once (here: every socket closed without a goodbye,
    as the kernel does for a killed process); the disconnect alone looked like a dropped
    2 GiB frame."""
    net = Network("zmq")
    try:
        t0, t1 = net.open(2, local_ipc=local_ipc)
        t0.send(1, tensor_msg())  # this peer's own link to 1 is up
        t1.recv(src=0)
        t1.send(0, tensor_msg())
        t0.recv(src=1)
        t1.close()
        read_until(t0, lambda: t0.stats.messages_rejected, "peer 1's disconnect to be judged")
        reason = t0.stats.rejections[0]
        assert "peer 1 exited or crashed" in reason and "MAXMSGSIZE" not in reason, reason
    finally:
        net.close()


def test_an_oversized_frame_from_a_peer_still_up_is_named_as_such():
    net = Network("zmq")
    try:
        t0, t1 = net.open(2, max_message_bytes=1000)
        t0.send(1, tensor_msg())
        t1.recv(src=0)
        t1.send(0, tensor_msg(round=1))
        assert t0.recv().round == 1
        t1.send(0, Message("gossip", 2, buffers=(torch.zeros(300),)))
        read_until(t0, lambda: t0.stats.messages_rejected, "the oversized message's rejection")
        reason = t0.stats.rejections[0]
        assert "while peer 1 is still up" in reason and "ZMQ_MAXMSGSIZE" in reason, reason
    finally:
        net.close()


@pytest.mark.parametrize("local_ipc", [True, False], ids=["ipc", "tcp"])
def test_a_peer_leaving_after_its_goodbye_is_not_a_rejection(local_ipc):
    net = Network("zmq")
    try:
        t0, t1, t2 = net.open(3, local_ipc=local_ipc)
        t1.send(0, tensor_msg())
        t2.send(0, tensor_msg())
        t0.recv(src=1)
        t0.recv(src=2)
        t1.shutdown(timeout=0.1, flush=1.0)  # says goodbye to 0, leaves without waiting for 0's
        read_until(t0, lambda: t0.departed == {1}, "peer 1's goodbye")
        with pytest.raises(PeerTimeout):
            t0.recv(timeout=0.2 + monitor.GRACE_S)  # long enough to judge the disconnect
        assert t0.stats.messages_rejected == 0, t0.stats.rejections
        t2.close()  # leaves without a goodbye: it may have died mid-message
        read_until(t0, lambda: t0.stats.messages_rejected, "peer 2's disconnect to be judged")
        assert t0.stats.messages_rejected == 1
        assert "closed without a goodbye" in t0.stats.rejections[0]
        assert "last heard from peer 2" in t0.stats.rejections[0]
    finally:
        net.close()


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_unclaimed_messages_beyond_the_buffer_limit_are_rejected(network):
    t0, t1 = network.open(2, max_pending_bytes=500)
    t1.send(0, Message("gossip", 9, buffers=(torch.zeros(200),)))  # 800 bytes: no room
    t1.send(0, tensor_msg(round=1))
    assert t0.recv(round=1).round == 1
    assert t0.stats.messages_rejected == 1
    assert "buffer full" in t0.stats.rejections[0]
    with pytest.raises(PeerTimeout):
        t0.recv(round=9, timeout=0.1)


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_accept_kinds_extends_the_accepted_set(network):
    t0, t1 = network.open(2, kinds=["a"])
    t1.send(0, tensor_msg("b"))
    t1.send(0, tensor_msg("a"))
    assert t0.recv().kind == "a" and t0.stats.messages_rejected == 1
    t0.accept_kinds(["b"])
    t1.send(0, tensor_msg("b"))
    assert t0.recv().kind == "b" and t0.stats.messages_rejected == 1


# -- timeouts and shutdown ------------------------------------------------------------------


@pytest.mark.parametrize("network", KINDS, indirect=True)
def test_timeout_names_the_peer_and_the_round(network):
    t0, _ = network.open(2, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        t0.recv(src=1, kind="gossip", round=3)
    elapsed = time.monotonic() - start
    # poll() counts whole milliseconds; the slack is a loaded machine's, below the 5 s default.
    assert 0.3 - 0.01 <= elapsed < 0.3 + 4.0
    text = str(info.value)
    assert "rank 0" in text and "peer 1" in text and "round 3" in text and "0.3 s" in text
    with pytest.raises(PeerTimeout, match="any peer for round any within 0.1 s"):
        t0.recv(timeout=0.1)


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_shutdown_exchanges_goodbyes(network):
    t0, t1 = network.open(2)
    t0.send(1, tensor_msg())
    t1.recv(src=0)
    missing = [None, None]

    def close(rank: int) -> None:
        missing[rank] = (t0, t1)[rank].shutdown(timeout=5.0)

    threads = [threading.Thread(target=close, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    assert missing == [set(), set()]
    assert t0.departed == {1} and t1.departed == {0}
    assert t0.stats.messages_recv == 1 and t1.stats.messages_recv == 2  # goodbyes count too


@pytest.mark.parametrize("network", SENDING_KINDS, indirect=True)
def test_shutdown_returns_silent_contacts_after_the_timeout(network):
    t0, t1 = network.open(2)
    t0.send(1, tensor_msg())
    t1.close()  # dies without a goodbye
    start = time.monotonic()
    assert t0.shutdown(timeout=0.3, flush=0.0) == {1}
    assert time.monotonic() - start < 0.3 + 4.0  # a loaded machine's slack, below the 5 s default


# -- ZeroMQ specifics ---------------------------------------------------------------------


def test_shutdown_awaits_no_goodbye_from_a_contact_nothing_ever_listened_for(caplog):
    """A joiner started after the members it asks ended: nothing listens at their
    addresses, so it leaves once that is known (dead_after), not after the whole timeout."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    transport = ZmqTransport(0, endpoints, dead_after=0.3).open()
    transport.send(1, Message(kind="ask", round=0))
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="gossip.transport"):
        assert transport.shutdown(timeout=5.0, flush=0.0) == {1}
    assert time.monotonic() - start < 3.0
    assert "no goodbye" not in caplog.text


@pytest.mark.parametrize("holder", ["zmq", "tcp listener"])
def test_bind_on_an_address_in_use_names_it(holder):
    (port,) = free_ports(1)
    endpoints = [f"tcp://127.0.0.1:{port}"]
    with socket.socket() as listener:
        if holder == "tcp listener":
            listener.bind(("127.0.0.1", port))
            listener.listen()
            busy = None
        else:
            busy = ZmqTransport(0, endpoints).open()
        try:
            with pytest.raises(TransportError, match=f"cannot listen on tcp://127.0.0.1:{port}"):
                ZmqTransport(0, endpoints).open()
        finally:
            if busy is not None:
                busy.close()


def test_close_removes_the_ipc_socket_file():
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    path = Path(local_ipc(endpoint).removeprefix("ipc://"))
    transport = ZmqTransport(0, [endpoint]).open()
    assert path.exists()
    transport.close()
    try:
        assert not path.exists(), f"{path} left behind"
    finally:
        path.unlink(missing_ok=True)


def test_closing_transport_spares_the_ipc_file_of_its_successor():
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    path = Path(local_ipc(endpoints[0]).removeprefix("ipc://"))
    old = ZmqTransport(0, endpoints, timeout=5.0).open()
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.DEALER)  # rank 1's receiving socket, never read: what is sent to
    stuck.setsockopt(zmq.ROUTING_ID, b"1-stuck")  # it stays in the old one's outbox
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.connect(local_ipc(endpoints[0]))
    stuck.send(codec.encode(Message("hello", -1, meta={"endpoint": endpoints[1]}), 1)[0])
    for _ in range(8):
        old.send(1, Message("gossip", 0, buffers=(torch.zeros(1 << 21),)))
    # The successor must open within the old one's linger (flush): seconds, for a loaded machine.
    closing = threading.Thread(target=old.shutdown, kwargs={"timeout": 0.1, "flush": 6.0})
    closing.start()
    successor = None
    try:
        def open_successor() -> ZmqTransport | None:
            try:  # the address is busy until the old one closes its socket, before the linger
                return ZmqTransport(0, endpoints, timeout=2.0).open()
            except TransportError:
                return None

        successor = wait_until(open_successor, 5.0, "the address to come free")
        assert closing.is_alive(), "missed the old one's linger"
        closing.join(10.0)
        with ZmqTransport(1, endpoints, timeout=2.0) as sender:
            sender.send(0, tensor_msg(value=5.0))
            assert path.exists(), "the successor's ipc socket file was removed"
            assert successor.recv(timeout=2.0).meta["value"] == 5.0
    finally:
        closing.join(10.0)
        if successor is not None:
            successor.close()
        ctx.destroy(linger=0)


def test_address_is_free_again_after_close():
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(1)]
    for _ in range(2):
        with ZmqTransport(0, endpoints, timeout=1.0) as transport:
            assert transport.describe(0) == f"peer 0 ({endpoints[0]})"
    transport.close()  # a second close is harmless


def test_rank_without_endpoint_and_unknown_destination_are_transport_errors():
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    with pytest.raises(TransportError, match="rank 2 has no endpoint"):
        ZmqTransport(2, endpoints)
    with pytest.raises(TransportError, match="not open"):
        ZmqTransport(0, endpoints).send(1, tensor_msg())
    with ZmqTransport(0, endpoints, timeout=1.0) as transport:
        with pytest.raises(TransportError, match="no peer 5"):
            transport.send(5, tensor_msg())


@pytest.mark.slow  # each a fresh interpreter importing torch
@pytest.mark.parametrize("setting, wanted", [("1", True), ("0", False)])
def test_malloc_tuning_applies_once_per_process_and_can_be_switched_off(setting, wanted):
    import platform
    import subprocess
    import sys

    tuned = wanted and platform.libc_ver()[0] == "glibc"  # elsewhere mallopt does not exist
    code = ("from gossip.transport.malloc_tuning import keep_freed_buffers as k; "
            "print(k(), k())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "GOSSIP_MALLOC_TUNING": setting})
    assert out.stdout.split() == [str(tuned)] * 2, out.stderr


def test_a_receive_timeout_fires_in_virtual_time_without_waiting():
    """The clock seam: a transport on a virtual clock gives up a receive by advancing its
    clock to the deadline, so a simulator runs timeouts of minutes in no time."""
    import time as real_time

    from gossip.clock import ManualClock

    clock = ManualClock(start=100.0)
    t0 = LoopbackHub(2).transport(0, clock=clock, timeout=60)
    started = real_time.perf_counter()
    with pytest.raises(PeerTimeout, match="within 60 s"):
        t0.recv(src=1, kind="gossip", round=0)
    assert real_time.perf_counter() - started < 30  # not the 60 s
    assert clock.monotonic() == pytest.approx(160.0)
